package moe

// Choosing the dispatcher: model.moe.dispatcher "auto". Neither dispatcher
// wins everywhere (the fused one saves the all-to-alls and permutations but
// its kernels are tuned for some shapes more than others), so auto is
// settled by measurement: both dispatchers run the layer's forward and
// backward on the machine, and the faster one is kept in a small JSON
// table on disk, keyed by machine and layer shape, so that each machine
// measures each shape once. `mktrain bench kernels` writes the same table.
//
// The table lives in os.UserCacheDir()/mktrain/dispatch.json, or in
// $MKTRAIN_CACHE_DIR/dispatch.json when that is set. Deleting it makes the
// next run measure again.

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/kernels"
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
	for i, p := range passes {
		l := m.unfused
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
	return nil
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

// MachineName names the machine b computes on, for the dispatch table: the
// backend's name, followed by its device's where the backend tells it (an
// optional method DeviceName() string; a wrapper with Inner() is looked
// through). The CPU backend is "cpu".
func MachineName(b backend.Backend) string {
	if dn := lookThrough(b, func(d interface{ DeviceName() string }) string { return d.DeviceName() }); dn != "" {
		return b.Name() + "/" + dn
	}
	return b.Name()
}

// SoftwareName names the software under b's kernels, for the dispatch
// table: what the backend tells through an optional method
// SoftwareVersions() string (the CUDA backend: its driver's and NVRTC's
// versions), looked for as MachineName looks; "" when it tells nothing.
// A driver upgrade can change which dispatcher is faster, so it is part
// of the key.
func SoftwareName(b backend.Backend) string {
	return lookThrough(b, func(s interface{ SoftwareVersions() string }) string { return s.SoftwareVersions() })
}

// lookThrough returns get's answer for the first of b and the backends
// it wraps (Inner() backend.Backend) that implements T and answers
// something, or "".
func lookThrough[T any](b backend.Backend, get func(T) string) string {
	for b != nil {
		if t, ok := b.(T); ok {
			if v := get(t); v != "" {
				return v
			}
		}
		w, ok := b.(interface{ Inner() backend.Backend })
		if !ok {
			break
		}
		b = w.Inner()
	}
	return ""
}

// DispatchKey is what a measurement holds for: the machine, the software
// under the kernels (SoftwareName: a new driver is measured again), the
// build's kernels (kernels.Digest: new kernels are measured again) and the
// layer shape (tokens per rank, ep ranks).
type DispatchKey struct {
	Machine  string `json:"machine"`
	Software string `json:"software,omitempty"`
	Kernels  string `json:"kernels"`
	Dim      int    `json:"dim"`
	FFN      int    `json:"ffn"`
	Experts  int    `json:"experts"`
	TopK     int    `json:"top_k"`
	Tokens   int    `json:"tokens"`
	EP       int    `json:"ep"`
}

// NewDispatchKey is the key of layer cfg of width dim with tokens tokens
// per rank on ep expert-parallel ranks of b.
func NewDispatchKey(b backend.Backend, cfg Config, dim, tokens, ep int) DispatchKey {
	return DispatchKey{Machine: MachineName(b), Software: SoftwareName(b), Kernels: kernelsDigest(), Dim: dim, FFN: cfg.FFN, Experts: cfg.Experts, TopK: cfg.TopK, Tokens: tokens, EP: ep}
}

// kernelsDigest is kernels.Digest, or "unknown" should the embedded
// sources not read (then the table is only consulted for that same
// answer, which costs a measurement at worst).
func kernelsDigest() string {
	d, err := kernels.Digest()
	if err != nil {
		return "unknown"
	}
	return d
}

func (k DispatchKey) String() string {
	sw := ""
	if k.Software != "" {
		sw = ", " + k.Software
	}
	return fmt.Sprintf("%s (kernels %s%s): dim %d, ffn %d, %d experts, top-%d, %d tokens per rank, ep %d", k.Machine, k.Kernels, sw, k.Dim, k.FFN, k.Experts, k.TopK, k.Tokens, k.EP)
}

func (k DispatchKey) compare(o DispatchKey) int {
	return cmp.Or(cmp.Compare(k.Machine, o.Machine), cmp.Compare(k.Software, o.Software), cmp.Compare(k.Kernels, o.Kernels), cmp.Compare(k.Dim, o.Dim), cmp.Compare(k.FFN, o.FFN),
		cmp.Compare(k.Experts, o.Experts), cmp.Compare(k.TopK, o.TopK), cmp.Compare(k.Tokens, o.Tokens), cmp.Compare(k.EP, o.EP))
}

// DispatchEntry is one row of the dispatch table: a key, the dispatcher
// chosen for it and the times it was chosen on (milliseconds per step).
type DispatchEntry struct {
	DispatchKey
	Choice           string    `json:"choice"`
	FusedMS          float64   `json:"fused_forward_backward_ms"`
	UnfusedMS        float64   `json:"unfused_forward_backward_ms"`
	FusedForwardMS   float64   `json:"fused_forward_ms"`
	UnfusedForwardMS float64   `json:"unfused_forward_ms"`
	Iters            int       `json:"iters"`
	MeasuredAt       time.Time `json:"measured_at"`
}

// dispatchTable is the file's content.
type dispatchTable struct {
	Version int             `json:"version"`
	Entries []DispatchEntry `json:"entries"`
}

// dispatchTableVersion is the file format; a file of another version is
// ignored (and replaced by the next Store).
const dispatchTableVersion = 3

// DispatchCache is the dispatch table file at Path.
type DispatchCache struct{ Path string }

// DefaultDispatchCache is the table of this user: dispatch.json in
// $MKTRAIN_CACHE_DIR when it is set, else in os.UserCacheDir()/mktrain.
func DefaultDispatchCache() (DispatchCache, error) {
	dir := os.Getenv("MKTRAIN_CACHE_DIR")
	if dir == "" {
		base, err := os.UserCacheDir()
		if err != nil {
			return DispatchCache{}, fmt.Errorf("moe: no cache directory for the dispatch table (set MKTRAIN_CACHE_DIR): %w", err)
		}
		dir = filepath.Join(base, "mktrain")
	}
	return DispatchCache{Path: filepath.Join(dir, "dispatch.json")}, nil
}

// read returns the table's entries: none when the file does not exist or
// is of another version.
func (c DispatchCache) read() ([]DispatchEntry, error) {
	buf, err := os.ReadFile(c.Path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("moe: dispatch table: %w", err)
	}
	var t dispatchTable
	if err := json.Unmarshal(buf, &t); err != nil {
		return nil, fmt.Errorf("moe: dispatch table %s: %w", c.Path, err)
	}
	if t.Version != dispatchTableVersion {
		return nil, nil
	}
	return t.Entries, nil
}

// Lookup returns the entry for k, and whether there is one.
func (c DispatchCache) Lookup(k DispatchKey) (DispatchEntry, bool, error) {
	entries, err := c.read()
	if err != nil {
		return DispatchEntry{}, false, err
	}
	for _, e := range entries {
		if e.DispatchKey == k && (e.Choice == DispatcherFused || e.Choice == DispatcherUnfused) {
			return e, true, nil
		}
	}
	return DispatchEntry{}, false, nil
}

// Store records t's choice for k, replacing any entry for k, and returns
// the entry. The file is replaced whole (a temporary file renamed over
// it), so a reader never sees half of it; of two processes storing at
// once, the last one's table wins. A file that cannot be parsed is
// replaced.
func (c DispatchCache) Store(k DispatchKey, t Timing) (DispatchEntry, error) {
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	e := DispatchEntry{
		DispatchKey: k, Choice: t.Faster(),
		FusedMS: ms(t.FusedStep), UnfusedMS: ms(t.UnfusedStep),
		FusedForwardMS: ms(t.FusedForward), UnfusedForwardMS: ms(t.UnfusedForward),
		Iters: t.Iters, MeasuredAt: time.Now().UTC().Truncate(time.Second),
	}
	entries, _ := c.read() // an unreadable table is replaced
	entries = slices.DeleteFunc(entries, func(o DispatchEntry) bool { return o.DispatchKey == k })
	entries = append(entries, e)
	slices.SortFunc(entries, func(a, b DispatchEntry) int { return a.DispatchKey.compare(b.DispatchKey) })
	buf, err := json.MarshalIndent(dispatchTable{Version: dispatchTableVersion, Entries: entries}, "", "  ")
	if err != nil {
		return e, err
	}
	if err := writeAtomic(c.Path, append(buf, '\n')); err != nil {
		return e, fmt.Errorf("moe: dispatch table: %w", err)
	}
	return e, nil
}

// writeAtomic writes data to path through a temporary file in the same
// directory, renamed over path once complete.
func writeAtomic(path string, data []byte) (err error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, ".dispatch-*.tmp")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if _, err = f.Write(data); err != nil {
		return err
	}
	if err = f.Sync(); err != nil {
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

// resolveIters is the number of steps of each kind ResolveDispatcher
// measures (forward, and forward+backward): enough for a stable median of
// one layer's steps at little cost.
const resolveIters = 5

// ResolveDispatcher settles cfg.Dispatcher for a layer of width dim with
// tokens local tokens on ep expert-parallel ranks of b; canPeer says
// whether the expert group offers peer access (comm.PeerAccess). It
// returns "fused" or "unfused":
//
//   - "unfused" and "fused" pass through; "fused" without peer access is
//     an error.
//   - "auto" (or "") without peer access is "unfused": the fused path
//     needs it.
//   - "auto" on the CPU backend is "unfused", unmeasured: there the fused
//     ops are the unfused sequence of ops (the reference compositions), so
//     neither can be faster, and the unfused path is the reference.
//   - otherwise "auto" is the table's entry for this machine and shape
//     (DefaultDispatchCache), or, when there is none, the faster in a
//     measurement (MeasureDispatch) that is then stored. A table that
//     cannot be read or written costs a measurement, not the run.
//
// log, when not nil, receives one sentence on the choice and why
// (measured or from the table), and one before a measurement starts. All
// ranks of a run must use the same dispatcher: resolve once, before the
// ranks build their layers.
func ResolveDispatcher(b backend.Backend, cfg Config, dim, tokens, ep int, canPeer bool, log func(string)) (string, error) {
	say := func(format string, args ...any) {
		if log != nil {
			log(fmt.Sprintf(format, args...))
		}
	}
	switch cfg.Dispatcher {
	case DispatcherUnfused:
		say("model.moe.dispatcher: unfused, as the recipe says")
		return DispatcherUnfused, nil
	case DispatcherFused:
		if !canPeer {
			return "", fmt.Errorf("moe: model.moe.dispatcher is %q, but the expert group has no peer access: "+
				"in-process virtual ranks and the NCCL groups of one process offer it, groups across processes do not yet; use %q or %q",
				DispatcherFused, DispatcherUnfused, DispatcherAuto)
		}
		say("model.moe.dispatcher: fused, as the recipe says")
		return DispatcherFused, nil
	case DispatcherAuto, "":
	default:
		return "", fmt.Errorf("moe: model.moe.dispatcher is %q; want %q, %q or %q", cfg.Dispatcher, DispatcherAuto, DispatcherFused, DispatcherUnfused)
	}
	if !canPeer {
		say("model.moe.dispatcher auto: unfused, since the expert group has no peer access")
		return DispatcherUnfused, nil
	}
	if b.Name() == "cpu" {
		say("model.moe.dispatcher auto: unfused, unmeasured: on the CPU the fused ops are the unfused sequence")
		return DispatcherUnfused, nil
	}
	key := NewDispatchKey(b, cfg, dim, tokens, ep)
	cache, err := DefaultDispatchCache()
	if err == nil {
		e, ok, lerr := cache.Lookup(key)
		switch {
		case lerr != nil:
			say("model.moe.dispatcher auto: %v; measuring instead", lerr)
		case ok:
			say("model.moe.dispatcher auto: %s, from the table %s (measured %s: %.3g ms fused, %.3g ms unfused per forward+backward; %s)",
				e.Choice, cache.Path, e.MeasuredAt.Format(time.DateOnly), e.FusedMS, e.UnfusedMS, key)
			return e.Choice, nil
		}
	}
	say("model.moe.dispatcher auto: measuring both dispatchers (%s)", key)
	t, merr := MeasureDispatch(b, cfg, dim, tokens, ep, resolveIters)
	// The measurement's tensors are garbage now; collecting them hands
	// their device memory back to the backend before the model allocates.
	runtime.GC()
	if merr != nil {
		return "", fmt.Errorf("moe: measuring the dispatchers for model.moe.dispatcher auto (set it to %q or %q to skip): %w",
			DispatcherFused, DispatcherUnfused, merr)
	}
	stored := "not stored"
	switch {
	case err != nil:
		stored += ": " + err.Error()
	default:
		if _, serr := cache.Store(key, t); serr != nil {
			stored += ": " + serr.Error()
		} else {
			stored = "stored in " + cache.Path
		}
	}
	say("model.moe.dispatcher auto: %s, measured: %.3g ms fused, %.3g ms unfused per forward+backward (%s)",
		t.Faster(), float64(t.FusedStep)/1e6, float64(t.UnfusedStep)/1e6, stored)
	return t.Faster(), nil
}
