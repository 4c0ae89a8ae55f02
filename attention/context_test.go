package attention_test

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"math/rand/v2"

	"github.com/mktrain/mktrain/attention"
	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
)

// blockRun is one block's Forward and Backward results on the host.
type blockRun struct {
	out, dx []float64
	g       hostParams
}

// runBlock runs Forward then Backward of l on x, pos and dout, with grads
// starting at zero.
func runBlock(b backend.Backend, l *attention.Layer, s attention.Shape, p *attention.Params, x []float64, pos []int32, dout []float64) (blockRun, error) {
	T := len(pos)
	xT, posT, outT := b.New(b.FloatType(), T, s.Dim), b.New(backend.Int32, T), b.New(b.FloatType(), T, s.Dim)
	doutT, dxT := b.New(b.FloatType(), T, s.Dim), b.New(b.FloatType(), T, s.Dim)
	backend.UploadSlice(b, xT, x)
	backend.UploadSlice(b, posT, pos)
	backend.UploadSlice(b, doutT, dout)
	g := attention.NewParams(b, s)
	if err := l.Forward(outT, xT, posT, p); err != nil {
		return blockRun{}, err
	}
	if err := l.Backward(dxT, doutT, p, g); err != nil {
		return blockRun{}, err
	}
	dl := func(t backend.Tensor) []float64 { return backend.DownloadFloat64(b, t) }
	return blockRun{out: dl(outT), dx: dl(dxT), g: hostParams{dl(g.WqQD), dl(g.WkKD), dl(g.WvKD), dl(g.WoDQ)}}, nil
}

// TestContextParallelMatchesOneRank runs the block on a dp x cp mesh of
// virtual ranks, each data replica holding batch sequences and each cp rank
// its zigzag chunks of them, and checks every rank's output and dx rows,
// and the weight gradients summed over all ranks, against one Layer of New
// on the whole batch of full sequences: to 1e-10 in float64, and with
// onePass (the fused ring in one pass, whose Layer keeps q, k and v in
// bf16 as the GPU's does, on onePassCPU) to 2e-2 of each tensor's norm,
// bf16's rounding of q, k, v and da (2^-9 relative each) carried through
// the softmax and the products; a fault of the flow shows as order 1.
func TestContextParallelMatchesOneRank(t *testing.T) {
	s := attention.Shape{Dim: 16, Heads: 4, KVHeads: 2, RopeTheta: 10000}
	for _, c := range []struct {
		dp, cp, batch, chunk int // batch per data replica, chunk length C
		mode                 attention.CPMode
		onePass              bool
	}{
		{1, 1, 2, 3, attention.CPAllGather, false},
		{1, 2, 2, 3, attention.CPAllGather, false},
		{1, 4, 2, 2, attention.CPAllGather, false},
		{2, 2, 1, 3, attention.CPAllGather, false},
		{1, 2, 2, 3, attention.CPRing, false},
		{1, 3, 2, 2, attention.CPRing, false},
		{1, 4, 2, 2, attention.CPRing, false},
		{2, 2, 1, 3, attention.CPRing, false},
		{1, 2, 2, 3, attention.CPRing, true},
		{1, 4, 2, 2, attention.CPRing, true},
		{2, 2, 1, 3, attention.CPRing, true},
	} {
		name := fmt.Sprintf("dp%d_cp%d_%s", c.dp, c.cp, c.mode)
		if c.onePass {
			name += "_one_pass"
		}
		t.Run(name, func(t *testing.T) {
			var b backend.Backend = cpu.New(backend.Float64)
			rng := rand.New(rand.NewPCG(uint64(c.cp), uint64(c.dp)))
			B, S := c.dp*c.batch, 2*c.cp*c.chunk
			w := hostParams{
				wq: randn(rng, s.Dim*s.Dim, 0.4), wk: randn(rng, s.KVHeads*s.HeadDim()*s.Dim, 0.4),
				wv: randn(rng, s.KVHeads*s.HeadDim()*s.Dim, 0.4), wo: randn(rng, s.Dim*s.Dim, 0.4),
			}
			p := uploadParams(b, s, w)
			x, dout := randn(rng, B*S*s.Dim, 1), randn(rng, B*S*s.Dim, 1)
			var pos []int32
			for range B {
				for i := range S {
					pos = append(pos, int32(i))
				}
			}
			want, err := runBlock(b, attention.New(b, s, B, S), s, p, x, pos, dout)
			if err != nil {
				t.Fatal(err)
			}

			if c.onePass {
				b = onePassCPU{b.(*cpu.Backend)}
			}
			ranks, err := comm.NewLocal(comm.Mesh{DP: c.dp, EP: 1, CP: c.cp, TP: 1}, b)
			if err != nil {
				t.Fatal(err)
			}
			got := make([]blockRun, len(ranks))
			rows := make([][]int, len(ranks)) // the global row of each local row
			var wg sync.WaitGroup
			errs := make([]error, len(ranks))
			for r, rk := range ranks {
				local, err := attention.ZigzagPositions(S, c.cp, rk.Coord.CP)
				if err != nil {
					t.Fatal(err)
				}
				var lpos []int32
				var lx, ldout []float64
				for bi := rk.Coord.DP * c.batch; bi < (rk.Coord.DP+1)*c.batch; bi++ {
					for _, q := range local {
						row := bi*S + int(q)
						rows[r] = append(rows[r], row)
						lpos = append(lpos, q)
						lx = append(lx, x[row*s.Dim:(row+1)*s.Dim]...)
						ldout = append(ldout, dout[row*s.Dim:(row+1)*s.Dim]...)
					}
				}
				l, err := attention.NewContextParallel(b, s, c.batch, S, rk.Context, attention.WithContextMode(c.mode))
				if err != nil {
					t.Fatal(err)
				}
				if c.onePass && l.ContextPath() != "fused ring in one pass" {
					t.Fatalf("the layer runs the %s, want the fused ring in one pass", l.ContextPath())
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					if got[r], errs[r] = runBlock(b, l, s, p, lx, lpos, ldout); errs[r] != nil {
						rk.Abort(errs[r])
					}
				}()
			}
			wg.Wait()
			for _, err := range errs {
				if err != nil {
					t.Fatal(err)
				}
			}

			// Every rank's rows in local order, beside the one rank's
			// same rows, and the weight gradients summed over the ranks.
			var gotOut, wantOut, gotDX, wantDX []float64
			for r := range ranks {
				for n, row := range rows[r] {
					gotOut, wantOut = append(gotOut, got[r].out[n*s.Dim:(n+1)*s.Dim]...), append(wantOut, want.out[row*s.Dim:(row+1)*s.Dim]...)
					gotDX, wantDX = append(gotDX, got[r].dx[n*s.Dim:(n+1)*s.Dim]...), append(wantDX, want.dx[row*s.Dim:(row+1)*s.Dim]...)
				}
			}
			sum := hostParams{}
			for r := range ranks {
				sum.wq, sum.wk = addInto(sum.wq, got[r].g.wq), addInto(sum.wk, got[r].g.wk)
				sum.wv, sum.wo = addInto(sum.wv, got[r].g.wv), addInto(sum.wo, got[r].g.wo)
			}
			for _, x := range []struct {
				name      string
				got, want []float64
			}{{"out", gotOut, wantOut}, {"dx", gotDX, wantDX}, {"dWq", sum.wq, want.g.wq}, {"dWk", sum.wk, want.g.wk}, {"dWv", sum.wv, want.g.wv}, {"dWo", sum.wo, want.g.wo}} {
				if c.onePass {
					// Measured 2e-3..9e-3.
					if e := relNormErr(x.got, x.want); !(e < 2e-2) {
						t.Errorf("%s differs from one rank's by %.3g of its norm", x.name, e)
					}
				} else if e := maxAbsDiff(x.got, x.want); !(e < 1e-10) {
					t.Errorf("%s differs from one rank's by %.3g", x.name, e)
				}
			}
		})
	}
}

