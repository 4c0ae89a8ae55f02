package comm_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
	"gorgonia.org/tensor"
)

// runRanks runs fn on every rank concurrently and fails the test on any
// error, or if the ranks do not all return within a few seconds. A rank
// that fails aborts its groups, so its peers stop too.
func runRanks(t *testing.T, ranks []*comm.Ranks, fn func(r *comm.Ranks) error) {
	t.Helper()
	errs := make([]error, len(ranks))
	var wg sync.WaitGroup
	for i, r := range ranks {
		wg.Go(func() {
			if errs[i] = fn(r); errs[i] != nil {
				r.Abort(errs[i])
			}
		})
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

// opaqueBackend is the CPU backend with its tensors behind another type, as
// a GPU backend's are: a communicator that reached for host memory instead
// of moving data with the backend's ops would fail on it. It implements the
// ops the communicator and these tests use; any other op panics on the
// unknown tensor type.
type opaqueBackend struct{ *cpu.Backend }

type opaqueTensor struct{ backend.Tensor }

func unwrap(t backend.Tensor) backend.Tensor { return t.(opaqueTensor).Tensor }

func (opaqueBackend) Name() string { return "opaque" }
func (o opaqueBackend) New(dt backend.DType, shape ...int) backend.Tensor {
	return opaqueTensor{o.Backend.New(dt, shape...)}
}
func (o opaqueBackend) View(t backend.Tensor, offset int, shape ...int) backend.Tensor {
	return opaqueTensor{o.Backend.View(unwrap(t), offset, shape...)}
}
func (o opaqueBackend) Copy(dst, src backend.Tensor) { o.Backend.Copy(unwrap(dst), unwrap(src)) }
func (o opaqueBackend) Axpy(dst backend.Tensor, alpha float64, x backend.Tensor) {
	o.Backend.Axpy(unwrap(dst), alpha, unwrap(x))
}
func (o opaqueBackend) Upload(dst backend.Tensor, src *tensor.Dense) {
	o.Backend.Upload(unwrap(dst), src)
}
func (o opaqueBackend) Download(t backend.Tensor) *tensor.Dense { return o.Backend.Download(unwrap(t)) }

// backends returns the backends the collectives are tested on, computing in
// dt: the CPU backend, and the same behind opaque tensors.
func backends(dt backend.DType) []backend.Backend {
	return []backend.Backend{cpu.New(dt), opaqueBackend{cpu.New(dt)}}
}

// worlds returns in-process worlds of 1, 2 and 4 ranks on b (EP only, so
// the expert group is the whole world).
func worlds(t *testing.T, b backend.Backend) [][]*comm.Ranks {
	var out [][]*comm.Ranks
	for _, w := range []int{1, 2, 4} {
		ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: w, CP: 1, TP: 1}, b)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, ranks)
	}
	return out
}

func newLocal(t *testing.T, m comm.Mesh, b backend.Backend) []*comm.Ranks {
	t.Helper()
	ranks, err := comm.NewLocal(m, b)
	if err != nil {
		t.Fatal(err)
	}
	return ranks
}

func randVals(rng *rand.Rand, n int) []float64 {
	v := make([]float64, n)
	for i := range v {
		v[i] = rng.NormFloat64()
	}
	return v
}

// put makes a tensor of dt on b holding vals (zeros when vals is empty).
func put(b backend.Backend, dt backend.DType, vals []float64, shape ...int) backend.Tensor {
	t := b.New(dt, shape...)
	if len(vals) > 0 {
		set(b, t, vals)
	}
	return t
}

// set uploads vals into t, converted to t's dtype.
func set(b backend.Backend, t backend.Tensor, vals []float64) {
	switch t.DType() {
	case backend.Float32:
		h := make([]float32, len(vals))
		for i, v := range vals {
			h[i] = float32(v)
		}
		backend.UploadSlice(b, t, h)
	case backend.Float64:
		backend.UploadSlice(b, t, vals)
	case backend.Int32:
		h := make([]int32, len(vals))
		for i, v := range vals {
			h[i] = int32(v)
		}
		backend.UploadSlice(b, t, h)
	}
}

// get reads t back as float64 values.
func get(b backend.Backend, t backend.Tensor) []float64 {
	if t.Len() == 0 {
		return nil
	}
	if t.DType() == backend.Int32 {
		h := backend.DownloadInt32(b, t)
		out := make([]float64, len(h))
		for i, v := range h {
			out[i] = float64(v)
		}
		return out
	}
	return backend.DownloadFloat64(b, t)
}

