package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/kernels"
)

// ggTNAdamWExtraSmem is what grouped_gemm_tn_adamw adds to
// grouped_gemm_tn's dynamic shared memory: its consumers' 256 float64
// sums of squares.
const ggTNAdamWExtraSmem = 256 * 8

// TestGroupedTNAdamWLab (MKTRAIN_GG_VARIANTS=tn-adamw) runs
// kernels/dev/grouped_gemm_lab.cu's grouped_gemm_tn_adamw, the weight
// gradients' product with the experts' AdamW in its epilogue, against
// what training runs: grouped_gemm_tn (beta 0) and then
// AdamWUpdateSplitSquares over its gradients. The split masters and the
// moments must come out bit for bit, the squares within float64
// rounding; on a small case with an empty expert and partial tiles, and
// on the fine-grained model's w1 shape (64 experts, ffn 1408, dim 2048,
// 8192 tokens of 6 experts each), where both are timed (figures
// "tn adamw fine <way>", ms). Run it on its own: a fault in a lab kernel
// leaves the CUDA context unusable for the tests after it.
func TestGroupedTNAdamWLab(t *testing.T) {
	testGroupedGemm(t)
	lab, vs := labVariants(t, "grouped_gemm_lab.cu", true)
	if len(vs) == 0 {
		t.Skipf("%s names no variant of grouped_gemm_lab.cu", labVariantsEnv)
	}
	b := testBackend(t)
	x, ok := b.expertKernels()
	if !ok {
		t.Fatalf("grouped GEMM kernels: %v", x.err)
	}
	gg := x.floatOut
	const name = "grouped_gemm_tn_adamw"
	src, _ := kernelSource(t, "grouped_gemm.cu")
	src.Kernels = append(slices.Clone(src.Kernels), kernels.Kernel{Name: name})
	for _, v := range vs {
		m, err := b.dev.load(src, lab.File+"+"+v.Name, lab.Text, v.Defines...)
		if err != nil {
			t.Fatal(err)
		}
		kern, err := gg.optIn(m, name, ggTNSmemBytes+ggTNAdamWExtraSmem)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s (%s): %d registers, %d bytes of local memory", name, v.Name, kern.Registers, kern.LocalBytes)
		figure(t, name+"_"+v.Name+"_local_bytes", float64(kern.LocalBytes), "B")
		for _, c := range []struct {
			name           string
			experts, m, n  int
			counts         []int // rows per expert; nil: tokens*topK spread at random
			tokens, topK   int
			timed, randomW bool
		}{
			{name: "small", experts: 5, m: 192, n: 320, counts: []int{70, 0, 130, 1, 64}, randomW: true},
			{name: "fine", experts: 64, m: 1408, n: 2048, tokens: 8192, topK: 6, timed: true},
		} {
			t.Run(v.Name+"/"+c.name, func(t *testing.T) {
				counts := c.counts
				rng := rand.New(rand.NewPCG(uint64(c.experts), 17))
				if counts == nil {
					counts = make([]int, c.experts)
					for range c.tokens * c.topK {
						counts[rng.IntN(c.experts)]++
					}
				}
				runTNAdamWCase(t, b, gg, kern, v.Name, rng, counts, c.m, c.n, c.randomW, c.timed)
			})
		}
	}
}

