package cuda

// The RoPE kernel on the GPU against backend/cpu in float64, forward and
// inverse, at positions up to 1e5, in place (the conformance suite's
// RoPE/out and RoPE/bf16-out cases cover a separate and a bf16 out).

import (
	"fmt"
	"math"
	"slices"
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

// TestRoPETableIsTheKernelsAngles: the device's cos/sin table gives the
// bits the kernel computes itself, for positions inside the table (a
// packed batch: pos = t mod seq) and past it, float32 and bf16 out, in
// place, and after the table grows (each case's call has more rows than
// the last, with one theta of this test's own, so each rebuilds it).
func TestRoPETableIsTheKernelsAngles(t *testing.T) {
	const theta = 12345.0
	for n, c := range []struct{ rows, seq, heads, headDim int }{{50, 16, 4, 64}, {256, 64, 4, 64}, {1000, 250, 2, 64}} {
		k := newKT(t, uint64(60+n))
		width := c.heads * c.headDim
		x := k.randn(c.rows*width, 1)
		pos := make([]int32, c.rows)
		for i := range pos {
			pos[i] = int32(i % c.seq)
			if i%7 == 3 {
				pos[i] = int32(c.rows + 100*i) // past the table
			}
		}
		bx, bpos := upload(k, x), upload(k, pos)
		for _, bf16 := range []bool{false, true} {
			for _, inverse := range []bool{false, true} {
				var got [2][]float32
				for i, withTable := range []bool{true, false} {
					out := k.out(c.rows*width, bf16)
					if err := ropeWith(k.d, out.Ptr(), bx.Ptr(), bpos.Ptr(), c.rows, width, c.headDim, theta, inverse, bf16, withTable, true); err != nil {
						t.Fatal(err)
					}
					got[i] = k.values(out, c.rows*width, bf16)
				}
				for i := range got[0] {
					if math.Float32bits(got[0][i]) != math.Float32bits(got[1][i]) {
						t.Fatalf("rows %d bf16 %v inverse %v: element %d (position %d) is %v with the table, %v without",
							c.rows, bf16, inverse, i, pos[i/width], got[0][i], got[1][i])
					}
				}
			}
		}
		// In place, as the backward turns the gradients back.
		want := k.out(c.rows*width, false)
		if err := ropeWith(k.d, want.Ptr(), bx.Ptr(), bpos.Ptr(), c.rows, width, c.headDim, theta, true, false, false, true); err != nil {
			t.Fatal(err)
		}
		if err := RoPE(k.d, bx.Ptr(), bx.Ptr(), bpos.Ptr(), c.rows, width, c.headDim, theta, true, false); err != nil {
			t.Fatal(err)
		}
		if got, w := k.download(bx, c.rows*width), k.download(want, c.rows*width); !slices.Equal(got, w) {
			t.Errorf("rows %d: the in-place rotation differs from the separate one", c.rows)
		}
		k.d.ropeMu.Lock()
		tab := k.d.ropeTabs[ropeKey{theta, c.headDim}]
		k.d.ropeMu.Unlock()
		if tab == nil || tab.rows != c.rows {
			t.Errorf("rows %d: the table holds %v positions, want %d", c.rows, tab, c.rows)
		}
	}
}

// TestRoPEQuadsArePairs: the four-pairs-a-thread kernels give the bits of
// the one-pair kernels, float32 and bf16 out, forward and inverse, in
// place and into another buffer, for positions inside the table and past
// it; and a call they cannot take (x one float off 16-byte alignment)
// falls back to the pairs, still right.
func TestRoPEQuadsArePairs(t *testing.T) {
	const theta = 1e6
	for n, c := range []struct{ rows, seq, heads, headDim int }{{333, 100, 16, 64}, {70, 64, 4, 128}, {129, 40, 3, 16}} {
		k := newKT(t, uint64(70+n))
		width := c.heads * c.headDim
		if !ropeQuads(16, 16, c.rows, width, c.headDim, false) {
			t.Fatalf("head dim %d: the quad kernels do not take the case", c.headDim)
		}
		x := k.randn(c.rows*width, 1)
		pos := make([]int32, c.rows)
		for i := range pos {
			pos[i] = int32(i % c.seq)
			if i%11 == 5 {
				pos[i] = int32(5*c.rows + i) // past the table
			}
		}
		bx, bpos := upload(k, x), upload(k, pos)
		for _, bf16 := range []bool{false, true} {
			for _, inverse := range []bool{false, true} {
				var got [2][]float32
				for i, quads := range []bool{true, false} {
					out := k.out(c.rows*width, bf16)
					if err := ropeWith(k.d, out.Ptr(), bx.Ptr(), bpos.Ptr(), c.rows, width, c.headDim, theta, inverse, bf16, true, quads); err != nil {
						t.Fatal(err)
					}
					got[i] = k.values(out, c.rows*width, bf16)
				}
				for i := range got[0] {
					if math.Float32bits(got[0][i]) != math.Float32bits(got[1][i]) {
						t.Fatalf("head dim %d bf16 %v inverse %v: element %d (position %d) is %v four pairs a thread, %v one",
							c.headDim, bf16, inverse, i, pos[i/width], got[0][i], got[1][i])
					}
				}
			}
		}
		// In place.
		want := k.out(c.rows*width, false)
		if err := ropeWith(k.d, want.Ptr(), bx.Ptr(), bpos.Ptr(), c.rows, width, c.headDim, theta, false, false, true, false); err != nil {
			t.Fatal(err)
		}
		if err := RoPE(k.d, bx.Ptr(), bx.Ptr(), bpos.Ptr(), c.rows, width, c.headDim, theta, false, false); err != nil {
			t.Fatal(err)
		}
		if got, w := k.download(bx, c.rows*width), k.download(want, c.rows*width); !slices.Equal(got, w) {
			t.Errorf("head dim %d: the in-place rotation four pairs a thread differs from the pairs'", c.headDim)
		}
	}

	// One float off alignment: the pairs kernel runs, against the CPU.
	k := newKT(t, 79)
	const rows, heads, headDim = 21, 2, 64
	width := heads * headDim
	x := k.randn(rows*width+1, 1)
	pos := k.ids(rows, 1000)
	bx, bpos := upload(k, x), upload(k, pos)
	if ropeQuads(bx.Ptr()+4, bx.Ptr()+4, rows, width, headDim, false) {
		t.Fatal("the quad kernels take an x 4 bytes off alignment")
	}
	if err := RoPE(k.d, bx.Ptr()+4, bx.Ptr()+4, bpos.Ptr(), rows, width, headDim, theta, false, false); err != nil {
		t.Fatal(err)
	}
	ref := k.cpuF(x[1:], rows, width)
	k.ref.RoPE(ref, ref, k.cpuI(pos), headDim, theta, false)
	k.check("rope one float off alignment", k.download(bx, len(x))[1:], k.get(ref), fp32Tol)
}
