package main

// mktrain bench tp: tensor parallelism's three patterns (package
// tensorpar, unfused) on tp virtual ranks of one device, against the same
// products without the collective and the collective alone.

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/profile"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/tensorpar"
)

const benchTPUsage = `Usage: mktrain bench tp [--shapes moe-small,llama70b] [--tp 2,4,8] [--iters N] [--backend auto|cpu|cuda] [--out DIR]

Times tensor parallelism's three patterns (package tensorpar) on tp
virtual ranks of the one device for each tp of --tp (goroutines over
in-process groups: comm.NewLocal with a mesh of tp = W, each rank's
comm.Ranks.Tensor group), float32 tensors (the backend's float type),
weights transposed (W is [out, in], as the layers keep them):
  allgather_gemm      x's row shards all-gathered into [R, K], then
                      outs[i] = x·W_i^T, W_i [N/tp, K]  (tensorpar.AllGatherMatMul)
  gemm_reducescatter  partial [R, N] = A·W^T, A [R, F/tp], W [N, F/tp],
                      reduce-scattered to [R/tp, N]     (tensorpar.MatMulReduceScatter)
  gemm_allreduce      the same product, all-reduced to [R, N]
                      (tensorpar.MatMulAllReduce, no sequence parallelism)
Shapes (R rows gathered):
  moe-small  R = 16384 tokens in all (16384/tp per rank), K = F = N = 1024;
             allgather_gemm: q, k and v-like outputs, 3 x [1024/tp, 1024]
             (3072/tp columns per rank); the row-parallel products
             o_proj-like: [16384, 1024/tp]·[1024, 1024/tp]^T
  llama70b   8192 tokens per rank (R = 8192*tp), hidden K = N = 8192,
             ffn F = 28672: the up projection x [R, 8192]·[28672/tp, 8192]^T
             gathered, the down projection [R, 28672/tp]·[8192, 28672/tp]^T
  tiny       8 tokens per rank, K = N = 16, F = 32, 2 outputs (tests)
For each shape, tp and pattern it times the product alone on already
gathered data (the same MatMul calls, no collective), the unfused pattern
(the collective and the products) and the collective alone, each from
before the first rank starts to after the last ends (barriers, marks of
the backend's clock on rank 0), the median of --iters steps after two
warm-up steps; TFLOP/s count every rank's products (2*R*K*N in all for
allgather_gemm, 2*R*F*N for the others) over that time, and unfused /
product is the ratio of the times. The fused kernels are not built yet:
the fused column says so and the issue's bars (fused within 10% of the
product alone and faster than unfused at every tp for llama70b;
GEMM+ReduceScatter fused never slower than unfused) are not measured.
The tp virtual ranks share one GPU's memory and SMs, so the figures show
the cost of the patterns on one device, not of links between GPUs
(NVLink figures come from the multi-GPU issue, #34). A row whose
tensors over all ranks (estimated, with the collectives' scratch) would
pass 120 GiB is skipped and says so; at tp 8 llama70b needs about 42 GiB
per pattern (each pattern's tensors are freed before the next), within
an H200's 141 GB, so no listed row is skipped.

Writes tp.json into bench/results/<machine>/ (the latest result per
machine, overwritten by the next run) or into the folder --out names,
with the commit, machine, command, every figure and each bar's verdict,
and prints the table, then the bars, last.

Flags:
`

// tpBenchShape is one shape of the benchmark: the column-parallel
// product's K and outputs, the row-parallel product's F and N, and the
// rows.
type tpBenchShape struct {
	Name          string `json:"name"`
	Tokens        int    `json:"tokens"`
	TokensPerRank bool   `json:"tokens_per_rank"` // Tokens per rank (R = Tokens*tp), else in all (R = Tokens)
	Hidden        int    `json:"hidden"`          // K of allgather_gemm, N of the row-parallel products
	ColumnWidth   int    `json:"column_width"`    // N of each allgather_gemm output, before splitting over tp
	ColumnOutputs int    `json:"column_outputs"`  // products sharing the gathered x
	RowInner      int    `json:"row_inner"`       // F, the row-parallel products' contraction, before splitting
}

func tpBenchShapes() []tpBenchShape {
	return []tpBenchShape{
		{Name: "moe-small", Tokens: 16384, Hidden: 1024, ColumnWidth: 1024, ColumnOutputs: 3, RowInner: 1024},
		{Name: "llama70b", Tokens: 8192, TokensPerRank: true, Hidden: 8192, ColumnWidth: 28672, ColumnOutputs: 1, RowInner: 28672},
		{Name: "tiny", Tokens: 8, TokensPerRank: true, Hidden: 16, ColumnWidth: 16, ColumnOutputs: 2, RowInner: 32},
	}
}

