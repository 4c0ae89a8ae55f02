package main

// mktrain bench kernels: the MoE layer's two dispatchers against each other
// and against the expert GEMMs alone, on the machine it runs on; the
// choices go to the dispatch table that model.moe.dispatcher: auto reads.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/moe"
	"github.com/mktrain/mktrain/tune"
)

const benchKernelsUsage = `Usage: mktrain bench kernels [--shape moe-small,fine] [--world 1,2,4,8] [--iters N] [--backend auto|cpu|cuda] [--gpus] [--out DIR]

Times one MoE layer, forward and forward+backward, with each dispatcher
(fused: the experts read their rows from the source ranks and write their
outputs straight back; unfused: gather, all-to-all, permute) on W virtual
expert-parallel ranks of one device, the experts' three forward products
alone (GroupedMatMul on the rows the layer routed), and the fused
forward's two kernels alone on those rows (without the layer's host work
around them), each step timed by itself and, as a training step queues
its layers, with a kind's steps queued back to back (k/g b2b). Shapes:
  moe-small  dim 1024, 8 experts, top-2, ffn 2816, 16384 tokens per rank
  fine       dim 2048, 64 experts, top-6, ffn 1408, 4096 tokens per rank
  tiny       dim 32, 4 experts, top-2, ffn 48, 64 tokens per rank (tests)
For each shape and W it prints the median times, the expert products'
TFLOP/s, the ratios fused / GEMM alone and fused / unfused, and whether two
bars hold: the fused expert block (the forward's gather, three products,
SwiGLU and scatter back to the sources: the data movement the fused
kernels hide) within 10% of the GEMMs alone, and the fused
forward+backward faster than the unfused one. The whole forward also
routes and combines, so it is shown beside the block but not held to the
first bar. Writes kernels.json (kernels-gpus.json with --gpus) into
bench/results/<machine>/ (the latest result per machine, overwritten by
the next run) or into the folder --out names, and stores each shape's
faster dispatcher in the dispatch table that model.moe.dispatcher: auto
reads (dispatch.json in $MKTRAIN_CACHE_DIR, else in the user cache
directory's mktrain folder).

With --gpus, world W is W ranks on GPUs 0..W-1, one each, their expert
group an NCCL communicator with peer access between the GPUs: the fused
kernels read and write the peers' rows over NVLink, the unfused path
exchanges them with NCCL's all-to-all. Those timings describe the links
between the GPUs, not one device, so they are not stored in the dispatch
table (which is keyed by one device).

Flags:
`

// kernelBenchShapes are bench kernels' layer shapes: moe-small's, and a
// fine-grained one whose 4096 tokens per rank fit eight virtual ranks on
// one H200.
func kernelBenchShapes() []moeBenchShape {
	return []moeBenchShape{
		{"moe-small", 1024, 8, 2, 2816, 16384},
		{"fine", 2048, 64, 6, 1408, 4096},
		{"tiny", 32, 4, 2, 48, 64},
	}
}

// The bars, as the table and the JSON name them.
const (
	gemmBarRatio = 1.10 // fused forward / GEMMs alone at most this
	gemmBar      = "fused expert block (forward) within 10% of the expert GEMMs alone"
	unfusedBar   = "fused forward+backward faster than unfused"
)

