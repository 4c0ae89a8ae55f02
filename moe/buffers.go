package moe

// Buffers whose size changes every micro-step, and host transfers.

import (
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
		backend.UploadSlice(b, v, vals)
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
