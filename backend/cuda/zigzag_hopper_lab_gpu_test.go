package cuda

// The fused ring on the Hopper core (kernels/dev/attention_hopper_lab.cu's
// zz-forward, attn_h_zz_forward_d{64,128}, and zz-backward,
// attn_h_zz_backward_d{64,128}): every rank's rows against the whole
// sequence's, computed by the production Hopper kernels on one rank, then
// timed beside that call and beside the fused ring's tensor-core kernels
// (attention_tc.cu's attn_zz_*, what mode ring runs today) on the same
// virtual ranks.

import (
	"fmt"
	"math"
	"runtime"
	"slices"
	"testing"
	"unsafe"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/kernels"
	"github.com/mktrain/mktrain/kernels/dev"
)

// zigzagLabs are the variants of attention_hopper_lab.cu that
// TestZigzagHopperLab launches (they add kernels; the other lab tests
// leave them out).
var zigzagLabs = map[string]bool{"zz-forward": true, "zz-backward": true}

// zzLabMaxRanks is the ranks attn_h_zz_forward takes (AH_ZZ_MAX).
const zzLabMaxRanks = 8

// launchZZForwardLab queues attn_h_zz_forward for rank s.Rank: q its bf16
// rows, ks and vs every rank's bf16 k and v, out and lse float32. The
// kernel's first parameter is ah_zz_maps, q's tensor map and then
// zzLabMaxRanks maps each of k and v (the entries past W repeat the last
// rank's), passed as one block of encoded maps (launchMapBlock).
func launchZZForwardLab(d *Device, kern *Kernel, out, lse, q driver.DevicePtr, ks, vs []driver.DevicePtr, s backend.ZigzagShape) error {
	if s.Ranks > zzLabMaxRanks || s.Chunk%hopperAttnBM != 0 {
		return fmt.Errorf("attn_h_zz_forward takes up to %d ranks and chunks of a multiple of %d rows, not %+v", zzLabMaxRanks, hopperAttnBM, s)
	}
	rows := s.Batch * 2 * s.Chunk
	maps := []driver.TiledMap{hopperAttnMap(q, s.Heads*s.HeadDim, rows, hopperAttnBM)}
	for _, t := range [][]driver.DevicePtr{ks, vs} {
		for i := range zzLabMaxRanks {
			maps = append(maps, hopperAttnMap(t[min(i, s.Ranks-1)], s.KVHeads*s.HeadDim, rows, hopperAttnBN))
		}
	}
	_, scaleLog2 := attnScales(s.HeadDim)
	slots := []uint64{uint64(out), uint64(lse), uint64(uint32(s.Rank)), uint64(uint32(s.Ranks)), uint64(uint32(s.Chunk)),
		uint64(uint32(s.Heads)), uint64(uint32(s.KVHeads)), uint64(math.Float32bits(scaleLog2))}
	grid := Grid{
		Grid:   driver.Dim3{X: s.Batch * s.Heads, Y: 2 * s.Chunk / hopperAttnBM, Z: 1},
		Block:  driver.Dim3{X: 384, Y: 1, Z: 1},
		Shared: hopperAttnSmem(s.HeadDim),
	}
	return launchMapBlock(d, kern, grid, maps, nil, slots)
}

