package attention_test

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/mktrain/mktrain/attention"
	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/tensorpar"
)

// TestTensorParallelMatchesOneRank runs the block split over 2 and 4
// tensor-parallel virtual ranks (with 2 kv heads: split at tp 2, each
// rank using one of the whole matrices' heads at tp 4), with sequence
// parallelism on and off, and checks every rank's output and dx rows and
// the weight gradients (the blocks joined; k_proj and v_proj summed over
// the ranks where they are whole) against one Layer of New.
func TestTensorParallelMatchesOneRank(t *testing.T) {
	s := attention.Shape{Dim: 16, Heads: 4, KVHeads: 2, RopeTheta: 10000}
	const batch, seq = 2, 6
	T, D, dh := batch*seq, s.Dim, s.HeadDim()
	Q, KD := s.Heads*dh, s.KVHeads*dh
	b := cpu.New(backend.Float64)
	rng := rand.New(rand.NewPCG(7, 8))
	x, dout := randn(rng, T*D, 1), randn(rng, T*D, 1)
	w := hostParams{wq: randn(rng, Q*D, 0.4), wk: randn(rng, KD*D, 0.4), wv: randn(rng, KD*D, 0.4), wo: randn(rng, D*Q, 0.4)}
	pos := make([]int32, T)
	for i := range pos {
		pos[i] = int32(i % seq)
	}
	one, err := runBlock(b, attention.New(b, s, batch, seq), s, uploadParams(b, s, w), x, pos, dout)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{2, 4} {
		for _, sp := range []bool{true, false} {
			t.Run(fmt.Sprintf("tp%d_sp%v", n, sp), func(t *testing.T) {
				ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: 1, TP: n}, b)
				if err != nil {
					t.Fatal(err)
				}
				rows := T
				if sp {
					rows = T / n
				}
				kvWhole := s.KVHeads%n != 0
				runs := make([]blockRun, n)
				errs := make([]error, n)
				var wg sync.WaitGroup
				for r, rk := range ranks {
					wg.Go(func() {
						tp := tensorpar.New(b, rk.Tensor, sp)
						l, err := attention.NewTensorParallel(b, s, batch, seq, attention.WithTensorParallel(tp))
						if err != nil {
							errs[r] = err
							return
						}
						h, kv, _ := attention.TensorParallelShape(s, n, r)
						q, kd := h*dh, kv*dh
						ps := &attention.Params{WqQD: b.New(backend.Float64, q, D), WoDQ: b.New(backend.Float64, D, q)}
						backend.UploadSlice(b, ps.WqQD, w.wq[r*q*D:(r+1)*q*D])
						backend.UploadSlice(b, ps.WoDQ, columnsOf(w.wo, D, Q, r*q, q))
						gs := &attention.Params{WqQD: b.New(backend.Float64, q, D), WoDQ: b.New(backend.Float64, D, q)}
						kvRows := kd
						if kvWhole {
							kvRows = KD
						}
						for _, t := range []*backend.Tensor{&ps.WkKD, &ps.WvKD, &gs.WkKD, &gs.WvKD} {
							*t = b.New(backend.Float64, kvRows, D)
						}
						lo := r * kd * D
						if kvWhole {
							lo = 0
						}
						backend.UploadSlice(b, ps.WkKD, w.wk[lo:lo+kvRows*D])
						backend.UploadSlice(b, ps.WvKD, w.wv[lo:lo+kvRows*D])
						runs[r], errs[r] = runTP(b, l, ps, gs, x[r*rows%T*D:][:rows*D], pos, dout[r*rows%T*D:][:rows*D], rows, D)
						if errs[r] != nil {
							rk.Abort(errs[r])
						}
					})
				}
				wg.Wait()
				for _, err := range errs {
					if err != nil {
						t.Fatal(err)
					}
				}
				const tol = 1e-12
				var wq, wo, wk, wv []float64
				wk, wv = make([]float64, KD*D), make([]float64, KD*D)
				for r, run := range runs {
					off := r * rows % T * D
					if d := maxAbsDiff(run.out, one.out[off:off+rows*D]); d > tol {
						t.Errorf("rank %d: out differs by %g", r, d)
					}
					if d := maxAbsDiff(run.dx, one.dx[off:off+rows*D]); d > tol {
						t.Errorf("rank %d: dx differs by %g", r, d)
					}
					wq = append(wq, run.g.wq...)
					wo = joinColumns(wo, run.g.wo, D)
					if kvWhole {
						wk, wv = addInto(wk, run.g.wk), addInto(wv, run.g.wv)
					} else {
						copy(wk[r*len(run.g.wk):], run.g.wk)
						copy(wv[r*len(run.g.wv):], run.g.wv)
					}
				}
				for _, c := range []struct {
					name      string
					got, want []float64
				}{{"q_proj", wq, one.g.wq}, {"k_proj", wk, one.g.wk}, {"v_proj", wv, one.g.wv}, {"o_proj", wo, one.g.wo}} {
					if d := maxAbsDiff(c.got, c.want); len(c.got) != len(c.want) || d > tol {
						t.Errorf("%s gradient: %d elements, differs by %g", c.name, len(c.got), d)
					}
				}
			})
		}
	}
}

// runTP is runBlock for a tensor-parallel Layer: x and dout are the
// rank's rows, the weights and gradients its blocks.
func runTP(b backend.Backend, l *attention.Layer, p, g *attention.Params, x []float64, pos []int32, dout []float64, rows, D int) (blockRun, error) {
	xT, outT, doutT, dxT := b.New(b.FloatType(), rows, D), b.New(b.FloatType(), rows, D), b.New(b.FloatType(), rows, D), b.New(b.FloatType(), rows, D)
	posT := b.New(backend.Int32, len(pos))
	backend.UploadSlice(b, xT, x)
	backend.UploadSlice(b, posT, pos)
	backend.UploadSlice(b, doutT, dout)
	if err := l.Forward(outT, xT, posT, p); err != nil {
		return blockRun{}, err
	}
	if err := l.Backward(dxT, doutT, p, g); err != nil {
		return blockRun{}, err
	}
	dl := func(t backend.Tensor) []float64 { return backend.DownloadFloat64(b, t) }
	return blockRun{out: dl(outT), dx: dl(dxT), g: hostParams{dl(g.WqQD), dl(g.WkKD), dl(g.WvKD), dl(g.WoDQ)}}, nil
}

// columnsOf is the cols columns from col0 of m [rows, stride].
func columnsOf(m []float64, rows, stride, col0, cols int) []float64 {
	var out []float64
	for i := range rows {
		out = append(out, m[i*stride+col0:i*stride+col0+cols]...)
	}
	return out
}

// joinColumns appends the columns of block [rows, len(block)/rows] to
// those of m [rows, len(m)/rows].
func joinColumns(m, block []float64, rows int) []float64 {
	a, c := len(m)/rows, len(block)/rows
	out := make([]float64, 0, len(m)+len(block))
	for i := range rows {
		out = append(out, m[i*a:(i+1)*a]...)
		out = append(out, block[i*c:(i+1)*c]...)
	}
	return out
}
