package comm_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
)

// runRanks runs fn on every rank concurrently and fails the test on any
// error, or if the ranks do not all return within a few seconds.
func runRanks(t *testing.T, ranks []*comm.Ranks, fn func(r *comm.Ranks) error) {
	t.Helper()
	errs := make([]error, len(ranks))
	var wg sync.WaitGroup
	for i, r := range ranks {
		wg.Go(func() { errs[i] = fn(r) })
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("ranks did not finish: a collective hangs")
	}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", i, err)
		}
	}
}

// worlds returns in-process worlds of 1, 2 and 4 ranks (EP only, so the
// expert group is the whole world).
func worlds(t *testing.T) [][]*comm.Ranks {
	var out [][]*comm.Ranks
	for _, w := range []int{1, 2, 4} {
		ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: w, CP: 1, TP: 1})
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, ranks)
	}
	return out
}

func randVals(rng *rand.Rand, n int) []float64 {
	v := make([]float64, n)
	for i := range v {
		v[i] = rng.NormFloat64()
	}
	return v
}

// hostTensor makes a CPU tensor of dt holding vals.
func hostTensor(dt backend.DType, vals []float64, shape ...int) backend.Tensor {
	t := cpu.New(backend.Float64).New(dt, shape...).(*cpu.Tensor)
	for i, v := range vals {
		switch dt {
		case backend.Float32:
			t.Float32s()[i] = float32(v)
		case backend.Float64:
			t.Float64s()[i] = v
		case backend.Int32:
			t.Int32s()[i] = int32(v)
		}
	}
	return t
}

func tensorVals(t backend.Tensor) []float64 {
	ct := t.(*cpu.Tensor)
	out := make([]float64, ct.Len())
	for i := range out {
		switch ct.DType() {
		case backend.Float32:
			out[i] = float64(ct.Float32s()[i])
		case backend.Float64:
			out[i] = ct.Float64s()[i]
		case backend.Int32:
			out[i] = float64(ct.Int32s()[i])
		}
	}
	return out
}

// AllReduceSum equals the sequential rank-order sum, bitwise, on every rank;
// lengths that do not split evenly over the ranks (and fewer elements than
// ranks) are included.
func TestAllReduceSum(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 1))
	for _, ranks := range worlds(t) {
		W := len(ranks)
		for _, dt := range []backend.DType{backend.Float64, backend.Float32} {
			for _, n := range []int{1, 3, 7, 64} {
				in := make([][]float64, W)
				tensors := make([]backend.Tensor, W)
				for r := range W {
					in[r] = randVals(rng, n)
					tensors[r] = hostTensor(dt, in[r], n)
				}
				// The reference sums in the tensors' own precision, in rank order.
				want := tensorVals(hostTensor(dt, in[0], n))
				for i := range n {
					switch dt {
					case backend.Float32:
						s := float32(in[0][i])
						for r := 1; r < W; r++ {
							s += float32(in[r][i])
						}
						want[i] = float64(s)
					default:
						s := in[0][i]
						for r := 1; r < W; r++ {
							s += in[r][i]
						}
						want[i] = s
					}
				}
				runRanks(t, ranks, func(r *comm.Ranks) error { return r.Expert.AllReduceSum(tensors[r.Rank]) })
				for r := range W {
					got := tensorVals(tensors[r])
					for i := range n {
						if got[i] != want[i] {
							t.Fatalf("W=%d %v n=%d rank %d: [%d] = %v, want %v", W, dt, n, r, i, got[i], want[i])
						}
					}
				}
			}
		}
	}
}

