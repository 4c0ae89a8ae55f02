package cpu

// MatMul is the hot op of CPU training, so its kernel is shaped for Go's
// compiler, which does not vectorise: every layout is computed in i-k-j
// order, out[i, j0:j1] += a(i,k) * B[k, j0:j1], eight k at a time, so the
// inner loop streams one output row segment and eight contiguous rows of B
// with no loop-carried dependency. When B is transposed its blocks are first
// copied, transposed, into a small per-worker panel, so the inner loop always
// reads B rows contiguously. The loops are blocked over k and j so that the
// block of B in use stays in cache while every output row of a worker passes
// over it.
//
// Work is split over output rows, and each output element is summed in the
// same order whatever the split, so results do not depend on the worker
// count.

import (
	"slices"

	"github.com/mktrain/mktrain/backend"
)

const (
	// mmKB and mmJB are the k and j extents of the block of B kept in cache
	// (256 KiB of float32), chosen by measurement on a 512x512x512 product.
	mmKB = 128
	mmJB = 512
	// mmWork is the least number of multiply-adds worth a goroutine.
	mmWork = 1 << 16
)

// MatMul computes out = alpha*op(a)*op(b) + beta*out. out must not overlap a
// or b. With beta = 0 out is not read, and with alpha = 0 neither are a and b.
// a, b and out may each be BFloat16 (out only with beta = 0): the product
// is computed in the float type from the operands' values, then rounded
// into a BFloat16 out.
func (b *Backend) MatMul(out, a, bb backend.Tensor, transA, transB bool, alpha, beta float64) {
	const op = "MatMul"
	b.operandMatrix(op, "a", a)
	b.operandMatrix(op, "b", bb)
	b.operandMatrix(op, "out", out)
	m, n, k, err := backend.MatMulDims(out, a, bb, transA, transB)
	if err != nil {
		fail(op, "%v", err)
	}
	if out.DType() == backend.BFloat16 && beta != 0 {
		fail(op, "out is bfloat16, which needs beta = 0 (got %v)", beta)
	}
	defer b.roundIfBF16(out)
	if b.dt == backend.Float32 {
		matmul(b, floats[float32](out), floats[float32](a), floats[float32](bb), m, n, k, transA, transB, float32(alpha), float32(beta))
	} else {
		matmul(b, floats[float64](out), floats[float64](a), floats[float64](bb), m, n, k, transA, transB, alpha, beta)
	}
}

// matmul is MatMul for [m, k] x [k, n] after the shape checks.
func matmul[T Float](be *Backend, out, a, b []T, m, n, k int, transA, transB bool, alpha, beta T) {
	if m == 0 || n == 0 {
		return
	}
	if k == 0 || alpha == 0 {
		// Only the beta term remains; as in BLAS, a and b are not read.
		scaleOrZero(out, beta)
		return
	}
	// a(i, kk) = a[i*ai + kk*ak].
	ai, ak := k, 1
	if transA {
		ai, ak = 1, m
	}
	minRows := max(1, mmWork/(n*k))
	be.parallelFor(m, minRows, func(lo, hi int) {
		var panel []T
		if transB {
			panel = make([]T, min(mmKB, k)*min(mmJB, n))
		}
		for j0 := 0; j0 < n; j0 += mmJB {
			jw := min(mmJB, n-j0)
			for k0 := 0; k0 < k; k0 += mmKB {
				kw := min(mmKB, k-k0)
				// bk[kk*ldb : kk*ldb+jw] is row k0+kk of op(b), columns j0..j0+jw.
				var bk []T
				ldb := n
				if transB {
					packTransposed(panel, b, k, j0, jw, k0, kw)
					bk, ldb = panel, jw
				} else {
					bk = b[k0*n+j0:]
				}
				for i := lo; i < hi; i++ {
					o := out[i*n+j0 : i*n+j0+jw]
					if k0 == 0 {
						scaleOrZero(o, beta)
					}
					axpyRows(o, a[i*ai+k0*ak:], ak, bk, ldb, kw, alpha)
				}
			}
		}
	})
}

// scaleOrZero computes x *= beta, where beta = 0 clears x (so NaN in x
// does not survive).
func scaleOrZero[T Float](x []T, beta T) {
	switch beta {
	case 0:
		clear(x)
	case 1:
	default:
		for i := range x {
			x[i] *= beta
		}
	}
}

// packTransposed copies the block of b ([n, k], row-major) with rows
// j0..j0+jw and columns k0..k0+kw into panel as [kw, jw], transposed. It
// walks eight rows of b side by side, so that reads run along those rows
// and each step writes eight adjacent panel elements.
func packTransposed[T Float](panel, b []T, k, j0, jw, k0, kw int) {
	j := 0
	for ; j+8 <= jw; j += 8 {
		r0 := b[(j0+j)*k+k0:][:kw]
		r1 := b[(j0+j+1)*k+k0:][:kw]
		r2 := b[(j0+j+2)*k+k0:][:kw]
		r3 := b[(j0+j+3)*k+k0:][:kw]
		r4 := b[(j0+j+4)*k+k0:][:kw]
		r5 := b[(j0+j+5)*k+k0:][:kw]
		r6 := b[(j0+j+6)*k+k0:][:kw]
		r7 := b[(j0+j+7)*k+k0:][:kw]
		for kk := range r0 {
			p := panel[kk*jw+j:][:8]
			p[0], p[1], p[2], p[3] = r0[kk], r1[kk], r2[kk], r3[kk]
			p[4], p[5], p[6], p[7] = r4[kk], r5[kk], r6[kk], r7[kk]
		}
	}
	for ; j < jw; j++ {
		for kk, v := range b[(j0+j)*k+k0:][:kw] {
			panel[kk*jw+j] = v
		}
	}
}

