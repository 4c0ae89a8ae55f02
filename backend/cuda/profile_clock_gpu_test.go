package cuda

import (
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/backendtest"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/profile"
)

// TestProfileClock runs the conformance suite through a profiler on the
// event clock (results unchanged, bf16 tolerance forwarded), then times
// large matrix multiplies: their GPU time must be positive and within the
// host's wall time, and a second profiled window must reuse the events.
func TestProfileClock(t *testing.T) {
	b := testBackend(t)
	clk := b.ProfileClock()
	p := profile.New(b, clk)
	p.SetEnabled(true)
	backendtest.RunAll(t, p.Backend(), cpu.New(backend.Float64))
	rep, err := p.Report()
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Ops) == 0 || rep.OpTime() <= 0 {
		t.Fatalf("empty report after the suite: %+v", rep)
	}
	ec := clk.(*eventClock)
	events := len(ec.events)
	if len(ec.free) != events {
		t.Errorf("%d of %d events back on the free list after Report", len(ec.free), events)
	}

	const n = 2048
	x, y, out := b.New(backend.Float32, n, n), b.New(backend.Float32, n, n), b.New(backend.Float32, n, n)
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for range 5 {
		p.MatMul(out, x, y, false, false, 1, 0)
	}
	if err := p.Sync(); err != nil {
		t.Fatal(err)
	}
	wall := time.Since(start)
	rep, err = p.Report()
	if err != nil {
		t.Fatal(err)
	}
	var mm time.Duration
	for _, o := range rep.Ops {
		if o.Op == "MatMul" {
			mm = o.Time
		}
	}
	figure(t, "profiled 2048^3 MatMul", mm.Seconds()*1e3/5, "ms")
	if mm <= 0 || mm > wall {
		t.Errorf("5 MatMuls took %v of GPU time in %v of wall time", mm, wall)
	}
	if len(ec.events) != events {
		t.Errorf("the second window created events: %d, was %d", len(ec.events), events)
	}
	if b.PeakMemory() < 3*n*n*4 {
		t.Errorf("PeakMemory %d is below the three %d x %d tensors", b.PeakMemory(), n, n)
	}
}

// TestProfileClockHold: a hold of d between two marks lasts at least d on
// the GPU and not much more; work the host queues while a hold runs
// starts when the hold ends, so a mark taken after the hold and before
// that work times the work alone, however long the host took to queue it.
func TestProfileClockHold(t *testing.T) {
	b := testBackend(t)
	clk := b.ProfileClock()
	h, ok := clk.(profile.Holder)
	if !ok {
		t.Fatal("the event clock is not a profile.Holder")
	}
	elapsed := func(a, z profile.Mark) time.Duration {
		t.Helper()
		d, err := clk.Elapsed(a, z)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	mark := func() profile.Mark {
		t.Helper()
		m, err := clk.Mark()
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	// The first hold loads clock.cu (NVRTC), outside the timed ones.
	if err := h.Hold(time.Microsecond); err != nil {
		t.Fatal(err)
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	for _, d := range []time.Duration{500 * time.Microsecond, 2 * time.Millisecond} {
		a := mark()
		if err := h.Hold(d); err != nil {
			t.Fatal(err)
		}
		z := mark()
		got := elapsed(a, z)
		figure(t, "hold of "+d.String(), got.Seconds()*1e3, "ms")
		if got < d || got > d+200*time.Microsecond {
			t.Errorf("a hold of %v took %v on the GPU", d, got)
		}
	}

	// The host sleeps 3 ms between the mark after a 5 ms hold and its
	// work: the interval holds the work only.
	const n = 2048
	x, y, out := b.New(backend.Float32, n, n), b.New(backend.Float32, n, n), b.New(backend.Float32, n, n)
	b.MatMul(out, x, y, false, false, 1, 0)
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	a := mark()
	b.MatMul(out, x, y, false, false, 1, 0)
	alone := elapsed(a, mark())
	if err := h.Hold(5 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	a = mark()
	time.Sleep(3 * time.Millisecond)
	b.MatMul(out, x, y, false, false, 1, 0)
	held := elapsed(a, mark())
	figure(t, "2048^3 MatMul alone", alone.Seconds()*1e3, "ms")
	figure(t, "2048^3 MatMul queued 3 ms after a held mark", held.Seconds()*1e3, "ms")
	if held > 2*alone+200*time.Microsecond {
		t.Errorf("the MatMul queued during a hold took %v from the mark, alone %v", held, alone)
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
}
