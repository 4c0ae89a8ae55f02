package cpu

// Rotary position embedding in Hugging Face's rotate-half convention: within
// each head of Dh dims, dim i < Dh/2 is paired with dim i+Dh/2 and the pair
// is rotated by the angle pos * theta^(-2i/Dh):
//
//	out[i]      = x[i]*cos - x[i+Dh/2]*sin
//	out[i+Dh/2] = x[i+Dh/2]*cos + x[i]*sin
//
// Angles and their sines and cosines are computed in float64. The rotation is
// orthogonal, so its transpose (the backward) is the rotation by -angle.

import (
	"math"
	"unsafe"

	"github.com/mktrain/mktrain/backend"
)

// RoPE writes outTQ = xTQ rotated at the positions posT; inverse rotates
// back. out is x (in place) or a tensor that does not overlap it, of the
// float type or BFloat16 (rounded after the rotation).
func (b *Backend) RoPE(outTQ, xTQ, posT backend.Tensor, headDim int, theta float64, inverse bool) {
	const op = "RoPE"
	t, q := b.matrix(op, "x", xTQ)
	b.wantOperandMatrix(op, "out", outTQ, t, q)
	if headDim <= 0 || headDim%2 != 0 || q%headDim != 0 {
		fail(op, "head dim %d must be even and positive and divide the row width %d of x %v", headDim, q, xTQ.Shape())
	}
	if theta <= 0 {
		fail(op, "theta %v must be positive", theta)
	}
	pos := indices(op, "pos", posT, t, math.MaxInt32, false)
	if b.dt == backend.Float32 {
		out, x := floats[float32](outTQ), floats[float32](xTQ)
		checkInPlace(op, out, x)
		rope(b, out, x, pos, q, headDim, theta, inverse)
	} else {
		out, x := floats[float64](outTQ), floats[float64](xTQ)
		checkInPlace(op, out, x)
		rope(b, out, x, pos, q, headDim, theta, inverse)
	}
	b.roundIfBF16(outTQ)
}

// checkInPlace refuses an out that overlaps x without being x itself: the
// rows run in parallel, so such a call's result would depend on timing
// (the CUDA backend refuses it too).
func checkInPlace[T Float](op string, out, x []T) {
	if len(out) == 0 || len(x) == 0 || unsafe.SliceData(out) == unsafe.SliceData(x) {
		return
	}
	size := unsafe.Sizeof(out[0])
	o0, x0 := uintptr(unsafe.Pointer(unsafe.SliceData(out))), uintptr(unsafe.Pointer(unsafe.SliceData(x)))
	if o0 < x0+uintptr(len(x))*size && x0 < o0+uintptr(len(out))*size {
		fail(op, "out overlaps x without being x itself")
	}
}

func rope[T Float](b *Backend, out, x []T, pos []int32, q, dh int, theta float64, inverse bool) {
	half := dh / 2
	invFreq := make([]float64, half)
	for i := range invFreq {
		invFreq[i] = math.Pow(theta, -2*float64(i)/float64(dh))
	}
	b.parallelFor(len(pos), rowChunk(q), func(lo, hi int) {
		cos := make([]T, half)
		sin := make([]T, half)
		for t := lo; t < hi; t++ {
			p := float64(pos[t])
			for i, f := range invFreq {
				s, c := math.Sincos(p * f)
				if inverse {
					s = -s
				}
				cos[i], sin[i] = T(c), T(s)
			}
			row, outRow := x[t*q:(t+1)*q], out[t*q:(t+1)*q]
			for h := 0; h < q; h += dh {
				x1, x2 := row[h:h+half], row[h+half:h+dh]
				o1, o2 := outRow[h:h+half], outRow[h+half:h+dh]
				// Both of a pair are read before either is written, so
				// out may be x.
				for i, u := range x1 {
					v := x2[i]
					o1[i] = u*cos[i] - v*sin[i]
					o2[i] = v*cos[i] + u*sin[i]
				}
			}
		}
	})
}
