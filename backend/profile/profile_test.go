package profile

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/backendtest"
	"github.com/mktrain/mktrain/backend/cpu"
)

// TestConformanceThroughProfiler runs the backend suite on the CPU backend
// through an enabled profiler: forwarding must change no result.
func TestConformanceThroughProfiler(t *testing.T) {
	p := New(cpu.New(backend.Float32), WallClock())
	p.SetEnabled(true)
	backendtest.RunAll(t, p.Backend(), cpu.New(backend.Float64))
	rep, err := p.Report()
	if err != nil {
		t.Fatal(err)
	}
	// The suite calls every timed op at least once, all in scope "".
	seen := map[string]bool{}
	for _, o := range rep.Ops {
		if o.Calls <= 0 || o.Time < 0 || o.Scope != "" {
			t.Errorf("op entry %+v", o)
		}
		seen[o.Op] = true
	}
	for _, op := range []string{opMatMul, opGroupedMatMul, opGroupedMatMulTN, opAttentionForward, opAttentionBackward, opRouterForward, opRouterBackward,
		opGatherRows, opScatterAddRows, opRowDots, opCrossEntropy, opAdamWUpdate, opRMSNormBackward, opRoPE, opUpload, opDownload} {
		if !seen[op] {
			t.Errorf("the suite ran %s but the report lacks it", op)
		}
	}
	if rep2, err := p.Report(); err != nil || len(rep2.Ops) != 0 || len(rep2.Kinds) != 0 {
		t.Errorf("a second Report is not empty: %+v, %v", rep2, err)
	}
}

// fakeClock is a Clock whose time the test advances; it counts the marks
// not yet released.
type fakeClock struct {
	mu      sync.Mutex
	now     time.Duration
	times   map[Mark]time.Duration
	next    Mark
	failAt  int // Mark call number (from 1) that fails; 0 = never
	calls   int
	elapsed int
}

func newFakeClock() *fakeClock { return &fakeClock{times: map[Mark]time.Duration{}} }

func (c *fakeClock) advance(d time.Duration) { c.mu.Lock(); c.now += d; c.mu.Unlock() }

func (c *fakeClock) Mark() (Mark, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls++
	if c.calls == c.failAt {
		return 0, errors.New("fake clock broke")
	}
	c.next++
	c.times[c.next] = c.now
	return c.next, nil
}

func (c *fakeClock) Elapsed(a, b Mark) (time.Duration, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ta, oka := c.times[a]
	tb, okb := c.times[b]
	if !oka || !okb {
		return 0, errors.New("fake clock: mark released or never taken")
	}
	c.elapsed++
	return tb - ta, nil
}

func (c *fakeClock) Release(m Mark) { c.mu.Lock(); delete(c.times, m); c.mu.Unlock() }

func (c *fakeClock) outstanding() int { c.mu.Lock(); defer c.mu.Unlock(); return len(c.times) }

// slowBackend is a CPU backend whose ops take, on the fake clock, the time
// the test sets in cost.
type slowBackend struct {
	backend.Backend
	clk  *fakeClock
	cost time.Duration
}

func (s *slowBackend) MatMul(out, a, b backend.Tensor, ta, tb bool, alpha, beta float64) {
	s.clk.advance(s.cost)
	s.Backend.MatMul(out, a, b, ta, tb, alpha, beta)
}

func (s *slowBackend) Copy(dst, src backend.Tensor) {
	s.clk.advance(s.cost)
	s.Backend.Copy(dst, src)
}

func (s *slowBackend) Zero(t backend.Tensor) {
	s.clk.advance(s.cost)
	s.Backend.Zero(t)
}

func (s *slowBackend) Sum(t backend.Tensor) float64 {
	s.clk.advance(s.cost)
	return s.Backend.Sum(t)
}

func (s *slowBackend) Scale(t backend.Tensor, alpha float64) {
	s.clk.advance(s.cost)
	s.Backend.Scale(t, alpha)
}

func (s *slowBackend) Download(t backend.Tensor) *tensor.Dense {
	s.clk.advance(s.cost)
	return s.Backend.Download(t)
}

