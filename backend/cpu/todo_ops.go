package cpu

// Placeholders, replaced by the real kernels in ops_*.go. DELETE THIS FILE when done.

import "github.com/mktrain/mktrain/backend"

func (b *Backend) Zero(t backend.Tensor)                                    { panic("todo") }
func (b *Backend) Copy(dst, src backend.Tensor)                             { panic("todo") }
func (b *Backend) Axpy(dst backend.Tensor, alpha float64, x backend.Tensor) { panic("todo") }
func (b *Backend) Scale(t backend.Tensor, alpha float64)                    { panic("todo") }
func (b *Backend) Sum(t backend.Tensor) float64                             { panic("todo") }
func (b *Backend) SumSquares(t backend.Tensor) float64                      { panic("todo") }
func (b *Backend) MatMul(out, a, bb backend.Tensor, transA, transB bool, alpha, beta float64) {
	panic("todo")
}
func (b *Backend) EmbeddingForward(outTD, tableVD, idsT backend.Tensor)    { panic("todo") }
func (b *Backend) EmbeddingBackward(dTableVD, dOutTD, idsT backend.Tensor) { panic("todo") }
func (b *Backend) RMSNormForward(outTD, rstdT, xTD, wD backend.Tensor, eps float64) {
	panic("todo")
}
func (b *Backend) RMSNormBackward(dxTD, dwD, doutTD, xTD, wD, rstdT backend.Tensor) { panic("todo") }
func (b *Backend) RoPE(xTQ, posT backend.Tensor, headDim int, theta float64, inverse bool) {
	panic("todo")
}
func (b *Backend) SwiGLUForward(outNF, aNF, bNF backend.Tensor)               { panic("todo") }
func (b *Backend) SwiGLUBackward(daNF, dbNF, doutNF, aNF, bNF backend.Tensor) { panic("todo") }
func (b *Backend) CrossEntropy(lossT, dlogitsTV, logitsTV, targetsT backend.Tensor, gradScale float64) {
	panic("todo")
}
func (b *Backend) GatherRows(outND, inTD, rowsN, scaleN backend.Tensor)          { panic("todo") }
func (b *Backend) ScatterAddRows(outTD, inND, rowsN, scaleN backend.Tensor)      { panic("todo") }
func (b *Backend) RowDots(outN, aTD, rowsN, bND backend.Tensor)                  { panic("todo") }
func (b *Backend) AdamWUpdate(param, grad, m, v backend.Tensor, h backend.AdamW) { panic("todo") }
