package cuda

import "testing"

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
	for _, c := range []struct {
		pairs, items int
		backward     bool
		want         int
	}{
		{32, 16, true, 32},    // moe-small's B8 KV4 at 2,048 tokens: all at once
		{128, 16, false, 128}, // its forward, B8 H16
		{32, 64, true, 2},     // B2 KV16 at 8,192 tokens
		{32, 64, false, 4},
		{8, 256, true, 2}, // B1 KV8 at 32,768
		{1, 256, true, 1}, // one pair: the band is the grid
		{3, 64, false, 3},
		{32, 63, true, 4}, // 4,096 to 8,191 tokens: 4 pairs both ways
		{64, 32, false, 4},
		{32, 31, true, 32},
	} {
		if got := hopperAttnBand(c.pairs, c.items, c.backward); got != c.want {
			t.Errorf("hopperAttnBand(%d pairs, %d items, backward %v) = %d, want %d", c.pairs, c.items, c.backward, got, c.want)
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
