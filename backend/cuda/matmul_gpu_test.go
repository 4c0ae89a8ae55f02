package cuda

// Gemm on the GPU against the CPU backend in float64, on fresh random
// inputs, with outputs poisoned with NaN wherever beta = 0 lets them be.
// bf16 results are compared twice: with the reference on the same
// bf16-rounded inputs, at fp32 accumulation tolerance (a wrong layout,
// transpose or alpha/beta shows here), and with the reference on the raw
// fp32 inputs, at bf16 tolerance (what a user of MatMul sees). The fp32
// mode is compared with the raw reference at fp32 tolerance.

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// gemmBF16Tol bounds the relative L2 error against the raw fp32 inputs:
// each input rounds by up to 2^-9 relative (about 1.6e-3 for a product).
const gemmBF16Tol = 1e-2

// gemmTightTol bounds the relative L2 error of an fp32-accumulated product
// of exactly representable inputs. Tensor cores have been measured to round
// each k-step's addition toward zero, an error that can be biased by up to
// an fp32 ulp per step, so the bound grows with k: 6e-5 at k = 4096 (the
// H200 showed 4.4e-6 there), still 25x below bf16 rounding error, so the
// two tolerances tell a GEMM bug from conversion error.
func gemmTightTol(k int) float64 { return max(2e-5, float64(k)*0x1p-23/8) }

type gemmCase struct {
	m, n, k        int
	transA, transB bool
	alpha, beta    float32
}

func (c gemmCase) String() string {
	return fmt.Sprintf("%dx%dx%d transA=%v transB=%v alpha=%g beta=%g", c.m, c.n, c.k, c.transA, c.transB, c.alpha, c.beta)
}

// shapes of the stored a and b.
func (c gemmCase) aShape() (int, int) {
	if c.transA {
		return c.k, c.m
	}
	return c.m, c.k
}

func (c gemmCase) bShape() (int, int) {
	if c.transB {
		return c.n, c.k
	}
	return c.k, c.n
}

func openGemm(t *testing.T, d *Device, p GemmPrecision) *Gemm {
	t.Helper()
	g, err := NewGemmWith(d, GemmOptions{Precision: p})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := g.Close(); err != nil {
			t.Errorf("Gemm.Close: %v", err)
		}
	})
	return g
}

// f64 is a float64 CPU tensor holding xs.
func (k *kt) f64(xs []float32, shape ...int) backend.Tensor {
	t := k.ref.New(backend.Float64, shape...)
	dst := t.(*cpu.Tensor).Float64s()
	for i, x := range xs {
		dst[i] = float64(x)
	}
	return t
}

// refMatMul is the CPU backend's MatMul in float64; c is out's initial
// value (nil for zeros).
func (k *kt) refMatMul(c gemmCase, a, b, out []float32) []float64 {
	ar, ac := c.aShape()
	br, bc := c.bShape()
	o := k.f64(out, c.m, c.n)
	k.ref.MatMul(o, k.f64(a, ar, ac), k.f64(b, br, bc), c.transA, c.transB, float64(c.alpha), float64(c.beta))
	return o.(*cpu.Tensor).Float64s()
}

func roundBF16(xs []float32) []float32 {
	out := make([]float32, len(xs))
	for i, x := range xs {
		out[i] = math.Float32frombits(uint32(bf16Nearest(x)) << 16)
	}
	return out
}

// relErr is ||got - want|| / ||want||; it fails the test on a NaN where the
// reference has none (an element never written) and on an error over tol.
func relErr(t *testing.T, what string, got []float32, want []float64, tol float64) float64 {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", what, len(got), len(want))
	}
	var num, den float64
	for i, g := range got {
		if math.IsNaN(float64(g)) != math.IsNaN(want[i]) {
			t.Errorf("%s: element %d = %v, want %v", what, i, g, want[i])
			return math.Inf(1)
		}
		if math.IsNaN(want[i]) {
			continue
		}
		d := float64(g) - want[i]
		num += d * d
		den += want[i] * want[i]
	}
	rel := math.Sqrt(num / max(den, 1e-300))
	if den == 0 {
		rel = math.Sqrt(num)
	}
	if rel > tol {
		t.Errorf("%s: relative error %.3g > %.3g", what, rel, tol)
	}
	return rel
}

