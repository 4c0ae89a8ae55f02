package moe

// Measuring the dispatchers: both run the layer's forward and backward on
// the machine, on random weights and inputs, and Timing says which is
// faster. Neither wins everywhere (the fused one saves the all-to-alls and
// permutations but its kernels are tuned for some shapes more than
// others), so model.moe.dispatcher "auto" is settled by this measurement;
// package tune keeps its answers in a table on disk, so that each machine
// measures each shape once (tune.ResolveDispatcher), and `mktrain bench
// kernels` reports it.

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
)

// Timing is what MeasureDispatch measured: the median wall time of one
// step of every rank's layer, forward alone and forward+backward, with
// each dispatcher. A step ends when the device is idle and every rank is
// done, so it is the slowest rank's.
type Timing struct {
	Iters                       int // measured steps of each kind
	FusedForward, FusedStep     time.Duration
	UnfusedForward, UnfusedStep time.Duration
	// FusedExperts is the fused forward's expert block alone: its
	// dispatch+experts phase (PhaseDispatchExperts until PhaseCombine,
	// with the device idle and the ranks met at both ends), which runs
	// the gather, the three expert products, SwiGLU and the scatter back
	// to the sources. It is what compares with the expert GEMMs alone.
	FusedExperts time.Duration
	// RowsPerExpert are the token assignments of each expert ([E], over
	// all ranks) in the measured steps, before any capacity: expert-group
	// rank r's experts processed RowsPerExpert[r*E/ep : (r+1)*E/ep] rows
	// (all of them when dropless).
	RowsPerExpert []int
}

// Faster is the dispatcher with the shorter forward+backward; a tie goes
// to "unfused", the reference path.
func (t Timing) Faster() string {
	if t.FusedStep < t.UnfusedStep {
		return DispatcherFused
	}
	return DispatcherUnfused
}

// measureWarmup is the number of steps of each dispatcher run before
// MeasureDispatch starts its clock: the first compiles kernels and grows
// the layers' buffers.
const measureWarmup = 2

// MeasureDispatch times the layer cfg (model width dim, tokens local
// tokens per rank) on an in-process world of ep virtual expert-parallel
// ranks sharing b, with each dispatcher, on random weights and inputs: a
// warm-up, then iters forward passes and iters forward+backward passes of
// each, interleaved so that both see the same machine, then iters fused
// forward passes that time the expert block (Timing.FusedExperts). Every
// rank runs in its own goroutine, as in training; every step ends with
// b.Sync and a barrier. cfg.Dispatcher is ignored. The measurement allocates two layers
// per rank; they are garbage once it returns.
func MeasureDispatch(b backend.Backend, cfg Config, dim, tokens, ep, iters int) (Timing, error) {
	if ep < 1 || iters < 1 {
		return Timing{}, fmt.Errorf("moe: MeasureDispatch: %d ranks and %d steps; both must be at least 1", ep, iters)
	}
	world, err := comm.NewLocal(comm.Mesh{DP: 1, EP: ep, CP: 1, TP: 1}, b)
	if err != nil {
		return Timing{}, err
	}
	bs := make([]backend.Backend, ep)
	for r := range bs {
		bs[r] = b
	}
	return MeasureDispatchOn(world, bs, cfg, dim, tokens, iters)
}

