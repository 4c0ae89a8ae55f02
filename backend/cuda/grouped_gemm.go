package cuda

// Grouped GEMM for MoE experts: the launch side of kernels/grouped_gemm.cu
// (wgmma + TMA + mbarrier pipeline, sm_90a only; its header describes the
// tiling). For each expert e with rows [off[e], off[e+1]) of A:
//
//	outRN[r, :] = alpha * aRK[r, :] . wENK[e]^T + beta * outRN[r, :]
//
// aRK [rows, K] and wENK [E, N, K] are bf16 row-major, outRN [rows, N] is
// float32 or bf16, accumulation is float32. The offsets (E+1 int32 prefix
// sums) stay in device memory: the kernel reads them and builds its own
// tile schedule, so a caller never synchronizes to learn the counts. Rows
// no expert owns (before off[0], from off[E] on) are not written; beta 0
// never reads outRN.

import (
	"fmt"
	"math"
	"runtime"
	"time"
	"unsafe"

	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/kernels"
)

// Kernel constants, as in grouped_gemm.cu.
const (
	ggBM         = 128     // rows per tile
	ggBK         = 64      // K per pipeline stage
	ggChunks     = 8       // GG_CHUNKS: the fused gathers' row chunks per m-tile
	ggGatherLead = 32      // GG_GATHER_LEAD: how many m-tiles the dgrad kernel's gather may run ahead of its block
	ggFrontDone  = 1 << 30 // GG_FRONT_DONE: a block's pacing front once its TMA thread is done
	ggThreads    = 384     // producer + two consumer warpgroups
	ggMaxExperts = 1024    // GG_MAX_EXPERTS
)

// ggStages is the pipeline depth of a variant's kernel.
func ggStages(variant int) int {
	switch variant {
	case ggCoop256S:
		return 3
	case ggCoop256, ggCoop256R, ggCoop256H:
		return 4
	}
	return 6
}

// ggStagingBytes is the shared memory a variant's TMA-store epilogue
// stages results in: the whole 128x256 bf16 tile, half of it, or none.
func ggStagingBytes(variant int) int {
	switch variant {
	case ggCoop256S:
		return 128 * 256 * 2
	case ggCoop256H:
		return 128 * 256
	}
	return 0
}

// ggSmemBytes is the dynamic shared memory of a variant's kernel for e
// experts: alignment slack, the stage ring, the staging buffer, the
// mbarriers and the schedule.
func ggSmemBytes(variant, e int) int {
	st, bn := ggStages(variant), ggKernels()[variant].bn
	return 1024 + st*(ggBM*ggBK*2+bn*ggBK*2) + ggStagingBytes(variant) + 16*st + 16 + 4*(3*e+1)
}