// TestReportSums runs random ops in random scopes with known durations and
// host time between them, some while disabled, and checks the report's sums
// against sums kept by the test.
func TestReportSums(t *testing.T) {
	clk := newFakeClock()
	inner := &slowBackend{Backend: cpu.New(backend.Float64), clk: clk}
	p := New(inner, clk)
	x, y, out := p.New(backend.Float64, 3, 4), p.New(backend.Float64, 4, 2), p.New(backend.Float64, 3, 2)
	backend.UploadSlice(p, x, []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12})
	scopes := []string{"", ScopeAttention, ScopeMoE, ScopeHead, ScopeOptimizer, "elsewhere"}
	ops := map[string]func(){
		opMatMul:   func() { p.MatMul(out, x, y, false, false, 1, 0) },
		opCopy:     func() { p.Copy(y, y) },
		opZero:     func() { p.Zero(out) },
		opSum:      func() { p.Sum(x) },
		opScale:    func() { p.Scale(y, 1) },
		opDownload: func() { p.Download(out) },
	}
	names := make([]string, 0, len(ops))
	for n := range ops {
		names = append(names, n)
	}
	slices.Sort(names)

	type key struct{ scope, op string }
	wantOp := map[key]time.Duration{}
	wantCalls := map[key]int{}
	var wantTotal time.Duration
	rng := rand.New(rand.NewPCG(7, 11))
	for range 400 {
		on := rng.IntN(4) != 0
		p.SetEnabled(on)
		scope, op := scopes[rng.IntN(len(scopes))], names[rng.IntN(len(names))]
		Scope(p, scope)
		inner.cost = time.Duration(1+rng.IntN(1000)) * time.Microsecond
		clk.advance(time.Duration(rng.IntN(50)) * time.Microsecond) // host time between ops: not counted
		ops[op]()
		if on {
			wantOp[key{scope, op}] += inner.cost
			wantCalls[key{scope, op}]++
			wantTotal += inner.cost
		}
	}
	p.SetEnabled(false)
	rep, err := p.Report()
	if err != nil {
		t.Fatal(err)
	}
	if n := clk.outstanding(); n != 0 {
		t.Errorf("%d marks not released after Report", n)
	}
	if len(rep.Ops) != len(wantOp) {
		t.Errorf("report has %d (scope, op) entries, want %d", len(rep.Ops), len(wantOp))
	}
	wantKind := map[string]time.Duration{}
	wantKindOps := map[string]int{}
	for _, o := range rep.Ops {
		k := key{o.Scope, o.Op}
		if o.Time != wantOp[k] || o.Calls != wantCalls[k] || o.Kind != KindOf(o.Scope, o.Op) {
			t.Errorf("%+v: want %v in %d calls, kind %q", o, wantOp[k], wantCalls[k], KindOf(o.Scope, o.Op))
		}
	}
	for k, d := range wantOp {
		wantKind[KindOf(k.scope, k.op)] += d
		wantKindOps[KindOf(k.scope, k.op)] += wantCalls[k]
	}
	if len(rep.Kinds) != len(wantKind) {
		t.Errorf("report has %d kinds, want %d", len(rep.Kinds), len(wantKind))
	}
	shares := 0.0
	for i, k := range rep.Kinds {
		if k.Time != wantKind[k.Kind] || k.Ops != wantKindOps[k.Kind] {
			t.Errorf("kind %q: %v in %d ops, want %v in %d", k.Kind, k.Time, k.Ops, wantKind[k.Kind], wantKindOps[k.Kind])
		}
		if want := float64(k.Time) / float64(wantTotal); math.Abs(k.Share-want) > 1e-12 {
			t.Errorf("kind %q: share %v, want %v", k.Kind, k.Share, want)
		}
		if i > 0 && k.Time > rep.Kinds[i-1].Time {
			t.Errorf("kinds not sorted longest first: %+v", rep.Kinds)
		}
		shares += k.Share
	}
	if math.Abs(shares-1) > 1e-12 || rep.OpTime() != wantTotal {
		t.Errorf("shares add up to %v, op time %v (want 1, %v)", shares, rep.OpTime(), wantTotal)
	}
	for i := 1; i < len(rep.Ops); i++ {
		if rep.Ops[i].Time > rep.Ops[i-1].Time {
			t.Errorf("ops not sorted longest first at %d", i)
		}
	}
}

