package backendtest

import (
	"fmt"
	"math"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// attnCompareShapes are compared against the oracle, as are the
// attnCheckShapes of more than one position: realistic head dims and more
// positions than one tile.
var attnCompareShapes = []backend.AttnShape{
	{Batch: 2, Seq: 33, Heads: 8, KVHeads: 2, HeadDim: 16},
	{Batch: 1, Seq: 64, Heads: 4, KVHeads: 1, HeadDim: 128},
	{Batch: 2, Seq: 17, Heads: 4, KVHeads: 4, HeadDim: 64},
	// A context-parallel rank's call: the queries are positions 70..99 of
	// 133 keys, so both the first and the last key tile are partly masked
	// and a tail of keys is seen by no query.
	{Batch: 2, Seq: 30, Heads: 4, KVHeads: 2, HeadDim: 64, KVSeq: 133, QOffset: 70},
	// A context-parallel ring's off-diagonal blocks: every query sees
	// every key (Full), as many keys as queries and twice as many.
	{Batch: 1, Seq: 70, Heads: 4, KVHeads: 2, HeadDim: 64, Full: true},
	{Batch: 2, Seq: 33, Heads: 4, KVHeads: 1, HeadDim: 128, KVSeq: 66, Full: true},
	{Batch: 1, Seq: 40, Heads: 2, KVHeads: 2, HeadDim: 24, KVSeq: 80, Full: true},
}

// attnCheckShapes are small enough for a finite-difference check of every
// input coordinate: GQA groups of 2 and 3, plain multi-head (H == KV),
// multi-query (KV = 1), a single position, and an odd head dim.
var attnCheckShapes = []backend.AttnShape{
	{Batch: 2, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 4},
	{Batch: 2, Seq: 5, Heads: 4, KVHeads: 4, HeadDim: 4},
	{Batch: 1, Seq: 6, Heads: 3, KVHeads: 1, HeadDim: 2},
	{Batch: 1, Seq: 7, Heads: 6, KVHeads: 2, HeadDim: 5},
	// More keys than queries: queries at key positions 4..8 of 9, and
	// queries at 0..4 of 9, where keys 5..8 are seen by no query (their
	// dk and dv must be 0).
	{Batch: 2, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 4, KVSeq: 9, QOffset: 4},
	{Batch: 2, Seq: 5, Heads: 2, KVHeads: 1, HeadDim: 3, KVSeq: 9},
	{Batch: 1, Seq: 3, Heads: 2, KVHeads: 2, HeadDim: 4, KVSeq: 8, QOffset: 2},
	// Unmasked (Full): every query sees every key, with as many keys as
	// queries and with more.
	{Batch: 2, Seq: 4, Heads: 4, KVHeads: 2, HeadDim: 4, Full: true},
	{Batch: 1, Seq: 3, Heads: 3, KVHeads: 1, HeadDim: 3, KVSeq: 7, Full: true},
	// One position: p = 1, so dq = dk = 0 exactly. Only checked here: a
	// float32 backend's rounding residue, compared with the oracle's exact
	// zeros, has no scale to be measured against.
	{Batch: 3, Seq: 1, Heads: 2, KVHeads: 1, HeadDim: 3},
}

// attentionCases lists the conformance and gradient cases of
// AttentionForward and AttentionBackward.
func attentionCases() []Case {
	var cs []Case
	for _, s := range attnCheckShapes {
		c := Case{Name: attnName(s), Compare: attnCompare(s, attnTypes{}), Check: attnCheck(s)}
		if s.Seq == 1 {
			c.Compare = nil
		}
		cs = append(cs, c)
	}
	for _, s := range attnCompareShapes {
		cs = append(cs, Case{Name: attnName(s), Compare: attnCompare(s, attnTypes{})})
		if s.HeadDim%8 == 0 {
			cs = append(cs, Case{Name: attnName(s) + "/bf16-qkv", Compare: attnCompare(s, attnTypes{qkv: true})},
				Case{Name: attnName(s) + "/bf16-qkv-dout", Compare: attnCompare(s, attnTypes{qkv: true, dout: true})},
				Case{Name: attnName(s) + "/bf16-out/forward", Compare: attnCompare(s, attnTypes{qkv: true, out: true})},
				Case{Name: attnName(s) + "/bf16-out/backward", Compare: attnBackwardBF16Out(s)})
		}
	}
	for _, s := range attnMergeShapes {
		cs = append(cs, Case{Name: fmt.Sprintf("AttentionMerge/B%d_S%d_H%d_Dh%d", s.Batch, s.Seq, s.Heads, s.HeadDim), Compare: attnMergeCompare(s)})
	}
	return cs
}

// attnMergeShapes are AttentionMerge's cases: a wide head dim over more
// than one warp's worth of lanes, and an odd one.
var attnMergeShapes = []backend.AttnShape{
	{Batch: 2, Seq: 33, Heads: 4, KVHeads: 4, HeadDim: 64},
	{Batch: 1, Seq: 7, Heads: 3, KVHeads: 3, HeadDim: 37},
}

// attnMergeCompare merges a random partial attention into a random
// running one. The lse values spread over [-4, 4] (weights from 1 to
// e^8), and a few rows of each side are -inf (no keys yet, or none in the
// part): the merge must then keep the other side exactly. Rows where both
// are -inf stay -inf, which the comparison cannot take; backend/cpu's
// tests check them.
func attnMergeCompare(s backend.AttnShape) func(e *Env) {
	return func(e *Env) {
		T, Q, L := s.Batch*s.Seq, s.Heads*s.HeadDim, s.Batch*s.Heads*s.Seq
		lse, plse := RandFloats(e.Rng, L, -4, 4), RandFloats(e.Rng, L, -4, 4)
		for i := 0; i < L; i += 5 {
			lse[i] = math.Inf(-1)
		}
		for i := 2; i < L; i += 7 {
			if !math.IsInf(lse[i], -1) {
				plse[i] = math.Inf(-1)
			}
		}
		out, part := e.InOut(e.Rand("out", T, Q)), e.Rand("part", T, Q)
		// The -inf values are uploaded inside the run: the suite's checks
		// of inputs take only finite values. The part's lse is not
		// checked (the op reads it only); the merged lse is finite.
		lseT := e.InOut(e.Out("lse", s.Batch, s.Heads, s.Seq))
		lse, plse = RoundTo(e.grid(), lse), RoundTo(e.grid(), plse)
		e.Run(func(b backend.Backend, x Pick) {
			backend.UploadSlice(b, x(lseT), lse)
			plseT := b.New(b.FloatType(), s.Batch, s.Heads, s.Seq)
			backend.UploadSlice(b, plseT, plse)
			b.AttentionMerge(x(out), x(lseT), x(part), plseT, s)
		})
	}
}

func attnName(s backend.AttnShape) string {
	name := fmt.Sprintf("Attention/B%d_S%d_H%d_KV%d_Dh%d", s.Batch, s.Seq, s.Heads, s.KVHeads, s.HeadDim)
	if s.KVSeq != 0 || s.QOffset != 0 {
		name += fmt.Sprintf("_KVS%d_Off%d", s.Keys(), s.QOffset)
	}
	if s.Full {
		name += "_Full"
	}
	return name
}

// attnTypes says which of attention's tensors a case keeps in bf16 (the
// attention layer's on a GPU): q, k and v, and beside them dout and out.
// With out, the case runs the forward alone: each backend rounds its own
// out, which may then differ by a bf16 step, too much to chain into the
// backward (attnBackwardBF16Out tests that apart).
type attnTypes struct{ qkv, dout, out bool }

// attnBackwardBF16Out runs the backward with bf16 q, k, v, dout and out on
// both backends, out and lse being the oracle's forward's (out rounded to
// bf16) given to both as inputs.
func attnBackwardBF16Out(s backend.AttnShape) func(e *Env) {
	return func(e *Env) {
		T, TK, Q, K := s.Batch*s.Seq, s.Batch*s.Keys(), s.Heads*s.HeadDim, s.KVHeads*s.HeadDim
		q, k := e.BF16Uniform("q", -2, 2, T, Q), e.BF16Uniform("k", -2, 2, TK, K)
		v, dout := e.BF16Uniform("v", -1, 1, TK, K), e.BF16Uniform("dout", -1, 1, T, Q)
		ft := e.Oracle.FloatType()
		oOut, oLse := e.Oracle.New(ft, T, Q), e.Oracle.New(ft, s.Batch, s.Heads, s.Seq)
		e.Oracle.AttentionForward(oOut, oLse, q.o, k.o, v.o, s)
		out := e.BF16Floats("out", Download(e.Oracle, oOut), T, Q)
		lse := e.Floats("lse", Download(e.Oracle, oLse), s.Batch, s.Heads, s.Seq)
		dq, dk, dv := e.Out("dq", T, Q), e.Out("dk", TK, K), e.Out("dv", TK, K)
		e.NormWise = true
		e.Run(func(b backend.Backend, x Pick) {
			b.AttentionBackward(x(dq), x(dk), x(dv), x(dout), x(q), x(k), x(v), x(out), x(lse), s)
		})
	}
}

// attnCompare runs the forward and then the backward on the forward's own
// out and lse, on both backends, with the tensors ty names in BFloat16
// (the operand type); lse and the gradients are float.
func attnCompare(s backend.AttnShape, ty attnTypes) func(e *Env) {
	return func(e *Env) {
		T, TK, Q, K := s.Batch*s.Seq, s.Batch*s.Keys(), s.Heads*s.HeadDim, s.KVHeads*s.HeadDim
		// q and k in [-2, 2) give scaled scores of standard deviation about
		// 1.3 at every head dim: softmax rows that are neither flat nor
		// one-hot.
		q, k := e.typed(ty.qkv, "q", -2, 2, T, Q), e.typed(ty.qkv, "k", -2, 2, TK, K)
		v, dout := e.typed(ty.qkv, "v", -1, 1, TK, K), e.typed(ty.dout, "dout", -1, 1, T, Q)
		out, lse := e.typedOut(ty.out, "out", T, Q), e.Out("lse", s.Batch, s.Heads, s.Seq)
		var dq, dk, dv *Pair
		if !ty.out {
			dq, dk, dv = e.Out("dq", T, Q), e.Out("dk", TK, K), e.Out("dv", TK, K)
		}
		// Every output element is a reduction over Seq rounded products.
		e.NormWise = true
		e.Run(func(b backend.Backend, x Pick) {
			b.AttentionForward(x(out), x(lse), x(q), x(k), x(v), s)
			if !ty.out {
				b.AttentionBackward(x(dq), x(dk), x(dv), x(dout), x(q), x(k), x(v), x(out), x(lse), s)
			}
		})
	}
}

// attnCheck compares the forward with naiveAttention and every coordinate of
// dq, dk and dv with central differences of L = sum(out * dout).
func attnCheck(s backend.AttnShape) func(t *testing.T, b64 backend.Backend) {
	return func(t *testing.T, b64 backend.Backend) {
		rng := NewRand(attnName(s) + "/check")
		T, TK, Q, K := s.Batch*s.Seq, s.Batch*s.Keys(), s.Heads*s.HeadDim, s.KVHeads*s.HeadDim
		host := map[string][]float64{
			"q": RandFloats(rng, T*Q, -2, 2),
			"k": RandFloats(rng, TK*K, -2, 2),
			"v": RandFloats(rng, TK*K, -1, 1),
		}
		dout := RandFloats(rng, T*Q, -1, 1)
		q, k, v := Upload(b64, host["q"], T, Q), Upload(b64, host["k"], TK, K), Upload(b64, host["v"], TK, K)
		dev := map[string]backend.Tensor{"q": q, "k": k, "v": v}
		out, lse := b64.New(backend.Float64, T, Q), b64.New(backend.Float64, s.Batch, s.Heads, s.Seq)

		b64.AttentionForward(out, lse, q, k, v, s)
		wantOut, wantLSE := naiveAttention(s, host["q"], host["k"], host["v"])
		CompareFloats(t, "out against naive attention", Download(b64, out), wantOut, 1e-12)
		CompareFloats(t, "lse against naive attention", Download(b64, lse), wantLSE, 1e-12)

		// Gradients start as NaN: the backward must overwrite them.
		grads := map[string]backend.Tensor{
			"q": Upload(b64, attnNaNs(T*Q), T, Q), "k": Upload(b64, attnNaNs(TK*K), TK, K), "v": Upload(b64, attnNaNs(TK*K), TK, K),
		}
		b64.AttentionBackward(grads["q"], grads["k"], grads["v"], Upload(b64, dout, T, Q), q, k, v, out, lse, s)

		for _, name := range []string{"q", "k", "v"} {
			x := host[name]
			loss := func() float64 {
				Set(b64, dev[name], x)
				b64.AttentionForward(out, lse, q, k, v, s)
				return Dot(Download(b64, out), dout)
			}
			CheckGrad(t, "d"+name, loss, x, Download(b64, grads[name]), 1e-6)
			Set(b64, dev[name], x)
		}
	}
}

func attnNaNs(n int) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = math.NaN()
	}
	return out
}