// kernelBenchRow is one shape at one world size. Times are medians per
// step of all ranks; TFLOP/s count the expert products of all ranks (the
// forward's three, three times that forward+backward).
type kernelBenchRow struct {
	Shape      string `json:"shape"`
	World      int    `json:"world"`
	TokensRank int    `json:"tokens_per_rank"`
	Rows       int    `json:"routed_rows"` // expert rows over all ranks

	GEMMMS         float64 `json:"gemm_forward_ms"`
	FusedKernelsMS float64 `json:"fused_kernels_ms"` // the fused forward's two kernels alone on the same rows
	// The same two, each kind's steps queued back to back with one sync
	// at the end, as a training step queues its layers.
	GEMMBackToBackMS         float64 `json:"gemm_forward_back_to_back_ms"`
	FusedKernelsBackToBackMS float64 `json:"fused_kernels_back_to_back_ms"`
	FusedBlockMS             float64 `json:"fused_expert_block_ms"`
	FusedForwardMS           float64 `json:"fused_forward_ms"`
	UnfusedForwardMS         float64 `json:"unfused_forward_ms"`
	FusedStepMS              float64 `json:"fused_forward_backward_ms"`
	UnfusedStepMS            float64 `json:"unfused_forward_backward_ms"`

	GEMMTF           float64 `json:"gemm_forward_tflops"`
	FusedForwardTF   float64 `json:"fused_forward_tflops"`
	UnfusedForwardTF float64 `json:"unfused_forward_tflops"`
	FusedStepTF      float64 `json:"fused_forward_backward_tflops"`
	UnfusedStepTF    float64 `json:"unfused_forward_backward_tflops"`

	FusedBlockOverGEMM      float64 `json:"fused_expert_block_over_gemm"`
	FusedKernelsOverGEMM    float64 `json:"fused_kernels_over_gemm"`
	FusedKernelsOverGEMMB2B float64 `json:"fused_kernels_over_gemm_back_to_back"`
	FusedOverGEMM           float64 `json:"fused_forward_over_gemm"`
	FusedOverUnfusedForward float64 `json:"fused_over_unfused_forward"`
	FusedOverUnfused        float64 `json:"fused_over_unfused_forward_backward"`
	GEMMBarHeld             bool    `json:"gemm_bar_held"`
	UnfusedBarHeld          bool    `json:"unfused_bar_held"`
	Choice                  string  `json:"choice"` // the faster dispatcher, as stored in the table
}

