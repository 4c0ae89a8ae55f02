package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/klauspost/compress/zstd"

	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/checkpoint/safetensors"
	"github.com/mktrain/mktrain/engine"
)

const ckptUsage = `Usage: mktrain ckpt verify DIR
       mktrain ckpt inspect DIR

verify rehashes every file of a checkpoint and compares it with the size and
SHA-256 in its MANIFEST.json. DIR is one checkpoint (a step_* directory), or
a run directory or checkpoints root, whose checkpoints are all verified. It
prints OK or FAIL per checkpoint and fails naming each bad file, and each
step directory without MANIFEST.json (damage: a save never leaves one).

inspect prints what a checkpoint holds: its step, tokens, the mktrain version
and mesh that wrote it, the recipe hash, every tensor with its dtype, shape
and file, the files and their total size, and the recipe snapshot. DIR is a
checkpoint, or a run directory or checkpoints root (its latest checkpoint).

`

func cmdCkpt(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, ckptUsage)
		return usageError{"ckpt takes the subcommand verify or inspect"}
	}
	switch args[0] {
	case "-h", "--h", "-help", "--help", "help":
		fmt.Fprint(stdout, ckptUsage)
		return errHelp
	case "verify", "inspect":
	default:
		fmt.Fprint(stderr, ckptUsage)
		return usageError{fmt.Sprintf("ckpt: unknown subcommand %q; want verify or inspect", args[0])}
	}
	fs := newFlagSet("ckpt "+args[0], ckptUsage, stderr)
	fs.Usage = func() { fmt.Fprint(fs.Output(), ckptUsage) }
	pos, err := parseInterspersed(fs, args[1:])
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		fs.Usage()
		return usageError{fmt.Sprintf("ckpt %s takes exactly one directory", args[0])}
	}
	if args[0] == "verify" {
		return ckptVerify(ctx, pos[0], stdout)
	}
	return ckptInspect(pos[0], stdout)
}

// checkpointDirs lists the checkpoints DIR stands for: itself when it is
// one, else every checkpoint under it, oldest first. Step directories
// without MANIFEST.json are listed too, for verify to fail on.
func checkpointDirs(dir string) ([]string, error) {
	if engine.IsCheckpointDir(dir) {
		return []string{dir}, nil
	}
	if err := checkExists(dir); err != nil {
		return nil, err
	}
	root := engine.CheckpointsRoot(dir)
	infos, err := checkpoint.List(root)
	if err != nil {
		return nil, err
	}
	incomplete, err := checkpoint.ListIncomplete(root)
	if err != nil {
		return nil, err
	}
	infos = append(infos, incomplete...)
	slices.SortStableFunc(infos, func(a, b checkpoint.Info) int { return b.Step - a.Step })
	if len(infos) == 0 {
		return nil, fmt.Errorf("%s holds no checkpoint: it is not a step directory (no MANIFEST.json), and neither it nor %s has step_* directories",
			dir, filepath.Join(dir, "checkpoints"))
	}
	dirs := make([]string, len(infos))
	for i, info := range infos {
		dirs[len(infos)-1-i] = info.Dir
	}
	return dirs, nil
}

func ckptVerify(ctx context.Context, dir string, stdout io.Writer) error {
	dirs, err := checkpointDirs(dir)
	if err != nil {
		return err
	}
	var bad []error
	for _, d := range dirs {
		if err := checkpoint.VerifyContext(ctx, d); err != nil {
			if ctx.Err() != nil {
				return stoppedError(ctx, fmt.Sprintf("verification of %s stopped", d))
			}
			fmt.Fprintf(stdout, "FAIL %s\n", d)
			bad = append(bad, err)
			continue
		}
		m, err := checkpoint.ReadManifest(d)
		if err != nil {
			return err
		}
		var total int64
		for _, f := range m.Files {
			total += f.Size
		}
		fmt.Fprintf(stdout, "OK   %s (step %d, %d files, %s)\n", d, m.Step, len(m.Files), sizeText(total))
	}
	if len(bad) > 0 {
		return fmt.Errorf("%d of %d checkpoints failed verification:\n%w", len(bad), len(dirs), errors.Join(bad...))
	}
	return nil
}

