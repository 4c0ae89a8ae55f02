package cpu

// Argument checks shared by the ops. A failed check is a bug in the caller,
// so it panics (see package backend), and it panics on the calling goroutine
// before any worker starts: a panic inside a worker goroutine could not be
// recovered by the engine.
//
// Matrix arguments (names ending in two shape letters, such as xTD) must be
// 2-D tensors. Vector arguments (rstdT, wD, idsT, scaleN, ...) are checked by
// length only, so a [B, S] tensor of ids serves as [T].

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
)

// fail panics with a message that names the op.
func fail(op, format string, args ...any) {
	panic(fmt.Sprintf("cpu.%s: %s", op, fmt.Sprintf(format, args...)))
}

// float checks that t is a float tensor of the backend's float type.
func (b *Backend) float(op, name string, t backend.Tensor) {
	if t == nil {
		fail(op, "%s is nil", name)
	}
	if t.DType() != b.dt {
		fail(op, "%s is %v, but this backend computes in %v", name, t.DType(), b.dt)
	}
}

// operand checks that t is a float tensor of the backend's float type or
// a BFloat16 tensor: the arguments that may be kept in bf16 (MatMul's, and
// the outputs and inputs named in backend.Backend's docs).
func (b *Backend) operand(op, name string, t backend.Tensor) {
	if t == nil || t.DType() != backend.BFloat16 {
		b.float(op, name, t)
	}
}

// matrix checks that t is a 2-D float tensor and returns its dimensions.
func (b *Backend) matrix(op, name string, t backend.Tensor) (rows, cols int) {
	b.float(op, name, t)
	return shape2(op, name, t)
}

// operandMatrix is matrix for an argument that may be BFloat16 (operand).
func (b *Backend) operandMatrix(op, name string, t backend.Tensor) (rows, cols int) {
	b.operand(op, name, t)
	return shape2(op, name, t)
}

// wantOperandMatrix is wantMatrix for an argument that may be BFloat16.
func (b *Backend) wantOperandMatrix(op, name string, t backend.Tensor, rows, cols int) {
	r, c := b.operandMatrix(op, name, t)
	if r != rows || c != cols {
		fail(op, "%s has shape %v, want [%d %d]", name, t.Shape(), rows, cols)
	}
}

// sameDType checks that x and y (checked already) have one dtype.
func sameDType(op, xName string, x backend.Tensor, yName string, y backend.Tensor) {
	if x.DType() != y.DType() {
		fail(op, "%s is %v but %s is %v; they must have one dtype", xName, x.DType(), yName, y.DType())
	}
}

// shape2 returns the dimensions of t, which must be 2-D.
func shape2(op, name string, t backend.Tensor) (rows, cols int) {
	s := t.Shape()
	if len(s) != 2 {
		fail(op, "%s has shape %v, want a 2-D tensor", name, s)
	}
	return s[0], s[1]
}

// wantMatrix checks that t is a 2-D float tensor of shape [rows, cols].
func (b *Backend) wantMatrix(op, name string, t backend.Tensor, rows, cols int) {
	r, c := b.matrix(op, name, t)
	if r != rows || c != cols {
		fail(op, "%s has shape %v, want [%d %d]", name, t.Shape(), rows, cols)
	}
}

// vector checks that t is a float tensor of n elements.
func (b *Backend) vector(op, name string, t backend.Tensor, n int) {
	b.float(op, name, t)
	if t.Len() != n {
		fail(op, "%s has shape %v (%d elements), want %d elements", name, t.Shape(), t.Len(), n)
	}
}

// sameLen checks that x is a float tensor with as many elements as dst.
func (b *Backend) sameLen(op, dstName string, dst backend.Tensor, xName string, x backend.Tensor) {
	b.float(op, dstName, dst)
	b.vector(op, xName, x, dst.Len())
}

// indices checks that t is an Int32 tensor of n elements whose values lie in
// [0, limit), and returns them. Negative values are accepted where
// allowNegative is set (ignored targets).
func indices(op, name string, t backend.Tensor, n, limit int, allowNegative bool) []int32 {
	if t == nil {
		fail(op, "%s is nil", name)
	}
	if t.DType() != backend.Int32 {
		fail(op, "%s is %v, want int32", name, t.DType())
	}
	if t.Len() != n {
		fail(op, "%s has shape %v (%d elements), want %d elements", name, t.Shape(), t.Len(), n)
	}
	ids := ints(t)
	for i, id := range ids {
		if int(id) >= limit || (id < 0 && !allowNegative) {
			fail(op, "%s[%d] = %d is outside [0, %d)", name, i, id, limit)
		}
	}
	return ids
}
