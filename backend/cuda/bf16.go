package cuda

// bfloat16 on the host: the conversions of Upload and Download, bit for
// bit those of the kernels' prelude (kernels/prelude.cuh, mk_f32_to_bf16
// and mk_bf16_to_f32).

import "math"

// bf16Bits is f rounded to bfloat16, to nearest with ties to even, as its
// 16 bits. A NaN keeps its sign and the top of its payload with the quiet
// bit set, so it stays NaN.
func bf16Bits(f float32) uint16 {
	u := math.Float32bits(f)
	if u&0x7fffffff > 0x7f800000 {
		return uint16(u>>16) | 0x40
	}
	u += 0x7fff + (u>>16)&1
	return uint16(u >> 16)
}

// bf16Value is the float32 value of bf16 bits h (exact).
func bf16Value(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// bf16Slice rounds xs to bf16 bits.
func bf16Slice(xs []float32) []uint16 {
	out := make([]uint16, len(xs))
	for i, x := range xs {
		out[i] = bf16Bits(x)
	}
	return out
}