func TestWithWallClampsHostGaps(t *testing.T) {
	ms := time.Millisecond
	rep := newReport([]OpTime{
		{Scope: ScopeAttention, Op: opAttentionForward, Kind: KindAttention, Time: 30 * ms, Calls: 3},
		{Scope: ScopeHead, Op: opMatMul, Kind: KindDenseGEMM, Time: 20 * ms, Calls: 2},
		{Scope: ScopeAttention, Op: opMatMul, Kind: KindDenseGEMM, Time: 30 * ms, Calls: 4},
		{Scope: "", Op: opAxpy, Kind: KindElementwise, Time: 20 * ms, Calls: 9},
	})
	check := func(r Report, want map[string]time.Duration, total time.Duration) {
		t.Helper()
		if len(r.Kinds) != len(want) {
			t.Fatalf("kinds %+v, want %v", r.Kinds, want)
		}
		sum := 0.0
		for _, k := range r.Kinds {
			w, ok := want[k.Kind]
			if !ok || k.Time != w || math.Abs(k.Share-float64(w)/float64(total)) > 1e-12 {
				t.Errorf("kind %+v, want time %v share %v", k, w, float64(w)/float64(total))
			}
			sum += k.Share
		}
		if math.Abs(sum-1) > 1e-12 {
			t.Errorf("shares add up to %v", sum)
		}
	}
	base := map[string]time.Duration{KindAttention: 30 * ms, KindDenseGEMM: 50 * ms, KindElementwise: 20 * ms}
	check(rep, base, 100*ms)
	if rep.Kinds[0].Kind != KindDenseGEMM || rep.Kinds[0].Ops != 6 {
		t.Errorf("first kind %+v, want dense GEMM of 6 ops", rep.Kinds[0])
	}

	withGaps := map[string]time.Duration{KindHostGaps: 25 * ms}
	for k, v := range base {
		withGaps[k] = v
	}
	r := rep.WithWall(125 * ms)
	check(r, withGaps, 125*ms)
	// Again, on the result: one host-gaps entry, recomputed.
	withGaps[KindHostGaps] = 60 * ms
	check(r.WithWall(160*ms), withGaps, 160*ms)
	if r.OpTime() != 100*ms {
		t.Errorf("OpTime counts host gaps: %v", r.OpTime())
	}

	// Ops longer than the wall time: no negative gap, shares of the ops.
	withGaps[KindHostGaps] = 0
	check(rep.WithWall(80*ms), withGaps, 100*ms)
	if rep.Kinds[len(rep.Kinds)-1].Kind == KindHostGaps {
		t.Error("WithWall changed its receiver")
	}
}

// TestKindOf spells the table out case by case.
// Collective times a call that is not one of the backend's ops in the
// comm scope, kind communication, with the profiler's clock, passes its
// error on, and records nothing while the profiler is off.
func TestCollective(t *testing.T) {
	clk := newFakeClock()
	p := New(cpu.New(backend.Float32), clk)
	call := func(d time.Duration, err error) func() error {
		return func() error { clk.advance(d); return err }
	}
	if err := p.Collective("Barrier", call(time.Second, nil)); err != nil {
		t.Fatal(err)
	}
	p.SetEnabled(true)
	p.SetScope(ScopeMoE) // the model's scope does not label collectives
	if err := p.Collective("AllToAllRows", call(3*time.Millisecond, nil)); err != nil {
		t.Fatal(err)
	}
	broken := errors.New("peer gone")
	if err := p.Collective("Barrier", call(2*time.Millisecond, broken)); !errors.Is(err, broken) {
		t.Fatalf("the collective's error: %v", err)
	}
	rep, err := p.Report()
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Kinds) != 1 || rep.Kinds[0].Kind != KindComm || rep.Kinds[0].Time != 5*time.Millisecond || rep.Kinds[0].Ops != 2 {
		t.Fatalf("kinds %+v, want 5ms of communication in 2 calls", rep.Kinds)
	}
	for _, o := range rep.Ops {
		if o.Scope != ScopeComm {
			t.Errorf("op %+v is not in the comm scope", o)
		}
	}
}

