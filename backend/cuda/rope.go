package cuda

// Rotary position embedding on raw device pointers: the launch side of
// kernels/rope.cu (Hugging Face rotate-half, angles in float64, as
// backend/cpu).

import (
	"errors"
	"fmt"
	"math"

	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// MaxRoPEHeadDim is the largest head dim the RoPE kernel takes.
const MaxRoPEHeadDim = 1024

// ropeKey names one cos/sin table: the angles depend on theta and the
// head dim alone.
type ropeKey struct {
	theta   float64
	headDim int
}

// ropeTable is rope_table's output for positions below rows: (cos, sin)
// float32 pairs, [rows, headDim/2].
type ropeTable struct {
	buf  *Buffer
	rows int
}

// ropeTableFor returns the table of key that holds at least rows
// positions, building (or, for more rows, rebuilding) it in stream order
// before the caller's kernel; the table is sized by the calls' rows, which
// cover the positions of a training step's packed sequences (0..seq-1).
// The caller holds d.ropeMu until its kernel is queued, so a rebuild's
// stream-ordered free of the old table comes after every kernel that
// read it.
func (d *Device) ropeTableFor(key ropeKey, rows int) (*ropeTable, error) {
	if tab := d.ropeTabs[key]; tab != nil && tab.rows >= rows {
		return tab, nil
	}
	kern, err := sourceKernel(d, "rope.cu", "rope_table")
	if err != nil {
		return nil, err
	}
	buf, err := d.Alloc(int64(rows) * int64(key.headDim/2) * 8)
	if err != nil {
		return nil, err
	}
	n := int64(rows) * int64(key.headDim/2)
	if err := d.Launch(kern, d.StrideGrid(n, 256, 8), buf, int32(rows), int32(key.headDim), key.theta); err != nil {
		return nil, errors.Join(err, d.Free(buf))
	}
	if d.ropeTabs == nil {
		d.ropeTabs = map[ropeKey]*ropeTable{}
	}
	if old := d.ropeTabs[key]; old != nil {
		if err := d.Free(old.buf); err != nil { // stream-ordered: after the kernels that read it
			return nil, err
		}
	}
	tab := &ropeTable{buf: buf, rows: rows}
	d.ropeTabs[key] = tab
	return tab, nil
}

// RoPE writes out = x rotated, x float32 [rows, width] with width a
// multiple of headDim: each row t turns every head's dim pairs (i,
// i+headDim/2) by pos[t] * theta^(-2i/headDim), pos being int32 [rows];
// inverse turns back (the backward). out is x itself (in place) or does
// not overlap it; outBF16 makes it bf16, each value rounded once from the
// float32 rotation. The cosines and sines of positions below rows come
// from the device's table for theta and headDim (built on first use, in
// float64 as backend/cpu computes them); other positions compute theirs
// in the kernel, the same way. It queues the kernels on d's stream; launch
// errors come back from the next Sync.
func RoPE(d *Device, out, x, pos driver.DevicePtr, rows, width, headDim int, theta float64, inverse, outBF16 bool) error {
	return ropeWith(d, out, x, pos, rows, width, headDim, theta, inverse, outBF16, true, true)
}

// ropeWith is RoPE, with the table or (withTable false: the tests'
// reference) every angle computed in the kernel, and four pairs a thread
// where ropeQuads allows and quads is set (false: the tests' reference).
func ropeWith(d *Device, out, x, pos driver.DevicePtr, rows, width, headDim int, theta float64, inverse, outBF16, withTable, quads bool) error {
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
	pairsPerThread := 1
	if quads && ropeQuads(out, x, rows, width, headDim, outBF16) {
		name += "_x4"
		pairsPerThread = 4
	}
	kern, err := sourceKernel(d, "rope.cu", name)
	if err != nil {
		return err
	}
	inv := int32(0)
	if inverse {
		inv = 1
	}
	d.ropeMu.Lock()
	defer d.ropeMu.Unlock()
	var tab driver.DevicePtr
	tabRows := 0
	if withTable {
		t, err := d.ropeTableFor(ropeKey{theta, headDim}, rows)
		if err != nil {
			return err
		}
		tab, tabRows = t.buf.Ptr(), t.rows
	}
	n := int64(rows) * int64(width/2) / int64(pairsPerThread)
	return d.Launch(kern, d.StrideGrid(n, 256, 8), out, x, pos, tab, int32(tabRows), int32(rows), int32(width), int32(headDim), theta, inv)
}

// ropeQuads reports whether rope.cu's four-pairs-a-thread kernels take a
// call: half the head dim a multiple of 4, x and out 16-byte aligned
// (bf16 out 8), and the thread count, rows*width/8, within 31 bits (the
// kernels' unsigned grid-stride index must not wrap).
func ropeQuads(out, x driver.DevicePtr, rows, width, headDim int, outBF16 bool) bool {
	outAlign := driver.DevicePtr(16)
	if outBF16 {
		outAlign = 8
	}
	return (headDim/2)%4 == 0 && x%16 == 0 && out%outAlign == 0 && int64(rows)*int64(width/8) <= math.MaxInt32
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
