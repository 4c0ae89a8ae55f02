package cpu

import "github.com/mktrain/mktrain/backend"

// elemChunk is the smallest slice of an elementwise loop worth a goroutine.
const elemChunk = 1 << 15

// sumBlock is the fixed block size of the reductions. Each block's partial
// sum is computed independently and the partials are added in order, so a
// reduction gives the same bits whatever the worker count.
const sumBlock = 1 << 12

// Zero clears t. It accepts Int32 and BFloat16 tensors as well as float
// ones.
func (b *Backend) Zero(t backend.Tensor) {
	if t == nil {
		fail("Zero", "tensor is nil")
	}
	ct := t.(*Tensor)
	switch ct.dt {
	case backend.Float32:
		clear(ct.f32)
	case backend.Float64:
		clear(ct.f64)
	case backend.Int32:
		clear(ct.i32)
	case backend.BFloat16:
		clear(ct.f32)
		clear(ct.f64)
	}
}

// Copy copies src into dst; both must have the same dtype and length (shapes
// may differ). It accepts Int32 and BFloat16 tensors as well as float ones.
func (b *Backend) Copy(dst, src backend.Tensor) {
	const op = "Copy"
	if dst == nil || src == nil {
		fail(op, "nil tensor")
	}
	d, s := dst.(*Tensor), src.(*Tensor)
	rounding := d.dt == backend.BFloat16 && s.dt == b.dt
	if d.dt != s.dt && !rounding {
		fail(op, "dst is %v but src is %v", d.dt, s.dt)
	}
	if d.Len() != s.Len() {
		fail(op, "dst has shape %v but src has shape %v", d.shape, s.shape)
	}
	if rounding {
		// A bf16 tensor keeps its values in the float type's storage.
		copy(d.f32, s.f32)
		copy(d.f64, s.f64)
		b.roundIfBF16(d)
		return
	}
	switch d.dt {
	case backend.Float32:
		copy(d.f32, s.f32)
	case backend.Float64:
		copy(d.f64, s.f64)
	case backend.Int32:
		copy(d.i32, s.i32)
	case backend.BFloat16:
		// Both are on the bf16 grid already.
		copy(d.f32, s.f32)
		copy(d.f64, s.f64)
	}
}

// Axpy computes dst += alpha*x.
func (b *Backend) Axpy(dst backend.Tensor, alpha float64, x backend.Tensor) {
	b.sameLen("Axpy", "dst", dst, "x", x)
	if b.dt == backend.Float32 {
		axpy(b, floats[float32](dst), float32(alpha), floats[float32](x))
	} else {
		axpy(b, floats[float64](dst), alpha, floats[float64](x))
	}
}

func axpy[T Float](b *Backend, dst []T, alpha T, x []T) {
	b.parallelFor(len(dst), elemChunk, func(lo, hi int) {
		d := dst[lo:hi]
		s := x[lo:hi][:len(d)]
		for i, v := range s {
			d[i] += alpha * v
		}
	})
}

// Scale computes t *= alpha.
func (b *Backend) Scale(t backend.Tensor, alpha float64) {
	b.float("Scale", "t", t)
	if b.dt == backend.Float32 {
		scale(b, floats[float32](t), float32(alpha))
	} else {
		scale(b, floats[float64](t), alpha)
	}
}

func scale[T Float](b *Backend, x []T, alpha T) {
	b.parallelFor(len(x), elemChunk, func(lo, hi int) {
		s := x[lo:hi]
		for i := range s {
			s[i] *= alpha
		}
	})
}

// Sum returns the sum of t's elements, accumulated in float64.
func (b *Backend) Sum(t backend.Tensor) float64 {
	b.float("Sum", "t", t)
	if b.dt == backend.Float32 {
		return reduce(b, floats[float32](t), false)
	}
	return reduce(b, floats[float64](t), false)
}

// SumSquares returns the sum of the squares of t's elements, accumulated in
// float64.
func (b *Backend) SumSquares(t backend.Tensor) float64 {
	b.float("SumSquares", "t", t)
	if b.dt == backend.Float32 {
		return reduce(b, floats[float32](t), true)
	}
	return reduce(b, floats[float64](t), true)
}

// reduce sums x (or its squares) in float64, block by block (see sumBlock).
func reduce[T Float](b *Backend, x []T, squares bool) float64 {
	blocks := (len(x) + sumBlock - 1) / sumBlock
	partial := make([]float64, blocks)
	b.parallelFor(blocks, 4, func(lo, hi int) {
		for blk := lo; blk < hi; blk++ {
			var s float64
			for _, v := range x[blk*sumBlock : min((blk+1)*sumBlock, len(x))] {
				f := float64(v)
				if squares {
					f *= f
				}
				s += f
			}
			partial[blk] = s
		}
	})
	var s float64
	for _, p := range partial {
		s += p
	}
	return s
}
