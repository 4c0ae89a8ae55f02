package cuda

import (
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/kernels"
)

// bandBlock is ah_band (kernels/attention_hopper.cu) in Go: the pair and
// item of the block launched lin-th on a grid of pairs by items.
func bandBlock(band, pairs, items, lin int) (pair, item int) {
	first := lin / (band * items) * band
	inBand := min(band, pairs-first)
	r := lin - first*items
	return first + r%inBand, r / inBand
}

// TestHopperAttnBand: the bands the whole-sequence kernels and the ring's
// one-pass forward get, and that
// every band maps the launch order onto each (pair, item) once, with a
// band's items heaviest first and all pairs at once being the launch
// order itself.
func TestHopperAttnBand(t *testing.T) {
	for _, c := range []struct{ pairs, items, want int }{
		{32, 16, 32},   // moe-small's B8 KV4 at 2,048 tokens, backward: all at once
		{128, 16, 128}, // its forward, B8 H16
		{32, 64, 4},    // B2 KV16 at 8,192 tokens
		{8, 256, 4},    // B1 KV8 at 32,768
		{4, 256, 4},    // the ring rows' core, B1 KV4: all four
		{1, 256, 1},    // one pair: the band is the grid
		{3, 64, 3},
		{32, 63, 4}, // 4,096 to 8,191 tokens
		{64, 32, 4},
		{32, 31, 32},
	} {
		if got := hopperAttnBand(c.pairs, c.items); got != c.want {
			t.Errorf("hopperAttnBand(%d pairs, %d items) = %d, want %d", c.pairs, c.items, got, c.want)
		}
	}
	for _, c := range []struct{ pairs, items, want int }{
		{16, 32, 8}, // bench attention's ring rows: H16, S/W 4,096
		{16, 64, 8},
		{16, 31, 16},
		{6, 64, 6},
	} {
		if got := hopperZigzagBand(c.pairs, c.items); got != c.want {
			t.Errorf("hopperZigzagBand(%d pairs, %d items) = %d, want %d", c.pairs, c.items, got, c.want)
		}
	}
	for _, g := range []struct{ pairs, items int }{{32, 64}, {7, 5}, {1, 9}, {33, 64}, {8, 256}} {
		for band := 1; band <= g.pairs; band++ {
			seen := make([]bool, g.pairs*g.items)
			lastItem := make([]int, g.pairs)
			for i := range lastItem {
				lastItem[i] = -1
			}
			for lin := 0; lin < g.pairs*g.items; lin++ {
				pair, item := bandBlock(band, g.pairs, g.items, lin)
				if pair < 0 || pair >= g.pairs || item < 0 || item >= g.items {
					t.Fatalf("band %d of %dx%d: block %d maps to (%d, %d), off the grid", band, g.pairs, g.items, lin, pair, item)
				}
				if seen[pair*g.items+item] {
					t.Fatalf("band %d of %dx%d: (%d, %d) mapped twice", band, g.pairs, g.items, pair, item)
				}
				seen[pair*g.items+item] = true
				if item != lastItem[pair]+1 {
					t.Fatalf("band %d of %dx%d: pair %d's item %d launched after item %d", band, g.pairs, g.items, pair, item, lastItem[pair])
				}
				lastItem[pair] = item
				if band == g.pairs && (pair != lin%g.pairs || item != lin/g.pairs) {
					t.Fatalf("band = pairs = %d: block %d maps to (%d, %d), not the launch order", band, lin, pair, item)
				}
			}
		}
	}
}

// TestHopperAttnSmemMatchesKernels compiles attention_hopper.cu with
// clang-19 and static_asserts that say the shared memory the launches
// give (hopperAttnSmem, hopperAttnBwdSmem) is what the kernels lay out
// (ah_cfg<DH, NC>::SMEM, ah_bcfg<DH>::SMEM) at both head dims, and that
// hopperAttnConsumers is the kernels' ah_fwd_nc: a layout
// changed on one side only fails here, not on the GPU. Skipped without
// clang-19, as kernels' compile check is.
func TestHopperAttnSmemMatchesKernels(t *testing.T) {
	clang, err := exec.LookPath("clang-19")
	if err != nil {
		t.Skip("cuda: clang-19 not on PATH, the kernels' shared-memory layout not checked against the launches")
	}
	text := hopperAttnText(t)
	var b strings.Builder
	b.WriteString(text)
	for _, dh := range []int{64, 128} {
		nc := hopperAttnConsumers(dh)
		fmt.Fprintf(&b, "static_assert(ah_fwd_nc<%d>::NC == %d, \"hopperAttnConsumers(%d) is not ah_fwd_nc<%d>::NC\");\n", dh, nc, dh, dh)
		for _, c := range []int{nc, 2} { // the whole-sequence forward's, the ring's
			fmt.Fprintf(&b, "static_assert(ah_cfg<%d, %d>::SMEM == %d, \"hopperAttnSmem(%d, %d) is not ah_cfg<%d, %d>::SMEM\");\n", dh, c, hopperAttnSmem(dh, c), dh, c, dh, c)
		}
		fmt.Fprintf(&b, "static_assert(ah_bcfg<%d>::SMEM == %d, \"hopperAttnBwdSmem(%d) is not ah_bcfg<%d>::SMEM\");\n", dh, hopperAttnBwdSmem(dh), dh, dh)
		if _, smem := hopperAttnBwdLaunch(dh); smem != hopperAttnBwdSmem(dh) {
			t.Errorf("hopperAttnBwdLaunch(%d) gives %d bytes, not ah_bcfg's %d", dh, smem, hopperAttnBwdSmem(dh))
		}
	}
	dir := t.TempDir()
	file := filepath.Join(dir, "attention_hopper_smem.cu")
	if err := os.WriteFile(file, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(clang, "-x", "cuda", "--cuda-device-only", "--cuda-gpu-arch=sm_90a", "-nocudainc", "-nocudalib",
		"-fsyntax-only", file)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", cmd, err, out)
	}
}