func TestKindOf(t *testing.T) {
	cases := []struct{ scope, op, want string }{
		{ScopeComm, "AllToAllRows", KindComm},
		{ScopeComm, opCopy, KindComm},
		{ScopeAttention, opAttentionForward, KindAttention},
		{ScopeAttention, opAttentionBackward, KindAttention},
		{ScopeAttention, opMatMul, KindDenseGEMM},
		{ScopeAttention, opRoPE, KindElementwise},
		{ScopeAttention, opCopy, KindElementwise},
		{ScopeMoE, opMatMul, KindExpertGEMM},
		{ScopeMoE, opGroupedMatMul, KindExpertGEMM},
		{ScopeMoE, opGroupedMatMulTN, KindExpertGEMM},
		{"", opGroupedMatMul, KindExpertGEMM},
		{ScopeOptimizer, opGroupedMatMulTN, KindOptimizer},
		{ScopeMoE, opGatherRows, KindDispatch},
		{ScopeMoE, opScatterAddRows, KindDispatch},
		{ScopeMoE, opRowDots, KindDispatch},
		{ScopeMoE, opCopy, KindDispatch},
		{ScopeMoE, opZero, KindDispatch},
		{ScopeMoE, opRouterForward, KindRouter},
		{ScopeMoE, opRouterBackward, KindRouter},
		{ScopeMoE, opSwiGLUForward, KindElementwise},
		{ScopeMoE, opSwiGLUBackward, KindElementwise},
		{ScopeMoE, opAxpy, KindElementwise},
		{ScopeMoE, opDownload, KindTransfers},
		{ScopeMoE, opUpload, KindTransfers},
		{ScopeHead, opMatMul, KindDenseGEMM},
		{ScopeHead, opCrossEntropy, KindLoss},
		{ScopeHead, opSum, KindLoss},
		{ScopeOptimizer, opAdamWUpdate, KindOptimizer},
		{ScopeOptimizer, opSumSquares, KindOptimizer},
		{ScopeOptimizer, opScale, KindOptimizer},
		{ScopeOptimizer, opDownload, KindOptimizer},
		{"", opAdamWUpdate, KindOptimizer},
		{"", opRMSNormForward, KindElementwise},
		{"", opRMSNormBackward, KindElementwise},
		{"", opEmbeddingForward, KindElementwise},
		{"", opEmbeddingBackward, KindElementwise},
		{"", opAxpy, KindElementwise},
		{"", opCopy, KindElementwise},
		{"", opZero, KindElementwise},
		{"", opScale, KindElementwise},
		{"", opSum, KindElementwise},
		{"", opSync, KindTransfers},
		{"", opUpload, KindTransfers},
		{"", opMatMul, KindDenseGEMM},
		{"", opCrossEntropy, KindLoss},
		{"unknown scope", opGatherRows, KindDispatch},
	}
	for _, c := range cases {
		if got := KindOf(c.scope, c.op); got != c.want {
			t.Errorf("KindOf(%q, %q) = %q, want %q", c.scope, c.op, got, c.want)
		}
	}
}