// AllReduceSum equals the sequential rank-order sum, bitwise, on every rank;
// lengths that do not split evenly over the ranks (and fewer elements than
// ranks) are included. The tensors are views into the middle of larger ones
// (2-D for some), as gradients in a flat buffer would be; the elements
// around them must stay untouched.
func TestAllReduceSum(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 1))
	const pad = 2
	for _, dt := range []backend.DType{backend.Float64, backend.Float32} {
		for _, b := range backends(dt) {
			for _, ranks := range worlds(t, b) {
				W := len(ranks)
				for _, n := range []int{1, 3, 7, 64} {
					shape := []int{n}
					if n == 64 {
						shape = []int{8, 8}
					}
					in := make([][]float64, W) // with the padding
					bases := make([]backend.Tensor, W)
					tensors := make([]backend.Tensor, W)
					for r := range W {
						in[r] = randVals(rng, n+2*pad)
						bases[r] = put(b, dt, in[r], n+2*pad)
						tensors[r] = b.View(bases[r], pad, shape...)
					}
					// The reference sums in the tensors' own precision, in
					// rank order; the padding keeps each rank's own values.
					want := make([][]float64, W)
					for r := range W {
						want[r] = get(b, put(b, dt, in[r], n+2*pad))
					}
					for i := pad; i < pad+n; i++ {
						var s float64
						switch dt {
						case backend.Float32:
							s32 := float32(in[0][i])
							for r := 1; r < W; r++ {
								s32 += float32(in[r][i])
							}
							s = float64(s32)
						default:
							s = in[0][i]
							for r := 1; r < W; r++ {
								s += in[r][i]
							}
						}
						for r := range W {
							want[r][i] = s
						}
					}
					runRanks(t, ranks, func(r *comm.Ranks) error { return r.Expert.AllReduceSum(tensors[r.Rank]) })
					for r := range W {
						got := get(b, bases[r])
						for i := range got {
							if got[i] != want[r][i] {
								t.Fatalf("%s W=%d %v n=%d rank %d: [%d] = %v, want %v", b.Name(), W, dt, n, r, i-pad, got[i], want[r][i])
							}
						}
					}
				}
			}
		}
	}
}

// AllReduceSum refuses, on every rank and with the same error, tensors the
// backend cannot sum and tensors whose lengths differ between ranks.
func TestAllReduceSumArgumentErrors(t *testing.T) {
	b := cpu.New(backend.Float32)
	ranks := newLocal(t, comm.Mesh{DP: 1, EP: 2, CP: 1, TP: 1}, b)
	for _, c := range []struct {
		name string
		make func(rank int) backend.Tensor
		want string
	}{
		{"float64 on a float32 backend", func(int) backend.Tensor { return b.New(backend.Float64, 3) }, "cannot sum a float64 tensor on the cpu backend, which computes in float32"},
		{"int32", func(int) backend.Tensor { return b.New(backend.Int32, 3) }, "cannot sum a int32 tensor"},
		{"nil", func(int) backend.Tensor { return nil }, "the tensor is nil"},
		{"lengths", func(r int) backend.Tensor { return b.New(backend.Float32, 3+r) }, "rank 1 has 4 elements of float32, rank 0 has 3 of float32"},
	} {
		runRanks(t, ranks, func(r *comm.Ranks) error {
			if err := r.Expert.AllReduceSum(c.make(r.Rank)); err == nil || !strings.Contains(err.Error(), c.want) {
				return fmt.Errorf("%s: error %v, want one containing %q", c.name, err, c.want)
			}
			return nil
		})
	}
	if _, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: 1, TP: 1}, nil); err == nil || !strings.Contains(err.Error(), "needs the backend") {
		t.Errorf("NewLocal without a backend: %v", err)
	}
}

func TestAllReduceFloat64AndAllToAllInts(t *testing.T) {
	rng := rand.New(rand.NewPCG(2, 2))
	for _, ranks := range worlds(t, cpu.New(backend.Float32)) {
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
	for _, b := range backends(backend.Float64) {
		for _, ranks := range worlds(t, b) {
			testAllToAllRows(t, rng, b, ranks, cols)
		}
	}
}

func testAllToAllRows(t *testing.T, rng *rand.Rand, b backend.Backend, ranks []*comm.Ranks, cols int) {
	{
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
				sendT[i] = put(b, dt, send[i], n, cols)
				recvT[i] = put(b, dt, nil, nr, cols)
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
				got := get(b, recvT[j])
				if fmt.Sprint(got) != fmt.Sprint(want) {
					t.Fatalf("%s W=%d %v iter %d rank %d: got %v, want %v", b.Name(), W, dt, iter, j, got, want)
				}
			}
		}
	}
}

