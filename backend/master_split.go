package backend

import (
	"math"
	"slices"
)

// Split master weights.
//
// Where the products multiply in bf16, a trainer keeps the float32 master
// weights for AdamW and a bf16 copy for the products: 6 bytes a
// parameter. Split masters keep 4: the bf16 copy itself (hi) and the 16
// bits that turn it back into the float32 master (lo). hi rounds the
// master to bf16 by adding half a bf16 ulp to its bit pattern (ties away
// from zero), so the master's bit pattern is hi's shifted up 16 bits plus
// lo's read as a signed 16-bit number, and lo is just the master's low 16
// bits. AdamWUpdateSplit updates the pair as the float32 AdamW updates the
// master, and the products read hi as they read the bf16 copy, which
// then costs neither memory nor a pass per step. hi differs from the bf16
// copy's round-to-nearest-even only at exact ties, which round away from
// zero instead of to even.
//
// The lo halves of n weights are an Int32 tensor of n/2 words, weight i's
// bits in the low half of word i/2 when i is even, the high half when
// odd; n is even.

// SplitMaster returns the halves of the master weight w: hi, a float32
// on the bf16 grid, and lo. A NaN stays a NaN in hi (its quiet bit set);
// it does not come back bit for bit.
func SplitMaster(w float32) (hi float32, lo uint16) {
	u := math.Float32bits(w)
	lo = uint16(u)
	if u&0x7fffffff > 0x7f800000 {
		return math.Float32frombits((u | 0x00400000) &^ 0xffff), lo
	}
	return math.Float32frombits((u + 0x8000) &^ 0xffff), lo
}

// JoinMaster is the master weight whose halves are hi and lo.
func JoinMaster(hi float32, lo uint16) float32 {
	return math.Float32frombits(math.Float32bits(hi) + uint32(int32(int16(lo))))
}

// SplitMasters splits ws (of even length) into the values of its hi tensor
// and the words of its lo tensor.
func SplitMasters(ws []float32) (hi []float32, lo []int32) {
	hi = slices.Clone(ws)
	return hi, SplitMastersInPlace(hi)
}

// SplitMastersInPlace is SplitMasters overwriting ws with hi.
func SplitMastersInPlace(ws []float32) (lo []int32) {
	lo = make([]int32, (len(ws)+1)/2)
	for i, w := range ws {
		h, l := SplitMaster(w)
		ws[i] = h
		lo[i/2] |= int32(uint32(l) << (16 * (i % 2)))
	}
	return lo
}

// JoinMasters is the masters of the halves hi and lo (SplitMasters).
func JoinMasters(hi []float32, lo []int32) []float32 {
	ws := make([]float32, len(hi))
	for i, h := range hi {
		ws[i] = JoinMaster(h, uint16(uint32(lo[i/2])>>(16*(i%2))))
	}
	return ws
}
