package main

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/profile"
	"github.com/mktrain/mktrain/comm"
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

// TestBenchTP runs bench tp on the CPU at the tiny shape on 2 and 4
// virtual ranks: one row per tp and pattern with positive, consistent
// times and rates, unfused and fused (the deterministic fused for the
// row-parallel patterns only), fused outputs matching the unfused ones,
// the first bar not measured (no llama70b row) and the second judged from
// the rows; the table shows the fused columns and ends with the bars.
func TestBenchTP(t *testing.T) {
	dir := t.TempDir()
	code, stdout, stderr := runCLI(t, "bench", "tp", "--backend", "cpu", "--shapes", "tiny", "--tp", "2,4", "--iters", "1", "--out", dir)
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
	if f.Fused != tpFusedAbout || !strings.Contains(f.Note, "share one GPU") {
		t.Errorf("fused %q, note %q", f.Fused, f.Note)
	}
	if len(f.Rows) != 2*len(tpPatterns()) {
		t.Fatalf("%d rows, want one per tp and pattern (%d)", len(f.Rows), 2*len(tpPatterns()))
	}
	tiny := tpBenchShapes()[2]
	rsHeld := true
	for i, r := range f.Rows {
		tp := 2 << (i / len(tpPatterns()))
		if r.Shape != "tiny" || r.TP != tp || r.Pattern != tpPatterns()[i%len(tpPatterns())] || r.Rows != 8*tp || r.Skipped != "" {
			t.Errorf("row %d: shape %s tp %d pattern %s rows %d skipped %q", i, r.Shape, r.TP, r.Pattern, r.Rows, r.Skipped)
		}
		checkTPRowFigures(t, r, tiny)
		if r.Pattern == tpGEMMReduceScatter && r.FusedMS != nil && r.UnfusedMS != nil && *r.FusedMS > *r.UnfusedMS {
			rsHeld = false
		}
	}
	// allgather_gemm at tiny, tp 2: 2*R*K*(N*outputs) = 2*16*16*32.
	if got := f.Rows[0].FLOPs; got != 2*16*16*32 {
		t.Errorf("allgather_gemm flops %v, want %v", got, 2*16*16*32)
	}
	if len(f.Bars) != 2 {
		t.Fatalf("%d bars, want 2", len(f.Bars))
	}
	if v := f.Bars[0]; v.Bar != tpFusedBar || v.Verdict != verdictNotMeasured || !strings.Contains(v.Why, "no llama70b row") {
		t.Errorf("first bar %q: %s (%s), want not measured: no llama70b row", v.Bar, v.Verdict, v.Why)
	}
	wantRS := map[bool]string{true: verdictHeld, false: verdictNotHeld}[rsHeld]
	if v := f.Bars[1]; v.Bar != tpRSBar || v.Verdict != wantRS || !strings.Contains(v.Why, "worst: tiny at tp ") || !strings.Contains(v.Why, "tiny at tp 2, 4") {
		t.Errorf("second bar %q: %s (%s), want %s over tiny at tp 2, 4 with its worst row", v.Bar, v.Verdict, v.Why, wantRS)
	}
	for _, want := range []string{"gemm_reducescatter", "share one GPU's memory and SMs", "fused ms", "det ms", "f/prod", "f/unf", "overlap", "rel L2", "#34"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("table lacks %q:\n%s", want, stdout)
		}
	}
	if i, j := strings.LastIndex(stdout, "bars:"), strings.LastIndex(stdout, wantRS+" "); i < 0 || j < i || !strings.HasSuffix(strings.TrimSpace(stdout), ")") ||
		!strings.Contains(stdout[j:], tpRSBar) {
		t.Errorf("the output does not end with the bars:\n%s", stdout)
	}
}

