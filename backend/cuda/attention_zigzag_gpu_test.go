package cuda

// The fused ring (attn_zz_* in attention_tc.cu) on the GPU: against the
// same GPU's plain tensor-core attention over the whole sequence (its
// unfused definition, with the same bf16 rounding of the inputs) at
// shapes of several tiles per chunk, and its speed against that one call
// at W = 2, 4 and 8 virtual ranks. The small conformance shapes against
// the CPU are in backend/backendtest (zigzag_cases.go).

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// zigzagWholeTol bounds the relative L2 difference between a rank's rows
// and the whole-sequence call's. Both round q, k, v and dout to bf16
// alike; they differ in the order keys are visited (the ring goes from the
// diagonal down, the plain call up), so P and dS round to bf16 at other
// running maxima, and in dk and dv, which the ring sums per query tile of
// every rank. That leaves differences of a few 1e-3 of an element, far
// under any indexing or masking fault (which is O(1)).
const zigzagWholeTol = 5e-3

// zzRun is one zigzag problem on the device: every rank's tensors and the
// whole sequence's.
type zzRun struct {
	b *Backend
	s backend.ZigzagShape

	// The whole sequence, natural order: [B*S, ...] and lse [B, H, S].
	q, k, v, dout, out, lse, dq, dk, dv backend.Tensor
	// Every rank's local rows.
	lq, lk, lv, ldout, lout, llse, ldq, ldelta, ldk, ldv []backend.Tensor
}

func newZZRun(t *testing.T, b *Backend, s backend.ZigzagShape, seed uint64) *zzRun {
	rng := rand.New(rand.NewPCG(seed, 7))
	S, Q, K := s.Seq(), s.Heads*s.HeadDim, s.KVHeads*s.HeadDim
	rows, lrows := s.Batch*S, s.Batch*2*s.Chunk
	r := &zzRun{b: b, s: s}
	host := func(n int, scale float64) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(rng.NormFloat64() * scale)
		}
		return x
	}
	hq, hk, hv, hd := host(rows*Q, 1), host(rows*K, 1), host(rows*K, 1), host(rows*Q, 1)
	up := func(x []float32, n, w int) backend.Tensor {
		t := b.New(backend.Float32, n, w)
		backend.UploadSlice(b, t, x)
		return t
	}
	r.q, r.k, r.v, r.dout = up(hq, rows, Q), up(hk, rows, K), up(hv, rows, K), up(hd, rows, Q)
	r.out, r.lse = b.New(backend.Float32, rows, Q), b.New(backend.Float32, s.Batch, s.Heads, S)
	r.dq, r.dk, r.dv = b.New(backend.Float32, rows, Q), b.New(backend.Float32, rows, K), b.New(backend.Float32, rows, K)
	for rank := range s.Ranks {
		l := func(x []float32, w int) backend.Tensor { return up(zzLocalRows(s, x, w, rank), lrows, w) }
		r.lq, r.lk, r.lv, r.ldout = append(r.lq, l(hq, Q)), append(r.lk, l(hk, K)), append(r.lv, l(hv, K)), append(r.ldout, l(hd, Q))
		r.lout, r.ldq = append(r.lout, b.New(backend.Float32, lrows, Q)), append(r.ldq, b.New(backend.Float32, lrows, Q))
		r.ldk, r.ldv = append(r.ldk, b.New(backend.Float32, lrows, K)), append(r.ldv, b.New(backend.Float32, lrows, K))
		r.llse = append(r.llse, b.New(backend.Float32, s.Batch, 2, s.Heads, s.Chunk))
		r.ldelta = append(r.ldelta, b.New(backend.Float32, s.Batch, 2, s.Heads, s.Chunk))
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	return r
}

