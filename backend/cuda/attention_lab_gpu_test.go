package cuda

// The experiments on the Hopper attention kernels (kernels/dev/
// attention_hopper_lab.cu) on the GPU: each variant MKTRAIN_GG_VARIANTS
// names is loaded in place of attention_hopper.cu, checked against the
// CPU reference on shapes of TestAttentionKernels (exact variants) and
// timed beside the production kernels' figures.

import (
	"fmt"
	"math"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/kernels"
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
	logCompiler(t, v, m)
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

// ownLaunch describes the variants whose kernels launch otherwise than
// the production ones (other kernels, block sizes, shared memory or
// arguments): TestAttentionLabOwnLaunch runs them, not in place of the
// production kernels.
var ownLaunch = map[string]labBackwardLaunch{}

// ownForwardLaunch names the variants that add forward kernels of their
// own: TestAttentionLabForwardOwnLaunch runs them.
var ownForwardLaunch = map[string]labForwardLaunch{}

// labForwardLaunch is how a lab build's forward kernels launch:
// production's arguments, grid, block and q map (hopperAttnConsumers'
// warpgroups), with extraSmem(dh) bytes of shared memory more.
type labForwardLaunch struct {
	headDims  []int
	kernel    string // the kernel's name, %d the head dim
	extraSmem func(dh int) int
	// ringKernel, where set, is the variant's build of the ring's forward
	// (attn_h_zz_forward's arguments and launch, extraSmem more bytes),
	// which TestAttentionLabForwardOwnLaunch runs beside the production
	// ring too.
	ringKernel string
}

// ownsLaunch says whether variant v launches kernels of its own.
func ownsLaunch(v dev.Variant) bool {
	_, bwd := ownLaunch[v.Name]
	_, fwd := ownForwardLaunch[v.Name]
	return bwd || fwd
}

// labBackwardLaunch is how a lab build's backward kernels launch.
type labBackwardLaunch struct {
	headDims []int
	kernel   string // the kernel's name, %d the head dim
	launch   func(dh int) (threads, smem int)
}

func TestAttentionLabVariants(t *testing.T) {
	d := testDevice(t)
	lab, vs := labVariants(t, "attention_hopper_lab.cu", false)
	vs = slices.DeleteFunc(vs, ownsLaunch)
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
		{Batch: 1, Seq: 32768, Heads: 32, KVHeads: 8, HeadDim: 128},
	}
	labRingFigures(t, "production", true)
	// Production's ring again after the variants: how far the same build
	// drifts within the process (the power cap), against which a
	// variant's difference is read.
	defer labRingFigures(t, "production-after", true)
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
			labRingFigures(t, v.Name, v.Exact)
		})
	}
}

// labRingFigures times the one-pass ring (forward, backward) on the rows
// of bench attention's ring table at S/W 4096 (H16 KV4 Dh128, W 2, 4, 8
// virtual ranks) and at W 4 S/W 8192 (the row whose backward fell
// furthest behind the core's at ca3eff4) beside the whole-sequence core,
// with the attention module the device holds (production's, or a lab
// variant's in place), and checks the ring's outputs against the core's
// where exact: figures "attention hopper ring <name> W<w> ...",
// efficiency = core time / ring time as bench attention computes it.
func labRingFigures(t *testing.T, name string, exact bool) {
	b := testBackend(t)
	d := b.dev
	sync := func(f func()) func() error { return func() error { f(); return b.Sync() } }
	for _, row := range []struct{ w, chunk int }{{2, 2048}, {4, 2048}, {8, 2048}, {4, 4096}} {
		w := row.w
		s := backend.ZigzagShape{Ranks: w, Batch: 1, Chunk: row.chunk, Heads: 16, KVHeads: 4, HeadDim: 128}
		if err := b.ZigzagAttentionOnePass(s); err != nil {
			t.Logf("the one-pass fused ring does not run here: %v", err)
			return
		}
		r := newZZRun(t, b, s, uint64(180+w))
		o := newZZOnePass(r)
		coreF := attnMedianMs(t, d, sync(r.wholeForward))
		coreB := attnMedianMs(t, d, sync(r.wholeBackward))
		ringF := attnMedianMs(t, d, sync(o.forward))
		ringB := attnMedianMs(t, d, sync(o.backward))
		if exact {
			r.compareSome(t, "out", "lse", "dq", "dk", "dv")
		}
		fig := fmt.Sprintf("attention hopper ring %s W%d S%d", name, w, s.Seq())
		figure(t, fig+" bwd", ringB, "ms")
		figure(t, fig+" bwd over core", ringB/coreB, "x")
		figure(t, fig+" efficiency fwd", coreF/ringF, "x")
		figure(t, fig+" efficiency fwd+bwd", (coreF+coreB)/(ringF+ringB), "x")
	}
}

