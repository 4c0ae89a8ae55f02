package cuda

import (
	"fmt"
	"testing"
)

// TestTPTileWalk checks the tensor-parallel kernels' walk on clusters of
// two blocks (tpTileOf, gg_tp_tile's twin) over odd and even m-tile
// counts, groups and rotations: the clusters' walk positions cover every
// (m-tile, n-tile) exactly once; a cluster's two blocks share the n-tile
// and take the two m-tiles of one pair; and only the last pair of an odd
// count has a missing half.
func TestTPTileWalk(t *testing.T) {
	for _, c := range []struct{ m, nTN, groupM, rotM int }{
		{1, 1, 1, 0}, {2, 3, 1, 1}, {3, 14, 1, 2}, {17, 25, 16, 0}, {64, 14, 1, 56},
		{512, 14, 1, 448}, {128, 56, 16, 64}, {9, 5, 4, 3}, {33, 7, 16, 5}, {6, 2, 8, 3},
	} {
		t.Run(fmt.Sprintf("m%d_n%d_G%d_rot%d", c.m, c.nTN, c.groupM, c.rotM), func(t *testing.T) {
			total := (c.m + 1) / 2 * c.nTN
			seen := make(map[[2]int]int)
			for p := range total {
				a, b := tpTileOf(p, c.nTN, c.m, c.groupM, c.rotM, 0), tpTileOf(p, c.nTN, c.m, c.groupM, c.rotM, 1)
				if a.N0 != b.N0 || b.WalkG != a.WalkG+1 || a.WalkG%2 != 0 {
					t.Fatalf("position %d: the blocks took %+v and %+v, not one pair of one n-tile", p, a, b)
				}
				if a.G < 0 {
					t.Fatalf("position %d: rank 0 has no m-tile (%+v)", p, a)
				}
				if b.G < 0 && (c.m%2 == 0 || b.WalkG != c.m) {
					t.Fatalf("position %d: rank 1 has no m-tile at walk m-tile %d of %d", p, b.WalkG, c.m)
				}
				for _, x := range []tpTile{a, b} {
					if x.G >= 0 {
						seen[[2]int{x.G, x.N0}]++
					}
				}
			}
			for g := range c.m {
				for n := range c.nTN {
					if k := seen[[2]int{g, 256 * n}]; k != 1 {
						t.Errorf("m-tile %d, n-tile %d taken %d times", g, n, k)
					}
				}
			}
			if len(seen) != c.m*c.nTN {
				t.Errorf("%d tiles taken, want %d", len(seen), c.m*c.nTN)
			}
		})
	}
}