// runTNAdamWCase is one case of TestGroupedTNAdamWLab.
func runTNAdamWCase(t *testing.T, b *Backend, gg *GroupedGemm, kern *Kernel, variant string, rng *rand.Rand, counts []int, M, N int, randomW, timed bool) {
	E, rows := len(counts), 0
	offsets := []int32{0}
	for _, c := range counts {
		rows += c
		offsets = append(offsets, int32(rows))
	}
	randoms := func(n int, scale float64) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(rng.NormFloat64() * scale)
		}
		return x
	}
	aT, bT := b.New(backend.BFloat16, rows, M), b.New(backend.BFloat16, rows, N)
	backend.UploadSlice(b, aT, randoms(rows*M, 1e-2))
	backend.UploadSlice(b, bT, randoms(rows*N, 1))
	offT := b.New(backend.Int32, E+1)
	backend.UploadSlice(b, offT, offsets)

	ptr := func(t0 backend.Tensor) uint64 {
		p, ok := tensorOf("lab", "t", t0).ptr()
		if !ok {
			t.Fatal("a tensor has no memory")
		}
		return uint64(p)
	}
	// The state, twice: the reference's and the lab's.
	n := E * M * N
	type state struct{ hi, lo, m, v backend.Tensor }
	var w0, m0, v0 []float32
	if randomW {
		w0, m0, v0 = randoms(n, 0.02), randoms(n, 1e-4), randoms(n, 1e-3)
		for i := range v0 {
			v0[i] *= v0[i]
		}
	}
	newState := func() state {
		s := state{b.New(backend.BFloat16, n), b.New(backend.Int32, n/2), b.New(backend.Float32, n), b.New(backend.Float32, n)}
		if randomW {
			hi, lo := backend.SplitMasters(w0)
			backend.UploadSlice(b, s.hi, hi) // bf16 values already: no rounding
			backend.UploadSlice(b, s.lo, lo)
			backend.UploadSlice(b, s.m, m0)
			backend.UploadSlice(b, s.v, v0)
			return s
		}
		// Large: a weight of about 0.0078 in every master (both bf16
		// halves of each hi word), small moments (the values do not
		// change the work).
		fill := kernel(t, b.dev, "elementwise.cu", "fill_f32")
		for _, f := range []struct {
			t     backend.Tensor
			words int
			value float32
		}{{s.hi, n / 2, math.Float32frombits(0x3c003c00)}, {s.m, n, 1e-4}, {s.v, n, 1e-6}} {
			mustLaunch(t, b.dev, fill, b.dev.StrideGrid(int64(f.words), 256, strideBlocksPerSM), driver.DevicePtr(ptr(f.t)), f.value, int64(f.words))
		}
		return s
	}
	ref, got := newState(), newState()
	grad := b.New(backend.Float32, E, M, N)
	h := backend.AdamW{LR: 3e-4, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01, Step: 5}
	bc1, bc2, decay := adamWFactors("TN AdamW lab", h)
	tiles := ggTNTiles(M, N, E)
	blocks := int(min(int64(b.dev.info.SMs), tiles))
	sqBuf, err := b.dev.Alloc(int64(8 * blocks))
	if err != nil {
		t.Fatal(err)
	}
	defer b.dev.Free(sqBuf)
	// The product on grouped_gemm_tn itself (GroupedMatMulTN hands small
	// ones to cuBLASLt, which adds in another order).
	unfused := func(s state) func() float64 {
		if err := gg.RunTN(driver.DevicePtr(ptr(grad)), driver.DevicePtr(ptr(aT)), driver.DevicePtr(ptr(bT)), driver.DevicePtr(ptr(offT)), rows, M, N, E, 1, 0); err != nil {
			t.Fatal(err)
		}
		return b.AdamWUpdateSplitSquares(s.hi, s.lo, grad, s.m, s.v, h)
	}
	fused := func(s state) error {
		extra := []uint64{ptr(s.hi), ptr(s.lo), ptr(s.m), ptr(s.v), math.Float64bits(h.LR), math.Float64bits(h.Beta1),
			math.Float64bits(h.Beta2), math.Float64bits(h.Eps), math.Float64bits(decay), math.Float64bits(bc1),
			math.Float64bits(bc2), uint64(sqBuf.Ptr())}
		return gg.runTN(kern, ggTNSmemBytes+ggTNAdamWExtraSmem, driver.DevicePtr(ptr(grad)), driver.DevicePtr(ptr(aT)),
			driver.DevicePtr(ptr(bT)), driver.DevicePtr(ptr(offT)), rows, M, N, E, 1, 0, extra...)
	}
	want := unfused(ref)()
	if err := fused(got); err != nil {
		t.Fatal(err)
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	sums := make([]float64, blocks)
	if err := b.dev.CopyFromDevice(Bytes(sums), sqBuf, 0); err != nil {
		t.Fatal(err)
	}
	squares := 0.0
	for _, s := range sums {
		squares += s
	}
	for _, pair := range []struct {
		what      string
		want, got backend.Tensor
	}{{"hi", ref.hi, got.hi}, {"m", ref.m, got.m}, {"v", ref.v, got.v}} {
		sameUpdate(t, backend.DownloadFloat32(b, pair.want), backend.DownloadFloat32(b, pair.got))
	}
	if lw, lg := backend.DownloadInt32(b, ref.lo), backend.DownloadInt32(b, got.lo); !slices.Equal(lw, lg) {
		t.Errorf("the masters' low halves differ from the product then AdamWUpdateSplit's")
	}
	if !(math.Abs(squares-want) <= 1e-10*want) {
		t.Errorf("the squares came to %v, AdamWUpdateSplitSquares' to %v", squares, want)
	}
	if timed {
		ms := eventMS(t, b.dev, 5, func() error { unfused(ref)(); return nil })
		figure(t, "tn adamw fine unfused (product, then AdamWUpdateSplitSquares)", ms, "ms")
		ms = eventMS(t, b.dev, 5, func() error { return fused(got) })
		figure(t, fmt.Sprintf("tn adamw fine fused %s (%d registers)", variant, kern.Registers), ms, "ms")
	}
	runtime.KeepAlive([]backend.Tensor{aT, bT, offT, grad, ref.hi, ref.lo, ref.m, ref.v, got.hi, got.lo, got.m, got.v})
}
