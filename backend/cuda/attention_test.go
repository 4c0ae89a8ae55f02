package cuda

// Argument checks of the attention and RoPE launchers; they need no GPU:
// a bad shape is refused before the device is touched.

import (
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
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
		{backend.AttnShape{Batch: 1, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 16, KVSeq: 64*65535 + 1}, "sequence length"},
		{backend.AttnShape{Batch: 1, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 16, QOffset: -1}, "QOffset"},
		{backend.AttnShape{Batch: 1, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 16, QOffset: 1}, "QOffset+Seq <= KVSeq"},
		{backend.AttnShape{Batch: 1, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 16, KVSeq: 8, QOffset: 4}, "QOffset+Seq <= KVSeq"},
		{backend.AttnShape{Batch: 1, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 16, KVSeq: -3}, "QOffset"},
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

// TestAttentionChoice checks which kernels serve a call: the tensor cores
// for head dims 64 and 128 on 16-byte aligned tensors (when
// attnTensorCores is on), float32 otherwise, and an error when the tensor
// cores are demanded where they cannot run.
func TestAttentionChoice(t *testing.T) {
	const aligned, odd = 0x7f0000001000, 0x7f0000001004
	autoTC := attnFP32
	if attnTensorCores {
		autoTC = attnTC
	}
	for _, c := range []struct {
		dh   int
		ptrs []driver.DevicePtr
		impl attnImpl
		want attnImpl
		err  string
	}{
		{64, []driver.DevicePtr{aligned, aligned + 256}, attnAuto, autoTC, ""},
		{128, []driver.DevicePtr{aligned, aligned + 16}, attnAuto, autoTC, ""},
		{32, []driver.DevicePtr{aligned}, attnAuto, attnFP32, ""},
		{96, []driver.DevicePtr{aligned}, attnAuto, attnFP32, ""},
		{64, []driver.DevicePtr{aligned, odd}, attnAuto, attnFP32, ""},
		{64, []driver.DevicePtr{aligned + 8}, attnAuto, attnFP32, ""},
		{64, []driver.DevicePtr{aligned}, attnFP32, attnFP32, ""},
		{64, []driver.DevicePtr{aligned}, attnTC, attnTC, ""},
		{37, []driver.DevicePtr{aligned}, attnTC, 0, "head dims 64 and 128, not 37"},
		{128, []driver.DevicePtr{odd}, attnTC, 0, "16-byte aligned"},
		{64, nil, attnImpl(9), 0, "unknown attention kernels"},
	} {
		s := backend.AttnShape{Batch: 1, Seq: 8, Heads: 2, KVHeads: 1, HeadDim: c.dh}
		got, err := chooseAttn("test", c.impl, s, c.ptrs...)
		switch {
		case c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)):
			t.Errorf("head dim %d, %v, %#x: %v, want an error saying %q", c.dh, c.impl, c.ptrs, err, c.err)
		case c.err == "" && (err != nil || got != c.want):
			t.Errorf("head dim %d, %v, %#x: %v (%v), want %v", c.dh, c.impl, c.ptrs, got, err, c.want)
		}
	}
	if g := tcGrid(8*16, 2049); g.Grid.X != 128 || g.Grid.Y != 33 || g.Block.X != 128 {
		t.Errorf("tcGrid(128, 2049) = %+v", g)
	}
	// The tensor-core launch refuses a bad shape before anything else.
	if err := attentionForward(nil, 0, 0, 0, 0, 0, backend.AttnShape{Batch: 1, Seq: 4, Heads: 3, KVHeads: 2, HeadDim: 64}, attnTC); err == nil ||
		!strings.Contains(err.Error(), "KVHeads must divide Heads") {
		t.Errorf("attentionForward with a bad shape: %v", err)
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
		if err := RoPE(nil, 0, 0, 0, c.rows, c.width, c.headDim, c.theta, false, false); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("RoPE(rows %d, width %d, head dim %d, theta %v): %v, want an error saying %q", c.rows, c.width, c.headDim, c.theta, err, c.want)
		}
	}
}

// TestZigzagAttentionSupports: the fused ring's kernels take head dims 64
// and 128, chunks of whole 64-row tiles and at most zigzagMaxRanks ranks,
// and say which limit a shape misses.
func TestZigzagAttentionSupports(t *testing.T) {
	var b *Backend // the check reads only the shape
	ok := backend.ZigzagShape{Ranks: 4, Rank: 1, Batch: 2, Chunk: 128, Heads: 16, KVHeads: 4, HeadDim: 128}
	if err := b.ZigzagAttentionSupports(ok); err != nil {
		t.Errorf("%+v: %v", ok, err)
	}
	for _, c := range []struct {
		edit func(*backend.ZigzagShape)
		want string
	}{
		{func(s *backend.ZigzagShape) { s.HeadDim = 96 }, "head dims 64 and 128"},
		{func(s *backend.ZigzagShape) { s.Chunk = 96 }, "multiple of 64"},
		{func(s *backend.ZigzagShape) { s.Ranks, s.Rank = zigzagMaxRanks+1, 0 }, "at most 64 ranks"},
		{func(s *backend.ZigzagShape) { s.Rank = 4 }, "out of range"},
		{func(s *backend.ZigzagShape) { s.KVHeads = 3 }, "not a multiple"},
	} {
		s := ok
		c.edit(&s)
		if err := b.ZigzagAttentionSupports(s); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error saying %q", s, err, c.want)
		}
	}
}
