package cuda

import (
	"fmt"
	"math/bits"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/mktrain/mktrain/kernels"
)

// TestFusedFaultError: the report of a tile wait that timed out names the
// kernel, the m-tile, the missing chunks and the rank to look at.
func TestFusedFaultError(t *testing.T) {
	err := fusedFaultError("moe_dispatch_dgrad", 10*time.Second, 6, 0b11110110, 2)
	for _, want := range []string{"moe_dispatch_dgrad", "m-tile 6", "within 10s", "[0 3] of 8 missing", "from rank 2"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q lacks %q", err, want)
		}
	}
	if err := fusedFaultError("moe_dispatch_swiglu", time.Second, 0, 0b01111111, -1); !strings.Contains(err.Error(), "no rank") {
		t.Errorf("a chunk without rows: %q", err)
	}
}

// kernelSource returns the kernels source file and its text.
func kernelSource(t *testing.T, file string) (kernels.Source, string) {
	t.Helper()
	src, err := kernels.Lookup(file)
	if err != nil {
		t.Fatal(err)
	}
	text, err := src.Text()
	if err != nil {
		t.Fatal(err)
	}
	return src, text
}

// TestGatherConstantsMatchKernel: the Go side's copies of the gather's
// constants are the ones grouped_gemm.cu defines.
func TestGatherConstantsMatchKernel(t *testing.T) {
	_, text := kernelSource(t, "grouped_gemm.cu")
	for _, want := range []string{
		fmt.Sprintf("#define GG_CHUNKS %d\n", ggChunks),
		fmt.Sprintf("#define GG_GATHER_LEAD %d\n", ggGatherLead),
		fmt.Sprintf("#define GG_FRONT_DONE (1 << %d)\n", bits.Len(ggFrontDone)-1),
	} {
		if !strings.Contains(text, want) {
			t.Errorf("grouped_gemm.cu lacks %q", strings.TrimSpace(want))
		}
	}
}

// TestGatherPacingCompletes model-checks the dgrad kernel's gather pacing
// (gg_gather and the TMA thread in gg_body) on random shapes: blocks walk
// their tiles (t = block, block + grid, ...; m-tile t / nTN, the fused
// kernels' order), each publishing its front (0 at the start, then the
// m-tile of the tile it waits for, ggFrontDone when it has issued its
// last) and moving on once every chunk of the tile's m-tile is published;
// each gather warp publishes its chunks (u = warp, warp + warps, ...) in
// order, holding one while its m-tile is more than ggGatherLead past its
// block's front, in the kernel's int32 arithmetic. Every run must finish
// without the pacing's timeout: no cycle of waits.
func TestGatherPacingCompletes(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 9))
	for trial := range 400 {
		mTiles := 1 + rng.IntN(300)
		if trial%4 == 0 {
			mTiles = 1 + rng.IntN(8)
		}
		nTN := 1 + rng.IntN(24)
		grid := 1 + rng.IntN(140)
		warps := []int{1, 3}[rng.IntN(2)] // FUSE 3 paces three gather warps a block; one is the leaner case
		if err := simulateGatherPacing(mTiles, nTN, grid, warps, ggGatherLead); err != nil {
			t.Fatalf("m-tiles %d, column tiles %d, grid %d, %d gather warps a block: %v", mTiles, nTN, grid, warps, err)
		}
	}
	// The lead is what keeps the tiles fed, not what makes the protocol
	// safe: with none at all it still completes.
	if err := simulateGatherPacing(200, 11, 132, 1, 0); err != nil {
		t.Fatalf("lead 0: %v", err)
	}
}

// simulateGatherPacing runs the model of TestGatherPacingCompletes until
// nothing can move, and reports the state if something is left.
func simulateGatherPacing(mTiles, nTN, grid, warpsPerBlock, lead int) error {
	total, chunks := mTiles*nTN, mTiles*ggChunks
	published := make([]bool, chunks)
	landed := make([]int, mTiles) // chunks published per m-tile
	next := make([]int, grid)     // each TMA thread's next tile, as block + k*grid
	front := make([]int32, grid)
	for b := range next {
		next[b] = b
	}
	gatherWarps := grid * warpsPerBlock
	chunk := make([]int, gatherWarps) // each gather warp's next chunk
	for w := range chunk {
		chunk[w] = w
	}
	for moved := true; moved; {
		moved = false
		for b := range next {
			for next[b] < total {
				g := next[b] / nTN
				front[b] = int32(g)
				if landed[g] < ggChunks {
					break
				}
				next[b] += grid
				moved = true
			}
			if next[b] >= total && front[b] != ggFrontDone {
				front[b] = ggFrontDone
				moved = true
			}
		}
		for w := range chunk {
			for chunk[w] < chunks {
				u := chunk[w]
				if int32(u/ggChunks) > front[w/warpsPerBlock]+int32(lead) {
					break
				}
				published[u] = true
				landed[u/ggChunks]++
				chunk[w] += gatherWarps
				moved = true
			}
		}
	}
	for b, n := range next {
		if n < total {
			return fmt.Errorf("block %d waits for m-tile %d (%d of %d chunks landed)", b, n/nTN, landed[n/nTN], ggChunks)
		}
	}
	for u, p := range published {
		if !p {
			return fmt.Errorf("chunk %d (m-tile %d) was never published", u, u/ggChunks)
		}
	}
	return nil
}

