package cuda

// Every kernel in package kernels, compiled with NVRTC and run on the GPU,
// against the CPU backend in float64 (backend/cpu) on fresh random inputs.
// Outputs are poisoned with NaN first, so an element a kernel fails to
// write fails the comparison.

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// fp32Tol bounds ||gpu - ref|| / ||ref|| for float32 kernels against the
// float64 reference: float32 rounding is 6e-8 per operation, and the longest
// reductions here add a few thousand terms.
const fp32Tol = 2e-6

type kt struct {
	t   *testing.T
	d   *Device
	ref *cpu.Backend
	rng *rand.Rand
}

func newKT(t *testing.T, seed uint64) *kt {
	return &kt{t: t, d: testDevice(t), ref: cpu.New(backend.Float64), rng: rand.New(rand.NewPCG(seed, 99))}
}

func (k *kt) randn(n int, scale float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(k.rng.NormFloat64() * scale)
	}
	return x
}

func (k *kt) ids(n, limit int) []int32 {
	x := make([]int32, n)
	for i := range x {
		x[i] = int32(k.rng.IntN(limit))
	}
	return x
}

// upload copies host values to a new device buffer.
func upload[T any](k *kt, xs []T) *Buffer {
	k.t.Helper()
	b, err := k.d.Alloc(int64(len(Bytes(xs))))
	if err != nil {
		k.t.Fatal(err)
	}
	if err := k.d.CopyToDevice(b, 0, Bytes(xs)); err != nil {
		k.t.Fatal(err)
	}
	k.t.Cleanup(func() { k.d.Free(b) })
	return b
}

// poisoned is a buffer of n float32 NaNs.
func (k *kt) poisoned(n int) *Buffer {
	k.t.Helper()
	b, err := k.d.Alloc(int64(4 * n))
	if err != nil {
		k.t.Fatal(err)
	}
	if err := k.d.Memset32(b, 0, int64(n), 0x7fc00000); err != nil {
		k.t.Fatal(err)
	}
	k.t.Cleanup(func() { k.d.Free(b) })
	return b
}

func (k *kt) download(b *Buffer, n int) []float32 {
	k.t.Helper()
	if err := k.d.Sync(); err != nil {
		k.t.Fatal(err)
	}
	out := make([]float32, n)
	if err := k.d.CopyFromDevice(Bytes(out), b, 0); err != nil {
		k.t.Fatal(err)
	}
	return out
}

func (k *kt) launch(file, name string, g Grid, args ...any) {
	k.t.Helper()
	if err := k.d.Launch(kernel(k.t, k.d, file, name), g, args...); err != nil {
		k.t.Fatal(err)
	}
}

// cpuF is a float64 CPU tensor holding xs.
func (k *kt) cpuF(xs []float32, shape ...int) backend.Tensor {
	t := k.ref.New(backend.Float64, shape...)
	v := make([]float64, len(xs))
	for i, x := range xs {
		v[i] = float64(x)
	}
	k.ref.Upload(t, tensor.New(tensor.WithShape(len(v)), tensor.WithBacking(v)))
	return t
}

func (k *kt) cpuI(xs []int32) backend.Tensor {
	t := k.ref.New(backend.Int32, len(xs))
	k.ref.Upload(t, tensor.New(tensor.WithShape(len(xs)), tensor.WithBacking(append([]int32(nil), xs...))))
	return t
}

func (k *kt) get(t backend.Tensor) []float64 { return backend.HostData(k.ref.Download(t)).([]float64) }

// check compares got with want by relative L2 error; any NaN fails.
func (k *kt) check(what string, got []float32, want []float64, tol float64) {
	k.t.Helper()
	if len(got) != len(want) {
		k.t.Fatalf("%s: %d values, want %d", what, len(got), len(want))
	}
	var num, den float64
	for i, g := range got {
		if math.IsNaN(float64(g)) != math.IsNaN(want[i]) {
			k.t.Fatalf("%s[%d] = %v, want %v (unwritten or wrong NaN)", what, i, g, want[i])
		}
		if math.IsNaN(want[i]) {
			continue
		}
		d := float64(g) - want[i]
		num += d * d
		den += want[i] * want[i]
	}
	rel := math.Sqrt(num / max(den, 1e-300))
	if rel > tol {
		k.t.Errorf("%s: relative error %.3g > %.3g", what, rel, tol)
	} else {
		k.t.Logf("%s: relative error %.3g", what, rel)
	}
}

