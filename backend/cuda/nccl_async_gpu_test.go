package cuda

// AllReduceSumStart on GPUs (nccl_async.go): buckets started behind the
// compute stream's writes, with more writes to other buckets queued in
// between, and waited for before they are read, give AllReduceSum's sums;
// with CheckArgs a start is a checked AllReduceSum; Abort releases a Wait
// whose peer never starts. They skip, with one line, where there is no GPU
// or too few (see gpu_test.go).

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
)

// asyncScenario builds one rank's flat gradient as a backward would, the
// last bucket first: step j adds a random tensor to every element below
// the end of bucket B-1-j, which makes that bucket final, and starts its
// reduction; so the earlier buckets are written while the later ones
// reduce. Then it waits for all and reads the flat tensor back. want is the
// same tensor built whole and summed with one AllReduceSum.
func asyncScenario(g *NCCLGroup, b *Backend, seed uint64) (got, want []float64, err error) {
	const n = 1 << 16
	cuts := []int{0, 1000, 20000, 20001, n} // buckets of uneven lengths, one of one element
	buckets := len(cuts) - 1
	rng := rand.New(rand.NewPCG(seed, uint64(g.Rank())))
	srcs := make([]backend.Tensor, buckets)
	for j := range srcs {
		v := make([]float32, n)
		for i := range v {
			v[i] = float32(rng.NormFloat64())
		}
		srcs[j] = b.New(backend.Float32, n)
		backend.UploadSlice(b, srcs[j], v)
	}
	// step j writes elements [0, end(j)).
	end := func(j int) int { return cuts[buckets-j] }
	flat, whole := b.New(backend.Float32, n), b.New(backend.Float32, n)
	b.Zero(flat)
	b.Zero(whole)
	for j, s := range srcs {
		b.Axpy(b.View(whole, 0, end(j)), 1, b.View(s, 0, end(j)))
	}
	if err := g.AllReduceSum(whole); err != nil {
		return nil, nil, err
	}
	var pending []comm.Pending
	for j, s := range srcs {
		b.Axpy(b.View(flat, 0, end(j)), 1, b.View(s, 0, end(j)))
		i := buckets - 1 - j
		p, err := g.AllReduceSumStart(b.View(flat, cuts[i], cuts[i+1]-cuts[i]))
		if err != nil {
			return nil, nil, err
		}
		pending = append(pending, p)
	}
	if err := comm.WaitAll(pending); err != nil {
		return nil, nil, err
	}
	got, want = backend.DownloadFloat64(b, flat), backend.DownloadFloat64(b, whole)
	return got, want, b.Sync()
}

func TestNCCLAllReduceStart(t *testing.T) {
	for _, n := range []int{1, 2, 4} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			gs, bs := ncclWorld(t, n, NCCLOptions{})
			for round := range 2 { // the second reuses the stream and its events
				got, want := make([][]float64, n), make([][]float64, n)
				errs := runEach(t, n, func(r int, err error) { gs[r].Abort(err) }, func(r int) error {
					var err error
					got[r], want[r], err = asyncScenario(gs[r], bs[r], uint64(40+round))
					return err
				})
				if err := errors.Join(errs...); err != nil {
					t.Fatal(err)
				}
				for r := range n {
					bad := 0
					for i := range want[r] {
						g, w := got[r][i], want[r][i]
						// Up to two ranks the sum of each element is one
						// rounding whatever NCCL's order; beyond, its
						// order may depend on where the buckets cut.
						ok := g == w
						if n > 2 {
							ok = math.Abs(g-w) <= 1e-5*(1+math.Abs(w))
						}
						if !ok {
							if bad++; bad <= 5 {
								t.Errorf("round %d, rank %d, element %d: %v from the started buckets, %v from one AllReduceSum", round, r, i, g, w)
							}
						}
					}
					if bad > 5 {
						t.Errorf("round %d, rank %d: %d elements differ", round, r, bad)
					}
				}
			}
		})
	}
}

// With CheckArgs a start agrees on the arguments like AllReduceSum: a
// mismatch fails on every rank at the start, a match is done at once.
func TestNCCLAllReduceStartCheckArgs(t *testing.T) {
	gs, bs := ncclWorld(t, 2, NCCLOptions{CheckArgs: true})
	errs := runEach(t, 2, nil, func(r int) error {
		_, err := gs[r].AllReduceSumStart(bs[r].New(backend.Float32, 4+r))
		return err
	})
	want := "comm: world group AllReduceSum: rank 1 has 5 elements of float32, rank 0 has 4 of float32"
	for r, err := range errs {
		if err == nil || err.Error() != want {
			t.Errorf("rank %d: %v, want %q", r, err, want)
		}
	}
	errs = runEach(t, 2, nil, func(r int) error {
		x := bs[r].New(backend.Float32, 3)
		backend.UploadSlice(bs[r], x, []float32{1, float32(r), 2})
		p, err := gs[r].AllReduceSumStart(x)
		if err != nil {
			return err
		}
		if err := p.Wait(); err != nil {
			return err
		}
		if got := backend.DownloadFloat64(bs[r], x); fmt.Sprint(got) != "[2 1 4]" {
			return fmt.Errorf("rank %d: sum %v, want [2 1 4]", r, got)
		}
		return nil
	})
	if err := errors.Join(errs...); err != nil {
		t.Error(err)
	}
}

// A rank whose peer never starts the reduction gets the peer's Abort's
// reason from Wait; its device is not left stuck behind the aborted
// all-reduce, and a start after the abort fails at once.
func TestNCCLAllReduceStartAbort(t *testing.T) {
	gs, bs := ncclWorld(t, 2, NCCLOptions{})
	if err := errors.Join(runEach(t, 2, nil, func(r int) error { return gs[r].Barrier() })...); err != nil {
		t.Fatal(err)
	}
	p, err := gs[0].AllReduceSumStart(bs[0].New(backend.Float32, 1<<20))
	if err != nil {
		t.Fatal(err)
	}
	// The all-reduce is stuck on the GPU, waiting for rank 1. Wait itself
	// does not block the host (the compute stream waits), so an abort
	// before it must show in its result.
	reason := errors.New("rank 1 failed")
	gs[1].Abort(reason)
	if err := p.Wait(); !errors.Is(err, reason) {
		t.Fatalf("Wait after the peer's abort: %v", err)
	}
	synced := make(chan error, 1)
	go func() { synced <- bs[0].Sync() }()
	select {
	case err := <-synced:
		if err != nil {
			t.Logf("the device after the aborted reduction: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the compute stream is still waiting for the aborted reduction after 30s")
	}
	if _, err := gs[0].AllReduceSumStart(bs[0].New(backend.Float32, 4)); err == nil || !strings.Contains(err.Error(), "world group aborted") {
		t.Errorf("a start after the abort: %v", err)
	}
}
