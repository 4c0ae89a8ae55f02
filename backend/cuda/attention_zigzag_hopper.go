package cuda

// The fused ring in one pass on the Hopper attention core: the launch side
// of attention_hopper.cu's attn_h_zz_forward_d{64,128} and
// attn_h_zz_backward_d{64,128} (kernels/attention_hopper.md, "The fused
// ring on this core").
//
// Forward: a block is the whole-sequence forward's, over this rank's 128
// queries, and reads each 128-key tile from the rank that holds it
// through that rank's tensor map, in position order, so the online
// softmax stays in registers from the first rank's chunk to the last.
// Backward: a block owns 128 of this rank's keys of one kv head and walks
// every query tile of the whole sequence that sees them, per query head of
// the group from the last tile down (as the whole-sequence backward, so
// the blocks that start together share their tiles in L2), reading q and
// dout through their owner's maps and lse and
// delta through its pointers; dk and dv stay in registers and are stored
// once, and each dq block is added into its owner's dq by TMA reductions.
// One kernel per rank and direction, no partial output, lse or gradient in
// memory between chunks, nothing summed afterwards. dq's adds land at L2
// in the order blocks run, so dq's last bits vary from run to run: under
// SetDeterministic the two-pass kernels of attention_zigzag.go run instead.
//
// Every tensor is addressed through a tensor map or pointer encoded into
// the kernel's one block parameter (ah_zz_maps, ah_zz_bmaps), so no
// pointer table is staged and ranks sharing a device need no lock.

