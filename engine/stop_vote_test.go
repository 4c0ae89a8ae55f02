package engine

import (
	"sync"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
)

// TestStopVotes: a distributed run's ranks vote over their world group;
// the ranks of one process over a group of their own that meets on the
// host (so that on GPUs a vote never waits for a device's queue), which
// sums every rank's vote.
func TestStopVotes(t *testing.T) {
	b := cpu.New(backend.Float32)
	world, err := comm.NewLocal(comm.Mesh{DP: 2, EP: 2, CP: 1, TP: 1}, b)
	if err != nil {
		t.Fatal(err)
	}
	votes, err := stopVotes(world, true, b)
	if err != nil {
		t.Fatal(err)
	}
	for i, v := range votes {
		if v != world[i].World {
			t.Errorf("distributed: rank %d votes over %v, want its world group", i, v)
		}
	}
	votes, err = stopVotes(world, false, b)
	if err != nil {
		t.Fatal(err)
	}
	sums := make([]float64, len(votes))
	var wg sync.WaitGroup
	for i, v := range votes {
		if v == world[i].World {
			t.Errorf("one process: rank %d votes over its world group", i)
		}
		if v.Size() != len(world) || v.Rank() != world[i].Rank {
			t.Errorf("one process: rank %d votes as rank %d of %d", i, v.Rank(), v.Size())
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			vals := []float64{float64(i % 2)} // ranks 1 and 3 vote to stop
			if err := v.AllReduceFloat64(vals); err != nil {
				t.Error(err)
			}
			sums[i] = vals[0]
		}()
	}
	wg.Wait()
	for i, s := range sums {
		if s != 2 {
			t.Errorf("rank %d counted %v votes to stop, want 2", i, s)
		}
	}
}
