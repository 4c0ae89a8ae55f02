package main

// mktrain bench moe: one MoE layer, forward and backward, on W virtual
// expert-parallel ranks of one device, with the unfused path's time split
// by phase (routing, count exchange, dispatch, expert GEMMs, combine).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/all"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/registry"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
)

const benchMoEUsage = `Usage: mktrain bench moe [--shape moe-small,fine] [--world 1,2,4,8] [--steps N] [--warmup N] [--backend auto|cpu|cuda] [--out DIR]

Times one MoE layer (router, dispatch, experts, combine), forward and
forward+backward, on W virtual expert-parallel ranks sharing one device
(W divides the experts; each rank routes its own tokens). Shapes:
  moe-small  dim 1024, 8 experts, top-2, ffn 2816, 16384 tokens per rank
  fine       dim 2048, 64 experts, top-6, ffn 1408, 16384 tokens per rank
  tiny       dim 32, 4 experts, top-2, ffn 48, 64 tokens per rank (tests)
For each shape and W it prints the median step times, the expert GEMMs'
rate (their FLOPs over the forward+backward time) and the time of each
phase. Phases are timed in separate steps that wait for the device and
for every rank at each phase boundary, so they add up to more than the
overlapped step. Writes moe.json into bench/results/<machine>/ (the
latest result per machine, overwritten by the next run) or into the
folder --out names.

Flags:
`

// moeBenchShape is one layer shape of the benchmark.
type moeBenchShape struct {
	Name                    string
	Dim, Experts, TopK, FFN int
	Tokens                  int // per rank
}

func moeBenchShapes() []moeBenchShape {
	return []moeBenchShape{
		{"moe-small", 1024, 8, 2, 2816, 16384},
		{"fine", 2048, 64, 6, 1408, 16384},
		{"tiny", 32, 4, 2, 48, 64},
	}
}

// expertFLOPs is the expert GEMMs' work per rank and forward: three
// products of [tokens*topk, dim] x [dim, ffn].
func (s moeBenchShape) expertFLOPs() float64 {
	return 3 * 2 * float64(s.Tokens*s.TopK) * float64(s.Dim) * float64(s.FFN)
}

// moeBenchRow is the result of one shape at one world size.
type moeBenchRow struct {
	Shape      string             `json:"shape"`
	World      int                `json:"world"`
	ForwardMS  float64            `json:"forward_ms"`
	StepMS     float64            `json:"forward_backward_ms"`
	ExpertTF   float64            `json:"expert_gemm_tflops"` // all ranks' expert GEMM FLOPs (forward and backward) over StepMS
	PhasesMS   map[string]float64 `json:"phases_ms"`          // per phase, from the phase-timed steps
	PhasedMS   float64            `json:"phased_step_ms"`     // their sum
	TokensRank int                `json:"tokens_per_rank"`
}

func cmdBenchMoE(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench moe", benchMoEUsage, stderr)
	shapesFlag := fs.String("shape", "moe-small,fine", "comma-separated shapes")
	worldFlag := fs.String("world", "1,2,4,8", "comma-separated numbers of virtual ranks")
	steps := fs.Int("steps", 10, "measured steps")
	warmup := fs.Int("warmup", 3, "steps run before measuring")
	backendName := fs.String("backend", "auto", "auto, cpu or cuda")
	out := fs.String("out", "", "directory for the JSON result (default bench/results/<machine>)")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageError{"bench moe takes no positional arguments"}
	}
	if *steps < 1 || *warmup < 0 {
		return usageError{"--steps must be positive and --warmup not negative"}
	}
	shapes, err := pickNamed("--shape", *shapesFlag, moeBenchShapes(), func(s moeBenchShape) string { return s.Name })
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
	fmt.Fprintf(stderr, "bench moe: on %s, %d warmup + %d measured steps\n", b.Name(), *warmup, *steps)

	var rows []moeBenchRow
	for _, s := range shapes {
		for _, w := range worlds {
			if ctx.Err() != nil {
				return stoppedError(ctx, "bench moe stopped")
			}
			if s.Experts%w != 0 {
				fmt.Fprintf(stderr, "bench moe: %s: skipping world %d, which does not divide its %d experts\n", s.Name, w, s.Experts)
				continue
			}
			row, err := benchMoELayer(b, s, w, *warmup, *steps)
			if err != nil {
				return fmt.Errorf("bench moe: %s at world %d: %w", s.Name, w, err)
			}
			rows = append(rows, row)
		}
	}
	printMoEBench(stdout, rows)
	names := make([]string, len(shapes))
	for i, s := range shapes {
		names[i] = s.Name
	}
	return writeResult(stdout, *out, "moe", b, benchResult{
		Benchmark: "moe", Commit: commit(), Date: time.Now().UTC().Format(time.RFC3339),
		Command: "mktrain bench moe " + strings.Join(args, " "), Machine: machine(b.Name()),
		Recipe: strings.Join(names, "+"), Config: shapes,
		Figures: map[string]any{"rows": rows, "phases": moePhases()},
	})
}