// ownLaunchVariants is the attention lab and its named exact variants
// that own selects; the test is skipped when there are none (saying the
// variant it wanted: one that what) or the Hopper kernels do not run on d.
func ownLaunchVariants(t *testing.T, d *Device, own func(name string) bool, what string) (dev.Source, []dev.Variant) {
	t.Helper()
	lab, vs := labVariants(t, "attention_hopper_lab.cu", true)
	vs = slices.DeleteFunc(vs, func(v dev.Variant) bool { return !own(v.Name) })
	if len(vs) == 0 {
		t.Skipf("%s names no variant of %s that %s", labVariantsEnv, lab.File, what)
	}
	if !hopperAttnTakes(d, backend.AttnShape{HeadDim: 64}) {
		t.Skipf("the Hopper attention kernels do not run on %s", d.info.Name)
	}
	return lab, vs
}

// TestAttentionLabOwnLaunch runs each named variant of ownLaunch against
// the CPU reference, twice on each shape (a second call must find its
// state reset: dq zeroed, barriers fresh), then times it beside the production
// backward at moe-small's shape (and at head dim 128 where it has one).
func TestAttentionLabOwnLaunch(t *testing.T) {
	d := testDevice(t)
	lab, vs := ownLaunchVariants(t, d, func(name string) bool { _, own := ownLaunch[name]; return own }, "launches on its own")
	for _, v := range vs {
		t.Run(v.Name, func(t *testing.T) { runOwnLaunch(t, d, lab, v, ownLaunch[v.Name]) })
	}
}

// logCompiler logs what NVRTC said compiling variant v into m, such as
// ptxas's advice that it serialised wgmma instructions (empty on a cache
// hit).
func logCompiler(t *testing.T, v dev.Variant, m *Module) {
	t.Helper()
	if m.Info.Log != "" {
		t.Logf("%s: NVRTC's log:\n%s", v.Name, m.Info.Log)
	}
}

// labKernels loads variant v of lab with the production kernels and
// kernel (%d: each head dim of headDims), which the variant adds or
// replaces, and returns those by head dim, logging their registers and
// local memory. also names more kernels the variant adds, loaded with
// them: a variant's module is built once, at its first call.
func labKernels(t *testing.T, d *Device, lab dev.Source, v dev.Variant, kernel string, headDims []int, also ...string) map[int]*Kernel {
	t.Helper()
	src, _ := kernelSource(t, "attention_hopper.cu")
	src.Kernels = slices.Clone(src.Kernels)
	for _, pattern := range append([]string{kernel}, also...) {
		for _, dh := range headDims {
			name := fmt.Sprintf(pattern, dh)
			if !slices.ContainsFunc(src.Kernels, func(k kernels.Kernel) bool { return k.Name == name }) {
				src.Kernels = append(src.Kernels, kernels.Kernel{Name: name})
			}
		}
	}
	m, err := d.load(src, lab.File+"+"+v.Name, lab.Text, v.Defines...)
	if err != nil {
		t.Fatal(err)
	}
	logCompiler(t, v, m)
	kerns := map[int]*Kernel{}
	for _, dh := range headDims {
		kern, err := m.Kernel(fmt.Sprintf(kernel, dh))
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s (%s): %d registers, %d bytes of local memory", kern.Desc.Name, v.Name, kern.Registers, kern.LocalBytes)
		kerns[dh] = kern
	}
	return kerns
}

