package cuda

// The one-pass fused ring (attention_zigzag_hopper.go: attn_h_zz_* on the
// Hopper core) on the GPU: every rank's rows against the whole sequence's
// from the production Hopper kernels on one rank (their unfused
// definition, on the same bf16 rounding), and its speed against that
// call and against the two-pass tensor-core ring at W = 2, 4 and 8
// virtual ranks. The small conformance shapes against the CPU are in
// backend/backendtest (zigzag_cases.go, "one-pass").

import (
	"fmt"
	"slices"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// zzOnePass is every rank's bf16 copies of a zzRun's q, k, v and dout.
// Here every rank rounds its float q, k and v in each pass, beside the
// whole-sequence call on float inputs, which rounds them too; the layers
// keep them in bf16 (attention.ContextCore.QKVType) and round only dout,
// as `mktrain bench attention` runs both sides.
type zzOnePass struct {
	r                *zzRun
	q, k, v, doutH16 []backend.Tensor
}

func newZZOnePass(r *zzRun) *zzOnePass {
	o := &zzOnePass{r: r}
	for i := range r.s.Ranks {
		bf := func(x backend.Tensor) backend.Tensor { return r.b.New(backend.BFloat16, x.Shape()...) }
		o.q, o.k, o.v = append(o.q, bf(r.lq[i])), append(o.k, bf(r.lk[i])), append(o.v, bf(r.lv[i]))
		o.doutH16 = append(o.doutH16, bf(r.ldout[i]))
	}
	return o
}

// forward rounds every rank's q, k and v and runs every rank's forward.
func (o *zzOnePass) forward() { o.forwardBand(0) }

// forwardBand is forward with the kernels' blocks band pairs at a time
// (0: hopperZigzagBand's choice, as ZigzagAttentionForward runs them).
func (o *zzOnePass) forwardBand(band int) {
	r := o.r
	for i := range r.s.Ranks {
		r.b.Copy(o.q[i], r.lq[i])
		r.b.Copy(o.k[i], r.lk[i])
		r.b.Copy(o.v[i], r.lv[i])
	}
	for i := range r.s.Ranks {
		if band == 0 {
			r.b.ZigzagAttentionForward(r.lout[i], r.llse[i], o.q[i], o.k, o.v, r.rank(i))
		} else {
			r.b.zigzagForwardHopper(r.lout[i], r.llse[i], o.q[i], o.k, o.v, r.rank(i), band)
		}
	}
}

// backward does what every rank does before the meeting (round q, k, v
// and dout, delta, zero dq), then every rank's backward.
func (o *zzOnePass) backward() { o.backwardSplits(0) }

// backwardSplits is backward with splits blocks a key block (0:
// zigzagBackwardSplits's choice, as ZigzagAttentionBackward runs them).
func (o *zzOnePass) backwardSplits(splits int) {
	r := o.r
	for i := range r.s.Ranks {
		r.b.Copy(o.q[i], r.lq[i])
		r.b.Copy(o.k[i], r.lk[i])
		r.b.Copy(o.v[i], r.lv[i])
		r.b.ZigzagAttentionPrepare(r.ldelta[i], o.doutH16[i], r.ldq[i], r.ldout[i], r.lout[i], r.rank(i))
	}
	for i := range r.s.Ranks {
		r.b.zigzagBackwardHopper(r.ldq, r.ldk[i], r.ldv[i], o.k[i], o.v[i], o.q, o.doutH16, r.llse, r.ldelta, r.rank(i), splits)
	}
}

func TestZigzagOnePassAgainstWhole(t *testing.T) {
	b := testBackend(t)
	// GQA groups of 1 to 4, W 2 to 8 and an odd W, one and several tiles
	// a chunk, several sequences, both head dims; the last with 32 q tiles
	// a rank, whose forward runs its 12 (sequence, head) pairs in bands of
	// 8 and 4 (hopperZigzagBand).
	shapes := []backend.ZigzagShape{
		{Ranks: 2, Batch: 2, Chunk: 128, Heads: 8, KVHeads: 2, HeadDim: 64},
		{Ranks: 4, Batch: 1, Chunk: 256, Heads: 8, KVHeads: 2, HeadDim: 128},
		{Ranks: 8, Batch: 1, Chunk: 128, Heads: 4, KVHeads: 4, HeadDim: 64},
		{Ranks: 3, Batch: 2, Chunk: 384, Heads: 4, KVHeads: 1, HeadDim: 128},
		{Ranks: 4, Batch: 1, Chunk: 256, Heads: 4, KVHeads: 4, HeadDim: 64},
		{Ranks: 2, Batch: 1, Chunk: 2048, Heads: 12, KVHeads: 3, HeadDim: 64},
	}
	if err := b.ZigzagAttentionOnePass(shapes[0]); err != nil {
		t.Skipf("the one-pass fused ring does not run here: %v", err)
	}
	for i, s := range shapes {
		r := newZZRun(t, b, s, uint64(40+i))
		r.wholeForward()
		r.wholeBackward()
		o := newZZOnePass(r)
		o.forward()
		r.compareSome(t, "out", "lse")
		o.backward()
		r.compareSome(t, "dq", "dk", "dv")
	}
}

// TestZigzagOnePassRefuses checks that the one-pass ops are refused under
// SetDeterministic (dq's adds land in no fixed order) and for chunks the
// kernels do not tile.
func TestZigzagOnePassRefuses(t *testing.T) {
	b := testBackend(t)
	s := backend.ZigzagShape{Ranks: 2, Batch: 1, Chunk: 128, Heads: 4, KVHeads: 2, HeadDim: 128}
	if err := b.ZigzagAttentionOnePass(s); err != nil {
		t.Skipf("the one-pass fused ring does not run here: %v", err)
	}
	b.SetDeterministic(true)
	err := b.ZigzagAttentionOnePass(s)
	b.SetDeterministic(false)
	if err == nil {
		t.Error("ZigzagAttentionOnePass takes a shape under SetDeterministic")
	}
	bad := s
	bad.Chunk = 192
	if b.ZigzagAttentionOnePass(bad) == nil {
		t.Errorf("ZigzagAttentionOnePass takes chunks of %d rows", bad.Chunk)
	}
	bad = s
	bad.Ranks, bad.Chunk = zigzagHopperMaxRanks+1, 128
	if b.ZigzagAttentionOnePass(bad) == nil {
		t.Errorf("ZigzagAttentionOnePass takes %d ranks", bad.Ranks)
	}
}

// TestZigzagOnePassFigures times the one-pass ring of W virtual ranks
// on float q, k and v (each rank's rounding, delta and dq zeroing
// included; see zzOnePass) beside the whole-sequence call on the same
// float inputs (the same work: core / ring is the ring's efficiency) and
// the two-pass tensor-core ring, forward and backward, at S/W 4096 and
// 8192, H16 KV4, head dims 128 and 64.
func TestZigzagOnePassFigures(t *testing.T) {
	b := testBackend(t)
	d := b.dev
	for _, c := range []struct{ w, perRank, dh int }{{2, 4096, 128}, {4, 4096, 128}, {8, 4096, 128}, {4, 8192, 128}, {8, 8192, 128}, {4, 4096, 64}} {
		s := backend.ZigzagShape{Ranks: c.w, Batch: 1, Chunk: c.perRank / 2, Heads: 16, KVHeads: 4, HeadDim: c.dh}
		if err := b.ZigzagAttentionOnePass(s); err != nil {
			t.Skipf("the one-pass fused ring does not run here: %v", err)
		}
		r := newZZRun(t, b, s, 99)
		o := newZZOnePass(r)
		sync := func(f func()) func() error { return func() error { f(); return b.Sync() } }
		r.wholeForward()
		coreF := attnMedianMs(t, d, sync(r.wholeForward))
		coreB := attnMedianMs(t, d, sync(r.wholeBackward))
		tcF := attnMedianMs(t, d, sync(r.ringForward))
		tcB := attnMedianMs(t, d, sync(r.ringBackward))
		oneF := attnMedianMs(t, d, sync(o.forward))
		oneB := attnMedianMs(t, d, sync(o.backward))
		r.compareSome(t, "out", "lse", "dq", "dk", "dv")
		name := fmt.Sprintf("ring W%d S%d H16 KV4 Dh%d", c.w, s.Seq(), c.dh)
		flops := 4 * float64(s.Heads) * float64(s.Seq()) * float64(s.Seq()) * float64(s.HeadDim) / 2
		figure(t, name+" core fwd", coreF, "ms")
		figure(t, name+" core bwd", coreB, "ms")
		figure(t, name+" one-pass fwd", oneF, "ms")
		figure(t, name+" one-pass bwd", oneB, "ms")
		figure(t, name+" one-pass fwd rate", flops/oneF/1e9, "TFLOP/s")
		figure(t, name+" one-pass bwd rate", 2.5*flops/oneB/1e9, "TFLOP/s")
		figure(t, name+" one-pass efficiency fwd", coreF/oneF, "x")
		figure(t, name+" one-pass efficiency fwd+bwd", (coreF+coreB)/(oneF+oneB), "x")
		figure(t, name+" two-pass efficiency fwd", coreF/tcF, "x")
		figure(t, name+" two-pass efficiency fwd+bwd", (coreF+coreB)/(tcF+tcB), "x")
	}
}

// TestZigzagForwardBandFigures times the one-pass ring's forward on W
// virtual ranks with its blocks each band of (sequence, head) pairs at a
// time, beside the whole-sequence forward (its efficiency at each band),
// at the rows of bench attention's ring table (H16 KV4 Dh128): the
// figures that set hopperZigzagBand's rule for the ring's 32 and 64 q
// tiles a pair (kernels/attention_hopper.md).
func TestZigzagForwardBandFigures(t *testing.T) {
	b := testBackend(t)
	d := b.dev
	for _, c := range []struct{ w, perRank int }{{2, 4096}, {8, 4096}, {4, 8192}} {
		s := backend.ZigzagShape{Ranks: c.w, Batch: 1, Chunk: c.perRank / 2, Heads: 16, KVHeads: 4, HeadDim: 128}
		if err := b.ZigzagAttentionOnePass(s); err != nil {
			t.Skipf("the one-pass fused ring does not run here: %v", err)
		}
		r := newZZRun(t, b, s, 98)
		o := newZZOnePass(r)
		sync := func(f func()) func() error { return func() error { f(); return b.Sync() } }
		coreF := attnMedianMs(t, d, sync(r.wholeForward))
		name := fmt.Sprintf("ring band W%d S%d", c.w, s.Seq())
		figure(t, name+" chosen", float64(hopperZigzagBand(s.Heads, 2*s.Chunk/hopperAttnBM)), "pairs")
		for _, band := range []int{s.Heads, 1, 2, 4, 8} { // the last, banded, is compared below
			ms := attnMedianMs(t, d, sync(func() { o.forwardBand(band) }))
			figure(t, fmt.Sprintf("%s band %d efficiency fwd", name, band), coreF/ms, "x")
		}
		r.compareSome(t, "out", "lse")
	}
}

// TestZigzagBackwardSplitFigures times the one-pass ring's backward on W
// virtual ranks with 1, 2 and 4 blocks sharing each key block, beside the
// whole-sequence backward, at the rows of bench attention's ring table
// (H16 KV4 Dh128) and two at head dim 64: the figures that set
// zigzagBackwardSplits's rule. Each
// split is timed twice, in the order 1 2 4 4 2 1, and its figure is the
// mean of the two medians, so that the clocks' drift weighs on each
// alike; every split's dq, dk and dv are checked against the whole call's.
func TestZigzagBackwardSplitFigures(t *testing.T) {
	b := testBackend(t)
	d := b.dev
	for _, c := range []struct{ w, perRank, dh int }{{2, 4096, 128}, {8, 4096, 128}, {2, 8192, 128}, {4, 8192, 128}, {8, 8192, 128}, {4, 4096, 64}, {2, 8192, 64}} {
		s := backend.ZigzagShape{Ranks: c.w, Batch: 1, Chunk: c.perRank / 2, Heads: 16, KVHeads: 4, HeadDim: c.dh}
		if err := b.ZigzagAttentionOnePass(s); err != nil {
			t.Skipf("the one-pass fused ring does not run here: %v", err)
		}
		r := newZZRun(t, b, s, 97)
		o := newZZOnePass(r)
		sync := func(f func()) func() error { return func() error { f(); return b.Sync() } }
		r.wholeForward()
		o.forward()
		coreB := attnMedianMs(t, d, sync(r.wholeBackward))
		name := fmt.Sprintf("ring splits W%d S%d Dh%d", c.w, s.Seq(), c.dh)
		keyBlocks := s.Batch * s.KVHeads * 2 * s.Chunk / hopperAttnBN
		figure(t, name+" chosen", float64(zigzagBackwardSplits(keyBlocks, s.Heads/s.KVHeads, s.HeadDim, s.Seq(), d.info.SMs)), "blocks a key block")
		splits := []int{1, 2, 4}
		ms := map[int]float64{}
		for _, sp := range append(slices.Clone(splits), 4, 2, 1) {
			ms[sp] += attnMedianMs(t, d, sync(func() { o.backwardSplits(sp) })) / 2
		}
		for _, sp := range splits {
			figure(t, fmt.Sprintf("%s split %d bwd", name, sp), ms[sp], "ms")
			figure(t, fmt.Sprintf("%s split %d efficiency bwd", name, sp), coreB/ms[sp], "x")
			o.backwardSplits(sp)
			r.compareSome(t, "dq", "dk", "dv")
		}
	}
}