// checkTPRowFigures checks a measured row's figures against each other:
// positive times, rates and ratios from the times, the overlap efficiency
// from its formula (null only when comm is short), the deterministic
// fused figures for the row-parallel patterns only, and fused outputs
// matching the unfused ones.
func checkTPRowFigures(t *testing.T, r tpBenchRow, s tpBenchShape) {
	t.Helper()
	if r.ProductMS == nil || r.UnfusedMS == nil || r.CommMS == nil || r.ProductTF == nil || r.UnfusedTF == nil || r.UnfusedOverProduct == nil ||
		r.FusedMS == nil || r.FusedTF == nil || r.FusedOverProduct == nil || r.FusedOverUnfused == nil || r.FusedRelL2 == nil {
		t.Fatalf("%s: a figure is null: %+v", r.label(), r)
	}
	if r.Fused != tpFusedMeasured {
		t.Errorf("%s: fused %q, want %q", r.label(), r.Fused, tpFusedMeasured)
	}
	if !(*r.ProductMS > 0 && *r.UnfusedMS > 0 && *r.CommMS > 0 && *r.FusedMS > 0) {
		t.Errorf("%s: times %v %v %v %v ms are not all positive", r.label(), *r.ProductMS, *r.UnfusedMS, *r.CommMS, *r.FusedMS)
	}
	if r.FLOPs != s.flops(r.Pattern, r.TP) || !within(*r.ProductTF, tflops(r.FLOPs, *r.ProductMS)) ||
		!within(*r.UnfusedOverProduct, *r.UnfusedMS / *r.ProductMS) {
		t.Errorf("%s: flops %v, product %v TF, ratio %v inconsistent with the times", r.label(), r.FLOPs, *r.ProductTF, *r.UnfusedOverProduct)
	}
	if !within(*r.FusedTF, tflops(r.FLOPs, *r.FusedMS)) || !within(*r.FusedOverProduct, *r.FusedMS / *r.ProductMS) ||
		!within(*r.FusedOverUnfused, *r.FusedMS / *r.UnfusedMS) {
		t.Errorf("%s: fused %v TF, %vx product, %vx unfused inconsistent with %v ms", r.label(), *r.FusedTF, *r.FusedOverProduct, *r.FusedOverUnfused, *r.FusedMS)
	}
	switch e := r.OverlapEfficiency; {
	case e == nil && *r.CommMS >= tpOverlapMinComm**r.ProductMS:
		t.Errorf("%s: overlap efficiency null with comm %v ms, product %v ms", r.label(), *r.CommMS, *r.ProductMS)
	case e != nil && !within(*e, (*r.ProductMS+*r.CommMS-*r.FusedMS) / *r.CommMS):
		t.Errorf("%s: overlap efficiency %v, want (product + comm - fused) / comm", r.label(), *e)
	}
	// The CPU's fused ops are the unfused sequences: the same sums.
	if *r.FusedRelL2 > 1e-6 {
		t.Errorf("%s: fused relative L2 %v from unfused", r.label(), *r.FusedRelL2)
	}
	det := []*float64{r.FusedDeterministicMS, r.FusedDeterministicOverProduct, r.FusedDeterministicOverUnfused, r.FusedDeterministicRelL2}
	if r.Pattern == tpAllGatherGEMM {
		for _, d := range det {
			if d != nil {
				t.Errorf("%s: deterministic fused figure %v, want null (nothing summed)", r.label(), *d)
			}
		}
		return
	}
	if slices.Contains(det, nil) {
		t.Fatalf("%s: a deterministic fused figure is null: %v", r.label(), det)
	}
	if !(*r.FusedDeterministicMS > 0) || !within(*r.FusedDeterministicOverUnfused, *r.FusedDeterministicMS / *r.UnfusedMS) ||
		!within(*r.FusedDeterministicOverProduct, *r.FusedDeterministicMS / *r.ProductMS) || *r.FusedDeterministicRelL2 > 1e-6 {
		t.Errorf("%s: deterministic fused %v ms, %vx product, %vx unfused, relative L2 %v", r.label(), *r.FusedDeterministicMS,
			*r.FusedDeterministicOverProduct, *r.FusedDeterministicOverUnfused, *r.FusedDeterministicRelL2)
	}
}

// tpRowOn times one tiny row at tp 2 on b, its tensor groups wrapped by
// wrap, and returns the row and timeTPRow's error.
func tpRowOn(t *testing.T, b backend.Backend, pattern string, wrap func(comm.Group) comm.Group) (tpBenchRow, error) {
	t.Helper()
	world, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: 1, TP: 2}, b)
	if err != nil {
		t.Fatal(err)
	}
	for _, rk := range world {
		rk.Tensor = wrap(rk.Tensor)
	}
	s := tpBenchShapes()[2]
	row := newTPRow(s, 2, pattern, 2)
	err = timeTPRow([]backend.Backend{b, b}, false, profile.ClockFor(b), rand.New(rand.NewPCG(1, 2)), world, s, &row, 1)
	return row, err
}

// peerlessGroup is a tensor group without comm.PeerAccess (as a group
// across processes): only Group's methods.
type peerlessGroup struct{ comm.Group }

