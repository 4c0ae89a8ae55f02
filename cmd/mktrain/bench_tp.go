package main

// mktrain bench tp: tensor parallelism's three patterns (package
// tensorpar), unfused and fused, on tp virtual ranks of one device (or,
// with --gpus, one rank per GPU), against the same products without the
// collective and the collective alone; the fused outputs are checked
// against the unfused ones.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
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

const benchTPUsage = `Usage: mktrain bench tp [--shapes moe-small,llama70b] [--tp 2,4,8] [--iters N] [--backend auto|cpu|cuda] [--gpus] [--out DIR]

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
(the collective and the products), the collective alone, the fused
pattern (tensorpar.Options{Fused: true}: the backend's fused op, which
reads or writes the peers' tensors through comm.PeerAccess; on CUDA the
tp_gather and tp_scatter kernels, on the CPU their unfused sequences)
and, for gemm_reducescatter and gemm_allreduce, the fused pattern with
Deterministic (every rank's rows landed in slots of their own and summed
in rank order), each from before the first rank starts to after the last
ends (barriers, marks of the backend's clock on rank 0), the median of
--iters steps after two warm-up steps, sampled in rounds that take one
step of every path in a balanced order (each path first equally often
and after every other equally often, so that the clocks' drift under the
power cap, and the step before's mark on them, weigh on every path
alike), each step on virtual ranks after a hold of the GPU behind which
the ranks queue their ops (as bench attention's ring rows: the times are
the GPU's, not the host's queueing). TFLOP/s count every rank's
products (2*R*K*N in all for allgather_gemm, 2*R*F*N for the others) over
that time; unfused / product, fused / product and fused / unfused are
ratios of the times, and the overlap efficiency, (product + comm -
fused) / comm, is the share of the collective the fused pattern hides
(null when the collective alone takes under 1% of the product's time).
Before the timing, rank 0's outputs of one step of each fused pattern
are compared with those of one step of the unfused pattern (relative L2
distance; the outputs are overwritten with other random values in
between): above 1e-3 the command fails, naming
the shape, tp and pattern. A group without peer access leaves the fused
figures null and says "not available" and why, rather than timing the
unfused path twice. The bars: fused within 10% of the product alone and
faster than unfused at every tp for llama70b (every llama70b row), and
GEMM+ReduceScatter fused never slower than unfused (every
gemm_reducescatter row), each held or not held with its worst row, or
not measured and why (no such row, a row skipped or without peer
access).
The tp virtual ranks share one GPU's memory and SMs, so the figures show
the cost of the patterns on one device, not of links between GPUs.
With --gpus, tp W runs on GPUs 0..W-1, one rank each (each rank's tensor
group an NCCL communicator with peer access between its GPUs, as bench
kernels --gpus places its ranks), each rank waiting for its GPU before a
step counts as finished: the fused patterns then read and write the
peers' tensors over NVLink (the multi-GPU issue, #34). A row whose
tensors on one device (estimated, with the collectives' scratch and the
deterministic fused pattern's slots: every rank's on virtual ranks, one
rank's with --gpus) would pass 120 GiB is skipped and says so; at tp 8
llama70b needs at most about 58 GiB per pattern on virtual ranks (each
pattern's tensors are freed before the next), within an H200's 141 GB,
so no listed row is skipped.

Writes tp.json (tp-gpus.json with --gpus) into bench/results/<machine>/
(the latest result per machine, overwritten by the next run) or into
the folder --out names,
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
	tpNote       = "tp virtual ranks share one GPU's memory and SMs (goroutines over in-process groups): the figures show the cost of the patterns on one device, not links between GPUs; NVLink figures come from the multi-GPU issue (#34)"
	tpGPUsNote   = "one rank per GPU (--gpus: tp W on GPUs 0..W-1, each rank's tensor group an NCCL communicator with peer access between its GPUs): the fused patterns read and write the peers' tensors over the links between the GPUs; each rank waits for its GPU before a step counts as finished"
	tpFusedAbout = "tensorpar.Options{Fused: true}: the backend's fused ops (AllGatherMatMul, MatMulScatter) reading and writing the peers' tensors through comm.PeerAccess; on CUDA the tp_gather and tp_scatter kernels, on the CPU their unfused sequences; deterministic: every rank's rows landed in slots of their own and summed in rank order"
	tpFusedBar   = "fused within 10% of the product alone and faster than unfused at every tp for the Llama-70B-like layer"
	tpRSBar      = "GEMM+ReduceScatter fused never slower than unfused at any listed shape"
	// tpFusedBarShape and tpFusedOverProductGoal are the first bar's rows
	// and its margin over the product alone.
	tpFusedBarShape        = "llama70b"
	tpFusedOverProductGoal = 1.10
	// tpFusedTolerance is the largest relative L2 distance of a fused
	// output from the unfused one; the products differ only in the order
	// of their sums (bf16 products on CUDA: a few 1e-6).
	tpFusedTolerance = 1e-3
	// tpOverlapMinComm: below this share of the product's time the
	// collective alone is too short for the overlap efficiency to be more
	// than the timing noise magnified; it is left null.
	tpOverlapMinComm = 0.01
	// The row's fused column: measured, or not and why.
	tpFusedMeasured     = "measured"
	tpFusedSkipped      = "skipped"
	tpFusedNotAvailable = "not available: "
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

	// Fused is "measured", "skipped" (with the row) or "not available: "
	// and why (a group without peer access); the fused figures are null
	// unless measured.
	Fused            string   `json:"fused"`
	FusedMS          *float64 `json:"fused_ms"`
	FusedTF          *float64 `json:"fused_tflops"`
	FusedOverProduct *float64 `json:"fused_over_product"`
	FusedOverUnfused *float64 `json:"fused_over_unfused"`
	// OverlapEfficiency is (product + comm - fused) / comm; null unless
	// measured and comm is at least tpOverlapMinComm of product.
	OverlapEfficiency *float64 `json:"overlap_efficiency"`
	// FusedRelL2 is the relative L2 distance of rank 0's fused outputs
	// from the unfused ones, the largest over the outputs compared.
	FusedRelL2 *float64 `json:"fused_rel_l2"`
	// The deterministic fused pattern (Options.Deterministic), the
	// row-parallel patterns only: null for allgather_gemm, which sums
	// nothing.
	FusedDeterministicMS          *float64 `json:"fused_deterministic_ms"`
	FusedDeterministicOverProduct *float64 `json:"fused_deterministic_over_product"`
	FusedDeterministicOverUnfused *float64 `json:"fused_deterministic_over_unfused"`
	FusedDeterministicRelL2       *float64 `json:"fused_deterministic_rel_l2"`
}

// label names the row in verdicts and errors.
func (r tpBenchRow) label() string { return fmt.Sprintf("%s at tp %d, %s", r.Shape, r.TP, r.Pattern) }

func cmdBenchTP(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench tp", benchTPUsage, stderr)
	shapesFlag := fs.String("shapes", "moe-small,llama70b", "comma-separated shapes")
	tpFlag := fs.String("tp", "2,4,8", "comma-separated numbers of tensor-parallel ranks (2 or more): virtual ranks, or GPUs with --gpus")
	iters := fs.Int("iters", 10, "timed steps of each kind (the median is kept)")
	backendName := fs.String("backend", "auto", "auto, cpu or cuda")
	onGPUs := fs.Bool("gpus", false, "one rank per GPU (tp W on GPUs 0..W-1, NCCL groups with peer access) instead of W virtual ranks of one device")
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
	place, closePlace, err := benchPlacer(b, *onGPUs, slices.Max(tps), tensorMesh, "bench tp", stderr)
	if err != nil {
		return err
	}
	defer closePlace()
	ranksPerDevice := func(tp int) int { return tp }
	if *onGPUs {
		ranksPerDevice = func(int) int { return 1 }
	}
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
				row := newTPRow(s, tp, p, ranksPerDevice(tp))
				if row.Skipped == "" {
					fmt.Fprintf(stderr, "bench tp: %s at tp %d, %s\n", s.Name, tp, p)
					world, bs, release, err := place(tp)
					if err != nil {
						return fmt.Errorf("bench tp: tp %d: %w", tp, err)
					}
					err = timeTPRow(bs, *onGPUs, clock, rng, world, s, &row, *iters)
					if err = errors.Join(err, release()); err != nil {
						return failedRun(fmt.Errorf("bench tp: %s: %w", row.label(), err))
					}
					runtime.GC() // the row's device memory back to the backend
				}
				rows = append(rows, row)
			}
		}
	}

	note, benchmark, ranksDesc := tpNote, "tp", "tp virtual ranks of one device"
	if *onGPUs { // its own file: one rank per GPU is not the virtual ranks' benchmark
		note, benchmark, ranksDesc = tpGPUsNote, "tp-gpus", "one rank per GPU"
	}
	printTP(stdout, rows, *iters, ranksDesc, note)
	bars := []barVerdict{tpFusedVerdict(rows), tpRSVerdict(rows)}
	names := make([]string, len(shapes))
	for i, s := range shapes {
		names[i] = s.Name
	}
	figures := map[string]any{
		"rows":               rows,
		"bars":               bars,
		"fused":              tpFusedAbout,
		"fused_check":        fmt.Sprintf("rank 0's outputs of one step of each fused pattern, before the timing, against one step of the unfused pattern's (relative L2 distance, largest over the outputs: allgather_gemm's gathered x and products, the row-parallel patterns' out); above %g the command fails", tpFusedTolerance),
		"overlap_efficiency": fmt.Sprintf("(product + comm - fused) / comm; null when comm is under %g of product", tpOverlapMinComm),
		"note":               note,
		"flops":              "every rank's products together: 2*R*K*N for allgather_gemm (N summed over its outputs), 2*R*F*N for gemm_reducescatter and gemm_allreduce",
		"timing": fmt.Sprintf("median of %d steps after 2 warm-up steps, in rounds that take one step of every path of the row in a balanced order (each path after every other equally often), each from a mark taken on rank 0 before any rank starts (barrier; on virtual ranks after a hold of the GPU behind which the ranks queue their ops) to one after every rank has returned (barrier), on the backend's clock (%s); fresh uniform random inputs in [-1, 1); float32",
			*iters, clockName(b)),
		"memory_budget_bytes": int64(tpMemoryBudget),
	}
	err = writeResult(stdout, *out, benchmark, b, benchResult{
		Benchmark: benchmark, Commit: commit(), Date: time.Now().UTC().Format(time.RFC3339),
		Command: "mktrain bench tp " + strings.Join(args, " "), Machine: machine(b.Name()),
		Recipe: strings.Join(names, "+"), Config: map[string]any{"shapes": shapes, "tp": tps, "iters": *iters, "gpus": *onGPUs},
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
// estimate, skipped when the share of one device (ranksPerDevice of the
// tp ranks' tensors: all of them on virtual ranks, one with --gpus)
// passes the budget.
func newTPRow(s tpBenchShape, tp int, p string, ranksPerDevice int) tpBenchRow {
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
	if p != tpAllGatherGEMM {
		// The deterministic fused pattern's slots: tp blocks of R/tp rows.
		perRank += 4 * int64(s.rows(tp)) * int64(s.Hidden)
	}
	row := tpBenchRow{Shape: s.Name, TP: tp, Pattern: p, Product: desc, Rows: s.rows(tp), FLOPs: s.flops(p, tp),
		MemoryBytes: int64(tp) * (perRank + largest)}
	if device := int64(ranksPerDevice) * (perRank + largest); device > tpMemoryBudget {
		row.Skipped = fmt.Sprintf("its tensors over the %d ranks of one device, about %.1f GiB, pass the %d GiB budget of one device", ranksPerDevice, float64(device)/(1<<30), tpMemoryBudget>>30)
		row.Fused = tpFusedSkipped
	}
	return row
}

// tpRank is one rank's group and backend, the kinds of work timed and the
// outputs the fused patterns are checked on.
type tpRank struct {
	ranks *comm.Ranks
	b     backend.Backend
	// ownDevice: the rank has a GPU of its own (bench tp --gpus), which
	// it waits for before a timed step counts as finished.
	ownDevice              bool
	product, unfused, coll func() error
	// fused and fusedDeterministic run the pattern through tensorpar's
	// fused ops (fusedDeterministic nil for allgather_gemm, which sums
	// nothing); fusedWhy says why they are not available ("" when they
	// are): tensorpar would run them unfused.
	fused, fusedDeterministic func() error
	fusedWhy                  string
	// checked are the outputs compared between the unfused and the fused
	// patterns, named in checkedNames.
	checked      []backend.Tensor
	checkedNames []string
}

// tpChunkLen is the length of the random chunk the tensors are filled
// from, each from a random offset; odd, so that the row blocks of the
// large tensors (multiples of 2^20 values) do not repeat the same values
// and a fused op that mixed up ranks' or blocks' rows would show.
const tpChunkLen = 1<<20 - 3

// timeTPRow allocates the row's tensors on every rank of world (one
// comm.Ranks per rank of a mesh of TP = row.TP, rank r's on bs[r]: the
// one device's virtual ranks, or with ownDevices one GPU each) and times
// the product alone, the unfused pattern, the collective alone and the
// fused patterns, checking the fused outputs against the unfused ones.
func timeTPRow(bs []backend.Backend, ownDevices bool, clock profile.Clock, rng *rand.Rand, world []*comm.Ranks, s tpBenchShape, row *tpBenchRow, iters int) error {
	layout, _ := s.layout(row.Pattern, row.TP)
	// Each rank's tensors are copies of a random chunk on its backend
	// (one a backend: virtual ranks share it): a cheap random fill of
	// large ones.
	chunks := map[backend.Backend]backend.Tensor{}
	for _, b := range bs {
		if chunks[b] == nil {
			chunks[b] = randFill(b, rng, tpChunkLen)
		}
	}
	fill := func(r int, t backend.Tensor) { fillFromChunk(bs[r], t, chunks[bs[r]], rng.IntN(tpChunkLen)) }
	ranks := make([]*tpRank, row.TP)
	for r := range ranks {
		b := bs[r]
		in := make([]backend.Tensor, len(layout.inputs))
		for i, shape := range layout.inputs {
			in[i] = b.New(b.FloatType(), shape...)
			fill(r, in[i])
		}
		outs := make([]backend.Tensor, len(layout.outputs))
		for i, shape := range layout.outputs {
			outs[i] = b.New(b.FloatType(), shape...)
		}
		ranks[r] = newTPRank(b, world[r], row.Pattern, in, outs)
		ranks[r].ownDevice = ownDevices
	}
	for b := range chunks {
		if err := b.Sync(); err != nil {
			return err
		}
	}
	ms := func(d time.Duration) *float64 { v := float64(d) / 1e6; return &v }
	// once runs one step of work on every rank, outside the timing, and
	// returns rank 0's checked outputs.
	once := func(work func(*tpRank) func() error) ([][]float32, error) {
		if _, _, _, err := oneRankStep(bs[0], clock, tpSteps(ranks, work), 0); err != nil {
			return nil, err
		}
		return ranks[0].download(), nil
	}
	unfusedOut, err := once(func(rk *tpRank) func() error { return rk.unfused })
	if err != nil {
		return err
	}
	path := func(name string, work func(*tpRank) func() error) *timedPath {
		return &timedPath{name: name, sample: rankSampler(bs[0], clock, tpSteps(ranks, work))}
	}
	paths := []*timedPath{
		path("product", func(rk *tpRank) func() error { return rk.product }),
		path("unfused", func(rk *tpRank) func() error { return rk.unfused }),
		path("collective", func(rk *tpRank) func() error { return rk.coll }),
	}
	fusedWhy := ""
	for _, rk := range ranks {
		fusedWhy = cmp.Or(fusedWhy, rk.fusedWhy)
	}
	type fusedKind struct {
		what      string
		work      func(*tpRank) func() error
		dst, rel2 **float64
		path      *timedPath
	}
	var fusedKinds []*fusedKind
	if fusedWhy == "" {
		for _, k := range []*fusedKind{
			{what: "fused", work: func(rk *tpRank) func() error { return rk.fused }, dst: &row.FusedMS, rel2: &row.FusedRelL2},
			{what: "deterministic fused", work: func(rk *tpRank) func() error { return rk.fusedDeterministic }, dst: &row.FusedDeterministicMS, rel2: &row.FusedDeterministicRelL2},
		} {
			if k.work(ranks[0]) == nil {
				continue
			}
			// Other values in the outputs first, so that a fused op that
			// left them alone cannot pass for one that wrote the unfused
			// results.
			for r, rk := range ranks {
				for _, t := range rk.checked {
					fill(r, t)
				}
			}
			fusedOut, err := once(k.work)
			if err != nil {
				return err
			}
			rel, worst := relL2Max(fusedOut, unfusedOut)
			*k.rel2 = &rel
			if !(rel <= tpFusedTolerance) {
				return fmt.Errorf("the %s pattern's %s on rank 0 differs from the unfused pattern's: relative L2 distance %.3g, above %g",
					k.what, ranks[0].checkedNames[worst], rel, tpFusedTolerance)
			}
			k.path = path(k.what, k.work)
			paths = append(paths, k.path)
			fusedKinds = append(fusedKinds, k)
		}
	}
	if _, err := timeInterleaved(paths, []string{"step"}, iters); err != nil {
		return err
	}
	row.ProductMS, row.UnfusedMS, row.CommMS = ms(paths[0].medians[0]), ms(paths[1].medians[0]), ms(paths[2].medians[0])
	pt, ut, ratio := tflops(row.FLOPs, *row.ProductMS), tflops(row.FLOPs, *row.UnfusedMS), *row.UnfusedMS / *row.ProductMS
	row.ProductTF, row.UnfusedTF, row.UnfusedOverProduct = &pt, &ut, &ratio
	if fusedWhy != "" {
		row.Fused = tpFusedNotAvailable + fusedWhy
		return nil
	}
	for _, k := range fusedKinds {
		*k.dst = ms(k.path.medians[0])
	}
	row.Fused = tpFusedMeasured
	fused := *row.FusedMS
	ft, fp, fu := tflops(row.FLOPs, fused), fused / *row.ProductMS, fused / *row.UnfusedMS
	row.FusedTF, row.FusedOverProduct, row.FusedOverUnfused = &ft, &fp, &fu
	row.OverlapEfficiency = overlapEfficiency(*row.ProductMS, *row.CommMS, fused)
	if d := row.FusedDeterministicMS; d != nil {
		dp, du := *d / *row.ProductMS, *d / *row.UnfusedMS
		row.FusedDeterministicOverProduct, row.FusedDeterministicOverUnfused = &dp, &du
	}
	return nil
}

// overlapEfficiency is (product + comm - fused) / comm, the share of the
// collective's time the fused pattern hides; nil when comm is under
// tpOverlapMinComm of product.
func overlapEfficiency(product, comm, fused float64) *float64 {
	if comm < tpOverlapMinComm*product || comm <= 0 {
		return nil
	}
	v := (product + comm - fused) / comm
	return &v
}

// relL2Max is the largest relative L2 distance of got[i] from want[i],
// and its i.
func relL2Max(got, want [][]float32) (float64, int) {
	if len(got) != len(want) {
		return math.Inf(1), 0
	}
	worst, at := 0.0, 0
	for i := range want {
		// NaN compares false: a NaN distance is kept as the worst.
		if d := relL2(got[i], want[i]); !(d <= worst) {
			worst, at = d, i
		}
	}
	return worst, at
}

// relL2 is |got - want| / |want| (0 when both are zero; +Inf when the
// lengths differ or only want is zero).
func relL2(got, want []float32) float64 {
	if len(got) != len(want) {
		return math.Inf(1)
	}
	var diff, norm float64
	for i, w := range want {
		e := float64(got[i]) - float64(w)
		diff += e * e
		norm += float64(w) * float64(w)
	}
	switch {
	case norm > 0:
		return math.Sqrt(diff / norm)
	case diff == 0:
		return 0
	}
	return math.Inf(1)
}

// newTPRank builds rank's kinds of work for pattern p over its tensor
// group, from the tensors layout lists.
func newTPRank(b backend.Backend, ranks *comm.Ranks, p string, in, outs []backend.Tensor) *tpRank {
	g := ranks.Tensor
	rk := &tpRank{ranks: ranks, b: b}
	sp := p != tpGEMMAllReduce // gemm_allreduce is the pattern without sequence parallelism
	fusedTP := tensorpar.NewWith(b, g, tensorpar.Options{SequenceParallel: sp, Fused: true})
	deterministicTP := tensorpar.NewWith(b, g, tensorpar.Options{SequenceParallel: sp, Fused: true, Deterministic: true})
	if !fusedTP.Fused() || !deterministicTP.Fused() {
		rk.fusedWhy = tpFusedUnavailable(g)
	}
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
		rk.fused = func() error { _, err := fusedTP.ColumnForward(full, shard, outs, ws, true); return err }
		// The gathered x too: the weight gradients read it.
		rk.checked, rk.checkedNames = []backend.Tensor{full}, []string{"gathered x"}
		for i, o := range outs {
			rk.checked = append(rk.checked, o)
			rk.checkedNames = append(rk.checkedNames, fmt.Sprintf("output %d", i+1))
		}
	case tpGEMMReduceScatter:
		a, w, partial, out := in[0], in[1], outs[0], outs[1]
		terms := []tensorpar.Term{{A: a, W: w, TransW: true}}
		rk.product = func() error { b.MatMul(partial, a, w, false, true, 1, 0); return nil }
		rk.unfused = func() error { return tensorpar.MatMulReduceScatter(b, g, out, partial, terms) }
		rk.coll = func() error { return g.ReduceScatterSum(out, partial) }
		rk.fused = func() error { return fusedTP.RowForward(out, partial, terms) }
		rk.fusedDeterministic = func() error { return deterministicTP.RowForward(out, partial, terms) }
		rk.checked, rk.checkedNames = []backend.Tensor{out}, []string{"reduce-scattered block"}
	default: // tpGEMMAllReduce
		a, w, out := in[0], in[1], outs[0]
		terms := []tensorpar.Term{{A: a, W: w, TransW: true}}
		rk.product = func() error { b.MatMul(out, a, w, false, true, 1, 0); return nil }
		rk.unfused = func() error { return tensorpar.MatMulAllReduce(b, g, out, terms) }
		// The product rewrites out each step; the collective alone sums
		// it again each step, growing it by tp, far from float32's range
		// in a dozen steps.
		rk.coll = func() error { return g.AllReduceSum(out) }
		rk.fused = func() error { return fusedTP.RowForward(out, nil, terms) }
		rk.fusedDeterministic = func() error { return deterministicTP.RowForward(out, nil, terms) }
		rk.checked, rk.checkedNames = []backend.Tensor{out}, []string{"all-reduced output"}
	}
	return rk
}

// tpFusedUnavailable says why tensorpar does not run the fused patterns
// over g.
func tpFusedUnavailable(g comm.Group) string {
	if _, ok := g.(comm.PeerAccess); !ok {
		return fmt.Sprintf("the tensor group (%T) offers no peer access (comm.PeerAccess), so tensorpar runs the patterns unfused", g)
	}
	return "tensorpar runs the patterns unfused over this group"
}

// download is rank's checked outputs on the host.
func (rk *tpRank) download() [][]float32 {
	out := make([][]float32, len(rk.checked))
	for i, t := range rk.checked {
		out[i] = backend.DownloadFloat32(rk.b, t)
	}
	return out
}

// fillFromChunk fills t with copies of chunk (a 1-D tensor) starting at
// chunk's value start, wrapping round, the last copy cut short.
func fillFromChunk(b backend.Backend, t, chunk backend.Tensor, start int) {
	n, c := t.Len(), chunk.Len()
	from := start % c
	for off := 0; off < n; {
		m := min(c-from, n-off)
		b.Copy(b.View(t, off, m), b.View(chunk, from, m))
		off += m
		from = 0
	}
}

// tpSteps is work on every rank as rankSteps bracketed by the tensor
// group's barriers, each rank waiting for its own device where it has one.
func tpSteps(ranks []*tpRank, work func(*tpRank) func() error) []rankStep {
	steps := make([]rankStep, len(ranks))
	for r, rk := range ranks {
		steps[r] = rankStep{group: rk.ranks.Tensor, ranks: rk.ranks, work: work(rk)}
		if rk.ownDevice {
			steps[r].device = rk.b
		}
	}
	return steps
}

// tpFusedMissing says why row r has no fused figures, or "" when it has.
func tpFusedMissing(r tpBenchRow) string {
	switch {
	case r.Skipped != "":
		return r.label() + " skipped: " + r.Skipped
	case r.FusedMS == nil:
		return r.label() + ": fused " + r.Fused
	}
	return ""
}

// tpFusedVerdict is the first bar, over the llama70b rows: held when
// every one has the fused pattern within 10% of the product alone and
// faster than unfused.
func tpFusedVerdict(rows []tpBenchRow) barVerdict {
	return tpBarVerdict(tpFusedBar, rows, "no "+tpFusedBarShape+" row in this run (--shapes)",
		func(r tpBenchRow) bool { return r.Shape == tpFusedBarShape },
		func(r tpBenchRow) bool {
			return *r.FusedMS <= tpFusedOverProductGoal**r.ProductMS && *r.FusedMS < *r.UnfusedMS
		},
		// How far from holding: past 1 on either count misses.
		func(r tpBenchRow) float64 {
			return max(*r.FusedMS/(tpFusedOverProductGoal**r.ProductMS), *r.FusedMS / *r.UnfusedMS)
		})
}

// tpRSVerdict is the second bar, over the gemm_reducescatter rows: held
// when the fused pattern is nowhere slower than unfused.
func tpRSVerdict(rows []tpBenchRow) barVerdict {
	return tpBarVerdict(tpRSBar, rows, "no "+tpGEMMReduceScatter+" row in this run",
		func(r tpBenchRow) bool { return r.Pattern == tpGEMMReduceScatter },
		func(r tpBenchRow) bool { return *r.FusedMS <= *r.UnfusedMS },
		func(r tpBenchRow) float64 { return *r.FusedMS / *r.UnfusedMS })
}

// tpBarVerdict judges bar over the rows it applies to: not measured when
// there are none (none says so) or one has no fused figures; else held
// when holds is true of every one. Why names the worst row (the largest
// score), the other rows that missed, and the shapes and tps judged.
func tpBarVerdict(bar string, rows []tpBenchRow, none string, applies, holds func(tpBenchRow) bool, score func(tpBenchRow) float64) barVerdict {
	v := barVerdict{Bar: bar}
	var shapes []string
	var tps, missed []int
	worst := -1
	for i, r := range rows {
		if !applies(r) {
			continue
		}
		if why := tpFusedMissing(r); why != "" {
			v.Verdict, v.Why = verdictNotMeasured, why
			return v
		}
		if !holds(r) {
			missed = append(missed, i)
		}
		if worst < 0 || !(score(r) <= score(rows[worst])) {
			worst = i
		}
		if !slices.Contains(shapes, r.Shape) {
			shapes = append(shapes, r.Shape)
		}
		if !slices.Contains(tps, r.TP) {
			tps = append(tps, r.TP)
		}
	}
	if worst < 0 {
		v.Verdict, v.Why = verdictNotMeasured, none
		return v
	}
	slices.Sort(tps)
	tpList := make([]string, len(tps))
	for i, tp := range tps {
		tpList[i] = fmt.Sprint(tp)
	}
	v.Verdict, v.Why = verdictHeld, "worst: "+tpFusedFigures(rows[worst])
	if len(missed) > 0 {
		v.Verdict = verdictNotHeld
		var others []string
		for _, i := range missed {
			if i != worst {
				others = append(others, rows[i].label())
			}
		}
		if len(others) > 0 {
			v.Why += "; also missed by " + strings.Join(others, "; ")
		}
	}
	v.Why += fmt.Sprintf("; over %s at tp %s", strings.Join(shapes, ", "), strings.Join(tpList, ", "))
	return v
}

// tpFusedFigures is a measured row's fused figures for a verdict.
func tpFusedFigures(r tpBenchRow) string {
	return fmt.Sprintf("%s (fused %.3f ms, %.2fx the product alone, %.2fx unfused)", r.label(), *r.FusedMS, *r.FusedOverProduct, *r.FusedOverUnfused)
}

// printTP prints the table of rows, measured on ranks (as the header
// says) and with note under it.
func printTP(w io.Writer, rows []tpBenchRow, iters int, ranks, note string) {
	fmt.Fprintf(w, "tp: tensor parallelism's patterns (tensorpar, unfused and fused) on %s, float32; ms from the first rank's start to the last rank's end, median of %d steps\n", ranks, iters)
	format := "%-10s %3s %-19s %7s | %10s %9s | %10s %9s | %9s | %10s %9s | %10s | %8s %6s %6s %7s | %7s\n"
	fmt.Fprintf(w, format, "shape", "tp", "pattern", "rows", "product ms", "TF", "unfused ms", "TF", "comm ms",
		"fused ms", "TF", "det ms", "unf/prod", "f/prod", "f/unf", "overlap", "rel L2")
	opt := func(p *float64, format string) string {
		if p == nil {
			return "-"
		}
		return fmt.Sprintf(format, *p)
	}
	var notes []string
	for _, r := range rows {
		rel := r.FusedRelL2
		if d := r.FusedDeterministicRelL2; d != nil && (rel == nil || *d > *rel) {
			rel = d
		}
		fmt.Fprintf(w, format, r.Shape, fmt.Sprint(r.TP), r.Pattern, fmt.Sprint(r.Rows), opt(r.ProductMS, "%.3f"), opt(r.ProductTF, "%.4g"),
			opt(r.UnfusedMS, "%.3f"), opt(r.UnfusedTF, "%.4g"), opt(r.CommMS, "%.3f"),
			opt(r.FusedMS, "%.3f"), opt(r.FusedTF, "%.4g"), opt(r.FusedDeterministicMS, "%.3f"),
			opt(r.UnfusedOverProduct, "%.2f"), opt(r.FusedOverProduct, "%.2f"), opt(r.FusedOverUnfused, "%.2f"),
			opt(r.OverlapEfficiency, "%.2f"), opt(rel, "%.1e"))
		switch {
		case r.Skipped != "":
			notes = append(notes, fmt.Sprintf("(skipped: %s: %s)", r.label(), r.Skipped))
		case strings.HasPrefix(r.Fused, tpFusedNotAvailable):
			notes = append(notes, fmt.Sprintf("(fused %s: %s)", r.label(), r.Fused))
		}
	}
	fmt.Fprintf(w, "(product: the same MatMul calls on already-gathered data, no collective; unfused: tensorpar's function, collective and products; comm: the collective alone; "+
		"fused: tensorpar.Options{Fused: true}, the backend's fused op over peer access; det: the same with Deterministic, row-parallel patterns only; TF: every rank's products over the time; "+
		"unf/prod, f/prod, f/unf: ratios of the times; overlap: (product + comm - fused) / comm, - when comm is under %g of product; "+
		"rel L2: the larger relative L2 distance of rank 0's fused and det outputs from the unfused ones, one step each before the timing, at most %g)\n", tpOverlapMinComm, tpFusedTolerance)
	fmt.Fprintf(w, "(%s)\n", note)
	for _, n := range notes {
		fmt.Fprintln(w, n)
	}
}