// MeasureDispatchOn is MeasureDispatch on the ranks of world, rank r
// computing on bs[r]: the virtual ranks of one device (MeasureDispatch),
// or one rank per GPU with expert groups that offer peer access (mktrain
// bench kernels --gpus). The world is expert-parallel only: its expert
// group is the whole world.
func MeasureDispatchOn(world []*comm.Ranks, bs []backend.Backend, cfg Config, dim, tokens, iters int) (Timing, error) {
	ep := len(world)
	switch {
	case ep < 1 || iters < 1:
		return Timing{}, fmt.Errorf("moe: MeasureDispatch: %d ranks and %d steps; both must be at least 1", ep, iters)
	case len(bs) != ep:
		return Timing{}, fmt.Errorf("moe: MeasureDispatch: %d backends for %d ranks", len(bs), ep)
	}
	for r, rk := range world {
		if rk == nil || rk.Expert == nil || rk.Expert.Size() != ep || bs[r] == nil {
			return Timing{}, fmt.Errorf("moe: MeasureDispatch: rank %d: want a backend and an expert group of all %d ranks", r, ep)
		}
	}
	ranks := make([]*measureRank, ep)
	rng := rand.New(rand.NewPCG(uint64(ep), uint64(dim)))
	var err error
	for r := range ranks {
		if ranks[r], err = newMeasureRank(bs[r], cfg, dim, tokens, world[r], rng); err != nil {
			return Timing{}, fmt.Errorf("moe: MeasureDispatch: rank %d: %w", r, err)
		}
	}
	for _, b := range bs {
		if err := b.Sync(); err != nil {
			return Timing{}, err
		}
	}

	// The schedule every rank follows: warm-up, then the forward passes
	// and the forward+backward passes, the two dispatchers alternating.
	var passes []measurePass
	for range measureWarmup {
		passes = append(passes, measurePass{fused: true, backward: true}, measurePass{backward: true})
	}
	first := len(passes)
	for _, backward := range []bool{false, true} {
		for range iters {
			passes = append(passes, measurePass{fused: true, backward: backward}, measurePass{backward: backward})
		}
	}
	for range iters {
		passes = append(passes, measurePass{fused: true, block: true})
	}
	times := make([]time.Duration, len(passes))
	var wg sync.WaitGroup
	errs := make([]error, ep)
	for r, rk := range ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := rk.run(bs[r], passes, times, r == 0); err != nil {
				errs[r] = fmt.Errorf("moe: MeasureDispatch: rank %d: %w", r, err)
				world[r].Abort(errs[r])
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return Timing{}, err
	}

	median := func(want measurePass) time.Duration {
		var ts []time.Duration
		for i, p := range passes[first:] {
			if p == want {
				ts = append(ts, times[first+i])
			}
		}
		slices.Sort(ts)
		return ts[len(ts)/2]
	}
	t := Timing{
		Iters:          iters,
		FusedForward:   median(measurePass{fused: true}),
		FusedStep:      median(measurePass{fused: true, backward: true}),
		UnfusedForward: median(measurePass{}),
		UnfusedStep:    median(measurePass{backward: true}),
		FusedExperts:   median(measurePass{fused: true, block: true}),
	}
	for _, n := range ranks[0].stats.TokensPerExpert {
		t.RowsPerExpert = append(t.RowsPerExpert, int(math.Round(n)))
	}
	return t, nil
}

// measurePass is one step of MeasureDispatch's schedule. A block pass is
// a fused forward whose recorded time is its expert block's.
type measurePass struct{ fused, backward, block bool }

// measureRank is one virtual rank of MeasureDispatch: a layer of each
// dispatcher (sharing one Scratch, as the layers of a rank do in
// training) on the same weights and inputs.
type measureRank struct {
	fused, unfused *Layer
	p, g           *Params
	xTD, doutTD    backend.Tensor
	outTD, dxTD    backend.Tensor
	world          comm.Group
	stats          Stats // the last forward's
	// During a block pass, the fused layer's phase hook waits for the
	// device and the other ranks where the expert block starts and ends
	// (blockStart, blockEnd); hookErr is the first error of those waits.
	inBlock              bool
	blockStart, blockEnd time.Time
	hookErr              error
}

func newMeasureRank(b backend.Backend, cfg Config, dim, tokens int, rk *comm.Ranks, rng *rand.Rand) (*measureRank, error) {
	g := Groups{Expert: rk.Expert, Data: rk.Data}
	if g.Expert.Size() < 1 || cfg.Experts%g.Expert.Size() != 0 {
		return nil, fmt.Errorf("%d experts do not divide over %d ranks", cfg.Experts, g.Expert.Size())
	}
	local := cfg.Experts / g.Expert.Size()
	m := &measureRank{world: rk.World}
	scratch := NewScratch(b, dim, cfg.FFN)
	var err error
	for _, l := range []struct {
		dst  **Layer
		disp string
	}{{&m.fused, DispatcherFused}, {&m.unfused, DispatcherUnfused}} {
		c := cfg
		c.Dispatcher = l.disp
		opts := []Option{WithScratch(scratch)}
		if l.disp == DispatcherFused {
			opts = append(opts, WithPhaseHook(func(p Phase) { m.blockHook(b, p) }))
		}
		if *l.dst, err = New(b, c, dim, tokens, g, opts...); err != nil {
			return nil, err
		}
	}
	m.p, m.g = randomParams(b, cfg, dim, local, rng), NewParams(b, cfg, dim, local)
	m.xTD, m.doutTD = randomTensor(b, rng, 1, tokens, dim), randomTensor(b, rng, 1/math.Sqrt(float64(tokens)), tokens, dim)
	m.outTD, m.dxTD = b.New(b.FloatType(), tokens, dim), b.New(b.FloatType(), tokens, dim)
	return m, nil
}