// worst tracks the largest error of each kind of comparison, for the log.
type worst map[string]float64

func (w worst) add(kind string, e float64) { w[kind] = max(w[kind], e) }

func (w worst) log(t *testing.T) {
	for kind, e := range w {
		t.Logf("worst relative error, %s: %.3g", kind, e)
	}
}

// runGemmCase runs c on fresh inputs through g.MatMul (and, for bf16,
// through g.MatMulBF16 on inputs rounded on the GPU) and checks the
// results.
func runGemmCase(k *kt, g *Gemm, c gemmCase, w worst) {
	t := k.t
	t.Helper()
	ar, ac := c.aShape()
	br, bc := c.bShape()
	a, b := k.randn(ar*ac, 1), k.randn(br*bc, 1)
	var out0 []float32
	if c.beta != 0 {
		out0 = k.randn(c.m*c.n, 1)
	}
	da, db := upload(k, a), upload(k, b)
	// run queues one product into a fresh output and returns the result.
	run := func(f func(out driver.DevicePtr) error) []float32 {
		var out *Buffer
		if out0 == nil {
			out = k.poisoned(c.m * c.n)
		} else {
			out = upload(k, out0)
		}
		if err := f(out.Ptr()); err != nil {
			t.Fatalf("%v: %v", c, err)
		}
		return k.download(out, c.m*c.n)
	}
	got := run(func(out driver.DevicePtr) error {
		return g.MatMul(out, da.Ptr(), db.Ptr(), c.m, c.n, c.k, c.transA, c.transB, c.alpha, c.beta)
	})
	raw := k.refMatMul(c, a, b, out0)
	if g.Precision() == GemmFP32 {
		w.add("fp32 vs raw inputs", relErr(t, c.String()+", fp32", got, raw, gemmTightTol(c.k)))
		return
	}
	rounded := k.refMatMul(c, roundBF16(a), roundBF16(b), out0)
	w.add("bf16 vs rounded inputs", relErr(t, c.String()+", bf16 vs rounded inputs", got, rounded, gemmTightTol(c.k)))
	w.add("bf16 vs raw inputs", relErr(t, c.String()+", bf16 vs raw inputs", got, raw, gemmBF16Tol))

	// MatMulBF16 on copies rounded by the conversion kernel.
	ha, hb := k.bf16Copy(da, ar*ac), k.bf16Copy(db, br*bc)
	got = run(func(out driver.DevicePtr) error {
		return g.MatMulBF16(out, ha.Ptr(), hb.Ptr(), c.m, c.n, c.k, c.transA, c.transB, c.alpha, c.beta)
	})
	w.add("MatMulBF16 vs rounded inputs", relErr(t, c.String()+", MatMulBF16", got, rounded, gemmTightTol(c.k)))
}

// bf16Copy rounds n float32s of x into a new bf16 buffer on the GPU.
func (k *kt) bf16Copy(x *Buffer, n int) *Buffer {
	k.t.Helper()
	h, err := k.d.Alloc(int64(2 * n))
	if err != nil {
		k.t.Fatal(err)
	}
	k.t.Cleanup(func() { k.d.Free(h) })
	k.launch("convert.cu", "f32_to_bf16", k.d.StrideGrid(int64(n), 256, 4), h, x, int64(n))
	return h
}

var gemmLayouts = [][2]bool{{false, false}, {true, false}, {false, true}, {true, true}}

