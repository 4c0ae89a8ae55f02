package cuda

import "testing"

// TestZigzagBackwardSplits: the fewest divisors of the group that give a
// rank's backward at least 1.5 blocks an SM, at head dim 128 at least
// two, and a head a block there from 65,536 positions on; the whole group
// at most.
func TestZigzagBackwardSplits(t *testing.T) {
	for _, c := range []struct{ keyBlocks, group, headDim, seq, sms, want int }{
		{256, 4, 64, 32768, 132, 1},  // chunks of 4096 rows, four kv heads: 1.9 blocks an SM
		{256, 4, 128, 32768, 132, 2}, // the same at head dim 128: two, for L2's sake
		{128, 4, 64, 32768, 132, 2},  // chunks of 2048: 0.97, so two blocks a key block
		{128, 4, 128, 32768, 132, 2},
		{64, 4, 128, 32768, 132, 4},  // chunks of 1024: all four heads apart
		{32, 4, 64, 32768, 132, 4},   // no more than the group
		{128, 1, 128, 32768, 132, 1}, // no group to share
		{100, 6, 64, 32768, 132, 2},  // 200 >= 198
		{400, 6, 128, 32768, 132, 2}, // at least two at head dim 128
		{400, 3, 128, 32768, 132, 3}, // the fewest divisors past one
		{60, 6, 64, 32768, 132, 6},   // 4 does not divide 6: 3 gives 180 < 198
		{1, 8, 128, 32768, 132, 8},
		{256, 4, 128, 65536, 132, 4}, // W8 S/W 8192: a head a block
		{512, 8, 128, 131072, 132, 8},
		{256, 4, 64, 65536, 132, 1}, // head dim 64 keeps the blocks-an-SM rule
	} {
		if got := zigzagBackwardSplits(c.keyBlocks, c.group, c.headDim, c.seq, c.sms); got != c.want {
			t.Errorf("zigzagBackwardSplits(%d key blocks, group %d, head dim %d, %d positions, %d SMs) = %d, want %d",
				c.keyBlocks, c.group, c.headDim, c.seq, c.sms, got, c.want)
		}
	}
}