func TestKernelElementwise(t *testing.T) {
	k := newKT(t, 1)
	const n = 100003
	x := k.randn(n, 1)
	y := k.randn(n, 1)
	dx, dy := upload(k, x), upload(k, y)
	// Three blocks: the grid-stride loop runs about 130 rounds.
	few := Grid1D(3, 256)
	k.launch("elementwise.cu", "axpy_f32", few, dy, float32(-0.75), dx, int64(n))
	k.launch("elementwise.cu", "scale_f32", k.d.StrideGrid(n, 256, 4), dy, float32(1.25), int64(n))
	ry, rx := k.cpuF(y, n), k.cpuF(x, n)
	k.ref.Axpy(ry, -0.75, rx)
	k.ref.Scale(ry, 1.25)
	k.check("axpy+scale", k.download(dy, n), k.get(ry), fp32Tol)

	f := k.poisoned(n)
	k.launch("elementwise.cu", "fill_f32", few, f, float32(3.5), int64(n-1))
	got := k.download(f, n)
	for i, v := range got[:n-1] {
		if v != 3.5 {
			t.Fatalf("fill[%d] = %v", i, v)
		}
	}
	if !math.IsNaN(float64(got[n-1])) {
		t.Fatalf("fill wrote past n")
	}
}

func TestKernelSum(t *testing.T) {
	k := newKT(t, 2)
	const n = 1<<20 + 17
	x := k.randn(n, 2)
	dx := upload(k, x)
	g := k.d.StrideGrid(n, 256, 4)
	partial := k.poisoned(2 * g.Grid.X) // float64 partials
	// From the buffer's start the kernel reads four floats at a time (and
	// a tail of one); one float in, one at a time.
	for _, off := range []int{0, 1} {
		rx := k.cpuF(x[off:], n-off)
		for _, sq := range []int32{0, 1} {
			k.launch("elementwise.cu", "sum_partial_f32", g, dx.ptr+driver.DevicePtr(4*off), int64(n-off), sq, partial)
			if err := k.d.Sync(); err != nil {
				t.Fatal(err)
			}
			parts := make([]float64, g.Grid.X)
			if err := k.d.CopyFromDevice(Bytes(parts), partial, 0); err != nil {
				t.Fatal(err)
			}
			var s float64
			for _, p := range parts {
				s += p
			}
			want := k.ref.Sum(rx)
			if sq == 1 {
				want = k.ref.SumSquares(rx)
			}
			if math.Abs(s-want) > 1e-10*max(math.Abs(want), 1) {
				t.Errorf("offset %d, squares=%d: sum %.17g, want %.17g", off, sq, s, want)
			}
		}
	}
}

// bf16Nearest rounds f to bfloat16 by comparing the two neighbours in
// float64, ties to the even one: an independent statement of what
// f32_to_bf16 must do.
func bf16Nearest(f float32) uint16 {
	u := math.Float32bits(f)
	if f != f {
		return uint16(u>>16) | 0x40
	}
	lo := uint16(u >> 16)
	hi := lo + 1
	vlo := float64(math.Float32frombits(uint32(lo) << 16))
	vhi := float64(math.Float32frombits(uint32(hi) << 16))
	if lo&0x7fff == 0x7f7f && math.Abs(float64(f)) >= math.Abs(vlo) {
		// Past the largest finite bf16 the upper neighbour is infinity;
		// compare against where the next value would be.
		vhi = vlo + (vlo - float64(math.Float32frombits(uint32(lo-1)<<16)))
	}
	dlo, dhi := math.Abs(float64(f)-vlo), math.Abs(float64(f)-vhi)
	switch {
	case uint32(lo)<<16 == u || dlo < dhi:
		return lo
	case dhi < dlo:
		return hi
	case lo&1 == 0:
		return lo
	}
	return hi
}

func TestKernelBF16(t *testing.T) {
	k := newKT(t, 3)
	x := k.randn(50000, 10)
	special := []float32{0, float32(math.Copysign(0, -1)), float32(math.Inf(1)), float32(math.Inf(-1)),
		math.MaxFloat32, -math.MaxFloat32, 1e-40, -1e-42, math.Float32frombits(0x3f808000), math.Float32frombits(0x3f818000),
		math.Float32frombits(0x7f7f8000), math.Float32frombits(0x3f80ffff), float32(math.NaN())}
	x = append(x, special...)
	for i := range 2000 { // exact ties and their neighbours
		x = append(x, math.Float32frombits(k.rng.Uint32()&0xffff0000|0x8000+uint32(i%3)-1))
	}
	n := len(x)
	dx := upload(k, x)
	h, err := k.d.Alloc(int64(2 * n))
	if err != nil {
		t.Fatal(err)
	}
	defer k.d.Free(h)
	k.launch("convert.cu", "f32_to_bf16", k.d.StrideGrid(int64(n), 256, 4), h, dx, int64(n))
	back := k.poisoned(n)
	k.launch("convert.cu", "bf16_to_f32", k.d.StrideGrid(int64(n), 256, 4), back, h, int64(n))
	if err := k.d.Sync(); err != nil {
		t.Fatal(err)
	}
	bits := make([]uint16, n)
	if err := k.d.CopyFromDevice(Bytes(bits), h, 0); err != nil {
		t.Fatal(err)
	}
	f := k.download(back, n)
	for i, v := range x {
		want := bf16Nearest(v)
		if bits[i] != want {
			t.Fatalf("bf16(%g = %#08x) = %#04x, want %#04x", v, math.Float32bits(v), bits[i], want)
		}
		if math.Float32bits(f[i]) != uint32(want)<<16 {
			t.Fatalf("float(bf16 %#04x) = %#08x", want, math.Float32bits(f[i]))
		}
	}
}