// launchMapBlock queues kern on grid with one block parameter, maps
// encoded one after another and then tail (each 128 bytes: a map's
// size), followed by the 8-byte argument slots.
func launchMapBlock(d *Device, kern *Kernel, grid Grid, maps []driver.TiledMap, tail []driver.TensorMap, slots []uint64) error {
	for i, m := range maps {
		if err := m.Check(); err != nil {
			return fmt.Errorf("tensor map %d: %w", i, err)
		}
	}
	enc, err := d.TensorMapEncoder()
	if err != nil {
		return err
	}
	return d.Submit(func() error {
		if kern.sharedOptIn < grid.Shared {
			if err := d.drv.FuncSetAttribute(kern.fn, driver.FuncMaxDynamicSharedSizeOpt, grid.Shared); err != nil {
				return err
			}
			kern.sharedOptIn = grid.Shared
		}
		block := make([]driver.TensorMap, len(maps), len(maps)+len(tail))
		for i, m := range maps {
			if err := enc.EncodeTiled(&block[i], m); err != nil {
				return fmt.Errorf("tensor map %d: %w", i, err)
			}
		}
		block = append(block, tail...)
		params := []unsafe.Pointer{unsafe.Pointer(&block[0])}
		for i := range slots {
			params = append(params, unsafe.Pointer(&slots[i]))
		}
		var pin runtime.Pinner
		defer pin.Unpin()
		pin.Pin(&block[0])
		pin.Pin(&slots[0])
		pin.Pin(&params[0])
		return d.drv.LaunchKernel(kern.fn, grid.Grid, grid.Block, grid.Shared, d.stream, params)
	})
}

// zzBF16 is every rank's q, k, v and dout of a zzRun rounded to bf16, in
// buffers of their own.
type zzBF16 struct{ q, k, v, dout []driver.DevicePtr }

func newZZBF16(t *testing.T, r *zzRun) zzBF16 {
	t.Helper()
	d := r.b.dev
	conv, err := sourceKernel(d, "convert.cu", "f32_to_bf16")
	if err != nil {
		t.Fatal(err)
	}
	round := func(x backend.Tensor) driver.DevicePtr {
		n := int64(x.Len())
		buf, err := d.Alloc(2 * n)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Free(buf) })
		src, ok := devicePtrs(x.(*Tensor))
		if !ok {
			t.Fatal("a tensor was freed")
		}
		if err := d.Launch(conv, d.StrideGrid(n, 256, 4), buf.Ptr(), src[0], n); err != nil {
			t.Fatal(err)
		}
		return buf.Ptr()
	}
	var z zzBF16
	for i := range r.s.Ranks {
		z.q, z.k, z.v = append(z.q, round(r.lq[i])), append(z.k, round(r.lk[i])), append(z.v, round(r.lv[i]))
		z.dout = append(z.dout, round(r.ldout[i]))
	}
	return z
}

// labForward runs kern for every rank of r into r.lout and r.llse.
func (r *zzRun) labForward(t *testing.T, kern *Kernel, in zzBF16) error {
	for i := range r.s.Ranks {
		ps, ok := devicePtrs(r.lout[i].(*Tensor), r.llse[i].(*Tensor))
		if !ok {
			t.Fatal("a tensor was freed")
		}
		if err := launchZZForwardLab(r.b.dev, kern, ps[0], ps[1], in.q[i], in.k, in.v, r.rank(i)); err != nil {
			return err
		}
	}
	return nil
}

