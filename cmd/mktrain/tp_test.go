package main

import (
	"encoding/json"
	"math"
	"path/filepath"
	"strings"
	"testing"
)

// TestRunTensorParallelFromFlags: --set parallel.tp=2 trains the tiny
// recipe on two tensor-parallel ranks with the losses of one rank (with
// sequence parallelism on and off, and under parallel.tp_overlap fused and
// unfused, which the log names); `mktrain eval` of the tp 2 checkpoint
// gives the tp 1 checkpoint's loss and `mktrain export` writes it; a tp
// the heads cannot split is refused naming both fields.
func TestRunTensorParallelFromFlags(t *testing.T) {
	type run struct {
		losses map[int]float64
		eval   float64
	}
	runs := map[string]run{}
	tpRuns := []string{"parallel.tp=2", "parallel.sequence_parallel=false", "parallel.tp_overlap=fused", "parallel.tp_overlap=unfused"}
	for _, set := range append([]string{"parallel.tp=1"}, tpRuns...) {
		dir := t.TempDir()
		args := append([]string{"run", "tiny", "--run-dir", dir}, quick...)
		if set != "parallel.tp=1" && set != "parallel.tp=2" {
			args = append(args, "--set", "parallel.tp=2")
		}
		code, _, stderr := runCLI(t, append(args, "--set", set)...)
		if code != exitOK {
			t.Fatalf("%s: exit %d\n%s", set, code, stderr)
		}
		if overlap, ok := strings.CutPrefix(set, "parallel.tp_overlap="); ok && !strings.Contains(stderr, "tensor parallelism runs "+overlap) {
			t.Errorf("%s: the log does not say which path runs:\n%s", set, stderr)
		}
		code, stdout, stderr := runCLI(t, "eval", "--checkpoint", dir, "--batches", "1", "--json")
		var got evalJSON
		if code != exitOK || json.Unmarshal([]byte(stdout), &got) != nil {
			t.Fatalf("%s: eval: exit %d %q\n%s", set, code, stdout, stderr)
		}
		runs[set] = run{losses: stepLosses(t, dir), eval: got.Loss}
		if set == "parallel.tp=2" {
			out := filepath.Join(t.TempDir(), "hf")
			if code, stdout, stderr := runCLI(t, "export", "--format", "hf", "--dtype", "fp32", dir, out); code != exitOK || !strings.Contains(stdout, "exported step 2") {
				t.Errorf("export of the tp 2 run: exit %d\n%s%s", code, stdout, stderr)
			}
		}
	}
	want := runs["parallel.tp=1"]
	if len(want.losses) == 0 {
		t.Fatal("no steps logged")
	}
	for _, set := range tpRuns {
		got := runs[set]
		for step, w := range want.losses {
			if g, ok := got.losses[step]; !ok || !(math.Abs(g-w) <= 1e-4) {
				t.Errorf("%s, step %d: loss %v (logged %v), %v with tp 1", set, step, g, ok, w)
			}
		}
		if !(math.Abs(got.eval-want.eval) <= 1e-4) {
			t.Errorf("%s: eval loss %v, %v with tp 1", set, got.eval, want.eval)
		}
	}

	args := append([]string{"run", "tiny", "--run-dir", t.TempDir()}, quick...)
	code, _, stderr := runCLI(t, append(args, "--set", "parallel.tp=3")...)
	if code != exitFailure || !strings.Contains(stderr, "parallel.tp") || !strings.Contains(stderr, "model.heads") {
		t.Errorf("parallel.tp=3: exit %d, want %d and an error naming parallel.tp and model.heads:\n%s", code, exitFailure, stderr)
	}
}
