package cpu

// Row gathers and scatters: the token embedding and the MoE dispatch/combine
// (GatherRows moves token rows to expert rows, ScatterAddRows adds weighted
// expert outputs back, RowDots gives the gradient of the combine weights).
// The scatters may hit one destination row many times, so they split work
// over columns rather than rows: no two workers write the same element, and
// each element receives its additions in index order.

import (
	"cmp"
	"slices"

	"github.com/mktrain/mktrain/backend"
)

// colChunk is the least number of columns worth a goroutine in a scatter.
const colChunk = 64

// rowChunk returns the least number of rows of width d worth a goroutine.
func rowChunk(d int) int { return max(1, elemChunk/max(d, 1)) }

// EmbeddingForward gathers outTD[t] = tableVD[idsT[t]].
func (b *Backend) EmbeddingForward(outTD, tableVD, idsT backend.Tensor) {
	const op = "EmbeddingForward"
	v, d := b.matrix(op, "table", tableVD)
	t, _ := b.matrix(op, "out", outTD)
	b.wantMatrix(op, "out", outTD, t, d)
	ids := indices(op, "ids", idsT, t, v, false)
	if b.dt == backend.Float32 {
		gatherRows(b, floats[float32](outTD), floats[float32](tableVD), ids, nil, d)
	} else {
		gatherRows(b, floats[float64](outTD), floats[float64](tableVD), ids, nil, d)
	}
}

// EmbeddingBackward accumulates dTableVD[idsT[t]] += dOutTD[t].
func (b *Backend) EmbeddingBackward(dTableVD, dOutTD, idsT backend.Tensor) {
	const op = "EmbeddingBackward"
	v, d := b.matrix(op, "dTable", dTableVD)
	t, _ := b.matrix(op, "dOut", dOutTD)
	b.wantMatrix(op, "dOut", dOutTD, t, d)
	ids := indices(op, "ids", idsT, t, v, false)
	if b.dt == backend.Float32 {
		scatterAddRows(b, floats[float32](dTableVD), floats[float32](dOutTD), ids, nil, d)
	} else {
		scatterAddRows(b, floats[float64](dTableVD), floats[float64](dOutTD), ids, nil, d)
	}
}

// GatherRows computes outND[i] = scaleN[i] * inTD[rowsN[i]]; scaleN may be
// nil (all ones). outND may be BFloat16 (the rows are rounded), and inTD
// BFloat16.
func (b *Backend) GatherRows(outND, inTD, rowsN, scaleN backend.Tensor) {
	const op = "GatherRows"
	t, d := b.operandMatrix(op, "in", inTD)
	n, _ := b.operandMatrix(op, "out", outND)
	b.wantOperandMatrix(op, "out", outND, n, d)
	defer b.roundIfBF16(outND)
	rows := indices(op, "rows", rowsN, n, t, false)
	if scaleN != nil {
		b.vector(op, "scale", scaleN, n)
	}
	if b.dt == backend.Float32 {
		gatherRows(b, floats[float32](outND), floats[float32](inTD), rows, floats[float32](scaleN), d)
	} else {
		gatherRows(b, floats[float64](outND), floats[float64](inTD), rows, floats[float64](scaleN), d)
	}
}

// ScatterAddRows computes outTD[rowsN[i]] += scaleN[i] * inND[i]; scaleN may
// be nil (all ones).
func (b *Backend) ScatterAddRows(outTD, inND, rowsN, scaleN backend.Tensor) {
	const op = "ScatterAddRows"
	t, d := b.matrix(op, "out", outTD)
	n, _ := b.matrix(op, "in", inND)
	b.wantMatrix(op, "in", inND, n, d)
	rows := indices(op, "rows", rowsN, n, t, false)
	if scaleN != nil {
		b.vector(op, "scale", scaleN, n)
	}
	if b.dt == backend.Float32 {
		scatterAddRows(b, floats[float32](outTD), floats[float32](inND), rows, floats[float32](scaleN), d)
	} else {
		scatterAddRows(b, floats[float64](outTD), floats[float64](inND), rows, floats[float64](scaleN), d)
	}
}

