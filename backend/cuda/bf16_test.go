package cuda

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// TestHostBF16 checks Upload's and Download's host conversions against
// bf16Nearest (an independent statement of rounding to nearest even) on
// random bit patterns, ties and their neighbours, and special values.
func TestHostBF16(t *testing.T) {
	rng := rand.New(rand.NewPCG(41, 42))
	var xs []float32
	for range 100000 {
		xs = append(xs, math.Float32frombits(rng.Uint32()))
	}
	for i := range 3000 {
		xs = append(xs, math.Float32frombits(rng.Uint32()&0xffff0000|0x8000+uint32(i%3)-1))
	}
	xs = append(xs, 0, float32(math.Copysign(0, -1)), float32(math.Inf(1)), float32(math.Inf(-1)),
		math.MaxFloat32, -math.MaxFloat32, 1e-40, math.Float32frombits(0x7f7f8000), math.Float32frombits(0x7f800001))
	for _, x := range xs {
		h := bf16Bits(x)
		if x != x {
			if v := bf16Value(h); v == v {
				t.Fatalf("NaN %#08x rounds to %v", math.Float32bits(x), v)
			}
			continue
		}
		if want := bf16Nearest(x); h != want {
			t.Fatalf("bf16Bits(%g = %#08x) = %#04x, want %#04x", x, math.Float32bits(x), h, want)
		}
		if v := bf16Value(h); math.Float32bits(v) != uint32(h)<<16 {
			t.Fatalf("bf16Value(%#04x) = %#08x", h, math.Float32bits(v))
		}
	}
}

func TestDTypeBytes(t *testing.T) {
	for dt, want := range map[backend.DType]int{backend.Float32: 4, backend.Int32: 4, backend.BFloat16: 2} {
		if got := dtypeBytes(dt); got != want {
			t.Errorf("dtypeBytes(%v) = %d, want %d", dt, got, want)
		}
	}
}