func runOwnLaunch(t *testing.T, d *Device, lab dev.Source, v dev.Variant, how labBackwardLaunch) {
	// (launchHopperAttnBackward refuses a kernel of a producer warpgroup
	// whose register count at entry is not what its setmaxnreg counts
	// assume: it would hang.)
	kerns := labKernels(t, d, lab, v, how.kernel, how.headDims)
	labBackward := func(dq, dk, dv, dout, q, kk, v, out, lse *Buffer, s backend.AttnShape) error {
		threads, smem := how.launch(s.HeadDim)
		return launchHopperAttnBackward(d, kerns[s.HeadDim], threads, smem, dq.Ptr(), dk.Ptr(), dv.Ptr(), dout.Ptr(),
			q.Ptr(), kk.Ptr(), v.Ptr(), out.Ptr(), lse.Ptr(), s, attnBwdInputs{}, 0)
	}
	shapes := []backend.AttnShape{
		{Batch: 2, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 64},
		{Batch: 1, Seq: 300, Heads: 8, KVHeads: 2, HeadDim: 64},
		{Batch: 2, Seq: 100, Heads: 4, KVHeads: 2, HeadDim: 64, KVSeq: 300, QOffset: 150},
		{Batch: 2, Seq: 100, Heads: 4, KVHeads: 2, HeadDim: 64, KVSeq: 200, Full: true},
		{Batch: 1, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 64},
		{Batch: 2, Seq: 129, Heads: 6, KVHeads: 6, HeadDim: 128},
		{Batch: 2, Seq: 300, Heads: 4, KVHeads: 2, HeadDim: 128, KVSeq: 700, QOffset: 333},
	}
	for n, s := range shapes {
		if kerns[s.HeadDim] == nil {
			continue
		}
		t.Run(fmt.Sprintf("B%d_S%d_H%d_KV%d_Dh%d_KVS%d_Off%d", s.Batch, s.Seq, s.Heads, s.KVHeads, s.HeadDim, s.Keys(), s.QOffset), func(t *testing.T) {
			k := newKT(t, uint64(80+n))
			T, TK, H, KV, Dh := s.Batch*s.Seq, s.Batch*s.Keys(), s.Heads, s.KVHeads, s.HeadDim
			nq, nk, nl := T*H*Dh, TK*KV*Dh, s.Batch*H*s.Seq
			q, kk, v, dout := k.randn(nq, 1.5), k.randn(nk, 1.5), k.randn(nk, 1), k.randn(nq, 1)
			bq, bk, bv, bdout := upload(k, q), upload(k, kk), upload(k, v), upload(k, dout)
			out, lse := k.poisoned(nq), k.poisoned(nl)
			if err := attentionForward(d, out.Ptr(), lse.Ptr(), bq.Ptr(), bk.Ptr(), bv.Ptr(), s, attnHopper); err != nil {
				t.Fatal(err)
			}
			gotOut, gotLse := k.download(out, nq), k.download(lse, nl)
			rdq, rdk, rdv := k.ref.New(backend.Float64, T, H*Dh), k.ref.New(backend.Float64, TK, KV*Dh), k.ref.New(backend.Float64, TK, KV*Dh)
			k.ref.AttentionBackward(rdq, rdk, rdv, k.cpuF(dout, T, H*Dh), k.cpuF(q, T, H*Dh), k.cpuF(kk, TK, KV*Dh), k.cpuF(v, TK, KV*Dh),
				k.cpuF(gotOut, T, H*Dh), k.cpuF(gotLse, nl), s)
			gq, gk, gv := k.poisoned(nq), k.poisoned(nk), k.poisoned(nk)
			for range 2 {
				if err := labBackward(gq, gk, gv, bdout, bq, bk, bv, out, lse, s); err != nil {
					t.Fatal(err)
				}
				gotQ, gotK, gotV := k.download(gq, nq), k.download(gk, nk), k.download(gv, nk)
				if s.Seq > 1 {
					k.check("dq", gotQ, k.get(rdq), attnBF16Tol)
					k.check("dk", gotK, k.get(rdk), attnBF16Tol)
				}
				k.check("dv", gotV, k.get(rdv), attnBF16Tol)
			}
		})
	}
	// The variant and the production backward on the same inputs, in this run.
	for _, s := range []backend.AttnShape{
		{Batch: 8, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 64},
		{Batch: 4, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 128},
		{Batch: 2, Seq: 8192, Heads: 16, KVHeads: 16, HeadDim: 128},
		{Batch: 1, Seq: 32768, Heads: 32, KVHeads: 8, HeadDim: 128},
	} {
		if kerns[s.HeadDim] == nil {
			continue
		}
		k := newKT(t, 90)
		T, H, KV, Dh := s.Batch*s.Seq, s.Heads, s.KVHeads, s.HeadDim
		nq, nk, nl := T*H*Dh, T*KV*Dh, s.Batch*H*s.Seq
		bq, bk, bv, bdout := upload(k, k.randn(nq, 1)), upload(k, k.randn(nk, 1)), upload(k, k.randn(nk, 1)), upload(k, k.randn(nq, 1))
		out, lse := k.poisoned(nq), k.poisoned(nl)
		gq, gk, gv := k.poisoned(nq), k.poisoned(nk), k.poisoned(nk)
		if err := attentionForward(d, out.Ptr(), lse.Ptr(), bq.Ptr(), bk.Ptr(), bv.Ptr(), s, attnHopper); err != nil {
			t.Fatal(err)
		}
		flops := 2.5 * 4 * float64(s.Batch*H) * float64(s.Seq) * float64(s.Seq) * float64(Dh) / 2
		prodMs := attnMedianMs(t, d, func() error {
			return attentionBackward(d, gq.Ptr(), gk.Ptr(), gv.Ptr(), bdout.Ptr(), bq.Ptr(), bk.Ptr(), bv.Ptr(), out.Ptr(), lse.Ptr(), s, attnHopper)
		})
		labMs := attnMedianMs(t, d, func() error { return labBackward(gq, gk, gv, bdout, bq, bk, bv, out, lse, s) })
		name := fmt.Sprintf("B%d S%d H%d KV%d Dh%d", s.Batch, s.Seq, H, KV, Dh)
		figure(t, "attention hopper bwd "+name+" rate", flops/prodMs/1e9, "TFLOP/s")
		figure(t, "attention hopper "+v.Name+" bwd "+name+" rate", flops/labMs/1e9, "TFLOP/s")
	}
}

