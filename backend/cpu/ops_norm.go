package cpu

// RMSNorm as Hugging Face's MixtralRMSNorm computes it:
//
//	rstd = 1 / sqrt(mean(x^2) + eps),  out = w * (x * rstd)
//
// The mean of squares is accumulated in float64. The backward, with g = dout:
//
//	dx_i = beta dx_i + rstd * (w_i g_i - x_i rstd^2 mean_j(w_j g_j x_j))
//	dw_i += sum over rows of g_i x_i rstd

import (
	"math"

	"github.com/mktrain/mktrain/backend"
)

// RMSNormForward writes outTD = wD * xTD * rstdT and saves rstdT, and
// copies x into copyTD when it is not nil. out may be BFloat16 (rounded).
func (b *Backend) RMSNormForward(outTD, rstdT, copyTD, xTD, wD backend.Tensor, eps float64) {
	const op = "RMSNormForward"
	t, d := b.matrix(op, "x", xTD)
	b.wantOperandMatrix(op, "out", outTD, t, d)
	if copyTD != nil {
		b.wantMatrix(op, "copy", copyTD, t, d)
		b.Copy(copyTD, xTD)
	}
	b.vector(op, "rstd", rstdT, t)
	b.vector(op, "w", wD, d)
	if b.dt == backend.Float32 {
		rmsNormForward(b, floats[float32](outTD), floats[float32](rstdT), floats[float32](xTD), floats[float32](wD), d, eps)
	} else {
		rmsNormForward(b, floats[float64](outTD), floats[float64](rstdT), floats[float64](xTD), floats[float64](wD), d, eps)
	}
	b.roundIfBF16(outTD)
}

// RMSNormBackward writes dxTD = beta*dxTD + the gradient of x (dx not
// read when beta is 0) and accumulates into dwD.
func (b *Backend) RMSNormBackward(dxTD, dwD, doutTD, xTD, wD, rstdT backend.Tensor, beta float64) {
	const op = "RMSNormBackward"
	t, d := b.matrix(op, "x", xTD)
	b.wantMatrix(op, "dx", dxTD, t, d)
	b.wantMatrix(op, "dout", doutTD, t, d)
	b.vector(op, "dw", dwD, d)
	b.vector(op, "w", wD, d)
	b.vector(op, "rstd", rstdT, t)
	if b.dt == backend.Float32 {
		rmsNormBackward(b, floats[float32](dxTD), floats[float32](dwD), floats[float32](doutTD),
			floats[float32](xTD), floats[float32](wD), floats[float32](rstdT), d, beta)
	} else {
		rmsNormBackward(b, floats[float64](dxTD), floats[float64](dwD), floats[float64](doutTD),
			floats[float64](xTD), floats[float64](wD), floats[float64](rstdT), d, beta)
	}
}

func rmsNormForward[T Float](b *Backend, out, rstd, x, w []T, d int, eps float64) {
	b.parallelFor(len(rstd), rowChunk(d), func(lo, hi int) {
		for t := lo; t < hi; t++ {
			xt := x[t*d : (t+1)*d]
			ot := out[t*d : (t+1)*d][:len(xt)]
			wt := w[:len(xt)]
			var ss float64
			for _, v := range xt {
				ss += float64(v) * float64(v)
			}
			r := T(1 / math.Sqrt(ss/float64(d)+eps))
			rstd[t] = r
			for i, v := range xt {
				ot[i] = wt[i] * (v * r)
			}
		}
	})
}

func rmsNormBackward[T Float](b *Backend, dx, dw, dout, x, w, rstd []T, d int, beta float64) {
	// dw first: dx may alias dout.
	b.parallelFor(d, colChunk, func(lo, hi int) {
		acc := make([]float64, hi-lo)
		for t, r := range rstd {
			g := dout[t*d+lo : t*d+hi][:len(acc)]
			xt := x[t*d+lo : t*d+hi][:len(acc)]
			rf := float64(r)
			for i, v := range g {
				acc[i] += float64(v) * float64(xt[i]) * rf
			}
		}
		for i, v := range acc {
			dw[lo+i] += T(v)
		}
	})
	b.parallelFor(len(rstd), rowChunk(d), func(lo, hi int) {
		for t := lo; t < hi; t++ {
			xt := x[t*d : (t+1)*d]
			g := dout[t*d : (t+1)*d][:len(xt)]
			dxt := dx[t*d : (t+1)*d][:len(xt)]
			wt := w[:len(xt)]
			var dot float64
			for i, v := range xt {
				dot += float64(wt[i]) * float64(g[i]) * float64(v)
			}
			r := rstd[t]
			c := T(float64(r) * float64(r) * dot / float64(d))
			if beta == 0 {
				for i, v := range xt {
					dxt[i] = r * (wt[i]*g[i] - v*c)
				}
				continue
			}
			bt := T(beta)
			for i, v := range xt {
				dxt[i] = bt*dxt[i] + T(r*(wt[i]*g[i]-v*c))
			}
		}
	})
}
