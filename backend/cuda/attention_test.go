package cuda

// Argument checks of the attention and RoPE launchers; they need no GPU:
// a bad shape is refused before the device is touched.

import (
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

func TestAttentionShapeChecks(t *testing.T) {
	good := backend.AttnShape{Batch: 2, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 16}
	for _, c := range []struct {
		s    backend.AttnShape
		want string
	}{
		{backend.AttnShape{Batch: 0, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 16}, "must be positive"},
		{backend.AttnShape{Batch: 1, Seq: 5, Heads: 4, KVHeads: 3, HeadDim: 16}, "KVHeads must divide Heads"},
		{backend.AttnShape{Batch: 1, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 129}, "head dim 129 is over"},
		{backend.AttnShape{Batch: 1, Seq: 64*65535 + 1, Heads: 4, KVHeads: 2, HeadDim: 64}, "sequence length"},
	} {
		if err := AttentionForward(nil, 0, 0, 0, 0, 0, c.s); err == nil || !strings.Contains(err.Error(), c.want) ||
			!strings.Contains(err.Error(), "AttentionForward") {
			t.Errorf("AttentionForward(%+v): %v, want an error saying %q", c.s, err, c.want)
		}
		if err := AttentionBackward(nil, 0, 0, 0, 0, 0, 0, 0, 0, 0, c.s); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("AttentionBackward(%+v): %v, want an error saying %q", c.s, err, c.want)
		}
	}
	for dh, want := range map[int]int{1: 32, 16: 32, 32: 32, 33: 64, 64: 64, 65: 128, 100: 128, 128: 128} {
		s := good
		s.HeadDim = dh
		if dp, err := checkAttnShape("test", s); err != nil || dp != want {
			t.Errorf("head dim %d: kernels for %d (%v), want %d", dh, dp, err, want)
		}
	}
	g := attnGrid(8*16, 2049, 64)
	if g.Grid.X != 128 || g.Grid.Y != 33 || g.Block.X != 128 {
		t.Errorf("attnGrid(128, 2049, 64) = %+v", g)
	}
}

func TestRoPEChecks(t *testing.T) {
	for _, c := range []struct {
		rows, width, headDim int
		theta                float64
		want                 string
	}{
		{4, 64, 0, 1e4, "head dim 0"},
		{4, 63, 63, 1e4, "head dim 63"},
		{4, 2048, 2048, 1e4, "at most 1024"},
		{4, 96, 64, 1e4, "multiple of the head dim"},
		{-1, 64, 64, 1e4, "rows"},
		{4, 64, 64, 0, "theta"},
		{4, 64, 64, -1, "theta"},
	} {
		if err := RoPE(nil, 0, 0, c.rows, c.width, c.headDim, c.theta, false); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("RoPE(rows %d, width %d, head dim %d, theta %v): %v, want an error saying %q", c.rows, c.width, c.headDim, c.theta, err, c.want)
		}
	}
}