// launchZZBackwardLab queues attn_h_zz_backward_d{64,128} for rank s.Rank:
// its dk and dv (float32, written), every rank's dq (float32, added to),
// lse and delta ([B, 2, H, C]) and bf16 q and dout, and its own bf16 k
// and v. The kernel's first parameter is ah_zz_bmaps: the maps of k and
// v, zzLabMaxRanks each of q, dout and dq (entries past W repeat the last
// rank's), then zzLabMaxRanks pointers each of lse and delta, passed as
// one block (launchMapBlock: 27 map-sized entries, the last holding the
// pointers).
func launchZZBackwardLab(d *Device, kern *Kernel, dk, dv driver.DevicePtr, in zzBF16, dqs, lses, deltas []driver.DevicePtr, s backend.ZigzagShape) error {
	if s.Ranks > zzLabMaxRanks || s.Chunk%hopperAttnBN != 0 || !tcHeadDim(s.HeadDim) {
		return fmt.Errorf("attn_h_zz_backward takes up to %d ranks, chunks of a multiple of %d rows and head dims 64 and 128, not %+v", zzLabMaxRanks, hopperAttnBN, s)
	}
	rows, Q := s.Batch*2*s.Chunk, s.Heads*s.HeadDim
	maps := []driver.TiledMap{
		hopperAttnMap(in.k[s.Rank], s.KVHeads*s.HeadDim, rows, hopperAttnBN),
		hopperAttnMap(in.v[s.Rank], s.KVHeads*s.HeadDim, rows, hopperAttnBN),
	}
	for _, t := range [][]driver.DevicePtr{in.q, in.dout} {
		for i := range zzLabMaxRanks {
			maps = append(maps, hopperAttnMap(t[min(i, s.Ranks-1)], Q, rows, hopperAttnBwdQ))
		}
	}
	for i := range zzLabMaxRanks {
		maps = append(maps, driver.TiledMap{
			Type: driver.TensorMapFloat32, Addr: dqs[min(i, s.Ranks-1)],
			Dims: []uint64{uint64(Q), uint64(rows)}, Strides: []uint64{4 * uint64(Q)},
			Box: []uint32{32, hopperAttnBwdQ}, Swizzle: driver.Swizzle128B, L2: driver.L2Promotion256B,
		})
	}
	scale, scaleLog2 := attnScales(s.HeadDim)
	slots := []uint64{uint64(dk), uint64(dv), uint64(uint32(s.Rank)), uint64(uint32(s.Ranks)), uint64(uint32(s.Chunk)),
		uint64(uint32(s.Heads)), uint64(uint32(s.KVHeads)), uint64(math.Float32bits(scaleLog2)), uint64(math.Float32bits(scale))}
	threads, smem := hopperAttnBwdLaunch(s.HeadDim)
	grid := Grid{
		Grid:   driver.Dim3{X: s.Batch * s.KVHeads, Y: 2 * s.Chunk / hopperAttnBN, Z: 1},
		Block:  driver.Dim3{X: threads, Y: 1, Z: 1},
		Shared: smem,
	}
	// ah_zz_bmaps' lse and delta pointers: one map-sized entry after the maps.
	var ptrs driver.TensorMap
	for i := range zzLabMaxRanks {
		ptrs[i] = uint64(lses[min(i, s.Ranks-1)])
		ptrs[zzLabMaxRanks+i] = uint64(deltas[min(i, s.Ranks-1)])
	}
	return launchMapBlock(d, kern, grid, maps, []driver.TensorMap{ptrs}, slots)
}

// labBackward zeroes every rank's dq and runs kern for every rank into
// r.ldq (added to), r.ldk and r.ldv, from r.llse and r.ldelta (the
// tensor-core ring's forward and dq pass fill them: ringForward,
// ringDelta).
func (r *zzRun) labBackward(t *testing.T, kern *Kernel, in zzBF16) error {
	ptr := func(x backend.Tensor) driver.DevicePtr {
		ps, ok := devicePtrs(x.(*Tensor))
		if !ok {
			t.Fatal("a tensor was freed")
		}
		return ps[0]
	}
	var dqs, lses, deltas []driver.DevicePtr
	for i := range r.s.Ranks {
		r.b.Zero(r.ldq[i])
		dqs, lses, deltas = append(dqs, ptr(r.ldq[i])), append(lses, ptr(r.llse[i])), append(deltas, ptr(r.ldelta[i]))
	}
	for i := range r.s.Ranks {
		if err := launchZZBackwardLab(r.b.dev, kern, ptr(r.ldk[i]), ptr(r.ldv[i]), in, dqs, lses, deltas, r.rank(i)); err != nil {
			return err
		}
	}
	return nil
}

// ringDelta fills every rank's delta ([B, 2, H, C]) by the tensor-core
// ring's dq pass (whose dq labBackward overwrites).
func (r *zzRun) ringDelta() {
	for i := range r.s.Ranks {
		r.b.ZigzagAttentionBackwardDQ(r.ldq[i], r.ldelta[i], r.ldout[i], r.lq[i], r.lout[i], r.llse[i], r.lk, r.lv, r.rank(i))
	}
}