// rows is R, the rows gathered at tp.
func (s tpBenchShape) rows(tp int) int {
	if s.TokensPerRank {
		return s.Tokens * tp
	}
	return s.Tokens
}

// check says why s cannot be split over tp ranks, or nil.
func (s tpBenchShape) check(tp int) error {
	for _, d := range []struct {
		name string
		v    int
	}{{"rows", s.rows(tp)}, {"column width", s.ColumnWidth}, {"row-parallel inner width", s.RowInner}} {
		if d.v%tp != 0 {
			return fmt.Errorf("shape %s: %s %d is not a multiple of tp %d", s.Name, d.name, d.v, tp)
		}
	}
	return nil
}

// The patterns, as the table and the JSON name them.
const (
	tpAllGatherGEMM     = "allgather_gemm"
	tpGEMMReduceScatter = "gemm_reducescatter"
	tpGEMMAllReduce     = "gemm_allreduce"
)

func tpPatterns() []string { return []string{tpAllGatherGEMM, tpGEMMReduceScatter, tpGEMMAllReduce} }

const (
	tpNote          = "tp virtual ranks share one GPU's memory and SMs (goroutines over in-process groups): the figures show the cost of the patterns on one device, not links between GPUs; NVLink figures come from the multi-GPU issue (#34)"
	tpFusedNotBuilt = "not built"
	tpNoFused       = "no fused kernels yet"
	tpFusedBar      = "fused within 10% of the product alone and faster than unfused at every tp for the Llama-70B-like layer"
	tpRSBar         = "GEMM+ReduceScatter fused never slower than unfused at any listed shape"
	// tpMemoryBudget is the most a row's tensors over all ranks may take:
	// an H200's 141 GB less room for the allocator and other tensors.
	tpMemoryBudget = 120 << 30
)

// tpBenchRow is one shape, tp and pattern; the times are null where the
// row was skipped (Skipped says why).
type tpBenchRow struct {
	Shape   string  `json:"shape"`
	TP      int     `json:"tp"`
	Pattern string  `json:"pattern"`
	Product string  `json:"product"` // the products and the collective, in shapes
	Rows    int     `json:"rows"`    // R, rows gathered
	FLOPs   float64 `json:"flops"`   // every rank's products together
	// MemoryBytes estimates the row's tensors over all ranks, with the
	// collectives' scratch (one more of the largest tensor per rank).
	MemoryBytes int64  `json:"memory_bytes_estimate"`
	Skipped     string `json:"skipped,omitempty"`

	ProductMS *float64 `json:"product_ms"`
	UnfusedMS *float64 `json:"unfused_ms"`
	CommMS    *float64 `json:"comm_ms"`
	ProductTF *float64 `json:"product_tflops"`
	UnfusedTF *float64 `json:"unfused_tflops"`
	// UnfusedOverProduct is unfused time / product time.
	UnfusedOverProduct *float64 `json:"unfused_over_product"`
	Fused              string   `json:"fused"` // "not built"
	FusedMS            *float64 `json:"fused_ms"`
	// OverlapEfficiency is (product + comm - fused) / comm; null without
	// fused kernels.
	OverlapEfficiency *float64 `json:"overlap_efficiency"`
}

