package cuda

// Grouped GEMM for MoE experts: the launch side of kernels/grouped_gemm.cu
// (wgmma + TMA + mbarrier pipeline, sm_90a only; kernels/grouped_gemm.cuh
// describes the tiling). For each expert e with rows [off[e], off[e+1]) of
// A:
//
//	outRN[r, :] = alpha * aRK[r, :] . wENK[e]^T + beta * outRN[r, :]
//
// aRK [rows, K] and wENK [E, N, K] are bf16 row-major, outRN [rows, N] is
// float32 or bf16, accumulation is float32. The offsets (E+1 int32 prefix
// sums) stay in device memory: the kernel reads them and builds its own
// tile schedule, so a caller never synchronizes to learn the counts. Rows
// no expert owns (before off[0], from off[E] on) are not written; beta 0
// never reads outRN.
//
// A GroupedGemm also launches the fused MoE kernels (moe_fused.go) and the
// weight gradients' TN product (RunTN, below).

import (
	"fmt"
	"math"
	"runtime"
	"time"
	"unsafe"

	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/kernels"
)

// Kernel constants, as in grouped_gemm.cuh and moe_fused.cu.
const (
	ggBM         = 128     // rows per tile
	ggBK         = 64      // K per pipeline stage
	ggChunks     = 8       // GG_CHUNKS: the fused gathers' row chunks per m-tile
	ggGatherLead = 32      // GG_GATHER_LEAD: how many m-tiles the dgrad kernel's gather may run ahead of its block
	ggFrontDone  = 1 << 30 // GG_FRONT_DONE: a block's pacing front once its TMA thread is done
	ggThreads    = 384     // producer + two consumer warpgroups
	ggMaxExperts = 1024    // GG_MAX_EXPERTS
)

// The NT product's kernels, the index of GroupedGemm.nt.
const (
	ggNT128     = iota // grouped_gemm_nt_bn128_f32
	ggNT256            // grouped_gemm_nt_bn256_f32
	ggNT256S           // grouped_gemm_nt_bn256s_bf16
	ggNTKernels        // how many
)

// ggKernel describes one NT kernel: its name, n tile, pipeline depth, the
// shared memory its TMA-store epilogue stages results in (0: the register
// epilogue), and its output type. A TMA-store kernel also takes the
// output's tensor map.
type ggKernel struct {
	name         string
	bn, stages   int
	stagingBytes int
	outBF16      bool
}

// ggNTKernelList lists the NT kernels, indexed like GroupedGemm.nt:
// float32 outputs take bn128 or bn256 (ggPickBN); bf16 outputs take
// bn256s, whose setmaxnreg and TMA-store epilogue (the whole 128x256 bf16
// tile staged) measured fastest (kernels/grouped_gemm.md).
func ggNTKernelList() [ggNTKernels]ggKernel {
	return [ggNTKernels]ggKernel{
		ggNT128:  {name: "grouped_gemm_nt_bn128_f32", bn: 128, stages: 6},
		ggNT256:  {name: "grouped_gemm_nt_bn256_f32", bn: 256, stages: 4},
		ggNT256S: {name: "grouped_gemm_nt_bn256s_bf16", bn: 256, stages: 3, stagingBytes: 128 * 256 * 2, outBF16: true},
	}
}

// ggSmemBytes is the dynamic shared memory of NT kernel kern for e
// experts: alignment slack, the stage ring, the staging buffer, the
// mbarriers and the schedule (gg_body's layout).
func ggSmemBytes(kern, e int) int {
	k := ggNTKernelList()[kern]
	return 1024 + k.stages*(ggBM*ggBK*2+k.bn*ggBK*2) + k.stagingBytes + 16*k.stages + 4*(3*e+1)
}

