package attention_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"

	"github.com/mktrain/mktrain/attention"
	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/backendtest"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
)

// coreInputs are one rank's rotated q, k, v rows and the gradient of its
// output, on the host.
type coreInputs struct{ q, k, v, da []float64 }

// coreRun is what one rank's ContextCore wrote.
type coreRun struct{ a, lse, dq, dk, dv []float64 }

// runCores runs Forward and Backward of a ContextCore in mode on every rank
// of a cp group of len(in) virtual ranks, all at once, two steps on the
// same inputs, and returns the second step's results.
//
// With portable set, the cores' groups hide their peer access, so mode ring
// runs the portable ring; else it runs the fused ring (ring_fused.go),
// which the CPU backend takes at every shape.
func runCores(t *testing.T, b backend.Backend, s attention.Shape, mode attention.CPMode, portable bool, batch, seq int, in []coreInputs) []coreRun {
	t.Helper()
	w := len(in)
	ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: w, TP: 1}, b)
	if err != nil {
		t.Fatal(err)
	}
	rows, q, kd := batch*seq/w, s.Heads*s.HeadDim(), s.KVHeads*s.HeadDim()
	out := make([]coreRun, w)
	errs := make([]error, w)
	var wg sync.WaitGroup
	for r, rk := range ranks {
		g := rk.Context
		if portable {
			g = withoutPeerAccess(g)
		}
		core, err := attention.NewContextCore(b, s, batch, seq, g, mode)
		if err != nil {
			t.Fatal(err)
		}
		want := string(mode)
		switch {
		case w == 1:
			want = "attention"
		case mode == attention.CPRing && portable:
			want = "portable ring"
		case mode == attention.CPRing:
			want = "fused ring"
			if _, ok := b.(onePassCPU); ok {
				want = "fused ring in one pass"
			}
		}
		if core.Path() != want {
			t.Fatalf("a core in mode %s runs the %s, want the %s", mode, core.Path(), want)
		}
		up := func(dt backend.DType, data []float64, shape ...int) backend.Tensor {
			x := b.New(dt, shape...)
			backend.UploadSlice(b, x, data)
			return x
		}
		qkv := core.QKVType()
		qT, kT, vT := up(qkv, in[r].q, rows, q), up(qkv, in[r].k, rows, kd), up(qkv, in[r].v, rows, kd)
		daT := up(b.FloatType(), in[r].da, rows, q)
		aT, lseT := b.New(b.FloatType(), rows, q), b.New(b.FloatType(), batch*s.Heads*seq/w)
		dqT, dkT, dvT := b.New(b.FloatType(), rows, q), b.New(b.FloatType(), rows, kd), b.New(b.FloatType(), rows, kd)
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Twice: the second step finds the outputs and the Scratch
			// holding the first's values.
			for range 2 {
				if errs[r] = core.Forward(aT, lseT, qT, kT, vT); errs[r] == nil {
					errs[r] = core.Backward(dqT, dkT, dvT, daT)
				}
				if errs[r] != nil {
					break
				}
			}
			if errs[r] != nil {
				rk.Abort(errs[r])
				return
			}
			dl := func(x backend.Tensor) []float64 { return backend.DownloadFloat64(b, x) }
			out[r] = coreRun{dl(aT), dl(lseT), dl(dqT), dl(dkT), dl(dvT)}
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	return out
}

// runPair is one output of two coreRuns.
type runPair struct {
	name      string
	got, want []float64
}

// pairs lines up the five outputs of got and want.
func pairs(got, want coreRun) []runPair {
	return []runPair{{"out", got.a, want.a}, {"lse", got.lse, want.lse}, {"dq", got.dq, want.dq},
		{"dk", got.dk, want.dk}, {"dv", got.dv, want.dv}}
}

// maxRelDiff is the largest |a-b| over the elements, relative to the rms
// of b.
func maxRelDiff(a, b []float64) float64 {
	var ss float64
	for _, x := range b {
		ss += x * x
	}
	rms := math.Sqrt(ss / float64(len(b)))
	return maxAbsDiff(a, b) / rms
}

