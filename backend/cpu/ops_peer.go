package cpu

// Peer-row ops: the MoE dispatch and combine of virtual ranks that read each
// other's tensors directly (see backend.Backend). Row r of the expert side
// refers to (rank s, send position p); the gather reads source s's token
// tokS[s][p], the scatter writes s's row p.

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
)

// peerRefs checks refsR2 (Int32 [R, 2]) against the ranks' send lengths
// sendLen[s] and returns the references as (rank, position) pairs.
func peerRefs(op string, refsR2 backend.Tensor, sendLen []int) [][2]int {
	if refsR2 == nil {
		fail(op, "refs is nil")
	}
	s := refsR2.Shape()
	if refsR2.DType() != backend.Int32 || len(s) != 2 || s[1] != 2 {
		fail(op, "refs is %v %v, want int32 [R 2]", refsR2.DType(), s)
	}
	raw := ints(refsR2)
	refs := make([][2]int, s[0])
	for r := range refs {
		rank, pos := int(raw[2*r]), int(raw[2*r+1])
		if rank < 0 || rank >= len(sendLen) {
			fail(op, "refs[%d] names rank %d of %d", r, rank, len(sendLen))
		}
		if pos < 0 || pos >= sendLen[rank] {
			fail(op, "refs[%d] names position %d of rank %d, which sends %d rows", r, pos, rank, sendLen[rank])
		}
		refs[r] = [2]int{rank, pos}
	}
	return refs
}

// PeerRowRefs expands blocks into refsR2 (see backend.Backend).
func (b *Backend) PeerRowRefs(refsR2 backend.Tensor, blocks []backend.RowBlock) {
	const op = "PeerRowRefs"
	if refsR2 == nil {
		fail(op, "refs is nil")
	}
	s := refsR2.Shape()
	if refsR2.DType() != backend.Int32 || len(s) != 2 || s[1] != 2 {
		fail(op, "refs is %v %v, want int32 [R 2]", refsR2.DType(), s)
	}
	if err := backend.CheckRowBlocks(blocks, s[0]); err != nil {
		fail(op, "%v", err)
	}
	copy(ints(refsR2), backend.ExpandRowBlocks(blocks, s[0]))
}

// GatherPeerRows computes outRD[r] = scaleS[s][p] * srcTD[s][tokS[s][p]]
// for (s, p) = refsR2[r]; scaleS may be nil (all ones). outRD may be
// BFloat16 (the rows are rounded).
func (b *Backend) GatherPeerRows(outRD backend.Tensor, srcTD, tokS, scaleS []backend.Tensor, refsR2 backend.Tensor) {
	const op = "GatherPeerRows"
	n, d := b.operandMatrix(op, "out", outRD)
	if len(tokS) != len(srcTD) || (scaleS != nil && len(scaleS) != len(srcTD)) {
		fail(op, "%d sources, %d token lists and %d scale lists; want one of each per rank", len(srcTD), len(tokS), len(scaleS))
	}
	sendLen := make([]int, len(srcTD))
	toks := make([][]int32, len(srcTD))
	for s, src := range srcTD {
		t, _ := b.operandMatrix(op, "source", src)
		b.wantOperandMatrix(op, "source", src, t, d)
		if src.DType() != srcTD[0].DType() {
			fail(op, "source %d is %v and source 0 %v; the sources must be of one dtype", s, src.DType(), srcTD[0].DType())
		}
		if tokS[s] == nil {
			fail(op, "token list of rank %d is nil", s)
		}
		sendLen[s] = tokS[s].Len()
		toks[s] = indices(op, "tokens", tokS[s], sendLen[s], t, false)
		if scaleS != nil {
			b.vector(op, "scale", scaleS[s], sendLen[s])
		}
	}
	if len(srcTD) > 0 && srcTD[0].DType() == backend.BFloat16 && (outRD.DType() != backend.BFloat16 || scaleS != nil) {
		fail(op, "the sources are bfloat16, which needs a bfloat16 out and no scales (out %v, scales given: %v)", outRD.DType(), scaleS != nil)
	}
	refs := peerRefs(op, refsR2, sendLen)
	if len(refs) != n {
		fail(op, "refs has %d rows, out %d", len(refs), n)
	}
	defer b.roundIfBF16(outRD)
	if b.dt == backend.Float32 {
		gatherPeerRows[float32](b, outRD, srcTD, toks, scaleS, refs, d)
	} else {
		gatherPeerRows[float64](b, outRD, srcTD, toks, scaleS, refs, d)
	}
}