// GroupedGemm runs the grouped GEMM on one Device. It is safe for
// concurrent use (it holds no per-call state).
type GroupedGemm struct {
	d   *Device
	enc *driver.TensorMapEncoder
	// kern[variant][bf16], variant ggCoop128 .. ggCoop256H; nil where a
	// variant has no such kernel (the TMA-store ones are bf16 only).
	kern [ggVariantCount][2]*Kernel
	// dispatchSwiGLU and downCombine are the MoE fused kernels
	// (moe_fused.go), bn256 cooperative like ggCoop256;
	// dispatchSwiGLUBF16 is dispatchSwiGLU for bf16 sources.
	dispatchSwiGLU, dispatchSwiGLUBF16, downCombine *Kernel
	// dispatchDgrad and dgradCombine are their backward twins, which read
	// the weights as stored (MN-major); dispatchDgradFirst is
	// dispatchDgrad's build that gathers first, chosen per shape by dgrad
	// (dgrad_choice.go).
	dispatchDgrad, dispatchDgradFirst, dgradCombine *Kernel
	dgrad                                           *dgradChooser
	// tn is the weight-gradient kernel (RunTN, grouped_gemm_tn).
	tn *Kernel
	// optInGather is the gathering kernels' opted-in shared memory (one
	// layout, fusedGatherSmem).
	optInGather int
	// fusedMode holds the fused kernels' experiment switches and test
	// hooks (tests only; 0 in use); fusedTimeout, when set, replaces
	// fusedTimeout (tests of the timeout report).
	fusedMode    int
	fusedTimeout time.Duration
	// fusedLocal, fusedBF16Local, downLocal, dgradLocal, dgradFirstLocal and
	// dgradCombineLocal are the fused kernels' local memory (spilled
	// registers) per thread, read at load time.
	fusedLocal, fusedBF16Local, downLocal, dgradLocal, dgradFirstLocal, dgradCombineLocal int
	// optIn is the dynamic shared memory each variant's kernels opted in
	// to: ggSmemBytes at ggMaxExperts, capped by the device's limit
	// (ggCoop256H needs more than that limit past 163 experts).
	optIn [ggVariantCount]int
	// spills256 is set when the compiler spilled the BN 256 kernels'
	// accumulators to local memory (they hold 128 floats a thread under
	// a 168-register cap); auto then takes BN 128.
	spills256 bool
	// BN forces the n tile, 128 or 256; 0 picks per N (ggPickBN).
	BN int
	// PingPong runs the ping-pong kernel pp128r (n tile 128: each
	// consumer warpgroup owns whole tiles and takes turns on the tensor
	// cores, so one's epilogue hides under the other's mainloop; always
	// with setmaxnreg) instead of the cooperative ones; BN must be 0 or
	// 128.
	PingPong bool
	// Regs runs the cooperative BN 256 tile as bn256r, with setmaxnreg
	// (producer 40 registers a thread, consumers 232). BN 128 cooperative
	// has no such kernel (it needs no more registers) and ignores Regs.
	Regs bool
	// Store picks the TMA-store epilogue of the cooperative BN 256 kernel
	// (bn256r's mainloop; BN must be 0 or 256, PingPong off): full result
	// blocks go through shared memory and TMA stores that overlap the next
	// tile's mainloop. 1 is bn256s (3 stages, the whole tile staged), 2 is
	// bn256h (4 stages, half a tile staged; more than 163 experts fall
	// back to bn256s, whose shared memory fits). 0 is the register
	// epilogue. float32 outputs always take the register epilogue (bn256r);
	// beta != 0 and blocks that hold the next expert's rows take it inside
	// the kernel.
	Store int
	// GroupM is the raster group, in m-tiles, of the tile order of every
	// kernel this GroupedGemm launches, the fused ones included: the
	// tiles of GroupM m-tiles run n-tile major, so the tiles in flight
	// share their A and W tiles in L2 (see gg_tile in the kernel). 0 is
	// ggDefaultGroupM; 1 is plain m-tile major order (version 1).
	GroupM int
}

// ggDefaultGroupM is GroupM's default: version 1's m-tile major order
// until a GPU run shows the grouped order's gain (kernels/grouped_gemm.md).
const ggDefaultGroupM = 1

// rasterGroup is GroupM checked, its default resolved: the kernels'
// argument GM.
func (g *GroupedGemm) rasterGroup() (int, error) {
	switch {
	case g.GroupM < 0 || g.GroupM > ggMaxGroupM:
		return 0, fmt.Errorf("cuda: GroupedGemm: GroupM %d, want 0 (default) or 1..%d", g.GroupM, ggMaxGroupM)
	case g.GroupM == 0:
		return ggDefaultGroupM, nil
	}
	return g.GroupM, nil
}

// ggMaxGroupM bounds GroupM (the kernel multiplies it by the n-tile count
// in 32 bits).
const ggMaxGroupM = 256

// Kernel variants, the first index of GroupedGemm.kern.
const (
	ggCoop128 = iota
	ggCoop256
	ggCoop256R     // ggCoop256 with setmaxnreg
	ggPingPong128R // ping-pong, n tile 128, with setmaxnreg
	ggCoop256S     // ggCoop256R with the TMA-store epilogue, whole tile staged
	ggCoop256H     // ggCoop256R with the TMA-store epilogue, half tile staged
	ggVariantCount
)

