package main

import (
	"bufio"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// stepLosses reads the loss of every step logged in a run directory's
// metrics.jsonl.
func stepLosses(t *testing.T, dir string) map[int]float64 {
	t.Helper()
	f, err := os.Open(filepath.Join(dir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[int]float64{}
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var line struct {
			Step int     `json:"step"`
			Loss float64 `json:"loss"`
		}
		if err := json.Unmarshal(sc.Bytes(), &line); err != nil {
			t.Fatalf("metrics.jsonl: %v", err)
		}
		out[line.Step] = line.Loss
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestRunContextParallelFromFlags: --set parallel.cp=2 trains the tiny
// recipe on two context-parallel ranks with the losses of one rank, and a
// train.seq that cp cannot split is refused naming both fields.
func TestRunContextParallelFromFlags(t *testing.T) {
	losses := map[string]map[int]float64{}
	for _, cp := range []string{"1", "2"} {
		dir := t.TempDir()
		args := append([]string{"run", "tiny", "--run-dir", dir}, quick...)
		args = append(args, "--set", "parallel.cp="+cp)
		code, _, stderr := runCLI(t, args...)
		if code != exitOK {
			t.Fatalf("parallel.cp=%s: exit %d\n%s", cp, code, stderr)
		}
		losses[cp] = stepLosses(t, dir)
	}
	if len(losses["1"]) == 0 {
		t.Fatal("no steps logged")
	}
	for step, want := range losses["1"] {
		got, ok := losses["2"][step]
		// metrics.jsonl keeps the loss unrounded; the two runs sum in other orders.
		if !ok || !(math.Abs(got-want) <= 2e-4*want) {
			t.Errorf("step %d: loss %v with cp=2 (logged %v), %v with cp=1", step, got, ok, want)
		}
	}

	args := append([]string{"run", "tiny", "--run-dir", t.TempDir()}, quick...)
	code, _, stderr := runCLI(t, append(args, "--set", "parallel.cp=3")...)
	if code != exitFailure || !strings.Contains(stderr, "train.seq") || !strings.Contains(stderr, "parallel.cp") {
		t.Errorf("parallel.cp=3 with train.seq=16: exit %d, want %d and an error naming train.seq and parallel.cp:\n%s", code, exitFailure, stderr)
	}
}
