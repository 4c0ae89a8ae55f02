package cuda

// The attention kernels, both sets (attention.cu in float32,
// attention_tc.cu on the tensor cores), on the GPU against backend/cpu in
// float64 on fresh random inputs, outputs poisoned with NaN; and their
// speed at moe-small's shape.

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// attnFP32Tol bounds the relative L2 error of the float32 kernels
// (attention.cu) against the float64 reference: sums of up to S*Dh
// products in float32, plus exp2f.
const attnFP32Tol = 1e-4

// attnBF16Tol bounds the relative L2 error of the tensor-core kernels
// (attention_tc.cu) against the float64 reference on the raw float32
// inputs, the bf16 tolerance: q, k, v and dout round to bf16 (2^-9
// relative), and so do P and dS before their products. An H200 measured
// 2.6e-3..4.7e-3 on out, up to 8.1e-3 on dq and dk, 6.9e-3 on dv and
// 2.2e-3 on lse (one position, where lse is small) at the shapes below.
const attnBF16Tol = 1e-2

// attnRoundedLseTol bounds the tensor-core lse against the reference on
// the bf16-rounded q and k the kernels multiply, which leaves only float32
// accumulation and ex2.approx (the emulation: 6e-8); a wrong mask, scale
// or softmax statistic shows here far above it.
const attnRoundedLseTol = 1e-4

// attnTol is the tolerance of impl's kernels against the raw reference.
func attnTol(impl attnImpl) float64 {
	if impl == attnFP32 {
		return attnFP32Tol
	}
	return attnBF16Tol
}

func TestAttentionKernels(t *testing.T) {
	d := testDevice(t)
	shapes := []backend.AttnShape{
		{Batch: 2, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 16},
		{Batch: 1, Seq: 300, Heads: 8, KVHeads: 2, HeadDim: 64},
		{Batch: 2, Seq: 129, Heads: 6, KVHeads: 6, HeadDim: 128},
		{Batch: 1, Seq: 70, Heads: 3, KVHeads: 1, HeadDim: 37},
		{Batch: 1, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 64},
		{Batch: 2, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 64},
		{Batch: 1, Seq: 70, Heads: 3, KVHeads: 1, HeadDim: 128},
		{Batch: 3, Seq: 64, Heads: 2, KVHeads: 1, HeadDim: 64},
		{Batch: 1, Seq: 1, Heads: 2, KVHeads: 2, HeadDim: 128},
		// More keys than queries, as on a context-parallel rank: an offset
		// that is no multiple of 16 (rows of an active warp that see no key
		// of a tile), keys 250..299 that no query sees (a whole dk/dv block
		// of zeros), zigzag chunks (the last of 4, the first with a tail
		// nobody sees) and one query deep in the sequence.
		{Batch: 2, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 16, KVSeq: 9, QOffset: 4},
		{Batch: 2, Seq: 100, Heads: 4, KVHeads: 2, HeadDim: 64, KVSeq: 300, QOffset: 150},
		{Batch: 1, Seq: 100, Heads: 3, KVHeads: 1, HeadDim: 37, KVSeq: 300, QOffset: 150},
		{Batch: 1, Seq: 128, Heads: 2, KVHeads: 1, HeadDim: 128, KVSeq: 512, QOffset: 384},
		{Batch: 2, Seq: 64, Heads: 2, KVHeads: 2, HeadDim: 64, KVSeq: 256},
		{Batch: 1, Seq: 1, Heads: 2, KVHeads: 2, HeadDim: 64, KVSeq: 70, QOffset: 67},
		// Unmasked (a ring's blocks of earlier keys), with a key tile that
		// runs into the next sequence; and queries spanning several of the
		// Hopper kernel's 128-query blocks against a longer key sequence.
		{Batch: 2, Seq: 100, Heads: 4, KVHeads: 2, HeadDim: 64, KVSeq: 200, Full: true},
		{Batch: 2, Seq: 260, Heads: 4, KVHeads: 1, HeadDim: 128, KVSeq: 333, Full: true},
		{Batch: 2, Seq: 300, Heads: 4, KVHeads: 2, HeadDim: 128, KVSeq: 700, QOffset: 333},
	}
	for n, s := range shapes {
		impls := []attnImpl{attnFP32}
		if tcHeadDim(s.HeadDim) {
			impls = append(impls, attnTC)
			if hopperAttnTakes(d, s) {
				impls = append(impls, attnHopper)
			}
		}
		for _, impl := range impls {
			name := fmt.Sprintf("B%d_S%d_H%d_KV%d_Dh%d", s.Batch, s.Seq, s.Heads, s.KVHeads, s.HeadDim)
			if s.KVSeq != 0 || s.QOffset != 0 {
				name += fmt.Sprintf("_KVS%d_Off%d", s.Keys(), s.QOffset)
			}
			t.Run(name+"_"+strings.ReplaceAll(impl.String(), " ", "_"), func(t *testing.T) {
				checkAttention(newKT(t, uint64(30+n)), s, impl)
			})
		}
	}
}