// GroupedGemm runs the grouped GEMM on one Device. It is safe for
// concurrent use (it holds no per-call state).
type GroupedGemm struct {
	d   *Device
	enc *driver.TensorMapEncoder
	// nt are the NT product's kernels (ggNT128 ...), opted in to the
	// shared memory of ggMaxExperts.
	nt [ggNTKernels]*Kernel
	// spills256 is set when the compiler spilled bn256's accumulators to
	// local memory (they hold 128 floats a thread under a 168-register
	// cap); float32 outputs then take bn128.
	spills256 bool
	// tn is the weight-gradient kernel (RunTN, grouped_gemm_tn).
	tn *Kernel
	// moe are the fused MoE kernels (moe_fused.go).
	moe moeKernels
	// dgrad chooses between moe_dispatch_dgrad's two builds per shape
	// (dgrad_choice.go).
	dgrad *dgradChooser
	// fusedTimeout, when set, replaces fusedTimeout as the bound of the
	// fused kernels' tile waits (tests of the timeout report).
	fusedTimeout time.Duration
}

// NewGroupedGemm loads the kernels on d. It fails on GPUs other than
// compute capability 9.0 (wgmma and TMA need sm_90a) and on drivers
// without cuTensorMapEncodeTiled.
func NewGroupedGemm(d *Device) (*GroupedGemm, error) {
	info := d.Info()
	if info.Arch != "sm_90a" {
		return nil, fmt.Errorf("cuda: GroupedGemm needs a Hopper GPU (sm_90a), not %s (%s)", info.Arch, info.Name)
	}
	need := max(fusedGatherSmem(ggMaxExperts), ggTNSmemBytes)
	for kern := range ggNTKernels {
		need = max(need, ggSmemBytes(kern, ggMaxExperts))
	}
	if info.MaxSharedOptIn < need {
		return nil, fmt.Errorf("cuda: GroupedGemm needs %d bytes of shared memory per block, %s offers %d", need, info.Name, info.MaxSharedOptIn)
	}
	enc, err := d.TensorMapEncoder()
	if err != nil {
		return nil, fmt.Errorf("cuda: GroupedGemm: %w", err)
	}
	g := &GroupedGemm{d: d, enc: enc, dgrad: newDgradChooser()}
	src, err := kernels.Lookup("grouped_gemm.cu")
	if err != nil {
		return nil, err
	}
	m, err := d.Load(src)
	if err != nil {
		return nil, err
	}
	// Every kernel opts in once to the most any call can ask (E =
	// ggMaxExperts).
	for kern, desc := range ggNTKernelList() {
		if g.nt[kern], err = g.optIn(m, desc.name, ggSmemBytes(kern, ggMaxExperts)); err != nil {
			return nil, err
		}
	}
	g.spills256 = g.nt[ggNT256].LocalBytes > 0
	if g.tn, err = g.optIn(m, "grouped_gemm_tn", ggTNSmemBytes); err != nil {
		return nil, err
	}
	// bn256s and grouped_gemm_tn trade registers with setmaxnreg.
	for _, k := range []*Kernel{g.nt[ggNT256S], g.tn} {
		if err := k.CheckRegisterSplit(ggThreads); err != nil {
			return nil, fmt.Errorf("cuda: GroupedGemm: %w", err)
		}
	}
	moe, err := kernels.Lookup("moe_fused.cu")
	if err != nil {
		return nil, err
	}
	m, err = d.Load(moe)
	if err != nil {
		return nil, err
	}
	if g.moe, err = g.loadMoEKernels(m); err != nil {
		return nil, err
	}
	return g, nil
}

// optIn returns m's kernel name, allowed smem bytes of dynamic shared
// memory (more than the default 48 KiB needs the opt-in).
func (g *GroupedGemm) optIn(m *Module, name string, smem int) (*Kernel, error) {
	k, err := m.Kernel(name)
	if err != nil {
		return nil, err
	}
	if err := g.d.Do(func() error {
		return g.d.drv.FuncSetAttribute(k.fn, driver.FuncMaxDynamicSharedSizeOpt, smem)
	}); err != nil {
		return nil, fmt.Errorf("cuda: GroupedGemm: %s: %w", name, err)
	}
	return k, nil
}

