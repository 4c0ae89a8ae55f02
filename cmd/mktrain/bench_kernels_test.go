package main

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/moe"
	"github.com/mktrain/mktrain/tune"
)

// TestBenchKernels runs bench kernels on the CPU with the tiny shape at
// worlds 1, 2 and 3 (3 does not divide 4 experts: skipped) and checks the
// JSON rows (times, rates and ratios consistent, every token's top-k rows
// routed) and the dispatch table it leaves: one entry per row, the row's
// choice.
func TestBenchKernels(t *testing.T) {
	dir, cache := t.TempDir(), t.TempDir()
	t.Setenv("MKTRAIN_CACHE_DIR", cache)
	code, stdout, stderr := runCLI(t, "bench", "kernels", "--shape", "tiny", "--world", "1,2,3", "--iters", "2",
		"--backend", "cpu", "--out", dir)
	if code != exitOK {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	if !strings.Contains(stderr, "skipping world 3") {
		t.Errorf("stderr does not say world 3 was skipped:\n%s", stderr)
	}
	table := filepath.Join(cache, "dispatch.json")
	if !strings.Contains(stdout, "f/gemm") || !strings.Contains(stdout, "tiny ") || !strings.Contains(stdout, table) {
		t.Errorf("no table on stdout, or no word of the dispatch table:\n%s", stdout)
	}
	var res struct {
		Commit  string `json:"commit"`
		Command string `json:"command"`
		Figures struct {
			Rows  []kernelBenchRow `json:"rows"`
			Bars  []string         `json:"bars"`
			Table string           `json:"dispatch_table"`
		} `json:"figures"`
	}
	readResult(t, dir, "kernels.json", &res)
	if res.Commit == "" || !strings.HasPrefix(res.Command, "mktrain bench kernels ") {
		t.Errorf("commit %q, command %q", res.Commit, res.Command)
	}
	if len(res.Figures.Bars) != 2 || res.Figures.Table != table {
		t.Errorf("bars %q, table %q", res.Figures.Bars, res.Figures.Table)
	}
	rows := res.Figures.Rows
	if len(rows) != 2 || rows[0].World != 1 || rows[1].World != 2 {
		t.Fatalf("rows %+v, want worlds 1 and 2", rows)
	}
	near := func(a, b float64) bool { return a > 0 && b > 0 && (a-b)/b < 1e-9 && (b-a)/b < 1e-9 }
	b := cpu.New(backend.Float32)
	for _, r := range rows {
		if r.Shape != "tiny" || r.TokensRank != 64 || r.Rows != 64*2*r.World {
			t.Errorf("world %d: %+v", r.World, r)
		}
		for _, ms := range []float64{r.GEMMMS, r.FusedKernelsMS, r.FusedBlockMS, r.FusedForwardMS, r.UnfusedForwardMS, r.FusedStepMS, r.UnfusedStepMS} {
			if ms <= 0 {
				t.Errorf("world %d: a time is not positive: %+v", r.World, r)
			}
		}
		// Rates are the products' FLOPs over the times; the ratios and
		// bars follow from the times.
		fwdTF := 6 * float64(r.Rows) * 32 * 48 / (r.FusedForwardMS / 1e3) / 1e12
		if !near(r.FusedForwardTF, fwdTF) || !near(r.FusedStepTF*r.FusedStepMS, 3*r.FusedForwardTF*r.FusedForwardMS) ||
			!near(r.GEMMTF*r.GEMMMS, r.FusedForwardTF*r.FusedForwardMS) {
			t.Errorf("world %d: rates %+v", r.World, r)
		}
		if !near(r.FusedOverGEMM, r.FusedForwardMS/r.GEMMMS) || !near(r.FusedOverUnfused, r.FusedStepMS/r.UnfusedStepMS) ||
			!near(r.FusedBlockOverGEMM, r.FusedBlockMS/r.GEMMMS) || !near(r.FusedKernelsOverGEMM, r.FusedKernelsMS/r.GEMMMS) || r.GEMMBarHeld != (r.FusedBlockOverGEMM <= gemmBarRatio) || r.UnfusedBarHeld != (r.FusedStepMS < r.UnfusedStepMS) {
			t.Errorf("world %d: ratios and bars %+v", r.World, r)
		}
		key := tune.NewDispatchKey(b, moe.Config{Experts: 4, TopK: 2, FFN: 48}, 32, 64, r.World)
		e, ok, err := tune.DispatchCache{Path: table}.Lookup(key)
		if err != nil || !ok || e.Choice != r.Choice || !near(e.FusedMS, r.FusedStepMS) {
			t.Errorf("world %d: table entry %+v, %v, %v; row %+v", r.World, e, ok, err, r)
		}
	}
}

func TestBenchKernelsErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--shape", "huge"}, `unknown shape "huge"`},
		{[]string{"--world", "x"}, `"x" is not a positive number of ranks`},
		{[]string{"--backend", "tpu"}, `"tpu" is not auto, cpu or cuda`},
		{[]string{"--iters", "0"}, "--iters must be positive"},
		{[]string{"extra"}, "no positional arguments"},
		{[]string{"--gpus"}, "--gpus needs the cuda backend; this one is cpu"},
	} {
		code, _, stderr := runCLI(t, append([]string{"bench", "kernels", "--shape", "tiny", "--backend", "cpu"}, c.args...)...)
		if code == exitOK || !strings.Contains(stderr, c.want) {
			t.Errorf("%v: exit %d, stderr %q, want an error containing %q", c.args, code, stderr, c.want)
		}
	}
}

// benchExpertsAlone on ranks with backends of their own (as --gpus
// places them) runs each rank's work from its goroutine and times both
// parts; the virtual ranks of one backend queue theirs in turn. A row
// count per expert that does not match the shape is an error.
func TestBenchExpertsAloneOnOwnBackends(t *testing.T) {
	var tiny moeBenchShape
	for _, s := range kernelBenchShapes() {
		if s.Name == "tiny" {
			tiny = s
		}
	}
	one := cpu.New(backend.Float32)
	rows := []int{40, 30, 0, 58} // an empty expert too
	for _, bs := range [][]backend.Backend{
		{one, one},
		{cpu.New(backend.Float32), cpu.New(backend.Float32)},
	} {
		a, err := benchExpertsAlone(bs, tiny, rows, 2)
		if err != nil {
			t.Fatalf("%d distinct backends: %v", len(distinctBackends(bs)), err)
		}
		if a.gemm <= 0 || a.kernels <= 0 || a.gemmB2B <= 0 || a.kernelsB2B <= 0 {
			t.Errorf("%d distinct backends: %+v, want every time > 0", len(distinctBackends(bs)), a)
		}
	}
	if _, err := benchExpertsAlone([]backend.Backend{one}, tiny, rows[:3], 1); err == nil || !strings.Contains(err.Error(), "3 expert row counts for 4 experts") {
		t.Errorf("short row counts: %v", err)
	}
}