// TestEvenGatherSharesCover model-checks gg_gather_even's partition (the
// even-shares variant of the first-gather) in the kernel's arithmetic:
// over random m-tile counts, row widths and warp counts, the warps' shares
// count every m-tile's 64 * nJ units exactly once, and no warp's share is
// more than one unit longer than another's.
func TestEvenGatherSharesCover(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 3))
	for range 300 {
		m, nJ, ncw := 1+rng.IntN(2000), 1+rng.IntN(8), 1+rng.IntN(1600)
		perTile := int32(64 * nJ)
		u := int32(m) * perTile
		share, rem := u/int32(ncw), u%int32(ncw)
		counts := make([]int32, m)
		minShare, maxShare := u, int32(0)
		for cw := range int32(ncw) {
			ua := cw*share + min(cw, rem)
			ub := ua + share
			if cw < rem {
				ub++
			}
			minShare, maxShare = min(minShare, ub-ua), max(maxShare, ub-ua)
			for x := ua; x < ub; {
				g := x / perTile
				qa := x - g*perTile
				qb := min(ub-g*perTile, perTile)
				counts[g] += qb - qa
				x = g*perTile + qb
			}
		}
		for g, c := range counts {
			if c != perTile {
				t.Fatalf("%d m-tiles, nJ %d, %d warps: m-tile %d counted %d units, want %d", m, nJ, ncw, g, c, perTile)
			}
		}
		if maxShare-minShare > 1 {
			t.Fatalf("%d m-tiles, nJ %d, %d warps: shares from %d to %d units", m, nJ, ncw, minShare, maxShare)
		}
	}
}

// TestActSplitProtocol model-checks the barriers of the act-split variant
// of moe_dispatch_swiglu (gg_stage_h13, gg_act_helper, gg_act_share in
// grouped_gemm.cu) in one block, over random tile lists and random
// interleavings. The actors: the two consumer warpgroups, which consume
// each tile's k-blocks from a shared ring of 3 stages (neither more than
// 3 k-blocks ahead of the other) and stage their block when it takes the
// TMA-store epilogue, after the previous one's buffers are freed; a
// helper warp per warpgroup; warp 3. Each barrier completes a phase per
// arrival (count 1) and a wait on parity p passes when the completed
// phases' count has the other parity, as mbarrier.try_wait.parity does, so
// a waiter two phases behind would hang and one a phase early would pass:
// every pass is checked against the phase the waiter means. Each
// warpgroup's staging buffer is checked through its states (free, staged,
// h1 read by the TMA store, act written, free again).
func TestActSplitProtocol(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 3))
	for trial := range 300 {
		tiles := 1 + rng.IntN(40)
		nK := 1 + rng.IntN(5)
		tma := make([][2]bool, tiles)
		for i := range tma {
			for cw := range 2 {
				tma[i][cw] = rng.IntN(8) != 0 // the register path sometimes (blocks with the next expert's rows)
			}
		}
		if err := simulateActSplit(tma, nK, rng); err != nil {
			t.Fatalf("trial %d, %d tiles of %d k-blocks: %v", trial, tiles, nK, err)
		}
	}
}

// actBarrier is an mbarrier of one arrival a phase.
type actBarrier struct{ completed int }

// wait reports whether a wait for phase k's completion (on parity k & 1,
// as the kernel waits) passes now, and an error naming who if it passes
// before phase k has completed: the parity aliased a phase still to come.
func (b *actBarrier) wait(k int, who string) (bool, error) {
	if b.completed&1 == k&1 {
		return false, nil
	}
	if b.completed < k+1 {
		return false, fmt.Errorf("%s passed its wait for phase %d after %d phases", who, k, b.completed)
	}
	return true, nil
}