// checkGroupedGemm validates a call's sizes and pointers. The limits come
// from the kernel: TMA needs 16-byte aligned bases and row strides (K a
// multiple of 8), the epilogue stores column pairs and the maps' N rows
// (N a multiple of 8), the schedule fits shared memory (E <= 1024) and
// 32-bit tile indices.
func checkGroupedGemm(outRN, aRK, wENK, offsetsE1 driver.DevicePtr, rows, n, k, experts, bn int) error {
	const op = "cuda: GroupedGemm"
	switch {
	case rows < 0 || rows > math.MaxInt32:
		return fmt.Errorf("%s: rows %d, want 0..%d", op, rows, math.MaxInt32)
	case !ggWidthOK(n):
		return fmt.Errorf("%s: n %d, %s", op, n, ggWidthWant)
	case !ggWidthOK(k):
		return fmt.Errorf("%s: k %d, %s", op, k, ggWidthWant)
	case experts < 1 || experts > ggMaxExperts:
		return fmt.Errorf("%s: experts %d, want 1..%d", op, experts, ggMaxExperts)
	case bn != 0 && bn != 128 && bn != 256:
		return fmt.Errorf("%s: BN %d, want 0 (auto), 128 or 256", op, bn)
	}
	// Most tiles any offsets can make: every expert's partial tile plus the
	// full ones, times the n-tiles (of 128, the smaller tile).
	if tiles := (int64(rows)/ggBM + int64(experts)) * int64((n+127)/128); tiles > math.MaxInt32 {
		return fmt.Errorf("%s: %d tiles overflow the kernel's 32-bit schedule", op, tiles)
	}
	return checkOperandPtrs(op, []string{"outRN", "aRK", "wENK", "offsetsE1"}, outRN, aRK, wENK, offsetsE1)
}

// ggWidthOK says whether a matrix width (elements of a row) suits the
// grouped kernels: TMA's 16-byte row strides and the epilogues' column
// pairs need a multiple of 8; 2^24 keeps tile and element indices in
// range. ggWidthWant says so in an error.
func ggWidthOK(w int) bool { return w >= 8 && w%8 == 0 && w <= 1<<24 }

const ggWidthWant = "want a positive multiple of 8 up to 2^24"

// checkOperandPtrs checks a grouped kernel's pointers, named by names:
// the three matrices 16-byte aligned (TMA and vector stores), the
// offsets last, 4-byte aligned; none null.
func checkOperandPtrs(op string, names []string, out, a, b, offsets driver.DevicePtr) error {
	for i, p := range []driver.DevicePtr{out, a, b, offsets} {
		align := driver.DevicePtr(16)
		if i == 3 {
			align = 4
		}
		if p == 0 {
			return fmt.Errorf("%s: %s is null", op, names[i])
		}
		if p%align != 0 {
			return fmt.Errorf("%s: %s %#x is not %d-byte aligned", op, names[i], uint64(p), align)
		}
	}
	return nil
}

// ggPickBN picks the n tile for n columns: 256 unless it pads more
// columns than 128 would (n = 1408: 6 tiles of 256 waste 128 columns, 11
// of 128 none).
func ggPickBN(n int) int {
	pad := func(bn int) int { return (n+bn-1)/bn*bn - n }
	if pad(256) <= pad(128) {
		return 256
	}
	return 128
}

// ggGrid is the persistent grid: one block per SM, fewer when the most
// tiles the call can have is smaller.
func ggGrid(sms, rows, n, experts, bn int) int {
	maxTiles := ((rows+ggBM-1)/ggBM + experts) * ((n + bn - 1) / bn)
	return max(1, min(sms, maxTiles))
}

// ggTile is one tile of the kernel's schedule.
type ggTile struct {
	Expert, Row0, RowEnd, N0 int
}

// ggSchedule is the Go twin of the kernel's schedule set-up: each expert's
// row range clamped to [0, rows] and the prefix sums of its m-tile counts
// (cum has E+1 entries). The kernel runs tiles 0 .. cum[E]*nTilesN-1.
func ggSchedule(offsets []int32, rows int) (beg, end, cum []int) {
	e := len(offsets) - 1
	beg, end, cum = make([]int, e), make([]int, e), make([]int, e+1)
	for i := range e {
		lo := min(max(int(offsets[i]), 0), rows)
		hi := min(max(int(offsets[i+1]), lo), rows)
		beg[i], end[i] = lo, hi
		cum[i+1] = cum[i] + (hi-lo+ggBM-1)/ggBM
	}
	return beg, end, cum
}