// GatherSumRows computes outTD[t] += Σ_k scaleTK[t,k]·inSD[posTK[t,k]], the
// terms in increasing position, skipping negative positions (see
// backend.Backend); inSD may be BFloat16.
func (b *Backend) GatherSumRows(outTD, inSD, posTK, scaleTK backend.Tensor) {
	const op = "GatherSumRows"
	t, d := b.matrix(op, "out", outTD)
	s, _ := b.operandMatrix(op, "in", inSD)
	b.wantOperandMatrix(op, "in", inSD, s, d)
	k, err := backend.GatherSumK(posTK, t)
	if err != nil {
		fail(op, "%v", err)
	}
	pos := indices(op, "pos", posTK, t*k, s, true)
	row := make([]int32, 0, k)
	for r := range t {
		row = row[:0]
		for _, p := range pos[r*k : (r+1)*k] {
			if p >= 0 {
				row = append(row, p)
			}
		}
		slices.Sort(row)
		for i := 1; i < len(row); i++ {
			if row[i] == row[i-1] {
				fail(op, "pos row %d names position %d twice", r, row[i])
			}
		}
	}
	if scaleTK != nil {
		b.vector(op, "scale", scaleTK, t*k)
	}
	if b.dt == backend.Float32 {
		gatherSumRows(b, floats[float32](outTD), floats[float32](inSD), pos, floats[float32](scaleTK), k, d)
	} else {
		gatherSumRows(b, floats[float64](outTD), floats[float64](inSD), pos, floats[float64](scaleTK), k, d)
	}
}

// RowDots computes outN[i] = dot(aTD[rowsN[i]], bND[i]), accumulated in
// float64.
func (b *Backend) RowDots(outN, aTD, rowsN, bND backend.Tensor) {
	const op = "RowDots"
	t, d := b.matrix(op, "a", aTD)
	n, _ := b.operandMatrix(op, "b", bND)
	b.wantOperandMatrix(op, "b", bND, n, d)
	b.vector(op, "out", outN, n)
	rows := indices(op, "rows", rowsN, n, t, false)
	if b.dt == backend.Float32 {
		rowDots(b, floats[float32](outN), floats[float32](aTD), rows, floats[float32](bND), d)
	} else {
		rowDots(b, floats[float64](outN), floats[float64](aTD), rows, floats[float64](bND), d)
	}
}

// gatherRows computes out[i] = scale[i] * in[rows[i]] (scale nil: 1).
func gatherRows[T Float](b *Backend, out, in []T, rows []int32, scale []T, d int) {
	b.parallelFor(len(rows), rowChunk(d), func(lo, hi int) {
		for i := lo; i < hi; i++ {
			r := int(rows[i])
			dst := out[i*d : (i+1)*d]
			src := in[r*d : (r+1)*d]
			if scale == nil {
				copy(dst, src)
				continue
			}
			s := scale[i]
			for j, v := range src[:len(dst)] {
				dst[j] = s * v
			}
		}
	})
}

// scatterAddRows computes out[rows[i]] += scale[i] * in[i] (scale nil: 1),
// split over columns.
func scatterAddRows[T Float](b *Backend, out, in []T, rows []int32, scale []T, d int) {
	b.parallelFor(d, colChunk, func(lo, hi int) {
		for i, r := range rows {
			dst := out[int(r)*d+lo : int(r)*d+hi]
			src := in[i*d+lo : i*d+hi][:len(dst)]
			if scale == nil {
				for j, v := range src {
					dst[j] += v
				}
				continue
			}
			s := scale[i]
			for j, v := range src {
				dst[j] += s * v
			}
		}
	})
}

// gatherSumRows adds to each output row t its rows of in in increasing
// position, each product rounded before its sum (T(s*v): never fused, as
// the GPU kernel rounds them).
func gatherSumRows[T Float](b *Backend, out, in []T, pos []int32, scale []T, k, d int) {
	b.parallelFor(len(pos)/max(k, 1), rowChunk(k*d), func(lo, hi int) {
		order := make([]int, 0, k) // the token's assignments j, by position
		for t := lo; t < hi; t++ {
			order = order[:0]
			for j := t * k; j < (t+1)*k; j++ {
				if pos[j] >= 0 {
					order = append(order, j)
				}
			}
			slices.SortFunc(order, func(a, b int) int { return cmp.Compare(pos[a], pos[b]) })
			dst := out[t*d : (t+1)*d]
			for _, j := range order {
				p := int(pos[j])
				src := in[p*d : (p+1)*d][:len(dst)]
				if scale == nil {
					for c, v := range src {
						dst[c] += v
					}
					continue
				}
				s := scale[j]
				for c, v := range src {
					dst[c] += T(s * v)
				}
			}
		}
	})
}

// rowDots computes out[i] = dot(a[rows[i]], bm[i]) in float64.
func rowDots[T Float](b *Backend, out, a []T, rows []int32, bm []T, d int) {
	b.parallelFor(len(rows), rowChunk(d), func(lo, hi int) {
		for i := lo; i < hi; i++ {
			r := int(rows[i])
			x := a[r*d : (r+1)*d]
			y := bm[i*d : (i+1)*d][:len(x)]
			var s float64
			for j, v := range x {
				s += float64(v) * float64(y[j])
			}
			out[i] = T(s)
		}
	})
}