func TestZigzagHopperLab(t *testing.T) {
	b := testBackend(t)
	d := b.dev
	lab, vs := labVariants(t, "attention_hopper_lab.cu", true)
	vs = slices.DeleteFunc(vs, func(v dev.Variant) bool { return !zigzagLabs[v.Name] })
	if len(vs) == 0 {
		t.Skipf("%s names no zigzag variant of %s", labVariantsEnv, lab.File)
	}
	if !hopperAttnTakes(d, backend.AttnShape{HeadDim: 128}) {
		t.Skipf("the Hopper attention kernels do not run on %s", d.info.Name)
	}
	for _, v := range vs {
		t.Run(v.Name, func(t *testing.T) {
			added := []string{"attn_h_zz_forward_d64", "attn_h_zz_forward_d128"}
			if v.Name == "zz-backward" {
				added = []string{"attn_h_zz_backward_d64", "attn_h_zz_backward_d128"}
			}
			src, _ := kernelSource(t, "attention_hopper.cu")
			src.Kernels = slices.Clone(src.Kernels)
			for _, name := range added {
				src.Kernels = append(src.Kernels, kernels.Kernel{Name: name})
			}
			m, err := d.load(src, lab.File+"+"+v.Name, lab.Text, v.Defines...)
			if err != nil {
				t.Fatal(err)
			}
			kerns := map[string]*Kernel{}
			for _, name := range added {
				if kerns[name], err = m.Kernel(name); err != nil {
					t.Fatal(err)
				}
				t.Logf("%s: %d registers, %d bytes of local memory", name, kerns[name].Registers, kerns[name].LocalBytes)
			}
			if v.Name == "zz-backward" {
				zzBackwardLab(t, b, func(dh int) *Kernel { return kerns[fmt.Sprintf("attn_h_zz_backward_d%d", dh)] })
				return
			}
			fwd := func(dh int) *Kernel { return kerns[fmt.Sprintf("attn_h_zz_forward_d%d", dh)] }
			// Against the whole sequence's rows: GQA groups of 1 to 4,
			// W 2 to 8, several sequences, one and several tiles a chunk.
			for i, s := range []backend.ZigzagShape{
				{Ranks: 2, Batch: 2, Chunk: 128, Heads: 8, KVHeads: 2, HeadDim: 64},
				{Ranks: 4, Batch: 1, Chunk: 256, Heads: 8, KVHeads: 2, HeadDim: 128},
				{Ranks: 8, Batch: 1, Chunk: 128, Heads: 4, KVHeads: 4, HeadDim: 64},
				{Ranks: 3, Batch: 2, Chunk: 384, Heads: 4, KVHeads: 1, HeadDim: 128},
			} {
				r := newZZRun(t, b, s, uint64(40+i))
				r.wholeForward()
				if err := r.labForward(t, fwd(s.HeadDim), newZZBF16(t, r)); err != nil {
					t.Fatal(err)
				}
				r.compareSome(t, "out", "lse")
			}
			// Timed beside the whole-sequence call (the same work: core /
			// ring is the efficiency) and the tensor-core ring.
			for _, c := range []struct{ w, perRank int }{{2, 4096}, {4, 4096}, {8, 4096}, {4, 8192}, {8, 8192}} {
				s := backend.ZigzagShape{Ranks: c.w, Batch: 1, Chunk: c.perRank / 2, Heads: 16, KVHeads: 4, HeadDim: 128}
				r := newZZRun(t, b, s, 99)
				in := newZZBF16(t, r)
				sync := func(f func()) func() error { return func() error { f(); return b.Sync() } }
				coreF := attnMedianMs(t, d, sync(r.wholeForward))
				tcF := attnMedianMs(t, d, sync(r.ringForward))
				labF := attnMedianMs(t, d, func() error {
					if err := r.labForward(t, fwd(s.HeadDim), in); err != nil {
						return err
					}
					return b.Sync()
				})
				r.compareSome(t, "out", "lse")
				name := fmt.Sprintf("ring W%d S%d H16 KV4 Dh128", c.w, s.Seq())
				flops := 4 * float64(s.Heads) * float64(s.Seq()) * float64(s.Seq()) * float64(s.HeadDim) / 2
				figure(t, name+" core fwd", coreF, "ms")
				figure(t, name+" tc ring fwd", tcF, "ms")
				figure(t, name+" "+v.Name, labF, "ms")
				figure(t, name+" "+v.Name+" rate", flops/labF/1e9, "TFLOP/s")
				figure(t, name+" "+v.Name+" efficiency", coreF/labF, "x")
				figure(t, name+" tc ring efficiency", coreF/tcF, "x")
			}
		})
	}
}

