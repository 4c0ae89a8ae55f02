package main

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend/profile"
	"github.com/mktrain/mktrain/recipes"
)

// readBench runs bench train on the quick tiny recipe and returns its
// stdout and the JSON figures it wrote.
func readBench(t *testing.T, extra ...string) (string, map[string]any) {
	t.Helper()
	dir := t.TempDir()
	args := append([]string{"bench", "train", "tiny", "--steps", "2", "--warmup", "1", "--out", dir}, quick...)
	code, stdout, stderr := runCLI(t, append(args, extra...)...)
	if code != exitOK {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	var res struct {
		Figures map[string]any `json:"figures"`
	}
	readResult(t, dir, "train-tiny-*.json", &res)
	return stdout, res.Figures
}

// readResult decodes the one benchmark result in dir whose name matches
// pattern into v.
func readResult(t *testing.T, dir, pattern string, v any) {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, pattern))
	if err != nil || len(files) != 1 {
		t.Fatalf("result files %v (%v)", files, err)
	}
	buf, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(buf, v); err != nil {
		t.Fatal(err)
	}
}

func TestBenchTrainProfile(t *testing.T) {
	stdout, fig := readBench(t)
	if fig["measured_steps"] != 2.0 {
		t.Errorf("measured_steps %v, want 2", fig["measured_steps"])
	}
	if v, ok := fig["mfu"]; !ok || v != nil {
		t.Errorf("mfu on the CPU is %v (present %v), want null", v, ok)
	}
	// auto settles to unfused on the CPU, where both run the same ops.
	if fig["moe_dispatcher"] != "unfused" || !strings.Contains(stdout, "unfused") {
		t.Errorf("moe_dispatcher %v, want unfused in the figures and the table:\n%s", fig["moe_dispatcher"], stdout)
	}
	if v, _ := fig["peak_memory_bytes"].(float64); v <= 0 {
		t.Errorf("peak_memory_bytes %v", fig["peak_memory_bytes"])
	}
	wall, _ := fig["profiled_step_ms"].(float64)
	if wall <= 0 {
		t.Fatalf("profiled_step_ms %v", fig["profiled_step_ms"])
	}
	rows, _ := fig["breakdown"].([]any)
	shares, ms := 0.0, 0.0
	kinds := map[string]bool{}
	for _, r := range rows {
		row := r.(map[string]any)
		kind, _ := row["kind"].(string)
		share, _ := row["share"].(float64)
		rowMS, _ := row["ms"].(float64)
		ops, _ := row["ops"].(float64)
		if share < 0 || rowMS < 0 || (kind != profile.KindHostGaps && ops < 1) {
			t.Errorf("breakdown row %v", row)
		}
		if kinds[kind] {
			t.Errorf("kind %q listed twice", kind)
		}
		kinds[kind] = true
		shares += share
		ms += rowMS
	}
	if math.Abs(shares-1) > 1e-9 {
		t.Errorf("shares add up to %v:\n%s", shares, stdout)
	}
	// The kinds cover the whole step: their sum is the profiled step's
	// wall time, or the op time when that is larger.
	if ms < wall*(1-1e-9) {
		t.Errorf("breakdown sums to %.3f ms, the profiled step took %.3f ms", ms, wall)
	}
	for _, k := range []string{profile.KindAttention, profile.KindExpertGEMM, profile.KindDenseGEMM, profile.KindDispatch,
		profile.KindRouter, profile.KindElementwise, profile.KindLoss, profile.KindOptimizer, profile.KindTransfers, profile.KindHostGaps} {
		if !kinds[k] {
			t.Errorf("breakdown lacks %q: %v", k, rows)
		}
		if !strings.Contains(stdout, k) {
			t.Errorf("the printed table lacks %q:\n%s", k, stdout)
		}
	}
	if !strings.Contains(stdout, "where the time goes") {
		t.Errorf("no breakdown table:\n%s", stdout)
	}
}

func TestBenchTrainWithoutProfile(t *testing.T) {
	stdout, fig := readBench(t, "--profile=false", "--set", "model.moe.dispatcher=fused")
	if fig["moe_dispatcher"] != "fused" {
		t.Errorf("moe_dispatcher %v, want fused as the recipe says", fig["moe_dispatcher"])
	}
	if _, ok := fig["breakdown"]; ok || strings.Contains(stdout, "where the time goes") {
		t.Errorf("--profile=false still profiled:\n%s", stdout)
	}
	if fig["measured_steps"] != 2.0 || fig["flops_per_token"] == nil {
		t.Errorf("figures %v", fig)
	}
}

// TestModelFLOPsPerToken checks the count on the tiny recipe, worked out
// by hand: 254784 parameters, of which 140096 active (less 2 layers x 2
// unvisited experts x 3*64*128, less the 256 x 64 embedding), so
// 6*140096 + 6*2*64*16 at seq 16.
func TestModelFLOPsPerToken(t *testing.T) {
	cfg, _, err := recipes.Load("tiny", nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := modelFLOPsPerToken(cfg.Model, 16), 6.0*140096+6*2*64*16; got != want {
		t.Errorf("modelFLOPsPerToken = %v, want %v", got, want)
	}
}
