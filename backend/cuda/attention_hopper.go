package cuda

// The Hopper attention kernels' launch side (kernels/attention_hopper.cu;
// its header describes the kernels), with AttentionForward's and
// AttentionBackward's semantics. bf16 q, k, v (and dout) go in through
// TMA tensor maps; out, lse and the gradients come out float32. They
// serve head dims 64 and 128 on sm_90a GPUs: attentionForward and
// attentionBackward pick them there and round float32 inputs to bf16 in
// scratch first (the tensor-core kernels round them too, as they stage
// tiles), and AttentionForwardBF16 / AttentionBackwardBF16 take bf16
// tensors as they are.

import (
	"cmp"
	"fmt"
	"math"
	"runtime"
	"unsafe"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// hopperAttnBM is the queries a block of two consumer warpgroups owns
// (the ring's forward); hopperAttnBN the keys of a tile
// (kernels/attention_hopper.cu's AH_BM and AH_BN).
const hopperAttnBM, hopperAttnBN = 128, 128

// hopperAttnConsumers is the whole-sequence forward's consumer
// warpgroups per head dim (ah_fwd_nc<DH>::NC), 64 queries each: three at
// head dim 64, two at 128. A block has one producer warpgroup more.
func hopperAttnConsumers(dh int) int {
	if dh == 64 {
		return 3
	}
	return 2
}

// hopperAttnStages is the depth of the kernel's k/v ring per head dim
// (ah_cfg<DH>::STAGES).
func hopperAttnStages(dh int) int {
	if dh == 64 {
		return 4
	}
	return 2
}

// hopperAttnSmem is a forward kernel's dynamic shared memory with
// consumers consumer warpgroups (ah_cfg<DH, NC>::SMEM): alignment slack,
// the q tile of 64*consumers rows, the ring of k and v tiles, the
// mbarriers (q's full and free, and four a stage: k and v full, k and v
// empty) and 8 bytes for the walking kernels' item slot.
func hopperAttnSmem(dh, consumers int) int {
	stages, tile, qTile := hopperAttnStages(dh), dh/64*hopperAttnBN*128, dh/64*64*consumers*128
	return 1024 + qTile + 2*stages*tile + 8*(3+4*stages)
}

// hopperAttnTakes says whether the Hopper kernels run s on d: a Hopper
// GPU with the shared memory both directions need, and head dim 64 or
// 128.
func hopperAttnTakes(d *Device, s backend.AttnShape) bool {
	return d.info.Arch == "sm_90a" && tcHeadDim(s.HeadDim) &&
		d.info.MaxSharedOptIn >= max(hopperAttnSmem(s.HeadDim, hopperAttnConsumers(s.HeadDim)), hopperAttnBwdSmem(s.HeadDim))
}

// AttentionForwardBF16 is AttentionForward on bf16 q [B*S, H*Dh], k and v
// [B*KS, KV*Dh], writing out [B*S, H*Dh] (float32, or bf16 with outBF16,
// each value rounded once) and float32 lse [B, H, S]. On Hopper, for head
// dims 64 and 128 and 16-byte aligned tensors, the kernel reads them as
// they are; elsewhere they are widened to float32 in scratch for
// AttentionForward's kernels (the same values, so the same results up to
// those kernels' own rounding), and a bf16 out is rounded from their
// float32 out. Asynchronous: launch errors come back from the next Sync.
func AttentionForwardBF16(d *Device, out, lse, q, k, v driver.DevicePtr, s backend.AttnShape, outBF16 bool) error {
	if _, err := checkAttnShape("AttentionForwardBF16", s); err != nil {
		return err
	}
	if hopperAttnTakes(d, s) && aligned16(out, q, k, v) {
		return launchHopperAttnForward(d, out, lse, q, k, v, s, outBF16, 0)
	}
	nq, nk := attnElems(s)
	bf := []widened{{q, nq}, {k, nk}, {v, nk}}
	if outBF16 {
		bf = append(bf, widened{0, nq}) // the float32 out, rounded into out below
	}
	return withWidened(d, bf, func(f []driver.DevicePtr) error {
		if !outBF16 {
			return attentionForward(d, out, lse, f[0], f[1], f[2], s, attnAuto)
		}
		if err := attentionForward(d, f[3], lse, f[0], f[1], f[2], s, attnAuto); err != nil {
			return err
		}
		conv, err := sourceKernel(d, "convert.cu", "f32_to_bf16")
		if err != nil {
			return err
		}
		return d.Launch(conv, d.StrideGrid(nq, 256, 4), out, f[3], nq)
	})
}

// attnBwdInputs says which of the backward's inputs come in bf16 already:
// the Hopper backward rounds q, k, v and dout into scratch otherwise, and
// reads out (the forward's output, for delta) in either type; a bf16 out
// goes with a bf16 dout.
type attnBwdInputs struct{ qkv, dout, out bool }

// AttentionBackwardBF16 is AttentionBackward with bf16 q, k and v (lse and
// the gradients float32; dout and out float32, or bf16 as in says), or
// AttentionBackwardOrdered with ordered. The Hopper backward reads the
// bf16 inputs as they are; the other kernels get them widened to float32
// in scratch.
func AttentionBackwardBF16(d *Device, dq, dk, dv, dout, q, k, v, out, lse driver.DevicePtr, s backend.AttnShape, ordered bool, in attnBwdInputs) error {
	if _, err := checkAttnShape("AttentionBackwardBF16", s); err != nil {
		return err
	}
	if in.out && !in.dout {
		return fmt.Errorf("cuda: AttentionBackwardBF16: a bf16 out needs a bf16 dout")
	}
	in.qkv = true
	if !ordered && hopperAttnTakes(d, s) && aligned16(dq, dk, dv, dout, q, k, v, out) {
		return hopperAttnBackward(d, dq, dk, dv, dout, q, k, v, out, lse, s, in)
	}
	impl := attnAuto
	if ordered {
		impl = attnAutoOrdered
	}
	nq, nk := attnElems(s)
	bf := []widened{{q, nq}, {k, nk}, {v, nk}}
	if in.dout {
		bf = append(bf, widened{dout, nq})
	}
	if in.out {
		bf = append(bf, widened{out, nq})
	}
	return withWidened(d, bf, func(f []driver.DevicePtr) error {
		if in.dout {
			dout = f[3]
		}
		if in.out {
			out = f[4]
		}
		return attentionBackward(d, dq, dk, dv, dout, f[0], f[1], f[2], out, lse, s, impl)
	})
}

// attnElems is the elements of q (and out, dout, dq) and of k (and v,
// dk, dv) for the shape s.
func attnElems(s backend.AttnShape) (nq, nk int64) {
	return int64(s.Batch) * int64(s.Seq) * int64(s.Heads*s.HeadDim), int64(s.Batch) * int64(s.Keys()) * int64(s.KVHeads*s.HeadDim)
}

// aligned16 reports whether every pointer is 16-byte aligned.
func aligned16(ps ...driver.DevicePtr) bool {
	for _, p := range ps {
		if p%16 != 0 {
			return false
		}
	}
	return true
}

// widened is a bf16 tensor of n elements that withWidened copies to
// float32.
type widened struct {
	src driver.DevicePtr
	n   int64
}

// withWidened runs f on float32 copies of the bf16 tensors ts (q, k and
// v, and a bf16 dout or out), in their order, in one scratch buffer freed
// (stream-ordered) after f's kernels; a src of 0 gets its float32 part
// but no copy (room for f's own float32 output).
func withWidened(d *Device, ts []widened, f func(f32 []driver.DevicePtr) error) error {
	widen, err := sourceKernel(d, "convert.cu", "bf16_to_f32")
	if err != nil {
		return err
	}
	// Parts rounded up to 4 elements keep each one 16-byte aligned.
	total := int64(0)
	for _, t := range ts {
		total += (t.n + 3) / 4 * 4
	}
	buf, err := d.Alloc(4 * total)
	if err != nil {
		return err
	}
	defer d.Free(buf)
	f32 := make([]driver.DevicePtr, len(ts))
	at := buf.Ptr()
	for i, t := range ts {
		f32[i] = at
		if t.src != 0 {
			if err := d.Launch(widen, d.StrideGrid(t.n, 256, 4), at, t.src, t.n); err != nil {
				return err
			}
		}
		at += driver.DevicePtr(4 * ((t.n + 3) / 4 * 4))
	}
	return f(f32)
}

// hopperAttnMap is a bf16 tensor of rows x cols as one 2-D tensor map read
// in boxes of 64 columns (128 bytes, the swizzle span) by boxRows rows.
func hopperAttnMap(addr driver.DevicePtr, cols, rows, boxRows int) driver.TiledMap {
	return driver.TiledMap{
		Type: driver.TensorMapBfloat16, Addr: addr,
		Dims: []uint64{uint64(cols), uint64(rows)}, Strides: []uint64{2 * uint64(cols)},
		Box: []uint32{64, uint32(boxRows)}, Swizzle: driver.Swizzle128B, L2: driver.L2Promotion256B,
	}
}

// namedMap is a tensor map and the name errors give it.
type namedMap struct {
	name string
	m    driver.TiledMap
}

// launchWithMaps queues kern on grid with the tensor maps first and then
// the 8-byte argument slots, opting the kernel in to grid.Shared bytes of
// dynamic shared memory the first time it asks for that much. The maps
// are checked here and encoded on the device thread.
func launchWithMaps(d *Device, op string, kern *Kernel, grid Grid, maps []namedMap, slots []uint64) error {
	return launchEncoded(d, op, kern, grid, maps, func(enc *driver.TensorMapEncoder, tiled []driver.TiledMap, pin *runtime.Pinner) ([]unsafe.Pointer, error) {
		return mappedParams(enc, tiled, slots, pin, func(i int) string {
			return "cuda: " + op + ": " + maps[i].name + " tensor map"
		})
	})
}

// launchEncoded checks maps, then on the device thread opts kern in to
// grid.Shared bytes of dynamic shared memory, builds the parameter list
// with params (which encodes the maps and pins what it points at) and
// queues kern.
func launchEncoded(d *Device, op string, kern *Kernel, grid Grid, maps []namedMap,
	params func(enc *driver.TensorMapEncoder, tiled []driver.TiledMap, pin *runtime.Pinner) ([]unsafe.Pointer, error)) error {
	tiled := make([]driver.TiledMap, len(maps))
	for i, m := range maps {
		if err := m.m.Check(); err != nil {
			return fmt.Errorf("cuda: %s: %s: %w", op, m.name, err)
		}
		tiled[i] = m.m
	}
	enc, err := d.TensorMapEncoder()
	if err != nil {
		return fmt.Errorf("cuda: %s: %w", op, err)
	}
	return d.Submit(func() error {
		if err := optInShared(d, kern, grid.Shared); err != nil {
			return err
		}
		var pin runtime.Pinner
		defer pin.Unpin()
		ps, err := params(enc, tiled, &pin)
		if err != nil {
			return err
		}
		if err := d.drv.LaunchKernel(kern.fn, grid.Grid, grid.Block, grid.Shared, d.stream, ps); err != nil {
			return fmt.Errorf("%s: %w", kern.Desc.Name, err)
		}
		return nil
	})
}

// optInShared opts kern in to bytes of dynamic shared memory the first
// time a launch asks for that much. It runs on the device thread.
func optInShared(d *Device, kern *Kernel, bytes int) error {
	if kern.sharedOptIn >= bytes {
		return nil
	}
	if err := d.drv.FuncSetAttribute(kern.fn, driver.FuncMaxDynamicSharedSizeOpt, bytes); err != nil {
		return fmt.Errorf("%s: %w", kern.Desc.Name, err)
	}
	kern.sharedOptIn = bytes
	return nil
}

// hopperAttnBand is how many (sequence, head) pairs the blocks of a
// whole-sequence kernel run at a time (ah_band in attention_hopper.cu), on
// a grid of pairs pairs by items blocks (query tiles forward, key blocks
// backward; pairs means all at once, in launch order). Below 32 items a
// pair (4,096 tokens) all pairs run at once, the heaviest items of every
// pair first, which keeps the last wave short. From 32 items 4 pairs at
// a time, whose rows L2 then holds while their blocks walk them: the
// backward's q, dout and dq (dq alone is 134 MB at B2 S8192 H16 Dh128),
// the forward's k and v. Every band was timed at 16, 32, 64 and 256
// items (TestAttentionBandFigures; kernels/attention_hopper.md). On the
// H200 at a5a94be (the backward's version 6) 4 pairs were the best band
// or level with it both ways at 32, 64 and 256 items: the backward
// 478 TFLOP/s at 64 items against 455 for 2 pairs, 492 against 493 at
// 256. (On the H100 at dbe1431, with the backward's version 4, 2 pairs
// had beaten 4 by 3% at 64 items.) At 16 items every band of 4 or fewer
// lost (the backward a sixth to a fifth).
func hopperAttnBand(pairs, items int) int {
	const band = 4
	if items < 32 || pairs < band {
		return pairs
	}
	return band
}

// hopperZigzagBand is hopperAttnBand for the ring's one-pass forward
// (attn_h_zz_forward), on its pairs by items grid (items: the rank's 2C/128
// query tiles a pair): 8 pairs at a time from 32 items, which
// TestZigzagForwardBandFigures measured on one H100 as the best band or
// level with it on every row (efficiency against the whole-sequence
// forward: W2 S/W 4096 0.976 against 0.976 all at once, W8 S/W 4096 0.888
// against 0.875, W4 S/W 8192 0.948 against 0.886 for 4 pairs). A rank's
// k and v chunks arrive one ring step at a time, so a band twice the
// whole call's still fits its rows in L2.
func hopperZigzagBand(pairs, items int) int {
	const band = 8
	if items < 32 || pairs < band {
		return pairs
	}
	return band
}

// launchHopperAttnForward queues attn_h_forward_d{64,128} (_bf16 for a
// bf16 out) on checked arguments, its items band (sequence, head) pairs
// at a time (0: hopperAttnBand's choice).
func launchHopperAttnForward(d *Device, out, lse, q, k, v driver.DevicePtr, s backend.AttnShape, outBF16 bool, band int) error {
	name := fmt.Sprintf("attn_h_forward_d%d", s.HeadDim)
	if outBF16 {
		name += "_bf16"
	}
	kern, err := sourceKernel(d, "attention_hopper.cu", name)
	if err != nil {
		return err
	}
	grid, maps, slots, err := hopperAttnForwardArgs(kern, 0, d.info.SMs, out, lse, q, k, v, s, band)
	if err != nil {
		return err
	}
	return launchWithMaps(d, "AttentionForward", kern, grid, maps, slots)
}

// hopperAttnWalks says whether the whole-sequence forward's kernels of
// head dim dh walk items (ah_forward_walk: head dim 64, 1.07-1.09x at
// moe-small's shape) or run one block an item (ah_forward: head dim 128,
// whose walking build ran 4-10% slower on an H100 even at one block an
// item; kernels/attention_hopper.md, fwd-persistent).
func hopperAttnWalks(dh int) bool { return dh == 64 }

// hopperAttnForwardArgs is the whole-sequence forward's launch on kern
// (production's, or a lab build's whose layout takes extraSmem bytes of
// shared memory more: kernels/dev) on a GPU of sms SMs: its grid, tensor
// maps and argument slots. Head dim 128's kernels run one block an item
// (a head and 128 queries) on a grid of pairs by q tiles. Head dim 64's
// walk the pairs x q tiles (items) in ah_band_of's order, block x items
// x, x + blocks, ... (hopperAttnWalks): where a band applies one block an
// item, whose launch order keeps the band's rows in L2 (a persistent grid
// of 132 blocks ran s8k's forward at 0.73-0.80x:
// kernels/attention_hopper.md); elsewhere min(sms, items) blocks, each
// item's start and epilogue under its neighbours' products.
func hopperAttnForwardArgs(kern *Kernel, extraSmem, sms int, out, lse, q, k, v driver.DevicePtr, s backend.AttnShape, band int) (Grid, []namedMap, []uint64, error) {
	dh, keys := s.HeadDim, s.Keys()
	consumers := hopperAttnConsumers(dh)
	threads, queries := 128*(1+consumers), 64*consumers
	// The producer's setmaxnreg hands the consumers registers.
	if err := kern.CheckRegisterSplit(threads); err != nil {
		return Grid{}, nil, nil, err
	}
	pairs, qTiles := s.Batch*s.Heads, (s.Seq+queries-1)/queries
	band = cmp.Or(band, hopperAttnBand(pairs, qTiles))
	blocks := driver.Dim3{X: pairs, Y: qTiles, Z: 1}
	if hopperAttnWalks(dh) {
		blocks = driver.Dim3{X: pairs * qTiles, Y: 1, Z: 1}
		if band >= pairs && sms > 0 {
			blocks.X = min(blocks.X, sms)
		}
	}
	grid := Grid{
		Grid:   blocks,
		Block:  driver.Dim3{X: threads, Y: 1, Z: 1},
		Shared: hopperAttnSmem(dh, consumers) + extraSmem,
	}
	maps := []namedMap{
		{"q", hopperAttnMap(q, s.Heads*dh, s.Batch*s.Seq, queries)},
		{"k", hopperAttnMap(k, s.KVHeads*dh, s.Batch*keys, hopperAttnBN)},
		{"v", hopperAttnMap(v, s.KVHeads*dh, s.Batch*keys, hopperAttnBN)},
	}
	_, scaleLog2 := attnScales(dh)
	slots := []uint64{uint64(out), uint64(lse), uint64(uint32(s.Seq)), uint64(uint32(keys)), uint64(uint32(attnOffset(s))),
		uint64(uint32(s.Heads)), uint64(uint32(s.KVHeads)), uint64(math.Float32bits(scaleLog2)),
		uint64(uint32(band))}
	if hopperAttnWalks(dh) {
		slots = append(slots, uint64(uint32(pairs)))
	}
	return grid, maps, slots, nil
}

// hopperAttnForwardF32 rounds float32 q, k and v to bf16 in scratch
// buffers and runs the Hopper forward on them.
func hopperAttnForwardF32(d *Device, out, lse, q, k, v driver.DevicePtr, s backend.AttnShape) error {
	conv, err := sourceKernel(d, "convert_vec.cu", "f32_to_bf16_x4")
	if err != nil {
		return err
	}
	nq, nk := attnElems(s)
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
	return launchHopperAttnForward(d, out, lse, qb, kb, vb, s, false, 0)
}

// hopperAttnBwdQ is the rows of the backward's q, dout and dq boxes
// (AH_BQ): an item's tile is one box of rows at head dim 128 and two at 64.
const hopperAttnBwdQ = 64

// hopperAttnBwdItemQ is the queries of one backward item at head dim dh
// (ah_bcfg<DH>::BQ): 128 at head dim 64, 64 at 128.
func hopperAttnBwdItemQ(dh int) int {
	if dh == 64 {
		return 128
	}
	return 64
}

// hopperAttnBwdSmem is the dynamic shared memory of the backward kernels
// (ah_bcfg<DH>::SMEM): slack, the k and v tiles, two stages of q and dout
// tiles, four dS^T buffers, the dq staging buffers (one a warpgroup at
// head dim 64, two at 128), two stages of the items' lse and delta, and
// the mbarriers.
func hopperAttnBwdSmem(dh int) int {
	const stages = 2
	bq := hopperAttnBwdItemQ(dh)
	dqBufs := 2
	if dh == 64 {
		dqBufs = 1
	}
	kt, qt, dsb, dqb := dh/64*128*128, dh/64*bq*128, 64*bq*2, 64*64*4
	return 1024 + 2*kt + stages*2*qt + 4*dsb + 2*dqBufs*dqb + stages*bq*8 + 8*(1+2*stages)
}

// hopperAttnBwdLaunch is attn_h_backward_d{dh}'s (and the ring's
// attn_h_zz_backward_d{dh}'s) block size and dynamic shared memory: 384
// threads at either head dim (ah_bwd_block: a producer warpgroup, whose
// setmaxnreg gives the two consumer warpgroups 240 registers for dk, dv
// and an item's scores).
func hopperAttnBwdLaunch(dh int) (threads, smem int) {
	return 384, hopperAttnBwdSmem(dh)
}

// hopperAttnBackward is AttentionBackward on the Hopper kernels: q, k, v
// and dout rounded to bf16 in scratch unless in says they are bf16
// already (dout by attn_h_delta, which also writes delta = rowsum(dout*out)
// and zeroes dq in the same pass), then
// attn_h_backward_d{64,128}, which writes dk and dv and adds dq's blocks
// with TMA reductions: float adds at L2 in the order the blocks run, so
// dq's last bits vary from run to run (attentionBackward under
// attnAutoOrdered runs attention_tc.cu's ordered backward instead).
func hopperAttnBackward(d *Device, dq, dk, dv, dout, q, k, v, out, lse driver.DevicePtr, s backend.AttnShape, in attnBwdInputs) error {
	kern, err := sourceKernel(d, "attention_hopper.cu", fmt.Sprintf("attn_h_backward_d%d", s.HeadDim))
	if err != nil {
		return err
	}
	threads, smem := hopperAttnBwdLaunch(s.HeadDim)
	return launchHopperAttnBackward(d, kern, threads, smem, dq, dk, dv, dout, q, k, v, out, lse, s, in, 0)
}

// launchHopperAttnBackward is hopperAttnBackward on kernel kern (attn_h_backward's
// arguments) launched with threads threads and smem bytes of dynamic
// shared memory a block, its blocks band (sequence, kv head) pairs at a
// time (0: hopperAttnBand's choice): the production
// kernel, or a lab build whose launch differs (kernels/dev).
func launchHopperAttnBackward(d *Device, kern *Kernel, threads, smem int, dq, dk, dv, dout, q, k, v, out, lse driver.DevicePtr, s backend.AttnShape, in attnBwdInputs, band int) error {
	const op = "AttentionBackward"
	dh, keys := s.HeadDim, s.Keys()
	conv, err := sourceKernel(d, "convert_vec.cu", "f32_to_bf16_x4")
	if err != nil {
		return err
	}
	deltaName := "attn_h_delta"
	switch {
	case in.out && in.dout:
		deltaName = "attn_h_delta_bf16_bf16"
	case in.out:
		return fmt.Errorf("cuda: %s: a bf16 out needs a bf16 dout", op)
	case in.dout:
		deltaName = "attn_h_delta_bf16"
	}
	deltaKern, err := sourceKernel(d, "attention_hopper.cu", deltaName)
	if err != nil {
		return err
	}
	nq, nk := attnElems(s)
	nl := int64(s.Batch) * int64(s.Heads) * int64(s.Seq)
	// Scratch: dout rounded to bf16 (by the delta kernel), the bf16
	// copies of q, k and v, then float32 delta, all 16-byte aligned (nq
	// and nk are multiples of 64).
	type rounding struct {
		dst, src driver.DevicePtr
		n        int64
	}
	var rounds []rounding
	if !in.qkv {
		rounds = append(rounds, rounding{src: q, n: nq}, rounding{src: k, n: nk}, rounding{src: v, n: nk})
	}
	bytes := 4 * nl
	if !in.dout {
		bytes += 2 * nq
	}
	for _, r := range rounds {
		bytes += 2 * r.n
	}
	buf, err := d.Alloc(bytes)
	if err != nil {
		return err
	}
	defer d.Free(buf) // stream-ordered, after the kernels below
	at := buf.Ptr()
	ob, qb, kb, vb := dout, q, k, v
	if !in.dout {
		ob = at
		at += driver.DevicePtr(2 * nq)
	}
	for i := range rounds {
		rounds[i].dst = at
		at += driver.DevicePtr(2 * rounds[i].n)
	}
	delta := at
	if !in.qkv {
		qb, kb, vb = rounds[0].dst, rounds[1].dst, rounds[2].dst
	}
	for _, c := range rounds {
		if err := d.Launch(conv, d.StrideGrid((c.n+3)/4, 256, 8), c.dst, c.src, c.n); err != nil {
			return err
		}
	}
	// delta, dq zeroed and (a float dout) its bf16 rounding, in one pass.
	T := int32(s.Batch * s.Seq)
	deltaArgs := []any{delta}
	if !in.dout {
		deltaArgs = append(deltaArgs, ob) // attn_h_delta's doutb
	}
	deltaArgs = append(deltaArgs, dq, dout, out, T, int32(s.Seq), int32(s.Heads), int32(dh))
	if err := d.Launch(deltaKern, d.StrideGrid(int64(T)*int64(s.Heads)*32, 256, 8), deltaArgs...); err != nil {
		return err
	}
	maps := []namedMap{
		{"q", hopperAttnMap(qb, s.Heads*dh, s.Batch*s.Seq, hopperAttnBwdQ)},
		{"dout", hopperAttnMap(ob, s.Heads*dh, s.Batch*s.Seq, hopperAttnBwdQ)},
		{"k", hopperAttnMap(kb, s.KVHeads*dh, s.Batch*keys, hopperAttnBN)},
		{"v", hopperAttnMap(vb, s.KVHeads*dh, s.Batch*keys, hopperAttnBN)},
		// dq's blocks are added by TMA reductions of float32 boxes of 32
		// columns (128 bytes, swizzled) by 64 query rows.
		{"dq", driver.TiledMap{
			Type: driver.TensorMapFloat32, Addr: dq,
			Dims: []uint64{uint64(s.Heads * dh), uint64(s.Batch * s.Seq)}, Strides: []uint64{4 * uint64(s.Heads*dh)},
			Box: []uint32{32, hopperAttnBwdQ}, Swizzle: driver.Swizzle128B, L2: driver.L2Promotion256B,
		}},
	}
	scale, scaleLog2 := attnScales(dh)
	pairs, keyBlocks := s.Batch*s.KVHeads, (keys+hopperAttnBN-1)/hopperAttnBN
	slots := []uint64{uint64(lse), uint64(delta), uint64(dk), uint64(dv),
		uint64(uint32(s.Seq)), uint64(uint32(keys)), uint64(uint32(attnOffset(s))), uint64(uint32(s.Heads)),
		uint64(uint32(s.KVHeads)), uint64(math.Float32bits(scaleLog2)), uint64(math.Float32bits(scale)),
		uint64(uint32(cmp.Or(band, hopperAttnBand(pairs, keyBlocks))))}
	grid := Grid{
		Grid:   driver.Dim3{X: pairs, Y: keyBlocks, Z: 1},
		Block:  driver.Dim3{X: threads, Y: 1, Z: 1},
		Shared: smem,
	}
	// Every attention_hopper.cu kernel trades registers between its
	// warpgroups with setmaxnreg, which hangs from another count at entry.
	if err := kern.CheckRegisterSplit(threads); err != nil {
		return err
	}
	return launchWithMaps(d, op, kern, grid, maps, slots)
}
