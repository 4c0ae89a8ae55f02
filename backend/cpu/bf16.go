package cpu

// bfloat16 tensors. A BFloat16 tensor keeps its values in the backend's own
// float slice (f32 or f64), always on the bf16 grid: every op or upload
// that writes one rounds what it wrote (roundBF16s), and ops read it like
// a tensor of the float type. So the generic kernels serve bf16 operands
// unchanged, and the values are exactly those a GPU holds in 16 bits.

import (
	"fmt"
	"math"

	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/backend"
)

// roundBF16 is x rounded to the nearest bfloat16, ties to even: the top 16
// bits of float32 after adding half an ulp of bf16 (plus one when the kept
// part is odd). A NaN stays NaN (its quiet bit set, so that dropping the
// low bits cannot make it an infinity); infinities stay; values past the
// largest bf16 round to infinity, as on the GPU.
func roundBF16(x float32) float32 {
	u := math.Float32bits(x)
	if u&0x7fffffff > 0x7f800000 {
		return math.Float32frombits((u | 0x00400000) &^ 0xffff)
	}
	u += 0x7fff + (u>>16)&1
	return math.Float32frombits(u &^ 0xffff)
}

// roundBF16s rounds xs in place onto the bf16 grid. float64 values round
// through float32 first; that double rounding is what a GPU kernel writing
// bf16 from float32 results does too (and differs from rounding the
// float64 directly only for values within 2^-29 relative of a tie).
func roundBF16s[T Float](b *Backend, xs []T) {
	b.parallelFor(len(xs), elemChunk, func(lo, hi int) {
		for i, v := range xs[lo:hi] {
			xs[lo+i] = T(roundBF16(float32(v)))
		}
	})
}

// roundIfBF16 rounds t's values onto the bf16 grid when t is a BFloat16
// tensor: the last step of every op that writes one.
func (b *Backend) roundIfBF16(t backend.Tensor) {
	if t.DType() != backend.BFloat16 {
		return
	}
	if b.dt == backend.Float32 {
		roundBF16s(b, floats[float32](t))
	} else {
		roundBF16s(b, floats[float64](t))
	}
}

// uploadBF16 is Upload into a BFloat16 tensor: float data, rounded.
func (b *Backend) uploadBF16(d *Tensor, src *tensor.Dense) {
	switch s := backend.HostData(src).(type) {
	case []float32:
		for i, v := range s[:d.Len()] {
			d.setBF16(i, roundBF16(v))
		}
	case []float64:
		for i, v := range s[:d.Len()] {
			d.setBF16(i, roundBF16(float32(v)))
		}
	default:
		panic(fmt.Sprintf("cpu: cannot upload %T into a bfloat16 tensor", s))
	}
}

// setBF16 stores the bf16 value v at element i of a BFloat16 tensor.
func (t *Tensor) setBF16(i int, v float32) {
	if t.f32 != nil {
		t.f32[i] = v
	} else {
		t.f64[i] = float64(v)
	}
}

// OperandType is the float type: the CPU backend multiplies in it, and
// stays the exact reference for layers that would keep bf16 operands on a
// GPU (backend.Backend).
func (b *Backend) OperandType() backend.DType { return b.dt }
