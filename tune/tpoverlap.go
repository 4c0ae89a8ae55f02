package tune

// parallel.tp_overlap: auto. Whether tensor parallelism's fused ops
// (tensorpar.Options.Fused: the all-gather inside the column-parallel
// products, the reduce-scatter in the row-parallel product's epilogue)
// beat the collectives around the products depends on the machine and the
// shape. Package tensorpar holds no measurement of its own, so this file
// times the two paths on virtual ranks of one device (MeasureTPOverlap)
// and keeps the answers in tp_overlap.json, beside the dispatch table.

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"time"

	"github.com/mktrain/mktrain/attention"
	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/internal/ranktime"
	"github.com/mktrain/mktrain/tensorpar"
)

// parallel.tp_overlap's values.
const (
	TPOverlapAuto    = "auto"    // measure and pick
	TPOverlapFused   = "fused"   // the backend's fused ops, where the group offers peer access
	TPOverlapUnfused = "unfused" // the collectives around the products: the reference
)

// tpResolveIters is the passes of each path ResolveTPOverlap times: one
// layer's column- and row-parallel forward products, enough for a stable
// median; tpMeasureWarmup passes of each run before them (kernel loading,
// the allocator's first sizes, the fused path's slots).
const (
	tpResolveIters  = 5
	tpMeasureWarmup = 1
)

// TPOverlapCase is what ResolveTPOverlap settles the path for: the
// recipe's value, the attention shape, the rows of a micro-batch and the
// tensor group: its size, its mode, and whether all of its ranks share
// one device.
type TPOverlapCase struct {
	Mode string // parallel.tp_overlap: fused, unfused, auto ("" is auto)
	// Shape is the model's attention (all heads); each tp rank multiplies
	// by its share (attention.TensorParallelShape).
	Shape attention.Shape
	// Rows is the rows T of a micro-batch a tensor group works on:
	// micro_batch*seq/cp, a multiple of TP.
	Rows int
	TP   int
	// SequenceParallel is parallel.sequence_parallel: the ranks hold
	// shards of the rows between the products (gathered before the
	// column-parallel ones, reduce-scattered after the row-parallel one)
	// rather than all of them (all-reduced after the row-parallel one).
	SequenceParallel bool
	// OneDevice says the ranks of each tensor group are virtual ranks of
	// one device (the backend's); false for one rank per GPU or ranks in
	// several processes.
	OneDevice bool
	// Deterministic is train.deterministic: the run must repeat bit for
	// bit, so a timing must not choose.
	Deterministic bool
}