// ggKernel is a variant's kernel name stem, n tile, and whether it has a
// float32-out kernel and takes the output's tensor map.
type ggKernel struct {
	name     string
	bn       int
	bf16Only bool // TMA-store epilogue: bf16 out only, a third tensor map
}

// ggKernels lists the variants' kernels, indexed like GroupedGemm.kern.
func ggKernels() [ggVariantCount]ggKernel {
	return [ggVariantCount]ggKernel{{"bn128", 128, false}, {"bn256", 256, false}, {"bn256r", 256, false},
		{"pp128r", 128, false}, {"bn256s", 256, true}, {"bn256h", 256, true}}
}

// NewGroupedGemm loads the kernels on d. It fails on GPUs other than
// compute capability 9.0 (wgmma and TMA need sm_90a) and on drivers
// without cuTensorMapEncodeTiled.
func NewGroupedGemm(d *Device) (*GroupedGemm, error) {
	info := d.Info()
	if info.Arch != "sm_90a" {
		return nil, fmt.Errorf("cuda: GroupedGemm needs a Hopper GPU (sm_90a), not %s (%s)", info.Arch, info.Name)
	}
	need := 0
	for v := range ggVariantCount {
		if v != ggCoop256H { // it falls back to ggCoop256S past 163 experts
			need = max(need, ggSmemBytes(v, ggMaxExperts))
		}
	}
	if info.MaxSharedOptIn < need {
		return nil, fmt.Errorf("cuda: GroupedGemm needs %d bytes of shared memory per block, %s offers %d", need, info.Name, info.MaxSharedOptIn)
	}
	enc, err := d.drv.TensorMapEncoder()
	if err != nil {
		return nil, fmt.Errorf("cuda: GroupedGemm: %w", err)
	}
	src, err := kernels.Lookup("grouped_gemm.cu")
	if err != nil {
		return nil, err
	}
	m, err := d.Load(src)
	if err != nil {
		return nil, err
	}
	g := &GroupedGemm{d: d, enc: enc, dgrad: newDgradChooser()}
	for i, v := range ggKernels() {
		// Opt in once to the most any call can ask (E = ggMaxExperts).
		g.optIn[i] = min(ggSmemBytes(i, ggMaxExperts), info.MaxSharedOptIn)
		for j, ty := range []string{"f32", "bf16"} {
			if j == 0 && v.bf16Only {
				continue
			}
			k, err := m.Kernel(fmt.Sprintf("grouped_gemm_nt_%s_%s", v.name, ty))
			if err != nil {
				return nil, err
			}
			smem := g.optIn[i]
			var local int
			err = d.Do(func() error {
				if err := d.drv.FuncSetAttribute(k.fn, driver.FuncMaxDynamicSharedSizeOpt, smem); err != nil {
					return err
				}
				var err error
				local, err = d.drv.FuncAttribute(k.fn, driver.FuncLocalSizeBytes)
				return err
			})
			if err != nil {
				return nil, fmt.Errorf("cuda: GroupedGemm: %s: %w", k.Desc.Name, err)
			}
			g.spills256 = g.spills256 || (i == ggCoop256 && local > 0)
			g.kern[i][j] = k
		}
	}
	for _, f := range []struct {
		name string
		k    **Kernel
	}{{"moe_dispatch_swiglu", &g.dispatchSwiGLU}, {"moe_dispatch_swiglu_bf16", &g.dispatchSwiGLUBF16},
		{"moe_down_combine", &g.downCombine},
		{"moe_dispatch_dgrad", &g.dispatchDgrad}, {"moe_dispatch_dgrad_first", &g.dispatchDgradFirst},
		{"moe_dgrad_combine", &g.dgradCombine}} {
		k, err := m.Kernel(f.name)
		if err != nil {
			return nil, err
		}
		smem := g.optIn[ggCoop256]
		if f.k == &g.dispatchSwiGLU || f.k == &g.dispatchSwiGLUBF16 || f.k == &g.dispatchDgrad || f.k == &g.dispatchDgradFirst {
			smem = min(fusedGatherSmem(ggMaxExperts), info.MaxSharedOptIn)
			g.optInGather = smem
		}
		var local int
		err = d.Do(func() error {
			if err := d.drv.FuncSetAttribute(k.fn, driver.FuncMaxDynamicSharedSizeOpt, smem); err != nil {
				return err
			}
			var err error
			local, err = d.drv.FuncAttribute(k.fn, driver.FuncLocalSizeBytes)
			return err
		})
		if err != nil {
			return nil, fmt.Errorf("cuda: GroupedGemm: %s: %w", f.name, err)
		}
		switch f.k {
		case &g.dispatchSwiGLU:
			g.fusedLocal = local
		case &g.dispatchSwiGLUBF16:
			g.fusedBF16Local = local
		case &g.downCombine:
			g.downLocal = local
		case &g.dispatchDgrad:
			g.dgradLocal = local
		case &g.dispatchDgradFirst:
			g.dgradFirstLocal = local
		case &g.dgradCombine:
			g.dgradCombineLocal = local
		}
		*f.k = k
	}
	if g.tn, err = m.Kernel("grouped_gemm_tn"); err != nil {
		return nil, err
	}
	if err := d.Do(func() error {
		return d.drv.FuncSetAttribute(g.tn.fn, driver.FuncMaxDynamicSharedSizeOpt, ggTNSmemBytes)
	}); err != nil {
		return nil, fmt.Errorf("cuda: GroupedGemm: grouped_gemm_tn: %w", err)
	}
	return g, nil
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

// ggTileOf is the Go twin of gg_tile: the cum[E] m-tiles are cut into
// raster groups of gm (the last may be short); tile t is in group
// t/(gm*nTN), where it is m-tile rem%gs and n-tile rem/gs of the group's
// gs m-tiles; its expert is the largest e with cum[e] <= m-tile.
func ggTileOf(t, nTN, gm, bn int, beg, end, cum []int) ggTile {
	span := gm * nTN
	grp := t / span
	gbase := grp * gm
	gs := min(gm, cum[len(cum)-1]-gbase)
	rem := t - grp*span
	nt := rem / gs
	g := gbase + rem - nt*gs
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
	if err := checkGroupedGemm(outRN, aRK, wENK, offsetsE1, rows, n, k, experts, g.BN); err != nil {
		return err
	}
	if g.PingPong && g.BN == 256 {
		return fmt.Errorf("cuda: GroupedGemm: PingPong takes BN 0 or 128, not 256")
	}
	switch {
	case g.Store < 0 || g.Store > 2:
		return fmt.Errorf("cuda: GroupedGemm: Store %d, want 0 (register epilogue), 1 (bn256s) or 2 (bn256h)", g.Store)
	case g.Store != 0 && (g.PingPong || g.BN == 128):
		return fmt.Errorf("cuda: GroupedGemm: Store %d needs the cooperative BN 256 kernel (BN 0 or 256, PingPong off)", g.Store)
	}
	gm, err := g.rasterGroup()
	if err != nil {
		return err
	}
	if rows == 0 {
		return nil // no rows, no expert owns anything
	}
	bn := g.BN
	switch {
	case g.Store != 0:
		bn = 256
	case bn == 0:
		bn = ggPickBN(n)
		if g.spills256 {
			bn = 128
		}
	}
	variant := ggPickVariant(bn, g.PingPong, g.Regs, g.Store, outBF16)
	if variant == ggCoop256H && ggSmemBytes(ggCoop256H, experts) > g.optIn[ggCoop256H] {
		variant = ggCoop256S // too many experts for half a tile of staging beside 4 stages
	}
	bn = ggKernels()[variant].bn
	kern := g.kern[variant][b2i(outBF16)]
	grid := Grid1D(ggGrid(g.d.info.SMs, rows, n, experts, bn), ggThreads)
	grid.Shared = ggSmemBytes(variant, experts)
	mapA := driver.TiledMap{
		Type: driver.TensorMapBfloat16, Addr: aRK,
		Dims: []uint64{uint64(k), uint64(rows)}, Strides: []uint64{2 * uint64(k)},
		Box: []uint32{ggBK, ggBM}, Swizzle: driver.Swizzle128B, L2: driver.L2Promotion256B,
	}
	mapW := driver.TiledMap{
		Type: driver.TensorMapBfloat16, Addr: wENK,
		Dims:    []uint64{uint64(k), uint64(n), uint64(experts)},
		Strides: []uint64{2 * uint64(k), 2 * uint64(k) * uint64(n)},
		Box:     []uint32{ggBK, uint32(bn), 1}, Swizzle: driver.Swizzle128B, L2: driver.L2Promotion256B,
	}
	// The TMA-store kernels' output map: {N, rows} bf16 in boxes of 64
	// columns x 64 rows (one consumer warpgroup's block is four of them).
	store := ggKernels()[variant].bf16Only
	mapO := driver.TiledMap{
		Type: driver.TensorMapBfloat16, Addr: outRN,
		Dims: []uint64{uint64(n), uint64(rows)}, Strides: []uint64{2 * uint64(n)},
		Box: []uint32{64, 64}, Swizzle: driver.Swizzle128B, L2: driver.L2PromotionNone,
	}
	maps := []struct {
		name string
		m    driver.TiledMap
	}{{"aRK", mapA}, {"wENK", mapW}}
	if store {
		maps = append(maps, struct {
			name string
			m    driver.TiledMap
		}{"outRN", mapO})
	}
	for _, m := range maps {
		if err := m.m.Check(); err != nil {
			return fmt.Errorf("cuda: GroupedGemm: %s: %w", m.name, err)
		}
	}
	slots := []uint64{uint64(outRN), uint64(offsetsE1), uint64(uint32(rows)), uint64(uint32(n)), uint64(uint32(k)),
		uint64(uint32(experts)), uint64(uint32(gm)), uint64(math.Float32bits(alpha)), uint64(math.Float32bits(beta))}
	d := g.d
	return d.Submit(func() error {
		// Encoding on the device thread keeps Run free of round trips;
		// the maps were checked above, so failures here are the driver's.
		var ta, tw, to driver.TensorMap
		if err := g.enc.EncodeTiled(&ta, mapA); err != nil {
			return fmt.Errorf("cuda: GroupedGemm: aRK tensor map: %w", err)
		}
		if err := g.enc.EncodeTiled(&tw, mapW); err != nil {
			return fmt.Errorf("cuda: GroupedGemm: wENK tensor map: %w", err)
		}
		var pin runtime.Pinner
		defer pin.Unpin()
		params := make([]unsafe.Pointer, 0, 3+len(slots))
		pin.Pin(&ta)
		pin.Pin(&tw)
		pin.Pin(&slots[0])
		params = append(params, unsafe.Pointer(&ta), unsafe.Pointer(&tw))
		if store {
			if err := g.enc.EncodeTiled(&to, mapO); err != nil {
				return fmt.Errorf("cuda: GroupedGemm: outRN tensor map: %w", err)
			}
			pin.Pin(&to)
			params = append(params, unsafe.Pointer(&to))
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

// ggPickVariant maps the knobs (bn already resolved to 128 or 256) to a
// kernel variant: PingPong wins, then Store for BN 256 with bf16 out
// (float32 out has no TMA-store kernel and runs bn256r), then Regs.
func ggPickVariant(bn int, pingPong, regs bool, store int, outBF16 bool) int {
	switch {
	case pingPong:
		return ggPingPong128R
	case bn != 256:
		return ggCoop128
	case store == 1 && outBF16:
		return ggCoop256S
	case store == 2 && outBF16:
		return ggCoop256H
	case store != 0 || regs:
		return ggCoop256R
	}
	return ggCoop256
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
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