// TestAttentionLabForwardOwnLaunch runs each named variant of
// ownForwardLaunch beside the production forward on bf16 q, k and v: the
// same out and lse bits on shapes with tails, offsets, GQA and no mask
// (the variants promise production's arithmetic in production's order),
// then both timed at moe-small's shape and three more.
func TestAttentionLabForwardOwnLaunch(t *testing.T) {
	d := testDevice(t)
	lab, vs := ownLaunchVariants(t, d, func(name string) bool { _, own := ownForwardLaunch[name]; return own }, "adds forward kernels")
	for _, v := range vs {
		t.Run(v.Name, func(t *testing.T) {
			how := ownForwardLaunch[v.Name]
			var ring []string // (the module loads once: every kernel the variant adds at the first call)
			if how.ringKernel != "" {
				ring = append(ring, how.ringKernel)
			}
			kerns := labKernels(t, d, lab, v, how.kernel, how.headDims, ring...)
			// (hopperAttnForwardArgs refuses a kernel whose register count
			// at entry is not what its setmaxnreg counts assume: it would
			// hang.)
			labForward := func(out, lse, q, kk, vv *Buffer, s backend.AttnShape) error {
				kern := kerns[s.HeadDim]
				grid, maps, slots, err := hopperAttnForwardArgs(kern, how.extraSmem(s.HeadDim), d.info.SMs, out.Ptr(), lse.Ptr(), q.Ptr(),
					kk.Ptr(), vv.Ptr(), s, 0)
				if err != nil {
					return err
				}
				return launchWithMaps(d, "AttentionForward", kern, grid, maps, slots)
			}
			checked := []backend.AttnShape{
				{Batch: 2, Seq: 5, Heads: 4, KVHeads: 2, HeadDim: 64},
				{Batch: 1, Seq: 300, Heads: 8, KVHeads: 2, HeadDim: 64},
				{Batch: 2, Seq: 100, Heads: 4, KVHeads: 2, HeadDim: 64, KVSeq: 300, QOffset: 150},
				{Batch: 2, Seq: 100, Heads: 4, KVHeads: 2, HeadDim: 64, KVSeq: 200, Full: true},
				{Batch: 1, Seq: 1000, Heads: 4, KVHeads: 1, HeadDim: 64},
				{Batch: 2, Seq: 129, Heads: 6, KVHeads: 6, HeadDim: 128},
				{Batch: 2, Seq: 300, Heads: 4, KVHeads: 2, HeadDim: 128, KVSeq: 700, QOffset: 333},
				{Batch: 2, Seq: 260, Heads: 4, KVHeads: 1, HeadDim: 128, KVSeq: 333, Full: true},
			}
			timed := []backend.AttnShape{
				{Batch: 8, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 64},
				{Batch: 4, Seq: 4096, Heads: 16, KVHeads: 4, HeadDim: 64},
				{Batch: 4, Seq: 2048, Heads: 16, KVHeads: 4, HeadDim: 128},
				{Batch: 2, Seq: 8192, Heads: 16, KVHeads: 16, HeadDim: 128},
			}
			for n, s := range append(checked, timed...) {
				if kerns[s.HeadDim] == nil {
					continue
				}
				t.Run(fmt.Sprintf("B%d_S%d_H%d_KV%d_Dh%d_KVS%d_Off%d", s.Batch, s.Seq, s.Heads, s.KVHeads, s.HeadDim, s.Keys(), s.QOffset), func(t *testing.T) {
					k := newKT(t, uint64(120+n))
					T, TK, H, KV, Dh := s.Batch*s.Seq, s.Batch*s.Keys(), s.Heads, s.KVHeads, s.HeadDim
					nq, nk, nl := T*H*Dh, TK*KV*Dh, s.Batch*H*s.Seq
					q, kk, vv := k.buf(k.randn(nq, 1.5), true), k.buf(k.randn(nk, 1.5), true), k.buf(k.randn(nk, 1), true)
					prodOut, prodLse, labOut, labLse := k.poisoned(nq), k.poisoned(nl), k.poisoned(nq), k.poisoned(nl)
					prod := func() error {
						return launchHopperAttnForward(d, prodOut.Ptr(), prodLse.Ptr(), q.Ptr(), kk.Ptr(), vv.Ptr(), s, false, 0)
					}
					labCall := func() error { return labForward(labOut, labLse, q, kk, vv, s) }
					if err := prod(); err != nil {
						t.Fatal(err)
					}
					if err := labCall(); err != nil {
						t.Fatal(err)
					}
					for _, c := range []struct {
						name      string
						got, want *Buffer
						n         int
					}{{"out", labOut, prodOut, nq}, {"lse", labLse, prodLse, nl}} {
						got, want := k.download(c.got, c.n), k.download(c.want, c.n)
						if i := slices.IndexFunc(got, func(x float32) bool { return math.IsNaN(float64(x)) }); i >= 0 {
							t.Fatalf("%s[%d] is NaN: an element no block wrote", c.name, i)
						}
						if !slices.Equal(got, want) {
							t.Errorf("%s differs from the production forward's", c.name)
						}
					}
					if n < len(checked) || t.Failed() {
						return
					}
					flops := 4 * float64(s.Batch*H*Dh) * float64(s.Seq) * float64(s.Keys()) / 2
					name := fmt.Sprintf("attention hopper %s fwd B%d S%d H%d KV%d Dh%d", v.Name, s.Batch, s.Seq, H, KV, Dh)
					prodMs, labMs := attnMedianMs(t, d, prod), attnMedianMs(t, d, labCall)
					figure(t, name+" production rate", flops/prodMs/1e9, "TFLOP/s")
					figure(t, name+" rate", flops/labMs/1e9, "TFLOP/s")
					figure(t, name+" over production", prodMs/labMs, "x")
				})
			}
			if how.ringKernel != "" {
				ringKerns := labKernels(t, d, lab, v, how.ringKernel, how.headDims, how.kernel)
				t.Run("ring", func(t *testing.T) { labRingForward(t, v, ringKerns, how.extraSmem) })
			}
		})
	}
}