func maxAbsDiff(a, b []float64) float64 {
	var worst float64
	for i := range a {
		worst = max(worst, abs(a[i]-b[i]))
	}
	return worst
}

func abs(x float64) float64 {
	if x < 0 {
		return -x
	}
	return x
}

func addInto(sum, x []float64) []float64 {
	if sum == nil {
		sum = make([]float64, len(x))
	}
	for i := range x {
		sum[i] += x[i]
	}
	return sum
}

func TestZigzagPositions(t *testing.T) {
	for _, c := range []struct {
		seq, ranks, rank int
		want             []int32
	}{
		{4, 1, 0, []int32{0, 1, 2, 3}},
		{5, 1, 0, []int32{0, 1, 2, 3, 4}}, // one rank cuts nothing
		{8, 2, 0, []int32{0, 1, 6, 7}},
		{8, 2, 1, []int32{2, 3, 4, 5}},
		{8, 4, 0, []int32{0, 7}},
		{8, 4, 3, []int32{3, 4}},
	} {
		got, err := attention.ZigzagPositions(c.seq, c.ranks, c.rank)
		if err != nil || !slices.Equal(got, c.want) {
			t.Errorf("ZigzagPositions(%d, %d, %d) = %v, %v; want %v", c.seq, c.ranks, c.rank, got, err, c.want)
		}
	}
	for _, c := range []struct {
		seq, ranks, rank int
		want             string
	}{
		{6, 2, 0, "not a positive multiple of 2*cp = 4"},
		{0, 1, 0, "not a positive multiple"},
		{8, 2, 2, "rank 2 of 2 is out of range"},
		{8, 0, 0, "out of range"},
	} {
		if _, err := attention.ZigzagPositions(c.seq, c.ranks, c.rank); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ZigzagPositions(%d, %d, %d): %v, want an error saying %q", c.seq, c.ranks, c.rank, err, c.want)
		}
	}
}

func TestNewContextParallelErrors(t *testing.T) {
	b := cpu.New(backend.Float64)
	s := attention.Shape{Dim: 8, Heads: 2, KVHeads: 1, RopeTheta: 100}
	ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: 2, TP: 1}, b)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		s          attention.Shape
		batch, seq int
		g          comm.Group
		want       string
	}{
		{s, 1, 6, ranks[0].Context, "seq_len 6 is not a positive multiple of 2*cp = 4"},
		{s, 0, 8, ranks[0].Context, "batch 0"},
		{s, 1, 8, nil, "needs a group"},
		{attention.Shape{Dim: 8, Heads: 3, KVHeads: 1, RopeTheta: 100}, 1, 8, ranks[0].Context, "not a multiple of heads"},
	} {
		if _, err := attention.NewContextParallel(b, c.s, c.batch, c.seq, c.g); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("NewContextParallel(%+v, batch %d, seq %d): %v, want an error saying %q", c.s, c.batch, c.seq, err, c.want)
		}
	}
}
