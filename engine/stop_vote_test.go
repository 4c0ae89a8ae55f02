package engine

import (
	"sync"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
)

// voteAll has every voter of votes vote (rank i votes to stop when stop(i))
// at once and returns the sums each counted.
func voteAll(t *testing.T, votes []stopVoter, stop func(i int) bool) []float64 {
	t.Helper()
	sums := make([]float64, len(votes))
	var wg sync.WaitGroup
	for i, v := range votes {
		wg.Go(func() {
			vals := []float64{0}
			if stop(i) {
				vals[0] = 1
			}
			if err := v.AllReduceFloat64(vals); err != nil {
				t.Error(err)
			}
			sums[i] = vals[0]
		})
	}
	wg.Wait()
	return sums
}

// TestStopVotes: a distributed run over TCP votes over its world group
// (which meets on the host); the ranks of one process over a group of
// their own that meets on the host (so that on GPUs a vote never waits
// for a device's queue), which sums every rank's vote; the ranks of a run
// over several processes whose groups are the devices' (NCCL) sum their
// process's votes on the host and the processes' over the rendezvous, so
// every rank of every process counts every vote.
func TestStopVotes(t *testing.T) {
	b := cpu.New(backend.Float32)
	world, err := comm.NewLocal(comm.Mesh{DP: 2, EP: 2, CP: 1, TP: 1}, b)
	if err != nil {
		t.Fatal(err)
	}
	votes, err := stopVotes(world, true, nil, b)
	if err != nil {
		t.Fatal(err)
	}
	for i, v := range votes {
		if v != world[i].World {
			t.Errorf("distributed over TCP: rank %d votes over %v, want its world group", i, v)
		}
	}
	votes, err = stopVotes(world, false, nil, b)
	if err != nil {
		t.Fatal(err)
	}
	for i, v := range votes {
		g, ok := v.(comm.Group)
		if !ok || g == world[i].World || g.Size() != len(world) || g.Rank() != world[i].Rank {
			t.Errorf("one process: rank %d votes over %v, want a host group of its own in which it is rank %d of %d", i, v, world[i].Rank, len(world))
		}
	}
	for i, s := range voteAll(t, votes, func(i int) bool { return i%2 == 1 }) { // ranks 1 and 3
		if s != 2 {
			t.Errorf("one process: rank %d counted %v votes to stop, want 2", i, s)
		}
	}

	// Two processes (nodes) of two ranks each, NCCL-like: each process's
	// ranks are a world of their own here, the rendezvous joins them.
	rdvs := joinLoopback(t, 2)
	var all []stopVoter
	for node := range 2 {
		ranks, err := comm.NewLocal(comm.Mesh{DP: 2, EP: 1, CP: 1, TP: 1}, b)
		if err != nil {
			t.Fatal(err)
		}
		vs, err := stopVotes(ranks, true, rdvs[node], b)
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, vs...)
	}
	for round, stop := range []func(i int) bool{
		func(int) bool { return false },
		func(i int) bool { return i == 3 },           // the second process's second rank
		func(i int) bool { return i == 0 || i == 2 }, // each process's first
	} {
		want := 0.0
		for i := range all {
			if stop(i) {
				want++
			}
		}
		for i, s := range voteAll(t, all, stop) {
			if s != want {
				t.Errorf("two processes, round %d: rank %d counted %v votes to stop, want %v", round, i, s, want)
			}
		}
	}
}
