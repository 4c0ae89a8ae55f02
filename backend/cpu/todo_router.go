package cpu

// Placeholders, replaced by the real kernels in router.go. DELETE THIS FILE when done.

import "github.com/mktrain/mktrain/backend"

func (b *Backend) RouterForward(probsTE, lseT, idxTK, gatesTK, logitsTE, biasE backend.Tensor) {
	panic("todo")
}
func (b *Backend) RouterBackward(dlogitsTE, dgatesTK, probsTE, lseT, idxTK, gatesTK, auxDProbE backend.Tensor, zScale float64) {
	panic("todo")
}
