package backend

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestSplitMasterRoundTrip: every float32 that is not a NaN comes back
// bit for bit from its halves, hi is on the bf16 grid within half a bf16
// ulp of the master (ties away from zero), and a NaN stays a NaN.
func TestSplitMasterRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	words := []uint32{0, 0x80000000, 0x00000001, 0x00008000, 0x3f808000, 0x3f818000, 0xbf808000, 0x7f7fffff, 0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001}
	for range 200000 {
		words = append(words, rng.Uint32())
	}
	for _, u := range words {
		w := math.Float32frombits(u)
		hi, lo := SplitMaster(w)
		if math.Float32bits(hi)&0xffff != 0 {
			t.Fatalf("%08x: hi %08x is not on the bf16 grid", u, math.Float32bits(hi))
		}
		back := JoinMaster(hi, lo)
		if w != w {
			if hi == hi || back == back {
				t.Fatalf("%08x (NaN): hi %g, joined %g", u, hi, back)
			}
			continue
		}
		if math.Float32bits(back) != u {
			t.Fatalf("%08x: joined %08x", u, math.Float32bits(back))
		}
		// Half a bf16 ulp at most, a tie rounding away from zero.
		if d := int64(u&0xffff) - 0x8000; d >= 0 && math.Abs(float64(hi)) < math.Abs(float64(w)) && !math.IsInf(float64(hi), 0) {
			t.Fatalf("%08x: a tie or above rounded toward zero to %08x", u, math.Float32bits(hi))
		}
	}
	ws := []float32{1, -2.5, 3e-3, 7}
	h, l := SplitMasters(ws)
	if got := JoinMasters(h, l); len(got) != 4 || got[0] != 1 || got[1] != -2.5 || got[2] != 3e-3 || got[3] != 7 {
		t.Errorf("JoinMasters(SplitMasters(%v)) = %v", ws, got)
	}
}