// ggTileOf is the Go twin of gg_tile: tile t is global m-tile t/nTN and
// n-tile t%nTN (m-tile major); its expert is the largest e with cum[e] <=
// m-tile.
func ggTileOf(t, nTN, bn int, beg, end, cum []int) ggTile {
	g, nt := t/nTN, t%nTN
	lo, hi := 0, len(beg)-1
	for lo < hi {
		mid := (lo + hi + 1) >> 1
		if cum[mid] <= g {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	return ggTile{Expert: lo, Row0: beg[lo] + (g-cum[lo])*ggBM, RowEnd: end[lo], N0: nt * bn}
}

// Run queues the grouped GEMM on the device stream: outRN [rows, n] (bf16
// when outBF16, else float32) = alpha * aRK [rows, k] (bf16) times the
// transpose of expert e's wENK [experts, n, k] (bf16) for the rows
// [off[e], off[e+1]) that offsetsE1 (experts+1 int32, device memory) gives,
// plus beta * outRN. Offsets are clamped to [0, rows]; an empty expert
// writes nothing. Sizes and pointers are checked at once (an error names
// the argument); launch and kernel errors come from the next Sync.
func (g *GroupedGemm) Run(outRN, aRK, wENK, offsetsE1 driver.DevicePtr, rows, n, k, experts int, outBF16 bool, alpha, beta float32) error {
	return g.runNT(g.ntKernelFor(n, outBF16), outRN, aRK, wENK, offsetsE1, rows, n, k, experts, alpha, beta)
}

// ntKernelFor is the NT kernel Run takes for n columns: bn256s for bf16
// outputs (beta != 0, and blocks that hold the next expert's rows, take
// its register epilogue inside the kernel), else the n tile that pads n
// less (bn128 when bn256 spilled).
func (g *GroupedGemm) ntKernelFor(n int, outBF16 bool) int {
	switch {
	case outBF16:
		return ggNT256S
	case ggPickBN(n) == 128 || g.spills256:
		return ggNT128
	}
	return ggNT256
}

// runNT is Run on NT kernel kern (ggNT128 ...), whose output type is the
// output's.
func (g *GroupedGemm) runNT(kern int, outRN, aRK, wENK, offsetsE1 driver.DevicePtr, rows, n, k, experts int, alpha, beta float32) error {
	desc := ggNTKernelList()[kern]
	if err := checkGroupedGemm(outRN, aRK, wENK, offsetsE1, rows, n, k, experts, desc.bn); err != nil {
		return err
	}
	if rows == 0 {
		return nil // no rows, no expert owns anything
	}
	grid := Grid1D(ggGrid(g.d.info.SMs, rows, n, experts, desc.bn), ggThreads)
	grid.Shared = ggSmemBytes(kern, experts)
	mapA := driver.TiledMap{
		Type: driver.TensorMapBfloat16, Addr: aRK,
		Dims: []uint64{uint64(k), uint64(rows)}, Strides: []uint64{2 * uint64(k)},
		Box: []uint32{ggBK, ggBM}, Swizzle: driver.Swizzle128B, L2: driver.L2Promotion256B,
	}
	mapW := driver.TiledMap{
		Type: driver.TensorMapBfloat16, Addr: wENK,
		Dims:    []uint64{uint64(k), uint64(n), uint64(experts)},
		Strides: []uint64{2 * uint64(k), 2 * uint64(k) * uint64(n)},
		Box:     []uint32{ggBK, uint32(desc.bn), 1}, Swizzle: driver.Swizzle128B, L2: driver.L2Promotion256B,
	}
	// The TMA-store kernel's output map: {N, rows} bf16 in boxes of 64
	// columns x 64 rows (one consumer warpgroup's block is four of them).
	store := desc.stagingBytes > 0
	maps := []struct {
		name string
		m    driver.TiledMap
	}{{"aRK", mapA}, {"wENK", mapW}}
	if store {
		maps = append(maps, struct {
			name string
			m    driver.TiledMap
		}{"outRN", boxesMap(outRN, rows, n)})
	}
	for _, m := range maps {
		if err := m.m.Check(); err != nil {
			return fmt.Errorf("cuda: GroupedGemm: %s: %w", m.name, err)
		}
	}
	kernel := g.nt[kern]
	slots := []uint64{uint64(outRN), uint64(offsetsE1), uint64(uint32(rows)), uint64(uint32(n)), uint64(uint32(k)),
		uint64(uint32(experts)), uint64(math.Float32bits(alpha)), uint64(math.Float32bits(beta))}
	d := g.d
	tiled := make([]driver.TiledMap, len(maps))
	for i, m := range maps {
		tiled[i] = m.m
	}
	return d.Submit(func() error {
		// Encoding on the device thread keeps Run free of round trips;
		// the maps were checked above, so failures here are the driver's.
		var pin runtime.Pinner
		defer pin.Unpin()
		params, err := mappedParams(g.enc, tiled, slots, &pin, func(i int) string {
			return "cuda: GroupedGemm: " + maps[i].name + " tensor map"
		})
		if err != nil {
			return err
		}
		if err := d.drv.LaunchKernel(kernel.fn, grid.Grid, grid.Block, grid.Shared, d.stream, params); err != nil {
			return fmt.Errorf("%s: %w", kernel.Desc.Name, err)
		}
		return nil
	})
}

// The weight-gradient product (grouped_gemm_tn; its header describes the
// tiling): for every expert e with rows [off[e], off[e+1]),
//
//	outEMN[e] = alpha * aRM[rows of e]ᵀ · bRN[rows of e] + beta * outEMN[e]
//
// with the rows as the product's K, read on the device.
const (
	ggTNStages    = 4                                       // GG_TN_STAGES
	ggTNBN        = 256                                     // n tile
	ggTNSmemBytes = 1024 + ggTNStages*49152 + 16*ggTNStages // slack, the ring, the barriers
)

// ggTNTiles is the kernel's tile count for an [experts, m, n] output:
// every expert's m x n block, whatever its rows.
func ggTNTiles(m, n, experts int) int64 {
	return int64(experts) * int64((m+ggBM-1)/ggBM) * int64((n+ggTNBN-1)/ggTNBN)
}

// ggTNTileOf is the Go twin of gg_tn_tile: tile t's expert, first row of
// m and first column of n; expert-major, then n-tile, m-tile fastest.
func ggTNTileOf(t, m, n int) (expert, m0, n0 int) {
	nTM, nTN := (m+ggBM-1)/ggBM, (n+ggTNBN-1)/ggTNBN
	expert, r := t/(nTM*nTN), t%(nTM*nTN)
	return expert, r % nTM * ggBM, r / nTM * ggTNBN
}

// checkGroupedGemmTN validates RunTN's sizes and pointers: TMA needs
// 16-byte aligned bases and row strides (m and n multiples of 8), the
// kernel counts tiles in 32 bits, and the offsets staging holds at most
// ggMaxExperts+1 of them.
func checkGroupedGemmTN(outEMN, aRM, bRN, offsetsE1 driver.DevicePtr, rows, m, n, experts int) error {
	const op = "cuda: GroupedGemm.RunTN"
	switch {
	case rows < 1 || rows > math.MaxInt32:
		return fmt.Errorf("%s: rows %d, want 1..%d", op, rows, math.MaxInt32)
	case !ggWidthOK(m):
		return fmt.Errorf("%s: m %d, %s", op, m, ggWidthWant)
	case !ggWidthOK(n):
		return fmt.Errorf("%s: n %d, %s", op, n, ggWidthWant)
	case experts < 1 || experts > ggMaxExperts:
		return fmt.Errorf("%s: experts %d, want 1..%d", op, experts, ggMaxExperts)
	}
	if tiles := ggTNTiles(m, n, experts); tiles > math.MaxInt32 {
		return fmt.Errorf("%s: %d tiles overflow the kernel's 32-bit tile index", op, tiles)
	}
	return checkOperandPtrs(op, []string{"outEMN", "aRM", "bRN", "offsetsE1"}, outEMN, aRM, bRN, offsetsE1)
}

// RunTN queues the weight-gradient product on the device stream: for each
// expert e, outEMN[e] ([m, n] float32, of [experts, m, n]) = alpha *
// aRM[r, :]ᵀ · bRN[r, :] summed over the rows r in [off[e], off[e+1])
// (offsetsE1: experts+1 int32 in device memory, clamped to [0, rows]),
// plus beta * outEMN[e]. aRM [rows, m] and bRN [rows, n] are bf16. An
// empty expert's block is scaled by beta. Sizes and pointers are checked
// at once (an error names the argument); launch and kernel errors come
// from the next Sync.
func (g *GroupedGemm) RunTN(outEMN, aRM, bRN, offsetsE1 driver.DevicePtr, rows, m, n, experts int, alpha, beta float32) error {
	if err := checkGroupedGemmTN(outEMN, aRM, bRN, offsetsE1, rows, m, n, experts); err != nil {
		return err
	}
	// Both operands MN-major: boxes of 64 columns x 64 rows (K), the
	// 128-byte swizzle (a box row is 128 bytes).
	mapA := driver.TiledMap{
		Type: driver.TensorMapBfloat16, Addr: aRM,
		Dims: []uint64{uint64(m), uint64(rows)}, Strides: []uint64{2 * uint64(m)},
		Box: []uint32{64, ggBK}, Swizzle: driver.Swizzle128B, L2: driver.L2Promotion256B,
	}
	mapB := driver.TiledMap{
		Type: driver.TensorMapBfloat16, Addr: bRN,
		Dims: []uint64{uint64(n), uint64(rows)}, Strides: []uint64{2 * uint64(n)},
		Box: []uint32{64, ggBK}, Swizzle: driver.Swizzle128B, L2: driver.L2Promotion256B,
	}
	for _, mp := range []struct {
		name string
		m    driver.TiledMap
	}{{"aRM", mapA}, {"bRN", mapB}} {
		if err := mp.m.Check(); err != nil {
			return fmt.Errorf("cuda: GroupedGemm.RunTN: %s: %w", mp.name, err)
		}
	}
	grid := Grid1D(int(min(int64(g.d.info.SMs), ggTNTiles(m, n, experts))), ggThreads)
	grid.Shared = ggTNSmemBytes
	slots := []uint64{uint64(outEMN), uint64(offsetsE1), uint64(uint32(rows)), uint64(uint32(m)), uint64(uint32(n)),
		uint64(uint32(experts)), uint64(math.Float32bits(alpha)), uint64(math.Float32bits(beta))}
	d := g.d
	return d.Submit(func() error {
		var ta, tb driver.TensorMap
		if err := g.enc.EncodeTiled(&ta, mapA); err != nil {
			return fmt.Errorf("cuda: GroupedGemm.RunTN: aRM tensor map: %w", err)
		}
		if err := g.enc.EncodeTiled(&tb, mapB); err != nil {
			return fmt.Errorf("cuda: GroupedGemm.RunTN: bRN tensor map: %w", err)
		}
		var pin runtime.Pinner
		defer pin.Unpin()
		pin.Pin(&ta)
		pin.Pin(&tb)
		pin.Pin(&slots[0])
		params := []unsafe.Pointer{unsafe.Pointer(&ta), unsafe.Pointer(&tb)}
		for i := range slots {
			params = append(params, unsafe.Pointer(&slots[i]))
		}
		pin.Pin(&params[0])
		if err := d.drv.LaunchKernel(g.tn.fn, grid.Grid, grid.Block, grid.Shared, d.stream, params); err != nil {
			return fmt.Errorf("%s: %w", g.tn.Desc.Name, err)
		}
		return nil
	})
}
