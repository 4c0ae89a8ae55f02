package main

import (
	"strings"
	"testing"
)

// TestBenchMoE runs bench moe on the CPU with the tiny shape at worlds 1, 2
// and 3 (3 does not divide 4 experts: skipped with a message) and checks
// the JSON rows: every phase timed, the step slower than the forward.
func TestBenchMoE(t *testing.T) {
	dir := t.TempDir()
	code, stdout, stderr := runCLI(t, "bench", "moe", "--shape", "tiny", "--world", "1,2,3", "--steps", "2", "--warmup", "1",
		"--backend", "cpu", "--out", dir)
	if code != exitOK {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	if !strings.Contains(stderr, "skipping world 3") {
		t.Errorf("stderr does not say world 3 was skipped:\n%s", stderr)
	}
	if !strings.Contains(stdout, "e.bwd") || !strings.Contains(stdout, "tiny ") {
		t.Errorf("no table on stdout:\n%s", stdout)
	}
	var res struct {
		Commit  string `json:"commit"`
		Figures struct {
			Rows   []moeBenchRow `json:"rows"`
			Phases []string      `json:"phases"`
		} `json:"figures"`
	}
	readResult(t, dir, "moe.json", &res)
	if res.Commit == "" {
		t.Error("no commit in the result")
	}
	rows := res.Figures.Rows
	if len(rows) != 2 || rows[0].World != 1 || rows[1].World != 2 {
		t.Fatalf("rows %+v, want worlds 1 and 2", rows)
	}
	if len(res.Figures.Phases) != 9 {
		t.Errorf("phases %v", res.Figures.Phases)
	}
	for _, r := range rows {
		if r.ForwardMS <= 0 || r.StepMS <= 0 || r.ExpertTF <= 0 || r.TokensRank != 64 {
			t.Errorf("world %d: %+v", r.World, r)
		}
		sum := 0.0
		for _, ph := range res.Figures.Phases {
			ms, ok := r.PhasesMS[ph]
			if !ok || ms < 0 {
				t.Errorf("world %d: phase %q: %v (present %v)", r.World, ph, ms, ok)
			}
			sum += ms
		}
		// Experts do most of the work; every phase boundary was seen.
		if r.PhasesMS["experts"] <= 0 || r.PhasesMS["experts backward"] <= 0 || sum <= 0 || sum-r.PhasedMS > 1e-9 || r.PhasedMS-sum > 1e-9 {
			t.Errorf("world %d: phases %v, sum %v, phased %v", r.World, r.PhasesMS, sum, r.PhasedMS)
		}
	}
}

func TestBenchMoEErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--shape", "huge"}, `unknown shape "huge"`},
		{[]string{"--world", "0"}, `"0" is not a positive number of ranks`},
		{[]string{"--backend", "tpu"}, `"tpu" is not auto, cpu or cuda`},
		{[]string{"--steps", "0"}, "--steps must be positive"},
	} {
		code, _, stderr := runCLI(t, append([]string{"bench", "moe", "--shape", "tiny", "--backend", "cpu"}, c.args...)...)
		if code == exitOK || !strings.Contains(stderr, c.want) {
			t.Errorf("%v: exit %d, stderr %q, want an error containing %q", c.args, code, stderr, c.want)
		}
	}
}
