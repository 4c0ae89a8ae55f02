package cuda

// The Backend's ops that map onto the kernels of package kernels one for
// one: elementwise ops and reductions, embedding, RMSNorm, SwiGLU,
// cross-entropy, row gathers and scatters, AdamW. Each checks its
// arguments as backend/cpu does and queues its kernel; none waits for the
// GPU except the reductions, which return a number.

import (
	"fmt"
	"math"
	"runtime"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// Zero clears t (float32, bfloat16 or int32).
func (b *Backend) Zero(t backend.Tensor) {
	ct := tensorOf("Zero", "t", t)
	if ct == nil {
		fail("Zero", "tensor is nil")
	}
	b.zero(ct)
}

// zero queues clearing t's elements: in 32-bit words where t's bytes start
// and end on word boundaries (always, but for bf16 views), else bytewise.
func (b *Backend) zero(t *Tensor) {
	n := int64(t.Len())
	if n == 0 || t.st.buf == nil {
		return
	}
	size := int64(dtypeBytes(t.dt))
	off, bytes := size*int64(t.off), size*n
	if off%4 == 0 && bytes%4 == 0 {
		b.fail(b.dev.Memset32(t.st.buf, off/4, bytes/4, 0))
		return
	}
	b.fail(b.dev.Memset8(t.st.buf, off, bytes, 0))
}

// Copy copies src into dst: same dtype and length, shapes may differ.
func (b *Backend) Copy(dst, src backend.Tensor) {
	const op = "Copy"
	d, s := tensorOf(op, "dst", dst), tensorOf(op, "src", src)
	if d == nil || s == nil {
		fail(op, "nil tensor")
	}
	rounding := d.dt == backend.BFloat16 && s.dt == backend.Float32
	if d.dt != s.dt && !rounding {
		fail(op, "dst is %v but src is %v", d.dt, s.dt)
	}
	if d.Len() != s.Len() {
		fail(op, "dst has shape %v but src has shape %v", d.shape, s.shape)
	}
	if rounding {
		// The conversion kernels the products round their operands with.
		if n := d.Len(); n > 0 {
			dp, okD := d.ptr()
			sp, okS := s.ptr()
			if okD && okS {
				b.fail(b.gemm.roundToBF16(dp, sp, int64(n)))
			}
		}
		runtime.KeepAlive(d)
		runtime.KeepAlive(s)
		return
	}
	// A copy of a tensor onto itself (the in-place collectives do that) is
	// a no-op, never a device copy between overlapping ranges.
	sameRange := d.st.buf == s.st.buf && d.off == s.off
	if n := d.Len(); n > 0 && d.st.buf != nil && s.st.buf != nil && !sameRange {
		size := int64(dtypeBytes(d.dt))
		b.fail(b.dev.CopyDevice(d.st.buf, size*int64(d.off), s.st.buf, size*int64(s.off), size*int64(n)))
	}
	runtime.KeepAlive(d)
	runtime.KeepAlive(s)
}

// Axpy computes dst += alpha*x.
func (b *Backend) Axpy(dst backend.Tensor, alpha float64, x backend.Tensor) {
	d := float("Axpy", "dst", dst)
	xs := vector("Axpy", "x", x, d.Len())
	if n := d.Len(); n > 0 {
		b.launch(b.k.axpy, b.strideGrid(n), d, float32(alpha), xs, int64(n))
	}
}

// Scale computes t *= alpha.
func (b *Backend) Scale(t backend.Tensor, alpha float64) {
	ct := float("Scale", "t", t)
	if n := ct.Len(); n > 0 {
		b.launch(b.k.scale, b.strideGrid(n), ct, float32(alpha), int64(n))
	}
}

// Sum returns the sum of t's elements, accumulated in float64. It waits for
// the GPU.
func (b *Backend) Sum(t backend.Tensor) float64 {
	return b.reduce(float("Sum", "t", t), false)()
}

// SumSquares returns the sum of the squares of t's elements, accumulated in
// float64. It waits for the GPU.
func (b *Backend) SumSquares(t backend.Tensor) float64 {
	return b.reduce(float("SumSquares", "t", t), true)()
}

// SumLater queues Sum(t); the function it returns waits for the GPU
// (backend.LaterReducer).
func (b *Backend) SumLater(t backend.Tensor) func() float64 {
	return b.reduce(float("SumLater", "t", t), false)
}

// SumSquaresLater queues SumSquares(t); the function it returns waits for
// the GPU (backend.LaterReducer).
func (b *Backend) SumSquaresLater(t backend.Tensor) func() float64 {
	return b.reduce(float("SumSquaresLater", "t", t), true)
}

// reduce queues sum_partial_f32 on a fixed grid (so the same tensor gives
// the same bits every time) and the copy of its per-block float64
// partials behind it (blockSums). A failure returns NaN and waits for
// Sync.
func (b *Backend) reduce(t *Tensor, squares bool) func() float64 {
	n := t.Len()
	if n == 0 {
		return func() float64 { return 0 }
	}
	g := b.strideGrid(n)
	buf := b.partials(g)
	if buf == nil {
		return math.NaN
	}
	sq := int32(0)
	if squares {
		sq = 1
	}
	b.launch(b.k.sumPartial, g, t, int64(n), sq, buf)
	return b.blockSums(buf, int(g.Grid.X))
}

// partials allocates one float64 per block of a kernel launched on grid,
// for its per-block sums; nil when the allocation fails (the failure
// waits for Sync).
func (b *Backend) partials(grid Grid) *Buffer {
	buf, err := b.alloc(int64(8 * grid.Grid.X))
	if err != nil {
		b.fail(err)
		return nil
	}
	return buf
}

// blockSums queues the copy of buf's per-block float64 partials (blocks
// of them) to the host behind the kernel that writes them, which must be
// queued before it
// (Device.StartCopyFromDevice), and returns the function that waits for
// that copy alone, adds the partials in order and frees buf. So a step's
// reductions queued before its loss wait are on the host when that wait
// ends, without a round trip each. A failure returns NaN and waits for
// Sync.
func (b *Backend) blockSums(buf *Buffer, blocks int) func() float64 {
	partials := make([]float64, blocks)
	wait, err := b.dev.StartCopyFromDevice(buf, 0, 8*blocks)
	if err != nil { // more partials than a slot holds: copy them when asked
		wait = func(dst []byte) error { return b.dev.CopyFromDevice(dst, buf, 0) }
	}
	return func() float64 {
		defer b.dev.Free(buf)
		if err := wait(Bytes(partials)); err != nil {
			b.fail(err)
			return math.NaN()
		}
		var s float64
		for _, p := range partials {
			s += p
		}
		return s
	}
}

// EmbeddingForward gathers rows: outTD[t] = tableVD[idsT[t]]. An id outside
// the table gives a row of NaNs.
func (b *Backend) EmbeddingForward(outTD, tableVD, idsT backend.Tensor) {
	const op = "EmbeddingForward"
	table, v, d := matrix(op, "table", tableVD)
	out, t, _ := matrix(op, "out", outTD)
	wantMatrix(op, "out", outTD, t, d)
	ids := indices(op, "ids", idsT, t)
	fitsInt32(op, t, d, v)
	if t > 0 && d > 0 {
		b.launch(b.k.embedFwd, Grid1D(t, 256), out, table, ids, int32(t), int32(d), int32(v))
	}
}

// EmbeddingBackward accumulates dTableVD[idsT[t]] += dOutTD[t]. Repeated
// ids add through atomics, so the last bits may vary from run to run. Ids
// outside the table are skipped.
func (b *Backend) EmbeddingBackward(dTableVD, dOutTD, idsT backend.Tensor) {
	const op = "EmbeddingBackward"
	dTable, v, d := matrix(op, "dTable", dTableVD)
	dOut, t, _ := matrix(op, "dOut", dOutTD)
	wantMatrix(op, "dOut", dOutTD, t, d)
	ids := indices(op, "ids", idsT, t)
	fitsInt32(op, t, d, v)
	switch {
	case t == 0 || d == 0:
	case b.deterministic.Load():
		b.scatterOrdered(dTable, dOut, ids, nil, t, d, v)
	default:
		b.launch(b.k.embedBwd, Grid1D(t, 256), dTable, dOut, ids, int32(t), int32(d), int32(v))
	}
}

// RMSNormForward: out = x / rms(x) * w, saving rstdT = 1/rms(x); out is
// float32 or bf16 (rounded once). copyTD, when not nil, gets x in the
// same pass.
func (b *Backend) RMSNormForward(outTD, rstdT, copyTD, xTD, wD backend.Tensor, eps float64) {
	const op = "RMSNormForward"
	x, t, d := matrix(op, "x", xTD)
	out := wantOperandMatrix(op, "out", outTD, t, d)
	rstd := vector(op, "rstd", rstdT, t)
	w := vector(op, "w", wD, d)
	var cp *Tensor
	if copyTD != nil {
		cp = wantMatrix(op, "copy", copyTD, t, d)
		if overlaps(cp, x) || overlaps(cp, out) {
			fail(op, "copy (%s) overlaps x or out", cp.describe())
		}
	}
	fitsInt32(op, t, d)
	if t == 0 {
		return
	}
	if rmsWarpRows(d) && aligned4(out, x, w) && (cp == nil || aligned4(cp)) {
		k := b.k.rmsFwdWarps
		if out.dt == backend.BFloat16 {
			k = b.k.rmsFwdWarpsBF16
		}
		b.launch(k, Grid1D((t+7)/8, 256), out, rstd, cp, x, w, int32(t), int32(d), float32(eps))
		return
	}
	k := b.k.rmsFwd
	if out.dt == backend.BFloat16 {
		k = b.k.rmsFwdBF16
	}
	b.launch(k, Grid1D(t, 256), out, rstd, cp, x, w, int32(t), int32(d), float32(eps))
}

// rmsWarpMaxD is the widest row the warp-per-row RMSNorm kernels take
// (rmsnorm.cu's RMS_WARP_MAXCH four-float columns a lane).
const rmsWarpMaxD = 1024

// rmsWarpRows reports whether the warp-per-row RMSNorm kernels take rows
// of d columns (their tensors 16-byte aligned besides): a warp per row
// with 16-byte loads and a shuffle sum, where the block-per-row kernels
// spend two barriers a row (moe-small's profiled calls on an H200 at
// 44e5f8c: forward 45.9 µs against 71.3, backward 137.7 against 158.1).
func rmsWarpRows(d int) bool { return d%128 == 0 && d <= rmsWarpMaxD }

// rmsRowsPerBlock is how many rows one block of the dw kernel sums into
// its partial sums: enough to keep the partial sums (and the reduce
// kernel's reads of them) small, few enough to fill the GPU for a few
// thousand rows. plan/terms.go mirrors it to size the partial sums.
const rmsRowsPerBlock = 32

// rmsWarpRowsPerBlock is rmsRowsPerBlock for rmsnorm_backward_warps_f32
// (16 rows a warp). Fewer rows a block mean more partial rows, each a
// shared-memory sum in its block and a row the reduce adds; more mean
// fewer blocks. On an H100 (2026-12-05, kernels/rmsnorm.md),
// TestRMSNormBackwardRowsFigures at moe-small's 16384 rows of 1024 (the
// kernel and its reduce) took 145.5/122.4/108.9/103.1/103.7 µs at
// 16/32/64/128/256 rows a block: 128 is the fastest, 2.60 TB/s, 16% under
// 32 rows' time. Measured at that shape only: a few thousand rows leave
// SMs idle at 128 (4096 rows: 32 blocks). Its partial sums are a quarter
// of rmsRowsPerBlock's, within the plan's size for them.
const rmsWarpRowsPerBlock = 128

// rmsBwdMaxD is the widest row rmsnorm_backward_f32 takes (RMS_BWD_COLS
// columns for each of at most 1024 threads); wider rows take the
// two-kernel path (rmsnorm_backward_dx_f32, rmsnorm_backward_dw_f32).
const rmsBwdMaxD = 8 * 1024

// RMSNormBackward writes dxTD = beta*dxTD + the gradient of x and
// accumulates into dwD.
func (b *Backend) RMSNormBackward(dxTD, dwD, doutTD, xTD, wD, rstdT backend.Tensor, beta float64) {
	const op = "RMSNormBackward"
	x, t, d := matrix(op, "x", xTD)
	dx := wantMatrix(op, "dx", dxTD, t, d)
	dout := wantMatrix(op, "dout", doutTD, t, d)
	dw := vector(op, "dw", dwD, d)
	w := vector(op, "w", wD, d)
	rstd := vector(op, "rstd", rstdT, t)
	fitsInt32(op, t, d)
	if overlaps(dx, dout) {
		fail(op, "dx (%s) overlaps dout (%s)", dx.describe(), dout.describe())
	}
	if t == 0 || d == 0 {
		return
	}
	// Each block of rows writes its column sums to partial, which the
	// reduce kernel adds to dw in block order: the same bits on every
	// run, unlike atomics. (The two-kernel path's grid has at most 65535
	// block rows; the one-pass kernels keep their row count.)
	warpPerRow := rmsWarpRows(d) && aligned4(dx, dout, x, w)
	rows := rmsRowsPerBlock
	if warpPerRow {
		rows = rmsWarpRowsPerBlock
	}
	rows = max(rows, (t+65534)/65535)
	blockRows := (t + rows - 1) / rows
	partial, err := b.dev.Alloc(int64(4 * blockRows * d))
	if err != nil {
		b.fail(err)
		return
	}
	defer func() { b.fail(b.dev.Free(partial)) }() // stream-ordered: after the kernels below
	if warpPerRow {
		// The same pass with a warp per row, the block's warps' column
		// sums added in warp order into its row of partial.
		b.launch(b.k.rmsBwdWarps, Grid1D(blockRows, 256), dx, partial, dout, x, w, rstd, int32(t), int32(d), int32(rows), float32(beta))
	} else if d <= rmsBwdMaxD {
		// One pass over dout and x for dx and dw: a thread per four
		// columns (eight above 4096), in whole warps.
		threads := min(1024, max(32, ((d+3)/4+31)/32*32))
		b.launch(b.k.rmsBwd, Grid1D(blockRows, threads), dx, partial, dout, x, w, rstd, int32(t), int32(d), int32(rows), float32(beta))
	} else {
		// dw's partials first: dx may be x itself (the interface allows
		// it), and the dx kernel overwrites it.
		g := Grid{Grid: driver.Dim3{X: (d + 31) / 32, Y: blockRows, Z: 1}, Block: driver.Dim3{X: 32, Y: 8, Z: 1}}
		b.launch(b.k.rmsBwdDw, g, partial, dout, x, rstd, int32(t), int32(d), int32(rows))
		b.launch(b.k.rmsBwdDx, Grid1D(t, 256), dx, dout, x, w, rstd, int32(t), int32(d), float32(beta))
	}
	b.launch(b.k.rmsDwReduce, b.strideGrid(d), dw, partial, int32(blockRows), int32(d))
}

// SwiGLUForward: out = silu(a) * b, elementwise over [N, F]. a and b are
// both float32 or both bfloat16; out is either (rounded when bf16).
func (b *Backend) SwiGLUForward(outNF, aNF, bNF backend.Tensor) {
	const op = "SwiGLUForward"
	a, n, f := operandMatrix(op, "a", aNF)
	bv := wantOperandMatrix(op, "b", bNF, n, f)
	sameDType(op, "a", a, "b", bv)
	out := wantOperandMatrix(op, "out", outNF, n, f)
	m := n * f
	if m == 0 {
		return
	}
	in16, out16 := a.dt == backend.BFloat16, out.dt == backend.BFloat16
	if in16 || out16 {
		b.launch(b.k.swigluFwdBF16[bit(in16)][bit(out16)], b.strideGrid(m), out, a, bv, int64(m), vecFlag(out, a, bv))
		return
	}
	k := b.k.swigluFwd
	if aligned4(out, a, bv) {
		k = b.k.swigluFwdX4
	}
	b.launch(k, b.strideGrid(m), out, a, bv, int64(m))
}

// SwiGLUBackward writes daNF and dbNF. dout is float32; a and b are both
// float32 or both bfloat16, and so are da and db (rounded when bf16).
func (b *Backend) SwiGLUBackward(daNF, dbNF, doutNF, aNF, bNF backend.Tensor) {
	const op = "SwiGLUBackward"
	a, n, f := operandMatrix(op, "a", aNF)
	bv := wantOperandMatrix(op, "b", bNF, n, f)
	sameDType(op, "a", a, "b", bv)
	dout := wantMatrix(op, "dout", doutNF, n, f)
	da := wantOperandMatrix(op, "da", daNF, n, f)
	db := wantOperandMatrix(op, "db", dbNF, n, f)
	sameDType(op, "da", da, "db", db)
	m := n * f
	if m == 0 {
		return
	}
	in16, out16 := a.dt == backend.BFloat16, da.dt == backend.BFloat16
	if in16 || out16 {
		b.launch(b.k.swigluBwdBF16[bit(in16)][bit(out16)], b.strideGrid(m), da, db, dout, a, bv, int64(m), vecFlag(da, db, dout, a, bv))
		return
	}
	k := b.k.swigluBwd
	if aligned4(da, db, dout, a, bv) {
		k = b.k.swigluBwdX4
	}
	b.launch(k, b.strideGrid(m), da, db, dout, a, bv, int64(m))
}

// bit is 1 for true, as an index.
func bit(v bool) int {
	if v {
		return 1
	}
	return 0
}

// vecFlag is the vec argument of the kernels that move four elements per
// access: 1 when aligned4(ts...), else 0.
func vecFlag(ts ...*Tensor) int32 { return int32(bit(aligned4(ts...))) }

// aligned4 reports whether every tensor starts on a multiple of four of its
// elements (16 bytes for float32, 8 for bf16), as the kernels that move
// four elements per access (the _x4 kernels, and those given vec = 1)
// need. Tensors from the allocator are; views at other offsets are not.
func aligned4(ts ...*Tensor) bool {
	for _, t := range ts {
		p, ok := t.ptr()
		if !ok || p%driver.DevicePtr(4*dtypeBytes(t.dt)) != 0 {
			return false
		}
	}
	return true
}

// ceRegMaxV is the widest row cross_entropy_f32_reg holds in registers:
// 1024 threads x CE_VEC (8) float4s.
const ceRegMaxV = 1024 * 8 * 4

// CrossEntropy: lossT[t] = logsumexp(logits[t]) - logits[t][targets[t]],
// dlogitsTV = (softmax - onehot) * gradScale (dlogitsTV may be logitsTV or
// nil); a negative target gives loss 0 and a zero gradient row, a target
// past the vocabulary a NaN loss.
func (b *Backend) CrossEntropy(lossT, dlogitsTV, logitsTV, targetsT backend.Tensor, gradScale float64) {
	const op = "CrossEntropy"
	logits, t, v := matrix(op, "logits", logitsTV)
	loss := vector(op, "loss", lossT, t)
	var dlogits *Tensor
	if dlogitsTV != nil {
		dlogits = wantOperandMatrix(op, "dlogits", dlogitsTV, t, v)
	}
	targets := indices(op, "targets", targetsT, t)
	fitsInt32(op, t, v)
	if t == 0 {
		return
	}
	k, kReg := b.k.crossEntropy, b.k.crossEntropyReg
	if dlogits != nil && dlogits.dt == backend.BFloat16 {
		k, kReg = b.k.crossEntropyBF16, b.k.crossEntropyBF16Reg
	}
	// Rows that fit in registers are read once (cross_entropy_f32_reg).
	if v%4 == 0 && v <= ceRegMaxV && aligned4(logits) && (dlogits == nil || aligned4(dlogits)) {
		b.launch(kReg, Grid1D(t, 1024), loss, dlogits, logits, targets, int32(t), int32(v), float32(gradScale))
		return
	}
	b.launch(k, Grid1D(t, 256), loss, dlogits, logits, targets, int32(t), int32(v), float32(gradScale))
}

// GatherRows: outND[i] = scale[i] * inTD[rowsN[i]]; scaleN may be nil (1).
// outND may be bfloat16 (rounded), and inTD bfloat16 (widened).
func (b *Backend) GatherRows(outND, inTD, rowsN, scaleN backend.Tensor) {
	const op = "GatherRows"
	in, t, d := operandMatrix(op, "in", inTD)
	out, n, _ := operandMatrix(op, "out", outND)
	wantOperandMatrix(op, "out", outND, n, d)
	rows := indices(op, "rows", rowsN, n)
	scale := optFloat(op, "scale", scaleN, n)
	fitsInt32(op, t, n, d)
	if n == 0 || d == 0 {
		return
	}
	if out.dt == backend.BFloat16 || in.dt == backend.BFloat16 {
		// Four at a time when every row starts aligned: d a multiple of 4.
		vec := int32(0)
		if d%4 == 0 {
			vec = vecFlag(out, in)
		}
		k := b.k.gatherRowsBF16
		switch {
		case in.dt == backend.BFloat16 && out.dt == backend.BFloat16:
			k = b.k.gatherRowsBF16BF16
		case in.dt == backend.BFloat16:
			k = b.k.gatherRowsFromBF16
		}
		b.launch(k, Grid1D(n, 256), out, in, rows, scale, int32(n), int32(d), vec)
		return
	}
	if d < narrowRows {
		b.launch(b.k.gatherRowsNarrow, b.strideGrid(n*d), out, in, rows, scale, int32(n), int32(d))
		return
	}
	b.launch(b.k.gatherRows, Grid1D(n, 256), out, in, rows, scale, int32(n), int32(d))
}

// narrowRows is the row width below which the float32 gather and
// scatter-add run one thread per element instead of a block of 256 per
// row (the MoE gates, one value a row: 32,768 blocks of one busy thread
// took about 25 us a call at moe-small's shape in the profile at fdd8c22).
const narrowRows = 64

// ScatterAddRows: outTD[rowsN[i]] += scale[i] * inND[i]; scaleN may be nil.
// Rows hit more than once add through atomics.
func (b *Backend) ScatterAddRows(outTD, inND, rowsN, scaleN backend.Tensor) {
	const op = "ScatterAddRows"
	out, t, d := matrix(op, "out", outTD)
	in, n, _ := matrix(op, "in", inND)
	wantMatrix(op, "in", inND, n, d)
	rows := indices(op, "rows", rowsN, n)
	scale := optFloat(op, "scale", scaleN, n)
	fitsInt32(op, t, n, d)
	switch {
	case n == 0 || d == 0:
	case b.deterministic.Load():
		b.scatterOrdered(out, in, rows, scale, n, d, t)
	case d < narrowRows:
		b.launch(b.k.scatterAddRowsNarrow, b.strideGrid(n*d), out, in, rows, scale, int32(n), int32(d))
	default:
		b.launch(b.k.scatterAddRows, Grid1D(n, 256), out, in, rows, scale, int32(n), int32(d))
	}
}

// gatherSumMaxK is the most rows GatherSumRows adds into one output row
// (kernels/rows.cu's RW_MAX_K).
const gatherSumMaxK = 64

// GatherSumRows: outTD[t] += Σ_k scaleTK[t,k]·inSD[posTK[t,k]] (see
// backend.Backend): one block per output row, its terms in increasing
// position, each product and sum rounded on its own (the CPU backend's
// bits), so it needs no ordered form under SetDeterministic.
func (b *Backend) GatherSumRows(outTD, inSD, posTK, scaleTK backend.Tensor) {
	const op = "GatherSumRows"
	out, t, d := matrix(op, "out", outTD)
	in, s, _ := operandMatrix(op, "in", inSD)
	wantOperandMatrix(op, "in", inSD, s, d)
	k, err := backend.GatherSumK(posTK, t)
	if err != nil {
		fail(op, "%v", err)
	}
	if k > gatherSumMaxK {
		fail(op, "pos has %d rows per output row; the kernel adds at most %d", k, gatherSumMaxK)
	}
	pos := indices(op, "pos", posTK, t*k)
	scale := optFloat(op, "scale", scaleTK, t*k)
	fitsInt32(op, t, s, d, t*k)
	if t == 0 || d == 0 || k == 0 {
		return
	}
	vec := int32(0)
	if d%4 == 0 {
		vec = vecFlag(out, in)
	}
	kern := b.k.gatherSumRows
	if in.dt == backend.BFloat16 {
		kern = b.k.gatherSumRowsFromBF16
	}
	b.launch(kern, Grid1D(t, 256), out, in, pos, scale, int32(t), int32(k), int32(d), vec)
}

// scatterOrdered is ScatterAddRows (and EmbeddingBackward) under
// SetDeterministic: out[rows[i]] += scale[i] * in[i] for rows[i] in
// [0, t), each output element summed by one thread in increasing i
// (kernels/rows.cu). The stable sort of the rows costs O(n^2) comparisons,
// spread over (n/1024) x (n/4096) blocks. in and rows have n rows; scale
// may be nil. docs/performance.md has its cost.
func (b *Backend) scatterOrdered(out, in, rows, scale *Tensor, n, d, t int) {
	// One scratch buffer: rank, then order, then the sorted rows.
	scratch, err := b.dev.Alloc(int64(3 * 4 * n))
	if err != nil {
		b.fail(err)
		return
	}
	defer func() { b.fail(b.dev.Free(scratch)) }() // stream-ordered: after the kernels below
	if err := b.dev.Memset32(scratch, 0, int64(n), 0); err != nil {
		b.fail(err)
		return
	}
	rank, order, sorted := scratch.ptr, scratch.ptr+driver.DevicePtr(4*n), scratch.ptr+driver.DevicePtr(8*n)
	rankGrid := Grid{Grid: driver.Dim3{X: (n + 1023) / 1024, Y: (n + 4095) / 4096, Z: 1}, Block: driver.Dim3{X: 256, Y: 1, Z: 1}}
	b.launch(b.k.stableRank, rankGrid, rank, rows, int32(n))
	b.launch(b.k.stablePlace, b.strideGrid(n), order, sorted, rank, rows, int32(n))
	b.launch(b.k.scatterAddRowsOrdered, Grid1D(n, 256), out, in, sorted, scale, order, int32(n), int32(d), int32(t))
}

// RowDots: outN[i] = dot(aTD[rowsN[i]], bND[i]).
func (b *Backend) RowDots(outN, aTD, rowsN, bND backend.Tensor) {
	const op = "RowDots"
	a, t, d := matrix(op, "a", aTD)
	bm, n, _ := operandMatrix(op, "b", bND)
	wantOperandMatrix(op, "b", bND, n, d)
	out := vector(op, "out", outN, n)
	rows := indices(op, "rows", rowsN, n)
	fitsInt32(op, t, n, d)
	k := b.k.rowDots
	if bm.dt == backend.BFloat16 {
		k = b.k.rowDotsBF16
	}
	vec := int32(0)
	if d%4 == 0 {
		vec = vecFlag(a, bm)
	}
	if n > 0 {
		b.launch(k, b.strideGrid(32*n), out, a, rows, bm, int32(n), int32(d), vec)
	}
}

// AdamWUpdate updates param in place from grad with moments m and v, in
// float64 arithmetic on the float32 state as the CPU backend does.
func (b *Backend) AdamWUpdate(param, grad, m, v backend.Tensor, h backend.AdamW) {
	b.adamW("AdamWUpdate", param, grad, m, v, h, false)
}

// AdamWUpdateSquares is AdamWUpdate that also sums grad's squares in the
// same pass (backend.SquaringOptimizer): each block of the kernel adds its
// share in a fixed order, the host the blocks' sums in order.
func (b *Backend) AdamWUpdateSquares(param, grad, m, v backend.Tensor, h backend.AdamW) func() float64 {
	return b.adamW("AdamWUpdateSquares", param, grad, m, v, h, true)
}

// adamW runs adamw_f32 (adamw_f32_x4 where every tensor is 16-byte
// aligned), with the squares' per-block sums when squares is set.
func (b *Backend) adamW(op string, param, grad, m, v backend.Tensor, h backend.AdamW, squares bool) func() float64 {
	p := float(op, "param", param)
	n := p.Len()
	g := vector(op, "grad", grad, n)
	mm := vector(op, "m", m, n)
	vv := vector(op, "v", v, n)
	bc1, bc2, decay := adamWFactors(op, h)
	if n == 0 {
		return func() float64 { return 0 }
	}
	k := b.k.adamw
	if aligned4(p, g, mm, vv) {
		k = b.k.adamwX4
	}
	grid := b.strideGrid(n)
	sq := b.squaresOut(grid, squares)
	b.launch(k, grid, p, g, mm, vv, int64(n), h.LR, h.Beta1, h.Beta2, h.Eps, decay, bc1, bc2, h.GradFactor(), sq)
	return b.squaresSum(sq, grid, squares)
}

// squaresOut is where an AdamW kernel launched on grid writes its blocks'
// sums of the gradient's squares: a buffer when want is set, else nil
// (the kernel's null sq). Also nil when the allocation fails (the
// failure waits for Sync): the update runs without the sums.
func (b *Backend) squaresOut(grid Grid, want bool) *Buffer {
	if !want {
		return nil
	}
	return b.partials(grid)
}

// squaresSum is the function returning the total of an AdamW kernel's
// squares, called once the kernel is queued: nil where none were wanted,
// NaN where their buffer could not be allocated.
func (b *Backend) squaresSum(out *Buffer, grid Grid, wanted bool) func() float64 {
	switch {
	case !wanted:
		return nil
	case out == nil:
		return math.NaN
	}
	return b.blockSums(out, int(grid.Grid.X))
}

// adamWFactors are AdamW's bias corrections 1 - beta^step and its decay
// factor 1 - lr*wd, which the kernels take.
func adamWFactors(op string, h backend.AdamW) (bc1, bc2, decay float64) {
	if h.Step < 1 {
		fail(op, "step %d must count from 1", h.Step)
	}
	return 1 - math.Pow(h.Beta1, float64(h.Step)), 1 - math.Pow(h.Beta2, float64(h.Step)), 1 - h.LR*h.WeightDecay
}

// AdamWUpdateSplit is AdamWUpdate on split float32 masters
// (backend.SplitMaster), in adamw.cu's adamw_split: the same arithmetic as
// adamw_f32 on the joined masters, one pair of weights per step.
func (b *Backend) AdamWUpdateSplit(hi, lo, grad, m, v backend.Tensor, h backend.AdamW) {
	b.adamWSplit("AdamWUpdateSplit", hi, lo, grad, m, v, h, false)
}

// AdamWUpdateSplitSquares is AdamWUpdateSplit that also sums grad's
// squares in the same pass, as AdamWUpdateSquares does.
func (b *Backend) AdamWUpdateSplitSquares(hi, lo, grad, m, v backend.Tensor, h backend.AdamW) func() float64 {
	return b.adamWSplit("AdamWUpdateSplitSquares", hi, lo, grad, m, v, h, true)
}

func (b *Backend) adamWSplit(op string, hi, lo, grad, m, v backend.Tensor, h backend.AdamW, squares bool) func() float64 {
	if hi == nil {
		fail(op, "hi is nil")
	}
	hs := tensorOf(op, "hi", hi)
	if hs.dt != backend.BFloat16 {
		fail(op, "hi is %v, want bfloat16", hs.dt)
	}
	n := hs.Len()
	if n%2 != 0 {
		fail(op, "hi has %d elements; split masters come in pairs", n)
	}
	ls := indices(op, "lo", lo, n/2)
	g := vector(op, "grad", grad, n)
	mm := vector(op, "m", m, n)
	vv := vector(op, "v", v, n)
	bc1, bc2, decay := adamWFactors(op, h)
	if n == 0 {
		return func() float64 { return 0 }
	}
	// Pairs: hi and lo a 4-byte word each, grad, m and v 8 bytes.
	for _, a := range []struct {
		t     *Tensor
		bytes driver.DevicePtr
	}{{hs, 4}, {ls, 4}, {g, 8}, {mm, 8}, {vv, 8}} {
		if p, ok := a.t.ptr(); ok && p%a.bytes != 0 {
			fail(op, "a tensor starts at an odd element; split masters come in aligned pairs")
		}
	}
	grid := b.strideGrid(n / 2)
	sq := b.squaresOut(grid, squares)
	b.launch(b.k.adamwSplit, grid, hs, ls, g, mm, vv, int64(n/2), h.LR, h.Beta1, h.Beta2, h.Eps, decay, bc1, bc2, h.GradFactor(), sq)
	return b.squaresSum(sq, grid, squares)
}

// devicePtrs returns the addresses of ts (0 for nil) and whether every
// tensor has memory; a tensor whose allocation failed makes the caller skip
// its work (the failure is already waiting for Sync).
func devicePtrs(ts ...*Tensor) ([]driver.DevicePtr, bool) {
	ps := make([]driver.DevicePtr, len(ts))
	for i, t := range ts {
		if t == nil {
			continue
		}
		p, ok := t.ptr()
		if !ok {
			return nil, false
		}
		ps[i] = p
	}
	return ps, true
}

// overlaps reports whether a and b share any element.
func overlaps(a, b *Tensor) bool {
	return a.st == b.st && a.off < b.off+b.Len() && b.off < a.off+a.Len()
}

// describe names a tensor's window for messages.
func (t *Tensor) describe() string {
	return fmt.Sprintf("%v %v at element %d", t.dt, t.shape, t.off)
}
