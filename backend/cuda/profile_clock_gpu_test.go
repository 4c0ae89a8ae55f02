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