// ResolveTPOverlap settles parallel.tp_overlap for c on b and returns
// "fused" or "unfused":
//
//   - "fused" and "unfused" pass through (said in the log only with more
//     than one tensor rank). Fused still runs the collectives where a
//     group offers no peer access (tensorpar.Parallel.Fused says which).
//   - "auto" (or "") with one tensor rank is "unfused", silently: nothing
//     moves between ranks, and the path is never used.
//   - "auto" on the CPU backend is "unfused", unmeasured: the CPU's fused
//     ops are the unfused sequences (its twins of the kernels), so they
//     have nothing to overlap.
//   - "auto" under train.deterministic is "unfused", unmeasured: a timing
//     could choose differently from run to run, and the two paths round
//     differently on the GPU.
//   - "auto" with a rank per GPU or ranks in several processes is
//     "unfused", unmeasured: the measurement runs on virtual ranks of one
//     device, which says nothing of the links between GPUs or nodes (and
//     nodes measuring for themselves could disagree). Ask for fused to
//     use it between the GPUs of one process.
//   - otherwise "auto" is the table's entry for this machine and case
//     (DefaultTPOverlapCache), or, when there is none, the faster path in
//     a measurement on c.TP virtual ranks of b (MeasureTPOverlap), which
//     is then stored. A table that cannot be read or written costs a
//     measurement, not the run.
//
// log, when not nil, receives one sentence on the choice and why. All
// ranks of a run must take the same path: resolve once, before the ranks
// build their layers.
func ResolveTPOverlap(b backend.Backend, c TPOverlapCase, log func(string)) (string, error) {
	say := sayTo(log)
	switch c.Mode {
	case TPOverlapFused, TPOverlapUnfused:
		if c.TP > 1 {
			say("parallel.tp_overlap: %s, as the recipe says", c.Mode)
		}
		return c.Mode, nil
	case TPOverlapAuto, "":
	default:
		return "", fmt.Errorf("tensorpar: parallel.tp_overlap is %q; want %q, %q or %q", c.Mode, TPOverlapAuto, TPOverlapFused, TPOverlapUnfused)
	}
	switch {
	case c.TP <= 1:
		return TPOverlapUnfused, nil
	case b.Name() == "cpu":
		say("parallel.tp_overlap auto: unfused, unmeasured: on the CPU the fused ops are the unfused sequences, with nothing to overlap")
		return TPOverlapUnfused, nil
	case c.Deterministic:
		say("parallel.tp_overlap auto: unfused, unmeasured, as train.deterministic asks")
		return TPOverlapUnfused, nil
	case !c.OneDevice:
		say("parallel.tp_overlap auto: unfused, unmeasured: the tensor-parallel ranks are on separate GPUs or nodes, whose links a measurement on virtual ranks would not see (fused asks for peer access between the GPUs of one process)")
		return TPOverlapUnfused, nil
	}
	key := NewTPOverlapKey(b, c)
	cache, noTable := DefaultTPOverlapCache()
	return settling[TPOverlapEntry, TPOverlapTiming]{
		setting: "parallel.tp_overlap auto", what: "both paths", key: key,
		path: cache.Path, noTable: noTable,
		lookup: func() (TPOverlapEntry, bool, error) { return cache.Lookup(key) },
		store:  func(t TPOverlapTiming) error { _, err := cache.Store(key, t); return err },
		measure: func() (TPOverlapTiming, error) {
			t, err := MeasureTPOverlap(b, c, tpResolveIters)
			if err != nil {
				err = fmt.Errorf("tensorpar: measuring the paths for parallel.tp_overlap auto (set it to %q or %q to skip): %w", TPOverlapFused, TPOverlapUnfused, err)
			}
			return t, err
		},
		entry: func(e TPOverlapEntry) (string, string) {
			return e.Choice, fmt.Sprintf("measured %s: %.3g ms fused, %.3g ms unfused per column+row forward",
				e.MeasuredAt.Format(time.DateOnly), e.FusedMS, e.UnfusedMS)
		},
		timing: func(t TPOverlapTiming) (string, string) {
			return t.Faster(), fmt.Sprintf("%.3g ms fused, %.3g ms unfused per column+row forward on %d virtual ranks",
				float64(t.Fused)/1e6, float64(t.Unfused)/1e6, c.TP)
		},
	}.settle(say)
}

// TPOverlapTiming is a measurement of the two paths: the median over
// Iters passes on rank 0 of one layer's column-parallel q, k, v products
// and row-parallel o_proj product, the ranks meeting before and after
// each pass.
type TPOverlapTiming struct {
	Fused, Unfused time.Duration
	Iters          int
}

// Faster is the path of the shorter median; a tie goes to unfused, the
// reference.
func (t TPOverlapTiming) Faster() string {
	if t.Fused < t.Unfused {
		return TPOverlapFused
	}
	return TPOverlapUnfused
}

// tpRankTensors are one virtual rank's tensors of the measurement, shaped
// as attention/layer.go's under tensor parallelism.
type tpRankTensors struct {
	paths          [2]*tensorpar.Parallel // unfused, fused
	xRD, fullTD    backend.Tensor         // the rank's rows (a shard under sequence parallelism) and all of them
	outs, ws       []backend.Tensor       // q, k, v [T, Ql|KDl] and their weights [Ql|KDl, D]
	aTQ, woDQ      backend.Tensor         // o_proj's input and weight
	sumRD, partial backend.Tensor         // o_proj's output (the rank's rows under sequence parallelism) and partial sums
}