// openBenchBackend opens the backend --backend names (package
// backend/all's drivers); auto takes the first device there is, and, unlike
// train.backend: auto, fails on a device that is there but fails: a
// benchmark should not quietly measure the CPU.
func openBenchBackend(name string) (backend.Backend, func(), error) {
	drivers, err := registry.NewSet(all.Drivers()...)
	if err != nil {
		return nil, nil, err
	}
	switch name {
	case "cpu":
		return cpu.New(backend.Float32), func() {}, nil
	case "cuda":
		opened, err := drivers.Open(name, nil)
		if err != nil {
			return nil, nil, fmt.Errorf("--backend %s: %w", name, err)
		}
		return opened.Backend, func() { opened.Close() }, nil
	case "auto":
		for _, d := range drivers.Drivers() {
			dev, err := d.Open()
			var none *registry.NoDeviceError
			switch {
			case err == nil:
				return dev, func() { dev.Close() }, nil
			case !errors.As(err, &none):
				return nil, nil, fmt.Errorf("--backend %s: %w", name, err)
			}
		}
		return cpu.New(backend.Float32), func() {}, nil
	}
	return nil, nil, usageError{fmt.Sprintf("--backend: %q is not auto, cpu or cuda", name)}
}

// moePhases lists the phases in the order the layer runs them.
func moePhases() []moe.Phase {
	return []moe.Phase{moe.PhaseRoute, moe.PhaseCountExchange, moe.PhaseDispatch, moe.PhaseExperts, moe.PhaseCombine,
		moe.PhaseRouterBackward, moe.PhaseDispatchBackward, moe.PhaseExpertsBackward, moe.PhaseCombineBackward}
}

// moeBenchRank is one virtual rank's layer and tensors.
type moeBenchRank struct {
	layer        *moe.Layer
	p, g         *moe.Params
	xTD, outTD   backend.Tensor
	doutTD, dxTD backend.Tensor
	phaseErr     error
}

// phaseClock accumulates, on rank 0, the wall time between phase
// boundaries; every rank waits for the device and for the others at each
// boundary, so a phase's time is the slowest rank's.
type phaseClock struct {
	on    bool
	last  time.Time
	cur   moe.Phase
	total map[moe.Phase]time.Duration
}

func benchMoELayer(b backend.Backend, s moeBenchShape, world, warmup, steps int) (moeBenchRow, error) {
	mesh := comm.Mesh{DP: 1, EP: world, CP: 1, TP: 1}
	groups, err := comm.NewLocal(mesh, b)
	if err != nil {
		return moeBenchRow{}, err
	}
	cfg := moe.Config{Experts: s.Experts, TopK: s.TopK, FFN: s.FFN, Dispatcher: moe.DispatcherUnfused}
	clock := &phaseClock{total: map[moe.Phase]time.Duration{}}
	ranks := make([]*moeBenchRank, world)
	rng := rand.New(rand.NewPCG(uint64(world), uint64(s.Dim)))
	for r := range ranks {
		rk := &moeBenchRank{}
		hook := func(ph moe.Phase) {
			if !clock.on {
				return
			}
			// Wait for the device and for every rank, then close the
			// phase on rank 0.
			if err := b.Sync(); err != nil && rk.phaseErr == nil {
				rk.phaseErr = err
			}
			if err := groups[r].World.Barrier(); err != nil && rk.phaseErr == nil {
				rk.phaseErr = err
			}
			if r == 0 {
				now := time.Now()
				if clock.cur != "" && clock.cur != moe.PhaseEnd {
					clock.total[clock.cur] += now.Sub(clock.last)
				}
				clock.cur, clock.last = ph, now
			}
			// No rank may start the next phase before rank 0 has read
			// the clock.
			if err := groups[r].World.Barrier(); err != nil && rk.phaseErr == nil {
				rk.phaseErr = err
			}
		}
		g := moe.Groups{Expert: groups[r].Expert, Data: groups[r].Data}
		rk.layer, err = moe.New(b, cfg, s.Dim, s.Tokens, g, moe.WithPhaseHook(hook))
		if err != nil {
			return moeBenchRow{}, err
		}
		rk.p, rk.g = benchMoEParams(b, cfg, s.Dim, s.Experts/world, rng), moe.NewParams(b, cfg, s.Dim, s.Experts/world)
		rk.xTD, rk.doutTD = randTensor(b, rng, 1, s.Tokens, s.Dim), randTensor(b, rng, 1, s.Tokens, s.Dim)
		rk.outTD, rk.dxTD = b.New(b.FloatType(), s.Tokens, s.Dim), b.New(b.FloatType(), s.Tokens, s.Dim)
		ranks[r] = rk
	}
	// runAll runs n steps on every rank, with a device sync and a barrier
	// after each, and returns rank 0's step times.
	runAll := func(n int, backward bool) ([]time.Duration, error) {
		times := make([]time.Duration, n)
		var wg sync.WaitGroup
		errs := make([]error, world)
		for r, rk := range ranks {
			wg.Add(1)
			go func() {
				defer wg.Done()
				err := rk.steps(b, groups[r].World, n, backward, times, r == 0)
				if err == nil {
					err = rk.phaseErr
				}
				if err != nil {
					errs[r] = fmt.Errorf("rank %d: %w", r, err)
					groups[r].Abort(errs[r])
				}
			}()
		}
		wg.Wait()
		return times, errors.Join(errs...)
	}
	median := func(ts []time.Duration) float64 {
		ts = slices.Clone(ts)
		slices.Sort(ts)
		return float64(ts[len(ts)/2]) / 1e6
	}
	row := moeBenchRow{Shape: s.Name, World: world, TokensRank: s.Tokens, PhasesMS: map[string]float64{}}
	if _, err := runAll(warmup, true); err != nil {
		return row, err
	}
	fwd, err := runAll(steps, false)
	if err != nil {
		return row, err
	}
	step, err := runAll(steps, true)
	if err != nil {
		return row, err
	}
	row.ForwardMS, row.StepMS = median(fwd), median(step)
	// Forward and backward: the forward's three products, and twice that
	// (input and weight gradients) in the backward.
	row.ExpertTF = 3 * s.expertFLOPs() * float64(world) / (row.StepMS / 1e3) / 1e12

	clock.on = true
	if _, err := runAll(steps, true); err != nil {
		return row, err
	}
	clock.on = false
	for _, ph := range moePhases() {
		ms := float64(clock.total[ph]) / 1e6 / float64(steps)
		row.PhasesMS[string(ph)] = ms
		row.PhasedMS += ms
	}
	return row, nil
}