func TestKernelEmbedding(t *testing.T) {
	k := newKT(t, 4)
	const V, D, T = 97, 300, 64
	table := k.randn(V*D, 1)
	ids := k.ids(T, V)
	ids[5], ids[9] = ids[3], ids[3] // repeats, for the backward's atomics
	dtable, did := upload(k, table), upload(k, ids)
	out := k.poisoned(T * D)
	k.launch("embedding.cu", "embedding_forward_f32", Grid1D(T, 256), out, dtable, did, int32(T), int32(D), int32(V))
	rout, rtable, rids := k.ref.New(backend.Float64, T, D), k.cpuF(table, V, D), k.cpuI(ids)
	k.ref.EmbeddingForward(rout, rtable, rids)
	k.check("embedding forward", k.download(out, T*D), k.get(rout), 0)

	dout := k.randn(T*D, 1)
	ddout := upload(k, dout)
	k.launch("embedding.cu", "embedding_backward_f32", Grid1D(T, 256), dtable, ddout, did, int32(T), int32(D), int32(V))
	k.ref.EmbeddingBackward(rtable, k.cpuF(dout, T, D), rids)
	k.check("embedding backward", k.download(dtable, V*D), k.get(rtable), fp32Tol)

	// An id outside the table gives a NaN row, not a wild read.
	bad := upload(k, []int32{V, -1})
	out2 := k.poisoned(2 * D)
	if err := k.d.Memset32(out2, 0, 2*D, 0); err != nil {
		t.Fatal(err)
	}
	k.launch("embedding.cu", "embedding_forward_f32", Grid1D(2, 256), out2, dtable, bad, int32(2), int32(D), int32(V))
	for i, v := range k.download(out2, 2*D) {
		if !math.IsNaN(float64(v)) {
			t.Fatalf("out-of-range id: element %d = %v, want NaN", i, v)
		}
	}
}

func TestKernelRMSNorm(t *testing.T) {
	k := newKT(t, 5)
	const T, D, eps = 37, 1000, 1e-5
	x, w := k.randn(T*D, 2), k.randn(D, 1)
	dx, dw := upload(k, x), upload(k, w)
	out, rstd := k.poisoned(T*D), k.poisoned(T)
	k.launch("rmsnorm.cu", "rmsnorm_forward_f32", Grid1D(T, 256), out, rstd, driver.DevicePtr(0), dx, dw, int32(T), int32(D), float32(eps))
	rx, rw := k.cpuF(x, T, D), k.cpuF(w, D)
	rout, rrstd := k.ref.New(backend.Float64, T, D), k.ref.New(backend.Float64, T)
	k.ref.RMSNormForward(rout, rrstd, nil, rx, rw, eps)
	k.check("rmsnorm out", k.download(out, T*D), k.get(rout), fp32Tol)
	gotRstd := k.download(rstd, T)
	k.check("rmsnorm rstd", gotRstd, k.get(rrstd), fp32Tol)

	g := k.randn(T*D, 1)
	dw0 := k.randn(D, 1) // dw accumulates
	dg, ddw := upload(k, g), upload(k, dw0)
	ddx := k.poisoned(T * D)
	// The backward takes the GPU's rstd; the reference gets the same values.
	k.launch("rmsnorm.cu", "rmsnorm_backward_dx_f32", Grid1D(T, 256), ddx, dg, dx, dw, rstd, int32(T), int32(D), float32(0))
	// dw: column sums per block row into partial, then their ordered sum.
	const rowsPerBlock = 16
	blockRows := (T + rowsPerBlock - 1) / rowsPerBlock
	partial := k.poisoned(blockRows * D)
	dwGrid := Grid{Grid: dim3((D+31)/32, blockRows), Block: dim3(32, 8)}
	k.launch("rmsnorm.cu", "rmsnorm_backward_dw_f32", dwGrid, partial, dg, dx, rstd, int32(T), int32(D), int32(rowsPerBlock))
	k.launch("rmsnorm.cu", "rmsnorm_dw_reduce_f32", Grid1D(4, 256), ddw, partial, int32(blockRows), int32(D))
	rdx, rdw := k.ref.New(backend.Float64, T, D), k.cpuF(dw0, D)
	k.ref.RMSNormBackward(rdx, rdw, k.cpuF(g, T, D), rx, rw, k.cpuF(gotRstd, T), 0)
	k.check("rmsnorm dx", k.download(ddx, T*D), k.get(rdx), fp32Tol)
	k.check("rmsnorm dw", k.download(ddw, D), k.get(rdw), fp32Tol)

	// The one-pass backward: dx, and dw's partial sums per block of rows
	// for the same reduce.
	ddx1, ddw1 := k.poisoned(T*D), upload(k, dw0)
	partial1 := k.poisoned(blockRows * D)
	k.launch("rmsnorm.cu", "rmsnorm_backward_f32", Grid1D(blockRows, 256), ddx1, partial1, dg, dx, dw, rstd, int32(T), int32(D), int32(rowsPerBlock), float32(0))
	k.launch("rmsnorm.cu", "rmsnorm_dw_reduce_f32", Grid1D(4, 256), ddw1, partial1, int32(blockRows), int32(D))
	k.check("rmsnorm one-pass dx", k.download(ddx1, T*D), k.get(rdx), fp32Tol)
	k.check("rmsnorm one-pass dw", k.download(ddw1, D), k.get(rdw), fp32Tol)
}

