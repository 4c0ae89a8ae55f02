package cuda

// Argument checks of the Backend's ops, the same rules as backend/cpu's
// (ops_shapes.go): matrix arguments (names ending in two shape letters) are
// 2-D, vector arguments are checked by length only. A failed check panics
// before anything is queued. Index values live on the GPU and are not read
// back to be checked: kernels skip or poison out-of-range indices where
// they can (see each kernel's comment), and the CPU backend is the place to
// debug an index bug.

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
)

func fail(op, format string, args ...any) {
	panic(fmt.Sprintf("cuda.%s: %s", op, fmt.Sprintf(format, args...)))
}

// float checks that t is a float32 tensor of this backend.
func float(op, name string, t backend.Tensor) *Tensor {
	if t == nil {
		fail(op, "%s is nil", name)
	}
	ct := tensorOf(op, name, t)
	if ct.dt != backend.Float32 {
		fail(op, "%s is %v, but this backend computes in float32", name, ct.dt)
	}
	return ct
}

// operand is float for an argument that may also be bfloat16 (the
// arguments backend.Backend allows to be: MatMul's, GatherRows' out,
// SwiGLU's inputs and outputs).
func operand(op, name string, t backend.Tensor) *Tensor {
	if t == nil {
		fail(op, "%s is nil", name)
	}
	ct := tensorOf(op, name, t)
	if ct.dt != backend.Float32 && ct.dt != backend.BFloat16 {
		fail(op, "%s is %v, want float32 or bfloat16", name, ct.dt)
	}
	return ct
}

// operandMatrix is matrix for an argument that may be bfloat16.
func operandMatrix(op, name string, t backend.Tensor) (*Tensor, int, int) {
	ct := operand(op, name, t)
	if len(ct.shape) != 2 {
		fail(op, "%s has shape %v, want a 2-D tensor", name, ct.shape)
	}
	return ct, ct.shape[0], ct.shape[1]
}

// wantOperandMatrix is wantMatrix for an argument that may be bfloat16.
func wantOperandMatrix(op, name string, t backend.Tensor, rows, cols int) *Tensor {
	ct, r, c := operandMatrix(op, name, t)
	if r != rows || c != cols {
		fail(op, "%s has shape %v, want [%d %d]", name, ct.shape, rows, cols)
	}
	return ct
}

// sameDType panics unless x and y have one dtype.
func sameDType(op, xName string, x *Tensor, yName string, y *Tensor) {
	if x.dt != y.dt {
		fail(op, "%s is %v but %s is %v; they must have one dtype", xName, x.dt, yName, y.dt)
	}
}

// optFloat is float for an optional argument (nil allowed) of n elements.
func optFloat(op, name string, t backend.Tensor, n int) *Tensor {
	if t == nil {
		return nil
	}
	return vector(op, name, t, n)
}

// matrix checks that t is a 2-D float tensor and returns it and its
// dimensions.
func matrix(op, name string, t backend.Tensor) (*Tensor, int, int) {
	ct := float(op, name, t)
	if len(ct.shape) != 2 {
		fail(op, "%s has shape %v, want a 2-D tensor", name, ct.shape)
	}
	return ct, ct.shape[0], ct.shape[1]
}

// wantMatrix checks that t is a 2-D float tensor of shape [rows, cols].
func wantMatrix(op, name string, t backend.Tensor, rows, cols int) *Tensor {
	ct, r, c := matrix(op, name, t)
	if r != rows || c != cols {
		fail(op, "%s has shape %v, want [%d %d]", name, ct.shape, rows, cols)
	}
	return ct
}

// vector checks that t is a float tensor of n elements.
func vector(op, name string, t backend.Tensor, n int) *Tensor {
	ct := float(op, name, t)
	if ct.Len() != n {
		fail(op, "%s has shape %v (%d elements), want %d elements", name, ct.shape, ct.Len(), n)
	}
	return ct
}

// indices checks that t is an Int32 tensor of n elements.
func indices(op, name string, t backend.Tensor, n int) *Tensor {
	return typedVector(op, name, t, backend.Int32, n, "want int32")
}

// typedVector checks that t is a tensor of this backend of type dt and n
// elements; a tensor of another type fails op saying why (why: "want
// int32", say).
func typedVector(op, name string, t backend.Tensor, dt backend.DType, n int, why string) *Tensor {
	if t == nil {
		fail(op, "%s is nil", name)
	}
	ct := tensorOf(op, name, t)
	if ct.dt != dt {
		fail(op, "%s is %v, %s", name, ct.dt, why)
	}
	if ct.Len() != n {
		fail(op, "%s has shape %v (%d elements), want %d elements", name, ct.shape, ct.Len(), n)
	}
	return ct
}

// fitsInt32 panics unless every size fits a kernel's int parameter.
func fitsInt32(op string, sizes ...int) {
	for _, s := range sizes {
		if s > 1<<31-1 {
			fail(op, "size %d does not fit the kernel's 32-bit argument", s)
		}
	}
}