// MeasureTPOverlap times the two paths of c's layer on c.TP virtual
// ranks of b (comm.NewLocal: goroutines of this process sharing b, whose
// tensor group offers peer access), iters passes each after a warm-up,
// the paths alternating. A pass is what tensor parallelism adds to an
// attention layer's forward: the column-parallel q, k and v products
// (ColumnForward: the rows all-gathered under sequence parallelism) and
// the row-parallel o_proj (RowForward: reduce-scattered or all-reduced).
// The weights are in the backend's operand type, as the engine's. The
// inputs are random; the tensors are garbage once it returns.
func MeasureTPOverlap(b backend.Backend, c TPOverlapCase, iters int) (TPOverlapTiming, error) {
	s, tp, rows := c.Shape, c.TP, c.Rows
	switch {
	case tp < 2 || iters < 1:
		return TPOverlapTiming{}, fmt.Errorf("tensorpar: MeasureTPOverlap: %d ranks and %d passes; want at least 2 and 1", tp, iters)
	case rows < 1 || rows%tp != 0:
		return TPOverlapTiming{}, fmt.Errorf("tensorpar: MeasureTPOverlap: %d rows over %d ranks; want a positive multiple of the ranks", rows, tp)
	}
	if err := s.Validate(); err != nil {
		return TPOverlapTiming{}, err
	}
	if s.Heads%tp != 0 || (s.KVHeads%tp != 0 && tp%s.KVHeads != 0) {
		return TPOverlapTiming{}, fmt.Errorf("tensorpar: MeasureTPOverlap: %d heads over %d kv heads cannot split over %d ranks", s.Heads, s.KVHeads, tp)
	}
	world, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: 1, TP: tp}, b)
	if err != nil {
		return TPOverlapTiming{}, err
	}
	rng := rand.New(rand.NewPCG(uint64(tp), uint64(rows)))
	random := func(dt backend.DType, n ...int) backend.Tensor {
		f := b.New(b.FloatType(), n...)
		host := make([]float32, f.Len())
		for i := range host {
			host[i] = float32(rng.NormFloat64())
		}
		backend.UploadSlice(b, f, host)
		if dt == b.FloatType() {
			return f
		}
		t := b.New(dt, n...)
		b.Copy(t, f)
		return t
	}
	D, dh, ft, ot := s.Dim, s.HeadDim(), b.FloatType(), b.OperandType()
	heads, kvHeads, _ := attention.TensorParallelShape(s, tp, 0)
	Q, KD := heads*dh, kvHeads*dh
	R := rows
	if c.SequenceParallel {
		R = rows / tp
	}
	states := make([]tpRankTensors, len(world))
	for r, rk := range world {
		st := &states[r]
		for i, fused := range []bool{false, true} {
			st.paths[i] = tensorpar.NewWith(b, rk.Tensor, tensorpar.Options{SequenceParallel: c.SequenceParallel, Fused: fused, Deterministic: c.Deterministic})
		}
		if !st.paths[1].Fused() {
			return TPOverlapTiming{}, errors.New("tensorpar: MeasureTPOverlap: the virtual ranks' tensor group offers no peer access, so there is no fused path to time")
		}
		st.xRD, st.fullTD = random(ft, R, D), b.New(ft, rows, D)
		st.outs = []backend.Tensor{b.New(ft, rows, Q), b.New(ft, rows, KD), b.New(ft, rows, KD)}
		st.ws = []backend.Tensor{random(ot, Q, D), random(ot, KD, D), random(ot, KD, D)}
		st.aTQ, st.woDQ = random(ft, rows, Q), random(ot, D, Q)
		st.sumRD, st.partial = b.New(ft, R, D), b.New(ft, rows, D)
	}
	ts, err := ranktime.Medians(world, func(rk *comm.Ranks) comm.Group { return rk.Tensor }, 2, tpMeasureWarmup, iters,
		b.Sync, func(r, path int) error {
			st := &states[r]
			tp := st.paths[path]
			if _, err := tp.ColumnForward(st.fullTD, st.xRD, st.outs, st.ws, true); err != nil {
				return err
			}
			return tp.RowForward(st.sumRD, st.partial, []tensorpar.Term{{A: st.aTQ, W: st.woDQ, TransW: true}})
		})
	if err != nil {
		return TPOverlapTiming{}, fmt.Errorf("tensorpar: MeasureTPOverlap: %w", err)
	}
	return TPOverlapTiming{Unfused: ts[0], Fused: ts[1], Iters: iters}, nil
}