// simulateActSplit runs the model of TestActSplitProtocol until every
// actor is done or none can move.
func simulateActSplit(tma [][2]bool, nK int, rng *rand.Rand) error {
	const stages = 3
	type bufState int
	const (
		bufFree bufState = iota
		bufStaged
		bufRead    // h1 and h3 read by their TMA store
		bufActDone // both shares of act written
	)
	var staged, freed, h13read, actdone [2]actBarrier
	var buf [2]bufState
	var helperShare, warp3Share [2]bool // the current block's act shares written

	// Each actor is a step function: it does one step and reports true,
	// or reports false when it must wait (or is done).
	var consumed [2]int // k-blocks consumed per warpgroup
	var cTile, cStaged [2]int
	consumer := func(cw int) (bool, error) {
		if cTile[cw] == len(tma) {
			return false, nil
		}
		if consumed[cw] < (cTile[cw]+1)*nK { // the next k-block: the ring holds 3 past the other's
			if consumed[cw] >= consumed[1-cw]+stages {
				return false, nil
			}
			consumed[cw]++
			return true, nil
		}
		if tma[cTile[cw]][cw] {
			c := cStaged[cw]
			if c > 0 {
				if ok, err := freed[cw].wait(c-1, fmt.Sprintf("warpgroup %d (freed)", cw)); !ok {
					return false, err
				}
			}
			if buf[cw] != bufFree {
				return false, fmt.Errorf("warpgroup %d stages block %d over a buffer in state %d", cw, c, buf[cw])
			}
			buf[cw] = bufStaged
			staged[cw].completed++
			cStaged[cw]++
		}
		cTile[cw]++
		return true, nil
	}
	// The helper's steps per block: 0 wait staged, store h1/h3 and wait
	// for the read, arrive h13read; 1 its share; 2 wait actdone, store act,
	// wait for the read, arrive freed.
	var hTile, hBlock, hStep [2]int
	helper := func(cw int) (bool, error) {
		for hTile[cw] < len(tma) && !tma[hTile[cw]][cw] {
			hTile[cw]++
		}
		if hTile[cw] == len(tma) {
			return false, nil
		}
		k := hBlock[cw]
		switch hStep[cw] {
		case 0:
			if ok, err := staged[cw].wait(k, fmt.Sprintf("helper %d (staged)", cw)); !ok {
				return false, err
			}
			if buf[cw] != bufStaged {
				return false, fmt.Errorf("helper %d stores block %d from a buffer in state %d", cw, k, buf[cw])
			}
			buf[cw] = bufRead
			h13read[cw].completed++
		case 1:
			helperShare[cw] = true
		case 2:
			if ok, err := actdone[cw].wait(k, fmt.Sprintf("helper %d (actdone)", cw)); !ok {
				return false, err
			}
			if !warp3Share[cw] || !helperShare[cw] {
				return false, fmt.Errorf("helper %d stores block %d's act before both shares", cw, k)
			}
			buf[cw] = bufFree
			helperShare[cw], warp3Share[cw] = false, false
			freed[cw].completed++
			hBlock[cw]++
			hTile[cw]++
			hStep[cw] = 0
			return true, nil
		}
		hStep[cw]++
		return true, nil
	}
	var wTile, wCW int
	var wBlock [2]int
	warp3 := func() (bool, error) {
		for wTile < len(tma) && !tma[wTile][wCW] {
			if wCW++; wCW == 2 {
				wCW, wTile = 0, wTile+1
			}
		}
		if wTile == len(tma) {
			return false, nil
		}
		cw, k := wCW, wBlock[wCW]
		if ok, err := h13read[cw].wait(k, fmt.Sprintf("warp 3 for warpgroup %d (h13read)", cw)); !ok {
			return false, err
		}
		if buf[cw] != bufRead {
			return false, fmt.Errorf("warp 3 writes block %d of warpgroup %d over a buffer in state %d", k, cw, buf[cw])
		}
		warp3Share[cw] = true
		actdone[cw].completed++
		wBlock[cw]++
		if wCW++; wCW == 2 {
			wCW, wTile = 0, wTile+1
		}
		return true, nil
	}
	actors := []func() (bool, error){
		func() (bool, error) { return consumer(0) }, func() (bool, error) { return consumer(1) },
		func() (bool, error) { return helper(0) }, func() (bool, error) { return helper(1) }, warp3,
	}
	for {
		moved := false
		for _, i := range rng.Perm(len(actors)) {
			ok, err := actors[i]()
			if err != nil {
				return err
			}
			moved = moved || ok
		}
		if !moved {
			break
		}
	}
	if cTile != [2]int{len(tma), len(tma)} || hTile != [2]int{len(tma), len(tma)} || wTile != len(tma) {
		return fmt.Errorf("stuck: consumers at tiles %v (k-blocks %v), helpers at %v (step %v), warp 3 at tile %d (warpgroup %d)",
			cTile, consumed, hTile, hStep, wTile, wCW)
	}
	return nil
}
