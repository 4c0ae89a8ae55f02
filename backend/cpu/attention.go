package cpu

// Causal grouped-query attention, flash style: the forward keeps one row of
// scores per worker and saves only the log-sum-exp of each query row; the
// backward recomputes the probabilities from it. Nothing of size Seq x Seq is
// ever held, so the reference has the memory profile of the CUDA kernels.
//
// Layout: query token t = b*Seq + i, key token b*Keys + j (Keys = s.Keys()).
// Query head h reads columns [h*Dh, (h+1)*Dh) of qTQ and uses key/value head
// h/(H/KV) (Hugging Face repeat_kv order: the first H/KV query heads share kv
// head 0). Query i sees keys 0..QOffset+i of its sequence. lseBHS[b, h, i] is
// the log-sum-exp of row i's scaled, masked scores.

import (
	"fmt"
	"math"

	"github.com/mktrain/mktrain/backend"
)

func (b *Backend) AttentionForward(outTQ, lseBHS, qTQ, kTK, vTK backend.Tensor, s backend.AttnShape) {
	checkAttn(s, lseBHS,
		attnArg{"out", outTQ, s.Heads, false}, attnArg{"q", qTQ, s.Heads, false},
		attnArg{"k", kTK, s.KVHeads, true}, attnArg{"v", vTK, s.KVHeads, true})
	if b.dt == backend.Float32 {
		attnForward[float32](b, outTQ, lseBHS, qTQ, kTK, vTK, s)
	} else {
		attnForward[float64](b, outTQ, lseBHS, qTQ, kTK, vTK, s)
	}
	b.roundIfBF16(outTQ) // a bf16 out (beside bf16 q, k and v)
}

func (b *Backend) AttentionBackward(dqTQ, dkTK, dvTK, doutTQ, qTQ, kTK, vTK, outTQ, lseBHS backend.Tensor, s backend.AttnShape) {
	checkAttn(s, lseBHS,
		attnArg{"dq", dqTQ, s.Heads, false}, attnArg{"dk", dkTK, s.KVHeads, true}, attnArg{"dv", dvTK, s.KVHeads, true},
		attnArg{"dout", doutTQ, s.Heads, false}, attnArg{"q", qTQ, s.Heads, false}, attnArg{"k", kTK, s.KVHeads, true},
		attnArg{"v", vTK, s.KVHeads, true}, attnArg{"out", outTQ, s.Heads, false})
	if b.dt == backend.Float32 {
		attnBackward[float32](b, dqTQ, dkTK, dvTK, doutTQ, qTQ, kTK, vTK, outTQ, lseBHS, s)
	} else {
		attnBackward[float64](b, dqTQ, dkTK, dvTK, doutTQ, qTQ, kTK, vTK, outTQ, lseBHS, s)
	}
}

// attnArg is a token-major tensor argument, the number of heads of width
// HeadDim in each of its rows, and whether it has a row per key (Keys per
// sequence) rather than per query (Seq per sequence).
type attnArg struct {
	name  string
	t     backend.Tensor
	heads int
	keys  bool
}

// checkAttn panics unless the shape is well formed and every tensor holds
// exactly what s says it should.
func checkAttn(s backend.AttnShape, lseBHS backend.Tensor, args ...attnArg) {
	if s.Batch < 1 || s.Seq < 1 || s.Heads < 1 || s.KVHeads < 1 || s.HeadDim < 1 || s.Heads%s.KVHeads != 0 {
		panic(fmt.Sprintf("cpu: attention shape %+v: all sizes must be positive and KVHeads must divide Heads", s))
	}
	if s.KVSeq < 0 || s.QOffset < 0 || s.QOffset+s.Seq > s.Keys() {
		panic(fmt.Sprintf("cpu: attention shape %+v: need 0 <= QOffset and QOffset+Seq <= KVSeq", s))
	}
	if s.Full && s.QOffset != 0 {
		panic(fmt.Sprintf("cpu: attention shape %+v: a Full call has no QOffset", s))
	}
	for _, a := range args {
		rows := s.Batch * s.Seq
		if a.keys {
			rows = s.Batch * s.Keys()
		}
		if want := rows * a.heads * s.HeadDim; a.t.Len() != want {
			panic(fmt.Sprintf("cpu: attention %s has %d elements, want %d for %+v", a.name, a.t.Len(), want, s))
		}
	}
	if want := s.Batch * s.Heads * s.Seq; lseBHS.Len() != want {
		panic(fmt.Sprintf("cpu: attention lse has %d elements, want %d for %+v", lseBHS.Len(), want, s))
	}
}