import (
	"cmp"
	"fmt"
	"math"
	"runtime"
	"unsafe"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// zigzagHopperMaxRanks is the most ranks the one-pass kernels take
// (attention_hopper.cu's AH_ZZ_MAX): the block parameter holds a tensor
// map per rank for each tensor it reads from every rank.
const zigzagHopperMaxRanks = 8

// ZigzagAttentionOnePass says whether the one-pass kernels take s here: a
// Hopper GPU (hopperAttnTakes), head dims 64 and 128, chunks of a multiple
// of 128 rows, at most zigzagHopperMaxRanks ranks, and not under
// SetDeterministic (dq's adds land in the order blocks run).
func (b *Backend) ZigzagAttentionOnePass(s backend.ZigzagShape) error {
	if err := b.zigzagOnePassTakes(s); err != nil {
		return err
	}
	if b.deterministic.Load() {
		return fmt.Errorf("the one-pass fused ring adds dq in the order its blocks run, which train.deterministic does not allow")
	}
	return nil
}

// zigzagOnePassTakes is ZigzagAttentionOnePass without the
// SetDeterministic check: whether the kernels run s at all. The ops check
// only this, so that a layer built before a SetDeterministic(true) keeps
// running (with dq's adds in no fixed order) instead of failing mid-run.
func (b *Backend) zigzagOnePassTakes(s backend.ZigzagShape) error {
	if !hopperAttnTakes(b.dev, backend.AttnShape{HeadDim: s.HeadDim}) {
		return fmt.Errorf("the one-pass fused ring runs on Hopper GPUs (sm_90a) at head dims 64 and 128, not on %s at head dim %d", b.dev.info.Name, s.HeadDim)
	}
	return zigzagOnePassShape(s)
}

// zigzagOnePassShape is the one-pass kernels' rule on s's shape, on a
// Hopper GPU: zigzagTakes', chunks of a multiple of 128 rows and at most
// zigzagHopperMaxRanks ranks.
func zigzagOnePassShape(s backend.ZigzagShape) error {
	if err := zigzagTakes(s); err != nil {
		return err
	}
	switch {
	case s.Chunk%hopperAttnBM != 0:
		return fmt.Errorf("the one-pass fused ring needs chunks (seq/(2*cp) = %d) that are a multiple of %d", s.Chunk, hopperAttnBM)
	case s.Ranks > zigzagHopperMaxRanks:
		return fmt.Errorf("the one-pass fused ring takes at most %d ranks, not %d", zigzagHopperMaxRanks, s.Ranks)
	}
	return nil
}

// HopperZigzag answers ZigzagAttentionSupports and ZigzagAttentionOnePass
// as the backend does on a Hopper GPU (H100, H200) outside
// train.deterministic, without opening one: for a memory plan of a named
// GPU (mktrain plan --device h200), which must size the fused ring's
// buffers as a run there would.
type HopperZigzag struct{}

// ZigzagAttentionSupports is the backend's on any GPU: the shape alone.
func (HopperZigzag) ZigzagAttentionSupports(s backend.ZigzagShape) error { return zigzagTakes(s) }

// ZigzagAttentionOnePass is the backend's on a Hopper GPU whose shared
// memory takes the kernels (every H100 and H200 does).
func (HopperZigzag) ZigzagAttentionOnePass(s backend.ZigzagShape) error {
	if !tcHeadDim(s.HeadDim) {
		return fmt.Errorf("the one-pass fused ring runs at head dims 64 and 128, not %d", s.HeadDim)
	}
	return zigzagOnePassShape(s)
}

// bf16Vector checks that t is a bfloat16 tensor of this backend of n
// elements.
func bf16Vector(op, name string, t backend.Tensor, n int) *Tensor {
	return typedVector(op, name, t, backend.BFloat16, n, "but the one-pass fused ring reads bf16 q, k, v and dout")
}

// zigzagPtrs returns the addresses of ts (live tensors), failing op with
// what's name otherwise.
func zigzagPtrs(op, what string, ts []*Tensor) []driver.DevicePtr {
	ps, ok := devicePtrs(ts...)
	if !ok {
		fail(op, "a tensor of %s was freed", what)
	}
	return ps
}

// zigzagList checks every rank's tensor of list name: W of them, of n
// elements each, bf16 or float32 as bf16 says.
func zigzagList(op, name string, l []backend.Tensor, s backend.ZigzagShape, n int, bf16 bool) []*Tensor {
	if len(l) != s.Ranks {
		fail(op, "%s has %d tensors for %d ranks", name, len(l), s.Ranks)
	}
	ts := make([]*Tensor, len(l))
	for r, t := range l {
		what := fmt.Sprintf("rank %d's %s", r, name)
		if bf16 {
			ts[r] = bf16Vector(op, what, t, n)
		} else {
			ts[r] = vector(op, what, t, n)
		}
	}
	return ts
}

// rankMaps is one tensor map per slot of zigzagHopperMaxRanks, slot i
// rank i's (the slots past W repeat the last rank's: the kernels never
// read them, but every map must encode).
func rankMaps(ps []driver.DevicePtr, m func(driver.DevicePtr) driver.TiledMap) []driver.TiledMap {
	maps := make([]driver.TiledMap, zigzagHopperMaxRanks)
	for i := range maps {
		maps[i] = m(ps[min(i, len(ps)-1)])
	}
	return maps
}

// zigzagForwardHopper is ZigzagAttentionForward on bf16 q, k and v:
// attn_h_zz_forward_d{64,128}, whose one block parameter is ah_zz_maps
// (q's map, then zigzagHopperMaxRanks maps each of k and v), its blocks
// band (sequence, head) pairs at a time (0: hopperZigzagBand's choice).
func (b *Backend) zigzagForwardHopper(outTQ, lseBHS, qTQ backend.Tensor, kTK, vTK []backend.Tensor, s backend.ZigzagShape, band int) {
	const op = "ZigzagAttentionForward"
	grid, maps, slots, keep := b.zigzagForwardArgs(op, outTQ, lseBHS, qTQ, kTK, vTK, s, band)
	b.fail(b.launchMapBlock(op, fmt.Sprintf("attn_h_zz_forward_d%d", s.HeadDim), grid, maps, nil, slots))
	runtime.KeepAlive(keep)
}

// zigzagForwardArgs checks zigzagForwardHopper's arguments and returns
// attn_h_zz_forward's launch: its grid, its block parameter's tensor maps,
// the scalar slots after it, and the tensors to keep alive until the
// launch is queued (a lab build of the kernel launches with the same).
func (b *Backend) zigzagForwardArgs(op string, outTQ, lseBHS, qTQ backend.Tensor, kTK, vTK []backend.Tensor, s backend.ZigzagShape, band int) (Grid, []driver.TiledMap, []uint64, [2][]*Tensor) {
	if err := b.zigzagOnePassTakes(s); err != nil {
		fail(op, "bf16 q, k and v: %v", err)
	}
	rows := s.Batch * 2 * s.Chunk
	nq, nk := rows*s.Heads*s.HeadDim, rows*s.KVHeads*s.HeadDim
	single := zigzagPtrs(op, "out, lse and q", []*Tensor{vector(op, "out", outTQ, nq),
		vector(op, "lse", lseBHS, s.Batch*2*s.Heads*s.Chunk), bf16Vector(op, "q", qTQ, nq)})
	ks, vs := zigzagList(op, "k", kTK, s, nk, true), zigzagList(op, "v", vTK, s, nk, true)
	kp, vp := zigzagPtrs(op, "k", ks), zigzagPtrs(op, "v", vs)
	kvMap := func(p driver.DevicePtr) driver.TiledMap {
		return hopperAttnMap(p, s.KVHeads*s.HeadDim, rows, hopperAttnBN)
	}
	maps := []driver.TiledMap{hopperAttnMap(single[2], s.Heads*s.HeadDim, rows, hopperAttnBM)}
	maps = append(maps, rankMaps(kp, kvMap)...)
	maps = append(maps, rankMaps(vp, kvMap)...)
	_, scaleLog2 := attnScales(s.HeadDim)
	slots := []uint64{uint64(single[0]), uint64(single[1]), uint64(uint32(s.Rank)), uint64(uint32(s.Ranks)), uint64(uint32(s.Chunk)),
		uint64(uint32(s.Heads)), uint64(uint32(s.KVHeads)), uint64(math.Float32bits(scaleLog2)),
		uint64(uint32(cmp.Or(band, hopperZigzagBand(s.Batch*s.Heads, 2*s.Chunk/hopperAttnBM))))}
	grid := Grid{
		Grid:   driver.Dim3{X: s.Batch * s.Heads, Y: 2 * s.Chunk / hopperAttnBM, Z: 1},
		Block:  driver.Dim3{X: 384, Y: 1, Z: 1},
		Shared: hopperAttnSmem(s.HeadDim, 2),
	}
	return grid, maps, slots, [2][]*Tensor{ks, vs}
}

// ZigzagAttentionPrepare runs attn_h_delta over this rank's rows: its
// [B*2C] rows are B*2 runs of C rows, which is [B, 2, H, C] in the
// kernel's [B', H, S] layout (B' = 2B, S = C). The same pass rounds dout
// into doutBF16TQ and zeroes dqTQ.
func (b *Backend) ZigzagAttentionPrepare(deltaBHS, doutBF16TQ, dqTQ, doutTQ, outTQ backend.Tensor, s backend.ZigzagShape) {
	const op = "ZigzagAttentionPrepare"
	if err := s.Check(); err != nil {
		fail(op, "%v", err)
	}
	rows := s.Batch * 2 * s.Chunk
	n := rows * s.Heads * s.HeadDim
	ps := zigzagPtrs(op, "delta, dout's rounding, dq, dout and out", []*Tensor{vector(op, "delta", deltaBHS, s.Batch*2*s.Heads*s.Chunk),
		bf16Vector(op, "dout's rounding", doutBF16TQ, n), vector(op, "dq", dqTQ, n), vector(op, "dout", doutTQ, n), vector(op, "out", outTQ, n)})
	// The kernel moves four columns an access: 16 bytes of the float
	// tensors, 8 of the bf16 one.
	for i, a := range []struct {
		name  string
		bytes driver.DevicePtr
	}{{"dout's rounding", 8}, {"dq", 16}, {"dout", 16}, {"out", 16}} {
		if ps[i+1]%a.bytes != 0 {
			fail(op, "%s must start on a %d-byte boundary, not at %#x", a.name, a.bytes, uint64(ps[i+1]))
		}
	}
	kern, err := sourceKernel(b.dev, "attention_hopper.cu", "attn_h_delta")
	if err != nil {
		b.fail(err)
		return
	}
	b.fail(b.dev.Launch(kern, b.dev.StrideGrid(int64(rows)*int64(s.Heads)*32, 256, 8), ps[0], ps[1], ps[2], ps[3], ps[4],
		int32(rows), int32(s.Chunk), int32(s.Heads), int32(s.HeadDim)))
}

// ZigzagAttentionBackward runs attn_h_zz_backward_d{64,128}, whose one
// block parameter is ah_zz_bmaps: this rank's k and v maps, then
// zigzagHopperMaxRanks maps each of q, dout and dq, then one map-sized
// entry holding zigzagHopperMaxRanks pointers each of lse and delta.
func (b *Backend) ZigzagAttentionBackward(dqTQ []backend.Tensor, dkTK, dvTK, kTK, vTK backend.Tensor, qTQ, doutTQ, lseBHS, deltaBHS []backend.Tensor, s backend.ZigzagShape) {
	b.zigzagBackwardHopper(dqTQ, dkTK, dvTK, kTK, vTK, qTQ, doutTQ, lseBHS, deltaBHS, s, 0)
}

// zigzagBackwardHopper is ZigzagAttentionBackward with splits blocks
// sharing each key block (0: zigzagBackwardSplits's choice; else a
// divisor of the group).
func (b *Backend) zigzagBackwardHopper(dqTQ []backend.Tensor, dkTK, dvTK, kTK, vTK backend.Tensor, qTQ, doutTQ, lseBHS, deltaBHS []backend.Tensor, s backend.ZigzagShape, splits int) {
	const op = "ZigzagAttentionBackward"
	if err := b.zigzagOnePassTakes(s); err != nil {
		fail(op, "%v", err)
	}
	rows := s.Batch * 2 * s.Chunk
	Q, KD := s.Heads*s.HeadDim, s.KVHeads*s.HeadDim
	nl := s.Batch * 2 * s.Heads * s.Chunk
	single := zigzagPtrs(op, "dk, dv, k and v", []*Tensor{vector(op, "dk", dkTK, rows*KD), vector(op, "dv", dvTK, rows*KD),
		bf16Vector(op, "k", kTK, rows*KD), bf16Vector(op, "v", vTK, rows*KD)})
	lists := [][]*Tensor{zigzagList(op, "dq", dqTQ, s, rows*Q, false), zigzagList(op, "q", qTQ, s, rows*Q, true),
		zigzagList(op, "dout", doutTQ, s, rows*Q, true), zigzagList(op, "lse", lseBHS, s, nl, false),
		zigzagList(op, "delta", deltaBHS, s, nl, false)}
	var ps [5][]driver.DevicePtr
	for i, name := range []string{"dq", "q", "dout", "lse", "delta"} {
		ps[i] = zigzagPtrs(op, name, lists[i])
	}
	qMap := func(p driver.DevicePtr) driver.TiledMap { return hopperAttnMap(p, Q, rows, hopperAttnBwdQ) }
	// dq's blocks are added by TMA reductions of float32 boxes of 32
	// columns (128 bytes, swizzled) by 64 query rows.
	dqMap := func(p driver.DevicePtr) driver.TiledMap {
		return driver.TiledMap{
			Type: driver.TensorMapFloat32, Addr: p,
			Dims: []uint64{uint64(Q), uint64(rows)}, Strides: []uint64{4 * uint64(Q)},
			Box: []uint32{32, hopperAttnBwdQ}, Swizzle: driver.Swizzle128B, L2: driver.L2Promotion256B,
		}
	}
	maps := []driver.TiledMap{hopperAttnMap(single[2], KD, rows, hopperAttnBN), hopperAttnMap(single[3], KD, rows, hopperAttnBN)}
	maps = append(maps, rankMaps(ps[1], qMap)...)
	maps = append(maps, rankMaps(ps[2], qMap)...)
	maps = append(maps, rankMaps(ps[0], dqMap)...)
	var pointers driver.TensorMap
	for i := range zigzagHopperMaxRanks {
		pointers[i] = uint64(ps[3][min(i, s.Ranks-1)])
		pointers[zigzagHopperMaxRanks+i] = uint64(ps[4][min(i, s.Ranks-1)])
	}
	scale, scaleLog2 := attnScales(s.HeadDim)
	slots := []uint64{uint64(single[0]), uint64(single[1]), uint64(uint32(s.Rank)), uint64(uint32(s.Ranks)), uint64(uint32(s.Chunk)),
		uint64(uint32(s.Heads)), uint64(uint32(s.KVHeads)), uint64(math.Float32bits(scaleLog2)), uint64(math.Float32bits(scale))}
	threads, smem := hopperAttnBwdLaunch(s.HeadDim)
	keyBlocks := s.Batch * s.KVHeads * 2 * s.Chunk / hopperAttnBN
	if splits == 0 {
		splits = zigzagBackwardSplits(keyBlocks, s.Heads/s.KVHeads, s.HeadDim, s.Seq(), b.dev.info.SMs)
	}
	if splits > 1 {
		// The blocks add their shares of dk and dv, two adjacent columns
		// a vector reduction, which wants 8-byte addresses.
		if single[0]%8 != 0 || single[1]%8 != 0 {
			fail(op, "dk and dv must start on 8-byte boundaries (views at even element offsets), not at %#x and %#x", uint64(single[0]), uint64(single[1]))
		}
		b.Zero(dkTK)
		b.Zero(dvTK)
	}
	grid := Grid{
		Grid:   driver.Dim3{X: s.Batch * s.KVHeads, Y: 2 * s.Chunk / hopperAttnBN, Z: splits},
		Block:  driver.Dim3{X: threads, Y: 1, Z: 1},
		Shared: smem,
	}
	b.fail(b.launchMapBlock(op, fmt.Sprintf("attn_h_zz_backward_d%d", s.HeadDim), grid, maps, []driver.TensorMap{pointers}, slots))
	runtime.KeepAlive(lists)
}

// zigzagBackwardSplits is how many blocks of attn_h_zz_backward_d* share
// one key block of a rank (each walking an equal share of the group's
// query heads, group of them, and adding its dk and dv): the fewest
// divisors of group that make at least 1.5 blocks an SM, and at head dim
// 128 at least two (the whole group at most). A rank's key blocks differ
// in work by up to 2W times (its early chunk's keys see every later
// query), so with about one block an SM the heaviest set the call's time;
// with more, the light ones fill the SMs the heavy ones leave. 1.5 and
// not 2: at chunks of 2048 rows two blocks a key block (1.9 an SM) beat
// four at bench level (TestZigzagBackwardSplitFigures, H100). At head
// dim 128 two beat one at chunks of 4096 rows too, where one already
// makes 1.9 blocks an SM: Nsight Compute per launch (H100, 7d3cf03) put
// a rank's call at 2.6% (W4) and 4.0% (W2) less time with two blocks a
// key block and 1.6-1.7% with four, its L2 hits from 85.7% to 92%: a
// block walking half the heads drifts half as far from the blocks it
// started beside, which read the same query tiles
// (kernels/attention_hopper.md). For the same reason a head a block at
// head dim 128 once the whole sequence, seq positions, reaches 65,536,
// where a block's walk is longest: at W8 S/W 8192 four blocks a key block
// took 83.6 and 84.1 ms against two's 83.2 and 87.2 and one's 85.9 and
// 87.8 (TestZigzagBackwardSplitFigures, two H100s, ca3eff4's kernels),
// and 82.9 against two's 82.7 on production's kernels (859b7f6), where
// bench attention's profiled step put the row's backward kernels at 77.8
// ms against 81.8 with two.
func zigzagBackwardSplits(keyBlocks, group, headDim, seq, sms int) int {
	if headDim == 128 && seq >= 65536 {
		return group
	}
	for d := 1; d < group; d++ {
		if group%d == 0 && 2*keyBlocks*d >= 3*sms && (d > 1 || headDim != 128) {
			return d
		}
	}
	return group
}

// launchMapBlock queues kernel name of attention_hopper.cu on grid with
// one block parameter, maps encoded one after another and then tail (each
// entry 128 bytes, a map's size), followed by the 8-byte argument slots.
func (b *Backend) launchMapBlock(op, name string, grid Grid, maps []driver.TiledMap, tail []driver.TensorMap, slots []uint64) error {
	kern, err := sourceKernel(b.dev, "attention_hopper.cu", name)
	if err != nil {
		return err
	}
	return b.launchMapBlockKernel(op, kern, grid, maps, tail, slots)
}

// launchMapBlockKernel is launchMapBlock on kernel kern (a lab build's,
// say).
func (b *Backend) launchMapBlockKernel(op string, kern *Kernel, grid Grid, maps []driver.TiledMap, tail []driver.TensorMap, slots []uint64) error {
	// (Its setmaxnreg hangs from a register count at entry it does not assume.)
	if err := kern.CheckRegisterSplit(grid.Block.X); err != nil {
		return err
	}
	named := make([]namedMap, len(maps))
	for i, m := range maps {
		named[i] = namedMap{fmt.Sprintf("tensor map %d", i), m}
	}
	return launchEncoded(b.dev, op, kern, grid, named, func(enc *driver.TensorMapEncoder, tiled []driver.TiledMap, pin *runtime.Pinner) ([]unsafe.Pointer, error) {
		block := make([]driver.TensorMap, len(tiled), len(tiled)+len(tail))
		for i, m := range tiled {
			if err := enc.EncodeTiled(&block[i], m); err != nil {
				return nil, fmt.Errorf("cuda: %s: %s: %w", op, named[i].name, err)
			}
		}
		block = append(block, tail...)
		params := []unsafe.Pointer{unsafe.Pointer(&block[0])}
		for i := range slots {
			params = append(params, unsafe.Pointer(&slots[i]))
		}
		pin.Pin(&block[0])
		pin.Pin(&slots[0])
		pin.Pin(&params[0])
		return params, nil
	})
}