func cmdBenchTP(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench tp", benchTPUsage, stderr)
	shapesFlag := fs.String("shapes", "moe-small,llama70b", "comma-separated shapes")
	tpFlag := fs.String("tp", "2,4,8", "comma-separated numbers of virtual tensor-parallel ranks (2 or more)")
	iters := fs.Int("iters", 10, "timed steps of each kind (the median is kept)")
	backendName := fs.String("backend", "auto", "auto, cpu or cuda")
	out := fs.String("out", "", "directory for the JSON result (default bench/results/<machine>)")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageError{"bench tp takes no positional arguments"}
	}
	if *iters < 1 {
		return usageError{"--iters must be positive"}
	}
	shapes, err := pickNamed("--shapes", *shapesFlag, tpBenchShapes(), func(s tpBenchShape) string { return s.Name })
	if err != nil {
		return err
	}
	tps, err := parseCounts("--tp", *tpFlag, func(n int) bool { return n >= 2 }, "a number of ranks of 2 or more")
	if err != nil {
		return err
	}
	for _, s := range shapes {
		for _, tp := range tps {
			if err := s.check(tp); err != nil {
				return usageError{"--tp: " + err.Error()}
			}
		}
	}

	b, closeB, err := openBenchBackend(*backendName)
	if err != nil {
		return err
	}
	defer closeB()
	fmt.Fprintf(stderr, "bench tp: on %s, 2 warm-up + %d timed steps of each kind\n", b.Name(), *iters)
	clock := profile.ClockFor(b)
	rng := rand.New(rand.NewPCG(3, 4))
	var rows []tpBenchRow
	for _, s := range shapes {
		for _, tp := range tps {
			for _, p := range tpPatterns() {
				if ctx.Err() != nil {
					return stoppedError(ctx, "bench tp stopped")
				}
				row := newTPRow(s, tp, p)
				if row.Skipped == "" {
					fmt.Fprintf(stderr, "bench tp: %s at tp %d, %s\n", s.Name, tp, p)
					if err := timeTPRow(b, clock, rng, s, &row, *iters); err != nil {
						return failedRun(fmt.Errorf("bench tp: %s at tp %d, %s: %w", s.Name, tp, p, err))
					}
					runtime.GC() // the row's device memory back to the backend
				}
				rows = append(rows, row)
			}
		}
	}

	printTP(stdout, rows, *iters)
	bars := []barVerdict{
		{Bar: tpFusedBar, Verdict: verdictNotMeasured, Why: tpNoFused},
		{Bar: tpRSBar, Verdict: verdictNotMeasured, Why: tpNoFused},
	}
	names := make([]string, len(shapes))
	for i, s := range shapes {
		names[i] = s.Name
	}
	figures := map[string]any{
		"rows":  rows,
		"bars":  bars,
		"fused": tpFusedNotBuilt,
		"note":  tpNote,
		"flops": "every rank's products together: 2*R*K*N for allgather_gemm (N summed over its outputs), 2*R*F*N for gemm_reducescatter and gemm_allreduce",
		"timing": fmt.Sprintf("median of %d steps after 2 warm-up steps, each from a mark taken on rank 0 before any rank starts (barrier) to one after every rank has returned (barrier), on the backend's clock (%s); fresh uniform random inputs in [-1, 1); float32",
			*iters, clockName(b)),
		"memory_budget_bytes": int64(tpMemoryBudget),
	}
	err = writeResult(stdout, *out, "tp", b, benchResult{
		Benchmark: "tp", Commit: commit(), Date: time.Now().UTC().Format(time.RFC3339),
		Command: "mktrain bench tp " + strings.Join(args, " "), Machine: machine(b.Name()),
		Recipe: strings.Join(names, "+"), Config: map[string]any{"shapes": shapes, "tp": tps, "iters": *iters},
		Figures: figures,
	})
	if err != nil {
		return err
	}
	printBars(stdout, bars)
	return nil
}

// tpTensors is one rank's tensors of one pattern, by shape; the first
// entries are filled with random values (the inputs), the rest zeroed.
type tpTensors struct {
	inputs  [][]int
	outputs [][]int
}

// layout is pattern p's tensors on one rank at tp, and the description of
// its products. allgather_gemm: shard, full, W_1..W_n | outs; the others:
// A, W | partial (or out), out.
func (s tpBenchShape) layout(p string, tp int) (tpTensors, string) {
	r := s.rows(tp)
	switch p {
	case tpAllGatherGEMM:
		n := s.ColumnWidth / tp
		t := tpTensors{inputs: [][]int{{r / tp, s.Hidden}, {r, s.Hidden}}}
		for range s.ColumnOutputs {
			t.inputs = append(t.inputs, []int{n, s.Hidden})
			t.outputs = append(t.outputs, []int{r, n})
		}
		return t, fmt.Sprintf("all-gather [%d, %d] -> x [%d, %d]; %d x x·[%d, %d]^T", r/tp, s.Hidden, r, s.Hidden, s.ColumnOutputs, n, s.Hidden)
	case tpGEMMReduceScatter:
		f := s.RowInner / tp
		return tpTensors{inputs: [][]int{{r, f}, {s.Hidden, f}}, outputs: [][]int{{r, s.Hidden}, {r / tp, s.Hidden}}},
			fmt.Sprintf("[%d, %d]·[%d, %d]^T -> [%d, %d], reduce-scatter -> [%d, %d]", r, f, s.Hidden, f, r, s.Hidden, r/tp, s.Hidden)
	default: // tpGEMMAllReduce
		f := s.RowInner / tp
		return tpTensors{inputs: [][]int{{r, f}, {s.Hidden, f}}, outputs: [][]int{{r, s.Hidden}}},
			fmt.Sprintf("[%d, %d]·[%d, %d]^T -> [%d, %d], all-reduce", r, f, s.Hidden, f, r, s.Hidden)
	}
}

