package comm_test

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
)

// overlapScript is what a rank's gradient reduction does during its
// backward: it cuts two flat tensors into buckets of uneven lengths and
// starts their reductions over two groups (the data-context group and the
// expert replicas) from the last bucket to the first, interleaved with
// other groups' collectives, as the layers' backward would run them; then
// it waits for all, in start order. It returns both tensors' bits.
func overlapScript(b backend.Backend, r *comm.Ranks, seed uint64) ([]uint64, error) {
	rng := rand.New(rand.NewPCG(seed, uint64(r.Rank)))
	flatA, flatB := b.New(backend.Float32, 40), b.New(backend.Float32, 30)
	set(b, flatA, randVals(rng, 40))
	set(b, flatB, randVals(rng, 30))
	cutsA, cutsB := []int{0, 5, 17, 18, 40}, []int{0, 7, 30}
	var pending []comm.Pending
	start := func(g comm.Group, flat backend.Tensor, cuts []int, i int) error {
		p, err := comm.StartAllReduce(g, b.View(flat, cuts[i], cuts[i+1]-cuts[i]))
		if err != nil {
			return err
		}
		pending = append(pending, p)
		return nil
	}
	// The computation in between uses other groups, as a layer's backward
	// uses the expert group.
	other := func() error {
		x := b.New(backend.Float32, 3)
		set(b, x, randVals(rng, 3))
		if err := r.Expert.AllReduceSum(x); err != nil {
			return err
		}
		_, err := r.Expert.AllToAllInts(make([]int, r.Expert.Size()))
		return err
	}
	for _, step := range []func() error{
		func() error { return start(r.DataContext, flatA, cutsA, 3) },
		func() error { return start(r.ExpertReplica, flatB, cutsB, 1) },
		other,
		func() error { return start(r.DataContext, flatA, cutsA, 2) },
		func() error { return start(r.DataContext, flatA, cutsA, 1) },
		other,
		func() error { return start(r.ExpertReplica, flatB, cutsB, 0) },
		func() error { return start(r.DataContext, flatA, cutsA, 0) },
	} {
		if err := step(); err != nil {
			return nil, err
		}
	}
	if err := comm.WaitAll(pending); err != nil {
		return nil, err
	}
	var out []uint64
	for _, t := range []backend.Tensor{flatA, flatB} {
		for _, v := range get(b, t) {
			out = append(out, math.Float64bits(v))
		}
	}
	return out, nil
}

// syncScript is overlapScript's reference: the same inputs, each tensor
// summed whole by one AllReduceSum of the in-process groups.
func syncScript(b backend.Backend, r *comm.Ranks, seed uint64) ([]uint64, error) {
	rng := rand.New(rand.NewPCG(seed, uint64(r.Rank)))
	flatA, flatB := b.New(backend.Float32, 40), b.New(backend.Float32, 30)
	set(b, flatA, randVals(rng, 40))
	set(b, flatB, randVals(rng, 30))
	if err := r.DataContext.AllReduceSum(flatA); err != nil {
		return nil, err
	}
	if err := r.ExpertReplica.AllReduceSum(flatB); err != nil {
		return nil, err
	}
	var out []uint64
	for _, t := range []backend.Tensor{flatA, flatB} {
		for _, v := range get(b, t) {
			out = append(out, math.Float64bits(v))
		}
	}
	return out, nil
}

// Bucketed reductions started during other groups' work and waited for
// afterwards give bitwise the sums of one plain AllReduceSum, on the
// in-process groups (which reduce at once) and on TCP groups (which reduce
// in the background, in start order: a bucket summed out of order would
// meet a peer's bucket of another length and fail). Run with -race: the
// TCP reductions move their buckets on goroutines of their own while the
// rank's goroutine runs other groups' collectives.
func TestStartAllReduceMatchesAllReduceSum(t *testing.T) {
	b := cpu.New(backend.Float32)
	m := comm.Mesh{DP: 2, EP: 2, CP: 1, TP: 1}
	local := newLocal(t, m, b)
	remote := tcpRanks(t, m, 2, b)
	if _, ok := local[0].DataContext.(comm.AsyncReducer); ok {
		t.Error("the in-process groups claim to reduce in the background; they share one backend and should reduce at once")
	}
	if _, ok := remote[0].DataContext.(comm.AsyncReducer); !ok {
		t.Error("the TCP groups do not implement comm.AsyncReducer")
	}
	for round := range 3 {
		seed := uint64(20 + round)
		want := make([][]uint64, len(local))
		runRanks(t, local, func(r *comm.Ranks) (err error) { want[r.Rank], err = syncScript(b, r, seed); return })
		for _, rs := range []struct {
			name  string
			ranks []*comm.Ranks
		}{{"local", local}, {"tcp", remote}} {
			got := make([][]uint64, len(rs.ranks))
			runRanks(t, rs.ranks, func(r *comm.Ranks) (err error) { got[r.Rank], err = overlapScript(b, r, seed); return })
			for r := range want {
				if fmt.Sprint(got[r]) != fmt.Sprint(want[r]) {
					t.Fatalf("%s, round %d, rank %d: bucketed reductions give\n%v\none AllReduceSum gives\n%v", rs.name, round, r, got[r], want[r])
				}
			}
		}
	}
}

