package profile

import (
	"cmp"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mktrain/mktrain/backend"
)

// Backend wraps a backend.Backend and, while enabled, times each op it
// forwards. Its methods are safe for concurrent use, like those of the
// backends it wraps.
type Backend struct {
	inner   backend.Backend
	clock   Clock
	enabled atomic.Bool

	// opMu spans each profiled op with its two marks, so profiled ops do
	// not interleave (see the package doc).
	opMu sync.Mutex

	mu      sync.Mutex
	scope   string
	records []record
	err     error // the first Clock error since the last Report
}

// record is one timed op.
type record struct {
	scope, op  string
	start, end Mark
}

var (
	_ backend.Backend           = (*Backend)(nil)
	_ backend.LaterReducer      = (*Backend)(nil)
	_ backend.SquaringOptimizer = (*Backend)(nil)
)

// New wraps inner, timing its ops with clock once enabled. Name and
// FloatType are inner's. Hand p.Backend() to code that should also see
// inner's optional capabilities.
func New(inner backend.Backend, clock Clock) *Backend {
	return &Backend{inner: inner, clock: clock}
}

// Inner is the wrapped backend.
func (p *Backend) Inner() backend.Backend { return p.inner }

// Backend is p as the backend to compute on: p itself, or p with the
// wrapped backend's optional capabilities forwarded: backend.Precision
// (RelTolerance, so that the conformance suite applies the wrapped
// backend's tolerance) and backend.Deterministic (SetDeterministic, and
// what code that asks whether the backend adds with float atomics, such
// as tensorpar's fused reduce-scatter, learns from it).
func (p *Backend) Backend() backend.Backend {
	prec, hasPrec := p.inner.(backend.Precision)
	det, hasDet := p.inner.(backend.Deterministic)
	switch {
	case hasPrec && hasDet:
		return preciseDeterministic{precise: precise{Backend: p, prec: prec}, det: det}
	case hasPrec:
		return precise{Backend: p, prec: prec}
	case hasDet:
		return deterministic{Backend: p, det: det}
	}
	return p
}

// precise is a *Backend that forwards backend.Precision.
type precise struct {
	*Backend
	prec backend.Precision
}

func (b precise) RelTolerance() float64 { return b.prec.RelTolerance() }

// deterministic is a *Backend that forwards backend.Deterministic.
type deterministic struct {
	*Backend
	det backend.Deterministic
}

func (b deterministic) SetDeterministic(on bool) { b.det.SetDeterministic(on) }

// preciseDeterministic forwards both (the CUDA backend has both).
type preciseDeterministic struct {
	precise
	det backend.Deterministic
}

func (b preciseDeterministic) SetDeterministic(on bool) { b.det.SetDeterministic(on) }

// SetEnabled starts (true) or stops (false) recording ops. Records are kept
// until Report.
func (p *Backend) SetEnabled(on bool) { p.enabled.Store(on) }

// SetScope names what the following ops are part of (ScopeAttention, ...;
// "" for elsewhere).
func (p *Backend) SetScope(name string) {
	p.mu.Lock()
	p.scope = name
	p.mu.Unlock()
}

// Scope sets the scope of b when b is a profiler (a *Backend, or what its
// Backend method returns) and does nothing otherwise, so model code calls it
// on any backend.
func Scope(b backend.Backend, name string) {
	switch p := b.(type) {
	case *Backend:
		p.SetScope(name)
	case precise:
		p.SetScope(name)
	}
}

// span is an op in progress: locked when the profiler was enabled as it
// began (opMu is held), ok when its start mark was taken.
type span struct {
	locked, ok bool
	scope      string
	start      Mark
}

// begin starts timing an op; the op's method defers end(begin(), name), so
// the lock is released even when the op panics on a caller's bug.
func (p *Backend) begin() span { return p.beginIn("") }

// beginIn is begin with the op's scope given ("": the current one).
func (p *Backend) beginIn(scope string) span {
	if !p.enabled.Load() {
		return span{}
	}
	p.opMu.Lock()
	p.mu.Lock()
	s := span{locked: true, scope: cmp.Or(scope, p.scope)}
	p.mu.Unlock()
	m, err := p.clock.Mark()
	if err != nil {
		p.fail(err)
		return s
	}
	s.ok, s.start = true, m
	return s
}

// end takes the end mark of s and records the op.
func (p *Backend) end(s span, op string) {
	if !s.locked {
		return
	}
	defer p.opMu.Unlock()
	if !s.ok {
		return
	}
	m, err := p.clock.Mark()
	if err != nil {
		p.clock.Release(s.start)
		p.fail(err)
		return
	}
	p.mu.Lock()
	p.records = append(p.records, record{scope: s.scope, op: op, start: s.start, end: m})
	p.mu.Unlock()
}

// Collective runs fn, a collective of a communicator that queues its work
// on the wrapped backend's device without going through p (an NCCL call on
// the GPU's stream), and, while p is enabled, times it as op in the comm
// scope (kind communication) with p's clock, as it times p's own ops. fn
// must not call p's ops: p runs one timed op at a time, and fn runs inside
// one.
func (p *Backend) Collective(op string, fn func() error) error {
	defer p.end(p.beginIn(ScopeComm), op)
	return fn()
}

func (p *Backend) fail(err error) {
	p.mu.Lock()
	if p.err == nil {
		p.err = fmt.Errorf("profile: clock: %w", err)
	}
	p.mu.Unlock()
}

// Report waits for the wrapped backend's queued work (Sync), reads the
// durations of the ops recorded since the last Report, sums them by
// (scope, op) and by kind, lists them in order on a timeline (Spans), and
// forgets them. Call it when no op is in
// flight, for example between two steps. It returns the Sync's error, or
// the first Clock error, with what could be read.
func (p *Backend) Report() (Report, error) {
	syncErr := p.inner.Sync()
	p.mu.Lock()
	recs, clockErr := p.records, p.err
	p.records, p.err = nil, nil
	p.mu.Unlock()

	type key struct{ scope, op string }
	byOp := map[key]*OpTime{}
	var order []key
	var errs []error
	spans := make([]Span, 0, len(recs))
	// Each op's start is read against the first op's start, the origin
	// of the timeline, which is released last.
	for i, r := range recs {
		d, err := p.clock.Elapsed(r.start, r.end)
		var at time.Duration
		if err == nil && i > 0 {
			at, err = p.clock.Elapsed(recs[0].start, r.start)
		}
		if i > 0 {
			p.clock.Release(r.start)
		}
		p.clock.Release(r.end)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		spans = append(spans, Span{Scope: r.scope, Op: r.op, Kind: KindOf(r.scope, r.op), Start: at, Time: d})
		k := key{r.scope, r.op}
		o := byOp[k]
		if o == nil {
			o = &OpTime{Scope: r.scope, Op: r.op, Kind: KindOf(r.scope, r.op)}
			byOp[k] = o
			order = append(order, k)
		}
		o.Time += d
		o.Calls++
	}
	if len(recs) > 0 {
		p.clock.Release(recs[0].start)
	}
	ops := make([]OpTime, 0, len(order))
	for _, k := range order {
		ops = append(ops, *byOp[k])
	}
	rep := newReport(ops)
	rep.Spans = spans
	if len(errs) > 0 {
		// Errors of one cause repeat for every record: keep the first.
		clockErr = errors.Join(clockErr, fmt.Errorf("profile: reading %d of %d op times: %w", len(errs), len(recs), errs[0]))
	}
	if syncErr != nil {
		return rep, fmt.Errorf("profile: %w", syncErr)
	}
	return rep, clockErr
}