// flops is every rank's products of pattern p together.
func (s tpBenchShape) flops(p string, tp int) float64 {
	r := float64(s.rows(tp))
	if p == tpAllGatherGEMM {
		return 2 * r * float64(s.Hidden) * float64(s.ColumnWidth*s.ColumnOutputs)
	}
	return 2 * r * float64(s.RowInner) * float64(s.Hidden)
}

// newTPRow is a row before timing: its shapes, FLOPs and memory
// estimate, skipped when the estimate passes the budget.
func newTPRow(s tpBenchShape, tp int, p string) tpBenchRow {
	t, desc := s.layout(p, tp)
	var perRank, largest int64
	for _, shape := range append(slices.Clone(t.inputs), t.outputs...) {
		n := int64(4) // float32
		for _, d := range shape {
			n *= int64(d)
		}
		perRank += n
		largest = max(largest, n)
	}
	row := tpBenchRow{Shape: s.Name, TP: tp, Pattern: p, Product: desc, Rows: s.rows(tp), FLOPs: s.flops(p, tp),
		MemoryBytes: int64(tp) * (perRank + largest), Fused: tpFusedNotBuilt}
	if row.MemoryBytes > tpMemoryBudget {
		row.Skipped = fmt.Sprintf("its tensors over %d ranks, about %.1f GiB, pass the %d GiB budget of one device", tp, float64(row.MemoryBytes)/(1<<30), tpMemoryBudget>>30)
	}
	return row
}

// tpRank is one virtual rank's group and the three kinds of work timed.
type tpRank struct {
	ranks                  *comm.Ranks
	product, unfused, coll func() error
}

// timeTPRow allocates the row's tensors on every rank and times the
// product alone, the unfused pattern and the collective alone.
func timeTPRow(b backend.Backend, clock profile.Clock, rng *rand.Rand, s tpBenchShape, row *tpBenchRow, iters int) error {
	world, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: 1, TP: row.TP}, b)
	if err != nil {
		return err
	}
	layout, _ := s.layout(row.Pattern, row.TP)
	chunk := randFill(b, rng, 1<<20) // copied over the inputs: cheap random fill of large tensors
	ranks := make([]*tpRank, row.TP)
	for r := range ranks {
		in := make([]backend.Tensor, len(layout.inputs))
		for i, shape := range layout.inputs {
			in[i] = b.New(b.FloatType(), shape...)
			fillFromChunk(b, in[i], chunk)
		}
		outs := make([]backend.Tensor, len(layout.outputs))
		for i, shape := range layout.outputs {
			outs[i] = b.New(b.FloatType(), shape...)
		}
		ranks[r] = newTPRank(b, world[r], row.Pattern, in, outs)
	}
	if err := b.Sync(); err != nil {
		return err
	}
	ms := func(d time.Duration) *float64 { v := float64(d) / 1e6; return &v }
	for _, k := range []struct {
		work func(*tpRank) func() error
		dst  **float64
	}{
		{func(rk *tpRank) func() error { return rk.product }, &row.ProductMS},
		{func(rk *tpRank) func() error { return rk.unfused }, &row.UnfusedMS},
		{func(rk *tpRank) func() error { return rk.coll }, &row.CommMS},
	} {
		d, err := runTPSteps(b, clock, ranks, k.work, iters)
		if err != nil {
			return err
		}
		*k.dst = ms(d)
	}
	pt, ut, ratio := tflops(row.FLOPs, *row.ProductMS), tflops(row.FLOPs, *row.UnfusedMS), *row.UnfusedMS / *row.ProductMS
	row.ProductTF, row.UnfusedTF, row.UnfusedOverProduct = &pt, &ut, &ratio
	return nil
}