// A rank that starts a reduction with a bad tensor makes every rank's
// reduction fail with its reason (at Wait on TCP, at once in-process),
// and the group stays usable.
func TestStartAllReduceArgumentErrorFailsEverywhere(t *testing.T) {
	b := cpu.New(backend.Float32)
	m := comm.Mesh{DP: 2, EP: 1, CP: 1, TP: 1}
	for _, rs := range []struct {
		name  string
		ranks []*comm.Ranks
	}{{"local", newLocal(t, m, b)}, {"tcp", tcpRanks(t, m, 2, b)}} {
		t.Run(rs.name, func(t *testing.T) {
			errs := make([]error, len(rs.ranks))
			var wg sync.WaitGroup
			for i, r := range rs.ranks {
				wg.Go(func() {
					x := b.New(backend.Float32, 4)
					if i == 1 {
						x = b.New(backend.Int32, 4)
					}
					p, err := comm.StartAllReduce(r.Data, x)
					if err == nil {
						err = p.Wait()
					}
					errs[i] = err
				})
			}
			waitOrFail(t, &wg, 5*time.Second)
			for i, err := range errs {
				if err == nil || !strings.Contains(err.Error(), "cannot sum a int32 tensor") {
					t.Errorf("rank %d: %v, want the bad tensor's error", i, err)
				}
			}
			runRanks(t, rs.ranks, func(r *comm.Ranks) error {
				p, err := comm.StartAllReduce(r.Data, b.New(backend.Float32, 4))
				if err != nil {
					return err
				}
				return p.Wait()
			})
		})
	}
}

// Abort releases a rank waiting for a reduction whose peer never starts
// it, with the abort's reason, and a start after the abort fails at once.
func TestStartAllReduceAbort(t *testing.T) {
	b := cpu.New(backend.Float32)
	m := comm.Mesh{DP: 2, EP: 2, CP: 1, TP: 1}
	for _, rs := range []struct {
		name  string
		ranks []*comm.Ranks
	}{{"local", newLocal(t, m, b)}, {"tcp", tcpRanks(t, m, 2, b)}} {
		t.Run(rs.name, func(t *testing.T) {
			cause := errors.New("rank 3 ran out of memory")
			errs := make([]error, 3)
			var wg sync.WaitGroup
			for i, r := range rs.ranks[:3] {
				wg.Go(func() {
					// Two in flight, so the second waits behind the first.
					var ps []comm.Pending
					for _, n := range []int{5, 6} {
						p, err := comm.StartAllReduce(r.DataContext, b.New(backend.Float32, n))
						if err != nil {
							errs[i] = err
							return
						}
						ps = append(ps, p)
					}
					errs[i] = comm.WaitAll(ps)
				})
			}
			time.Sleep(50 * time.Millisecond)
			rs.ranks[3].Abort(cause)
			waitOrFail(t, &wg, 5*time.Second)
			for i, err := range errs {
				if err == nil || !strings.Contains(err.Error(), cause.Error()) {
					t.Errorf("rank %d: %v, want the abort's reason", i, err)
				}
			}
			if _, err := comm.StartAllReduce(rs.ranks[0].DataContext, b.New(backend.Float32, 5)); err == nil {
				t.Error("a reduction started after the abort did not fail at once")
			}
		})
	}
}

func TestWaitAllWaitsForEvery(t *testing.T) {
	first, second := errors.New("first"), errors.New("second")
	waited := 0
	ps := []comm.Pending{comm.Done(nil), comm.Done(first), countWait{&waited, second}, countWait{&waited, nil}}
	if err := comm.WaitAll(ps); err != first {
		t.Errorf("WaitAll returned %v, want the first error", err)
	}
	if waited != 2 {
		t.Errorf("WaitAll waited for %d of the 2 pending reductions after the failed one", waited)
	}
}

type countWait struct {
	n   *int
	err error
}

func (c countWait) Wait() error { *c.n++; return c.err }
