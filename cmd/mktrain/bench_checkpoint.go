package main

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/checkpoint/safetensors"
	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/recipes"
)

const benchCheckpointUsage = `Usage: mktrain bench checkpoint [RECIPE] [--set k=v]... [--dir DIR] [--out DIR]

Measures checkpoint save and load for the full training state of RECIPE's
model (default moe-small): fp32 weights and both AdamW moments, as one rank
writes them, once with the moments uncompressed and once with zstd. Save
time includes fsync and the atomic rename; load time reads every tensor
back (from the page cache when the machine has the memory). Writes
checkpoint-<recipe>.json into bench/results/cpu/ (it uses no backend; the
latest result, overwritten by the next run) or into the folder --out
names.

Flags:
`

func cmdBenchCheckpoint(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench checkpoint", benchCheckpointUsage, stderr)
	var sets setFlags
	fs.Var(&sets, "set", "override a recipe field (repeatable), e.g. --set model.layers=2")
	scratch := fs.String("dir", "", "where the checkpoints are written (default a temporary directory)")
	out := fs.String("out", "", "directory for the JSON result (default bench/results/cpu)")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	recipe := "moe-small"
	if len(pos) > 1 {
		return usageError{"bench checkpoint takes at most one recipe"}
	} else if len(pos) == 1 {
		recipe = pos[0]
	}
	cfg, _, err := recipes.Load(recipe, sets)
	if err != nil {
		return err
	}
	if *scratch == "" {
		if *scratch, err = os.MkdirTemp("", "mktrain-bench-"); err != nil {
			return err
		}
		defer os.RemoveAll(*scratch)
	}

	shapes := engine.ParamShapes(cfg.Model)
	fmt.Fprintf(stderr, "bench: %d tensors, %d parameters; filling state\n", len(shapes), engine.ParamCount(cfg.Model))
	model, optim := benchState(shapes, cfg.Train.Seed)
	figures := map[string]any{"params": engine.ParamCount(cfg.Model), "tensors": len(shapes)}
	fmt.Fprintf(stdout, "%-10s %10s %10s %12s %12s\n", "moments", "save s", "load s", "bytes", "save MB/s")
	variants := []string{"none", "zstd"}
	for vi, compress := range variants {
		if err := ctx.Err(); err != nil {
			return stoppedError(ctx, "bench checkpoint stopped")
		}
		root := filepath.Join(*scratch, compress)
		t0 := time.Now()
		sv, err := checkpoint.BeginSave(root, 1)
		if err != nil {
			return err
		}
		if err := sv.WriteTensors(checkpoint.ModelFile(0), model, checkpoint.TensorOptions{DType: safetensors.F32}); err != nil {
			sv.Abort()
			return err
		}
		if err := sv.WriteTensors(checkpoint.OptimFile(0), optim, checkpoint.TensorOptions{DType: safetensors.F32, Compress: compress == "zstd"}); err != nil {
			sv.Abort()
			return err
		}
		if err := sv.WriteState(map[string]int{"step": 1}); err != nil {
			sv.Abort()
			return err
		}
		if err := sv.Commit(); err != nil {
			return err
		}
		save := time.Since(t0)
		if vi == len(variants)-1 {
			// Loading needs the memory the state held.
			model, optim = nil, nil
			runtime.GC()
		}
		manifest, err := checkpoint.ReadManifest(sv.Dir())
		if err != nil {
			return err
		}
		var bytes int64
		for _, f := range manifest.Files {
			bytes += f.Size
		}

		t0 = time.Now()
		ck, err := checkpoint.Open(sv.Dir())
		if err != nil {
			return err
		}
		for _, set := range []*checkpoint.TensorSet{ck.Model(), ck.Optim()} {
			for _, name := range set.Names() {
				if _, _, err := set.Tensor(name); err != nil {
					ck.Close()
					return err
				}
			}
		}
		ck.Close()
		load := time.Since(t0)
		figures[compress] = map[string]any{"save_s": save.Seconds(), "load_s": load.Seconds(), "bytes": bytes,
			"save_MB_per_s": float64(bytes) / 1e6 / save.Seconds(), "load_MB_per_s": float64(bytes) / 1e6 / load.Seconds()}
		fmt.Fprintf(stdout, "%-10s %10.2f %10.2f %12d %12.0f\n", compress, save.Seconds(), load.Seconds(), bytes, float64(bytes)/1e6/save.Seconds())
		if err := os.RemoveAll(root); err != nil {
			return err
		}
	}
	return writeBenchResult(stdout, *out, "checkpoint", recipe, "", cfg, "mktrain bench checkpoint "+strings.Join(args, " "), figures)
}

// benchState makes training-like state: weights N(0, 0.02), first moments
// N(0, 1e-3), second moments their squares scaled, as AdamW leaves them.
func benchState(shapes []engine.NamedShape, seed uint64) (model, optim []checkpoint.NamedTensor) {
	rng := rand.New(rand.NewPCG(seed, 42))
	for _, s := range shapes {
		n := 1
		for _, d := range s.Shape {
			n *= d
		}
		w, m, v := make([]float32, n), make([]float32, n), make([]float32, n)
		for i := range w {
			w[i] = float32(rng.NormFloat64() * 0.02)
			m[i] = float32(rng.NormFloat64() * 1e-3)
			v[i] = m[i] * m[i] * 0.5
		}
		model = append(model, checkpoint.NamedTensor{Name: s.Name, Shape: s.Shape, Data: w})
		optim = append(optim,
			checkpoint.NamedTensor{Name: s.Name + ".exp_avg", Shape: s.Shape, Data: m},
			checkpoint.NamedTensor{Name: s.Name + ".exp_avg_sq", Shape: s.Shape, Data: v})
	}
	return model, optim
}
