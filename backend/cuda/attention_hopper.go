package cuda

// The Hopper attention forward: the launch side of
// kernels/attention_hopper.cu (its header describes the kernel). bf16 q, k
// and v go in through TMA tensor maps; out and lse come out float32, with
// AttentionForward's semantics. It serves head dims 64 and 128 on sm_90a
// GPUs; attentionForward picks it there and rounds float32 inputs to bf16
// first (the tensor-core kernels round them too, as they stage tiles, so
// the results agree to float32 rounding of the accumulations).

import (
	"fmt"
	"math"
	"runtime"
	"unsafe"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// hopperAttnBM is the queries a block owns; hopperAttnBN the keys of a
// tile (kernels/attention_hopper.cu's AH_BM and AH_BN).
const hopperAttnBM, hopperAttnBN = 128, 128

// hopperAttnStages is the depth of the kernel's k/v ring per head dim
// (ah_cfg<DH>::STAGES).
func hopperAttnStages(dh int) int {
	if dh == 64 {
		return 4
	}
	return 2
}

// hopperAttnSmem is the kernel's dynamic shared memory (ah_cfg<DH>::SMEM):
// alignment slack, the q tile, the ring of k and v tiles and the
// mbarriers.
func hopperAttnSmem(dh int) int {
	stages, tile := hopperAttnStages(dh), dh/64*hopperAttnBN*128
	return 1024 + tile + 2*stages*tile + 8*(1+3*stages)
}

// hopperAttnTakes says whether the Hopper kernels run s on d: a Hopper
// GPU with the shared memory they need, and head dim 64 or 128.
func hopperAttnTakes(d *Device, s backend.AttnShape) bool {
	return d.info.Arch == "sm_90a" && tcHeadDim(s.HeadDim) && d.info.MaxSharedOptIn >= hopperAttnSmem(s.HeadDim)
}

// AttentionForwardBF16 is AttentionForward on bf16 q [B*S, H*Dh], k and v
// [B*KS, KV*Dh] (16-byte aligned), writing float32 out [B*S, H*Dh] and
// lse [B, H, S]. It needs a Hopper GPU and head dim 64 or 128.
// Asynchronous: launch errors come back from the next Sync.
func AttentionForwardBF16(d *Device, out, lse, q, k, v driver.DevicePtr, s backend.AttnShape) error {
	const op = "AttentionForwardBF16"
	if _, err := checkAttnShape(op, s); err != nil {
		return err
	}
	if !hopperAttnTakes(d, s) {
		return fmt.Errorf("cuda: %s: needs a Hopper GPU (sm_90a) and head dim 64 or 128; %s, head dim %d", op, d.info.Arch, s.HeadDim)
	}
	for _, p := range []driver.DevicePtr{out, q, k, v} {
		if p%16 != 0 {
			return fmt.Errorf("cuda: %s: tensors must be 16-byte aligned", op)
		}
	}
	return launchHopperAttnForward(d, out, lse, q, k, v, s)
}

// launchHopperAttnForward queues attn_h_forward_d{64,128} on checked
// arguments.
func launchHopperAttnForward(d *Device, out, lse, q, k, v driver.DevicePtr, s backend.AttnShape) error {
	dh := s.HeadDim
	kern, err := sourceKernel(d, "attention_hopper.cu", fmt.Sprintf("attn_h_forward_d%d", dh))
	if err != nil {
		return err
	}
	enc, err := d.drv.TensorMapEncoder()
	if err != nil {
		return fmt.Errorf("cuda: AttentionForward: %w", err)
	}
	// Each tensor is one 2-D map {columns, rows} read in boxes of 64
	// columns (128 bytes, the swizzle span) by 128 rows.
	tileMap := func(addr driver.DevicePtr, cols, rows int) driver.TiledMap {
		return driver.TiledMap{
			Type: driver.TensorMapBfloat16, Addr: addr,
			Dims: []uint64{uint64(cols), uint64(rows)}, Strides: []uint64{2 * uint64(cols)},
			Box: []uint32{64, hopperAttnBM}, Swizzle: driver.Swizzle128B, L2: driver.L2Promotion256B,
		}
	}
	keys := s.Keys()
	maps := []struct {
		name string
		m    driver.TiledMap
	}{
		{"q", tileMap(q, s.Heads*dh, s.Batch*s.Seq)},
		{"k", tileMap(k, s.KVHeads*dh, s.Batch*keys)},
		{"v", tileMap(v, s.KVHeads*dh, s.Batch*keys)},
	}
	for _, m := range maps {
		if err := m.m.Check(); err != nil {
			return fmt.Errorf("cuda: AttentionForward: %s: %w", m.name, err)
		}
	}
	_, scaleLog2 := attnScales(dh)
	slots := []uint64{uint64(out), uint64(lse), uint64(uint32(s.Seq)), uint64(uint32(keys)), uint64(uint32(attnOffset(s))),
		uint64(uint32(s.Heads)), uint64(uint32(s.KVHeads)), uint64(math.Float32bits(scaleLog2))}
	grid := Grid{
		Grid:   driver.Dim3{X: s.Batch * s.Heads, Y: (s.Seq + hopperAttnBM - 1) / hopperAttnBM, Z: 1},
		Block:  driver.Dim3{X: 384, Y: 1, Z: 1},
		Shared: hopperAttnSmem(dh),
	}
	return d.Submit(func() error {
		if err := d.drv.FuncSetAttribute(kern.fn, driver.FuncMaxDynamicSharedSizeOpt, grid.Shared); err != nil {
			return fmt.Errorf("%s: %w", kern.Desc.Name, err)
		}
		tms := make([]driver.TensorMap, len(maps))
		for i, m := range maps {
			if err := enc.EncodeTiled(&tms[i], m.m); err != nil {
				return fmt.Errorf("cuda: AttentionForward: %s tensor map: %w", m.name, err)
			}
		}
		var pin runtime.Pinner
		defer pin.Unpin()
		pin.Pin(&tms[0])
		pin.Pin(&slots[0])
		params := make([]unsafe.Pointer, 0, len(tms)+len(slots))
		for i := range tms {
			params = append(params, unsafe.Pointer(&tms[i]))
		}
		for i := range slots {
			params = append(params, unsafe.Pointer(&slots[i]))
		}
		pin.Pin(&params[0])
		if err := d.drv.LaunchKernel(kern.fn, grid.Grid, grid.Block, grid.Shared, d.stream, params); err != nil {
			return fmt.Errorf("%s: %w", kern.Desc.Name, err)
		}
		return nil
	})
}

// hopperAttnForwardF32 rounds float32 q, k and v to bf16 in scratch
// buffers and runs the Hopper forward on them.
func hopperAttnForwardF32(d *Device, out, lse, q, k, v driver.DevicePtr, s backend.AttnShape) error {
	conv, err := sourceKernel(d, "convert_vec.cu", "f32_to_bf16_x4")
	if err != nil {
		return err
	}
	nq := int64(s.Batch) * int64(s.Seq) * int64(s.Heads*s.HeadDim)
	nk := int64(s.Batch) * int64(s.Keys()) * int64(s.KVHeads*s.HeadDim)
	// One buffer for the three, each part 16-byte aligned (nq and nk are
	// multiples of 64 elements).
	buf, err := d.Alloc(2 * (nq + 2*nk))
	if err != nil {
		return err
	}
	// Free is stream-ordered: the kernels queued before it still see buf.
	defer d.Free(buf)
	qb, kb := buf.Ptr(), buf.Ptr()+driver.DevicePtr(2*nq)
	vb := kb + driver.DevicePtr(2*nk)
	for _, c := range []struct {
		dst, src driver.DevicePtr
		n        int64
	}{{qb, q, nq}, {kb, k, nk}, {vb, v, nk}} {
		if err := d.Launch(conv, d.StrideGrid((c.n+3)/4, 256, 8), c.dst, c.src, c.n); err != nil {
			return err
		}
	}
	return launchHopperAttnForward(d, out, lse, qb, kb, vb, s)
}
