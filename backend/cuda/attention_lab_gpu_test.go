package cuda

// The experiments on the Hopper attention kernels (kernels/dev/
// attention_hopper_lab.cu) on the GPU: each variant MKTRAIN_GG_VARIANTS
// names is loaded in place of attention_hopper.cu, checked against the
// CPU reference on shapes of TestAttentionKernels (exact variants) and
// timed beside the production kernels' figures.

import (
	"fmt"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/kernels/dev"
)

// withAttentionLab makes d's calls of attention_hopper.cu's kernels run
// lab's variant v until the returned restore is called.
func withAttentionLab(t *testing.T, d *Device, lab dev.Source, v dev.Variant) (restore func()) {
	t.Helper()
	src, _ := kernelSource(t, "attention_hopper.cu")
	m, err := d.load(src, lab.File+"+"+v.Name, lab.Text, v.Defines...)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"attn_h_forward_d64", "attn_h_forward_d128", "attn_h_backward_d64", "attn_h_backward_d128"} {
		k, err := m.Kernel(name)
		if err != nil {
			t.Fatal(err)
		}
		figure(t, fmt.Sprintf("%s_%s_registers", name, strings.ReplaceAll(v.Name, "-", "_")), float64(k.Registers), "")
		figure(t, fmt.Sprintf("%s_%s_local_bytes", name, strings.ReplaceAll(v.Name, "-", "_")), float64(k.LocalBytes), "B")
	}
	d.modMu.Lock()
	prod, had := d.modules[src.File]
	d.modules[src.File] = m
	d.modMu.Unlock()
	return func() {
		d.modMu.Lock()
		defer d.modMu.Unlock()
		if had {
			d.modules[src.File] = prod
		} else {
			delete(d.modules, src.File)
		}
	}
}

func TestAttentionLabVariants(t *testing.T) {
	d := testDevice(t)
	lab, vs := labVariants(t, "attention_hopper_lab.cu", false)
	if len(vs) == 0 {
		t.Skipf("%s names no variant of %s", labVariantsEnv, lab.File)
	}
	if !hopperAttnTakes(d, backend.AttnShape{HeadDim: 128}) {
		t.Skipf("the Hopper attention kernels do not run on %s", d.info.Name)
	}
	checked := []backend.AttnShape{
		{Batch: 2, Seq: 129, Heads: 6, KVHeads: 6, HeadDim: 128},
		{Batch: 1, Seq: 70, Heads: 3, KVHeads: 1, HeadDim: 128},
		{Batch: 1, Seq: 128, Heads: 2, KVHeads: 1, HeadDim: 128, KVSeq: 512, QOffset: 384},
		{Batch: 2, Seq: 260, Heads: 4, KVHeads: 1, HeadDim: 128, KVSeq: 333, Full: true},
		{Batch: 2, Seq: 300, Heads: 4, KVHeads: 2, HeadDim: 128, KVSeq: 700, QOffset: 333},
		{Batch: 1, Seq: 300, Heads: 8, KVHeads: 2, HeadDim: 64},
		{Batch: 2, Seq: 100, Heads: 4, KVHeads: 2, HeadDim: 64, KVSeq: 300, QOffset: 150},
		{Batch: 2, Seq: 100, Heads: 4, KVHeads: 2, HeadDim: 64, KVSeq: 200, Full: true},
		{Batch: 1, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 64},
	}
	timed := []backend.AttnShape{
		{Batch: 8, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 64},
		{Batch: 4, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 128},
		{Batch: 2, Seq: 8192, Heads: 16, KVHeads: 16, HeadDim: 128},
	}
	for _, v := range vs {
		t.Run(v.Name, func(t *testing.T) {
			defer withAttentionLab(t, d, lab, v)()
			if v.Exact {
				for n, s := range checked {
					t.Run(fmt.Sprintf("B%d_S%d_H%d_KV%d_Dh%d_KVS%d_Off%d", s.Batch, s.Seq, s.Heads, s.KVHeads, s.HeadDim, s.Keys(), s.QOffset), func(t *testing.T) {
						checkAttention(newKT(t, uint64(60+n)), s, attnHopper)
					})
				}
			}
			k := newKT(t, 70)
			for _, s := range timed {
				timeAttention(k, "attention hopper "+v.Name, s, attnHopper)
			}
		})
	}
}