// zzLocalRows deals the [B*S, w] rows of x to rank's zigzag layout.
func zzLocalRows(s backend.ZigzagShape, x []float32, w, rank int) []float32 {
	var o []float32
	S, C := s.Seq(), s.Chunk
	for bi := range s.Batch {
		for n := range 2 {
			c := s.LocalChunk(rank, n)
			o = append(o, x[(bi*S+c*C)*w:(bi*S+c*C+C)*w]...)
		}
	}
	return o
}

// zzLocalLse deals a [B, H, S] lse to rank's [B, 2, H, C].
func zzLocalLse(s backend.ZigzagShape, x []float32, rank int) []float32 {
	var o []float32
	S, C := s.Seq(), s.Chunk
	for bi := range s.Batch {
		for n := range 2 {
			c := s.LocalChunk(rank, n)
			for h := range s.Heads {
				base := (bi*s.Heads+h)*S + c*C
				o = append(o, x[base:base+C]...)
			}
		}
	}
	return o
}

func (r *zzRun) whole() backend.AttnShape {
	return backend.AttnShape{Batch: r.s.Batch, Seq: r.s.Seq(), Heads: r.s.Heads, KVHeads: r.s.KVHeads, HeadDim: r.s.HeadDim}
}

func (r *zzRun) wholeForward() { r.b.AttentionForward(r.out, r.lse, r.q, r.k, r.v, r.whole()) }
func (r *zzRun) wholeBackward() {
	r.b.AttentionBackward(r.dq, r.dk, r.dv, r.dout, r.q, r.k, r.v, r.out, r.lse, r.whole())
}

func (r *zzRun) rank(i int) backend.ZigzagShape { s := r.s; s.Rank = i; return s }

// ringForward runs every rank's forward, as W virtual ranks queue them.
func (r *zzRun) ringForward() {
	for i := range r.s.Ranks {
		r.b.ZigzagAttentionForward(r.lout[i], r.llse[i], r.lq[i], r.lk, r.lv, r.rank(i))
	}
}

// ringBackward runs every rank's dq, then every rank's dk/dv.
func (r *zzRun) ringBackward() {
	for i := range r.s.Ranks {
		r.b.ZigzagAttentionBackwardDQ(r.ldq[i], r.ldelta[i], r.ldout[i], r.lq[i], r.lout[i], r.llse[i], r.lk, r.lv, r.rank(i))
	}
	for i := range r.s.Ranks {
		r.b.ZigzagAttentionBackwardDKDV(r.ldk[i], r.ldv[i], r.lk[i], r.lv[i], r.lq, r.ldout, r.llse, r.ldelta, r.rank(i))
	}
}

// compare checks every rank's outputs against the whole sequence's rows.
func (r *zzRun) compare(t *testing.T) {
	t.Helper()
	r.compareSome(t, "out", "lse", "dq", "dk", "dv")
}

// compareSome checks the named outputs of every rank (out, lse, dq, dk,
// dv) against the whole sequence's rows.
func (r *zzRun) compareSome(t *testing.T, names ...string) {
	t.Helper()
	if err := r.b.Sync(); err != nil {
		t.Fatal(err)
	}
	dl := func(x backend.Tensor) []float32 { return backend.DownloadFloat32(r.b, x) }
	Q, K := r.s.Heads*r.s.HeadDim, r.s.KVHeads*r.s.HeadDim
	whole := map[string]backend.Tensor{"out": r.out, "lse": r.lse, "dq": r.dq, "dk": r.dk, "dv": r.dv}
	for _, name := range names {
		w := dl(whole[name])
		for i := range r.s.Ranks {
			var got backend.Tensor
			var want []float32
			switch name {
			case "out":
				got, want = r.lout[i], zzLocalRows(r.s, w, Q, i)
			case "lse":
				got, want = r.llse[i], zzLocalLse(r.s, w, i)
			case "dq":
				got, want = r.ldq[i], zzLocalRows(r.s, w, Q, i)
			case "dk":
				got, want = r.ldk[i], zzLocalRows(r.s, w, K, i)
			case "dv":
				got, want = r.ldv[i], zzLocalRows(r.s, w, K, i)
			default:
				t.Fatalf("no output %q", name)
			}
			g := dl(got)
			var num, den float64
			for j, x := range want {
				d := float64(g[j]) - float64(x)
				num, den = num+d*d, den+float64(x)*float64(x)
			}
			rel := math.Sqrt(num / den)
			if !(rel < zigzagWholeTol) {
				t.Errorf("%+v rank %d: %s differs from the whole sequence's rows by %.3g (relative L2)", r.s, i, name, rel)
			} else {
				t.Logf("%+v rank %d: %s within %.2g of the whole sequence's rows", r.s, i, name, rel)
			}
		}
	}
}