// Counts that disagree between sender and receiver fail on every rank with
// the same message, and nobody hangs.
func TestAllToAllRowsMismatchFailsEverywhere(t *testing.T) {
	b := cpu.New(backend.Float64)
	ranks := newLocal(t, comm.Mesh{DP: 1, EP: 2, CP: 1, TP: 1}, b)
	errs := make([]error, 2)
	runRanks(t, ranks, func(r *comm.Ranks) error {
		// Both expect one row from each rank; rank 1 sends both its rows
		// to rank 0.
		send, recv := b.New(backend.Float64, 2, 1), b.New(backend.Float64, 2, 1)
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
		err := r.Expert.AllToAllRows(b.New(backend.Float64, 2, 1), b.New(backend.Float64, 2, 1), []int{1, 1}, counts)
		if err == nil || !strings.Contains(err.Error(), "rank 1") {
			return fmt.Errorf("want an error naming rank 1, got %v", err)
		}
		return nil
	})
}

// Ranks that call different collectives get an error instead of mixing them
// up.
func TestMismatchedCollectivesFail(t *testing.T) {
	ranks := newLocal(t, comm.Mesh{DP: 2, EP: 1, CP: 1, TP: 1}, cpu.New(backend.Float32))
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
	b := cpu.New(backend.Float64)
	ranks := newLocal(t, comm.Mesh{DP: 1, EP: 3, CP: 1, TP: 1}, b)
	cause := errors.New("rank 2 ran out of memory")
	blocked := make(chan error, 2)
	for _, r := range ranks[:2] {
		go func() { blocked <- r.Expert.AllReduceSum(put(b, backend.Float64, []float64{1, 2}, 2)) }()
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

// Many rounds of mixed collectives, with lengths changing from round to
// round (so the reduce's scratch is regrown and reused) and every buffer
// overwritten as soon as the collective returns: each rank's sums equal the
// rank-order reference bitwise, and the rows exchanged are the ones sent.
// Run with -race to check the hand-off between rounds.
func TestManyRoundsStayConsistent(t *testing.T) {
	b := cpu.New(backend.Float64)
	mesh := comm.Mesh{DP: 2, EP: 2, CP: 1, TP: 1}
	ranks := newLocal(t, mesh, b)
	W := len(ranks)
	const rounds, cols = 200, 2
	rng := rand.New(rand.NewPCG(4, 7))
	in := make([][][]float64, rounds) // [round][rank]
	want := make([][]float64, rounds)
	for k := range rounds {
		n := 1 + (k*7)%17
		in[k] = make([][]float64, W)
		for r := range W {
			in[k][r] = randVals(rng, n)
		}
		want[k] = slices.Clone(in[k][0])
		for r := 1; r < W; r++ {
			for i, v := range in[k][r] {
				want[k][i] += v
			}
		}
	}
	runRanks(t, ranks, func(r *comm.Ranks) error {
		x := b.New(backend.Float64, 17)
		send, recv := b.New(backend.Float64, mesh.EP, cols), b.New(backend.Float64, mesh.EP, cols)
		ones := []int{1, 1}
		for k := range rounds {
			n := len(in[k][r.Rank])
			xn := b.View(x, 0, n)
			backend.UploadSlice(b, xn, in[k][r.Rank])
			if err := r.World.AllReduceSum(xn); err != nil {
				return err
			}
			sum := get(b, xn)
			b.Zero(xn) // at once: the peers must be done reading it
			if !slices.Equal(sum, want[k]) {
				return fmt.Errorf("round %d: sum %v, want %v", k, sum, want[k])
			}
			// Row j goes to expert rank j and carries (round, sender, j).
			rows := make([]float64, 0, mesh.EP*cols)
			for j := range mesh.EP {
				rows = append(rows, float64(k), float64(10*r.Rank+j))
			}
			backend.UploadSlice(b, send, rows)
			if err := r.Expert.AllToAllRows(recv, send, ones, ones); err != nil {
				return err
			}
			b.Zero(send) // at once: the peers must be done reading it
			got := get(b, recv)
			for i := range mesh.EP {
				from := mesh.Rank(comm.Coord{DP: r.Coord.DP, EP: i})
				if got[i*cols] != float64(k) || got[i*cols+1] != float64(10*from+r.Coord.EP) {
					return fmt.Errorf("round %d: row from expert rank %d is %v", k, i, got[i*cols:(i+1)*cols])
				}
			}
			v := []float64{float64(r.Rank)}
			if err := r.Data.AllReduceFloat64(v); err != nil {
				return err
			}
			if v[0] != 6 {
				return fmt.Errorf("rank-sum %v, want 6", v[0])
			}
		}
		return nil
	})
}

// rankSum is the sequential reference reduction: element i of the sum, in
// rank order, of vals[r][off+i], computed in dt's precision.
func rankSum(dt backend.DType, vals [][]float64, off, n int) []float64 {
	out := make([]float64, n)
	for i := range out {
		if dt == backend.Float32 {
			s := float32(vals[0][off+i])
			for _, v := range vals[1:] {
				s += float32(v[off+i])
			}
			out[i] = float64(s)
		} else {
			s := vals[0][off+i]
			for _, v := range vals[1:] {
				s += v[off+i]
			}
			out[i] = s
		}
	}
	return out
}

// rounded returns vals as dt holds them.
func rounded(dt backend.DType, vals []float64) []float64 {
	out := slices.Clone(vals)
	if dt == backend.Float32 {
		for i, v := range out {
			out[i] = float64(float32(v))
		}
	}
	return out
}

// ReduceScatterSum leaves on rank r the rank-order sum of block r, bitwise,
// with send and recv views inside larger tensors whose other elements stay
// untouched; and in place, with recv the rank's own block of send.
func TestReduceScatterSum(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 5))
	const pad = 3
	for _, dt := range []backend.DType{backend.Float64, backend.Float32} {
		for _, b := range backends(dt) {
			for _, ranks := range worlds(t, b) {
				W := len(ranks)
				for _, n := range []int{0, 1, 5} {
					for _, inPlace := range []bool{false, true} {
						in := make([][]float64, W)  // send with padding
						out := make([][]float64, W) // recv with padding
						sendBase := make([]backend.Tensor, W)
						recvBase := make([]backend.Tensor, W)
						send := make([]backend.Tensor, W)
						recv := make([]backend.Tensor, W)
						for r := range W {
							in[r] = randVals(rng, W*n+2*pad)
							sendBase[r] = put(b, dt, in[r], W*n+2*pad)
							send[r] = b.View(sendBase[r], pad, W*n)
							if W*n%2 == 0 && W*n > 0 {
								send[r] = b.View(sendBase[r], pad, 2, W*n/2) // 2-D
							}
							if inPlace {
								recv[r] = b.View(sendBase[r], pad+r*n, n)
							} else {
								out[r] = randVals(rng, n+2*pad)
								recvBase[r] = put(b, dt, out[r], n+2*pad)
								recv[r] = b.View(recvBase[r], pad, n)
							}
						}
						runRanks(t, ranks, func(r *comm.Ranks) error {
							return r.Expert.ReduceScatterSum(recv[r.Rank], send[r.Rank])
						})
						for r := range W {
							sum := rankSum(dt, in, pad+r*n, n)
							var want, got []float64
							if inPlace {
								want = rounded(dt, in[r])
								copy(want[pad+r*n:], sum)
								got = get(b, sendBase[r])
							} else {
								want = rounded(dt, out[r])
								copy(want[pad:], sum)
								got = get(b, recvBase[r])
								if g := get(b, sendBase[r]); !slices.Equal(g, rounded(dt, in[r])) {
									t.Fatalf("%s %v W=%d n=%d rank %d: send changed", b.Name(), dt, W, n, r)
								}
							}
							if !slices.Equal(got, want) {
								t.Fatalf("%s %v W=%d n=%d in place %v rank %d:\ngot  %v\nwant %v", b.Name(), dt, W, n, inPlace, r, got, want)
							}
						}
					}
				}
			}
		}
	}
}

