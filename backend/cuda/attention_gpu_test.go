package cuda

// The attention kernels on the GPU against backend/cpu in float64 on fresh
// random inputs, outputs poisoned with NaN; and their speed at moe-small's
// shape.

import (
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// attnTol bounds the relative L2 error of the float32 kernels against the
// float64 reference: sums of up to S*Dh products in float32, plus exp2f.
const attnTol = 1e-4

func TestAttentionKernels(t *testing.T) {
	testDevice(t)
	shapes := []backend.AttnShape{
		{Batch: 2, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 16},
		{Batch: 1, Seq: 300, Heads: 8, KVHeads: 2, HeadDim: 64},
		{Batch: 2, Seq: 129, Heads: 6, KVHeads: 6, HeadDim: 128},
		{Batch: 1, Seq: 70, Heads: 3, KVHeads: 1, HeadDim: 37},
		{Batch: 1, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 64},
	}
	for n, s := range shapes {
		t.Run(fmt.Sprintf("B%d_S%d_H%d_KV%d_Dh%d", s.Batch, s.Seq, s.Heads, s.KVHeads, s.HeadDim), func(t *testing.T) {
			checkAttention(newKT(t, uint64(30+n)), s)
		})
	}
}

// checkAttention runs the forward and the backward on one shape and
// compares every output with the CPU backend's.
func checkAttention(k *kt, s backend.AttnShape) {
	T, H, KV, Dh := s.Batch*s.Seq, s.Heads, s.KVHeads, s.HeadDim
	nq, nk, nl := T*H*Dh, T*KV*Dh, s.Batch*H*s.Seq
	// q and k at 1.5 give peaked softmax rows as well as flat ones.
	q, kk, v, dout := k.randn(nq, 1.5), k.randn(nk, 1.5), k.randn(nk, 1), k.randn(nq, 1)
	bq, bk, bv, bdout := upload(k, q), upload(k, kk), upload(k, v), upload(k, dout)
	out, lse := k.poisoned(nq), k.poisoned(nl)
	if err := AttentionForward(k.d, out.Ptr(), lse.Ptr(), bq.Ptr(), bk.Ptr(), bv.Ptr(), s); err != nil {
		k.t.Fatal(err)
	}
	rq, rk, rv := k.cpuF(q, T, H*Dh), k.cpuF(kk, T, KV*Dh), k.cpuF(v, T, KV*Dh)
	rout, rlse := k.ref.New(backend.Float64, T, H*Dh), k.ref.New(backend.Float64, s.Batch, H, s.Seq)
	k.ref.AttentionForward(rout, rlse, rq, rk, rv, s)
	gotOut, gotLse := k.download(out, nq), k.download(lse, nl)
	k.check("out", gotOut, k.get(rout), attnTol)
	k.check("lse", gotLse, k.get(rlse), attnTol)

	// The backward takes the GPU's out and lse; the reference gets the same.
	gq, gk, gv := k.poisoned(nq), k.poisoned(nk), k.poisoned(nk)
	backward := func() {
		k.t.Helper()
		if err := AttentionBackward(k.d, gq.Ptr(), gk.Ptr(), gv.Ptr(), bdout.Ptr(), bq.Ptr(), bk.Ptr(), bv.Ptr(), out.Ptr(), lse.Ptr(), s); err != nil {
			k.t.Fatal(err)
		}
	}
	backward()
	rdq, rdk, rdv := k.ref.New(backend.Float64, T, H*Dh), k.ref.New(backend.Float64, T, KV*Dh), k.ref.New(backend.Float64, T, KV*Dh)
	k.ref.AttentionBackward(rdq, rdk, rdv, k.cpuF(dout, T, H*Dh), rq, rk, rv, k.cpuF(gotOut, T, H*Dh), k.cpuF(gotLse, nl), s)
	gotQ, gotK, gotV := k.download(gq, nq), k.download(gk, nk), k.download(gv, nk)
	k.check("dq", gotQ, k.get(rdq), attnTol)
	k.check("dk", gotK, k.get(rdk), attnTol)
	k.check("dv", gotV, k.get(rdv), attnTol)

	// No atomics: a second run gives the same bits.
	backward()
	if !slices.Equal(gotQ, k.download(gq, nq)) || !slices.Equal(gotK, k.download(gk, nk)) || !slices.Equal(gotV, k.download(gv, nk)) {
		k.t.Error("the backward is not deterministic: a second run gave other bits")
	}
}

// TestAttentionFigures times the kernels at moe-small's shape and logs
// their registers and local memory.
func TestAttentionFigures(t *testing.T) {
	d := testDevice(t)
	for _, dp := range []int{32, 64, 128} {
		for _, name := range []string{"attn_forward_d%d_f32", "attn_backward_dq_d%d_f32", "attn_backward_dkdv_d%d_f32"} {
			kern, err := attnKernel(d, fmt.Sprintf(name, dp))
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
		}
	}

	k := newKT(t, 40)
	s := backend.AttnShape{Batch: 8, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 64}
	T, H, KV, Dh := s.Batch*s.Seq, s.Heads, s.KVHeads, s.HeadDim
	nq, nk, nl := T*H*Dh, T*KV*Dh, s.Batch*H*s.Seq
	q, kk, v, dout := k.randn(nq, 1), k.randn(nk, 1), k.randn(nk, 1), k.randn(nq, 1)
	bq, bk, bv, bdout := upload(k, q), upload(k, kk), upload(k, v), upload(k, dout)
	out, lse := k.poisoned(nq), k.poisoned(nl)
	gq, gk, gv := k.poisoned(nq), k.poisoned(nk), k.poisoned(nk)
	fwd := func() error { return AttentionForward(d, out.Ptr(), lse.Ptr(), bq.Ptr(), bk.Ptr(), bv.Ptr(), s) }
	bwd := func() error {
		return AttentionBackward(d, gq.Ptr(), gk.Ptr(), gv.Ptr(), bdout.Ptr(), bq.Ptr(), bk.Ptr(), bv.Ptr(), out.Ptr(), lse.Ptr(), s)
	}
	flops := 4 * float64(s.Batch*H) * float64(s.Seq) * float64(s.Seq) * float64(Dh) / 2
	fwdMs := attnMedianMs(t, d, fwd)
	bwdMs := attnMedianMs(t, d, bwd)
	figure(t, "attention fwd B8 S2048 H16 KV4 Dh64", fwdMs, "ms")
	figure(t, "attention fwd B8 S2048 H16 KV4 Dh64 rate", flops/fwdMs/1e9, "TFLOP/s")
	figure(t, "attention bwd B8 S2048 H16 KV4 Dh64", bwdMs, "ms")
	figure(t, "attention bwd B8 S2048 H16 KV4 Dh64 rate", 2.5*flops/bwdMs/1e9, "TFLOP/s")

	// A timed kernel must also be right: spot-check rows of out and lse
	// against a direct float64 computation, and every gradient for NaN.
	gotOut, gotLse := k.download(out, nq), k.download(lse, nl)
	group := H / KV
	for _, r := range [][3]int{{0, 0, 0}, {7, 15, s.Seq - 1}, {3, 5, 1000}, {5, 9, 63}, {2, 12, 64}} {
		b, h, i := r[0], r[1], r[2]
		wantOut, wantLse := naiveAttnRow(q, kk, v, s, b, h/group, h, i)
		if e := math.Abs(float64(gotLse[(b*H+h)*s.Seq+i]) - wantLse); e > 1e-4*max(1, math.Abs(wantLse)) {
			t.Errorf("lse[%d,%d,%d] = %v, want %v", b, h, i, gotLse[(b*H+h)*s.Seq+i], wantLse)
		}
		row := gotOut[((b*s.Seq+i)*H+h)*Dh:][:Dh]
		var num, den float64
		for j, w := range wantOut {
			num += (float64(row[j]) - w) * (float64(row[j]) - w)
			den += w * w
		}
		if rel := math.Sqrt(num / den); !(rel < attnTol) {
			t.Errorf("out row (b %d, h %d, i %d): relative error %.3g", b, h, i, rel)
		}
	}
	for name, g := range map[string][]float32{"dq": k.download(gq, nq), "dk": k.download(gk, nk), "dv": k.download(gv, nk)} {
		if i := slices.IndexFunc(g, func(x float32) bool { return math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) }); i >= 0 {
			t.Errorf("%s[%d] = %v", name, i, g[i])
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
