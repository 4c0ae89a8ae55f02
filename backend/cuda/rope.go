package cuda

// Rotary position embedding on raw device pointers: the launch side of
// kernels/rope.cu (Hugging Face rotate-half, angles in float64, as
// backend/cpu).

import (
	"fmt"
	"math"

	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// MaxRoPEHeadDim is the largest head dim the RoPE kernel takes (its
// per-row cos/sin table lives in shared memory).
const MaxRoPEHeadDim = 1024

// RoPE writes out = x rotated, x float32 [rows, width] with width a
// multiple of headDim: each row t turns every head's dim pairs (i,
// i+headDim/2) by pos[t] * theta^(-2i/headDim), pos being int32 [rows];
// inverse turns back (the backward). out is x itself (in place) or does
// not overlap it; outBF16 makes it bf16, each value rounded once from the
// float32 rotation. It queues the kernel on d's stream; launch errors come
// back from the next Sync.
func RoPE(d *Device, out, x, pos driver.DevicePtr, rows, width, headDim int, theta float64, inverse, outBF16 bool) error {
	if err := checkRoPE(rows, width, headDim, theta); err != nil {
		return err
	}
	if rows == 0 {
		return nil
	}
	name := "rope_f32"
	if outBF16 {
		name = "rope_f32_bf16"
	}
	kern, err := sourceKernel(d, "rope.cu", name)
	if err != nil {
		return err
	}
	inv := int32(0)
	if inverse {
		inv = 1
	}
	// One thread per pair of the row, in whole warps, at most 256.
	threads := min(256, max(32, (width/2+31)/32*32))
	return d.Launch(kern, Grid1D(rows, threads), out, x, pos, int32(rows), int32(width), int32(headDim), theta, inv)
}

// checkRoPE validates RoPE's sizes.
func checkRoPE(rows, width, headDim int, theta float64) error {
	if headDim <= 0 || headDim%2 != 0 || headDim > MaxRoPEHeadDim {
		return fmt.Errorf("cuda: RoPE: head dim %d must be even, positive and at most %d", headDim, MaxRoPEHeadDim)
	}
	if width <= 0 || width%headDim != 0 || width > math.MaxInt32 {
		return fmt.Errorf("cuda: RoPE: row width %d must be a positive multiple of the head dim %d", width, headDim)
	}
	if rows < 0 || rows > math.MaxInt32 {
		return fmt.Errorf("cuda: RoPE: %d rows is out of range", rows)
	}
	if !(theta > 0) || math.IsInf(theta, 1) {
		return fmt.Errorf("cuda: RoPE: theta %v must be positive and finite", theta)
	}
	return nil
}
