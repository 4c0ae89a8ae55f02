package backend

import "fmt"

// RowBlock is one block of PeerRowRefs' table: rows from First on refer to
// rank Rank's send positions from Pos on.
type RowBlock struct{ First, Rank, Pos int }

// CheckRowBlocks checks a PeerRowRefs table for R rows and returns a
// description of the first fault, or nil.
func CheckRowBlocks(blocks []RowBlock, R int) error {
	if R > 0 && (len(blocks) == 0 || blocks[0].First != 0) {
		return fmt.Errorf("%d rows but the first block does not start at row 0 (%d blocks)", R, len(blocks))
	}
	for i, bl := range blocks {
		switch {
		case bl.First < 0 || bl.First > R:
			return fmt.Errorf("block %d starts at row %d, outside [0, %d]", i, bl.First, R)
		case i > 0 && bl.First < blocks[i-1].First:
			return fmt.Errorf("block %d starts at row %d, before block %d (row %d)", i, bl.First, i-1, blocks[i-1].First)
		case bl.Rank < 0 || bl.Pos < 0:
			return fmt.Errorf("block %d names rank %d position %d", i, bl.Rank, bl.Pos)
		case bl.First < R && int64(bl.Pos)+int64(R-bl.First) > 1<<31-1:
			return fmt.Errorf("block %d: positions from %d overflow int32", i, bl.Pos)
		}
	}
	return nil
}

// ExpandRowBlocks is PeerRowRefs on the host: the R references, as the
// flat (rank, position) pairs refsR2 holds. The blocks must pass
// CheckRowBlocks.
func ExpandRowBlocks(blocks []RowBlock, R int) []int32 {
	refs := make([]int32, 2*R)
	for i, bl := range blocks {
		end := R
		if i+1 < len(blocks) {
			end = blocks[i+1].First
		}
		for r := bl.First; r < end; r++ {
			refs[2*r], refs[2*r+1] = int32(bl.Rank), int32(bl.Pos+r-bl.First)
		}
	}
	return refs
}

// DispatchSwiGLUBySteps computes DispatchSwiGLU as its unfused sequence on
// b: GatherPeerRows, two GroupedMatMul and SwiGLUForward. It is the
// reference definition of the fused op (the CPU backend's implementation)
// and serves any call a backend's fused kernel does not take.
func DispatchSwiGLUBySteps(b Backend, xRD, h1RF, h3RF, actRF Tensor, srcTD, tokS []Tensor, refsR2, w1GFD, w3GFD Tensor, groups Groups) {
	b.GatherPeerRows(xRD, srcTD, tokS, nil, refsR2)
	b.GroupedMatMul(h1RF, xRD, w1GFD, groups, true, 1, 0)
	b.GroupedMatMul(h3RF, xRD, w3GFD, groups, true, 1, 0)
	b.SwiGLUForward(actRF, h1RF, h3RF)
}

// DownCombineBySteps computes DownCombine as its unfused sequence on b:
// GroupedMatMul into a scratch tensor yRD (of the float type, actRF's row
// count and the outputs' width), ScatterPeerRows, and MarkPeerRows when
// doneS is not nil.
func DownCombineBySteps(b Backend, yRD Tensor, outSD, doneS []Tensor, refsR2, actRF, w2GDF Tensor, groups Groups) {
	b.GroupedMatMul(yRD, actRF, w2GDF, groups, true, 1, 0)
	b.ScatterPeerRows(outSD, yRD, refsR2)
	if doneS != nil {
		b.MarkPeerRows(doneS, refsR2)
	}
}

// DispatchDgradSwiGLUBySteps computes DispatchDgradSwiGLU as its unfused
// sequence on b: GatherPeerRows, GroupedMatMul into a scratch tensor
// dActRF (dh1RF's shape, of the float type: SwiGLUBackward takes a float
// dout), and SwiGLUBackward.
func DispatchDgradSwiGLUBySteps(b Backend, dActRF, dyRD, dh1RF, dh3RF Tensor, srcTD, tokS, scaleS []Tensor, refsR2, h1RF, h3RF, w2GDF Tensor, groups Groups) {
	b.GatherPeerRows(dyRD, srcTD, tokS, scaleS, refsR2)
	b.GroupedMatMul(dActRF, dyRD, w2GDF, groups, false, 1, 0)
	b.SwiGLUBackward(dh1RF, dh3RF, dActRF, h1RF, h3RF)
}

// DgradCombineBySteps computes DgradCombine as its unfused sequence on b:
// two GroupedMatMul into a scratch tensor dxRD (of the float type, the
// rows' count and the outputs' width), ScatterPeerRows, and MarkPeerRows
// when doneS is not nil.
func DgradCombineBySteps(b Backend, dxRD Tensor, outSD, doneS []Tensor, refsR2, dh1RF, dh3RF, w1GFD, w3GFD Tensor, groups Groups) {
	b.GroupedMatMul(dxRD, dh1RF, w1GFD, groups, false, 1, 0)
	b.GroupedMatMul(dxRD, dh3RF, w3GFD, groups, false, 1, 1)
	b.ScatterPeerRows(outSD, dxRD, refsR2)
	if doneS != nil {
		b.MarkPeerRows(doneS, refsR2)
	}
}

// RowOwner is the rank of the expert group that send row i goes to, given
// the rows sent to each rank in send order (sendCounts), or -1 when i is
// past them: how CombineRows names the rank that owed a row.
func RowOwner(sendCounts []int, i int) int {
	end := 0
	for r, n := range sendCounts {
		end += n
		if i < end {
			return r
		}
	}
	return -1
}