func TestKernelSwiGLU(t *testing.T) {
	k := newKT(t, 6)
	const N, F = 5, 777
	a, b, g := k.randn(N*F, 3), k.randn(N*F, 1), k.randn(N*F, 1)
	da, db, dg := upload(k, a), upload(k, b), upload(k, g)
	ra, rb := k.cpuF(a, N, F), k.cpuF(b, N, F)
	rout, rda, rdb := k.ref.New(backend.Float64, N, F), k.ref.New(backend.Float64, N, F), k.ref.New(backend.Float64, N, F)
	k.ref.SwiGLUForward(rout, ra, rb)
	k.ref.SwiGLUBackward(rda, rdb, k.cpuF(g, N, F), ra, rb)
	// N*F is odd, so the vector kernels run their scalar tail too.
	grid := k.d.StrideGrid(N*F, 256, 4)
	for _, suffix := range []string{"", "_x4"} {
		out, gda, gdb := k.poisoned(N*F), k.poisoned(N*F), k.poisoned(N*F)
		k.launch("swiglu.cu", "swiglu_forward_f32"+suffix, grid, out, da, db, int64(N*F))
		k.launch("swiglu.cu", "swiglu_backward_f32"+suffix, grid, gda, gdb, dg, da, db, int64(N*F))
		k.check("swiglu"+suffix+" out", k.download(out, N*F), k.get(rout), fp32Tol)
		k.check("swiglu"+suffix+" da", k.download(gda, N*F), k.get(rda), fp32Tol)
		k.check("swiglu"+suffix+" db", k.download(gdb, N*F), k.get(rdb), fp32Tol)
	}
}

func TestKernelAdamW(t *testing.T) {
	for _, name := range []string{"adamw_f32", "adamw_f32_x4"} {
		k := newKT(t, 7)
		const n = 10007 // odd: the vector kernel's scalar tail runs too
		p := k.randn(n, 1)
		dp, dm, dv := upload(k, p), upload(k, make([]float32, n)), upload(k, make([]float32, n))
		rp, rm, rv := k.cpuF(p, n), k.ref.New(backend.Float64, n), k.ref.New(backend.Float64, n)
		for step := 1; step <= 3; step++ {
			g := k.randn(n, 0.1)
			dg := upload(k, g)
			h := backend.AdamW{LR: 1e-2, Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.1, Step: step, GradScale: 0.5 + 0.25*float64(step)}
			bc1 := 1 - math.Pow(h.Beta1, float64(step))
			bc2 := 1 - math.Pow(h.Beta2, float64(step))
			k.launch("adamw.cu", name, k.d.StrideGrid(n, 256, 4), dp, dg, dm, dv, int64(n),
				h.LR, h.Beta1, h.Beta2, h.Eps, 1-h.LR*h.WeightDecay, bc1, bc2, h.GradScale, driver.DevicePtr(0))
			k.ref.AdamWUpdate(rp, k.cpuF(g, n), rm, rv, h)
		}
		k.check(name+" param", k.download(dp, n), k.get(rp), fp32Tol)
		k.check(name+" m", k.download(dm, n), k.get(rm), fp32Tol)
		k.check(name+" v", k.download(dv, n), k.get(rv), fp32Tol)
	}
}