func TestGemmLayouts(t *testing.T) {
	k := newKT(t, 21)
	shapes := [][3]int{{1, 1, 1}, {7, 13, 5}, {1000, 3, 257}, {3, 1000, 33}, {64, 96, 80}, {129, 67, 1031}}
	scales := [][2]float32{{1, 0}, {0.75, -1.5}}
	for _, p := range []GemmPrecision{GemmBF16, GemmFP32} {
		g := openGemm(t, k.d, p)
		w := worst{}
		for _, s := range shapes {
			for _, tr := range gemmLayouts {
				for _, ab := range scales {
					runGemmCase(k, g, gemmCase{m: s[0], n: s[1], k: s[2], transA: tr[0], transB: tr[1], alpha: ab[0], beta: ab[1]}, w)
				}
			}
		}
		w.log(t)
		t.Logf("%v: %d shapes cached; cuBLASLt %d from %s", p, g.algos.len(), g.CublasLtVersion(), g.CublasLtPath())
	}
}

func TestGemmDegenerate(t *testing.T) {
	k := newKT(t, 22)
	for _, p := range []GemmPrecision{GemmBF16, GemmFP32} {
		g := openGemm(t, k.d, p)
		w := worst{}
		// k = 0 and alpha = 0: out = beta*out, and a and b are not read
		// (null, or full of NaN).
		nan := make([]float32, 64)
		for i := range nan {
			nan[i] = float32(math.NaN())
		}
		dnan := upload(k, nan)
		for _, beta := range []float32{0, 1, -2.5} {
			for _, c := range []gemmCase{
				{m: 5, n: 7, k: 0, alpha: 1, beta: beta},
				{m: 5, n: 7, k: 3, transA: true, alpha: 0, beta: beta},
			} {
				var out0 []float32
				out := k.poisoned(c.m * c.n)
				if beta != 0 {
					out0 = k.randn(c.m*c.n, 1)
					out = upload(k, out0)
				}
				a, b := driver.DevicePtr(0), driver.DevicePtr(0)
				ha, hb := []float32{}, []float32{}
				if c.k > 0 {
					a, b = dnan.Ptr(), dnan.Ptr()
					ha, hb = nan[:c.m*c.k], nan[:c.k*c.n]
				}
				if err := g.MatMul(out.Ptr(), a, b, c.m, c.n, c.k, c.transA, c.transB, c.alpha, c.beta); err != nil {
					t.Fatalf("%v: %v", c, err)
				}
				w.add("beta*out", relErr(t, c.String(), k.download(out, c.m*c.n), k.refMatMul(c, ha, hb, out0), 1e-7)) // one fp32 multiply
			}
		}
		// Empty products touch nothing, null pointers included.
		for _, s := range [][3]int{{0, 5, 3}, {5, 0, 3}, {0, 0, 0}} {
			if err := g.MatMul(0, 0, 0, s[0], s[1], s[2], false, false, 1, 0); err != nil {
				t.Errorf("empty %v: %v", s, err)
			}
		}
		// Bad arguments come back at once, naming the field.
		if err := g.MatMul(dnan.Ptr(), dnan.Ptr(), dnan.Ptr(), -1, 2, 2, false, false, 1, 0); err == nil || !strings.Contains(err.Error(), "m = -1") {
			t.Errorf("negative m: %v", err)
		}
		// out over a: allowed where a is copied first, refused otherwise.
		const n = 48
		x := k.randn(n*n, 1)
		y := k.randn(n*n, 1)
		dx, dy := upload(k, x), upload(k, y)
		c := gemmCase{m: n, n: n, k: n, alpha: 1}
		err := g.MatMul(dx.Ptr(), dx.Ptr(), dy.Ptr(), n, n, n, false, false, 1, 0)
		if p == GemmFP32 {
			if err == nil || !strings.Contains(err.Error(), "overlaps a") {
				t.Errorf("fp32 out over a: %v", err)
			}
		} else {
			if err != nil {
				t.Fatal(err)
			}
			w.add("out over a", relErr(t, "bf16 out over a", k.download(dx, n*n), k.refMatMul(c, roundBF16(x), roundBF16(y), nil), gemmTightTol(n)))
		}
		w.log(t)
	}
	// A closed Gemm refuses work.
	g, err := NewGemm(k.d)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	if err := g.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	out := k.poisoned(4)
	if err := g.MatMul(out.Ptr(), out.Ptr(), out.Ptr(), 2, 2, 1, false, false, 1, 0); err == nil || !strings.Contains(err.Error(), "closed Gemm") {
		t.Errorf("MatMul after Close: %v", err)
	}
}

