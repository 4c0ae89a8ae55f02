package cuda

// The RoPE kernel on the GPU against backend/cpu in float64, forward and
// inverse, at positions up to 1e5, in place (the conformance suite's
// RoPE/out and RoPE/bf16-out cases cover a separate and a bf16 out).

import (
	"fmt"
	"testing"
)

func TestRoPEKernel(t *testing.T) {
	testDevice(t)
	cases := []struct {
		rows, heads, headDim int
		theta                float64
	}{
		{37, 3, 64, 1e6},
		{300, 5, 16, 1e4},
		{9, 2, 128, 5e5},
	}
	for n, c := range cases {
		t.Run(fmt.Sprintf("rows%d_heads%d_dh%d", c.rows, c.heads, c.headDim), func(t *testing.T) {
			k := newKT(t, uint64(50+n))
			width := c.heads * c.headDim
			x := k.randn(c.rows*width, 1)
			pos := k.ids(c.rows, 100_000)
			pos[0], pos[c.rows-1] = 0, 99_999
			bx, bpos := upload(k, x), upload(k, pos)
			for _, inverse := range []bool{false, true} {
				if err := k.d.CopyToDevice(bx, 0, Bytes(x)); err != nil {
					t.Fatal(err)
				}
				if err := RoPE(k.d, bx.Ptr(), bx.Ptr(), bpos.Ptr(), c.rows, width, c.headDim, c.theta, inverse, false); err != nil {
					t.Fatal(err)
				}
				ref := k.cpuF(x, c.rows, width)
				k.ref.RoPE(ref, ref, k.cpuI(pos), c.headDim, c.theta, inverse)
				k.check(fmt.Sprintf("rope inverse=%v", inverse), k.download(bx, len(x)), k.get(ref), fp32Tol)
			}
			// The inverse undoes the forward (x now holds the inverse
			// rotation of the original).
			if err := RoPE(k.d, bx.Ptr(), bx.Ptr(), bpos.Ptr(), c.rows, width, c.headDim, c.theta, false, false); err != nil {
				t.Fatal(err)
			}
			k.check("rope round trip", k.download(bx, len(x)), k.get(k.cpuF(x, len(x))), fp32Tol)
		})
	}
}

// TestRoPEZeroRows: no rows is a no-op, not a launch of an empty grid.
func TestRoPEZeroRows(t *testing.T) {
	d := testDevice(t)
	if err := RoPE(d, 0, 0, 0, 0, 64, 64, 1e4, false, false); err != nil {
		t.Fatal(err)
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
}