// TestRingMatchesAllGather: the portable ring's output, lse and q, k, v
// gradients equal the all-gather path's, on every rank, for W = 2, 3, 4,
// GQA and more than one sequence per micro-batch; the fused ring's equal
// them bit for bit.
//
// In float32 they are not bitwise equal: the all-gather path runs one
// softmax pass over a query chunk's keys, the ring merges one partial
// result per ring step (AttentionMerge) and sums dk, dv in ring order, so
// the roundings differ. Measured, the largest element difference is
// 2e-6 to 4.5e-6 of the tensor's rms (dq the largest), the same size as
// either path's own float32 error against float64 (2e-6 to 5e-6). The
// tolerance, 1e-5 of the rms (about 80 float32 epsilons), leaves room for
// other seeds and shapes and is still far below any indexing mistake
// (which shows as differences of order 1). In float64 they agree within
// 1e-13 (measured 6e-15).
func TestRingMatchesAllGather(t *testing.T) {
	for _, c := range []struct {
		w, batch, chunk int
		s               attention.Shape
		dt              backend.DType
		tol             float64
	}{
		{2, 2, 5, attention.Shape{Dim: 32, Heads: 4, KVHeads: 2, RopeTheta: 1e4}, backend.Float32, 1e-5},
		{3, 2, 4, attention.Shape{Dim: 24, Heads: 6, KVHeads: 2, RopeTheta: 1e4}, backend.Float32, 1e-5},
		{4, 3, 3, attention.Shape{Dim: 32, Heads: 4, KVHeads: 1, RopeTheta: 1e4}, backend.Float32, 1e-5},
		{4, 2, 3, attention.Shape{Dim: 16, Heads: 4, KVHeads: 2, RopeTheta: 1e4}, backend.Float64, 1e-13},
	} {
		t.Run(fmt.Sprintf("W%d_B%d_C%d_H%d_KV%d_%v", c.w, c.batch, c.chunk, c.s.Heads, c.s.KVHeads, c.dt), func(t *testing.T) {
			b := cpu.New(c.dt)
			seq := 2 * c.w * c.chunk
			rows, q, kd := c.batch*seq/c.w, c.s.Heads*c.s.HeadDim(), c.s.KVHeads*c.s.HeadDim()
			rng := rand.New(rand.NewPCG(uint64(c.w), uint64(c.chunk)))
			in := make([]coreInputs, c.w)
			for r := range in {
				in[r] = coreInputs{q: randn(rng, rows*q, 1.5), k: randn(rng, rows*kd, 1.5), v: randn(rng, rows*kd, 1), da: randn(rng, rows*q, 1)}
			}
			want := runCores(t, b, c.s, attention.CPAllGather, false, c.batch, seq, in)
			// The fused ring's CPU ops compute in the all-gather path's
			// order: the same bits.
			fused := runCores(t, b, c.s, attention.CPRing, false, c.batch, seq, in)
			for r := range in {
				for _, x := range pairs(fused[r], want[r]) {
					if d := maxAbsDiff(x.got, x.want); d != 0 {
						t.Errorf("rank %d: the fused ring differs from the all-gather path by %g (want the same bits)", r, d)
					}
				}
			}
			got := runCores(t, b, c.s, attention.CPRing, true, c.batch, seq, in)
			var worst float64
			for r := range in {
				for _, x := range pairs(got[r], want[r]) {
					e := maxRelDiff(x.got, x.want)
					worst = max(worst, e)
					if e > c.tol {
						t.Errorf("rank %d: the ring's %s differs from the all-gather path's by %.3g of its rms (tolerance %.3g)", r, x.name, e, c.tol)
					}
				}
			}
			t.Logf("largest difference: %.3g of a tensor's rms", worst)
		})
	}
}

// onePassCPU is the CPU backend with its one-pass zigzag ops offered to
// the layers (the CPU itself keeps its layers on the two-pass ops, for
// their bits), so that the fused ring's one-pass flow (ring_fused.go) runs
// here as it runs on a Hopper GPU.
type onePassCPU struct{ *cpu.Backend }

func (onePassCPU) ZigzagAttentionOnePass(s backend.ZigzagShape) error { return s.Check() }

// TestFusedRingOnePass: the fused ring in one pass (each rank rounds q, k,
// v and da to bf16, writes its delta, zeroes its dq; one backward per rank
// adds into every rank's dq) gives the all-gather path's out, lse, dq, dk
// and dv on inputs already on the bf16 grid, where its rounding changes
// nothing: in float64 they differ only in the order of the sums (1e-12 of
// the rms; an indexing, masking or ordering fault shows as order 1), for
// W = 2, 3, 4, GQA and several sequences (runCores' second step: the
// Scratch's delta and copies and the outputs hold the first's values).
func TestFusedRingOnePass(t *testing.T) {
	for _, c := range []struct {
		w, batch, chunk int
		s               attention.Shape
	}{
		{2, 2, 5, attention.Shape{Dim: 32, Heads: 4, KVHeads: 2, RopeTheta: 1e4}},
		{3, 1, 4, attention.Shape{Dim: 24, Heads: 6, KVHeads: 2, RopeTheta: 1e4}},
		{4, 2, 3, attention.Shape{Dim: 32, Heads: 4, KVHeads: 1, RopeTheta: 1e4}},
	} {
		t.Run(fmt.Sprintf("W%d_B%d_C%d_H%d_KV%d", c.w, c.batch, c.chunk, c.s.Heads, c.s.KVHeads), func(t *testing.T) {
			b := cpu.New(backend.Float64)
			seq := 2 * c.w * c.chunk
			rows, q, kd := c.batch*seq/c.w, c.s.Heads*c.s.HeadDim(), c.s.KVHeads*c.s.HeadDim()
			rng := rand.New(rand.NewPCG(uint64(c.w), 17))
			bf16 := func(xs []float64) []float64 {
				for i, x := range xs {
					xs[i] = backendtest.RoundBF16(x)
				}
				return xs
			}
			in := make([]coreInputs, c.w)
			for r := range in {
				in[r] = coreInputs{q: bf16(randn(rng, rows*q, 1.5)), k: bf16(randn(rng, rows*kd, 1.5)),
					v: bf16(randn(rng, rows*kd, 1)), da: bf16(randn(rng, rows*q, 1))}
			}
			want := runCores(t, b, c.s, attention.CPAllGather, false, c.batch, seq, in)
			got := runCores(t, onePassCPU{b}, c.s, attention.CPRing, false, c.batch, seq, in)
			for r := range in {
				for _, x := range pairs(got[r], want[r]) {
					if e := maxRelDiff(x.got, x.want); !(e < 1e-12) {
						t.Errorf("rank %d: the one-pass ring's %s differs from the all-gather path's by %.3g of its rms", r, x.name, e)
					}
				}
			}
		})
	}
}

