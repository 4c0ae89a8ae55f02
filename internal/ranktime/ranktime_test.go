package ranktime

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
)

func world(t *testing.T, n int) []*comm.Ranks {
	t.Helper()
	w, err := comm.NewLocal(comm.Mesh{DP: n, EP: 1, CP: 1, TP: 1}, cpu.New(backend.Float32))
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func data(rk *comm.Ranks) comm.Group { return rk.Data }

// The variants alternate, every rank runs every pass, and each variant's
// median is its own: variant 1 sleeps longer than variant 0.
func TestMediansPerVariant(t *testing.T) {
	const warmup, iters = 1, 3
	var calls [2]atomic.Int32
	syncs := atomic.Int32{}
	ts, err := Medians(world(t, 3), data, 2, warmup, iters, func() error { syncs.Add(1); return nil },
		func(r, v int) error {
			calls[v].Add(1)
			time.Sleep(time.Duration(1+20*v) * time.Millisecond)
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	if len(ts) != 2 || !(ts[1] > ts[0]) || ts[0] < time.Millisecond {
		t.Errorf("medians %v: want variant 1 slower than variant 0, both at least 1 ms", ts)
	}
	for v := range calls {
		if got := calls[v].Load(); got != 3*(warmup+iters) {
			t.Errorf("variant %d ran %d times on 3 ranks, want %d", v, got, 3*(warmup+iters))
		}
	}
	if got := syncs.Load(); got != 3*2*(warmup+iters) {
		t.Errorf("%d syncs, want one a rank and pass (%d)", got, 3*2*(warmup+iters))
	}
}

// A failing rank aborts the others instead of leaving them at a barrier,
// and its error comes back.
func TestMediansFailure(t *testing.T) {
	boom := errors.New("boom")
	_, err := Medians(world(t, 2), data, 2, 1, 2, func() error { return nil }, func(r, v int) error {
		if r == 1 && v == 1 {
			return boom
		}
		return nil
	})
	if !errors.Is(err, boom) || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("error %v, want boom", err)
	}
}