func TestKernelCrossEntropy(t *testing.T) {
	for _, c := range []struct {
		kernel string
		block  int
		V      int
	}{
		{"cross_entropy_f32", 256, 5003},
		// The register kernel: a row shorter than its capacity, and a full
		// one (moe-small's vocabulary).
		{"cross_entropy_f32_reg", 1024, 5004},
		{"cross_entropy_f32_reg", 1024, ceRegMaxV},
	} {
		k := newKT(t, 8)
		const T = 19
		V := c.V
		logits := k.randn(T*V, 3)
		targets := k.ids(T, V)
		targets[3] = -1 // ignored
		targets[5] = int32(V - 1)
		scale := 1.0 / T
		rlogits, rtargets := k.cpuF(logits, T, V), k.cpuI(targets)
		rloss, rd := k.ref.New(backend.Float64, T), k.ref.New(backend.Float64, T, V)
		k.ref.CrossEntropy(rloss, rd, rlogits, rtargets, scale)
		dt := upload(k, targets)
		for _, mode := range []string{"separate", "in place", "loss only"} {
			what := fmt.Sprintf("%s V=%d %s", c.kernel, V, mode)
			dl := upload(k, logits)
			loss := k.poisoned(T)
			var dlogits *Buffer
			switch mode {
			case "separate":
				dlogits = k.poisoned(T * V)
			case "in place":
				dlogits = dl
			}
			k.launch("crossentropy.cu", c.kernel, Grid1D(T, c.block), loss, dlogits, dl, dt, int32(T), int32(V), float32(scale))
			k.check(what+": loss", k.download(loss, T), k.get(rloss), fp32Tol)
			if dlogits != nil {
				k.check(what+": dlogits", k.download(dlogits, T*V), k.get(rd), 1e-5)
			} else {
				k.check(what+": logits untouched", k.download(dl, T*V), k.get(rlogits), 0)
			}
		}
	}
}

func TestKernelRows(t *testing.T) {
	k := newKT(t, 9)
	const T, N, D = 50, 80, 129
	in := k.randn(T*D, 1)
	rows := k.ids(N, T)
	scale := k.randn(N, 1)
	din, drows, dscale := upload(k, in), upload(k, rows), upload(k, scale)
	rin, rrows, rscale := k.cpuF(in, T, D), k.cpuI(rows), k.cpuF(scale, N)
	for _, scaled := range []bool{true, false} {
		sc, rsc, name := dscale, rscale, "scaled"
		if !scaled {
			sc, rsc, name = nil, nil, "unscaled"
		}
		out := k.poisoned(N * D)
		k.launch("rows.cu", "gather_rows_f32", Grid1D(N, 256), out, din, drows, sc, int32(N), int32(D))
		rout := k.ref.New(backend.Float64, N, D)
		k.ref.GatherRows(rout, rin, rrows, rsc)
		k.check("gather "+name, k.download(out, N*D), k.get(rout), fp32Tol)

		src := k.randn(N*D, 1)
		acc := k.randn(T*D, 1)
		dacc := upload(k, acc)
		k.launch("rows.cu", "scatter_add_rows_f32", Grid1D(N, 256), dacc, upload(k, src), drows, sc, int32(N), int32(D))
		racc := k.cpuF(acc, T, D)
		k.ref.ScatterAddRows(racc, k.cpuF(src, N, D), rrows, rsc)
		k.check("scatter-add "+name, k.download(dacc, T*D), k.get(racc), fp32Tol)
	}
	b := k.randn(N*D, 1)
	rdots := k.ref.New(backend.Float64, N)
	k.ref.RowDots(rdots, rin, rrows, k.cpuF(b, N, D))
	// One warp a row: a grid of fewer warps than rows strides over them
	// (D is odd, so one element an access; the conformance suite's
	// RowDots cases take the four-wide path through the Backend).
	dots := k.poisoned(N)
	k.launch("rows.cu", "row_dots_f32", Grid1D(3, 64), dots, din, drows, upload(k, b), int32(N), int32(D), int32(0))
	k.check("row dots", k.download(dots, N), k.get(rdots), fp32Tol)
}

func dim3(x, y int) driver.Dim3 { return driver.Dim3{X: x, Y: y, Z: 1} }