// steps runs n forward (and backward) passes, each followed by a device
// sync and a barrier; rank 0 (first) records each step's wall time.
func (rk *moeBenchRank) steps(b backend.Backend, world comm.Group, n int, backward bool, times []time.Duration, first bool) error {
	for i := range n {
		start := time.Now()
		if _, err := rk.layer.Forward(rk.outTD, rk.xTD, rk.p, nil, 1); err != nil {
			return err
		}
		if backward {
			if err := rk.layer.Backward(rk.dxTD, rk.doutTD, rk.p, rk.g); err != nil {
				return err
			}
		}
		if err := b.Sync(); err != nil {
			return err
		}
		if err := world.Barrier(); err != nil {
			return err
		}
		if first {
			times[i] = time.Since(start)
		}
	}
	return nil
}

// benchMoEParams draws a rank's weights, the expert matrices in the
// backend's operand type as the engine passes them (rounded from float
// draws); the router's scale spreads the tokens over the experts.
func benchMoEParams(b backend.Backend, cfg moe.Config, dim, local int, rng *rand.Rand) *moe.Params {
	F := cfg.FFN
	p := &moe.Params{GateED: randTensor(b, rng, 1/math.Sqrt(float64(dim)), cfg.Experts, dim)}
	operand := func(scale float64, shape ...int) backend.Tensor {
		f := randTensor(b, rng, scale, shape...)
		if b.OperandType() == b.FloatType() {
			return f
		}
		t := b.New(b.OperandType(), shape...)
		b.Copy(t, f)
		return t
	}
	p.W1EFD = operand(1/math.Sqrt(float64(dim)), local, F, dim)
	p.W3EFD = operand(1/math.Sqrt(float64(dim)), local, F, dim)
	p.W2EDF = operand(1/math.Sqrt(float64(F)), local, dim, F)
	return p
}

// randTensor is a float tensor of uniform values in [-scale, scale).
func randTensor(b backend.Backend, rng *rand.Rand, scale float64, shape ...int) backend.Tensor {
	n := 1
	for _, d := range shape {
		n *= d
	}
	vals := make([]float32, n)
	for i := range vals {
		vals[i] = float32(scale * (2*rng.Float64() - 1))
	}
	t := b.New(b.FloatType(), shape...)
	backend.UploadSlice(b, t, vals)
	return t
}

func printMoEBench(w io.Writer, rows []moeBenchRow) {
	short := []string{"route", "counts", "dispatch", "experts", "combine", "r.bwd", "d.bwd", "e.bwd", "c.bwd"}
	fmt.Fprintf(w, "%-10s %5s %9s %9s %9s", "shape", "world", "fwd ms", "step ms", "GEMM TF/s")
	for _, s := range short {
		fmt.Fprintf(w, " %8s", s)
	}
	fmt.Fprintln(w)
	for _, r := range rows {
		fmt.Fprintf(w, "%-10s %5d %9.2f %9.2f %9.3g", r.Shape, r.World, r.ForwardMS, r.StepMS, r.ExpertTF)
		for _, ph := range moePhases() {
			fmt.Fprintf(w, " %8.2f", r.PhasesMS[string(ph)])
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintln(w, "(phase columns: ms per step from steps that sync at every phase boundary; step ms overlaps nothing across ranks either, each step ends with a sync)")
}