func TestAllReduceFloat64AndAllToAllInts(t *testing.T) {
	rng := rand.New(rand.NewPCG(2, 2))
	for _, ranks := range worlds(t) {
		W := len(ranks)
		vals := make([][]float64, W)
		want := make([]float64, 5)
		send := make([][]int, W)
		recv := make([][]int, W)
		for r := range W {
			vals[r] = randVals(rng, 5)
			for i := range want {
				want[i] += vals[r][i]
			}
			send[r] = make([]int, W)
			for j := range send[r] {
				send[r][j] = rng.IntN(100)
			}
		}
		runRanks(t, ranks, func(r *comm.Ranks) error {
			var err error
			if err = r.Data.AllReduceFloat64(vals[r.Rank]); err != nil {
				return err
			}
			recv[r.Rank], err = r.Expert.AllToAllInts(send[r.Rank])
			return err
		})
		for r := range W {
			for i := range want {
				if vals[r][i] != want[i] {
					t.Fatalf("W=%d rank %d: sum[%d] = %v, want %v", W, r, i, vals[r][i], want[i])
				}
			}
			for j := range W {
				if recv[r][j] != send[j][r] {
					t.Fatalf("W=%d: rank %d got %d from rank %d, which sent %d", W, r, recv[r][j], j, send[j][r])
				}
			}
		}
	}
}

// AllToAllRows with random uneven splits, zeros included, matches a
// sequential reference; repeated rounds check that no collective sees
// another's data.
func TestAllToAllRows(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 3))
	const cols = 3
	for _, ranks := range worlds(t) {
		W := len(ranks)
		for iter := range 20 {
			dt := []backend.DType{backend.Float64, backend.Float32, backend.Int32}[iter%3]
			counts := make([][]int, W) // counts[i][j]: rows i sends to j
			for i := range counts {
				counts[i] = make([]int, W)
				for j := range counts[i] {
					counts[i][j] = rng.IntN(4) // 0 is common
				}
			}
			send := make([][]float64, W)
			sendT := make([]backend.Tensor, W)
			recvT := make([]backend.Tensor, W)
			recvCounts := make([][]int, W)
			for i := range W {
				n, nr := 0, 0
				recvCounts[i] = make([]int, W)
				for j := range W {
					n += counts[i][j]
					recvCounts[i][j] = counts[j][i]
					nr += counts[j][i]
				}
				send[i] = make([]float64, n*cols)
				for k := range send[i] {
					send[i][k] = float64(rng.IntN(1000) - 500)
				}
				sendT[i] = hostTensor(dt, send[i], n, cols)
				recvT[i] = hostTensor(dt, nil, nr, cols)
			}
			runRanks(t, ranks, func(r *comm.Ranks) error {
				return r.Expert.AllToAllRows(recvT[r.Rank], sendT[r.Rank], recvCounts[r.Rank], counts[r.Rank])
			})
			for j := range W {
				var want []float64
				for i := range W {
					from := 0
					for k := range j {
						from += counts[i][k]
					}
					want = append(want, send[i][from*cols:(from+counts[i][j])*cols]...)
				}
				got := tensorVals(recvT[j])
				if fmt.Sprint(got) != fmt.Sprint(want) {
					t.Fatalf("W=%d iter %d rank %d: got %v, want %v", W, iter, j, got, want)
				}
			}
		}
	}
}

// Counts that disagree between sender and receiver fail on every rank with
// the same message, and nobody hangs.
func TestAllToAllRowsMismatchFailsEverywhere(t *testing.T) {
	ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 2, CP: 1, TP: 1})
	if err != nil {
		t.Fatal(err)
	}
	errs := make([]error, 2)
	runRanks(t, ranks, func(r *comm.Ranks) error {
		// Both expect one row from each rank; rank 1 sends both its rows
		// to rank 0.
		send, recv := hostTensor(backend.Float64, nil, 2, 1), hostTensor(backend.Float64, nil, 2, 1)
		recvCounts, sendCounts := []int{1, 1}, []int{1, 1}
		if r.Rank == 1 {
			sendCounts = []int{2, 0}
		}
		errs[r.Rank] = r.Expert.AllToAllRows(recv, send, recvCounts, sendCounts)
		return nil
	})
	for i, err := range errs {
		if err == nil || !strings.Contains(err.Error(), "rank 1 sends 2 rows to rank 0, which expects 1") {
			t.Fatalf("rank %d: error %v", i, err)
		}
	}
	// A local argument error (counts that do not match the tensor) is
	// reported on every rank too.
	runRanks(t, ranks, func(r *comm.Ranks) error {
		counts := []int{1, 1}
		if r.Rank == 1 {
			counts = []int{1, 5}
		}
		err := r.Expert.AllToAllRows(hostTensor(backend.Float64, nil, 2, 1), hostTensor(backend.Float64, nil, 2, 1), []int{1, 1}, counts)
		if err == nil || !strings.Contains(err.Error(), "rank 1") {
			return fmt.Errorf("want an error naming rank 1, got %v", err)
		}
		return nil
	})
}

