package backendtest

// Conformance cases of the zigzag context-parallel attention ops (the
// fused ring): the two-pass ZigzagAttentionForward,
// ZigzagAttentionBackwardDQ and ZigzagAttentionBackwardDKDV, and the
// one-pass ZigzagAttentionForward on bf16 q, k, v, ZigzagAttentionPrepare
// and ZigzagAttentionBackward. Compare runs every rank's ops, in the
// order a context-parallel layer does (every forward, then every dq or
// delta, then every dk/dv or backward), on the backend and the oracle.
// Check holds both sets, in float64, to their unfused definition: plain
// causal attention over the whole sequence (AttentionForward and
// AttentionBackward on the natural order), whose rows the ranks' outputs
// must be.

import (
	"fmt"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// zigzagCompareShapes have chunks of whole 64-row tiles (what the CUDA
// kernels take), both head dims of the tensor-core kernels, GQA and plain
// multi-head, and an odd number of ranks.
var zigzagCompareShapes = []backend.ZigzagShape{
	{Ranks: 2, Batch: 2, Chunk: 64, Heads: 4, KVHeads: 2, HeadDim: 64},
	{Ranks: 4, Batch: 1, Chunk: 64, Heads: 4, KVHeads: 1, HeadDim: 128},
	{Ranks: 3, Batch: 1, Chunk: 128, Heads: 2, KVHeads: 2, HeadDim: 64},
}

// zigzagCheckShapes are small: one rank (the plain attention), two and
// three ranks, chunks of one and of several positions.
var zigzagCheckShapes = []backend.ZigzagShape{
	{Ranks: 1, Batch: 2, Chunk: 3, Heads: 2, KVHeads: 1, HeadDim: 4},
	{Ranks: 2, Batch: 2, Chunk: 3, Heads: 4, KVHeads: 2, HeadDim: 4},
	{Ranks: 3, Batch: 1, Chunk: 2, Heads: 3, KVHeads: 1, HeadDim: 5},
	{Ranks: 2, Batch: 1, Chunk: 1, Heads: 2, KVHeads: 2, HeadDim: 3},
}

func zigzagCases() []Case {
	var cs []Case
	for _, s := range zigzagCheckShapes {
		cs = append(cs, Case{Name: zigzagName(s), Compare: zigzagCompare(s), Check: zigzagCheck(s)})
	}
	for _, s := range zigzagCompareShapes {
		cs = append(cs, Case{Name: zigzagName(s), Compare: zigzagCompare(s)})
	}
	for _, s := range zigzagOnePassShapes {
		cs = append(cs, Case{Name: zigzagName(s) + "/one-pass", Compare: zigzagOnePassCompare(s)})
	}
	return cs
}

// zigzagOnePassShapes are the one-pass ops' (chunks of whole 128-row
// tiles): both head dims, GQA groups of 1 to 4, one and several tiles a
// chunk, several sequences, W 2 to 8 and an odd W.
var zigzagOnePassShapes = []backend.ZigzagShape{
	{Ranks: 2, Batch: 2, Chunk: 128, Heads: 8, KVHeads: 2, HeadDim: 64},
	{Ranks: 2, Batch: 1, Chunk: 128, Heads: 4, KVHeads: 1, HeadDim: 128},
	{Ranks: 3, Batch: 1, Chunk: 256, Heads: 2, KVHeads: 2, HeadDim: 128},
	{Ranks: 8, Batch: 1, Chunk: 128, Heads: 2, KVHeads: 1, HeadDim: 64},
}

// zigzagOnePassCompare runs the one-pass ops of every rank on both
// backends in the order a context-parallel layer does: every forward
// (bf16 q, k, v), then every delta, then every backward into dq zeroed
// beforehand (each rank adds its keys' share to every rank's dq). A
// backend whose ZigzagAttentionOnePass refuses the shape skips it with a
// line, but for the CPU, which refuses every shape so that its layers
// keep the two-pass ops' bits, and runs the one-pass ops all the same.
func zigzagOnePassCompare(s backend.ZigzagShape) func(e *Env) {
	return func(e *Env) {
		if err := e.B.ZigzagAttentionOnePass(s); err != nil && e.B.Name() != "cpu" {
			e.T.Skipf("%s does not take %+v in one pass: %v", e.B.Name(), s, err)
		}
		W, rows := s.Ranks, s.Batch*2*s.Chunk
		Q, K := s.Heads*s.HeadDim, s.KVHeads*s.HeadDim
		var q, k, v, dout, doutBF16, out, lse, dq, delta, dk, dv []*Pair
		for r := range W {
			n := func(x string) string { return fmt.Sprintf("%s%d", x, r) }
			q = append(q, e.BF16Uniform(n("q"), -2, 2, rows, Q))
			k = append(k, e.BF16Uniform(n("k"), -2, 2, rows, K))
			v = append(v, e.BF16Uniform(n("v"), -1, 1, rows, K))
			dout = append(dout, e.Uniform(n("dout"), -1, 1, rows, Q))
			// ZigzagAttentionPrepare rounds dout for the backward's
			// products and zeroes dq, which starts as NaN.
			doutBF16 = append(doutBF16, e.OutBF16(n("dout-bf16"), rows, Q))
			out = append(out, e.Out(n("out"), rows, Q))
			lse = append(lse, e.Out(n("lse"), s.Batch, 2, s.Heads, s.Chunk))
			dq = append(dq, e.Out(n("dq"), rows, Q))
			delta = append(delta, e.Out(n("delta"), s.Batch, 2, s.Heads, s.Chunk))
			dk = append(dk, e.Out(n("dk"), rows, K))
			dv = append(dv, e.Out(n("dv"), rows, K))
		}
		e.NormWise = true
		e.Run(func(b backend.Backend, x Pick) {
			rank := func(r int) backend.ZigzagShape { sr := s; sr.Rank = r; return sr }
			for r := range W {
				b.ZigzagAttentionForward(x(out[r]), x(lse[r]), x(q[r]), x.All(k), x.All(v), rank(r))
			}
			for r := range W {
				b.ZigzagAttentionPrepare(x(delta[r]), x(doutBF16[r]), x(dq[r]), x(dout[r]), x(out[r]), rank(r))
			}
			for r := range W {
				b.ZigzagAttentionBackward(x.All(dq), x(dk[r]), x(dv[r]), x(k[r]), x(v[r]), x.All(q), x.All(doutBF16), x.All(lse), x.All(delta), rank(r))
			}
		})
	}
}

func zigzagName(s backend.ZigzagShape) string {
	return fmt.Sprintf("ZigzagAttention/W%d_B%d_C%d_H%d_KV%d_Dh%d", s.Ranks, s.Batch, s.Chunk, s.Heads, s.KVHeads, s.HeadDim)
}

// zigzagCompare runs the three ops of every rank on both backends, the
// backward on the forward's own out and lse. A backend that does not take
// the shape (ZigzagAttentionSupports) skips it with a line.
func zigzagCompare(s backend.ZigzagShape) func(e *Env) {
	return func(e *Env) {
		if err := e.B.ZigzagAttentionSupports(s); err != nil {
			e.T.Skipf("%s does not take %+v: %v", e.B.Name(), s, err)
		}
		W, rows := s.Ranks, s.Batch*2*s.Chunk
		Q, K := s.Heads*s.HeadDim, s.KVHeads*s.HeadDim
		var q, k, v, dout, out, lse, dq, delta, dk, dv []*Pair
		for r := range W {
			n := func(x string) string { return fmt.Sprintf("%s%d", x, r) }
			// As attnCompare: scaled scores of standard deviation about 1.3.
			q = append(q, e.Uniform(n("q"), -2, 2, rows, Q))
			k = append(k, e.Uniform(n("k"), -2, 2, rows, K))
			v = append(v, e.Rand(n("v"), rows, K))
			dout = append(dout, e.Rand(n("dout"), rows, Q))
			out = append(out, e.Out(n("out"), rows, Q))
			lse = append(lse, e.Out(n("lse"), s.Batch, 2, s.Heads, s.Chunk))
			dq = append(dq, e.Out(n("dq"), rows, Q))
			delta = append(delta, e.Out(n("delta"), s.Batch, 2, s.Heads, s.Chunk))
			dk = append(dk, e.Out(n("dk"), rows, K))
			dv = append(dv, e.Out(n("dv"), rows, K))
		}
		e.NormWise = true
		e.Run(func(b backend.Backend, x Pick) {
			for r := range W {
				sr := s
				sr.Rank = r
				b.ZigzagAttentionForward(x(out[r]), x(lse[r]), x(q[r]), x.All(k), x.All(v), sr)
			}
			for r := range W {
				sr := s
				sr.Rank = r
				b.ZigzagAttentionBackwardDQ(x(dq[r]), x(delta[r]), x(dout[r]), x(q[r]), x(out[r]), x(lse[r]), x.All(k), x.All(v), sr)
			}
			for r := range W {
				sr := s
				sr.Rank = r
				b.ZigzagAttentionBackwardDKDV(x(dk[r]), x(dv[r]), x(k[r]), x(v[r]), x.All(q), x.All(dout), x.All(lse), x.All(delta), sr)
			}
		})
	}
}

// zigzagCheck draws a whole sequence, runs plain attention over it on b64
// (forward, and backward from a random dout), deals the rows out to the
// ranks in zigzag order, runs the zigzag ops and compares every rank's
// out, lse, dq, dk, dv and delta with the whole sequence's rows.
func zigzagCheck(s backend.ZigzagShape) func(t *testing.T, b64 backend.Backend) {
	return func(t *testing.T, b64 backend.Backend) {
		rng := NewRand(zigzagName(s) + "/check")
		W, C, S, B := s.Ranks, s.Chunk, s.Seq(), s.Batch
		Q, K := s.Heads*s.HeadDim, s.KVHeads*s.HeadDim
		whole := backend.AttnShape{Batch: B, Seq: S, Heads: s.Heads, KVHeads: s.KVHeads, HeadDim: s.HeadDim}
		host := map[string][]float64{
			"q": RandFloats(rng, B*S*Q, -2, 2), "k": RandFloats(rng, B*S*K, -2, 2),
			"v": RandFloats(rng, B*S*K, -1, 1), "dout": RandFloats(rng, B*S*Q, -1, 1),
		}
		up := func(name string, width int) backend.Tensor { return Upload(b64, host[name], B*S, width) }
		q, k, v, dout := up("q", Q), up("k", K), up("v", K), up("dout", Q)
		out, lse := b64.New(backend.Float64, B*S, Q), b64.New(backend.Float64, B, s.Heads, S)
		dq, dk, dv := b64.New(backend.Float64, B*S, Q), b64.New(backend.Float64, B*S, K), b64.New(backend.Float64, B*S, K)
		b64.AttentionForward(out, lse, q, k, v, whole)
		b64.AttentionBackward(dq, dk, dv, dout, q, k, v, out, lse, whole)
		want := map[string][]float64{
			"out": Download(b64, out), "lse": Download(b64, lse), "dq": Download(b64, dq),
			"dk": Download(b64, dk), "dv": Download(b64, dv),
		}
		// delta_i = dout_i . out_i, per (sequence, head, position).
		want["delta"] = make([]float64, B*s.Heads*S)
		for bi := range B {
			for h := range s.Heads {
				for p := range S {
					row := (bi*S+p)*Q + h*s.HeadDim
					var d float64
					for x := range s.HeadDim {
						d += host["dout"][row+x] * want["out"][row+x]
					}
					want["delta"][(bi*s.Heads+h)*S+p] = d
				}
			}
		}

		// local deals the rows of a [B*S, width] tensor, or the positions
		// of a [B, H, S] one (width 0), to rank r's zigzag layout.
		local := func(x []float64, width, r int) []float64 {
			var o []float64
			if width == 0 {
				for bi := range B {
					for n := range 2 {
						c := s.LocalChunk(r, n)
						for h := range s.Heads {
							base := (bi*s.Heads+h)*S + c*C
							o = append(o, x[base:base+C]...)
						}
					}
				}
				return o
			}
			for bi := range B {
				for n := range 2 {
					c := s.LocalChunk(r, n)
					o = append(o, x[(bi*S+c*C)*width:(bi*S+c*C+C)*width]...)
				}
			}
			return o
		}
		put := func(name string, width, r int) backend.Tensor {
			return Upload(b64, local(host[name], width, r), B*2*C, width)
		}
		var lq, lk, lv, ldout, lout, llse, ldelta []backend.Tensor
		for r := range W {
			lq, lk, lv, ldout = append(lq, put("q", Q, r)), append(lk, put("k", K, r)), append(lv, put("v", K, r)), append(ldout, put("dout", Q, r))
			lout = append(lout, Upload(b64, attnNaNs(B*2*C*Q), B*2*C, Q))
			llse = append(llse, Upload(b64, attnNaNs(B*2*C*s.Heads), B, 2, s.Heads, C))
			ldelta = append(ldelta, Upload(b64, attnNaNs(B*2*C*s.Heads), B, 2, s.Heads, C))
		}
		for r := range W {
			sr := s
			sr.Rank = r
			b64.ZigzagAttentionForward(lout[r], llse[r], lq[r], lk, lv, sr)
			CompareFloats(t, fmt.Sprintf("rank %d out", r), Download(b64, lout[r]), local(want["out"], Q, r), 1e-12)
			CompareFloats(t, fmt.Sprintf("rank %d lse", r), Download(b64, llse[r]), local(want["lse"], 0, r), 1e-12)
		}
		for r := range W {
			sr := s
			sr.Rank = r
			ldq := Upload(b64, attnNaNs(B*2*C*Q), B*2*C, Q)
			b64.ZigzagAttentionBackwardDQ(ldq, ldelta[r], ldout[r], lq[r], lout[r], llse[r], lk, lv, sr)
			CompareFloats(t, fmt.Sprintf("rank %d dq", r), Download(b64, ldq), local(want["dq"], Q, r), 1e-12)
			CompareFloats(t, fmt.Sprintf("rank %d delta", r), Download(b64, ldelta[r]), local(want["delta"], 0, r), 1e-12)
		}
		for r := range W {
			sr := s
			sr.Rank = r
			ldk, ldv := Upload(b64, attnNaNs(B*2*C*K), B*2*C, K), Upload(b64, attnNaNs(B*2*C*K), B*2*C, K)
			b64.ZigzagAttentionBackwardDKDV(ldk, ldv, lk[r], lv[r], lq, ldout, llse, ldelta, sr)
			CompareFloats(t, fmt.Sprintf("rank %d dk", r), Download(b64, ldk), local(want["dk"], K, r), 1e-12)
			CompareFloats(t, fmt.Sprintf("rank %d dv", r), Download(b64, ldv), local(want["dv"], K, r), 1e-12)
		}

		// The one-pass ops: every rank's preparation (delta, dout rounded,
		// dq zeroed from NaN), then every rank's backward, which writes its
		// dk, dv and adds its keys' share to every rank's dq. The backward
		// here reads the float dout, so that it meets the float64
		// definition; the rounding is checked on its own.
		ldqs := make([]backend.Tensor, W)
		for r := range W {
			sr := s
			sr.Rank = r
			ldelta[r] = Upload(b64, attnNaNs(B*2*C*s.Heads), B, 2, s.Heads, C)
			ldqs[r] = Upload(b64, attnNaNs(B*2*C*Q), B*2*C, Q)
			lround := UploadBF16(b64, attnNaNs(B*2*C*Q), B*2*C, Q)
			b64.ZigzagAttentionPrepare(ldelta[r], lround, ldqs[r], ldout[r], lout[r], sr)
			CompareFloats(t, fmt.Sprintf("one pass: rank %d delta", r), Download(b64, ldelta[r]), local(want["delta"], 0, r), 1e-12)
			CompareFloats(t, fmt.Sprintf("one pass: rank %d dout rounded", r), Download(b64, lround),
				RoundTo(backend.BFloat16, Download(b64, ldout[r])), 0)
			CompareFloats(t, fmt.Sprintf("one pass: rank %d dq zeroed", r), Download(b64, ldqs[r]), make([]float64, B*2*C*Q), 0)
		}
		for r := range W {
			sr := s
			sr.Rank = r
			ldk, ldv := Upload(b64, attnNaNs(B*2*C*K), B*2*C, K), Upload(b64, attnNaNs(B*2*C*K), B*2*C, K)
			b64.ZigzagAttentionBackward(ldqs, ldk, ldv, lk[r], lv[r], lq, ldout, llse, ldelta, sr)
			CompareFloats(t, fmt.Sprintf("one pass: rank %d dk", r), Download(b64, ldk), local(want["dk"], K, r), 1e-12)
			CompareFloats(t, fmt.Sprintf("one pass: rank %d dv", r), Download(b64, ldv), local(want["dv"], K, r), 1e-12)
		}
		for r := range W {
			CompareFloats(t, fmt.Sprintf("one pass: rank %d dq", r), Download(b64, ldqs[r]), local(want["dq"], Q, r), 1e-12)
		}
	}
}