func gatherPeerRows[T Float](b *Backend, outRD backend.Tensor, srcTD []backend.Tensor, toks [][]int32, scaleS []backend.Tensor, refs [][2]int, d int) {
	out := floats[T](outRD)
	b.parallelFor(len(refs), rowChunk(d), func(lo, hi int) {
		for r := lo; r < hi; r++ {
			s, p := refs[r][0], refs[r][1]
			t := int(toks[s][p])
			src := floats[T](srcTD[s])[t*d : (t+1)*d]
			dst := out[r*d : (r+1)*d]
			if scaleS == nil {
				copy(dst, src)
				continue
			}
			k := floats[T](scaleS[s])[p]
			for j, v := range src {
				dst[j] = k * v
			}
		}
	})
}

// ScatterPeerRows computes outSD[s][p] = inRD[r] for (s, p) = refsR2[r]:
// all of the float type, or all BFloat16 (whose values a copy keeps).
func (b *Backend) ScatterPeerRows(outSD []backend.Tensor, inRD, refsR2 backend.Tensor) {
	const op = "ScatterPeerRows"
	n, d := b.operandMatrix(op, "in", inRD)
	sendLen := make([]int, len(outSD))
	for s, o := range outSD {
		rows, _ := b.operandMatrix(op, "out", o)
		b.wantOperandMatrix(op, "out", o, rows, d)
		sameDType(op, "in", inRD, fmt.Sprintf("rank %d's out", s), o)
		sendLen[s] = rows
	}
	refs := peerRefs(op, refsR2, sendLen)
	if len(refs) != n {
		fail(op, "refs has %d rows, in %d", len(refs), n)
	}
	seen := make(map[[2]int]int, n)
	for r, ref := range refs {
		if q, dup := seen[ref]; dup {
			fail(op, "refs[%d] and refs[%d] both name rank %d position %d", q, r, ref[0], ref[1])
		}
		seen[ref] = r
	}
	if b.dt == backend.Float32 {
		scatterPeerRows[float32](b, outSD, inRD, refs, d)
	} else {
		scatterPeerRows[float64](b, outSD, inRD, refs, d)
	}
}

func scatterPeerRows[T Float](b *Backend, outSD []backend.Tensor, inRD backend.Tensor, refs [][2]int, d int) {
	in := floats[T](inRD)
	b.parallelFor(len(refs), rowChunk(d), func(lo, hi int) {
		for r := lo; r < hi; r++ {
			s, p := refs[r][0], refs[r][1]
			copy(floats[T](outSD[s])[p*d:(p+1)*d], in[r*d:(r+1)*d])
		}
	})
}

// MarkPeerRows sets doneS[s][p] = 1 for (s, p) = refsR2[r].
func (b *Backend) MarkPeerRows(doneS []backend.Tensor, refsR2 backend.Tensor) {
	const op = "MarkPeerRows"
	sendLen := make([]int, len(doneS))
	flags := make([][]int32, len(doneS))
	for s, d := range doneS {
		if d == nil {
			fail(op, "flags of rank %d are nil", s)
		}
		if d.DType() != backend.Int32 {
			fail(op, "flags of rank %d are %v, want int32", s, d.DType())
		}
		// Written, never read: the other ranks mark their rows in the
		// same lists at the same time.
		sendLen[s] = d.Len()
		flags[s] = ints(d)
	}
	for _, ref := range peerRefs(op, refsR2, sendLen) {
		flags[ref[0]][ref[1]] = 1
	}
}

