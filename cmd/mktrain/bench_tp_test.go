package main

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// tpResult is the part of tp.json the test reads.
type tpResult struct {
	Benchmark string `json:"benchmark"`
	Commit    string `json:"commit"`
	Command   string `json:"command"`
	Machine   struct {
		Backend string `json:"backend"`
	} `json:"machine"`
	Figures struct {
		Rows  []tpBenchRow `json:"rows"`
		Bars  []barVerdict `json:"bars"`
		Fused string       `json:"fused"`
		Note  string       `json:"note"`
	} `json:"figures"`
}

// TestBenchTP runs bench tp on the CPU at the tiny shape on 2 virtual
// ranks: one row per pattern with positive, consistent times and rates,
// fused not built, both bars not measured, and the table says so and ends
// with the bars.
func TestBenchTP(t *testing.T) {
	dir := t.TempDir()
	code, stdout, stderr := runCLI(t, "bench", "tp", "--backend", "cpu", "--shapes", "tiny", "--tp", "2", "--iters", "1", "--out", dir)
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	buf, err := os.ReadFile(filepath.Join(dir, "tp.json"))
	if err != nil {
		t.Fatal(err)
	}
	var res tpResult
	if err := json.Unmarshal(buf, &res); err != nil {
		t.Fatalf("tp.json: %v", err)
	}
	if res.Benchmark != "tp" || res.Commit == "" || !strings.HasPrefix(res.Command, "mktrain bench tp ") || res.Machine.Backend != "cpu" {
		t.Errorf("benchmark %q, commit %q, command %q, backend %q", res.Benchmark, res.Commit, res.Command, res.Machine.Backend)
	}
	f := res.Figures
	if f.Fused != tpFusedNotBuilt || !strings.Contains(f.Note, "share one GPU") {
		t.Errorf("fused %q, note %q", f.Fused, f.Note)
	}
	if len(f.Rows) != len(tpPatterns()) {
		t.Fatalf("%d rows, want one per pattern (%d)", len(f.Rows), len(tpPatterns()))
	}
	tiny := tpBenchShapes()[2]
	for i, r := range f.Rows {
		if r.Shape != "tiny" || r.TP != 2 || r.Pattern != tpPatterns()[i] || r.Rows != 16 || r.Skipped != "" {
			t.Errorf("row %d: shape %s tp %d pattern %s rows %d skipped %q", i, r.Shape, r.TP, r.Pattern, r.Rows, r.Skipped)
		}
		if r.ProductMS == nil || r.UnfusedMS == nil || r.CommMS == nil || r.ProductTF == nil || r.UnfusedTF == nil || r.UnfusedOverProduct == nil {
			t.Fatalf("row %s: a figure is null: %+v", r.Pattern, r)
		}
		if !(*r.ProductMS > 0 && *r.UnfusedMS > 0 && *r.CommMS > 0) {
			t.Errorf("row %s: times %v %v %v ms are not all positive", r.Pattern, *r.ProductMS, *r.UnfusedMS, *r.CommMS)
		}
		if r.FLOPs != tiny.flops(r.Pattern, 2) || !within(*r.ProductTF, tflops(r.FLOPs, *r.ProductMS)) ||
			!within(*r.UnfusedOverProduct, *r.UnfusedMS / *r.ProductMS) {
			t.Errorf("row %s: flops %v, product %v TF, ratio %v inconsistent with the times", r.Pattern, r.FLOPs, *r.ProductTF, *r.UnfusedOverProduct)
		}
		if r.Fused != tpFusedNotBuilt || r.FusedMS != nil || r.OverlapEfficiency != nil {
			t.Errorf("row %s: fused %q %v %v, want not built and null", r.Pattern, r.Fused, r.FusedMS, r.OverlapEfficiency)
		}
	}
	// allgather_gemm at tiny: 2*R*K*(N*outputs) = 2*16*16*32.
	if got := f.Rows[0].FLOPs; got != 2*16*16*32 {
		t.Errorf("allgather_gemm flops %v, want %v", got, 2*16*16*32)
	}
	if len(f.Bars) != 2 {
		t.Fatalf("%d bars, want 2", len(f.Bars))
	}
	for _, v := range f.Bars {
		if v.Verdict != verdictNotMeasured || v.Why != tpNoFused {
			t.Errorf("bar %q: %s (%s), want not measured: %s", v.Bar, v.Verdict, v.Why, tpNoFused)
		}
	}
	for _, want := range []string{"gemm_reducescatter", "share one GPU's memory and SMs", "fused: not built", "#34"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("table lacks %q:\n%s", want, stdout)
		}
	}
	if i, j := strings.LastIndex(stdout, "bars:"), strings.LastIndex(stdout, "not measured  "+tpRSBar); i < 0 || j < i {
		t.Errorf("the output does not end with the bars:\n%s", stdout)
	}
}

// TestBenchTPBadFlags: a shape not split evenly over tp, an unknown
// shape and a tp below 2 are usage errors (exit 2).
func TestBenchTPBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--shapes", "tiny", "--tp", "3"},
		{"--shapes", "huge"},
		{"--tp", "1"},
	} {
		code, _, stderr := runCLI(t, append([]string{"bench", "tp", "--backend", "cpu", "--out", t.TempDir()}, args...)...)
		if code != 2 || !strings.Contains(stderr, "--") {
			t.Errorf("%v: exit %d, stderr %q; want 2 naming the flag", args, code, stderr)
		}
	}
}

// TestTPMemoryEstimate: llama70b at tp 8 fits the budget for every
// pattern (nothing skipped at the listed shapes).
func TestTPMemoryEstimate(t *testing.T) {
	for _, s := range tpBenchShapes() {
		for _, p := range tpPatterns() {
			r := newTPRow(s, 8, p)
			t.Logf("%s tp 8 %s: %.1f GiB", s.Name, p, float64(r.MemoryBytes)/(1<<30))
			if r.Skipped != "" {
				t.Errorf("%s at tp 8, %s: skipped: %s", s.Name, p, r.Skipped)
			}
		}
	}
}

// within says whether a and b agree to a relative 1e-9.
func within(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(math.Abs(a), math.Abs(b)) }

// TestTPRowSkippedOverBudget: a row whose tensors pass the budget is
// skipped with its estimate, and its figures stay null in the table.
func TestTPRowSkippedOverBudget(t *testing.T) {
	huge := tpBenchShape{Name: "huge", Tokens: 1 << 20, TokensPerRank: true, Hidden: 8192, ColumnWidth: 28672, ColumnOutputs: 1, RowInner: 28672}
	r := newTPRow(huge, 8, tpGEMMReduceScatter)
	if r.Skipped == "" || !strings.Contains(r.Skipped, "GiB budget") || r.MemoryBytes <= tpMemoryBudget {
		t.Fatalf("skipped %q at %d bytes", r.Skipped, r.MemoryBytes)
	}
	var out strings.Builder
	printTP(&out, []tpBenchRow{r}, 1)
	if !strings.Contains(out.String(), "(skipped: huge at tp 8, gemm_reducescatter: ") {
		t.Errorf("table does not say the row is skipped:\n%s", out.String())
	}
}