func cmdBenchKernels(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench kernels", benchKernelsUsage, stderr)
	shapesFlag := fs.String("shape", "moe-small,fine", "comma-separated shapes")
	worldFlag := fs.String("world", "1,2,4,8", "comma-separated world sizes: virtual ranks, or GPUs with --gpus")
	iters := fs.Int("iters", 10, "measured steps of each kind")
	backendName := fs.String("backend", "auto", "auto, cpu or cuda")
	onGPUs := fs.Bool("gpus", false, "one rank per GPU (world W on GPUs 0..W-1, NCCL with peer access) instead of W virtual ranks of one device")
	out := fs.String("out", "", "directory for the JSON result (default bench/results/<machine>)")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageError{"bench kernels takes no positional arguments"}
	}
	if *iters < 1 {
		return usageError{"--iters must be positive"}
	}
	shapes, err := pickNamed("--shape", *shapesFlag, kernelBenchShapes(), func(s moeBenchShape) string { return s.Name })
	if err != nil {
		return err
	}
	worlds, err := parseCounts("--world", *worldFlag, func(n int) bool { return n >= 1 }, "a positive number of ranks")
	if err != nil {
		return err
	}
	b, closeB, err := openBenchBackend(*backendName)
	if err != nil {
		return err
	}
	defer closeB()
	place, closePlace, err := benchPlacer(b, *onGPUs, slices.Max(worlds), expertMesh, "bench kernels", stderr)
	if err != nil {
		return err
	}
	defer closePlace()
	cache, cacheErr := tune.DefaultDispatchCache()
	table := cache.Path
	if *onGPUs {
		cacheErr = errors.New("--gpus measures the links between GPUs; the table is keyed by one device")
		table = ""
	}
	fmt.Fprintf(stderr, "bench kernels: on %s (%s), %d measured steps of each kind\n", b.Name(), tune.MachineName(b), *iters)

	var rows []kernelBenchRow
	for _, s := range shapes {
		for _, w := range worlds {
			if ctx.Err() != nil {
				return stoppedError(ctx, "bench kernels stopped")
			}
			if s.Experts%w != 0 {
				fmt.Fprintf(stderr, "bench kernels: %s: skipping world %d, which does not divide its %d experts\n", s.Name, w, s.Experts)
				continue
			}
			cfg := moe.Config{Experts: s.Experts, TopK: s.TopK, FFN: s.FFN}
			world, bs, release, err := place(w)
			if err != nil {
				return fmt.Errorf("bench kernels: world %d: %w", w, err)
			}
			tm, err := moe.MeasureDispatchOn(world, bs, cfg, s.Dim, s.Tokens, *iters)
			err = errors.Join(err, release())
			if err != nil {
				return fmt.Errorf("bench kernels: %s at world %d: %w", s.Name, w, err)
			}
			runtime.GC() // the layers' device memory back to the backend
			alone, err := benchExpertsAlone(bs, s, tm.RowsPerExpert, *iters)
			if err != nil {
				return fmt.Errorf("bench kernels: %s at world %d: GEMMs and fused kernels alone: %w", s.Name, w, err)
			}
			runtime.GC()
			rows = append(rows, kernelRow(s, w, tm, alone))
			if cacheErr == nil {
				_, cacheErr = cache.Store(tune.NewDispatchKey(b, cfg, s.Dim, s.Tokens, w), tm)
			}
		}
	}
	printKernelBench(stdout, rows)
	if cacheErr != nil {
		fmt.Fprintf(stderr, "bench kernels: the choices were not stored: %v\n", cacheErr)
	} else if len(rows) > 0 {
		fmt.Fprintf(stdout, "stored the faster dispatcher of each row in %s\n", cache.Path)
	}
	names := make([]string, len(shapes))
	for i, s := range shapes {
		names[i] = s.Name
	}
	benchmark := "kernels"
	if *onGPUs { // its own file: one rank per GPU is not the virtual ranks' benchmark
		benchmark = "kernels-gpus"
	}
	return writeResult(stdout, *out, benchmark, b, benchResult{
		Benchmark: benchmark, Commit: commit(), Date: time.Now().UTC().Format(time.RFC3339),
		Command: "mktrain bench kernels " + strings.Join(args, " "), Machine: machine(tune.MachineName(b)),
		Recipe: strings.Join(names, "+"), Config: map[string]any{"shapes": shapes, "iters": *iters, "gpus": *onGPUs},
		Figures: map[string]any{"rows": rows, "bars": []string{gemmBar, unfusedBar}, "dispatch_table": table},
	})
}

// kernelRow derives a row's rates, ratios and bars from the measured
// times.
func kernelRow(s moeBenchShape, world int, tm moe.Timing, alone expertsAlone) kernelBenchRow {
	gemm, kern := alone.gemm, alone.kernels
	rows := 0
	for _, n := range tm.RowsPerExpert {
		rows += n
	}
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	// The forward's three products of [rows, D] x [D, F].
	fwdFLOPs := 3 * 2 * float64(rows) * float64(s.Dim) * float64(s.FFN)
	tf := func(flops float64, d time.Duration) float64 { return flops / d.Seconds() / 1e12 }
	r := kernelBenchRow{
		Shape: s.Name, World: world, TokensRank: s.Tokens, Rows: rows,
		GEMMMS: ms(gemm), FusedKernelsMS: ms(kern),
		GEMMBackToBackMS: ms(alone.gemmB2B), FusedKernelsBackToBackMS: ms(alone.kernelsB2B),
		FusedBlockMS: ms(tm.FusedExperts), FusedForwardMS: ms(tm.FusedForward), UnfusedForwardMS: ms(tm.UnfusedForward),
		FusedStepMS: ms(tm.FusedStep), UnfusedStepMS: ms(tm.UnfusedStep),
		GEMMTF: tf(fwdFLOPs, gemm), FusedForwardTF: tf(fwdFLOPs, tm.FusedForward), UnfusedForwardTF: tf(fwdFLOPs, tm.UnfusedForward),
		FusedStepTF: tf(3*fwdFLOPs, tm.FusedStep), UnfusedStepTF: tf(3*fwdFLOPs, tm.UnfusedStep),
		FusedBlockOverGEMM:      tm.FusedExperts.Seconds() / gemm.Seconds(),
		FusedKernelsOverGEMM:    kern.Seconds() / gemm.Seconds(),
		FusedKernelsOverGEMMB2B: alone.kernelsB2B.Seconds() / alone.gemmB2B.Seconds(),
		FusedOverGEMM:           tm.FusedForward.Seconds() / gemm.Seconds(),
		FusedOverUnfusedForward: tm.FusedForward.Seconds() / tm.UnfusedForward.Seconds(),
		FusedOverUnfused:        tm.FusedStep.Seconds() / tm.UnfusedStep.Seconds(),
		Choice:                  tm.Faster(),
	}
	r.GEMMBarHeld = r.FusedBlockOverGEMM <= gemmBarRatio
	r.UnfusedBarHeld = tm.FusedStep < tm.UnfusedStep
	return r
}