// naiveAttention is the textbook computation in float64: repeat_kv (query
// head h reads kv head h/(H/KV)), the full S x Keys score matrix with a
// -Inf causal mask (key j hidden from query i when j > QOffset+i; none
// with Full), softmax,
// times V. It returns out [T, H*Dh] and lse [B, H, S].
func naiveAttention(s backend.AttnShape, q, k, v []float64) (outTQ, lseBHS []float64) {
	B, S, KS, H, KV, Dh := s.Batch, s.Seq, s.Keys(), s.Heads, s.KVHeads, s.HeadDim
	kRep, vRep := make([]float64, B*KS*H*Dh), make([]float64, B*KS*H*Dh)
	for t := range B * KS {
		for h := range H {
			src := (t*KV + h/(H/KV)) * Dh
			copy(kRep[(t*H+h)*Dh:(t*H+h+1)*Dh], k[src:src+Dh])
			copy(vRep[(t*H+h)*Dh:(t*H+h+1)*Dh], v[src:src+Dh])
		}
	}
	outTQ, lseBHS = make([]float64, B*S*H*Dh), make([]float64, B*H*S)
	scores := make([]float64, S*KS)
	for b := range B {
		for h := range H {
			for i := range S {
				for j := range KS {
					scores[i*KS+j] = math.Inf(-1)
					if s.Full || j <= s.QOffset+i {
						qi, kj := ((b*S+i)*H+h)*Dh, ((b*KS+j)*H+h)*Dh
						scores[i*KS+j] = Dot(q[qi:qi+Dh], kRep[kj:kj+Dh]) / math.Sqrt(float64(Dh))
					}
				}
			}
			for i := range S {
				var z float64
				for j := range KS {
					z += math.Exp(scores[i*KS+j])
				}
				lseBHS[(b*H+h)*S+i] = math.Log(z)
				oi := ((b*S+i)*H + h) * Dh
				for j := range KS {
					p := math.Exp(scores[i*KS+j]) / z
					vj := ((b*KS+j)*H + h) * Dh
					for d := range Dh {
						outTQ[oi+d] += p * vRep[vj+d]
					}
				}
			}
		}
	}
	return outTQ, lseBHS
}
