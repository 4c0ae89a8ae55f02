package moe

// Buffers whose size changes every micro-step, and host transfers.

import (
	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/backend"
)

// rowBuf is a grow-only buffer of rows of a fixed width. A step views the
// rows it needs; memory is reallocated only when a step needs more rows than
// any before it (with a quarter of headroom, so a slowly growing load does
// not reallocate every step).
type rowBuf struct {
	dt   backend.DType
	cols int
	t    backend.Tensor
	rows int // capacity
}

// view returns the first n rows as an [n, cols] tensor.
func (r *rowBuf) view(b backend.Backend, n int) backend.Tensor {
	r.grow(b, n)
	return b.View(r.t, 0, n, r.cols)
}

// vec returns the first n elements as an [n] tensor (for width-1 buffers).
func (r *rowBuf) vec(b backend.Backend, n int) backend.Tensor {
	r.grow(b, n)
	return b.View(r.t, 0, n*r.cols)
}

// uploadInts copies host indices into the buffer and returns the [n] view.
func (r *rowBuf) uploadInts(b backend.Backend, vals []int32) backend.Tensor {
	v := r.vec(b, len(vals))
	if len(vals) > 0 {
		b.Upload(v, tensor.New(tensor.WithShape(len(vals)), tensor.WithBacking(vals)))
	}
	return v
}

func (r *rowBuf) grow(b backend.Backend, n int) {
	if r.t != nil && n <= r.rows {
		return
	}
	r.rows = max(n, r.rows+r.rows/4, 1)
	r.t = b.New(r.dt, r.rows*r.cols)
}

// upload copies host floats into a float tensor of the same length.
func upload(b backend.Backend, t backend.Tensor, vals []float64) {
	b.Upload(t, tensor.New(tensor.WithShape(len(vals)), tensor.WithBacking(vals)))
}

// hostFloats downloads a float tensor as float64s.
func hostFloats(b backend.Backend, t backend.Tensor) []float64 {
	switch d := b.Download(t).Data().(type) {
	case []float64:
		return d
	case []float32:
		out := make([]float64, len(d))
		for i, v := range d {
			out[i] = float64(v)
		}
		return out
	default:
		panic("moe: hostFloats of a non-float tensor")
	}
}

// hostInt32s downloads an Int32 tensor.
func hostInt32s(b backend.Backend, t backend.Tensor) []int32 {
	return b.Download(t).Data().([]int32)
}