// newTPRank builds rank's three kinds of work for pattern p over its
// tensor group, from the tensors layout lists.
func newTPRank(b backend.Backend, ranks *comm.Ranks, p string, in, outs []backend.Tensor) *tpRank {
	g := ranks.Tensor
	rk := &tpRank{ranks: ranks}
	switch p {
	case tpAllGatherGEMM:
		shard, full, ws := in[0], in[1], in[2:]
		rk.product = func() error {
			for i := range outs {
				b.MatMul(outs[i], full, ws[i], false, true, 1, 0)
			}
			return nil
		}
		rk.unfused = func() error { return tensorpar.AllGatherMatMul(b, g, full, shard, outs, ws, true) }
		rk.coll = func() error { return g.AllGather(full, shard) }
	case tpGEMMReduceScatter:
		a, w, partial, out := in[0], in[1], outs[0], outs[1]
		rk.product = func() error { b.MatMul(partial, a, w, false, true, 1, 0); return nil }
		rk.unfused = func() error {
			return tensorpar.MatMulReduceScatter(b, g, out, partial, []tensorpar.Term{{A: a, W: w, TransW: true}})
		}
		rk.coll = func() error { return g.ReduceScatterSum(out, partial) }
	default: // tpGEMMAllReduce
		a, w, out := in[0], in[1], outs[0]
		rk.product = func() error { b.MatMul(out, a, w, false, true, 1, 0); return nil }
		rk.unfused = func() error {
			return tensorpar.MatMulAllReduce(b, g, out, []tensorpar.Term{{A: a, W: w, TransW: true}})
		}
		// The product rewrites out each step; the collective alone sums
		// it again each step, growing it by tp, far from float32's range
		// in a dozen steps.
		rk.coll = func() error { return g.AllReduceSum(out) }
	}
	return rk
}

// fillFromChunk fills t with copies of chunk (a 1-D tensor), the last one
// cut short.
func fillFromChunk(b backend.Backend, t, chunk backend.Tensor) {
	n, c := t.Len(), chunk.Len()
	for off := 0; off < n; off += c {
		m := min(c, n-off)
		b.Copy(b.View(t, off, m), b.View(chunk, 0, m))
	}
}

// runTPSteps times work on every rank with medianRankStep, the steps
// bracketed by the tensor group's barriers.
func runTPSteps(b backend.Backend, clock profile.Clock, ranks []*tpRank, work func(*tpRank) func() error, iters int) (time.Duration, error) {
	steps := make([]rankStep, len(ranks))
	for r, rk := range ranks {
		steps[r] = rankStep{group: rk.ranks.Tensor, ranks: rk.ranks, work: work(rk)}
	}
	return medianRankStep(b, clock, steps, iters)
}

func printTP(w io.Writer, rows []tpBenchRow, iters int) {
	fmt.Fprintf(w, "tp: tensor parallelism's patterns (tensorpar, unfused) on tp virtual ranks of one device, float32; ms from the first rank's start to the last rank's end, median of %d steps\n", iters)
	fmt.Fprintf(w, "%-10s %3s %-19s %7s | %10s %9s | %10s %9s | %9s | %8s | %-9s\n",
		"shape", "tp", "pattern", "rows", "product ms", "TF", "unfused ms", "TF", "comm ms", "unf/prod", "fused")
	opt := func(p *float64, format string) string {
		if p == nil {
			return "-"
		}
		return fmt.Sprintf(format, *p)
	}
	var skipped []string
	for _, r := range rows {
		fmt.Fprintf(w, "%-10s %3d %-19s %7d | %10s %9s | %10s %9s | %9s | %8s | %-9s\n",
			r.Shape, r.TP, r.Pattern, r.Rows, opt(r.ProductMS, "%.3f"), opt(r.ProductTF, "%.4g"),
			opt(r.UnfusedMS, "%.3f"), opt(r.UnfusedTF, "%.4g"), opt(r.CommMS, "%.3f"), opt(r.UnfusedOverProduct, "%.2f"), r.Fused)
		if r.Skipped != "" {
			skipped = append(skipped, fmt.Sprintf("%s at tp %d, %s: %s", r.Shape, r.TP, r.Pattern, r.Skipped))
		}
	}
	fmt.Fprintf(w, "(product: the same MatMul calls on already-gathered data, no collective; unfused: tensorpar's function, collective and products; comm: the collective alone; TF: every rank's products over the time; unf/prod: unfused time / product time; fused: %s, %s)\n", tpFusedNotBuilt, tpNoFused)
	fmt.Fprintf(w, "(%s)\n", tpNote)
	for _, s := range skipped {
		fmt.Fprintf(w, "(skipped: %s)\n", s)
	}
}
