package cuda

import (
	"fmt"
	"math/bits"
	"math/rand/v2"
	"regexp"
	"strconv"
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
// constants are the ones moe_fused.cu (and the grouped_gemm.cuh it
// includes) defines.
func TestGatherConstantsMatchKernel(t *testing.T) {
	_, text := kernelSource(t, "moe_fused.cu")
	for _, want := range []string{
		fmt.Sprintf("#define GG_CHUNKS %d\n", ggChunks),
		fmt.Sprintf("#define GG_GATHER_LEAD %d\n", ggGatherLead),
		fmt.Sprintf("#define GG_FRONT_DONE (1 << %d)\n", bits.Len(ggFrontDone)-1),
	} {
		if !strings.Contains(text, want) {
			t.Errorf("moe_fused.cu lacks %q", strings.TrimSpace(want))
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

// TestFusedTimeoutUnderTrapBound checks that a fused kernel's tile wait
// gives up well before its consumers' mbarrier waits trap (GG_TIMEOUT_NS
// in hopper.cuh), so that a lost peer is reported by name.
func TestFusedTimeoutUnderTrapBound(t *testing.T) {
	h, err := kernels.Header("hopper.cuh")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^#define GG_TIMEOUT_NS (\d+)ull$`).FindSubmatch(h)
	if m == nil {
		t.Fatal("hopper.cuh defines no GG_TIMEOUT_NS")
	}
	trap, err := strconv.ParseInt(string(m[1]), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	if time.Duration(trap) < 2*fusedTimeout {
		t.Errorf("fusedTimeout %v is not under half the mbarrier trap bound %v", fusedTimeout, time.Duration(trap))
	}
}