// TestGemmUnaligned runs products on views at small offsets (as tensor
// views produce), where the algorithm must not assume 256-byte alignment.
func TestGemmUnaligned(t *testing.T) {
	k := newKT(t, 26)
	gb, gf := openGemm(t, k.d, GemmBF16), openGemm(t, k.d, GemmFP32)
	gfirst, err := NewGemmWith(k.d, GemmOptions{NoAutotune: true})
	if err != nil {
		t.Fatal(err)
	}
	defer gfirst.Close()
	// at copies xs to a new buffer, off bytes in.
	at := func(xs []float32, off int) *Buffer {
		b, err := k.d.Alloc(int64(4*len(xs) + off))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { k.d.Free(b) })
		if err := k.d.CopyToDevice(b, int64(off), Bytes(xs)); err != nil {
			t.Fatal(err)
		}
		return b
	}
	w := worst{}
	for _, tr := range gemmLayouts {
		c := gemmCase{m: 37, n: 29, k: 19, transA: tr[0], transB: tr[1], alpha: 1.25, beta: 0.5}
		ar, ac := c.aShape()
		br, bc := c.bShape()
		a, b, out0 := k.randn(ar*ac, 1), k.randn(br*bc, 1), k.randn(c.m*c.n, 1)
		da, db := at(a, 12), at(b, 4)
		raw := k.refMatMul(c, a, b, out0)
		rounded := k.refMatMul(c, roundBF16(a), roundBF16(b), out0)
		// bf16 copies 2 and 6 bytes into their buffers.
		ha, hb := at(make([]float32, ar*ac), 8), at(make([]float32, br*bc), 8)
		k.launch("convert.cu", "f32_to_bf16", Grid1D(4, 256), ha.Ptr()+2, da.Ptr()+12, int64(ar*ac))
		k.launch("convert.cu", "f32_to_bf16", Grid1D(4, 256), hb.Ptr()+6, db.Ptr()+4, int64(br*bc))
		for _, run := range []struct {
			what string
			f    func(out driver.DevicePtr) error
			want []float64
		}{
			{"bf16", func(out driver.DevicePtr) error {
				return gb.MatMul(out, da.Ptr()+12, db.Ptr()+4, c.m, c.n, c.k, c.transA, c.transB, c.alpha, c.beta)
			}, rounded},
			{"fp32", func(out driver.DevicePtr) error {
				return gf.MatMul(out, da.Ptr()+12, db.Ptr()+4, c.m, c.n, c.k, c.transA, c.transB, c.alpha, c.beta)
			}, raw},
			{"MatMulBF16", func(out driver.DevicePtr) error {
				return gb.MatMulBF16(out, ha.Ptr()+2, hb.Ptr()+6, c.m, c.n, c.k, c.transA, c.transB, c.alpha, c.beta)
			}, rounded},
		} {
			out := at(out0, 4)
			if err := run.f(out.Ptr() + 4); err != nil {
				t.Fatalf("%v, %s: %v", c, run.what, err)
			}
			got := make([]float32, c.m*c.n)
			if err := k.d.Sync(); err != nil {
				t.Fatalf("%v, %s: %v", c, run.what, err)
			}
			if err := k.d.CopyFromDevice(Bytes(got), out, 4); err != nil {
				t.Fatal(err)
			}
			w.add(run.what, relErr(t, c.String()+", "+run.what+" at odd offsets", got, run.want, gemmTightTol(c.k)))
		}
	}
	w.log(t)
}

