package cuda

import "testing"

// TestZigzagBackwardSplits: the fewest divisors of the group that give a
// rank's backward at least 1.5 blocks an SM, the whole group at most.
func TestZigzagBackwardSplits(t *testing.T) {
	for _, c := range []struct{ keyBlocks, group, sms, want int }{
		{256, 4, 132, 1}, // chunks of 4096 rows, four kv heads: 1.9 blocks an SM
		{128, 4, 132, 2}, // chunks of 2048: 0.97, so two blocks a key block
		{64, 4, 132, 4},  // chunks of 1024: all four heads apart
		{32, 4, 132, 4},  // no more than the group
		{128, 1, 132, 1}, // no group to share
		{100, 6, 132, 2}, // 200 >= 198
		{60, 6, 132, 6},  // 4 does not divide 6: 3 gives 180 < 198
		{1, 8, 132, 8},
	} {
		if got := zigzagBackwardSplits(c.keyBlocks, c.group, c.sms); got != c.want {
			t.Errorf("zigzagBackwardSplits(%d key blocks, group %d, %d SMs) = %d, want %d", c.keyBlocks, c.group, c.sms, got, c.want)
		}
	}
}