// TestClockErrorIsReported breaks the clock at the second op's start mark:
// every op still runs, Report returns the error with the other ops' times.
func TestClockErrorIsReported(t *testing.T) {
	clk := newFakeClock()
	clk.failAt = 3
	inner := &slowBackend{Backend: cpu.New(backend.Float64), clk: clk, cost: time.Millisecond}
	p := New(inner, clk)
	x := p.New(backend.Float64, 4)
	backend.UploadSlice(p, x, []float64{1, 2, 3, 4})
	p.SetEnabled(true)
	for range 3 {
		p.Scale(x, 2)
	}
	if got := backend.DownloadFloat64(p, x); !slices.Equal(got, []float64{8, 16, 24, 32}) {
		t.Errorf("ops did not all run: %v", got)
	}
	rep, err := p.Report()
	if err == nil || !strings.Contains(err.Error(), "fake clock broke") {
		t.Fatalf("Report error %v, want the clock's", err)
	}
	// Two Scales and the Download were timed.
	if len(rep.Ops) != 2 || rep.OpTime() != 3*time.Millisecond {
		t.Errorf("report %+v", rep)
	}
	if n := clk.outstanding(); n != 0 {
		t.Errorf("%d marks not released", n)
	}
	if _, err := p.Report(); err != nil {
		t.Errorf("the error outlived its Report: %v", err)
	}
}

// TestPanickingOpReleasesTheProfiler: a shape bug panics inside an op; the
// next op, from another goroutine, must not block.
func TestPanickingOpReleasesTheProfiler(t *testing.T) {
	p := New(cpu.New(backend.Float32), WallClock())
	p.SetEnabled(true)
	a, b := p.New(backend.Float32, 2, 3), p.New(backend.Float32, 4, 2)
	func() {
		defer func() {
			if recover() == nil {
				t.Error("MatMul of mismatched shapes did not panic")
			}
		}()
		p.MatMul(p.New(backend.Float32, 2, 2), a, b, false, false, 1, 0)
	}()
	done := make(chan struct{})
	go func() { p.Zero(a); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the op after a panic blocked: the profiler's lock was not released")
	}
	if _, err := p.Report(); err != nil {
		t.Fatal(err)
	}
}

// TestConcurrentOpsDoNotOverlap: profiled ops from several goroutines are
// recorded as disjoint intervals.
func TestConcurrentOpsDoNotOverlap(t *testing.T) {
	p := New(cpu.New(backend.Float32), WallClock())
	p.SetEnabled(true)
	var wg sync.WaitGroup
	for g := range 4 {
		x, y := p.New(backend.Float32, 64, 64), p.New(backend.Float32, 64, 64)
		wg.Go(func() {
			for range 50 {
				p.Copy(y, x)
				Scope(p, []string{"", ScopeMoE}[g%2])
			}
		})
	}
	wg.Wait()
	p.mu.Lock()
	recs := slices.Clone(p.records)
	p.mu.Unlock()
	if len(recs) != 200 {
		t.Fatalf("%d records, want 200", len(recs))
	}
	slices.SortFunc(recs, func(a, b record) int { return int(int64(a.start) - int64(b.start)) })
	for i := 1; i < len(recs); i++ {
		if recs[i].start < recs[i-1].end {
			t.Fatalf("records %d and %d overlap: %+v %+v", i-1, i, recs[i-1], recs[i])
		}
	}
	rep, err := p.Report()
	if err != nil {
		t.Fatal(err)
	}
	calls := 0
	for _, k := range rep.Kinds {
		calls += k.Ops
	}
	if calls != 200 {
		t.Errorf("report counts %d ops, want 200", calls)
	}
}

// tolBackend is a backend with its own precision.
type tolBackend struct{ backend.Backend }

func (tolBackend) RelTolerance() float64 { return 0.03 }

// detBackend is a backend with float atomics it can order (as CUDA's):
// SetDeterministic records the last setting.
type detBackend struct {
	backend.Backend
	on *bool
}

func (d detBackend) SetDeterministic(on bool) { *d.on = on }

// tolDetBackend has both capabilities.
type tolDetBackend struct{ detBackend }

func (tolDetBackend) RelTolerance() float64 { return 0.05 }

