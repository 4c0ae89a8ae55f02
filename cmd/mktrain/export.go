package main

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/hf"
	"github.com/mktrain/mktrain/infer"
)

const exportUsage = `Usage: mktrain export [--format hf] [--dtype bf16|fp32] CKPT OUT

Writes a checkpoint's model as a Hugging Face Mixtral directory,
OUT/config.json and OUT/model.safetensors, which transformers loads with
MixtralForCausalLM.from_pretrained(OUT). When the run had a tokenizer
(data.tokenizer), OUT/tokenizer.json and OUT/tokenizer_config.json hold it,
and AutoTokenizer.from_pretrained(OUT) loads it. CKPT is a checkpoint (a step_*
directory), or a run directory or checkpoints root (its newest checkpoint
that verifies); its checksums are verified first. OUT must not exist, or be
empty; it appears complete or not at all.

Mixtral has no shared experts and routes without an expert bias, so models
trained with model.moe.shared_experts or bias_update_rate are refused. Export
fp32 to compare losses with transformers exactly (scripts/hf_check.py).

Flags:
`

func cmdExport(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("export", exportUsage, stderr)
	format := fs.String("format", "hf", "output format: hf (Hugging Face Mixtral)")
	dtype := fs.String("dtype", "bf16", "tensor dtype: bf16 or fp32")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 2 {
		fs.Usage()
		return usageError{"export takes a checkpoint and an output directory"}
	}
	if *format != "hf" {
		return usageError{fmt.Sprintf("--format %q: the only format is hf", *format)}
	}
	if *dtype != "bf16" && *dtype != "fp32" {
		return usageError{fmt.Sprintf("--dtype %q: want bf16 or fp32", *dtype)}
	}
	ckDir := pos[0]
	if !engine.IsCheckpointDir(ckDir) {
		ckDir, err = engine.ResolveCheckpointContext(ctx, ckDir, func(msg string) { fmt.Fprintln(stderr, "mktrain: warning:", msg) })
		if err != nil {
			return err
		}
	}
	if ctx.Err() != nil {
		return stoppedError(ctx, "export stopped before writing "+pos[1])
	}
	info, err := engine.ReadCheckpointInfo(ckDir)
	if err != nil {
		return err
	}
	if err := infer.ExportHF(ctx, ckDir, pos[1], *dtype); err != nil {
		return err
	}
	if cf := info.Config.Model.MoE.CapacityFactor; cf > 0 {
		fmt.Fprintf(stderr, "mktrain: note: the model was trained with model.moe.capacity_factor %g; transformers routes without a capacity, so its outputs differ wherever tokens were dropped\n", cf)
	}
	files := []string{filepath.Join(pos[1], hf.ConfigFile), filepath.Join(pos[1], hf.WeightsFile)}
	if info.TokenizerSHA256 != "" {
		files = append(files, filepath.Join(pos[1], hf.TokenizerFile), filepath.Join(pos[1], hf.TokenizerConfigFile))
	}
	fmt.Fprintf(stdout, "exported step %d of %s to %s (%s): %s\n", info.Step, ckDir, pos[1], *dtype, strings.Join(files, ", "))
	return nil
}