// checkAttention runs the forward and the backward on one shape with
// impl's kernels and compares every output with the CPU backend's.
func checkAttention(k *kt, s backend.AttnShape, impl attnImpl) {
	T, TK, H, KV, Dh := s.Batch*s.Seq, s.Batch*s.Keys(), s.Heads, s.KVHeads, s.HeadDim
	nq, nk, nl := T*H*Dh, TK*KV*Dh, s.Batch*H*s.Seq
	tol := attnTol(impl)
	// q and k at 1.5 give peaked softmax rows as well as flat ones.
	q, kk, v, dout := k.randn(nq, 1.5), k.randn(nk, 1.5), k.randn(nk, 1), k.randn(nq, 1)
	bq, bk, bv, bdout := upload(k, q), upload(k, kk), upload(k, v), upload(k, dout)
	out, lse := k.poisoned(nq), k.poisoned(nl)
	if err := attentionForward(k.d, out.Ptr(), lse.Ptr(), bq.Ptr(), bk.Ptr(), bv.Ptr(), s, impl); err != nil {
		k.t.Fatal(err)
	}
	rq, rk, rv := k.cpuF(q, T, H*Dh), k.cpuF(kk, TK, KV*Dh), k.cpuF(v, TK, KV*Dh)
	rout, rlse := k.ref.New(backend.Float64, T, H*Dh), k.ref.New(backend.Float64, s.Batch, H, s.Seq)
	k.ref.AttentionForward(rout, rlse, rq, rk, rv, s)
	gotOut, gotLse := k.download(out, nq), k.download(lse, nl)
	k.check("out", gotOut, k.get(rout), tol)
	k.check("lse", gotLse, k.get(rlse), tol)
	if impl != attnFP32 {
		bout, blse := k.ref.New(backend.Float64, T, H*Dh), k.ref.New(backend.Float64, s.Batch, H, s.Seq)
		k.ref.AttentionForward(bout, blse, k.cpuF(roundBF16(q), T, H*Dh), k.cpuF(roundBF16(kk), TK, KV*Dh), rv, s)
		k.check("lse against bf16-rounded q and k", gotLse, k.get(blse), attnRoundedLseTol)
	}

	// The backward takes the GPU's out and lse; the reference gets the same.
	gq, gk, gv := k.poisoned(nq), k.poisoned(nk), k.poisoned(nk)
	backward := func() {
		k.t.Helper()
		if err := attentionBackward(k.d, gq.Ptr(), gk.Ptr(), gv.Ptr(), bdout.Ptr(), bq.Ptr(), bk.Ptr(), bv.Ptr(), out.Ptr(), lse.Ptr(), s, impl); err != nil {
			k.t.Fatal(err)
		}
	}
	backward()
	rdq, rdk, rdv := k.ref.New(backend.Float64, T, H*Dh), k.ref.New(backend.Float64, TK, KV*Dh), k.ref.New(backend.Float64, TK, KV*Dh)
	k.ref.AttentionBackward(rdq, rdk, rdv, k.cpuF(dout, T, H*Dh), rq, rk, rv, k.cpuF(gotOut, T, H*Dh), k.cpuF(gotLse, nl), s)
	gotQ, gotK, gotV := k.download(gq, nq), k.download(gk, nk), k.download(gv, nk)
	if s.Seq == 1 && s.QOffset == 0 {
		// One visible key: dS = P*(dP - D) is 0 in exact arithmetic, so dq
		// and dk are 0 up to rounding and a relative error means nothing;
		// bound them instead.
		for name, g := range map[string][]float32{"dq": gotQ, "dk": gotK} {
			for i, x := range g {
				if !(math.Abs(float64(x)) < 10*tol) {
					k.t.Errorf("%s[%d] = %v with one key, want about 0", name, i, x)
					break
				}
			}
		}
	} else {
		k.check("dq", gotQ, k.get(rdq), tol)
		k.check("dk", gotK, k.get(rdk), tol)
	}
	k.check("dv", gotV, k.get(rdv), tol)
	// Keys after the last query's last visible key get exactly 0 (with
	// Full, every query sees every key).
	for b := range s.Batch {
		if s.Full {
			break
		}
		for j := s.QOffset + s.Seq; j < s.Keys(); j++ {
			row := (b*s.Keys() + j) * KV * Dh
			for x := row; x < row+KV*Dh; x++ {
				if gotK[x] != 0 || gotV[x] != 0 {
					k.t.Fatalf("key %d of sequence %d, seen by no query: dk %v, dv %v, want 0", j, b, gotK[x], gotV[x])
				}
			}
		}
	}
	if impl != attnFP32 {
		// For the record: the conformance suite's element-wise measure,
		// max |got - want| / (|want| + rms(want)), which bf16 rounding of
		// the inputs alone pushes past its bound of 1e-2 (an H200: up to
		// 0.05 on out and 0.13 on the gradients here, q and k at 1.5).
		k.t.Logf("element-wise max |g-w|/(|w|+rms): out %.3g, dq %.3g, dk %.3g, dv %.3g",
			elementRatio(gotOut, k.get(rout)), elementRatio(gotQ, k.get(rdq)), elementRatio(gotK, k.get(rdk)), elementRatio(gotV, k.get(rdv)))
	}

	// A second run gives the same bits, but for the Hopper kernel's dq,
	// whose float atomics add in the order the blocks run.
	backward()
	again := k.download(gq, nq)
	if impl == attnHopper {
		if s.Seq > 1 || s.QOffset > 0 { // see the one-key case above
			k.check("dq of a second run", again, k.get(rdq), tol)
		}
		again = gotQ
	}
	if !slices.Equal(gotQ, again) || !slices.Equal(gotK, k.download(gk, nk)) || !slices.Equal(gotV, k.download(gv, nk)) {
		k.t.Error("the backward is not deterministic: a second run gave other bits")
	}
}