// TPOverlapKey is what a measurement of the paths holds for: the machine,
// the software under the kernels and the build's kernels (as
// DispatchKey), and the shape: dim, heads, kv heads, the rows of a
// micro-batch, the tensor ranks and whether the rows are sharded between
// the products (sequence parallelism).
type TPOverlapKey struct {
	Machine          string `json:"machine"`
	Software         string `json:"software,omitempty"`
	Kernels          string `json:"kernels"`
	Dim              int    `json:"dim"`
	Heads            int    `json:"heads"`
	KVHeads          int    `json:"kv_heads"`
	Rows             int    `json:"rows"`
	TP               int    `json:"tp"`
	SequenceParallel bool   `json:"sequence_parallel"`
}

// NewTPOverlapKey is c's key on b.
func NewTPOverlapKey(b backend.Backend, c TPOverlapCase) TPOverlapKey {
	return TPOverlapKey{Machine: MachineName(b), Software: SoftwareName(b), Kernels: kernelsDigest(),
		Dim: c.Shape.Dim, Heads: c.Shape.Heads, KVHeads: c.Shape.KVHeads, Rows: c.Rows, TP: c.TP, SequenceParallel: c.SequenceParallel}
}

func (k TPOverlapKey) String() string {
	sw := ""
	if k.Software != "" {
		sw = ", " + k.Software
	}
	rows := "rows replicated"
	if k.SequenceParallel {
		rows = "sequence parallel"
	}
	return fmt.Sprintf("%s (kernels %s%s): dim %d, %d heads over %d kv heads, %d rows, tp %d, %s", k.Machine, k.Kernels, sw, k.Dim, k.Heads, k.KVHeads, k.Rows, k.TP, rows)
}

// TPOverlapEntry is one row of the table: a key, the path chosen and the
// times it was chosen on (milliseconds per column- and row-parallel
// forward).
type TPOverlapEntry struct {
	TPOverlapKey
	Choice     string    `json:"choice"`
	FusedMS    float64   `json:"fused_column_row_forward_ms"`
	UnfusedMS  float64   `json:"unfused_column_row_forward_ms"`
	Iters      int       `json:"iters"`
	MeasuredAt time.Time `json:"measured_at"`
}

// tpOverlapTableVersion is the file format; a file of another version is
// ignored (and replaced by the next Store).
const tpOverlapTableVersion = 1

// TPOverlapCache is the table file at Path.
type TPOverlapCache struct{ Path string }

// DefaultTPOverlapCache is tp_overlap.json in the dispatch table's
// directory ($MKTRAIN_CACHE_DIR, else os.UserCacheDir()/mktrain).
func DefaultTPOverlapCache() (TPOverlapCache, error) {
	d, err := DefaultDispatchCache()
	if err != nil {
		return TPOverlapCache{}, err
	}
	return TPOverlapCache{Path: filepath.Join(filepath.Dir(d.Path), "tp_overlap.json")}, nil
}

func (c TPOverlapCache) read() ([]TPOverlapEntry, error) {
	return readTable[TPOverlapEntry](c.Path, "tensorpar: tp_overlap table", tpOverlapTableVersion)
}

// Lookup returns the entry for k, and whether there is one.
func (c TPOverlapCache) Lookup(k TPOverlapKey) (TPOverlapEntry, bool, error) {
	entries, err := c.read()
	if err != nil {
		return TPOverlapEntry{}, false, err
	}
	for _, e := range entries {
		if e.TPOverlapKey == k && (e.Choice == TPOverlapFused || e.Choice == TPOverlapUnfused) {
			return e, true, nil
		}
	}
	return TPOverlapEntry{}, false, nil
}

// Store records t's choice for k, replacing any entry for k, as
// DispatchCache.Store does (the file replaced whole, its directory made).
func (c TPOverlapCache) Store(k TPOverlapKey, t TPOverlapTiming) (TPOverlapEntry, error) {
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	e := TPOverlapEntry{TPOverlapKey: k, Choice: t.Faster(), FusedMS: ms(t.Fused), UnfusedMS: ms(t.Unfused),
		Iters: t.Iters, MeasuredAt: time.Now().UTC().Truncate(time.Second)}
	err := storeEntry(c.Path, "tensorpar: tp_overlap table", tpOverlapTableVersion, e,
		func(o TPOverlapEntry) bool { return o.TPOverlapKey == k },
		func(a, b TPOverlapEntry) int {
			return strings.Compare(a.TPOverlapKey.String(), b.TPOverlapKey.String())
		})
	return e, err
}
