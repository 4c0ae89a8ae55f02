package cuda

// The weight-gradient kernel (GroupedGemm.RunTN, grouped_gemm_tn) on the
// GPU against a float64 reference on fresh random bf16 inputs: ragged
// experts whose rows are not a multiple of the 64-row k-block (the
// kernel zeroes the next expert's rows), empty experts under beta 0, 1
// and others, m and n that are not multiples of the tile, rows before
// the first expert, and every output element checked.
// TestGroupedGemmTNFigures times it against the cuBLASLt loop on
// moe-small's and the fine-grained shape's weight gradients, overwriting
// (beta 0) and accumulating (beta 1, as in training).

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// ggTNCase is one RunTN call to check: counts are the experts' rows,
// after start rows no expert owns.
type ggTNCase struct {
	name        string
	start       int
	counts      []int
	m, n        int
	alpha, beta float32
}

func TestGroupedGemmTN(t *testing.T) {
	g := testGroupedGemm(t)
	for _, c := range []ggTNCase{
		{"ragged", 0, []int{100, 0, 257, 64, 1, 130}, 136, 264, 1, 1},
		{"all-to-one-beta0", 0, []int{0, 0, 0, 700, 0, 0, 0, 0}, 256, 512, 1, 0},
		{"scaled-empty", 0, []int{0, 33, 0}, 64, 8, 0.5, -2},
		{"single-rows", 0, []int{1, 1, 1}, 128, 256, 1, 1},
		{"offset-start", 5, []int{63, 65, 128}, 200, 72, -1, 0.25},
		{"wide", 0, []int{1500, 700, 0, 800}, 512, 704, 1, 1},
	} {
		t.Run(c.name, func(t *testing.T) { c.check(t, g, 7) })
	}
}