// elementRatio is max |got - want| / (|want| + rms(want)).
func elementRatio(got []float32, want []float64) float64 {
	var ss float64
	for _, w := range want {
		ss += w * w
	}
	rms := math.Sqrt(ss / float64(max(len(want), 1)))
	var worst float64
	for i, w := range want {
		worst = max(worst, math.Abs(float64(got[i])-w)/(math.Abs(w)+rms))
	}
	return worst
}

// TestAttentionFigures times both sets of kernels at moe-small's shape
// (and the tensor-core ones at head dim 128), and logs every kernel's
// registers and local memory.
func TestAttentionFigures(t *testing.T) {
	d := testDevice(t)
	var names []string
	for _, dp := range []int{32, 64, 128} {
		for _, name := range []string{"attn_forward_d%d_f32", "attn_backward_dq_d%d_f32", "attn_backward_dkdv_d%d_f32"} {
			names = append(names, "attention.cu:"+fmt.Sprintf(name, dp))
		}
	}
	for _, dh := range []int{64, 128} {
		for _, name := range []string{"attn_tc_forward_d%d", "attn_tc_backward_dq_d%d", "attn_tc_backward_dkdv_d%d",
			"attn_zz_forward_d%d", "attn_zz_backward_dq_d%d", "attn_zz_backward_dkdv_d%d"} {
			names = append(names, "attention_tc.cu:"+fmt.Sprintf(name, dh))
		}
		for _, name := range []string{"attn_h_forward_d%d", "attn_h_forward_d%d_bf16", "attn_h_backward_d%d",
			"attn_h_zz_forward_d%d", "attn_h_zz_backward_d%d"} {
			names = append(names, "attention_hopper.cu:"+fmt.Sprintf(name, dh))
		}
	}
	for _, fn := range names {
		file, name, _ := strings.Cut(fn, ":")
		kern, err := sourceKernel(d, file, name)
		if err != nil {
			t.Fatal(err)
		}
		var local int
		if err := d.Do(func() error {
			var err error
			local, err = d.drv.FuncAttribute(kern.fn, driver.FuncLocalSizeBytes)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: %d registers, %d bytes of local memory per thread", kern.Desc.Name, kern.Registers, local)
		if file == "attention_hopper.cu" {
			// In the suite's summary: a spill or a register count that moved
			// shows there, beside the kernels' rates.
			figure(t, name+"_registers", float64(kern.Registers), "")
			figure(t, name+"_local_bytes", float64(local), "B")
		}
	}

	k := newKT(t, 40)
	moeSmall := backend.AttnShape{Batch: 8, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 64}
	timeAttention(k, "attention fp32", moeSmall, attnFP32)
	timeAttention(k, "attention", moeSmall, attnTC)
	timeAttention(k, "attention", backend.AttnShape{Batch: 4, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 128}, attnTC)
	if hopperAttnTakes(d, moeSmall) {
		for _, s := range []backend.AttnShape{moeSmall, {Batch: 4, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 128},
			{Batch: 2, Seq: 8192, Heads: 16, KVHeads: 16, HeadDim: 128}, {Batch: 1, Seq: 32768, Heads: 32, KVHeads: 8, HeadDim: 128}} {
			timeAttention(k, "attention hopper", s, attnHopper)
		}
	}
}

// timeAttention times impl's forward and backward on s, logs their figures
// under name, and spot-checks the result: rows of out and lse against a
// direct float64 computation, every gradient for NaN.
func timeAttention(k *kt, name string, s backend.AttnShape, impl attnImpl) {
	t, d := k.t, k.d
	T, H, KV, Dh := s.Batch*s.Seq, s.Heads, s.KVHeads, s.HeadDim
	nq, nk, nl := T*H*Dh, T*KV*Dh, s.Batch*H*s.Seq
	q, kk, v, dout := k.randn(nq, 1), k.randn(nk, 1), k.randn(nk, 1), k.randn(nq, 1)
	bq, bk, bv, bdout := upload(k, q), upload(k, kk), upload(k, v), upload(k, dout)
	out, lse := k.poisoned(nq), k.poisoned(nl)
	gq, gk, gv := k.poisoned(nq), k.poisoned(nk), k.poisoned(nk)
	fwd := func() error { return attentionForward(d, out.Ptr(), lse.Ptr(), bq.Ptr(), bk.Ptr(), bv.Ptr(), s, impl) }
	bwd := func() error {
		return attentionBackward(d, gq.Ptr(), gk.Ptr(), gv.Ptr(), bdout.Ptr(), bq.Ptr(), bk.Ptr(), bv.Ptr(), out.Ptr(), lse.Ptr(), s, impl)
	}
	flops := 4 * float64(s.Batch*H) * float64(s.Seq) * float64(s.Seq) * float64(Dh) / 2
	fwdMs := attnMedianMs(t, d, fwd)
	bwdMs := attnMedianMs(t, d, bwd)
	shape := fmt.Sprintf("B%d S%d H%d KV%d Dh%d", s.Batch, s.Seq, H, KV, Dh)
	if impl == attnHopper {
		// The kernel alone, on inputs already in bf16 (as SDPA is timed).
		q16, k16, v16 := upload(k, bf16Slice(q)), upload(k, bf16Slice(kk)), upload(k, bf16Slice(v))
		ms := attnMedianMs(t, d, func() error {
			return AttentionForwardBF16(d, out.Ptr(), lse.Ptr(), q16.Ptr(), k16.Ptr(), v16.Ptr(), s, false)
		})
		figure(t, name+" fwd bf16 in "+shape+" rate", flops/ms/1e9, "TFLOP/s")
		// And with a bf16 out, as a layer on one rank runs it (the output
		// projection's operand): its own buffer, so out is still checked.
		out16 := k.poisoned(nq)
		ms = attnMedianMs(t, d, func() error {
			return AttentionForwardBF16(d, out16.Ptr(), lse.Ptr(), q16.Ptr(), k16.Ptr(), v16.Ptr(), s, true)
		})
		figure(t, name+" fwd bf16 in and out "+shape+" rate", flops/ms/1e9, "TFLOP/s")
	}
	figure(t, name+" fwd "+shape, fwdMs, "ms")
	figure(t, name+" fwd "+shape+" rate", flops/fwdMs/1e9, "TFLOP/s")
	figure(t, name+" bwd "+shape, bwdMs, "ms")
	figure(t, name+" bwd "+shape+" rate", 2.5*flops/bwdMs/1e9, "TFLOP/s")

	// A timed kernel must also be right.
	gotOut, gotLse := k.download(out, nq), k.download(lse, nl)
	group := H / KV
	tol := attnTol(impl)
	for _, r := range [][3]int{{0, 0, 0}, {s.Batch - 1, H - 1, s.Seq - 1}, {s.Batch / 2, 5, 1000}, {s.Batch - 1, 9, 63}, {min(1, s.Batch-1), 12, 64}} {
		b, h, i := r[0], r[1], r[2]
		wantOut, wantLse := naiveAttnRow(q, kk, v, s, b, h/group, h, i)
		if e := math.Abs(float64(gotLse[(b*H+h)*s.Seq+i]) - wantLse); !(e <= tol*max(1, math.Abs(wantLse))) {
			t.Errorf("%s %s: lse[%d,%d,%d] = %v, want %v", name, shape, b, h, i, gotLse[(b*H+h)*s.Seq+i], wantLse)
		}
		row := gotOut[((b*s.Seq+i)*H+h)*Dh:][:Dh]
		var num, den float64
		for j, w := range wantOut {
			num += (float64(row[j]) - w) * (float64(row[j]) - w)
			den += w * w
		}
		if rel := math.Sqrt(num / den); !(rel < tol) {
			t.Errorf("%s %s: out row (b %d, h %d, i %d): relative error %.3g", name, shape, b, h, i, rel)
		}
	}
	for name, g := range map[string][]float32{"dq": k.download(gq, nq), "dk": k.download(gk, nk), "dv": k.download(gv, nk)} {
		if i := slices.IndexFunc(g, func(x float32) bool { return math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) }); i >= 0 {
			t.Errorf("%s: %s[%d] = %v", shape, name, i, g[i])
		}
	}
}

// attnMedianMs returns the median milliseconds of f over several runs,
// after a warm-up, timed with device events.
func attnMedianMs(t *testing.T, d *Device, f func() error) float64 {
	t.Helper()
	start, err := d.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	defer start.Destroy()
	stop, err := d.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	defer stop.Destroy()
	if err := f(); err != nil {
		t.Fatal(err)
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	ms := make([]float64, 7)
	for i := range ms {
		if err := start.Record(); err != nil {
			t.Fatal(err)
		}
		if err := f(); err != nil {
			t.Fatal(err)
		}
		if err := stop.Record(); err != nil {
			t.Fatal(err)
		}
		if ms[i], err = stop.Since(start); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	slices.Sort(ms)
	return ms[len(ms)/2]
}

// naiveAttnRow computes one query row's output and lse in float64 from the
// definition.
func naiveAttnRow(q, k, v []float32, s backend.AttnShape, b, kvh, h, i int) ([]float64, float64) {
	H, KV, Dh := s.Heads, s.KVHeads, s.HeadDim
	qi := q[((b*s.Seq+i)*H+h)*Dh:][:Dh]
	scores := make([]float64, i+1)
	m := math.Inf(-1)
	for j := range scores {
		kj := k[((b*s.Seq+j)*KV+kvh)*Dh:][:Dh]
		var dot float64
		for d := range qi {
			dot += float64(qi[d]) * float64(kj[d])
		}
		scores[j] = dot / math.Sqrt(float64(Dh))
		m = max(m, scores[j])
	}
	var sum float64
	out := make([]float64, Dh)
	for j, sc := range scores {
		p := math.Exp(sc - m)
		sum += p
		vj := v[((b*s.Seq+j)*KV+kvh)*Dh:][:Dh]
		for d := range out {
			out[d] += p * float64(vj[d])
		}
	}
	for d := range out {
		out[d] /= sum
	}
	return out, m + math.Log(sum)
}

// TestHopperAttnWalkRepeats: head dim 64's walking forward, whose blocks
// claim items from module counters that each launch's last block resets,
// writes every element and the same bits launch after launch, on grids
// of min(SMs, items) blocks and of one block an item (band 1) in turn.
func TestHopperAttnWalkRepeats(t *testing.T) {
	d := testDevice(t)
	s := backend.AttnShape{Batch: 4, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 64}
	if !hopperAttnTakes(d, s) || !hopperAttnWalks(s.HeadDim) {
		t.Skipf("the Hopper attention kernels do not run on %s", d.info.Name)
	}
	k := newKT(t, 97)
	T, H, KV, Dh := s.Batch*s.Seq, s.Heads, s.KVHeads, s.HeadDim
	nq, nk, nl := T*H*Dh, T*KV*Dh, s.Batch*H*s.Seq
	q, kk, v := k.buf(k.randn(nq, 1.5), true), k.buf(k.randn(nk, 1.5), true), k.buf(k.randn(nk, 1), true)
	var first []float32
	for call, band := range []int{0, 0, 1, 0, 1, 1, 0} {
		out, lse := k.poisoned(nq), k.poisoned(nl)
		if err := launchHopperAttnForward(d, out.Ptr(), lse.Ptr(), q.Ptr(), kk.Ptr(), v.Ptr(), s, false, band); err != nil {
			t.Fatal(err)
		}
		got := append(k.download(out, nq), k.download(lse, nl)...)
		if i := slices.IndexFunc(got, func(x float32) bool { return math.IsNaN(float64(x)) }); i >= 0 {
			t.Fatalf("call %d (band %d): element %d of out and lse is NaN: an item no block ran", call, band, i)
		}
		if first == nil {
			first = got
		} else if !slices.Equal(got, first) {
			t.Errorf("call %d (band %d): out or lse differs from the first call's", call, band)
		}
	}
}

// TestHopperAttnBands: the whole-sequence Hopper kernels give the same
// results whichever pairs their blocks run at a time. On shapes of 64
// and 32 tiles a pair, where hopperAttnBand picks a band (and the last
// band is short), the chosen bands against every pair at once: out, lse, dk and dv
// are the same bits (each element is one block's), dq agrees to float32
// rounding (its blocks' additions land in another order).
func TestHopperAttnBands(t *testing.T) {
	d := testDevice(t)
	if !hopperAttnTakes(d, backend.AttnShape{HeadDim: 64}) {
		t.Skipf("the Hopper attention kernels do not run on %s", d.info.Name)
	}
	for n, s := range []backend.AttnShape{
		// 10 and 5 pairs: bands of 4, the last of 2 forward and 1 backward.
		{Batch: 1, Seq: 8065, Heads: 10, KVHeads: 5, HeadDim: 64},
		{Batch: 1, Seq: 8065, Heads: 10, KVHeads: 5, HeadDim: 128},
		{Batch: 1, Seq: 4033, Heads: 12, KVHeads: 6, HeadDim: 128},
	} {
		t.Run(fmt.Sprintf("B%d_S%d_H%d_KV%d_Dh%d", s.Batch, s.Seq, s.Heads, s.KVHeads, s.HeadDim), func(t *testing.T) {
			k := newKT(t, uint64(90+n))
			T, H, KV, Dh := s.Batch*s.Seq, s.Heads, s.KVHeads, s.HeadDim
			nq, nk, nl := T*H*Dh, T*KV*Dh, s.Batch*H*s.Seq
			tiles := (s.Seq + hopperAttnBN - 1) / hopperAttnBN
			fwdPairs, bwdPairs := s.Batch*H, s.Batch*KV
			fwdBand, bwdBand := hopperAttnBand(fwdPairs, tiles), hopperAttnBand(bwdPairs, tiles)
			if fwdBand == fwdPairs || bwdBand == bwdPairs {
				t.Fatalf("no band at %d tiles: forward %d of %d pairs, backward %d of %d", tiles, fwdBand, fwdPairs, bwdBand, bwdPairs)
			}
			q, kk, v := k.buf(k.randn(nq, 1.5), true), k.buf(k.randn(nk, 1.5), true), k.buf(k.randn(nk, 1), true)
			dout := upload(k, k.randn(nq, 1))
			kern, err := sourceKernel(d, "attention_hopper.cu", fmt.Sprintf("attn_h_backward_d%d", Dh))
			if err != nil {
				t.Fatal(err)
			}
			threads, smem := hopperAttnBwdLaunch(Dh)
			run := func(fwd, bwd int) map[string][]float32 {
				out, lse := k.poisoned(nq), k.poisoned(nl)
				if err := launchHopperAttnForward(d, out.Ptr(), lse.Ptr(), q.Ptr(), kk.Ptr(), v.Ptr(), s, false, fwd); err != nil {
					t.Fatal(err)
				}
				dq, dk, dv := k.poisoned(nq), k.poisoned(nk), k.poisoned(nk)
				if err := launchHopperAttnBackward(d, kern, threads, smem, dq.Ptr(), dk.Ptr(), dv.Ptr(), dout.Ptr(), q.Ptr(), kk.Ptr(), v.Ptr(),
					out.Ptr(), lse.Ptr(), s, attnBwdInputs{qkv: true}, bwd); err != nil {
					t.Fatal(err)
				}
				return map[string][]float32{"out": k.download(out, nq), "lse": k.download(lse, nl),
					"dq": k.download(dq, nq), "dk": k.download(dk, nk), "dv": k.download(dv, nk)}
			}
			banded, whole := run(fwdBand, bwdBand), run(fwdPairs, bwdPairs)
			for _, name := range []string{"out", "lse", "dq", "dk", "dv"} {
				got, want := banded[name], whole[name]
				if i := slices.IndexFunc(got, func(x float32) bool { return math.IsNaN(float64(x)) }); i >= 0 {
					t.Fatalf("%s[%d] is NaN: an element no block wrote", name, i)
				}
				if name == "dq" {
					if e := relL2(got, want); e > 1e-5 {
						t.Errorf("dq with bands %d/%d: relative L2 %.3g from every pair at once, want at most 1e-5", fwdBand, bwdBand, e)
					}
					continue
				}
				if !slices.Equal(got, want) {
					t.Errorf("%s with bands %d/%d differs from every pair at once", name, fwdBand, bwdBand)
				}
			}
		})
	}
}

// TestAttentionBandFigures times the whole-sequence Hopper kernels with
// each band of (sequence, head) pairs a time (ah_band; the number of pairs
// is every pair at once) at shapes from 16 to 256 tiles a pair, so that
// hopperAttnBand's rule can be read off one run: figures "attention band
// <shape> fwd|bwd band <n> rate", beside "... chosen" (the rule's band).
func TestAttentionBandFigures(t *testing.T) {
	d := testDevice(t)
	if !hopperAttnTakes(d, backend.AttnShape{HeadDim: 64}) {
		t.Skipf("the Hopper attention kernels do not run on %s", d.info.Name)
	}
	k := newKT(t, 95)
	for _, s := range []backend.AttnShape{
		{Batch: 8, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 64},
		{Batch: 4, Seq: 4096, Heads: 16, KVHeads: 4, HeadDim: 128},
		{Batch: 2, Seq: 8192, Heads: 16, KVHeads: 16, HeadDim: 128},
		{Batch: 1, Seq: 32768, Heads: 32, KVHeads: 8, HeadDim: 128},
	} {
		T, H, KV, Dh := s.Batch*s.Seq, s.Heads, s.KVHeads, s.HeadDim
		nq, nk, nl := T*H*Dh, T*KV*Dh, s.Batch*H*s.Seq
		q, kk, v := k.buf(k.randn(nq, 1), true), k.buf(k.randn(nk, 1), true), k.buf(k.randn(nk, 1), true)
		dout := upload(k, k.randn(nq, 1))
		out, lse := k.poisoned(nq), k.poisoned(nl)
		dq, dk, dv := k.poisoned(nq), k.poisoned(nk), k.poisoned(nk)
		kern, err := sourceKernel(d, "attention_hopper.cu", fmt.Sprintf("attn_h_backward_d%d", Dh))
		if err != nil {
			t.Fatal(err)
		}
		threads, smem := hopperAttnBwdLaunch(Dh)
		tiles := (s.Seq + hopperAttnBN - 1) / hopperAttnBN
		shape := fmt.Sprintf("B%d S%d H%d KV%d Dh%d", s.Batch, s.Seq, H, KV, Dh)
		flops := 4 * float64(s.Batch*H) * float64(s.Seq) * float64(s.Seq) * float64(Dh) / 2
		for _, dir := range []struct {
			name   string
			pairs  int
			chosen int
			flops  float64
			run    func(band int) error
		}{
			{"fwd", s.Batch * H, hopperAttnBand(s.Batch*H, tiles), flops, func(band int) error {
				return launchHopperAttnForward(d, out.Ptr(), lse.Ptr(), q.Ptr(), kk.Ptr(), v.Ptr(), s, false, band)
			}},
			{"bwd", s.Batch * KV, hopperAttnBand(s.Batch*KV, tiles), 2.5 * flops, func(band int) error {
				return launchHopperAttnBackward(d, kern, threads, smem, dq.Ptr(), dk.Ptr(), dv.Ptr(), dout.Ptr(), q.Ptr(), kk.Ptr(), v.Ptr(),
					out.Ptr(), lse.Ptr(), s, attnBwdInputs{qkv: true}, band)
			}},
		} {
			figure(t, fmt.Sprintf("attention band %s %s chosen", shape, dir.name), float64(dir.chosen), "pairs")
			// 1 to 16 pairs at a time, and all of them (once).
			for _, band := range slices.Compact(slices.Sorted(slices.Values([]int{1, 2, 3, 4, 6, 8, 16, dir.pairs}))) {
				if band > dir.pairs {
					continue
				}
				ms := attnMedianMs(t, d, func() error { return dir.run(band) })
				figure(t, fmt.Sprintf("attention band %s %s band %d rate", shape, dir.name, band), dir.flops/ms/1e9, "TFLOP/s")
			}
		}
		for name, g := range map[string][]float32{"out": k.download(out, nq), "dq": k.download(dq, nq), "dk": k.download(dk, nk)} {
			if i := slices.IndexFunc(g, func(x float32) bool { return math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) }); i >= 0 {
				t.Errorf("%s: %s[%d] = %v", shape, name, i, g[i])
			}
		}
	}
}