func attnDot[T Float](a, b []T) T {
	var s T
	for i := range a {
		s += a[i] * b[i]
	}
	return s
}

// attnAxpy does y += alpha*x.
func attnAxpy[T Float](y []T, alpha T, x []T) {
	for i := range y {
		y[i] += alpha * x[i]
	}
}

// lastKey is the last key query i sees: QOffset+i, or the last of all with
// Full.
func lastKey(s backend.AttnShape, i int) int {
	if s.Full {
		return s.Keys() - 1
	}
	return s.QOffset + i
}

// attnRow writes oi, one query qi's attention over keys 0..last
// (key(j) and val(j) are key j's rows), with scores as scratch, and
// returns its log-sum-exp: the scaled scores, their softmax in float64
// sums, the weighted values. Every CPU attention forward (attnForward,
// zigzagForward) computes its rows here, so that they round alike.
func attnRow[T Float](oi, qi, scores []T, last int, scale float64, key, val func(j int) []T) T {
	m := math.Inf(-1)
	for j := 0; j <= last; j++ {
		sc := float64(attnDot(qi, key(j))) * scale
		scores[j] = T(sc)
		m = max(m, sc)
	}
	var sum float64
	for j := 0; j <= last; j++ {
		p := math.Exp(float64(scores[j]) - m)
		scores[j] = T(p)
		sum += p
	}
	clear(oi)
	for j := 0; j <= last; j++ {
		attnAxpy(oi, scores[j], val(j))
	}
	inv := T(1 / sum)
	for d := range oi {
		oi[d] *= inv
	}
	return T(m + math.Log(sum))
}

// attnForward runs one (batch, head) pair per work item.
func attnForward[T Float](b *Backend, outTQ, lseBHS, qTQ, kTK, vTK backend.Tensor, s backend.AttnShape) {
	out, lse, q, k, v := floats[T](outTQ), floats[T](lseBHS), floats[T](qTQ), floats[T](kTK), floats[T](vTK)
	S, KS, H, Dh := s.Seq, s.Keys(), s.Heads, s.HeadDim
	group := H / s.KVHeads
	qStride, kStride := H*Dh, s.KVHeads*Dh
	scale := 1 / math.Sqrt(float64(Dh))

	b.parallelFor(s.Batch*H, 1, func(lo, hi int) {
		scores := make([]T, KS) // the one row of scores this worker holds
		for bh := lo; bh < hi; bh++ {
			bi, h := bh/H, bh%H
			qOff, kOff := h*Dh, (h/group)*Dh
			for i := range S {
				ti := bi*S + i
				row := func(t []T, j int) []T {
					tj := bi*KS + j
					return t[tj*kStride+kOff : tj*kStride+kOff+Dh]
				}
				// Keys 0..last; later keys are masked out.
				lse[bh*S+i] = attnRow(out[ti*qStride+qOff:ti*qStride+qOff+Dh], q[ti*qStride+qOff:ti*qStride+qOff+Dh],
					scores, lastKey(s, i), scale, func(j int) []T { return row(k, j) }, func(j int) []T { return row(v, j) })
			}
		}
	})
}

