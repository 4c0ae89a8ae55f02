package cpu

// Placeholders, replaced by the real kernels in attention.go. DELETE THIS FILE when done.

import "github.com/mktrain/mktrain/backend"

func (b *Backend) AttentionForward(outTQ, lseBHS, qTQ, kTK, vTK backend.Tensor, s backend.AttnShape) {
	panic("todo")
}
func (b *Backend) AttentionBackward(dqTQ, dkTK, dvTK, doutTQ, qTQ, kTK, vTK, outTQ, lseBHS backend.Tensor, s backend.AttnShape) {
	panic("todo")
}