func TestForwardsDeterministic(t *testing.T) {
	var on bool
	for _, inner := range []backend.Backend{detBackend{cpu.New(backend.Float32), &on}, tolDetBackend{detBackend{cpu.New(backend.Float32), &on}}} {
		b := New(inner, WallClock()).Backend()
		d, ok := b.(backend.Deterministic)
		if !ok {
			t.Fatalf("%T: Deterministic not forwarded (%T)", inner, b)
		}
		on = false
		d.SetDeterministic(true)
		if !on {
			t.Errorf("%T: SetDeterministic did not reach the wrapped backend", inner)
		}
		_, prec := b.(backend.Precision)
		if _, want := inner.(backend.Precision); prec != want {
			t.Errorf("%T: Precision forwarded %v, want %v", inner, prec, want)
		}
	}
	if _, ok := New(cpu.New(backend.Float32), WallClock()).Backend().(backend.Deterministic); ok {
		t.Error("a profiler over the CPU claims backend.Deterministic")
	}
}

func TestForwardsNameFloatTypePrecisionAndScope(t *testing.T) {
	p := New(cpu.New(backend.Float64), WallClock())
	if p.Name() != "cpu" || p.FloatType() != backend.Float64 {
		t.Errorf("Name %q FloatType %v", p.Name(), p.FloatType())
	}
	if b := p.Backend(); b != backend.Backend(p) {
		t.Errorf("Backend() of a profiler over the CPU is %T, want the profiler itself", b)
	} else if _, ok := b.(backend.Precision); ok {
		t.Error("a profiler over the CPU claims backend.Precision")
	}
	q := New(tolBackend{cpu.New(backend.Float32)}, WallClock())
	prec, ok := q.Backend().(backend.Precision)
	if !ok || prec.RelTolerance() != 0.03 {
		t.Fatalf("Precision not forwarded: %T %v", q.Backend(), ok)
	}
	Scope(q.Backend(), ScopeHead)
	Scope(cpu.New(backend.Float32), ScopeHead) // no profiler: nothing happens
	if q.scope != ScopeHead {
		t.Errorf("Scope through Backend() set %q", q.scope)
	}
	if p.Inner().Name() != "cpu" {
		t.Error("Inner")
	}
}

// laterCounter is a backend with queued sums (backend.LaterReducer) that
// counts its queued and immediate reductions.
type laterCounter struct {
	backend.Backend
	queued, immediate int
}

func (c *laterCounter) SumSquaresLater(t backend.Tensor) func() float64 {
	c.queued++
	return func() float64 { return 3 }
}

func (c *laterCounter) SumLater(t backend.Tensor) func() float64 {
	c.queued++
	return func() float64 { return 2 }
}

func (c *laterCounter) SumSquares(t backend.Tensor) float64 {
	c.immediate++
	return 3
}

func (c *laterCounter) Sum(t backend.Tensor) float64 {
	c.immediate++
	return 2
}

// TestLaterReducersForwarded: the profiler queues a reduction where the
// wrapped backend can (a profiled step waits where the real one does) and
// times it as SumSquares or Sum.
func TestLaterReducersForwarded(t *testing.T) {
	inner := &laterCounter{Backend: cpu.New(backend.Float32)}
	p := New(inner, WallClock())
	p.SetEnabled(true)
	x := inner.New(backend.Float32, 4)
	if got := backend.SumSquaresLater(p.Backend(), x)(); got != 3 || inner.queued != 1 || inner.immediate != 0 {
		t.Errorf("got %v with %d queued and %d immediate reductions; want 3 from one queued", got, inner.queued, inner.immediate)
	}
	if got := backend.SumLater(p.Backend(), x)(); got != 2 || inner.queued != 2 || inner.immediate != 0 {
		t.Errorf("got %v with %d queued and %d immediate reductions; want 2 from a second queued", got, inner.queued, inner.immediate)
	}
	rep, err := p.Report()
	if err != nil {
		t.Fatal(err)
	}
	calls := map[string]int{}
	for _, o := range rep.Ops {
		calls[o.Op] += o.Calls
	}
	if len(rep.Ops) != 2 || calls[opSumSquares] != 1 || calls[opSum] != 1 {
		t.Errorf("report %+v; want one SumSquares call and one Sum", rep.Ops)
	}
}