// attnBackward runs one (batch, kv head) pair per work item: every query head
// of the group adds into the same dk/dv rows, so owning the whole group keeps
// the accumulation race-free without per-worker buffers. With
// p = exp(score - lse), dP = dout·vᵀ and D = rowsum(dout*out):
//
//	dS = p * (dP - D),  dq = scale*dS·k,  dk = scale*dSᵀ·q,  dv = pᵀ·dout.
func attnBackward[T Float](b *Backend, dqTQ, dkTK, dvTK, doutTQ, qTQ, kTK, vTK, outTQ, lseBHS backend.Tensor, s backend.AttnShape) {
	dq, dk, dv := floats[T](dqTQ), floats[T](dkTK), floats[T](dvTK)
	dout, q, k, v, out, lse := floats[T](doutTQ), floats[T](qTQ), floats[T](kTK), floats[T](vTK), floats[T](outTQ), floats[T](lseBHS)
	S, KS, H, KV, Dh := s.Seq, s.Keys(), s.Heads, s.KVHeads, s.HeadDim
	group := H / KV
	qStride, kStride := H*Dh, KV*Dh
	scale := 1 / math.Sqrt(float64(Dh))
	tscale := T(scale)

	b.parallelFor(s.Batch*KV, 1, func(lo, hi int) {
		for bg := lo; bg < hi; bg++ {
			bi, g := bg/KV, bg%KV
			kOff := g * Dh
			// Every key row is written: keys no query sees keep 0.
			for j := range KS {
				tj := bi*KS + j
				clear(dk[tj*kStride+kOff : tj*kStride+kOff+Dh])
				clear(dv[tj*kStride+kOff : tj*kStride+kOff+Dh])
			}
			for h := g * group; h < (g+1)*group; h++ {
				qOff := h * Dh
				for i := range S {
					ti := bi*S + i
					row := ti*qStride + qOff
					qi, doi, dqi := q[row:row+Dh], dout[row:row+Dh], dq[row:row+Dh]
					di := attnDot(doi, out[row:row+Dh])
					lseI := float64(lse[(bi*H+h)*S+i])
					clear(dqi)
					for j := 0; j <= lastKey(s, i); j++ {
						col := (bi*KS+j)*kStride + kOff
						kj, vj := k[col:col+Dh], v[col:col+Dh]
						p := T(math.Exp(float64(attnDot(qi, kj))*scale - lseI))
						attnAxpy(dv[col:col+Dh], p, doi)
						ds := p * (attnDot(doi, vj) - di) * tscale
						attnAxpy(dqi, ds, kj)
						attnAxpy(dk[col:col+Dh], ds, qi)
					}
				}
			}
		}
	})
}

func (b *Backend) AttentionMerge(outTQ, lseBHS, partTQ, partLseBHS backend.Tensor, s backend.AttnShape) {
	checkAttn(backend.AttnShape{Batch: s.Batch, Seq: s.Seq, Heads: s.Heads, KVHeads: s.Heads, HeadDim: s.HeadDim}, lseBHS,
		attnArg{"out", outTQ, s.Heads, false}, attnArg{"part", partTQ, s.Heads, false})
	if want := s.Batch * s.Heads * s.Seq; partLseBHS.Len() != want {
		panic(fmt.Sprintf("cpu: attention merge partLse has %d elements, want %d for %+v", partLseBHS.Len(), want, s))
	}
	if b.dt == backend.Float32 {
		attnMerge[float32](b, outTQ, lseBHS, partTQ, partLseBHS, s)
	} else {
		attnMerge[float64](b, outTQ, lseBHS, partTQ, partLseBHS, s)
	}
}

// attnMerge runs one (batch, head) pair per work item, in float64.
func attnMerge[T Float](b *Backend, outTQ, lseBHS, partTQ, partLseBHS backend.Tensor, s backend.AttnShape) {
	out, lse, part, plse := floats[T](outTQ), floats[T](lseBHS), floats[T](partTQ), floats[T](partLseBHS)
	S, H, Dh := s.Seq, s.Heads, s.HeadDim
	b.parallelFor(s.Batch*H, 1, func(lo, hi int) {
		for bh := lo; bh < hi; bh++ {
			bi, h := bh/H, bh%H
			for i := range S {
				l, lp := float64(lse[bh*S+i]), float64(plse[bh*S+i])
				row := (bi*S+i)*H*Dh + h*Dh
				o, p := out[row:row+Dh], part[row:row+Dh]
				m := max(l, lp)
				if math.IsInf(m, -1) {
					clear(o)
					continue
				}
				wo, wp := math.Exp(l-m), math.Exp(lp-m)
				sum := wo + wp
				wo, wp = wo/sum, wp/sum
				for d := range o {
					o[d] = T(wo*float64(o[d]) + wp*float64(p[d]))
				}
				lse[bh*S+i] = T(m + math.Log(sum))
			}
		}
	})
}
