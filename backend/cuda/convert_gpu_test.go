package cuda

// The vectorised float32 -> bf16 conversion (kernels/convert_vec.cu) on the
// GPU: bit for bit against f32_to_bf16 and against the float64 statement
// of rounding (bf16Nearest), and its speed beside the scalar kernel's.

import (
	"fmt"
	"math"
	"testing"
)

func TestKernelBF16x4(t *testing.T) {
	k := newKT(t, 5)
	x := k.randn(50000, 10)
	for _, u := range []uint32{
		0, 0x80000000, 0x7f800000, 0xff800000, 0x7f7fffff, 0xff7fffff, 0x00000001, 0x80000400,
		0x3f808000, 0x3f818000, 0x7f7f8000, 0x3f80ffff, 0x7fc00000, 0x7f800001, 0xffc00001, 0x7fffffff, 0xff800001,
	} {
		x = append(x, math.Float32frombits(u))
	}
	for i := range 2000 { // exact ties and their neighbours
		x = append(x, math.Float32frombits(k.rng.Uint32()&0xffff0000|0x8000+uint32(i%3)-1))
	}
	for len(x)%4 != 3 { // a tail past the last group of four
		x = append(x, float32(k.rng.NormFloat64()))
	}
	dx := upload(k, x)
	x4 := kernel(t, k.d, "convert_vec.cu", "f32_to_bf16_x4")
	scalar := kernel(t, k.d, "convert.cu", "f32_to_bf16")
	for _, c := range []struct {
		n    int
		grid Grid
	}{
		{len(x), k.d.StrideGrid(int64(len(x)+3)/4, 256, 8)},
		{len(x), Grid1D(3, 256)}, // many trips round the grid-stride loop
		{len(x) - 3, Grid1D(5, 64)},
		{1, Grid1D(1, 256)}, {2, Grid1D(1, 32)}, {3, Grid1D(2, 32)}, {5, Grid1D(1, 32)}, {7, Grid1D(1, 256)}, {8, Grid1D(1, 32)},
	} {
		what := fmt.Sprintf("n = %d, %d blocks of %d", c.n, c.grid.Grid.X, c.grid.Block.X)
		// Room past n, filled with a marker, to catch stray writes.
		words := (2*c.n + 16 + 3) / 4
		got, want := k.marked(words), k.marked(words)
		if err := k.d.Launch(x4, c.grid, got, dx, int64(c.n)); err != nil {
			t.Fatal(err)
		}
		if err := k.d.Launch(scalar, k.d.StrideGrid(int64(c.n), 256, 4), want, dx, int64(c.n)); err != nil {
			t.Fatal(err)
		}
		gb, wb := k.bits16(got, 2*words), k.bits16(want, 2*words)
		for i := range gb {
			switch {
			case i >= c.n && gb[i] != 0xaaaa:
				t.Fatalf("%s: element %d, past n, was written: %#04x", what, i, gb[i])
			case i < c.n && gb[i] != wb[i]:
				t.Fatalf("%s: bf16(%g = %#08x): f32_to_bf16_x4 gave %#04x, f32_to_bf16 %#04x", what, x[i], math.Float32bits(x[i]), gb[i], wb[i])
			case i < c.n && gb[i] != bf16Nearest(x[i]):
				t.Fatalf("%s: bf16(%g = %#08x) = %#04x, want %#04x", what, x[i], math.Float32bits(x[i]), gb[i], bf16Nearest(x[i]))
			}
		}
	}
}

// TestConvertFigures times both conversions on 64M elements (256 MiB in,
// 128 MiB out) and checks that they agree.
func TestConvertFigures(t *testing.T) {
	k := newKT(t, 6)
	const n = 64 << 20
	x := k.randn(n, 3)
	dx := upload(k, x)
	outs := map[string]*Buffer{}
	for _, c := range []struct {
		file, name string
		grid       Grid
	}{
		{"convert.cu", "f32_to_bf16", k.d.StrideGrid(n, 256, 4)},
		{"convert_vec.cu", "f32_to_bf16_x4", k.d.StrideGrid(n/4, 256, 8)},
	} {
		out := k.marked(n / 2)
		kern := kernel(t, k.d, c.file, c.name)
		ms := attnMedianMs(t, k.d, func() error { return k.d.Launch(kern, c.grid, out, dx, int64(n)) })
		figure(t, c.name+" 64M elements (6 B/element)", 6*n/ms/1e6, "GB/s")
		outs[c.name] = out
	}
	a, b := k.bits16(outs["f32_to_bf16"], n), k.bits16(outs["f32_to_bf16_x4"], n)
	for i := range a {
		if a[i] != b[i] || (i%4099 == 0 && a[i] != bf16Nearest(x[i])) {
			t.Fatalf("element %d (%g): f32_to_bf16 %#04x, f32_to_bf16_x4 %#04x, want %#04x", i, x[i], a[i], b[i], bf16Nearest(x[i]))
		}
	}
}

// marked is a buffer of words 32-bit words, each 0xaaaaaaaa.
func (k *kt) marked(words int) *Buffer {
	k.t.Helper()
	b, err := k.d.Alloc(int64(4 * words))
	if err != nil {
		k.t.Fatal(err)
	}
	if err := k.d.Memset32(b, 0, int64(words), 0xaaaaaaaa); err != nil {
		k.t.Fatal(err)
	}
	k.t.Cleanup(func() { k.d.Free(b) })
	return b
}

// bits16 downloads n 16-bit words of b.
func (k *kt) bits16(b *Buffer, n int) []uint16 {
	k.t.Helper()
	if err := k.d.Sync(); err != nil {
		k.t.Fatal(err)
	}
	out := make([]uint16, n)
	if err := k.d.CopyFromDevice(Bytes(out), b, 0); err != nil {
		k.t.Fatal(err)
	}
	return out
}