// TestHopperAttnLaunchBounds checks every kernel of attention_hopper.cu
// that the backend launches with a fixed block against the source's
// __launch_bounds__: a launch of more threads than the bound is refused
// on the GPU (CUDA_ERROR_INVALID_VALUE) and one of fewer leaves warps the
// kernel's setmaxnreg counts assume, so the two must be equal; a block
// size changed on one side only fails here, without a GPU.
func TestHopperAttnLaunchBounds(t *testing.T) {
	text := hopperAttnText(t)
	bounds := map[string]int{}
	for _, m := range regexp.MustCompile(`__launch_bounds__\((\d+), 1\) (attn_h_\w+)\(`).FindAllStringSubmatch(text, -1) {
		n, err := strconv.Atoi(m[1])
		if err != nil {
			t.Fatal(err)
		}
		bounds[m[2]] = n
	}
	want := map[string]int{}
	for _, dh := range []int{64, 128} {
		fwd := 128 * (1 + hopperAttnConsumers(dh)) // a producer warpgroup and the consumers
		want[fmt.Sprintf("attn_h_forward_d%d", dh)] = fwd
		want[fmt.Sprintf("attn_h_forward_d%d_bf16", dh)] = fwd
		want[fmt.Sprintf("attn_h_zz_forward_d%d", dh)] = 384 // the ring's forward: two consumers
		bwd, _ := hopperAttnBwdLaunch(dh)
		want[fmt.Sprintf("attn_h_backward_d%d", dh)] = bwd
		want[fmt.Sprintf("attn_h_zz_backward_d%d", dh)] = bwd
	}
	for name, threads := range want {
		got, ok := bounds[name]
		switch {
		case !ok:
			t.Errorf("%s: no __launch_bounds__(N, 1) kernel of that name in attention_hopper.cu", name)
		case got != threads:
			t.Errorf("%s: __launch_bounds__(%d, 1), but the backend launches %d threads", name, got, threads)
		}
	}
}

// hopperAttnText is the source text of kernels/attention_hopper.cu.
func hopperAttnText(t *testing.T) string {
	t.Helper()
	src, err := kernels.Lookup("attention_hopper.cu")
	if err != nil {
		t.Fatal(err)
	}
	text, err := src.Text()
	if err != nil {
		t.Fatal(err)
	}
	return text
}

// ahDiv mirrors attention_hopper.cu's ah_div: n / d for 0 <= n < 2^31 as
// (umulhi(n, m) + n) >> l.
type ahDiv struct {
	m uint32
	l uint
}

func newAHDiv(d int) ahDiv {
	d = max(d, 1)
	l := uint(bits.Len32(uint32(d - 1))) // 32 - clz(d - 1): 0 for d == 1
	m := uint32((((uint64(1)<<l)-uint64(d))<<32)/uint64(d) + 1)
	return ahDiv{m: m, l: l}
}

func (a ahDiv) div(n int) int {
	hi := uint32((uint64(uint32(n)) * uint64(a.m)) >> 32)
	return int((hi + uint32(n)) >> a.l)
}

// TestAHDivExact checks the backward walk's division by multiply against
// Go's: every divisor up to 4096 (a head's query tiles reach S/64) with
// the dividends a walk reaches and the ends of the range, then random
// divisors and dividends over all of it.
func TestAHDivExact(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	check := func(d, n int) {
		if got, want := newAHDiv(d).div(n), n/d; got != want {
			t.Fatalf("ah_div(%d).div(%d) = %d, want %d", d, n, got, want)
		}
	}
	for d := 1; d <= 4096; d++ {
		for n := range 4 * d {
			check(d, n)
		}
		for _, n := range []int{math.MaxInt32, math.MaxInt32 - 1, math.MaxInt32 - d} {
			check(d, n)
		}
	}
	for range 200000 {
		check(1+rng.IntN(math.MaxInt32), rng.IntN(math.MaxInt32+1))
	}
}