// labRingForward runs a lab build of the ring's forward (kerns, by head
// dim, launched as attn_h_zz_forward with extraSmem(dh) bytes of shared
// memory more; launchMapBlockKernel refuses a register count at entry its
// setmaxnreg counts do not assume) on every rank
// of zigzag problems beside the production kernel: the same out and lse
// bits on every rank, then both rings timed at the ring bar's rows
// against the whole-sequence core (efficiency = core time / ring time, as
// bench attention).
func labRingForward(t *testing.T, v dev.Variant, kerns map[int]*Kernel, extraSmem func(dh int) int) {
	b := testBackend(t)
	d := b.dev
	for n, c := range []struct {
		w     int
		s     backend.ZigzagShape
		timed bool
	}{
		{2, backend.ZigzagShape{Batch: 2, Chunk: 256, Heads: 4, KVHeads: 2, HeadDim: 64}, false},
		{4, backend.ZigzagShape{Batch: 1, Chunk: 128, Heads: 4, KVHeads: 1, HeadDim: 128}, false},
		{2, backend.ZigzagShape{Batch: 1, Chunk: 2048, Heads: 16, KVHeads: 4, HeadDim: 128}, true},
		{4, backend.ZigzagShape{Batch: 1, Chunk: 4096, Heads: 16, KVHeads: 4, HeadDim: 128}, true},
		{8, backend.ZigzagShape{Batch: 1, Chunk: 2048, Heads: 16, KVHeads: 4, HeadDim: 128}, true},
	} {
		s := c.s
		s.Ranks = c.w
		if kerns[s.HeadDim] == nil {
			continue
		}
		t.Run(fmt.Sprintf("W%d_B%d_S%d_H%d_KV%d_Dh%d", c.w, s.Batch, s.Seq(), s.Heads, s.KVHeads, s.HeadDim), func(t *testing.T) {
			if err := b.ZigzagAttentionOnePass(s); err != nil {
				t.Skipf("the one-pass fused ring does not run here: %v", err)
			}
			r := newZZRun(t, b, s, uint64(140+n))
			o := newZZOnePass(r)
			o.forward() // production's out and lse on every rank, and the bf16 copies
			want := make([][2][]float32, c.w)
			for i := range c.w {
				want[i] = [2][]float32{backend.DownloadFloat32(b, r.lout[i]), backend.DownloadFloat32(b, r.llse[i])}
			}
			labRing := func() error {
				for i := range c.w {
					const op = "ZigzagAttentionForward"
					grid, maps, slots, keep := b.zigzagForwardArgs(op, r.lout[i], r.llse[i], o.q[i], o.k, o.v, r.rank(i), 0)
					grid.Shared += extraSmem(s.HeadDim)
					if err := b.launchMapBlockKernel(op, kerns[s.HeadDim], grid, maps, nil, slots); err != nil {
						return err
					}
					runtime.KeepAlive(keep)
				}
				return b.Sync()
			}
			for i := range c.w {
				b.Zero(r.lout[i])
				b.Zero(r.llse[i])
			}
			if err := labRing(); err != nil {
				t.Fatal(err)
			}
			for i := range c.w {
				for j, name := range []string{"out", "lse"} {
					got := backend.DownloadFloat32(b, []backend.Tensor{r.lout[i], r.llse[i]}[j])
					if !slices.Equal(got, want[i][j]) {
						t.Errorf("rank %d: %s differs from the production ring's", i, name)
					}
				}
			}
			if !c.timed || t.Failed() {
				return
			}
			sync := func(f func()) func() error { return func() error { f(); return b.Sync() } }
			coreMs := attnMedianMs(t, d, sync(r.wholeForward))
			prodMs := attnMedianMs(t, d, sync(o.forward))
			labMs := attnMedianMs(t, d, func() error {
				for i := range c.w { // the bf16 rounding o.forward does, so both rings time the same work
					b.Copy(o.q[i], r.lq[i])
					b.Copy(o.k[i], r.lk[i])
					b.Copy(o.v[i], r.lv[i])
				}
				return labRing()
			})
			name := fmt.Sprintf("attention hopper %s ring W%d S/W %d", v.Name, c.w, 2*s.Chunk)
			figure(t, name+" production efficiency fwd", coreMs/prodMs, "x")
			figure(t, name+" efficiency fwd", coreMs/labMs, "x")
			figure(t, name+" over production", prodMs/labMs, "x")
		})
	}
}
