package cuda

// Tensor parallelism's fused products (kernels/moe_fused.cu, tp_*):
//   - AllGatherMatMul runs tp_gather_nt or tp_gather_nn: three warps a
//     block gather the ranks' row blocks (float32, read in place from each
//     rank's tensor: a virtual rank's buffer, or a peer GPU's over NVLink),
//     round them to bf16 into a scratch operand and keep them as float32
//     in full, publishing each 16-row chunk of an m-tile; the TMA thread
//     waits for an m-tile's chunks (bounded: a lost peer is reported at
//     the next Sync, naming the m-tile and the rank) and the consumers
//     multiply it while later tiles are still being copied. The walk
//     starts at the caller's own block. Outputs after the first are
//     products of the gathered bf16 rows (cuBLASLt).
//   - MatMulScatter runs tp_scatter_nt or tp_scatter_nn: the product's
//     epilogue sends each row to its owner's tensor (stored, added, or
//     added atomically, backend.ScatterLanding), the walk starting at the
//     next rank's block so the ranks write to different owners at once.
//
// All four kernels run on clusters of two blocks (cuLaunchKernelEx): a
// cluster's blocks take two m-tiles of one n-tile and each loads half of
// their common weight tile, multicast into both (kernels/grouped_gemm.md).
//
// Float32 operands are rounded to bf16 first into the backend's scratch
// (as MatMul rounds its operands), so the fused ops multiply exactly what
// the unfused products multiply. Calls the kernels do not take (not
// Hopper, a driver before CUDA 12.0, which cannot launch clusters, widths
// not multiples of 8, misaligned tensors) run the unfused
// sequence (backend.AllGatherMatMulBySteps, MatMulScatterBySteps); on one
// stream its adds are ordered by the queue.

