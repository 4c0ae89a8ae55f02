package backend

import "fmt"

// ScatterLanding is how MatMulScatter lands a row in its owner's tensor.
type ScatterLanding int

const (
	// ScatterStore overwrites the rows: they are this rank's slot of the
	// owner's tensor.
	ScatterStore ScatterLanding = iota
	// ScatterAdd adds to the rows (read, add, write): they are this rank's
	// alone.
	ScatterAdd
	// ScatterAtomic adds atomically: every rank adds into the same rows,
	// in an order that varies from run to run.
	ScatterAtomic
)

func (l ScatterLanding) String() string {
	switch l {
	case ScatterStore:
		return "store"
	case ScatterAdd:
		return "add"
	case ScatterAtomic:
		return "atomic add"
	}
	return fmt.Sprintf("ScatterLanding(%d)", int(l))
}

// CheckAllGatherMatMul checks AllGatherMatMul's arguments: W shards of the
// same [B, K] shape, fullRK [W*B, K] or nil, one weight per output of
// [N, K] (transW) or [K, N], outs [W*B, N], rank in [0, W).
func CheckAllGatherMatMul(fullRK Tensor, outs, shardsBK, ws []Tensor, transW bool, rank int) error {
	w := len(shardsBK)
	if w == 0 || rank < 0 || rank >= w {
		return fmt.Errorf("rank %d of %d shards", rank, w)
	}
	if len(outs) != len(ws) {
		return fmt.Errorf("%d outputs but %d weights", len(outs), len(ws))
	}
	ss := shardsBK[0].Shape()
	if len(ss) != 2 {
		return fmt.Errorf("shard 0 has shape %v, want a matrix", ss)
	}
	for s, sh := range shardsBK {
		if got := sh.Shape(); len(got) != 2 || got[0] != ss[0] || got[1] != ss[1] {
			return fmt.Errorf("shard %d has shape %v, shard 0 %v", s, got, ss)
		}
	}
	if fullRK != nil {
		if fs := fullRK.Shape(); len(fs) != 2 || fs[0] != w*ss[0] || fs[1] != ss[1] {
			return fmt.Errorf("full has shape %v, want [%d %d]", fs, w*ss[0], ss[1])
		}
	}
	for i := range outs {
		os, ws := outs[i].Shape(), ws[i].Shape()
		n, k := 0, 0
		if len(ws) == 2 {
			n, k = ws[1], ws[0]
			if transW {
				n, k = ws[0], ws[1]
			}
		}
		if len(os) != 2 || len(ws) != 2 || os[0] != w*ss[0] || os[1] != n || k != ss[1] {
			return fmt.Errorf("output %d has shape %v and its weight %v (transposed: %v); the gathered rows are [%d %d]",
				i, os, ws, transW, w*ss[0], ss[1])
		}
	}
	return nil
}

// CheckMatMulScatter checks MatMulScatter's arguments: a [R, K], w [N, K]
// (transW) or [K, N], R a multiple of len(dstsS), and every dstsS[s] a
// matrix of N columns with R/len(dstsS) rows from row0.
func CheckMatMulScatter(dstsS []Tensor, row0 int, a, w Tensor, transW bool, landing ScatterLanding, rank int) error {
	n := len(dstsS)
	if n == 0 || rank < 0 || rank >= n {
		return fmt.Errorf("rank %d of %d destinations", rank, n)
	}
	if landing < ScatterStore || landing > ScatterAtomic {
		return fmt.Errorf("landing %v", landing)
	}
	as, ws := a.Shape(), w.Shape()
	if len(as) != 2 || len(ws) != 2 {
		return fmt.Errorf("a %v and w %v must be matrices", as, ws)
	}
	k, cols := ws[1], ws[0]
	if !transW {
		k, cols = ws[0], ws[1]
	}
	if as[1] != k {
		return fmt.Errorf("a %v and w %v (transposed: %v) do not chain", as, ws, transW)
	}
	if as[0]%n != 0 {
		return fmt.Errorf("a's %d rows do not split into %d blocks", as[0], n)
	}
	block := as[0] / n
	for s, d := range dstsS {
		ds := d.Shape()
		if len(ds) != 2 || ds[1] != cols || row0 < 0 || row0+block > ds[0] {
			return fmt.Errorf("destination %d has shape %v, want %d columns and rows [%d, %d)", s, ds, cols, row0, row0+block)
		}
	}
	return nil
}

// AllGatherMatMulBySteps is AllGatherMatMul as its unfused sequence on b:
// a copy of every shard into its block of fullRK (a scratch tensor when
// nil), then the products. It is the reference definition of the op (the
// CPU backend's) and serves any call a backend's fused kernel does not
// take.
func AllGatherMatMulBySteps(b Backend, fullRK Tensor, outs, shardsBK, ws []Tensor, transW bool) {
	n := shardsBK[0].Len()
	if fullRK == nil {
		ss := shardsBK[0].Shape()
		fullRK = b.New(shardsBK[0].DType(), len(shardsBK)*ss[0], ss[1])
	}
	for s, sh := range shardsBK {
		b.Copy(b.View(fullRK, s*n, sh.Shape()...), sh)
	}
	for i := range outs {
		b.MatMul(outs[i], fullRK, ws[i], false, transW, 1, 0)
	}
}

// MatMulScatterBySteps is MatMulScatter as its unfused sequence on b: the
// product into pRN (a scratch tensor of the float type, [R, N]), then each
// row block copied or added into its destination, in rank order. Callers
// serialise ScatterAtomic's adds into one tensor themselves.
func MatMulScatterBySteps(b Backend, pRN Tensor, dstsS []Tensor, row0 int, a, w Tensor, transW bool, landing ScatterLanding) {
	b.MatMul(pRN, a, w, false, transW, 1, 0)
	ps := pRN.Shape()
	block, cols := ps[0]/len(dstsS), ps[1]
	for s, d := range dstsS {
		src := b.View(pRN, s*block*cols, block, cols)
		dst := b.View(d, row0*cols, block, cols)
		if landing == ScatterStore {
			b.Copy(dst, src)
		} else {
			b.Axpy(dst, 1, src)
		}
	}
}