func ckptInspect(dir string, stdout io.Writer) error {
	ckDir := dir
	if !engine.IsCheckpointDir(dir) {
		if err := checkExists(dir); err != nil {
			return err
		}
		d, err := checkpoint.Latest(engine.CheckpointsRoot(dir))
		if err != nil {
			return fmt.Errorf("%s: %w", dir, err)
		}
		ckDir = d
	}
	info, err := engine.ReadCheckpointInfo(ckDir)
	if err != nil {
		return err
	}
	man, err := checkpoint.ReadManifest(ckDir)
	if err != nil {
		return err
	}
	m := info.Config.Model
	w := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(w, "checkpoint\t%s\n", ckDir)
	fmt.Fprintf(w, "step\t%d\n", info.Step)
	fmt.Fprintf(w, "tokens\t%d\n", info.Tokens)
	fmt.Fprintf(w, "learning rate\t%.4g\n", info.LR)
	fmt.Fprintf(w, "saved\t%s by mktrain %s on %s\n", info.SavedAt.Format("2006-01-02 15:04:05 MST"), info.Version, info.Backend)
	fmt.Fprintf(w, "mesh\tdp=%d ep=%d cp=%d tp=%d\n", info.Mesh.DP, info.Mesh.EP, info.Mesh.CP, info.Mesh.TP)
	fmt.Fprintf(w, "recipe hash\t%s\n", orNone(info.RecipeHash))
	tokenizer := "byte-level (none)"
	if info.TokenizerSHA256 != "" {
		tokenizer = "tokenizer.json, sha256 " + info.TokenizerSHA256
	}
	fmt.Fprintf(w, "tokenizer\t%s\n", tokenizer)
	fmt.Fprintf(w, "model\t%d parameters: vocab %d, dim %d, %d layers, %d heads (%d kv), %d experts top-%d, ffn %d\n",
		engine.ParamCount(m), m.Vocab, m.Dim, m.Layers, m.Heads, m.KVHeads, m.MoE.Experts, m.MoE.TopK, m.MoE.FFN)
	var total int64
	for _, f := range man.Files {
		total += f.Size
	}
	fmt.Fprintf(w, "files\t%d, %s\n", len(man.Files), sizeText(total))
	if err := w.Flush(); err != nil {
		return err
	}
	w = tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	for _, f := range man.Files {
		fmt.Fprintf(w, "  %s\t%s\tsha256 %s\n", f.Name, sizeText(f.Size), f.SHA256[:16])
	}
	fmt.Fprintln(w, "\ntensors\tdtype\tshape\tfile")
	for _, f := range man.Files {
		if !strings.Contains(f.Name, ".safetensors") {
			continue
		}
		h, err := readTensorHeader(filepath.Join(ckDir, f.Name))
		if err != nil {
			return err
		}
		names := h.Names()
		slices.Sort(names)
		for _, name := range names {
			t, _ := h.Lookup(name)
			fmt.Fprintf(w, "  %s\t%s\t%v\t%s\n", name, t.DType, t.Shape, f.Name)
		}
	}
	if err := w.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(stdout, "\nrecipe")
	if info.Recipe == "" {
		fmt.Fprintln(stdout, "  (no snapshot: the run was started from the Go API)")
		return nil
	}
	for _, line := range strings.Split(strings.TrimRight(info.Recipe, "\n"), "\n") {
		fmt.Fprintln(stdout, "  "+line)
	}
	return nil
}

func checkExists(dir string) error {
	_, err := os.Stat(dir)
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("%s does not exist", dir)
	}
	return err
}

// readTensorHeader parses the header of a safetensors file, decompressing
// a .zst file as far as its header.
func readTensorHeader(path string) (*safetensors.Header, error) {
	if !strings.HasSuffix(path, ".zst") {
		f, err := safetensors.Open(path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		return f.Header(), nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	dec, err := zstd.NewReader(f, zstd.WithDecoderConcurrency(1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	defer dec.Close()
	return safetensors.ReadHeader(path, dec)
}

// sizeText is a byte count for people: "3075037 bytes (2.9 MiB)".
func sizeText(n int64) string {
	units := []string{"KiB", "MiB", "GiB", "TiB"}
	v, unit := float64(n), ""
	for _, u := range units {
		if v < 1024 {
			break
		}
		v, unit = v/1024, u
	}
	if unit == "" {
		return fmt.Sprintf("%d bytes", n)
	}
	return fmt.Sprintf("%d bytes (%.1f %s)", n, v, unit)
}

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}

// requireFlag reports a missing required flag as a usage error.
func requireFlag(fs *flag.FlagSet, name, value string) error {
	if value == "" {
		fs.Usage()
		return usageError{fmt.Sprintf("%s needs --%s", fs.Name(), name)}
	}
	return nil
}
