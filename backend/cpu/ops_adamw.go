package cpu

// AdamW with PyTorch's semantics (torch.optim.AdamW, decoupled weight decay):
//
//	p -= lr*wd*p
//	m = b1*m + (1-b1)*g,  v = b2*v + (1-b2)*g^2
//	p -= lr * (m/(1-b1^step)) / (sqrt(v/(1-b2^step)) + eps)
//
// Each element is updated in float64 from the stored (backend-precision)
// values, and the updated moments are rounded before they enter the step, as
// a float32 optimizer state would be.

import (
	"math"

	"github.com/mktrain/mktrain/backend"
)

// AdamWUpdate updates param in place from grad with moments m and v.
func (b *Backend) AdamWUpdate(param, grad, m, v backend.Tensor, h backend.AdamW) {
	const op = "AdamWUpdate"
	b.float(op, "param", param)
	n := param.Len()
	b.vector(op, "grad", grad, n)
	b.vector(op, "m", m, n)
	b.vector(op, "v", v, n)
	if h.Step < 1 {
		fail(op, "step %d must count from 1", h.Step)
	}
	if b.dt == backend.Float32 {
		adamW(b, floats[float32](param), floats[float32](grad), floats[float32](m), floats[float32](v), h)
	} else {
		adamW(b, floats[float64](param), floats[float64](grad), floats[float64](m), floats[float64](v), h)
	}
}

func adamW[T Float](b *Backend, param, grad, m, v []T, h backend.AdamW) {
	b.parallelFor(len(param), elemChunk, func(lo, hi int) {
		adamWSerial(param[lo:hi], grad[lo:hi], m[lo:hi], v[lo:hi], h)
	})
}

// adamWSerial is adamW over one chunk, on the calling goroutine.
func adamWSerial[T Float](p, grad, m, v []T, h backend.AdamW) {
	bc1 := 1 - math.Pow(h.Beta1, float64(h.Step))
	bc2 := 1 - math.Pow(h.Beta2, float64(h.Step))
	decay, gscale := 1-h.LR*h.WeightDecay, h.GradFactor()
	g, mm, vv := grad[:len(p)], m[:len(p)], v[:len(p)]
	for i, pi := range p {
		gi := float64(g[i]) * gscale
		mi := T(h.Beta1*float64(mm[i]) + (1-h.Beta1)*gi)
		vi := T(h.Beta2*float64(vv[i]) + (1-h.Beta2)*gi*gi)
		mm[i], vv[i] = mi, vi
		mhat := float64(mi) / bc1
		vhat := float64(vi) / bc2
		p[i] = T(float64(pi)*decay - h.LR*mhat/(math.Sqrt(vhat)+h.Eps))
	}
}

// AdamWUpdateSplit is AdamWUpdate on split float32 masters
// (backend.SplitMaster): each master is joined from hi and lo, updated as
// adamW updates a float32 one, and split again.
func (b *Backend) AdamWUpdateSplit(hi, lo, grad, m, v backend.Tensor, h backend.AdamW) {
	const op = "AdamWUpdateSplit"
	if b.dt != backend.Float32 {
		fail(op, "split masters are float32, and this backend computes in %v", b.dt)
	}
	if hi == nil || hi.DType() != backend.BFloat16 {
		fail(op, "hi must be a bfloat16 tensor")
	}
	n := hi.Len()
	if n%2 != 0 {
		fail(op, "hi has %d elements; split masters come in pairs", n)
	}
	if lo == nil || lo.DType() != backend.Int32 || lo.Len() != n/2 {
		fail(op, "lo must be an int32 tensor of %d words (the low halves of %d masters)", n/2, n)
	}
	b.vector(op, "grad", grad, n)
	b.vector(op, "m", m, n)
	b.vector(op, "v", v, n)
	if h.Step < 1 {
		fail(op, "step %d must count from 1", h.Step)
	}
	his, los := floats[float32](hi), ints(lo)
	g, mm, vv := floats[float32](grad), floats[float32](m), floats[float32](v)
	// Pairs share a word of lo: a chunk of the workers is whole pairs.
	b.parallelFor(n/2, elemChunk, func(pairLo, pairHi int) {
		lo2, hi2 := 2*pairLo, 2*pairHi
		w := backend.JoinMasters(his[lo2:hi2], los[pairLo:pairHi])
		adamWSerial(w, g[lo2:hi2], mm[lo2:hi2], vv[lo2:hi2], h)
		hs, ls := backend.SplitMasters(w)
		copy(his[lo2:hi2], hs)
		copy(los[pairLo:pairHi], ls)
	})
}