// benchExpertsAlone times, on every rank's rows (rowsPerExpert, [E] over
// all ranks: rank r's experts are E/world of them), the experts' three
// forward products alone, as the layer runs them (expert-major operand
// rows times the stacked weights, one GroupedMatMul per product and
// rank), and the fused forward kernels alone on the same rows
// (DispatchSwiGLU and DownCombine per rank, the rows gathered from and
// written back to every source rank, flagged when there are peers),
// without the layer's host work around them. Rank r computes on bs[r] and
// keeps its source rows and outputs there: the virtual ranks of one
// device queue their work on it one after another; ranks on devices of
// their own run at once, each from its goroutine.
func benchExpertsAlone(bs []backend.Backend, s moeBenchShape, rowsPerExpert []int, iters int) (expertsAlone, error) {
	world := len(bs)
	if len(rowsPerExpert) != s.Experts {
		return expertsAlone{}, fmt.Errorf("%d expert row counts for %d experts", len(rowsPerExpert), s.Experts)
	}
	D, F, T, local := s.Dim, s.FFN, s.Tokens, s.Experts/world
	rng := rand.New(rand.NewPCG(uint64(world), uint64(D)))
	operand := func(b backend.Backend, scale float64, shape ...int) backend.Tensor {
		f := randTensor(b, rng, scale, shape...)
		if b.OperandType() == b.FloatType() {
			return f
		}
		t := b.New(b.OperandType(), shape...)
		b.Copy(t, f)
		return t
	}
	// Each expert's rows come from the world sources in equal shares, and
	// each source sends its rows in (destination, expert) order: a send
	// list of random tokens, its output rows and its flags.
	fromSE := make([][]int, world) // [source][expert] rows
	sent := make([]int, world)
	for src := range world {
		fromSE[src] = make([]int, s.Experts)
		for e, n := range rowsPerExpert {
			fromSE[src][e] = n / world
			if src < n%world {
				fromSE[src][e]++
			}
			sent[src] += fromSE[src][e]
		}
	}
	var srcTD, tokS, outSD, doneS []backend.Tensor
	for src, b := range bs {
		toks := make([]int32, sent[src])
		for i := range toks {
			toks[i] = int32(rng.IntN(T))
		}
		n := max(sent[src], 1)
		tok, out, done := b.New(backend.Int32, n), b.New(b.FloatType(), n, D), b.New(backend.Int32, n)
		backend.UploadSlice(b, tok, toks)
		// The layer's sources: its input in the operand type (moe.Layer's xoTD).
		srcTD = append(srcTD, operand(b, 1, T, D))
		tokS = append(tokS, b.View(tok, 0, sent[src]))
		outSD = append(outSD, b.View(out, 0, sent[src], D))
		doneS = append(doneS, b.View(done, 0, sent[src]))
	}
	if world == 1 {
		doneS = nil // a rank alone combines without flags, as in the layer
	}
	type rankWork struct {
		b                              backend.Backend
		rows                           []int
		xRD, h1RF, h3RF, actRF, refsR2 backend.Tensor
		yRD                            backend.Tensor
		w1, w3, w2                     backend.Tensor
	}
	var ranks []rankWork
	pos := make([]int, world) // each source's next send position
	for r, b := range bs {
		rows := rowsPerExpert[r*local : (r+1)*local]
		R := 0
		var blocks []backend.RowBlock
		for le := range local {
			for src := range world {
				n := fromSE[src][r*local+le]
				blocks = append(blocks, backend.RowBlock{First: R, Rank: src, Pos: pos[src]})
				R += n
				pos[src] += n
			}
		}
		if R == 0 {
			continue // nothing to multiply, as in the layer
		}
		refs := b.New(backend.Int32, R, 2)
		b.PeerRowRefs(refs, blocks)
		ot := b.OperandType()
		ranks = append(ranks, rankWork{
			b: b, rows: rows, refsR2: refs,
			xRD: operand(b, 1, R, D), h1RF: b.New(ot, R, F), h3RF: b.New(ot, R, F), actRF: b.New(ot, R, F), yRD: b.New(b.FloatType(), R, D),
			w1: operand(b, 0.03, local*F, D), w3: operand(b, 0.03, local*F, D), w2: operand(b, 0.03, local*D, F),
		})
	}
	gemms := func(g rankWork) {
		g.b.GroupedMatMul(g.h1RF, g.xRD, g.w1, backend.Groups{Rows: g.rows}, true, 1, 0)
		g.b.GroupedMatMul(g.h3RF, g.xRD, g.w3, backend.Groups{Rows: g.rows}, true, 1, 0)
		// The third product reads the SwiGLU output, of h1's shape and
		// type; the GEMM alone does not compute it.
		g.b.GroupedMatMul(g.yRD, g.h1RF, g.w2, backend.Groups{Rows: g.rows}, true, 1, 0)
	}
	fused := func(g rankWork) {
		g.b.DispatchSwiGLU(g.xRD, g.h1RF, g.h3RF, g.actRF, srcTD, tokS, g.refsR2, g.w1, g.w3, backend.Groups{Rows: g.rows})
		g.b.DownCombine(outSD, doneS, g.refsR2, g.actRF, g.w2, backend.Groups{Rows: g.rows})
	}
	devices := distinctBackends(bs)
	syncAll := func() error {
		for _, b := range devices {
			if err := b.Sync(); err != nil {
				return err
			}
		}
		return nil
	}
	runAll := func(work func(rankWork)) {
		if len(devices) == 1 {
			for _, g := range ranks {
				work(g)
			}
			return
		}
		var wg sync.WaitGroup
		for _, g := range ranks {
			wg.Go(func() { work(g) })
		}
		wg.Wait()
	}
	// timeSteps queues n steps of work with no sync between them and
	// returns their mean, timed until every device is done.
	timeSteps := func(work func(rankWork), n int) (time.Duration, error) {
		start := time.Now()
		for range n {
			runAll(work)
		}
		if err := syncAll(); err != nil {
			return 0, err
		}
		return time.Since(start) / time.Duration(n), nil
	}
	if err := syncAll(); err != nil {
		return expertsAlone{}, err
	}
	var a expertsAlone
	// Each step by itself, the two kinds alternately, so a drift of the
	// device's clock (it runs at its power cap under this load) meets
	// both alike; the medians.
	gemmTimes, fusedTimes := make([]time.Duration, iters), make([]time.Duration, iters)
	for i := -2; i < iters; i++ { // two warm-up steps of each
		g, err := timeSteps(gemms, 1)
		if err != nil {
			return a, err
		}
		f, err := timeSteps(fused, 1)
		if err != nil {
			return a, err
		}
		if i >= 0 {
			gemmTimes[i], fusedTimes[i] = g, f
		}
	}
	slices.Sort(gemmTimes)
	slices.Sort(fusedTimes)
	a.gemm, a.kernels = gemmTimes[iters/2], fusedTimes[iters/2]
	// Back to back: blocks of iters steps of one kind queued with no sync
	// between them (the device never idles for the host, and runs at the
	// clock it holds under sustained load); three blocks of each kind,
	// alternately, and the median block.
	var gemmBlocks, fusedBlocks [3]time.Duration
	for i := range gemmBlocks {
		var err error
		if gemmBlocks[i], err = timeSteps(gemms, iters); err != nil {
			return a, err
		}
		if fusedBlocks[i], err = timeSteps(fused, iters); err != nil {
			return a, err
		}
	}
	slices.Sort(gemmBlocks[:])
	slices.Sort(fusedBlocks[:])
	a.gemmB2B, a.kernelsB2B = gemmBlocks[1], fusedBlocks[1]
	return a, nil
}