func TestZigzagAttentionAgainstWhole(t *testing.T) {
	b := testBackend(t)
	for i, s := range []backend.ZigzagShape{
		{Ranks: 2, Batch: 2, Chunk: 192, Heads: 8, KVHeads: 2, HeadDim: 64},
		{Ranks: 4, Batch: 1, Chunk: 256, Heads: 8, KVHeads: 2, HeadDim: 128},
		{Ranks: 8, Batch: 1, Chunk: 128, Heads: 4, KVHeads: 4, HeadDim: 64},
		{Ranks: 3, Batch: 1, Chunk: 64, Heads: 6, KVHeads: 1, HeadDim: 128},
	} {
		r := newZZRun(t, b, s, uint64(i))
		r.wholeForward()
		r.wholeBackward()
		r.ringForward()
		r.ringBackward()
		r.compare(t)
	}
}

// TestZigzagAttentionFigures times the fused ring of W virtual ranks
// (every rank's kernels, one after another on this GPU) against one call
// of the tensor-core kernels on the whole sequence: the same work, so
// core / ring is the ring's efficiency. Virtual ranks share one GPU's
// memory and SMs: the figures show what the zigzag split and the reads
// through pointer tables cost, not NVLink.
func TestZigzagAttentionFigures(t *testing.T) {
	b := testBackend(t)
	d := b.dev
	for _, c := range []struct{ w, perRank, dh, h, kv int }{
		{2, 4096, 128, 16, 4}, {4, 4096, 128, 16, 4}, {8, 4096, 128, 16, 4},
		{2, 8192, 128, 16, 4}, {4, 8192, 128, 16, 4}, {8, 8192, 128, 16, 4},
		{4, 4096, 64, 16, 4},
	} {
		s := backend.ZigzagShape{Ranks: c.w, Batch: 1, Chunk: c.perRank / 2, Heads: c.h, KVHeads: c.kv, HeadDim: c.dh}
		r := newZZRun(t, b, s, 99)
		sync := func(f func()) func() error { return func() error { f(); return b.Sync() } }
		coreF := attnMedianMs(t, d, sync(r.wholeForward))
		coreB := attnMedianMs(t, d, sync(r.wholeBackward))
		ringF := attnMedianMs(t, d, sync(r.ringForward))
		ringB := attnMedianMs(t, d, sync(r.ringBackward))
		name := fmt.Sprintf("ring W%d S%d H%d KV%d Dh%d", c.w, s.Seq(), c.h, c.kv, c.dh)
		flops := 4 * float64(s.Heads) * float64(s.Seq()) * float64(s.Seq()) * float64(c.dh) / 2
		figure(t, name+" fwd", ringF, "ms")
		figure(t, name+" fwd rate", flops/ringF/1e9, "TFLOP/s")
		figure(t, name+" fwd efficiency", coreF/ringF, "x")
		figure(t, name+" bwd", ringB, "ms")
		figure(t, name+" fwd+bwd efficiency", (coreF+coreB)/(ringF+ringB), "x")
		figure(t, name+" core fwd", coreF, "ms")
		figure(t, name+" core bwd", coreB, "ms")
		r.compare(t)
	}
}
