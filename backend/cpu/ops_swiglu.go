package cpu

// SwiGLU, the gated activation of the experts: out = silu(a) * b with
// silu(a) = a * sigmoid(a). With s = sigmoid(a) and g = dout:
//
//	da = g * b * s * (1 + a*(1-s)),  db = g * a * s
//
// The sigmoid is computed in float64.

import (
	"math"

	"github.com/mktrain/mktrain/backend"
)

// SwiGLUForward writes outNF = silu(aNF) * bNF. a and b are both of the
// float type or both BFloat16; out may be either (rounded when BFloat16).
func (b *Backend) SwiGLUForward(outNF, aNF, bNF backend.Tensor) {
	const op = "SwiGLUForward"
	n, f := b.operandMatrix(op, "a", aNF)
	b.wantOperandMatrix(op, "b", bNF, n, f)
	sameDType(op, "a", aNF, "b", bNF)
	b.wantOperandMatrix(op, "out", outNF, n, f)
	defer b.roundIfBF16(outNF)
	if b.dt == backend.Float32 {
		swigluForward(b, floats[float32](outNF), floats[float32](aNF), floats[float32](bNF))
	} else {
		swigluForward(b, floats[float64](outNF), floats[float64](aNF), floats[float64](bNF))
	}
}

// SwiGLUBackward writes daNF and dbNF. dout is of the float type; a and b
// are both of it or both BFloat16, and so are da and db (rounded).
func (b *Backend) SwiGLUBackward(daNF, dbNF, doutNF, aNF, bNF backend.Tensor) {
	const op = "SwiGLUBackward"
	n, f := b.operandMatrix(op, "a", aNF)
	b.wantOperandMatrix(op, "b", bNF, n, f)
	sameDType(op, "a", aNF, "b", bNF)
	b.wantMatrix(op, "dout", doutNF, n, f)
	b.wantOperandMatrix(op, "da", daNF, n, f)
	b.wantOperandMatrix(op, "db", dbNF, n, f)
	sameDType(op, "da", daNF, "db", dbNF)
	defer b.roundIfBF16(dbNF)
	defer b.roundIfBF16(daNF)
	if b.dt == backend.Float32 {
		swigluBackward(b, floats[float32](daNF), floats[float32](dbNF), floats[float32](doutNF), floats[float32](aNF), floats[float32](bNF))
	} else {
		swigluBackward(b, floats[float64](daNF), floats[float64](dbNF), floats[float64](doutNF), floats[float64](aNF), floats[float64](bNF))
	}
}

func sigmoid(x float64) float64 { return 1 / (1 + math.Exp(-x)) }

func swigluForward[T Float](b *Backend, out, a, bv []T) {
	b.parallelFor(len(a), elemChunk, func(lo, hi int) {
		o := out[lo:hi]
		x := a[lo:hi][:len(o)]
		y := bv[lo:hi][:len(o)]
		for i, v := range x {
			av := float64(v)
			o[i] = T(av*sigmoid(av)) * y[i]
		}
	})
}

func swigluBackward[T Float](b *Backend, da, db, dout, a, bv []T) {
	b.parallelFor(len(a), elemChunk, func(lo, hi int) {
		x := a[lo:hi]
		y := bv[lo:hi][:len(x)]
		g := dout[lo:hi][:len(x)]
		dx := da[lo:hi][:len(x)]
		dy := db[lo:hi][:len(x)]
		for i, v := range x {
			// Read every input of element i before writing: da or db may
			// alias an input.
			av, bvi, gi := float64(v), float64(y[i]), float64(g[i])
			s := sigmoid(av)
			dx[i] = T(gi * bvi * s * (1 + av*(1-s)))
			dy[i] = T(gi * av * s)
		}
	})
}