// TestGemmConcurrent queues products of growing sizes from several
// goroutines on one Gemm, so the scratch buffers are regrown while other
// products are queued; each result must still be its own.
func TestGemmConcurrent(t *testing.T) {
	k := newKT(t, 23)
	g := openGemm(t, k.d, GemmBF16)
	const workers, each = 4, 6
	type job struct {
		c      gemmCase
		a, b   []float32
		out    *Buffer
		da, db *Buffer
	}
	jobs := make([][]job, workers)
	for w := range jobs {
		for i := range each {
			c := gemmCase{m: 1 + k.rng.IntN(60*(i+1)), n: 1 + k.rng.IntN(60*(i+1)), k: 1 + k.rng.IntN(60*(i+1)),
				transA: k.rng.IntN(2) == 0, transB: k.rng.IntN(2) == 0, alpha: 1}
			ar, ac := c.aShape()
			br, bc := c.bShape()
			j := job{c: c, a: k.randn(ar*ac, 1), b: k.randn(br*bc, 1), out: k.poisoned(c.m * c.n)}
			j.da, j.db = upload(k, j.a), upload(k, j.b)
			jobs[w] = append(jobs[w], j)
		}
	}
	var wg sync.WaitGroup
	errs := make([]error, workers)
	for w := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range jobs[w] {
				j := &jobs[w][i]
				c := j.c
				if err := g.MatMul(j.out.Ptr(), j.da.Ptr(), j.db.Ptr(), c.m, c.n, c.k, c.transA, c.transB, c.alpha, c.beta); err != nil {
					errs[w] = err
					return
				}
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	w := worst{}
	for _, js := range jobs {
		for _, j := range js {
			want := k.refMatMul(j.c, roundBF16(j.a), roundBF16(j.b), nil)
			w.add("bf16 vs rounded inputs", relErr(t, j.c.String(), k.download(j.out, j.c.m*j.c.n), want, gemmTightTol(j.c.k)))
		}
	}
	w.log(t)
}

// TestGemmLarge runs 4096^3 in every layout and both precisions; the whole
// output is checked for unwritten elements and sampled rows against the
// CPU backend.
func TestGemmLarge(t *testing.T) {
	k := newKT(t, 24)
	const N = 4096
	a, b := k.randn(N*N, 1), k.randn(N*N, 1)
	ar, br := roundBF16(a), roundBF16(b)
	da, db := upload(k, a), upload(k, b)
	// Sampled output rows: the first, the last and random ones.
	rows := []int{0, N - 1}
	for range 62 {
		rows = append(rows, k.rng.IntN(N))
	}
	// The rows of op(a) that produce them, and b whole, as CPU tensors.
	opRows := func(x []float32, transA bool) backend.Tensor {
		sub := make([]float32, 0, len(rows)*N)
		for _, i := range rows {
			for l := range N {
				if transA {
					sub = append(sub, x[l*N+i])
				} else {
					sub = append(sub, x[i*N+l])
				}
			}
		}
		return k.f64(sub, len(rows), N)
	}
	tb, tbr := k.f64(b, N, N), k.f64(br, N, N)
	ref := func(aRows, bFull backend.Tensor, transB bool) []float64 {
		o := k.ref.New(backend.Float64, len(rows), N)
		k.ref.MatMul(o, aRows, bFull, false, transB, 1, 0)
		return o.(*cpu.Tensor).Float64s()
	}
	sample := func(full []float32) []float32 {
		out := make([]float32, 0, len(rows)*N)
		for _, i := range rows {
			out = append(out, full[i*N:(i+1)*N]...)
		}
		return out
	}
	gb, gf := openGemm(t, k.d, GemmBF16), openGemm(t, k.d, GemmFP32)
	gfirst, err := NewGemmWith(k.d, GemmOptions{NoAutotune: true})
	if err != nil {
		t.Fatal(err)
	}
	defer gfirst.Close()
	out := k.poisoned(N * N)
	w := worst{}
	for _, tr := range gemmLayouts {
		name := fmt.Sprintf("4096^3 transA=%v transB=%v", tr[0], tr[1])
		raw := ref(opRows(a, tr[0]), tb, tr[1])
		rounded := ref(opRows(ar, tr[0]), tbr, tr[1])
		for _, g := range []*Gemm{gb, gf} {
			if err := k.d.Memset32(out, 0, N*N, 0x7fc00000); err != nil {
				t.Fatal(err)
			}
			if err := g.MatMul(out.Ptr(), da.Ptr(), db.Ptr(), N, N, N, tr[0], tr[1], 1, 0); err != nil {
				t.Fatalf("%s, %v: %v", name, g.Precision(), err)
			}
			full := k.download(out, N*N)
			for i, v := range full {
				if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
					t.Fatalf("%s, %v: out[%d, %d] = %v", name, g.Precision(), i/N, i%N, v)
				}
			}
			got := sample(full)
			if g.Precision() == GemmFP32 {
				w.add("fp32 vs raw inputs", relErr(t, name+", fp32", got, raw, gemmTightTol(N)))
				continue
			}
			w.add("bf16 vs rounded inputs", relErr(t, name+", bf16 vs rounded inputs", got, rounded, gemmTightTol(N)))
			w.add("bf16 vs raw inputs", relErr(t, name+", bf16 vs raw inputs", got, raw, gemmBF16Tol))
		}
	}
	w.log(t)
}

