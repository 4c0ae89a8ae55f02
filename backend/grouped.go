package backend

// GroupedMatMulByLoop computes GroupedMatMul on b with one MatMul per
// group, on views of the operands; GroupedMatMulTNByLoop likewise. They are
// the reference definition of the two grouped products (the CPU backend's
// implementation) and serve any backend with no grouped kernel. The
// arguments must have passed GroupedMatMulDims or GroupedMatMulTNDims.
func GroupedMatMulByLoop(b Backend, outRN, aRK, bG Tensor, groupRows []int, transB bool, alpha, beta float64) {
	k, n := aRK.Shape()[1], outRN.Shape()[1]
	off := 0
	for g, rows := range groupRows {
		if rows > 0 {
			bg := b.View(bG, g*n*k, n, k)
			if !transB {
				bg = b.View(bG, g*k*n, k, n)
			}
			b.MatMul(b.View(outRN, off*n, rows, n), b.View(aRK, off*k, rows, k), bg, false, transB, alpha, beta)
		}
		off += rows
	}
}

// GroupedMatMulTNByLoop is GroupedMatMulTN as one MatMul per group; an
// empty group's block is scaled by beta (zeroed when beta is 0).
func GroupedMatMulTNByLoop(b Backend, outGMN, aRM, bRN Tensor, groupRows []int, alpha, beta float64) {
	m, n := aRM.Shape()[1], bRN.Shape()[1]
	off := 0
	for g, rows := range groupRows {
		out := b.View(outGMN, g*m*n, m, n)
		switch {
		case rows > 0:
			b.MatMul(out, b.View(aRM, off*m, rows, m), b.View(bRN, off*n, rows, n), true, false, alpha, beta)
		case beta == 0:
			b.Zero(out)
		case beta != 1:
			b.Scale(out, beta)
		}
		off += rows
	}
}