import (
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// tpScratch holds the fused tensor-parallel ops' bf16 operands, grown to
// the largest call: rows (the gathered x, or a rounded a) and weights.
// Calls are queued on one stream, so a call's kernel has read them before
// the next call's conversions overwrite them.
type tpScratch struct {
	mu         sync.Mutex
	rows, wght *Tensor
	// maps holds tp_scatter's per-owner tensor maps (fusedMaxRanks of
	// 128 bytes), written in stream order before each launch.
	maps *Buffer
}

// tpScratchView returns a bf16 [r, c] view of *buf, grown when smaller.
func (b *Backend) tpScratchView(buf **Tensor, r, c int) *Tensor {
	if *buf == nil || (*buf).Len() < r*c {
		*buf = b.New(backend.BFloat16, r*c).(*Tensor)
	}
	return b.View(*buf, 0, r, c).(*Tensor)
}

// tpBF16 returns t itself when it is bf16, else its rounding into *buf.
func (b *Backend) tpBF16(buf **Tensor, t *Tensor) *Tensor {
	if t.dt == backend.BFloat16 {
		return t
	}
	v := b.tpScratchView(buf, t.shape[0], t.shape[1])
	b.Copy(v, t)
	return v
}

// tpSmem is the tensor-parallel kernels' dynamic shared memory: alignment
// slack, 3 stages of the BN 256 tile, two 32 KiB staging buffers (the
// float32 TMA-store epilogue), the stage barriers and the schedule of one
// group with the gather's pacing front (gg_body's layout).
func tpSmem() int {
	const stages = 3
	return 1024 + stages*(ggBM*ggBK*2+256*ggBK*2) + 2*32768 + 16*stages + 4*(3*1+2)
}

// f32BoxesMap is the {n, rows} float32 map of a [rows, n] output that
// gg_epilogue_tma_f32 stores: boxes of 32 columns x 64 rows, 128-byte
// swizzle.
func f32BoxesMap(addr driver.DevicePtr, rows, n int) driver.TiledMap {
	return driver.TiledMap{
		Type: driver.TensorMapFloat32, Addr: addr,
		Dims: []uint64{uint64(n), uint64(rows)}, Strides: []uint64{4 * uint64(n)},
		Box: []uint32{32, 64}, Swizzle: driver.Swizzle128B, L2: driver.L2PromotionNone,
	}
}

// tpRotM is the m-tile a walk over rows split into blocks of blockRows
// starts at to begin with block first: 0 when blocks do not start on
// m-tile boundaries.
func tpRotM(first, blockRows int) int {
	if blockRows%ggBM != 0 {
		return 0
	}
	return first * blockRows / ggBM
}

// tpGroupM is how many m-tiles the tensor-parallel kernels walk as one
// group, n-tile by n-tile, for products of nTN n-tiles (gg_tp_tile): 16,
// which reads a weight larger than L2 once per 16 m-tiles, but for a
// gathering kernel of fewer than 24 n-tiles, whose m-tiles go by faster
// than its gather fills a group of them: 1, the m-tile-major walk. At the
// Llama-70B-like layer (kernels/grouped_gemm.md) the gather was 0.94x,
// 1.09x and 1.31x the product alone grouped at tp 2, 4 and 8 (56, 28 and
// 14 n-tiles), 1.16x, 1.16x and 1.10x m-tile major.
func tpGroupM(nTN int, gather bool) int {
	if gather && nTN < 24 {
		return 1
	}
	return 16
}

// tpTile is one tile of the tensor-parallel kernels' walk on clusters of
// two blocks: its m-tile (-1 for the missing second m-tile of the last
// pair when the m-tile count is odd), first column and the walk's m-tile
// before the rotation (the gather's pacing front).
type tpTile struct {
	G, N0, WalkG int
}

// tpTileOf is the Go twin of gg_tp_tile on clusters of two: walk position
// t of a product of m m-tiles and nTN n-tiles of 256 columns, in groups of
// groupM m-tiles (pairs of them, groupM/2 a group), n-tile by n-tile,
// rotated by rotM, for the block of cluster rank rank.
func tpTileOf(t, nTN, m, groupM, rotM, rank int) tpTile {
	units, gu := (m+1)/2, max(1, groupM/2)
	group := t / (gu * nTN)
	first := group * gu
	size, in := min(gu, units-first), t-first*nTN
	nt := in / size
	walkG := (first+in-nt*size)*2 + rank
	g := -1
	if walkG < m {
		g = walkG + rotM
		if g >= m {
			g -= m
		}
	}
	return tpTile{G: g, N0: nt * 256, WalkG: walkG}
}

// tpKernels returns the grouped GEMM that launches the tensor-parallel
// kernels, or false when they do not take a call of rows rows whose
// peers' tensors are at ptrs (0: none): not Hopper, a driver that cannot
// launch clusters, no rows, or a tensor not 16-byte aligned (the
// gather's vector loads, TMA).
func (b *Backend) tpKernels(rows int, ptrs []driver.DevicePtr) (*GroupedGemm, bool) {
	for _, p := range ptrs {
		if p%16 != 0 {
			return nil, false
		}
	}
	x, ok := b.expertKernels()
	if !ok || rows == 0 || x.bf16Out.moe.tpClusters == 0 {
		return nil, false
	}
	return x.bf16Out, true
}

// AllGatherMatMul runs tp_gather when the call is one it takes (float32
// shards and full, a Hopper GPU), else the unfused sequence.
func (b *Backend) AllGatherMatMul(fullRK backend.Tensor, outs, shardsBK, ws []backend.Tensor, transW bool, rank int) {
	const op = "AllGatherMatMul"
	if err := backend.CheckAllGatherMatMul(fullRK, outs, shardsBK, ws, transW, rank); err != nil {
		fail(op, "%v", err)
	}
	if b.allGatherMatMulKernel(fullRK, outs, shardsBK, ws, transW, rank) {
		return
	}
	backend.AllGatherMatMulBySteps(b, fullRK, outs, shardsBK, ws, transW)
}

func (b *Backend) allGatherMatMulKernel(fullRK backend.Tensor, outs, shardsBK, ws []backend.Tensor, transW bool, rank int) bool {
	if len(outs) == 0 || len(shardsBK) > fusedMaxRanks {
		return false
	}
	ranks, ok := peerPtrs(shardsBK, backend.Float32)
	if !ok {
		return false
	}
	ends, ok := peerPtrs([]backend.Tensor{outs[0]}, backend.Float32)
	if !ok {
		return false
	}
	full := driver.DevicePtr(0) // not kept
	if fullRK != nil {
		fp, ok := peerPtrs([]backend.Tensor{fullRK}, backend.Float32)
		if !ok {
			return false
		}
		full = fp[0]
	}
	ends = append(ends, full)
	w0, ok := ws[0].(*Tensor)
	if !ok || (w0.dt != backend.Float32 && w0.dt != backend.BFloat16) {
		return false
	}
	ss, os := shardsBK[0].Shape(), outs[0].Shape()
	blockRows, k, n := ss[0], ss[1], os[1]
	rows := len(shardsBK) * blockRows
	gg, ok := b.tpKernels(rows, append(ranks, ends...))
	if !ok {
		return false
	}
	s := &b.tp
	s.mu.Lock()
	defer s.mu.Unlock()
	xbf := b.tpScratchView(&s.rows, rows, k)
	wbf := b.tpBF16(&s.wght, w0)
	ps, ok := devicePtrs(xbf, wbf)
	if !ok {
		return false
	}
	f := &b.fused
	f.mu.Lock()
	// The offsets are staged below (any aligned address passes the check).
	if err := checkGroupedGemm(ends[0], ps[0], ps[1], 16, rows, n, k, 1, 256); err != nil {
		f.mu.Unlock()
		return false
	}
	err := f.stage(b.dev, ranks, nil, nil, nil, backend.Groups{Rows: []int{rows}})
	var flags, fault driver.DevicePtr
	if err == nil {
		flags, fault, err = f.armWaits(b.dev, rows/ggBM+1, gg.waitTimeout())
	}
	if err == nil {
		tp := f.tables.Ptr()
		err = gg.runTPGather(tpGather{
			out: ends[0], x: ps[0], full: full, w: ps[1], ptrs: tp + fusedPtrsOff, offsets: tp + fusedOffsOff,
			flags: flags, fault: fault, rows: rows, n: n, k: k, blockRows: blockRows,
			rotM: tpRotM(rank, blockRows), mn: !transW,
		})
	}
	f.mu.Unlock()
	b.fail(err)
	for i := 1; i < len(outs); i++ {
		b.MatMul(outs[i], xbf, ws[i], false, transW, 1, 0)
	}
	runtime.KeepAlive(fullRK)
	runtime.KeepAlive(outs)
	runtime.KeepAlive(shardsBK)
	runtime.KeepAlive(ws)
	return true
}

// MatMulScatter runs tp_scatter when the call is one it takes (float32
// destinations, a Hopper GPU), else the unfused sequence.
func (b *Backend) MatMulScatter(dstsS []backend.Tensor, row0 int, a, w backend.Tensor, transW bool, landing backend.ScatterLanding, rank int) {
	const op = "MatMulScatter"
	if err := backend.CheckMatMulScatter(dstsS, row0, a, w, transW, landing, rank); err != nil {
		fail(op, "%v", err)
	}
	if b.matMulScatterKernel(dstsS, row0, a, w, transW, landing, rank) {
		return
	}
	cols := dstsS[0].Shape()[1]
	backend.MatMulScatterBySteps(b, b.New(b.FloatType(), a.Shape()[0], cols), dstsS, row0, a, w, transW, landing)
}

func (b *Backend) matMulScatterKernel(dstsS []backend.Tensor, row0 int, a, w backend.Tensor, transW bool, landing backend.ScatterLanding, rank int) bool {
	if len(dstsS) > fusedMaxRanks {
		return false
	}
	owners, ok := peerPtrs(dstsS, backend.Float32)
	if !ok {
		return false
	}
	at, ok1 := a.(*Tensor)
	wt, ok2 := w.(*Tensor)
	if !ok1 || !ok2 {
		return false
	}
	for _, t := range []*Tensor{at, wt} {
		if t.dt != backend.Float32 && t.dt != backend.BFloat16 {
			return false
		}
	}
	rows, k, n := at.shape[0], at.shape[1], dstsS[0].Shape()[1]
	gg, ok := b.tpKernels(rows, owners)
	if !ok {
		return false
	}
	s := &b.tp
	s.mu.Lock()
	defer s.mu.Unlock()
	abf := b.tpBF16(&s.rows, at)
	wbf := b.tpBF16(&s.wght, wt)
	ps, ok := devicePtrs(abf, wbf)
	if !ok {
		return false
	}
	f := &b.fused
	f.mu.Lock()
	if err := checkGroupedGemm(owners[0], ps[0], ps[1], 16, rows, n, k, 1, 256); err != nil {
		f.mu.Unlock()
		return false
	}
	blockRows := rows / len(dstsS)
	err := f.stage(b.dev, owners, nil, nil, nil, backend.Groups{Rows: []int{rows}})
	// Blocks of whole 64-row halves of m-tiles leave by TMA through the
	// owners' maps; others by the register epilogue.
	var maps []driver.TiledMap
	if blockRows%64 == 0 && err == nil {
		if s.maps == nil {
			s.maps, err = b.dev.Alloc(128 * fusedMaxRanks)
		}
		for i, d := range dstsS {
			maps = append(maps, f32BoxesMap(owners[i], d.Shape()[0], n))
		}
	}
	if err == nil {
		tp := f.tables.Ptr()
		a := tpScatter{
			a: ps[0], w: ps[1], ptrs: tp + fusedPtrsOff, offsets: tp + fusedOffsOff, rows: rows, n: n, k: k,
			blockRows: blockRows, slotRow0: row0, rotM: tpRotM((rank+1)%len(dstsS), blockRows),
			landing: landing, mn: !transW, ownerMaps: maps,
		}
		if maps != nil {
			a.mapsAt = s.maps
		}
		err = gg.runTPScatter(a)
	}
	f.mu.Unlock()
	b.fail(err)
	runtime.KeepAlive(dstsS)
	runtime.KeepAlive(a)
	runtime.KeepAlive(w)
	return true
}

// tpGather is one tp_gather call: out [rows, n] = x.op(W), x gathered from
// ptrs' blocks into the bf16 x and float32 full; w is [n, k] (nt) or
// [k, n] (mn: tp_gather_nn).
type tpGather struct {
	out, x, full, w, ptrs, offsets, flags, fault driver.DevicePtr
	rows, n, k, blockRows, rotM                  int
	mn                                           bool
}

// tpScatter is one tp_scatter call: p = a.op(W) [rows, n], row r landing
// in ptrs[r / blockRows] at row slotRow0 + r % blockRows.
type tpScatter struct {
	a, w, ptrs, offsets                   driver.DevicePtr
	rows, n, k, blockRows, slotRow0, rotM int
	landing                               backend.ScatterLanding
	mn                                    bool
	// ownerMaps are the owners' float32 maps, encoded and written to
	// mapsAt on the device thread just before the launch; nil: the
	// register epilogue.
	ownerMaps []driver.TiledMap
	mapsAt    *Buffer
}

// tpWeightMap is the bf16 map of a weight the tensor-parallel kernels
// read: [n, k] K-major in boxes of 128 rows (each block of a cluster
// loads half the 256-row tile), or [k, n] as stored (mn: boxes of 64 x
// 64, two of the four a block's).
func tpWeightMap(w driver.DevicePtr, n, k int, mn bool) driver.TiledMap {
	if mn {
		return expertsMNMap(w, 1, n, k)
	}
	return expertsMap(w, 1, n, k, 128)
}

// tpGrid is the grid of a tensor-parallel call of rows x n outputs:
// clusters of two blocks, one cluster a pair of m-tiles of an n-tile, at
// most as many as the GPU holds at once, so the gathering kernels' blocks
// are all resident, as their waits need.
func (g *GroupedGemm) tpGrid(rows, n int) Grid {
	pairs := (rows + 2*ggBM - 1) / (2 * ggBM) * ((n + 255) / 256)
	grid := Grid1D(2*max(1, min(g.moe.tpClusters, pairs)), ggThreads)
	grid.Cluster = driver.Dim3{X: 2, Y: 1, Z: 1}
	grid.Shared = tpSmem()
	return grid
}

// runTPGather queues tp_gather_nt or tp_gather_nn. Its grid must be
// resident at once (TMA threads wait on other blocks' gathering warps):
// one block per SM, which its shared memory enforces, in no more clusters
// than the GPU holds (tpGrid).
func (g *GroupedGemm) runTPGather(a tpGather) error {
	k := g.moe.tpGatherNT
	if a.mn {
		k = g.moe.tpGatherNN
	}
	maps := []driver.TiledMap{rowsMap(a.x, a.rows, a.k), tpWeightMap(a.w, a.n, a.k, a.mn), f32BoxesMap(a.out, a.rows, a.n)}
	slots := []uint64{uint64(a.out), uint64(a.x), uint64(a.full), uint64(a.ptrs), uint64(a.flags), uint64(a.fault),
		uint64(g.waitTimeout().Nanoseconds()), uint64(a.offsets), uint64(uint32(a.rows)), uint64(uint32(a.n)),
		uint64(uint32(a.k)), uint64(uint32(a.blockRows)), uint64(uint32(a.rotM)),
		uint64(uint32(tpGroupM((a.n+255)/256, true)))}
	return g.launchFused(k, g.tpGrid(a.rows, a.n), maps, slots, g.moe.optInTP)
}

// runTPScatter queues tp_scatter_nt or tp_scatter_nn, after writing the
// owners' maps (when a has them) in stream order.
func (g *GroupedGemm) runTPScatter(a tpScatter) error {
	k := g.moe.tpScatterNT
	if a.mn {
		k = g.moe.tpScatterNN
	}
	maps := []driver.TiledMap{rowsMap(a.a, a.rows, a.k), tpWeightMap(a.w, a.n, a.k, a.mn)}
	var mapsPtr driver.DevicePtr
	if a.ownerMaps != nil {
		mapsPtr = a.mapsAt.Ptr()
	}
	slots := []uint64{uint64(a.ptrs), uint64(mapsPtr), uint64(a.offsets), uint64(uint32(a.rows)),
		uint64(uint32(a.n)), uint64(uint32(a.k)), uint64(uint32(a.blockRows)), uint64(uint32(a.slotRow0)),
		uint64(uint32(a.rotM)), uint64(uint32(tpGroupM((a.n+255)/256, false))), uint64(uint32(a.landing))}
	for i, m := range a.ownerMaps {
		if err := m.Check(); err != nil {
			return fmt.Errorf("cuda: %s: owner %d's tensor map: %w", k.Desc.Name, i, err)
		}
	}
	return g.launchFusedChosen(k, g.tpGrid(a.rows, a.n), maps, slots, g.moe.optInTP, func(launch func(*Kernel) error) error {
		if a.ownerMaps != nil {
			tms := make([]driver.TensorMap, len(a.ownerMaps))
			for i, m := range a.ownerMaps {
				if err := g.enc.EncodeTiled(&tms[i], m); err != nil {
					return fmt.Errorf("cuda: %s: owner %d's tensor map: %w", k.Desc.Name, i, err)
				}
			}
			raw := unsafe.Slice((*byte)(unsafe.Pointer(&tms[0])), len(tms)*int(unsafe.Sizeof(tms[0])))
			if err := g.d.stage(mapsPtr, raw); err != nil {
				return fmt.Errorf("cuda: %s: owners' tensor maps: %w", k.Desc.Name, err)
			}
		}
		return launch(k)
	})
}