// check runs the case on random inputs and compares every element of out
// with the float64 reference, within a bound scaled by the sum of the
// products' magnitudes (float32 accumulation of bf16 products).
func (c ggTNCase) check(t *testing.T, g *GroupedGemm, seed uint64) {
	t.Helper()
	d := g.d
	e := len(c.counts)
	off := ggOffsets(c.start, c.counts...)
	rows := int(off[e])
	aBits, a := ggRandBF16(seed, rows*c.m)
	bBits, b := ggRandBF16(seed+1, rows*c.n)
	out0 := make([]float32, e*c.m*c.n)
	rng := rand.New(rand.NewPCG(seed, 3))
	for i := range out0 {
		out0[i] = 2*rng.Float32() - 1
		if c.beta == 0 {
			out0[i] = float32(math.NaN()) // beta 0 never reads out
		}
	}
	aBuf, bBuf, offBuf, outBuf := ggUpload(t, d, aBits), ggUpload(t, d, bBits), ggUpload(t, d, off), ggUpload(t, d, out0)
	defer func() {
		for _, buf := range []*Buffer{aBuf, bBuf, offBuf, outBuf} {
			d.Free(buf)
		}
	}()
	if err := g.RunTN(outBuf.Ptr(), aBuf.Ptr(), bBuf.Ptr(), offBuf.Ptr(), rows, c.m, c.n, e, c.alpha, c.beta); err != nil {
		t.Fatal(err)
	}
	got := make([]float32, len(out0))
	if err := d.CopyFromDevice(Bytes(got), outBuf, 0); err != nil {
		t.Fatal(err)
	}
	want, bound := ggTNReference(a, b, out0, off, c.m, c.n, float64(c.alpha), float64(c.beta))
	bad := 0
	for i := range got {
		if diff := math.Abs(float64(got[i]) - want[i]); !(diff <= 1e-5*bound[i]+1e-6) {
			if bad < 5 {
				x, r := i/(c.m*c.n), i%(c.m*c.n)
				t.Errorf("expert %d out[%d][%d] = %g, want %g (bound %g)", x, r/c.n, r%c.n, got[i], want[i], bound[i])
			}
			bad++
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d elements wrong", bad, len(got))
	}
}

// ggTNReference is out[x] = alpha*a[rows of x]ᵀ·b[rows of x] + beta*out0[x]
// in float64 (beta 0 does not read out0), and per element the sum of the
// terms' magnitudes, which bounds float32's rounding. Experts run in
// parallel.
func ggTNReference(a, b, out0 []float32, off []int32, m, n int, alpha, beta float64) (want, bound []float64) {
	e := len(off) - 1
	want, bound = make([]float64, e*m*n), make([]float64, e*m*n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	for x := range e {
		for i := range m {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer func() { <-sem; wg.Done() }()
				sum, mag := make([]float64, n), make([]float64, n)
				for r := int(off[x]); r < int(off[x+1]); r++ {
					ai := float64(a[r*m+i])
					for j := range n {
						p := ai * float64(b[r*n+j])
						sum[j] += p
						mag[j] += math.Abs(p)
					}
				}
				for j := range n {
					k := (x*m+i)*n + j
					want[k], bound[k] = alpha*sum[j], math.Abs(alpha)*mag[j]
					if beta != 0 {
						want[k] += beta * float64(out0[k])
						bound[k] += math.Abs(beta * float64(out0[k]))
					}
				}
			}()
		}
	}
	wg.Wait()
	return want, bound
}

// TestGroupedGemmTNFigures times the weight-gradient products of
// moe-small (8 experts, D 1024, F 2816) and the fine-grained shape (64
// experts, D 2048, F 1408; at twice and at once moe-fine's rows) on one
// rank's routed rows, evenly spread:
// RunTN against the cuBLASLt loop (one product per expert), after checking
// that the two agree, with beta 0 and then beta 1.
func TestGroupedGemmTNFigures(t *testing.T) {
	g := testGroupedGemm(t)
	if testing.Short() {
		t.Skip("figures take a while; not in -short")
	}
	d := g.d
	lt, err := NewGemm(d)
	if err != nil {
		t.Fatal(err)
	}
	defer lt.Close()
	for _, s := range []struct {
		name          string
		rows, e, m, n int
	}{
		{"moe-small dW1", 32768, 8, 2816, 1024}, {"moe-small dW2", 32768, 8, 1024, 2816},
		{"fine dW1", 98304, 64, 1408, 2048}, {"fine dW2", 98304, 64, 2048, 1408},
		// moe-fine's own calls: 4 x 2048 tokens x top 6 = 49152 rows, 768
		// an expert (12 k-blocks a tile), half the K of the rows above.
		{"moe-fine dW1", 49152, 64, 1408, 2048}, {"moe-fine dW2", 49152, 64, 2048, 1408},
	} {
		counts := make([]int, s.e)
		for i := range counts {
			counts[i] = s.rows / s.e
		}
		off := ggOffsets(0, counts...)
		aBits, _ := ggRandBF16(21, s.rows*s.m)
		bBits, _ := ggRandBF16(22, s.rows*s.n)
		aBuf, bBuf, offBuf := ggUpload(t, d, aBits), ggUpload(t, d, bBits), ggUpload(t, d, off)
		size := s.e * s.m * s.n
		outK, err := d.Alloc(int64(4 * size))
		if err != nil {
			t.Fatal(err)
		}
		outL, err := d.Alloc(int64(4 * size))
		if err != nil {
			t.Fatal(err)
		}
		types := GemmTypes{Out: backend.Float32, A: backend.BFloat16, B: backend.BFloat16}
		kernel := func() error {
			return g.RunTN(outK.Ptr(), aBuf.Ptr(), bBuf.Ptr(), offBuf.Ptr(), s.rows, s.m, s.n, s.e, 1, 0)
		}
		loop := func() error {
			return lt.GroupedMatMulTN(types, outL.Ptr(), aBuf.Ptr(), bBuf.Ptr(), counts, s.m, s.n, 1, 0)
		}
		msK, err := ggTime(d, kernel)
		if err != nil {
			t.Fatal(err)
		}
		msL, err := ggTime(d, loop)
		if err != nil {
			t.Fatal(err)
		}
		gotK, gotL := make([]float32, size), make([]float32, size)
		if err := d.CopyFromDevice(Bytes(gotK), outK, 0); err != nil {
			t.Fatal(err)
		}
		if err := d.CopyFromDevice(Bytes(gotL), outL, 0); err != nil {
			t.Fatal(err)
		}
		if rel := relL2(gotK, gotL); !(rel < 1e-5) {
			t.Errorf("%s: the kernel and cuBLASLt differ, relative L2 %.3g", s.name, rel)
		}
		flop := 2 * float64(s.rows) * float64(s.m) * float64(s.n)
		name := fmt.Sprintf("grouped_gemm_tn %s E%d M%d N%d", s.name, s.e, s.m, s.n)
		figure(t, name+" kernel", msK, fmt.Sprintf("ms (%.1f TFLOP/s)", flop/msK/1e9))
		figure(t, name+" cuBLASLt loop", msL, fmt.Sprintf("ms (%.1f TFLOP/s)", flop/msL/1e9))
		figure(t, name+" kernel over cuBLASLt loop", msK/msL, "x")
		// Accumulating (beta 1), as the training step does: the epilogue
		// reads the old gradients too.
		msK1, err := ggTime(d, func() error {
			return g.RunTN(outK.Ptr(), aBuf.Ptr(), bBuf.Ptr(), offBuf.Ptr(), s.rows, s.m, s.n, s.e, 1, 1)
		})
		if err != nil {
			t.Fatal(err)
		}
		msL1, err := ggTime(d, func() error {
			return lt.GroupedMatMulTN(types, outL.Ptr(), aBuf.Ptr(), bBuf.Ptr(), counts, s.m, s.n, 1, 1)
		})
		if err != nil {
			t.Fatal(err)
		}
		figure(t, name+" beta 1 kernel", msK1, "ms")
		figure(t, name+" beta 1 cuBLASLt loop", msL1, "ms")
		figure(t, name+" beta 1 kernel over cuBLASLt loop", msK1/msL1, "x")
		for _, buf := range []*Buffer{aBuf, bBuf, offBuf, outK, outL} {
			d.Free(buf)
		}
	}
}

// TestGroupedMatMulTNRoutes runs the Backend's GroupedMatMulTN once routed
// to the TN kernel (the fill rule lowered to 0) and once to the cuBLASLt
// loop (raised past 1) on the same ragged groups (one empty, one ending
// inside a k-block, rows past the last), accumulating into the same old
// gradients, and checks the two agree.
func TestGroupedMatMulTNRoutes(t *testing.T) {
	testGroupedGemm(t)
	b := testBackend(t)
	x, ok := b.expertKernels()
	if !ok {
		t.Skip("no grouped GEMM kernels here")
	}
	defer func(f float64) { x.tnMinFill = f }(x.tnMinFill)
	const m, n, total = 264, 136, 700
	groups := []int{130, 0, 257, 201}
	rng := rand.New(rand.NewPCG(31, 7))
	vals := func(k int, scale float64) []float32 {
		v := make([]float32, k)
		for i := range v {
			v[i] = float32(scale * rng.NormFloat64())
		}
		return v
	}
	bf := func(rows, cols int) backend.Tensor {
		f := b.New(backend.Float32, rows, cols)
		backend.UploadSlice(b, f, vals(rows*cols, 1))
		h := b.New(backend.BFloat16, rows, cols)
		b.Copy(h, f)
		return h
	}
	a, bb := bf(total, m), bf(total, n)
	old := vals(len(groups)*m*n, 1)
	run := func(fill float64) []float32 {
		x.tnMinFill = fill
		out := b.New(backend.Float32, len(groups)*m, n)
		backend.UploadSlice(b, out, old)
		b.GroupedMatMulTN(out, a, bb, backend.Groups{Rows: groups}, 0.5, 1)
		if err := b.Sync(); err != nil {
			t.Fatal(err)
		}
		return backend.DownloadFloat32(b, out)
	}
	kernel, loop := run(0), run(2)
	if rel := relL2(kernel, loop); !(rel < 1e-5) {
		t.Errorf("GroupedMatMulTN on the kernel and on the cuBLASLt loop differ: relative L2 %.3g", rel)
	}
}
