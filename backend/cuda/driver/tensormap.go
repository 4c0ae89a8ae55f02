package driver

// TMA tensor maps (CUtensorMap) for the Hopper bulk tensor copy engine.
// cuTensorMapEncodeTiled (CUDA 12.0+) is resolved on first use rather than
// in LoadDriver's table, so an older libcuda still loads and only the
// kernels that need tensor maps report the missing symbol.

import (
	"fmt"
	"unsafe"
)

// TensorMap is a CUtensorMap: 128 opaque bytes the driver fills and a
// kernel takes by value (a __grid_constant__ parameter).
type TensorMap [16]uint64

// TensorMapDataType is a CUtensorMapDataType.
type TensorMapDataType int32

const (
	TensorMapUint8    TensorMapDataType = 0
	TensorMapFloat16  TensorMapDataType = 6
	TensorMapFloat32  TensorMapDataType = 7
	TensorMapBfloat16 TensorMapDataType = 9
)

// elemBytes is the element size of the types above.
func (t TensorMapDataType) elemBytes() (int, bool) {
	switch t {
	case TensorMapUint8:
		return 1, true
	case TensorMapFloat16, TensorMapBfloat16:
		return 2, true
	case TensorMapFloat32:
		return 4, true
	}
	return 0, false
}

// TensorMapSwizzle is a CUtensorMapSwizzle: how TMA permutes the 16-byte
// chunks of each shared-memory row (the wgmma descriptor must name the
// same swizzle).
type TensorMapSwizzle int32

const (
	SwizzleNone TensorMapSwizzle = 0
	Swizzle32B  TensorMapSwizzle = 1
	Swizzle64B  TensorMapSwizzle = 2
	Swizzle128B TensorMapSwizzle = 3
)

// bytes is the swizzle span, the most bytes a box's inner dimension may
// have under it (0: no limit).
func (s TensorMapSwizzle) bytes() int {
	switch s {
	case Swizzle32B:
		return 32
	case Swizzle64B:
		return 64
	case Swizzle128B:
		return 128
	}
	return 0
}

// TensorMapL2Promotion is a CUtensorMapL2promotion.
type TensorMapL2Promotion int32

const (
	L2PromotionNone TensorMapL2Promotion = 0
	L2Promotion64B  TensorMapL2Promotion = 1
	L2Promotion128B TensorMapL2Promotion = 2
	L2Promotion256B TensorMapL2Promotion = 3
)

// TiledMap describes a tiled tensor map: a row-major tensor in device
// memory of up to 5 dimensions, innermost first, and the box one copy
// moves. Elements outside the tensor read as zero.
type TiledMap struct {
	Type TensorMapDataType
	Addr DevicePtr // 16-byte aligned
	// Dims are the sizes, innermost first; Strides the byte distances of
	// dims 1.. (len(Dims)-1 entries, multiples of 16).
	Dims    []uint64
	Strides []uint64
	// Box is the copy's extent in elements per dimension (each 1..256);
	// the inner extent times the element size must be a multiple of 16
	// bytes and fit the swizzle span.
	Box     []uint32
	Swizzle TensorMapSwizzle
	L2      TensorMapL2Promotion
}

// Check validates m as cuTensorMapEncodeTiled would, with errors naming
// the field, so a bad map is reported before the driver's bare
// CUDA_ERROR_INVALID_VALUE.
func (m TiledMap) Check() error {
	eb, ok := m.Type.elemBytes()
	if !ok {
		return fmt.Errorf("tensor map: data type %d is not one this package knows", m.Type)
	}
	rank := len(m.Dims)
	if rank < 1 || rank > 5 {
		return fmt.Errorf("tensor map: rank %d, want 1..5", rank)
	}
	if len(m.Strides) != rank-1 {
		return fmt.Errorf("tensor map: %d strides for rank %d, want %d", len(m.Strides), rank, rank-1)
	}
	if len(m.Box) != rank {
		return fmt.Errorf("tensor map: box has %d dims for rank %d", len(m.Box), rank)
	}
	if m.Addr == 0 || m.Addr%16 != 0 {
		return fmt.Errorf("tensor map: address %#x is not 16-byte aligned (or null)", uint64(m.Addr))
	}
	for i, d := range m.Dims {
		if d == 0 || d > 1<<32 {
			return fmt.Errorf("tensor map: dim %d is %d, want 1..2^32", i, d)
		}
	}
	for i, s := range m.Strides {
		if s%16 != 0 || s >= 1<<40 {
			return fmt.Errorf("tensor map: stride %d is %d bytes, want a multiple of 16 under 2^40", i+1, s)
		}
	}
	for i, b := range m.Box {
		if b == 0 || b > 256 {
			return fmt.Errorf("tensor map: box dim %d is %d, want 1..256", i, b)
		}
	}
	inner := int(m.Box[0]) * eb
	if inner%16 != 0 {
		return fmt.Errorf("tensor map: box inner extent %d bytes is not a multiple of 16", inner)
	}
	if sw := m.Swizzle.bytes(); sw > 0 && inner > sw {
		return fmt.Errorf("tensor map: box inner extent %d bytes exceeds the %d-byte swizzle", inner, sw)
	}
	return nil
}

// TensorMapEncoder calls cuTensorMapEncodeTiled.
type TensorMapEncoder struct {
	d  *Driver
	fn uintptr
}

// TensorMapEncoder resolves cuTensorMapEncodeTiled in the loaded libcuda.
func (d *Driver) TensorMapEncoder() (*TensorMapEncoder, error) {
	fn, err := d.lib.Symbol("cuTensorMapEncodeTiled")
	if err != nil {
		return nil, err
	}
	return &TensorMapEncoder{d: d, fn: fn}, nil
}

// EncodeTiled fills out from m (element strides 1, no interleave, zero
// out-of-bounds fill). It needs no context.
func (e *TensorMapEncoder) EncodeTiled(out *TensorMap, m TiledMap) error {
	if err := m.Check(); err != nil {
		return err
	}
	rank := len(m.Dims)
	// The driver wants the map 64-byte aligned; Go guarantees 8, so
	// encode into an aligned window of a larger array and copy out.
	raw := new([24]uint64) // on the heap, which does not move
	off := 0
	for uintptr(unsafe.Pointer(&raw[off]))%64 != 0 {
		off++
	}
	dims := make([]uint64, rank)
	copy(dims, m.Dims)
	strides := make([]uint64, rank) // the driver reads rank-1
	copy(strides, m.Strides)
	box := make([]uint32, rank)
	copy(box, m.Box)
	elem := make([]uint32, rank)
	for i := range elem {
		elem[i] = 1
	}
	const interleaveNone, oobFillZero = 0, 0
	r := e.d.call(e.fn,
		uintptr(unsafe.Pointer(&raw[off])), uintptr(m.Type), uintptr(rank), uintptr(m.Addr),
		uintptr(unsafe.Pointer(&dims[0])), uintptr(unsafe.Pointer(&strides[0])),
		uintptr(unsafe.Pointer(&box[0])), uintptr(unsafe.Pointer(&elem[0])),
		interleaveNone, uintptr(m.Swizzle), uintptr(m.L2), oobFillZero)
	if err := e.d.check(r, "cuTensorMapEncodeTiled(rank %d, dims %v, box %v)", rank, m.Dims, m.Box); err != nil {
		return err
	}
	copy(out[:], raw[off:off+16])
	return nil
}
