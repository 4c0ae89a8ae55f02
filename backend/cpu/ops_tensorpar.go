package cpu

import "github.com/mktrain/mktrain/backend"

// AllGatherMatMul is the unfused sequence (backend.AllGatherMatMulBySteps):
// the CPU's twin of the fused kernel, bit for bit the all-gather and the
// products.
func (b *Backend) AllGatherMatMul(fullRK backend.Tensor, outs, shardsBK, ws []backend.Tensor, transW bool, rank int) {
	if err := backend.CheckAllGatherMatMul(fullRK, outs, shardsBK, ws, transW, rank); err != nil {
		panic("cpu.AllGatherMatMul: " + err.Error())
	}
	backend.AllGatherMatMulBySteps(b, fullRK, outs, shardsBK, ws, transW)
}

// MatMulScatter is the unfused sequence (backend.MatMulScatterBySteps).
// Virtual ranks run side by side on one CPU backend, so ScatterAtomic's
// adds hold scatterMu: each rank's block lands whole, in the order the
// ranks get there.
func (b *Backend) MatMulScatter(dstsS []backend.Tensor, row0 int, a, w backend.Tensor, transW bool, landing backend.ScatterLanding, rank int) {
	if err := backend.CheckMatMulScatter(dstsS, row0, a, w, transW, landing, rank); err != nil {
		panic("cpu.MatMulScatter: " + err.Error())
	}
	cols := w.Shape()[0]
	if !transW {
		cols = w.Shape()[1]
	}
	p := b.New(b.dt, a.Shape()[0], cols)
	if landing == backend.ScatterAtomic {
		b.MatMul(p, a, w, false, transW, 1, 0)
		b.scatterMu.Lock()
		defer b.scatterMu.Unlock()
		rows := a.Shape()[0] / len(dstsS)
		for s, d := range dstsS {
			b.Axpy(b.View(d, row0*cols, rows, cols), 1, b.View(p, s*rows*cols, rows, cols))
		}
		return
	}
	backend.MatMulScatterBySteps(b, p, dstsS, row0, a, w, transW, landing)
}