// TestGemmFigures times MatMul (conversion included), MatMulBF16 (the
// cuBLASLt call alone) and the fp32 mode on the moe-small recipe's
// shapes (T = 16384 tokens, D = 1024, F = 2816, V = 32768). Sampled
// output elements are checked against float64 dot products, so a broken
// path cannot report a good time.
func TestGemmFigures(t *testing.T) {
	k := newKT(t, 25)
	if testing.Short() {
		t.Skip("figures take seconds; not in -short")
	}
	gb, gf := openGemm(t, k.d, GemmBF16), openGemm(t, k.d, GemmFP32)
	gfirst, err := NewGemmWith(k.d, GemmOptions{NoAutotune: true})
	if err != nil {
		t.Fatal(err)
	}
	defer gfirst.Close()
	type shape struct {
		name string
		c    gemmCase
		fp32 bool // time the fp32 mode too
	}
	shapes := []shape{
		{"4096x4096x4096", gemmCase{m: 4096, n: 4096, k: 4096}, true},
		{"moe-small expert up/gate 16384x1024 @ 1024x2816", gemmCase{m: 16384, n: 2816, k: 1024}, false},
		{"moe-small expert down 16384x2816 @ 2816x1024", gemmCase{m: 16384, n: 1024, k: 2816}, false},
		{"moe-small expert up dX 16384x2816 @ (1024x2816)T", gemmCase{m: 16384, n: 1024, k: 2816, transB: true}, false},
		{"moe-small expert up dW (16384x1024)T @ 16384x2816", gemmCase{m: 1024, n: 2816, k: 16384, transA: true}, true},
		// One expert's share of moe-small's routed rows (32768 / 8 experts).
		{"moe-small one expert up/gate 4096x1024 @ 1024x2816", gemmCase{m: 4096, n: 2816, k: 1024}, false},
		{"moe-small one expert down 4096x2816 @ 2816x1024", gemmCase{m: 4096, n: 1024, k: 2816}, false},
		{"moe-small one expert up dW (4096x1024)T @ 4096x2816", gemmCase{m: 1024, n: 2816, k: 4096, transA: true}, false},
		{"moe-small attention proj 16384x1024 @ 1024x1024", gemmCase{m: 16384, n: 1024, k: 1024}, false},
		{"moe-small lm head 16384x1024 @ (32768x1024)T", gemmCase{m: 16384, n: 32768, k: 1024, transB: true}, false},
	}
	rng := rand.New(rand.NewPCG(25, 26))
	for _, s := range shapes {
		c := s.c
		c.alpha = 1
		ar, ac := c.aShape()
		br, bc := c.bShape()
		a, b := make([]float32, ar*ac), make([]float32, br*bc)
		for i := range a {
			a[i] = rng.Float32() - 0.5
		}
		for i := range b {
			b[i] = rng.Float32() - 0.5
		}
		da, db := upload(k, a), upload(k, b)
		ha, hb := k.bf16Copy(da, len(a)), k.bf16Copy(db, len(b))
		out := k.poisoned(c.m * c.n)
		flop := 2 * float64(c.m) * float64(c.n) * float64(c.k)
		type path struct {
			what  string
			round bool // the reference rounds the inputs to bf16
			f     func() error
		}
		paths := []path{
			{"MatMul bf16 (with conversion)", true, func() error {
				return gb.MatMul(out.Ptr(), da.Ptr(), db.Ptr(), c.m, c.n, c.k, c.transA, c.transB, 1, 0)
			}},
			{"MatMulBF16 (cuBLASLt alone)", true, func() error {
				return gb.MatMulBF16(out.Ptr(), ha.Ptr(), hb.Ptr(), c.m, c.n, c.k, c.transA, c.transB, 1, 0)
			}},
			{"MatMulBF16 (cuBLASLt alone, heuristic's first choice)", true, func() error {
				return gfirst.MatMulBF16(out.Ptr(), ha.Ptr(), hb.Ptr(), c.m, c.n, c.k, c.transA, c.transB, 1, 0)
			}},
		}
		if s.fp32 {
			paths = append(paths, path{"MatMul fp32", false, func() error {
				return gf.MatMul(out.Ptr(), da.Ptr(), db.Ptr(), c.m, c.n, c.k, c.transA, c.transB, 1, 0)
			}})
		}
		for _, p := range paths {
			if err := k.d.Memset32(out, 0, int64(c.m*c.n), 0x7fc00000); err != nil {
				t.Fatal(err)
			}
			ms, err := timeGPU(k.d, 2, 10, p.f)
			if err != nil {
				t.Fatalf("%s, %s: %v", s.name, p.what, err)
			}
			figure(t, p.what+", "+s.name, flop/(ms*1e-3)/1e12, "TFLOP/s")
			checkSampled(k, s.name+", "+p.what, out, c, a, b, p.round, gemmTightTol(c.k))
		}
	}
}