// blockHook is the fused layer's phase hook: in a block pass it waits for
// the device and the other ranks where the expert block starts and ends,
// and notes the times.
func (m *measureRank) blockHook(b backend.Backend, p Phase) {
	if !m.inBlock || (p != PhaseDispatchExperts && p != PhaseCombine) {
		return
	}
	if err := b.Sync(); err != nil {
		m.hookErr = cmp.Or(m.hookErr, err)
	}
	if err := m.world.Barrier(); err != nil {
		m.hookErr = cmp.Or(m.hookErr, err)
	}
	if p == PhaseDispatchExperts {
		m.blockStart = time.Now()
	} else {
		m.blockEnd = time.Now()
	}
}

// run runs the passes; after each, the device is waited for and the ranks
// meet, and rank 0 (first) records the pass's wall time in times (a block
// pass: its expert block's).
func (m *measureRank) run(b backend.Backend, passes []measurePass, times []time.Duration, first bool) error {
	var l *Layer
	for i, p := range passes {
		l = m.unfused
		if p.fused {
			l = m.fused
		}
		start := time.Now()
		m.inBlock = p.block
		st, err := l.Forward(m.outTD, m.xTD, m.p, nil, 1)
		m.inBlock = false
		if err == nil {
			err = m.hookErr
		}
		if err != nil {
			return err
		}
		m.stats = st
		if p.backward {
			if err := l.Backward(m.dxTD, m.doutTD, m.p, m.g); err != nil {
				return err
			}
		}
		if err := b.Sync(); err != nil {
			return err
		}
		if err := m.world.Barrier(); err != nil {
			return err
		}
		if first {
			times[i] = time.Since(start)
			if p.block {
				times[i] = m.blockEnd.Sub(m.blockStart)
			}
		}
	}
	if l == nil {
		return nil
	}
	defer func() { m.fused.releaseStep(); m.unfused.releaseStep() }() // the layers are dropped
	return l.ReadStats(&m.stats)                                      // every rank: a collective over the data group
}

// randomParams draws a rank's weights: the expert matrices in the
// backend's operand type, as the engine passes them; the router's scale
// spreads the tokens over the experts.
func randomParams(b backend.Backend, cfg Config, dim, local int, rng *rand.Rand) *Params {
	F := cfg.FFN
	operand := func(scale float64, shape ...int) backend.Tensor {
		f := randomTensor(b, rng, scale, shape...)
		if b.OperandType() == b.FloatType() {
			return f
		}
		t := b.New(b.OperandType(), shape...)
		b.Copy(t, f)
		return t
	}
	p := &Params{
		GateED: randomTensor(b, rng, 1/math.Sqrt(float64(dim)), cfg.Experts, dim),
		W1EFD:  operand(1/math.Sqrt(float64(dim)), local, F, dim),
		W3EFD:  operand(1/math.Sqrt(float64(dim)), local, F, dim),
		W2EDF:  operand(1/math.Sqrt(float64(F)), local, dim, F),
	}
	if fs := cfg.SharedExperts * F; fs > 0 {
		p.SharedW1FD = operand(1/math.Sqrt(float64(dim)), fs, dim)
		p.SharedW3FD = operand(1/math.Sqrt(float64(dim)), fs, dim)
		p.SharedW2DF = operand(1/math.Sqrt(float64(fs)), dim, fs)
	}
	return p
}

// randomTensor is a float tensor of uniform values in [-scale, scale).
func randomTensor(b backend.Backend, rng *rand.Rand, scale float64, shape ...int) backend.Tensor {
	t := b.New(b.FloatType(), shape...)
	vals := make([]float32, t.Len())
	for i := range vals {
		vals[i] = float32(scale * (2*rng.Float64() - 1))
	}
	backend.UploadSlice(b, t, vals)
	return t
}
