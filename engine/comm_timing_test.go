package engine

import (
	"errors"
	"slices"
	"sync"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
)

// countingTimer records the collectives it times, per rank.
type countingTimer struct {
	mu  sync.Mutex
	ops []string
}

func (c *countingTimer) Collective(op string, fn func() error) error {
	c.mu.Lock()
	c.ops = append(c.ops, op)
	c.mu.Unlock()
	return fn()
}

// asyncGroup is a group that offers AllReduceSumStart, as the NCCL
// groups do.
type asyncGroup struct{ comm.Group }

func (g asyncGroup) AllReduceSumStart(t backend.Tensor) (comm.Pending, error) {
	return comm.StartAllReduce(g.Group, t)
}

// The timed groups time every collective under its name, give the same
// results as the groups they wrap, pass errors on, and keep the optional
// interfaces of what they wrap (the MoE layer picks its dispatcher by
// comm.PeerAccess, the gradient reduce its overlap by comm.AsyncReducer).
func TestTimedGroups(t *testing.T) {
	b := cpu.New(backend.Float32)
	world, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 2, CP: 1, TP: 1}, b)
	if err != nil {
		t.Fatal(err)
	}
	timers := []*countingTimer{{}, {}}
	for r, rk := range world {
		rk.Data = asyncGroup{rk.Data} // PeerAccess gone, AllReduceSumStart added
		timeCollectives(rk, timers[r])
	}
	for r, rk := range world {
		if _, ok := rk.Expert.(comm.PeerAccess); !ok {
			t.Errorf("rank %d: the timed expert group lost PeerAccess", r)
		}
		if _, ok := rk.Expert.(comm.AsyncReducer); ok {
			t.Errorf("rank %d: the timed expert group offers AllReduceSumStart its group lacks", r)
		}
		if _, ok := rk.Data.(comm.AsyncReducer); !ok {
			t.Errorf("rank %d: the timed data group lost AllReduceSumStart", r)
		}
		if _, ok := rk.Data.(comm.PeerAccess); ok {
			t.Errorf("rank %d: the timed data group offers PeerAccess its group lacks", r)
		}
	}
	errs := make([]error, 2)
	sums := make([][]float32, 2)
	var wg sync.WaitGroup
	for r, rk := range world {
		wg.Go(func() {
			x := b.New(backend.Float32, 2)
			backend.UploadSlice(b, x, []float32{float32(r + 1), 1})
			if errs[r] = rk.Expert.AllReduceSum(x); errs[r] != nil {
				return
			}
			if _, errs[r] = rk.Expert.(comm.PeerAccess).PeerTensors(x); errs[r] != nil {
				return
			}
			p, err := rk.Data.(comm.AsyncReducer).AllReduceSumStart(x)
			if err != nil {
				errs[r] = err
				return
			}
			if errs[r] = p.Wait(); errs[r] != nil {
				return
			}
			errs[r] = rk.World.Barrier()
			sums[r] = backend.DownloadFloat32(b, x)
		})
	}
	wg.Wait()
	for r := range world {
		if errs[r] != nil {
			t.Fatalf("rank %d: %v", r, errs[r])
		}
		// [1 1] + [2 1] over the expert group, then that over the data
		// group (both ranks: the dense weights' replicas).
		if !slices.Equal(sums[r], []float32{6, 4}) {
			t.Errorf("rank %d: sum %v, want [6 4]", r, sums[r])
		}
		want := []string{"AllReduceSum", "PeerTensors", "AllReduceSumStart", "AllReduceSumWait", "Barrier"}
		if !slices.Equal(timers[r].ops, want) {
			t.Errorf("rank %d timed %v, want %v", r, timers[r].ops, want)
		}
	}
	// An aborted group's error comes through the timer.
	reason := errors.New("rank 1 failed")
	world[1].Abort(reason)
	if err := world[0].World.Barrier(); !errors.Is(err, reason) {
		t.Errorf("Barrier after an abort: %v", err)
	}
}