// Ranks that call different collectives get an error instead of mixing them
// up.
func TestMismatchedCollectivesFail(t *testing.T) {
	ranks, err := comm.NewLocal(comm.Mesh{DP: 2, EP: 1, CP: 1, TP: 1})
	if err != nil {
		t.Fatal(err)
	}
	runRanks(t, ranks, func(r *comm.Ranks) error {
		var err error
		if r.Rank == 0 {
			err = r.Data.Barrier()
		} else {
			err = r.Data.AllReduceFloat64([]float64{1})
		}
		if err == nil || !strings.Contains(err.Error(), "same collectives in the same order") {
			return fmt.Errorf("want a call-order error, got %v", err)
		}
		return nil
	})
}

// Abort releases a rank blocked in a collective, and every later collective
// of the group fails with the abort's cause.
func TestAbortReleasesBlockedRank(t *testing.T) {
	ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 3, CP: 1, TP: 1})
	if err != nil {
		t.Fatal(err)
	}
	cause := errors.New("rank 2 ran out of memory")
	blocked := make(chan error, 2)
	for _, r := range ranks[:2] {
		go func() { blocked <- r.Expert.AllReduceSum(hostTensor(backend.Float64, []float64{1, 2}, 2)) }()
	}
	time.Sleep(20 * time.Millisecond) // let both block (the test passes either way)
	ranks[2].Abort(cause)
	for range 2 {
		select {
		case err := <-blocked:
			if !errors.Is(err, cause) {
				t.Fatalf("blocked rank returned %v, want the abort cause", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("Abort did not release a blocked rank")
		}
	}
	if err := ranks[0].Expert.Barrier(); !errors.Is(err, cause) {
		t.Fatalf("collective after Abort returned %v", err)
	}
	// Ranks.Abort reached the rank's other groups too.
	if err := ranks[1].World.Barrier(); !errors.Is(err, cause) {
		t.Fatalf("world collective after Ranks.Abort returned %v", err)
	}
	// A group the failing rank is not in is untouched (size 1 here).
	if err := ranks[0].ExpertReplica.Barrier(); err != nil {
		t.Fatalf("unrelated group: %v", err)
	}
}

// Reduced gradients are bitwise identical across ranks under many rounds of
// mixed collectives (run with -race to check the round hand-off).
func TestManyRoundsStayConsistent(t *testing.T) {
	ranks, err := comm.NewLocal(comm.Mesh{DP: 2, EP: 2, CP: 1, TP: 1})
	if err != nil {
		t.Fatal(err)
	}
	const rounds, n = 200, 9
	results := make([][]float64, len(ranks))
	runRanks(t, ranks, func(r *comm.Ranks) error {
		rng := rand.New(rand.NewPCG(uint64(r.Rank), 7))
		acc := make([]float64, n)
		for range rounds {
			x := hostTensor(backend.Float64, randVals(rng, n), n)
			if err := r.World.AllReduceSum(x); err != nil {
				return err
			}
			v := []float64{float64(r.Rank)}
			if err := r.Data.AllReduceFloat64(v); err != nil {
				return err
			}
			if v[0] != 6 {
				return fmt.Errorf("rank-sum %v, want 6", v[0])
			}
			for i, s := range tensorVals(x) {
				acc[i] += s
			}
		}
		results[r.Rank] = acc
		return nil
	})
	for r := 1; r < len(ranks); r++ {
		if fmt.Sprint(results[r]) != fmt.Sprint(results[0]) {
			t.Fatalf("rank %d's sums differ from rank 0's", r)
		}
	}
}
