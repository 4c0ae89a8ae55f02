package main

import (
	"context"
	"fmt"
	"io"
	"path/filepath"

	"github.com/mktrain/mktrain/internal/atomicfile"
	"github.com/mktrain/mktrain/observe/report"
)

const reportUsage = `Usage: mktrain report RUN_DIR [--out FILE.html] [--bench FILE]

Writes one self-contained HTML file about a run (default RUN_DIR/report.html):
the training and validation loss, the load-balancing losses, the learning
rate, the gradient norm, tokens/s, MFU and peak memory over the steps, and
per MoE layer a heat map of each expert's load over the logged steps, with
dead experts (below 0.1 of their fair share of the tokens) and overloaded
ones (above 2 times it), over the last quarter of the logged steps, flagged.
With --bench, a bench train result (bench/results/<machine>/train-*.json),
its time breakdown as a chart too. It reads RUN_DIR/metrics.jsonl and
recipe.yaml; log.every sets how many steps the curves and heat maps have.

Flags:
`

func cmdReport(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("report", reportUsage, stderr)
	out := fs.String("out", "", "the HTML file to write (default RUN_DIR/report.html)")
	bench := fs.String("bench", "", "a bench train result JSON whose time breakdown to chart")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		fs.Usage()
		return usageError{"report takes exactly one run directory"}
	}
	run, err := report.LoadRun(pos[0])
	if err != nil {
		return fmt.Errorf("report: %w", err)
	}
	if *bench != "" {
		if run.Bench, err = report.ReadBench(*bench); err != nil {
			return fmt.Errorf("report: --bench: %w", err)
		}
	}
	if *out == "" {
		*out = filepath.Join(pos[0], "report.html")
	}
	if err := atomicfile.WriteFile(*out, func(w io.Writer) error { return report.Write(w, run) }); err != nil {
		return fmt.Errorf("report: %w", err)
	}
	fmt.Fprintf(stdout, "wrote %s (%d logged steps)\n", *out, len(run.Steps))
	return nil
}