// zzBackwardLab is TestZigzagHopperLab's zz-backward: every rank's dq, dk
// and dv against the whole sequence's (the production Hopper backward on
// one rank), from the tensor-core ring's lse and delta, then timed beside
// the whole-sequence backward and the tensor-core ring's (its dq and dk/dv
// passes; the lab's time leaves out delta, a rowsum pass over dout and
// out, which the tensor-core ring's dq pass makes on the way).
func zzBackwardLab(t *testing.T, b *Backend, kern func(dh int) *Kernel) {
	d := b.dev
	for i, s := range []backend.ZigzagShape{
		{Ranks: 2, Batch: 2, Chunk: 128, Heads: 8, KVHeads: 2, HeadDim: 128},
		{Ranks: 4, Batch: 1, Chunk: 256, Heads: 8, KVHeads: 2, HeadDim: 128},
		{Ranks: 8, Batch: 1, Chunk: 128, Heads: 4, KVHeads: 4, HeadDim: 128},
		{Ranks: 3, Batch: 2, Chunk: 384, Heads: 4, KVHeads: 1, HeadDim: 128},
		{Ranks: 2, Batch: 2, Chunk: 128, Heads: 8, KVHeads: 2, HeadDim: 64},
		{Ranks: 4, Batch: 1, Chunk: 256, Heads: 4, KVHeads: 4, HeadDim: 64},
	} {
		r := newZZRun(t, b, s, uint64(60+i))
		r.wholeForward()
		r.wholeBackward()
		r.ringForward()
		r.ringDelta()
		if err := r.labBackward(t, kern(s.HeadDim), newZZBF16(t, r)); err != nil {
			t.Fatal(err)
		}
		r.compareSome(t, "dq", "dk", "dv")
	}
	for _, c := range []struct{ w, perRank, dh int }{{2, 4096, 128}, {4, 4096, 128}, {8, 4096, 128}, {4, 8192, 128}, {8, 8192, 128}, {4, 4096, 64}} {
		s := backend.ZigzagShape{Ranks: c.w, Batch: 1, Chunk: c.perRank / 2, Heads: 16, KVHeads: 4, HeadDim: c.dh}
		r := newZZRun(t, b, s, 98)
		r.wholeForward()
		r.ringForward()
		r.ringDelta()
		in := newZZBF16(t, r)
		sync := func(f func()) func() error { return func() error { f(); return b.Sync() } }
		coreB := attnMedianMs(t, d, sync(r.wholeBackward))
		tcB := attnMedianMs(t, d, sync(r.ringBackward))
		labB := attnMedianMs(t, d, func() error {
			if err := r.labBackward(t, kern(s.HeadDim), in); err != nil {
				return err
			}
			return b.Sync()
		})
		r.compareSome(t, "dq", "dk", "dv")
		name := fmt.Sprintf("ring W%d S%d H16 KV4 Dh%d", c.w, s.Seq(), c.dh)
		flops := 2.5 * 4 * float64(s.Heads) * float64(s.Seq()) * float64(s.Seq()) * float64(s.HeadDim) / 2
		figure(t, name+" core bwd", coreB, "ms")
		figure(t, name+" tc ring bwd", tcB, "ms")
		figure(t, name+" zz-backward", labB, "ms")
		figure(t, name+" zz-backward rate", flops/labB/1e9, "TFLOP/s")
		figure(t, name+" zz-backward efficiency", coreB/labB, "x")
		figure(t, name+" tc ring bwd efficiency", coreB/tcB, "x")
	}
}