// timeGPU runs f warm times, then reps times between two events, and
// returns the milliseconds per run.
func timeGPU(d *Device, warm, reps int, f func() error) (float64, error) {
	for range warm {
		if err := f(); err != nil {
			return 0, err
		}
	}
	start, err := d.NewEvent()
	if err != nil {
		return 0, err
	}
	defer start.Destroy()
	end, err := d.NewEvent()
	if err != nil {
		return 0, err
	}
	defer end.Destroy()
	if err := start.Record(); err != nil {
		return 0, err
	}
	for range reps {
		if err := f(); err != nil {
			return 0, err
		}
	}
	if err := end.Record(); err != nil {
		return 0, err
	}
	ms, err := end.Since(start)
	if err != nil {
		return 0, err
	}
	return ms / float64(reps), d.Sync()
}

// checkSampled compares 64 random elements of out with float64 dot
// products of (bf16-rounded, when round) a and b.
func checkSampled(k *kt, what string, out *Buffer, c gemmCase, a, b []float32, round bool, tol float64) {
	k.t.Helper()
	if err := k.d.Sync(); err != nil {
		k.t.Fatal(err)
	}
	get := func(x float32) float64 {
		if round {
			return float64(math.Float32frombits(uint32(bf16Nearest(x)) << 16))
		}
		return float64(x)
	}
	got := make([]float32, 0, 64)
	want := make([]float64, 0, 64)
	for range 64 {
		i, j := k.rng.IntN(c.m), k.rng.IntN(c.n)
		var s float64
		for l := range c.k {
			ail := a[i*c.k+l]
			if c.transA {
				ail = a[l*c.m+i]
			}
			blj := b[l*c.n+j]
			if c.transB {
				blj = b[j*c.k+l]
			}
			s += get(ail) * get(blj)
		}
		var v [1]float32
		if err := k.d.CopyFromDevice(Bytes(v[:]), out, int64(4*(i*c.n+j))); err != nil {
			k.t.Fatal(err)
		}
		got, want = append(got, v[0]), append(want, s)
	}
	relErr(k.t, what+" (sampled)", got, want, tol)
}