// AllGather puts rank j's send in block j of every rank's recv, for every
// dtype, with views inside larger tensors and in place (send being the
// rank's own block of recv).
func TestAllGather(t *testing.T) {
	rng := rand.New(rand.NewPCG(6, 6))
	const pad = 2
	for _, bt := range []backend.DType{backend.Float64, backend.Float32} {
		for _, b := range backends(bt) {
			for _, ranks := range worlds(t, b) {
				W := len(ranks)
				for iter, n := range []int{0, 1, 4, 7, 3, 2} {
					dt := []backend.DType{backend.Float64, backend.Float32, backend.Int32}[iter%3]
					inPlace := iter%2 == 1
					in := make([][]float64, W)
					sendBase := make([]backend.Tensor, W)
					recvBase := make([]backend.Tensor, W)
					send := make([]backend.Tensor, W)
					recv := make([]backend.Tensor, W)
					pads := make([][]float64, W) // recv's initial contents
					for r := range W {
						in[r] = make([]float64, n)
						for i := range in[r] {
							in[r][i] = float64(rng.IntN(2000) - 1000)
						}
						pads[r] = make([]float64, W*n+2*pad)
						for i := range pads[r] {
							pads[r][i] = float64(rng.IntN(2000) - 1000)
						}
						recvBase[r] = put(b, dt, pads[r], W*n+2*pad)
						recv[r] = b.View(recvBase[r], pad, W*n)
						if inPlace {
							send[r] = b.View(recvBase[r], pad+r*n, n)
							set(b, send[r], in[r])
						} else {
							sendBase[r] = put(b, dt, append([]float64{1}, in[r]...), n+1)
							send[r] = b.View(sendBase[r], 1, n)
						}
						if W*n%2 == 0 && W*n > 0 {
							recv[r] = b.View(recvBase[r], pad, W*n/2, 2) // 2-D
						}
					}
					runRanks(t, ranks, func(r *comm.Ranks) error {
						return r.Expert.AllGather(recv[r.Rank], send[r.Rank])
					})
					for r := range W {
						want := slices.Clone(pads[r])
						for j := range W {
							copy(want[pad+j*n:], in[j])
						}
						if got := get(b, recvBase[r]); !slices.Equal(got, want) {
							t.Fatalf("%s %v W=%d n=%d in place %v rank %d:\ngot  %v\nwant %v", b.Name(), dt, W, n, inPlace, r, got, want)
						}
					}
				}
			}
		}
	}
}