// TestContextCoreOneRank: a core on a group of one rank is plain causal
// attention over the whole sequences, in either mode.
func TestContextCoreOneRank(t *testing.T) {
	b := cpu.New(backend.Float64)
	s := attention.Shape{Dim: 16, Heads: 4, KVHeads: 2, RopeTheta: 1e4}
	const batch, seq = 2, 6
	rng := rand.New(rand.NewPCG(3, 4))
	q, kd := s.Heads*s.HeadDim(), s.KVHeads*s.HeadDim()
	in := []coreInputs{{q: randn(rng, batch*seq*q, 1), k: randn(rng, batch*seq*kd, 1), v: randn(rng, batch*seq*kd, 1), da: randn(rng, batch*seq*q, 1)}}
	up := func(data []float64, shape ...int) backend.Tensor {
		x := b.New(b.FloatType(), shape...)
		backend.UploadSlice(b, x, data)
		return x
	}
	shape := backend.AttnShape{Batch: batch, Seq: seq, Heads: s.Heads, KVHeads: s.KVHeads, HeadDim: s.HeadDim()}
	qT, kT, vT, daT := up(in[0].q, batch*seq, q), up(in[0].k, batch*seq, kd), up(in[0].v, batch*seq, kd), up(in[0].da, batch*seq, q)
	aT, lseT := b.New(b.FloatType(), batch*seq, q), b.New(b.FloatType(), batch, s.Heads, seq)
	dqT, dkT, dvT := b.New(b.FloatType(), batch*seq, q), b.New(b.FloatType(), batch*seq, kd), b.New(b.FloatType(), batch*seq, kd)
	b.AttentionForward(aT, lseT, qT, kT, vT, shape)
	b.AttentionBackward(dqT, dkT, dvT, daT, qT, kT, vT, aT, lseT, shape)
	dl := func(x backend.Tensor) []float64 { return backend.DownloadFloat64(b, x) }
	want := coreRun{dl(aT), dl(lseT), dl(dqT), dl(dkT), dl(dvT)}
	for _, mode := range []attention.CPMode{attention.CPAllGather, attention.CPRing} {
		got := runCores(t, b, s, mode, false, batch, seq, in)[0]
		for name, pair := range map[string][2][]float64{"out": {got.a, want.a}, "lse": {got.lse, want.lse}, "dq": {got.dq, want.dq}, "dk": {got.dk, want.dk}, "dv": {got.dv, want.dv}} {
			if e := maxAbsDiff(pair[0], pair[1]); e != 0 {
				t.Errorf("mode %s: %s differs from one attention call's by %.3g", mode, name, e)
			}
		}
	}
}

func TestNewContextCoreErrors(t *testing.T) {
	b := cpu.New(backend.Float64)
	s := attention.Shape{Dim: 8, Heads: 2, KVHeads: 1, RopeTheta: 100}
	ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: 2, TP: 1}, b)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		mode attention.CPMode
		seq  int
		want string
	}{
		{"auto", 8, `mode "auto"; want "allgather" or "ring"`},
		{attention.CPRing, 6, "not a positive multiple of 2*cp = 4"},
	} {
		if _, err := attention.NewContextCore(b, s, 1, c.seq, ranks[0].Context, c.mode); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("NewContextCore(mode %q, seq %d): %v, want an error saying %q", c.mode, c.seq, err, c.want)
		}
	}
	core, err := attention.NewContextCore(b, s, 1, 8, ranks[0].Context, attention.CPRing)
	if err != nil {
		t.Fatal(err)
	}
	small := b.New(backend.Float64, 3)
	if err := core.Forward(small, small, small, small, small); err == nil || !strings.Contains(err.Error(), "Forward: a has shape [3]") {
		t.Errorf("Forward with wrong tensors: %v", err)
	}
	if err := core.Backward(small, small, small, small); err == nil || !strings.Contains(err.Error(), "without a successful Forward") {
		t.Errorf("Backward before Forward: %v", err)
	}
}