// CombineRows adds the flagged rows as ScatterAddRows does and clears
// their flags. The ops run when called, so a flag that is not 1 was never
// raised: the call then adds nothing and the next Sync reports the first
// such row and the rank that owed it.
func (b *Backend) CombineRows(outTD, inSD, rowsS, scaleS, doneS backend.Tensor, sendCounts []int) {
	const op = "CombineRows"
	if inSD == nil || doneS == nil {
		fail(op, "in and flags are required")
	}
	n, _ := b.matrix(op, "in", inSD)
	flags := indices(op, "flags", doneS, n, 1<<31-1, true)
	for i, f := range flags {
		if f != 1 {
			b.report(fmt.Errorf("cpu: CombineRows: send row %d (to rank %d) was never flagged as written (flag %d); the results of this step are wrong",
				i, backend.RowOwner(sendCounts, i), f))
			return
		}
	}
	b.ScatterAddRows(outTD, inSD, rowsS, scaleS)
	clear(flags)
}

// DispatchSwiGLU is its unfused sequence (backend.DispatchSwiGLUBySteps).
func (b *Backend) DispatchSwiGLU(xRD, h1RF, h3RF, actRF backend.Tensor, srcTD, tokS []backend.Tensor, refsR2, w1GFD, w3GFD backend.Tensor, groups backend.Groups) {
	backend.DispatchSwiGLUBySteps(b, xRD, h1RF, h3RF, actRF, srcTD, tokS, refsR2, w1GFD, w3GFD, groups)
}

// DownCombine is its unfused sequence (backend.DownCombineBySteps) through
// a scratch tensor of y rows, of the outputs' type (a bf16 y is rounded
// once, from the product).
func (b *Backend) DownCombine(outSD, doneS []backend.Tensor, refsR2, actRF, w2GDF backend.Tensor, groups backend.Groups) {
	const op = "DownCombine"
	if len(outSD) == 0 {
		fail(op, "no output tensors")
	}
	r, _ := b.operandMatrix(op, "act", actRF)
	_, d := b.operandMatrix(op, "out", outSD[0])
	backend.DownCombineBySteps(b, b.New(outSD[0].DType(), r, d), outSD, doneS, refsR2, actRF, w2GDF, groups)
}

// DispatchDgradSwiGLU is its unfused sequence
// (backend.DispatchDgradSwiGLUBySteps) through a scratch tensor of dAct
// rows.
func (b *Backend) DispatchDgradSwiGLU(dyRD, dh1RF, dh3RF backend.Tensor, srcTD, tokS, scaleS []backend.Tensor, refsR2, h1RF, h3RF, w2GDF backend.Tensor, groups backend.Groups) {
	const op = "DispatchDgradSwiGLU"
	r, f := b.operandMatrix(op, "dh1", dh1RF)
	backend.DispatchDgradSwiGLUBySteps(b, b.New(b.dt, r, f), dyRD, dh1RF, dh3RF, srcTD, tokS, scaleS, refsR2, h1RF, h3RF, w2GDF, groups)
}

// DgradCombine is its unfused sequence (backend.DgradCombineBySteps)
// through a scratch tensor of dx rows.
func (b *Backend) DgradCombine(outSD, doneS []backend.Tensor, refsR2, dh1RF, dh3RF, w1GFD, w3GFD backend.Tensor, groups backend.Groups) {
	const op = "DgradCombine"
	if len(outSD) == 0 {
		fail(op, "no output tensors")
	}
	r, _ := b.operandMatrix(op, "dh1", dh1RF)
	_, d := b.matrix(op, "out", outSD[0])
	backend.DgradCombineBySteps(b, b.New(b.dt, r, d), outSD, doneS, refsR2, dh1RF, dh3RF, w1GFD, w3GFD, groups)
}