// TestTPFusedNotAvailable: over a group without peer access a row times
// the unfused pattern, leaves the fused figures null, says why, and the
// bars over it are not measured naming it.
func TestTPFusedNotAvailable(t *testing.T) {
	b := cpu.New(backend.Float32)
	var rows []tpBenchRow
	for _, p := range tpPatterns() {
		row, err := tpRowOn(t, b, p, func(g comm.Group) comm.Group { return peerlessGroup{g} })
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		if !strings.HasPrefix(row.Fused, tpFusedNotAvailable) || !strings.Contains(row.Fused, "comm.PeerAccess") {
			t.Errorf("%s: fused %q, want not available: no peer access", p, row.Fused)
		}
		if row.UnfusedMS == nil || row.FusedMS != nil || row.FusedRelL2 != nil || row.FusedDeterministicMS != nil || row.OverlapEfficiency != nil {
			t.Errorf("%s: unfused %v, fused %v, rel L2 %v, deterministic %v, overlap %v; want only unfused measured",
				p, row.UnfusedMS, row.FusedMS, row.FusedRelL2, row.FusedDeterministicMS, row.OverlapEfficiency)
		}
		rows = append(rows, row)
	}
	for _, v := range []barVerdict{tpRSVerdict(rows), tpFusedVerdict(relabel(rows, tpFusedBarShape))} {
		if v.Verdict != verdictNotMeasured || !strings.Contains(v.Why, "not available") {
			t.Errorf("bar %q: %s (%s), want not measured: not available", v.Bar, v.Verdict, v.Why)
		}
	}
	var out strings.Builder
	printTP(&out, rows, 1, "tp virtual ranks of one device", tpNote)
	if !strings.Contains(out.String(), "(fused tiny at tp 2, gemm_allreduce: not available: ") {
		t.Errorf("table does not say fused is not available:\n%s", out.String())
	}
}

// relabel is rows with their shape renamed.
func relabel(rows []tpBenchRow, shape string) []tpBenchRow {
	out := slices.Clone(rows)
	for i := range out {
		out[i].Shape = shape
	}
	return out
}

// wrongFused is a backend whose fused ops do nothing: the fused
// patterns' outputs keep what was in them.
type wrongFused struct{ backend.Backend }

func (wrongFused) AllGatherMatMul(backend.Tensor, []backend.Tensor, []backend.Tensor, []backend.Tensor, bool, int) {
}
func (wrongFused) MatMulScatter([]backend.Tensor, int, backend.Tensor, backend.Tensor, bool, backend.ScatterLanding, int) {
}

// TestTPFusedMismatchFails: a fused op that leaves its outputs alone
// (holding other values than the unfused pattern left: the bench
// refills them) fails the row, naming the output and the distance.
func TestTPFusedMismatchFails(t *testing.T) {
	b := wrongFused{cpu.New(backend.Float32)}
	for _, p := range tpPatterns() {
		_, err := tpRowOn(t, b, p, func(g comm.Group) comm.Group { return g })
		if err == nil || !strings.Contains(err.Error(), "differs from the unfused pattern's: relative L2 distance") {
			t.Errorf("%s: error %v, want the fused output's distance from the unfused one", p, err)
		}
	}
}

// TestTPBarVerdicts: the bars from made-up rows: held with the worst row
// named, not held naming the rows that missed, not measured without rows
// or with a skipped one.
func TestTPBarVerdicts(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	row := func(shape string, tp int, pattern string, product, unfused, fused float64) tpBenchRow {
		r := tpBenchRow{Shape: shape, TP: tp, Pattern: pattern, Fused: tpFusedMeasured,
			ProductMS: f(product), UnfusedMS: f(unfused), FusedMS: f(fused),
			FusedOverProduct: f(fused / product), FusedOverUnfused: f(fused / unfused)}
		return r
	}
	held := []tpBenchRow{
		row("llama70b", 2, tpGEMMReduceScatter, 10, 12, 10.5),
		row("llama70b", 8, tpGEMMAllReduce, 10, 12, 10.9),
		row("moe-small", 2, tpGEMMReduceScatter, 1, 2, 1.5),
	}
	v := tpFusedVerdict(held)
	if v.Verdict != verdictHeld || !strings.Contains(v.Why, "worst: llama70b at tp 8, gemm_allreduce") || !strings.Contains(v.Why, "llama70b at tp 2, 8") {
		t.Errorf("fused bar: %s (%s), want held, worst llama70b at tp 8", v.Verdict, v.Why)
	}
	v = tpRSVerdict(held)
	if v.Verdict != verdictHeld || !strings.Contains(v.Why, "worst: llama70b at tp 2, gemm_reducescatter") || !strings.HasSuffix(v.Why, "; over llama70b, moe-small at tp 2") {
		t.Errorf("reduce-scatter bar: %s (%s), want held over llama70b and moe-small, worst llama70b at tp 2", v.Verdict, v.Why)
	}

	missed := append(slices.Clone(held),
		row("llama70b", 4, tpAllGatherGEMM, 10, 10.5, 10.6), // within 10% but slower than unfused
		row("moe-small", 4, tpGEMMReduceScatter, 1, 2, 2.1),
	)
	v = tpFusedVerdict(missed)
	if v.Verdict != verdictNotHeld || !strings.HasPrefix(v.Why, "worst: llama70b at tp 4, allgather_gemm") || strings.Contains(v.Why, "also missed") {
		t.Errorf("fused bar: %s (%s), want not held by llama70b at tp 4 only", v.Verdict, v.Why)
	}
	// Faster than unfused but 15% over the product alone: the worst now.
	v = tpFusedVerdict(append(slices.Clone(missed), row("llama70b", 4, tpGEMMReduceScatter, 10, 20, 11.5)))
	if v.Verdict != verdictNotHeld || !strings.HasPrefix(v.Why, "worst: llama70b at tp 4, gemm_reducescatter") ||
		!strings.Contains(v.Why, "; also missed by llama70b at tp 4, allgather_gemm; over llama70b at tp 2, 4, 8") {
		t.Errorf("fused bar: %s (%s), want not held, worst llama70b at tp 4 reduce-scatter, also allgather", v.Verdict, v.Why)
	}
	v = tpRSVerdict(missed)
	if v.Verdict != verdictNotHeld || !strings.HasPrefix(v.Why, "worst: moe-small at tp 4, gemm_reducescatter") || strings.Contains(v.Why, "also missed") {
		t.Errorf("reduce-scatter bar: %s (%s), want not held by moe-small at tp 4", v.Verdict, v.Why)
	}

	if v := tpFusedVerdict(held[2:]); v.Verdict != verdictNotMeasured || !strings.Contains(v.Why, "no llama70b row") {
		t.Errorf("fused bar without llama70b rows: %s (%s)", v.Verdict, v.Why)
	}
	skipped := newTPRow(tpBenchShape{Name: "llama70b", Tokens: 1 << 20, TokensPerRank: true, Hidden: 8192, ColumnWidth: 28672, ColumnOutputs: 1, RowInner: 28672}, 8, tpGEMMReduceScatter, 8)
	for _, v := range []barVerdict{tpFusedVerdict(append(slices.Clone(held), skipped)), tpRSVerdict(append(slices.Clone(held), skipped))} {
		if v.Verdict != verdictNotMeasured || !strings.Contains(v.Why, "llama70b at tp 8, gemm_reducescatter skipped") {
			t.Errorf("bar %q with a skipped row: %s (%s)", v.Bar, v.Verdict, v.Why)
		}
	}
}