// axpyRows computes o += alpha * sum over kk < kw of a[kk*ak] * bk[kk*ldb :
// kk*ldb+len(o)]. Eight rows of B per pass, summed as a tree, measured
// fastest: fewer passes over o, and short dependency chains.
func axpyRows[T Float](o, a []T, ak int, bk []T, ldb, kw int, alpha T) {
	kk := 0
	for ; kk+8 <= kw; kk += 8 {
		x0, x1 := alpha*a[kk*ak], alpha*a[(kk+1)*ak]
		x2, x3 := alpha*a[(kk+2)*ak], alpha*a[(kk+3)*ak]
		x4, x5 := alpha*a[(kk+4)*ak], alpha*a[(kk+5)*ak]
		x6, x7 := alpha*a[(kk+6)*ak], alpha*a[(kk+7)*ak]
		b0 := bk[kk*ldb:][:len(o)]
		b1 := bk[(kk+1)*ldb:][:len(o)]
		b2 := bk[(kk+2)*ldb:][:len(o)]
		b3 := bk[(kk+3)*ldb:][:len(o)]
		b4 := bk[(kk+4)*ldb:][:len(o)]
		b5 := bk[(kk+5)*ldb:][:len(o)]
		b6 := bk[(kk+6)*ldb:][:len(o)]
		b7 := bk[(kk+7)*ldb:][:len(o)]
		for j := range o {
			o[j] += ((x0*b0[j] + x1*b1[j]) + (x2*b2[j] + x3*b3[j])) +
				((x4*b4[j] + x5*b5[j]) + (x6*b6[j] + x7*b7[j]))
		}
	}
	for ; kk+4 <= kw; kk += 4 {
		x0, x1 := alpha*a[kk*ak], alpha*a[(kk+1)*ak]
		x2, x3 := alpha*a[(kk+2)*ak], alpha*a[(kk+3)*ak]
		b0 := bk[kk*ldb:][:len(o)]
		b1 := bk[(kk+1)*ldb:][:len(o)]
		b2 := bk[(kk+2)*ldb:][:len(o)]
		b3 := bk[(kk+3)*ldb:][:len(o)]
		for j := range o {
			o[j] += (x0*b0[j] + x1*b1[j]) + (x2*b2[j] + x3*b3[j])
		}
	}
	for ; kk < kw; kk++ {
		x := alpha * a[kk*ak]
		b0 := bk[kk*ldb:][:len(o)]
		for j := range o {
			o[j] += x * b0[j]
		}
	}
}

// GroupedMatMul is one MatMul per group (backend.GroupedMatMulByLoop).
func (b *Backend) GroupedMatMul(outRN, aRK, bG backend.Tensor, groups backend.Groups, transB bool, alpha, beta float64) {
	const op = "GroupedMatMul"
	if _, _, err := backend.GroupedMatMulDims(outRN, aRK, bG, groups, transB); err != nil {
		fail(op, "%v", err)
	}
	backend.GroupedMatMulByLoop(b, outRN, aRK, bG, b.groupRows(op, groups, aRK.Shape()[0]), transB, alpha, beta)
}

// GroupedMatMulTN is one MatMul per group (backend.GroupedMatMulTNByLoop).
func (b *Backend) GroupedMatMulTN(outGMN, aRM, bRN backend.Tensor, groups backend.Groups, alpha, beta float64) {
	const op = "GroupedMatMulTN"
	if _, _, err := backend.GroupedMatMulTNDims(outGMN, aRM, bRN, groups); err != nil {
		fail(op, "%v", err)
	}
	if outGMN.DType() == backend.BFloat16 {
		fail(op, "out is bfloat16; the weight gradients it accumulates are of the float type")
	}
	backend.GroupedMatMulTNByLoop(b, outGMN, aRM, bRN, b.groupRows(op, groups, aRM.Shape()[0]), alpha, beta)
}

// ReadsGroupOffsets is true: the CPU reads offsets in place.
func (b *Backend) ReadsGroupOffsets(n, k, groups int) bool { return true }

// groupRows returns the row counts of groups over operands of rows rows:
// Rows, or those of Offsets (read in place). Given both, they must agree:
// the reference backend holds a caller to its word.
func (b *Backend) groupRows(op string, groups backend.Groups, rows int) []int {
	if err := backend.CheckGroups(groups, rows); err != nil {
		fail(op, "%v", err)
	}
	if groups.Offsets == nil {
		return groups.Rows
	}
	fromOffsets, err := backend.OffsetRows(ints(groups.Offsets), rows)
	if err != nil {
		fail(op, "%v", err)
	}
	if groups.Rows != nil && !slices.Equal(groups.Rows, fromOffsets) {
		fail(op, "row counts %v and offsets (counts %v) describe different groups", groups.Rows, fromOffsets)
	}
	return fromOffsets
}
