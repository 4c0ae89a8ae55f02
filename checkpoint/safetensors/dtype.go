package safetensors

import (
	"encoding/binary"
	"fmt"
	"math"
	"unsafe"
)

// DType is a safetensors element type, spelled as in the header ("F32").
type DType string

// The element types of the safetensors format. The writer produces F32 and
// BF16; the reader converts F32, BF16, F16 and F64 to float32 and parses
// headers naming any of them.
const (
	BOOL   DType = "BOOL"
	U8     DType = "U8"
	I8     DType = "I8"
	F8E4M3 DType = "F8_E4M3"
	F8E5M2 DType = "F8_E5M2"
	I16    DType = "I16"
	U16    DType = "U16"
	F16    DType = "F16"
	BF16   DType = "BF16"
	I32    DType = "I32"
	U32    DType = "U32"
	F32    DType = "F32"
	F64    DType = "F64"
	I64    DType = "I64"
	U64    DType = "U64"
)

// Size is the number of bytes of one element, or 0 for an unknown dtype.
func (d DType) Size() int {
	switch d {
	case BOOL, U8, I8, F8E4M3, F8E5M2:
		return 1
	case I16, U16, F16, BF16:
		return 2
	case I32, U32, F32:
		return 4
	case F64, I64, U64:
		return 8
	}
	return 0
}

// readable reports whether decodeFloat32 can convert d.
func (d DType) readable() bool {
	switch d {
	case F32, BF16, F16, F64:
		return true
	}
	return false
}

// writable reports whether the Writer can produce d.
func (d DType) writable() bool { return d == F32 || d == BF16 }

// BF16FromFloat32 rounds f to bfloat16 (the top 16 bits of a float32),
// to nearest with ties to even. NaN stays a (quiet) NaN with f's sign;
// values above the largest bfloat16 round to infinity.
func BF16FromFloat32(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 {
		// Truncating could clear every mantissa bit left and make an
		// infinity; setting the quiet bit keeps it a NaN.
		return uint16(b>>16) | 0x0040
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// Float32FromBF16 widens a bfloat16 exactly.
func Float32FromBF16(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// float32FromF16 widens an IEEE half exactly.
func float32FromF16(h uint16) float32 {
	sign := uint32(h>>15) << 31
	exp := uint32(h>>10) & 0x1f
	man := uint32(h) & 0x3ff
	switch {
	case exp == 0x1f: // inf or NaN
		return math.Float32frombits(sign | 0x7f800000 | man<<13)
	case exp == 0 && man == 0:
		return math.Float32frombits(sign)
	case exp == 0: // subnormal: value = man * 2^-24
		f := float32(man) * (1.0 / (1 << 24))
		if sign != 0 {
			f = -f
		}
		return f
	}
	return math.Float32frombits(sign | (exp+127-15)<<23 | man<<13)
}

// encodeFloat32 writes src as dtype d into dst, which holds exactly
// len(src)*d.Size() bytes.
func encodeFloat32(d DType, dst []byte, src []float32) {
	switch d {
	case F32:
		for i, v := range src {
			binary.LittleEndian.PutUint32(dst[4*i:], math.Float32bits(v))
		}
	case BF16:
		for i, v := range src {
			binary.LittleEndian.PutUint16(dst[2*i:], BF16FromFloat32(v))
		}
	default:
		panic(fmt.Sprintf("safetensors: encodeFloat32 called with %s", d)) // guarded by writable
	}
}

// decodeFloat32 converts src, holding len(dst) elements of dtype d, into dst.
func decodeFloat32(d DType, dst []float32, src []byte) {
	switch d {
	case F32:
		for i := range dst {
			dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(src[4*i:]))
		}
	case BF16:
		for i := range dst {
			dst[i] = Float32FromBF16(binary.LittleEndian.Uint16(src[2*i:]))
		}
	case F16:
		for i := range dst {
			dst[i] = float32FromF16(binary.LittleEndian.Uint16(src[2*i:]))
		}
	case F64:
		for i := range dst {
			dst[i] = float32(math.Float64frombits(binary.LittleEndian.Uint64(src[8*i:])))
		}
	default:
		panic(fmt.Sprintf("safetensors: decodeFloat32 called with %s", d)) // guarded by readable
	}
}

// hostIsLittleEndian reports whether the host's float32 memory already has
// the file's byte order, so F32 data can be moved without conversion.
func hostIsLittleEndian() bool { return binary.NativeEndian.Uint16([]byte{1, 0}) == 1 }

// float32Bytes views f's memory as bytes (no copy).
func float32Bytes(f []float32) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(f))), 4*len(f))
}
