package tensorpar_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/tensorpar"
)

// Each pattern on n virtual ranks gives what one rank computes with the
// whole matrices: x [T, K] times W [N, K]ᵀ with W split by rows
// (column-parallel: each rank its N/n outputs) and by columns
// (row-parallel: each rank its K/n inputs, partial sums reduced).
func TestPatternsMatchOneRank(t *testing.T) {
	const T, K, N = 12, 12, 6
	b := cpu.New(backend.Float64)
	rng := rand.New(rand.NewPCG(1, 2))
	x, w := randoms(rng, T*K), randoms(rng, N*K)
	want := make([]float64, T*N) // x·Wᵀ
	for i := range T {
		for j := range N {
			for k := range K {
				want[i*N+j] += x[i*K+k] * w[j*K+k]
			}
		}
	}
	for _, n := range []int{2, 3} {
		ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: 1, TP: n}, b)
		if err != nil {
			t.Fatal(err)
		}
		rows, outs, ks := T/n, N/n, K/n
		gathered := make([][]float64, n)
		scattered := make([][]float64, n)
		reduced := make([][]float64, n)
		run(t, ranks, func(r *comm.Ranks) error {
			q := r.Tensor.Rank()
			// AllGatherMatMul: x's row shard gathered, times this rank's rows of W.
			full, shard := b.New(backend.Float64, T, K), b.New(backend.Float64, rows, K)
			backend.UploadSlice(b, shard, x[q*rows*K:(q+1)*rows*K])
			wRows, out := b.New(backend.Float64, outs, K), b.New(backend.Float64, T, outs)
			backend.UploadSlice(b, wRows, w[q*outs*K:(q+1)*outs*K])
			if err := tensorpar.AllGatherMatMul(b, r.Tensor, full, shard, []backend.Tensor{out}, []backend.Tensor{wRows}, true); err != nil {
				return err
			}
			gathered[q] = backend.DownloadFloat64(b, out)
			// The row-parallel products: this rank's columns of x and W.
			xCols, wCols := b.New(backend.Float64, T, ks), b.New(backend.Float64, N, ks)
			backend.UploadSlice(b, xCols, columns(x, T, K, q*ks, ks))
			backend.UploadSlice(b, wCols, columns(w, N, K, q*ks, ks))
			terms := []tensorpar.Term{{A: xCols, W: wCols, TransW: true}}
			partial, mine := b.New(backend.Float64, T, N), b.New(backend.Float64, rows, N)
			if err := tensorpar.MatMulReduceScatter(b, r.Tensor, mine, partial, terms); err != nil {
				return err
			}
			scattered[q] = backend.DownloadFloat64(b, mine)
			all := b.New(backend.Float64, T, N)
			if err := tensorpar.MatMulAllReduce(b, r.Tensor, all, terms); err != nil {
				return err
			}
			reduced[q] = backend.DownloadFloat64(b, all)
			return nil
		})
		for q := range n {
			for i := range T {
				for j := range outs {
					near(t, "AllGatherMatMul", n, q, gathered[q][i*outs+j], want[i*N+q*outs+j])
				}
			}
			for i := range rows * N {
				near(t, "MatMulReduceScatter", n, q, scattered[q][i], want[q*rows*N+i])
			}
			for i := range T * N {
				near(t, "MatMulAllReduce", n, q, reduced[q][i], want[i])
			}
		}
	}
}

func near(t *testing.T, what string, n, q int, got, want float64) {
	t.Helper()
	if math.Abs(got-want) > 1e-12 {
		t.Fatalf("%s over %d ranks, rank %d: %v, one rank %v", what, n, q, got, want)
	}
}

func randoms(rng *rand.Rand, n int) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = rng.NormFloat64()
	}
	return out
}

// columns is the cols columns of m [rows, stride] from col0.
func columns(m []float64, rows, stride, col0, cols int) []float64 {
	var out []float64
	for i := range rows {
		out = append(out, m[i*stride+col0:i*stride+col0+cols]...)
	}
	return out
}

func run(t *testing.T, ranks []*comm.Ranks, fn func(r *comm.Ranks) error) {
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
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
}

// ColumnProducts gives ColumnForward's products, fused or not, with and
// without sequence parallelism; fused under sequence parallelism it
// leaves full as it was (no gathered rows kept).
func TestColumnProductsMatchColumnForward(t *testing.T) {
	const T, K, N = 12, 8, 6
	b := cpu.New(backend.Float64)
	rng := rand.New(rand.NewPCG(5, 6))
	x, w := randoms(rng, T*K), randoms(rng, N*K)
	const sentinel = 7.25
	for _, n := range []int{2, 3} {
		for _, o := range []tensorpar.Options{{SequenceParallel: true}, {SequenceParallel: true, Fused: true}, {}, {Fused: true}} {
			ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: 1, TP: n}, b)
			if err != nil {
				t.Fatal(err)
			}
			run(t, ranks, func(r *comm.Ranks) error {
				q := r.Tensor.Rank()
				tp := tensorpar.NewWith(b, r.Tensor, o)
				if o.Fused != tp.Fused() {
					return fmt.Errorf("%+v over %d ranks: Fused() = %v", o, n, tp.Fused())
				}
				rows := tp.Rows(T)
				xIn := b.New(backend.Float64, rows, K)
				backend.UploadSlice(b, xIn, x[q*rows*K%(T*K):][:rows*K])
				wRows := b.New(backend.Float64, N/n, K)
				backend.UploadSlice(b, wRows, w[q*(N/n)*K:(q+1)*(N/n)*K])
				forward, products := b.New(backend.Float64, T, N/n), b.New(backend.Float64, T, N/n)
				full := b.New(backend.Float64, T, K)
				if _, err := tp.ColumnForward(full, xIn, []backend.Tensor{forward}, []backend.Tensor{wRows}, true); err != nil {
					return err
				}
				backend.UploadSlice(b, full, slices.Repeat([]float64{sentinel}, T*K))
				if err := tp.ColumnProducts(full, xIn, []backend.Tensor{products}, []backend.Tensor{wRows}, true); err != nil {
					return err
				}
				want, got := backend.DownloadFloat64(b, forward), backend.DownloadFloat64(b, products)
				for i := range want {
					if got[i] != want[i] {
						t.Errorf("%+v over %d ranks, rank %d: ColumnProducts[%d] = %v, ColumnForward's %v", o, n, q, i, got[i], want[i])
						break
					}
				}
				if tp.SequenceParallel() && tp.Fused() {
					for i, v := range backend.DownloadFloat64(b, full) {
						if v != sentinel {
							t.Errorf("%+v over %d ranks, rank %d: fused ColumnProducts wrote full[%d] = %v", o, n, q, i, v)
							break
						}
					}
				}
				return nil
			})
		}
	}
}