// errorsEverywhere runs call on every rank of ranks and checks that each
// fails with the same error, containing want.
func errorsEverywhere(t *testing.T, ranks []*comm.Ranks, want string, call func(r *comm.Ranks) error) {
	t.Helper()
	errs := make([]error, len(ranks))
	runRanks(t, ranks, func(r *comm.Ranks) error {
		errs[r.Rank] = call(r)
		return nil
	})
	for r, err := range errs {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("rank %d: error %v, want one containing %q", r, err, want)
		}
		if err.Error() != errs[0].Error() {
			t.Fatalf("rank %d's error %q differs from rank 0's %q", r, err, errs[0])
		}
	}
}

// Bad ReduceScatterSum and AllGather arguments, on one rank or between
// ranks, fail on every rank with the same error; the group stays usable.
func TestReduceScatterAllGatherArgumentErrors(t *testing.T) {
	b := cpu.New(backend.Float32)
	ranks := newLocal(t, comm.Mesh{DP: 1, EP: 2, CP: 1, TP: 1}, b)
	f32 := func(n int) backend.Tensor { return b.New(backend.Float32, n) }
	errorsEverywhere(t, ranks, "rank 1 has blocks of 3 elements of float32, rank 0 of 2 of float32", func(r *comm.Ranks) error {
		n := 2 + r.Rank
		return r.Expert.ReduceScatterSum(f32(n), f32(2*n))
	})
	errorsEverywhere(t, ranks, "rank 1: send has 5 elements of float32 but must hold 4", func(r *comm.Ranks) error {
		return r.Expert.ReduceScatterSum(f32(2), f32(4+r.Rank))
	})
	errorsEverywhere(t, ranks, "rank 0: cannot sum a int32 tensor (send)", func(r *comm.Ranks) error {
		return r.Expert.ReduceScatterSum(f32(1), b.New(backend.Int32, 2))
	})
	errorsEverywhere(t, ranks, "rank 1 has blocks of 2 elements of int32, rank 0 of 2 of float32", func(r *comm.Ranks) error {
		dt := []backend.DType{backend.Float32, backend.Int32}[r.Rank]
		return r.Expert.AllGather(b.New(dt, 4), b.New(dt, 2))
	})
	errorsEverywhere(t, ranks, "rank 0: recv has 3 elements of float32 but must hold 4", func(r *comm.Ranks) error {
		return r.Expert.AllGather(f32(3+r.Rank), f32(2))
	})
	errorsEverywhere(t, ranks, "rank 1: recv or send is nil", func(r *comm.Ranks) error {
		if r.Rank == 1 {
			return r.Expert.AllGather(nil, f32(2))
		}
		return r.Expert.AllGather(f32(4), f32(2))
	})
	runRanks(t, ranks, func(r *comm.Ranks) error { return r.Expert.AllGather(f32(4), f32(2)) })
}