// expertsAlone is what benchExpertsAlone measured: the medians over its
// steps of the time until every device is done, the expert products
// alone and the fused forward kernels alone, each step timed by itself
// (the two kinds alternately); and the same two queued back to back.
type expertsAlone struct {
	gemm, kernels       time.Duration
	gemmB2B, kernelsB2B time.Duration
}

// distinctBackends lists bs without repeats, in order.
func distinctBackends(bs []backend.Backend) []backend.Backend {
	var out []backend.Backend
	for _, b := range bs {
		if !slices.Contains(out, b) {
			out = append(out, b)
		}
	}
	return out
}

func printKernelBench(w io.Writer, rows []kernelBenchRow) {
	fmt.Fprintf(w, "%-10s %5s %8s | %9s %9s %9s %9s %9s | %9s %9s | %8s %8s %8s | %7s %7s %7s %7s %7s %7s | %-9s %-9s\n",
		"shape", "world", "rows", "gemm ms", "kern ms", "block ms", "fused ms", "unfus ms", "fused f+b", "unfus f+b",
		"gemm TF", "fused TF", "f+b TF", "krn/gem", "k/g b2b", "blk/gem", "f/gemm", "f/unf", "f+b f/u", "gemm bar", "unf bar")
	held := func(ok bool) string {
		if ok {
			return "held"
		}
		return "not held"
	}
	for _, r := range rows {
		fmt.Fprintf(w, "%-10s %5d %8d | %9.3f %9.3f %9.3f %9.3f %9.3f | %9.3f %9.3f | %8.3g %8.3g %8.3g | %7.2f %7.2f %7.2f %7.2f %7.2f %7.2f | %-9s %-9s\n",
			r.Shape, r.World, r.Rows, r.GEMMMS, r.FusedKernelsMS, r.FusedBlockMS, r.FusedForwardMS, r.UnfusedForwardMS, r.FusedStepMS,
			r.UnfusedStepMS, r.GEMMTF, r.FusedForwardTF, r.FusedStepTF, r.FusedKernelsOverGEMM, r.FusedKernelsOverGEMMB2B,
			r.FusedBlockOverGEMM, r.FusedOverGEMM,
			r.FusedOverUnfusedForward, r.FusedOverUnfused, held(r.GEMMBarHeld), held(r.UnfusedBarHeld))
	}
	fmt.Fprintf(w, "(ms: medians per step of all ranks, forward unless f+b; kern: the fused forward's two kernels alone on the layer's rows; k/g b2b: kern over gemm with each kind's steps queued back to back; block: the fused forward's expert block inside the layer; TF: TFLOP/s of the expert products; bars: gemm: %s (blk/gem <= %.2f); unf: %s)\n",
		gemmBar, gemmBarRatio, unfusedBar)
}
