package cuda

// The fused ring's forward on the Hopper core (kernels/dev/
// attention_hopper_lab.cu's zz-forward, attn_h_zz_forward_d{64,128}):
// every rank's rows against the whole sequence's, computed by the
// production Hopper forward on one rank, then timed beside that call and
// beside the fused ring's tensor-core kernels (attention_tc.cu's
// attn_zz_forward, what mode ring runs today) on the same virtual ranks.

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
var zigzagLabs = map[string]bool{"zz-forward": true}

// zzLabMaxRanks is the ranks attn_h_zz_forward takes (AH_ZZ_MAX).
const zzLabMaxRanks = 8

// launchZZForwardLab queues attn_h_zz_forward for rank s.Rank: q its bf16
// rows, ks and vs every rank's bf16 k and v, out and lse float32. The
// kernel's first parameter is ah_zz_maps, q's tensor map and then
// zzLabMaxRanks maps each of k and v (the entries past W repeat the last
// rank's), passed as one block of encoded maps.
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
	for i, m := range maps {
		if err := m.Check(); err != nil {
			return fmt.Errorf("tensor map %d: %w", i, err)
		}
	}
	enc, err := d.TensorMapEncoder()
	if err != nil {
		return err
	}
	_, scaleLog2 := attnScales(s.HeadDim)
	slots := []uint64{uint64(out), uint64(lse), uint64(uint32(s.Rank)), uint64(uint32(s.Ranks)), uint64(uint32(s.Chunk)),
		uint64(uint32(s.Heads)), uint64(uint32(s.KVHeads)), uint64(math.Float32bits(scaleLog2))}
	grid := Grid{
		Grid:   driver.Dim3{X: s.Batch * s.Heads, Y: 2 * s.Chunk / hopperAttnBM, Z: 1},
		Block:  driver.Dim3{X: 384, Y: 1, Z: 1},
		Shared: hopperAttnSmem(s.HeadDim),
	}
	return d.Submit(func() error {
		if kern.sharedOptIn < grid.Shared {
			if err := d.drv.FuncSetAttribute(kern.fn, driver.FuncMaxDynamicSharedSizeOpt, grid.Shared); err != nil {
				return err
			}
			kern.sharedOptIn = grid.Shared
		}
		tms := make([]driver.TensorMap, len(maps)) // one block: ah_zz_maps
		for i, m := range maps {
			if err := enc.EncodeTiled(&tms[i], m); err != nil {
				return fmt.Errorf("tensor map %d: %w", i, err)
			}
		}
		params := []unsafe.Pointer{unsafe.Pointer(&tms[0])}
		for i := range slots {
			params = append(params, unsafe.Pointer(&slots[i]))
		}
		var pin runtime.Pinner
		defer pin.Unpin()
		pin.Pin(&tms[0])
		pin.Pin(&slots[0])
		pin.Pin(&params[0])
		return d.drv.LaunchKernel(kern.fn, grid.Grid, grid.Block, grid.Shared, d.stream, params)
	})
}

// zzBF16 is every rank's q, k and v of a zzRun rounded to bf16, in
// buffers of their own.
type zzBF16 struct{ q, k, v []driver.DevicePtr }

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
			src, _ := kernelSource(t, "attention_hopper.cu")
			src.Kernels = append(slices.Clone(src.Kernels), kernels.Kernel{Name: "attn_h_zz_forward_d64"}, kernels.Kernel{Name: "attn_h_zz_forward_d128"})
			m, err := d.load(src, lab.File+"+"+v.Name, lab.Text, v.Defines...)
			if err != nil {
				t.Fatal(err)
			}
			kerns := map[int]*Kernel{}
			for _, dh := range []int{64, 128} {
				if kerns[dh], err = m.Kernel(fmt.Sprintf("attn_h_zz_forward_d%d", dh)); err != nil {
					t.Fatal(err)
				}
				t.Logf("attn_h_zz_forward_d%d: %d registers, %d bytes of local memory", dh, kerns[dh].Registers, kerns[dh].LocalBytes)
			}
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
				if err := r.labForward(t, kerns[s.HeadDim], newZZBF16(t, r)); err != nil {
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
					if err := r.labForward(t, kerns[s.HeadDim], in); err != nil {
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