// Point-to-point messages between every pair of ranks, several per pair of
// varying length and dtype, arrive in order and intact; the sender
// overwrites its buffer as soon as Send returns (run with -race to check
// that the receiver is done with it), and the receive buffers are views.
func TestSendRecv(t *testing.T) {
	const msgs = 5
	for _, b := range append(backends(backend.Float64), backends(backend.Float32)...) {
		for _, ranks := range worlds(t, b) {
			W := len(ranks)
			// payload is message k from src to dst: its dtype, and values
			// that name the message.
			payload := func(src, dst, k int) (backend.DType, []float64) {
				dt := []backend.DType{backend.Float64, backend.Float32, backend.Int32}[k%3]
				v := make([]float64, 1+(src+dst+k)%4)
				for i := range v {
					v[i] = float64(1000*src + 100*dst + 10*k + i)
				}
				return dt, v
			}
			runRanks(t, ranks, func(r *comm.Ranks) error {
				me := r.Rank
				bufs := map[backend.DType]backend.Tensor{}
				for _, dt := range []backend.DType{backend.Float64, backend.Float32, backend.Int32} {
					bufs[dt] = b.New(dt, 8)
				}
				send := func(peer int) error {
					for k := range msgs {
						dt, v := payload(me, peer, k)
						t := b.View(bufs[dt], 1, len(v))
						set(b, t, v)
						if err := r.Expert.Send(t, peer); err != nil {
							return err
						}
						set(b, t, make([]float64, len(v))) // at once
					}
					return nil
				}
				recv := func(peer int) error {
					for k := range msgs {
						dt, want := payload(peer, me, k)
						t := b.View(bufs[dt], 2, len(want))
						if err := r.Expert.Recv(t, peer); err != nil {
							return err
						}
						if got := get(b, t); !slices.Equal(got, want) {
							return fmt.Errorf("message %d from rank %d: got %v, want %v", k, peer, got, want)
						}
					}
					return nil
				}
				// Pairwise exchanges (W is a power of two): the lower rank
				// of each pair sends first, so nobody waits in a cycle.
				for s := 1; s < W; s++ {
					peer := me ^ s
					first, second := send, recv
					if me > peer {
						first, second = recv, send
					}
					if err := first(peer); err != nil {
						return err
					}
					if err := second(peer); err != nil {
						return err
					}
				}
				return nil
			})
		}
	}
}

// A Send and Recv that do not match fail on both sides with the same
// error, and the pair can go on; a bad peer rank fails at once.
func TestSendRecvErrors(t *testing.T) {
	b := cpu.New(backend.Float64)
	ranks := newLocal(t, comm.Mesh{DP: 1, EP: 2, CP: 1, TP: 1}, b)
	for _, c := range []struct {
		send, recv backend.Tensor
		want       string
	}{
		{b.New(backend.Float64, 3), b.New(backend.Float64, 4), "sent 3 elements of float64, but the receive buffer holds 4 of float64"},
		{b.New(backend.Int32, 3), b.New(backend.Float64, 3), "sent 3 elements of int32, but the receive buffer holds 3 of float64"},
		{nil, b.New(backend.Float64, 3), "the sent tensor is nil"},
		{b.New(backend.Float64, 3), nil, "the receive buffer is nil"},
	} {
		errorsEverywhere(t, ranks, "expert group Send from rank 0 to rank 1: "+c.want, func(r *comm.Ranks) error {
			if r.Rank == 0 {
				return r.Expert.Send(c.send, 1)
			}
			return r.Expert.Recv(c.recv, 0)
		})
	}
	runRanks(t, ranks, func(r *comm.Ranks) error {
		if r.Rank == 0 {
			return r.Expert.Send(b.New(backend.Float64, 2), 1)
		}
		return r.Expert.Recv(b.New(backend.Float64, 2), 0)
	})
	for _, peer := range []int{-1, 0, 2} {
		if err := ranks[0].Expert.Send(b.New(backend.Float64, 1), peer); err == nil || !strings.Contains(err.Error(), "is not another rank of this group of 2") {
			t.Errorf("Send to %d: %v", peer, err)
		}
		if err := ranks[0].Expert.Recv(b.New(backend.Float64, 1), peer); err == nil || !strings.Contains(err.Error(), "is not another rank of this group of 2") {
			t.Errorf("Recv from %d: %v", peer, err)
		}
	}
}