// TestBenchTPBadFlags: a shape not split evenly over tp, an unknown
// shape and a tp below 2 are usage errors (exit 2).
func TestBenchTPBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--shapes", "tiny", "--tp", "3"},
		{"--shapes", "huge"},
		{"--tp", "1"},
		{"--shapes", "tiny", "--tp", "2", "--gpus"}, // one rank per GPU needs the cuda backend
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
			r := newTPRow(s, 8, p, 8)
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
	r := newTPRow(huge, 8, tpGEMMReduceScatter, 8)
	if r.Skipped == "" || !strings.Contains(r.Skipped, "GiB budget") || r.MemoryBytes <= tpMemoryBudget {
		t.Fatalf("skipped %q at %d bytes", r.Skipped, r.MemoryBytes)
	}
	// One rank a device (--gpus): a row that passes the budget on one
	// device's 8 virtual ranks fits when each rank has a GPU.
	big := huge
	big.Tokens = 1 << 16
	if v, g := newTPRow(big, 8, tpGEMMReduceScatter, 8), newTPRow(big, 8, tpGEMMReduceScatter, 1); v.Skipped == "" || g.Skipped != "" {
		t.Errorf("%d tokens a rank at tp 8: skipped %q on virtual ranks, %q with a GPU each; want skipped only on virtual ranks", big.Tokens, v.Skipped, g.Skipped)
	}
	var out strings.Builder
	printTP(&out, []tpBenchRow{r}, 1, "tp virtual ranks of one device", tpNote)
	if !strings.Contains(out.String(), "(skipped: huge at tp 8, gemm_reducescatter: ") {
		t.Errorf("table does not say the row is skipped:\n%s", out.String())
	}
}

// TestTPRowOwnDevices: each rank on a backend of its own, waited for at
// the end of every step (bench tp --gpus's way, here two CPU backends):
// every pattern is measured, fused included, and the fused outputs equal
// the unfused ones.
func TestTPRowOwnDevices(t *testing.T) {
	bs := []backend.Backend{cpu.New(backend.Float32), cpu.New(backend.Float32)}
	s := tpBenchShapes()[2]
	for _, p := range tpPatterns() {
		world, err := comm.NewLocal(tensorMesh(2), bs[0])
		if err != nil {
			t.Fatal(err)
		}
		row := newTPRow(s, 2, p, 1)
		if err := timeTPRow(bs, true, profile.ClockFor(bs[0]), rand.New(rand.NewPCG(5, 6)), world, s, &row, 1); err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		if row.Fused != tpFusedMeasured || row.FusedMS == nil || row.FusedRelL2 == nil || *row.FusedRelL2 > 1e-6 {
			t.Errorf("%s: fused %q, relative L2 %v; want measured, equal to unfused", p, row.Fused, row.FusedRelL2)
		}
	}
}
