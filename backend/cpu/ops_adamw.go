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
	bc1 := 1 - math.Pow(h.Beta1, float64(h.Step))
	bc2 := 1 - math.Pow(h.Beta2, float64(h.Step))
	decay, gscale := 1-h.LR*h.WeightDecay, h.GradFactor()
	b.parallelFor(len(param), elemChunk, func(lo, hi int) {
		p := param[lo:hi]
		g := grad[lo:hi][:len(p)]
		mm := m[lo:hi][:len(p)]
		vv := v[lo:hi][:len(p)]
		for i, pi := range p {
			gi := float64(g[i]) * gscale
			mi := T(h.Beta1*float64(mm[i]) + (1-h.Beta1)*gi)
			vi := T(h.Beta2*float64(vv[i]) + (1-h.Beta2)*gi*gi)
			mm[i], vv[i] = mi, vi
			mhat := float64(mi) / bc1
			vhat := float64(vi) / bc2
			p[i] = T(float64(pi)*decay - h.LR*mhat/(math.Sqrt(vhat)+h.Eps))
		}
	})
}