// Abort releases a rank blocked in Recv and one blocked in Send, and later
// point-to-point calls fail with the abort's cause.
func TestAbortReleasesSendRecv(t *testing.T) {
	b := cpu.New(backend.Float64)
	ranks := newLocal(t, comm.Mesh{DP: 1, EP: 3, CP: 1, TP: 1}, b)
	cause := errors.New("rank 2 lost its device")
	blocked := make(chan error, 2)
	go func() { blocked <- ranks[0].Expert.Recv(b.New(backend.Float64, 2), 2) }()
	go func() { blocked <- ranks[1].Expert.Send(b.New(backend.Float64, 2), 2) }()
	time.Sleep(20 * time.Millisecond) // let both block (the test passes either way)
	ranks[2].Abort(cause)
	for range 2 {
		select {
		case err := <-blocked:
			if !errors.Is(err, cause) {
				t.Fatalf("blocked rank returned %v, want the abort cause", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("Abort did not release a blocked Send or Recv")
		}
	}
	if err := ranks[0].Expert.Send(b.New(backend.Float64, 2), 1); !errors.Is(err, cause) {
		t.Fatalf("Send after Abort returned %v", err)
	}
	if err := ranks[1].Expert.Recv(b.New(backend.Float64, 2), 0); !errors.Is(err, cause) {
		t.Fatalf("Recv after Abort returned %v", err)
	}
}

// ReduceScatterSum in place followed by AllGather in place is an
// all-reduce: over many rounds of changing lengths, interleaved with
// AllReduceSum (which shares the reduce scratch), both give the rank-order
// sum bitwise, with every buffer overwritten as soon as a collective
// returns. Run with -race to check the hand-off between rounds.
func TestReduceScatterAllGatherRounds(t *testing.T) {
	b := cpu.New(backend.Float32)
	ranks := newLocal(t, comm.Mesh{DP: 1, EP: 4, CP: 1, TP: 1}, b)
	W := len(ranks)
	const rounds = 100
	rng := rand.New(rand.NewPCG(8, 9))
	in := make([][][]float64, rounds) // [round][rank]
	for k := range in {
		n := W * (1 + k%5)
		in[k] = make([][]float64, W)
		for r := range W {
			in[k][r] = randVals(rng, n)
		}
	}
	runRanks(t, ranks, func(r *comm.Ranks) error {
		x, y := b.New(backend.Float32, 5*W), b.New(backend.Float32, 5*W)
		for k := range rounds {
			n := len(in[k][r.Rank])
			want := rankSum(backend.Float32, in[k], 0, n)
			xn, yn := b.View(x, 0, n), b.View(y, 0, n)
			set(b, xn, in[k][r.Rank])
			set(b, yn, in[k][r.Rank])
			mine := b.View(xn, r.Rank*n/W, n/W)
			if err := r.Expert.ReduceScatterSum(mine, xn); err != nil {
				return err
			}
			// At once: the peers must be done reading the other blocks.
			b.Zero(b.View(xn, 0, r.Rank*n/W))
			b.Zero(b.View(xn, (r.Rank+1)*n/W, n-(r.Rank+1)*n/W))
			if err := r.Expert.AllReduceSum(yn); err != nil {
				return err
			}
			if err := r.Expert.AllGather(xn, mine); err != nil {
				return err
			}
			gx, gy := get(b, xn), get(b, yn)
			b.Zero(x) // at once: the peers must be done reading it
			b.Zero(y)
			if !slices.Equal(gx, want) || !slices.Equal(gy, want) {
				return fmt.Errorf("round %d: reduce-scatter + all-gather %v, all-reduce %v, want %v", k, gx, gy, want)
			}
		}
		return nil
	})
}
