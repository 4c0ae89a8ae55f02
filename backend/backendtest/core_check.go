package backendtest

// Float64 checks of the core ops, run by GradCheck: "ref" cases compare an
// op's forward with a naive formulation written here independently of any
// backend; "grad" cases compare a backward op with central finite
// differences of the forward, reduced to a scalar by a random projection R
// (loss = sum(R ⊙ output)), so the backward receives dout = R.

import (
	"fmt"
	"math"
	"math/cmplx"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"gorgonia.org/tensor"
)

const (
	// refTol is the tolerance of naive-reference checks in float64.
	refTol = 1e-11
	// gradTol is the tolerance of finite-difference checks.
	gradTol = 1e-6
)

// checker bundles what one float64 check needs.
type checker struct {
	t   *testing.T
	b   backend.Backend
	rng *rand.Rand
}

func newChecker(t *testing.T, b backend.Backend) *checker {
	return &checker{t: t, b: b, rng: NewRand(t.Name())}
}

// rand draws n values from [lo, hi).
func (c *checker) rand(n int, lo, hi float64) []float64 { return RandFloats(c.rng, n, lo, hi) }

func (c *checker) up(data []float64, shape ...int) backend.Tensor { return Upload(c.b, data, shape...) }

func (c *checker) upInts(data []int32, shape ...int) backend.Tensor {
	return UploadInts(c.b, data, shape...)
}

func (c *checker) down(t backend.Tensor) []float64 { return Download(c.b, t) }

// out allocates an output of the given shape filled with NaN.
func (c *checker) out(shape ...int) backend.Tensor {
	nan := make([]float64, numel(shape))
	for i := range nan {
		nan[i] = math.NaN()
	}
	return c.up(nan, shape...)
}

// projected returns a loss for CheckGrad: it uploads x into xT, runs the
// forward op and dots outT with r.
func (c *checker) projected(xT backend.Tensor, x []float64, forward func(), outT backend.Tensor, r []float64) func() float64 {
	return func() float64 {
		Set(c.b, xT, x)
		forward()
		return Dot(r, c.down(outT))
	}
}

func (c *checker) same(what string, got, want []float64) {
	c.t.Helper()
	CompareFloats(c.t, what, got, want, refTol)
}

func sub(a, b []float64) []float64 {
	out := make([]float64, len(a))
	for i := range a {
		out[i] = a[i] - b[i]
	}
	return out
}

func checkCases() []Case {
	return []Case{
		{Name: "Elementwise/ref", Check: checkElementwise},
		{Name: "MatMul/ref", Check: checkMatMulRef},
		{Name: "MatMul/grad/linear", Check: checkMatMulLinear},
		{Name: "MatMul/grad/layouts", Check: checkMatMulLayouts},
		{Name: "Embedding/ref", Check: checkEmbeddingRef},
		{Name: "Embedding/grad", Check: checkEmbeddingGrad},
		{Name: "RMSNorm/ref", Check: checkRMSNormRef},
		{Name: "RMSNorm/grad", Check: checkRMSNormGrad},
		{Name: "RMSNorm/bf16-out", Check: checkRMSNormBF16Out},
		{Name: "RoPE/ref", Check: checkRoPERef},
		{Name: "RoPE/grad", Check: checkRoPEGrad},
		{Name: "SwiGLU/ref", Check: checkSwiGLURef},
		{Name: "SwiGLU/grad", Check: checkSwiGLUGrad},
		{Name: "CrossEntropy/ref", Check: checkCrossEntropyRef},
		{Name: "CrossEntropy/grad", Check: checkCrossEntropyGrad},
		{Name: "Rows/ref", Check: checkRowsRef},
		{Name: "Rows/grad", Check: checkRowsGrad},
		{Name: "AdamWUpdate/ref", Check: checkAdamWRef},
		{Name: "AdamWUpdateSplit/ref", Check: checkAdamWSplit},
		{Name: "StartDownload/ref", Check: checkStartDownload},
	}
}

// checkStartDownload checks that a queued download returns its tensor as
// the work queued before it left it, not as later work changes it: ints
// (the MoE counts' dtype), floats and bf16, and two downloads in flight
// at once waited for out of order.
func checkStartDownload(t *testing.T, b backend.Backend) {
	ints := UploadInts(b, []int32{3, -1, 7, 0, 9}, 5)
	floats := b.New(b.FloatType(), 3)
	backend.UploadSlice(b, floats, []float32{0.5, -2, 1e6})
	bf := b.New(backend.BFloat16, 3)
	b.Copy(bf, floats)
	b.Scale(floats, 3) // queued before: the download sees it
	pendInts, pendFloats, pendBF := b.StartDownload(ints), b.StartDownload(floats), b.StartDownload(bf)
	// Queued after: the downloads must not see these.
	b.Zero(ints)
	b.Zero(floats)
	b.Zero(bf)
	f32 := func(d *tensor.Dense) []float32 {
		if v, ok := backend.HostData(d).([]float64); ok {
			out := make([]float32, len(v))
			for i, x := range v {
				out[i] = float32(x)
			}
			return out
		}
		return backend.HostData(d).([]float32)
	}
	if got := f32(pendFloats()); !slices.Equal(got, []float32{1.5, -6, 3e6}) {
		t.Errorf("floats = %v, want [1.5 -6 3e+06]", got)
	}
	if got := backend.HostData(pendInts()).([]int32); !slices.Equal(got, []int32{3, -1, 7, 0, 9}) {
		t.Errorf("ints = %v, want [3 -1 7 0 9]", got)
	}
	if got := f32(pendBF()); !slices.Equal(got, []float32{0.5, -2, 999424}) {
		t.Errorf("bf16 = %v, want [0.5 -2 999424] (1e6 rounded to bf16)", got)
	}
	if got := DownloadInts(b, ints); !slices.Equal(got, make([]int32, 5)) {
		t.Errorf("ints after the zeroing = %v, want zeros", got)
	}
}

func checkElementwise(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const n = 1000
	x, y := c.rand(n, -1, 1), c.rand(n, -1, 1)
	xT, yT := c.up(x, n), c.up(y, n)

	var sum, ss float64
	for _, v := range x {
		sum += v
		ss += v * v
	}
	c.same("Sum", []float64{b.Sum(xT)}, []float64{sum})
	c.same("SumSquares", []float64{b.SumSquares(xT)}, []float64{ss})

	b.Axpy(yT, -0.3, xT)
	want := make([]float64, n)
	for i := range want {
		want[i] = y[i] - 0.3*x[i]
	}
	c.same("Axpy", c.down(yT), want)

	b.Scale(yT, 2.5)
	for i := range want {
		want[i] *= 2.5
	}
	c.same("Scale", c.down(yT), want)

	b.Copy(yT, xT)
	c.same("Copy", c.down(yT), x)

	b.Zero(yT)
	c.same("Zero", c.down(yT), make([]float64, n))
}

// naiveMatMul returns alpha*op(a)*op(b) + beta*c for op(a) [m,k], op(b) [k,n].
func naiveMatMul(a, b, cm []float64, m, n, k int, transA, transB bool, alpha, beta float64) []float64 {
	at := func(i, kk int) float64 {
		if transA {
			return a[kk*m+i]
		}
		return a[i*k+kk]
	}
	bt := func(kk, j int) float64 {
		if transB {
			return b[j*k+kk]
		}
		return b[kk*n+j]
	}
	out := make([]float64, m*n)
	for i := range m {
		for j := range n {
			var s float64
			for kk := range k {
				s += at(i, kk) * bt(kk, j)
			}
			out[i*n+j] = alpha*s + beta*cm[i*n+j]
		}
	}
	return out
}

func checkMatMulRef(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	// The second shape crosses the CPU kernel's k and j blocks.
	for _, s := range []struct{ m, n, k int }{{3, 4, 5}, {5, 530, 141}} {
		for _, l := range mmLayouts() {
			a, bm, cm := c.rand(s.m*s.k, -1, 1), c.rand(s.k*s.n, -1, 1), c.rand(s.m*s.n, -1, 1)
			for _, beta := range []float64{0, -0.4} {
				outT := c.up(cm, s.m, s.n)
				b.MatMul(outT, c.up(a, l.aShape(s.m, s.k)...), c.up(bm, l.bShape(s.k, s.n)...), l.transA, l.transB, 0.7, beta)
				c.same(l.name, c.down(outT), naiveMatMul(a, bm, cm, s.m, s.n, s.k, l.transA, l.transB, 0.7, beta))
			}
		}
	}
}

// checkMatMulLinear checks the gradients of a linear layer y = x·wᵀ as the
// engine computes them: dx = dy·w and dw = dyᵀ·x.
func checkMatMulLinear(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const tok, din, dout = 6, 5, 4
	x, w, r := c.rand(tok*din, -1, 1), c.rand(dout*din, -1, 1), c.rand(tok*dout, -1, 1)
	xT, wT, rT, yT := c.up(x, tok, din), c.up(w, dout, din), c.up(r, tok, dout), c.out(tok, dout)
	forward := func() { b.MatMul(yT, xT, wT, false, true, 1, 0) }

	dxT, dwT := c.out(tok, din), c.out(dout, din)
	b.MatMul(dxT, rT, wT, false, false, 1, 0)
	b.MatMul(dwT, rT, xT, true, false, 1, 0)
	CheckGrad(t, "dx = dy·w", c.projected(xT, x, forward, yT, r), x, c.down(dxT), gradTol)
	CheckGrad(t, "dw = dyᵀ·x", c.projected(wT, w, forward, yT, r), w, c.down(dwT), gradTol)
}

// checkMatMulLayouts checks, for every layout, that out = alpha*op(a)*op(b)
// + beta*c has the gradients the other layouts compute:
//
//	d op(a) = alpha R op(b)ᵀ,  d op(b) = alpha op(a)ᵀ R,  dc = beta R.
func checkMatMulLayouts(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const m, n, k, alpha, beta = 4, 3, 5, 0.8, -1.3
	for _, l := range mmLayouts() {
		a, bm, cm, r := c.rand(m*k, -1, 1), c.rand(k*n, -1, 1), c.rand(m*n, -1, 1), c.rand(m*n, -1, 1)
		aT, bT, cT, rT := c.up(a, l.aShape(m, k)...), c.up(bm, l.bShape(k, n)...), c.up(cm, m, n), c.up(r, m, n)
		outT := c.out(m, n)
		forward := func() {
			Set(b, outT, cm)
			b.MatMul(outT, aT, bT, l.transA, l.transB, alpha, beta)
		}
		daT, dbT := c.out(l.aShape(m, k)...), c.out(l.bShape(k, n)...)
		if l.transA { // da = (alpha R op(b)ᵀ)ᵀ = alpha op(b) Rᵀ
			b.MatMul(daT, bT, rT, l.transB, true, alpha, 0)
		} else {
			b.MatMul(daT, rT, bT, false, !l.transB, alpha, 0)
		}
		if l.transB { // db = (alpha op(a)ᵀ R)ᵀ = alpha Rᵀ op(a)
			b.MatMul(dbT, rT, aT, true, l.transA, alpha, 0)
		} else {
			b.MatMul(dbT, aT, rT, !l.transA, false, alpha, 0)
		}
		CheckGrad(t, l.name+" da", c.projected(aT, a, forward, outT, r), a, c.down(daT), gradTol)
		CheckGrad(t, l.name+" db", c.projected(bT, bm, forward, outT, r), bm, c.down(dbT), gradTol)
		dc := make([]float64, len(r))
		for i, v := range r {
			dc[i] = beta * v
		}
		// forward resets out to cm, so perturbing cm perturbs the input c.
		CheckGrad(t, l.name+" dc", c.projected(cT, cm, forward, outT, r), cm, dc, gradTol)
	}
}

func checkEmbeddingRef(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const v, tok, d = 11, 9, 6
	table, ids := c.rand(v*d, -1, 1), RandInts(c.rng, tok, 0, v)
	outT := c.out(tok, d)
	b.EmbeddingForward(outT, c.up(table, v, d), c.upInts(ids, tok))
	want := make([]float64, 0, tok*d)
	for _, id := range ids {
		want = append(want, table[int(id)*d:int(id+1)*d]...)
	}
	c.same("EmbeddingForward", c.down(outT), want)
}

func checkEmbeddingGrad(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const v, tok, d = 7, 12, 5 // more tokens than rows: ids repeat
	table, r, d0 := c.rand(v*d, -1, 1), c.rand(tok*d, -1, 1), c.rand(v*d, -1, 1)
	idsT := c.upInts(RandInts(c.rng, tok, 0, v), tok)
	tableT, outT := c.up(table, v, d), c.out(tok, d)
	forward := func() { b.EmbeddingForward(outT, tableT, idsT) }
	dT := c.up(d0, v, d) // EmbeddingBackward accumulates onto d0
	b.EmbeddingBackward(dT, c.up(r, tok, d), idsT)
	CheckGrad(t, "dtable", c.projected(tableT, table, forward, outT, r), table, sub(c.down(dT), d0), gradTol)
}

func checkRMSNormRef(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const tok, d, eps = 5, 12, 1e-3
	x, w := c.rand(tok*d, -2, 2), c.rand(d, 0.5, 1.5)
	outT, rstdT, copyT := c.out(tok, d), c.out(tok), c.out(tok, d)
	b.RMSNormForward(outT, rstdT, copyT, c.up(x, tok, d), c.up(w, d), eps)
	c.same("copy", c.down(copyT), x)
	out, rstd := make([]float64, tok*d), make([]float64, tok)
	for r := range tok {
		row := x[r*d : (r+1)*d]
		rms := math.Sqrt(Dot(row, row)/d + eps)
		rstd[r] = 1 / rms
		for i, v := range row {
			out[r*d+i] = w[i] * v / rms
		}
	}
	c.same("out", c.down(outT), out)
	c.same("rstd", c.down(rstdT), rstd)
}

func checkRMSNormGrad(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const tok, d, eps = 4, 7, 1e-3
	x, w, r, dw0 := c.rand(tok*d, -2, 2), c.rand(d, 0.5, 1.5), c.rand(tok*d, -1, 1), c.rand(d, -1, 1)
	xT, wT, outT, rstdT := c.up(x, tok, d), c.up(w, d), c.out(tok, d), c.out(tok)
	forward := func() { b.RMSNormForward(outT, rstdT, nil, xT, wT, eps) }
	forward()
	dxT, dwT := c.out(tok, d), c.up(dw0, d) // dw accumulates onto dw0
	b.RMSNormBackward(dxT, dwT, c.up(r, tok, d), xT, wT, rstdT, 0)
	dx := c.down(dxT)
	CheckGrad(t, "dx", c.projected(xT, x, forward, outT, r), x, dx, gradTol)
	CheckGrad(t, "dw", c.projected(wT, w, forward, outT, r), w, sub(c.down(dwT), dw0), gradTol)
	// beta 1 adds the same gradient onto what dx held; beta 0.5 scales
	// it first.
	for _, beta := range []float64{1, 0.5} {
		held := c.rand(tok*d, -1, 1)
		dxT := c.up(held, tok, d)
		b.RMSNormBackward(dxT, c.up(dw0, d), c.up(r, tok, d), xT, wT, rstdT, beta)
		want := make([]float64, len(dx))
		for i := range want {
			want[i] = beta*held[i] + dx[i]
		}
		c.same(fmt.Sprintf("dx with beta %v", beta), c.down(dxT), want)
	}
}

// checkRMSNormBF16Out checks that a bf16 out holds the float output
// rounded once.
func checkRMSNormBF16Out(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const tok, d, eps = 5, 9, 1e-5
	xT, wT := c.up(c.rand(tok*d, -2, 2), tok, d), c.up(c.rand(d, 0.5, 1.5), d)
	outT, rstdT := c.out(tok, d), c.out(tok)
	b.RMSNormForward(outT, rstdT, nil, xT, wT, eps)
	want := c.down(outT)
	for i, v := range want {
		want[i] = RoundBF16(v)
	}
	bfT := UploadBF16(b, make([]float64, tok*d), tok, d)
	b.RMSNormForward(bfT, rstdT, nil, xT, wT, eps)
	c.same("bf16 out", Download(b, bfT), want)
}

// naiveRoPE rotates each pair (x[i], x[i+Dh/2]) of each head as the complex
// number x[i] + i·x[i+Dh/2] multiplied by e^{i·pos·theta^(-2i/Dh)}.
func naiveRoPE(x []float64, pos []int32, q, dh int, theta float64) []float64 {
	out := make([]float64, len(x))
	half := dh / 2
	for t, p := range pos {
		for h := 0; h < q; h += dh {
			for i := range half {
				freq := math.Exp(-float64(2*i) / float64(dh) * math.Log(theta))
				z := complex(x[t*q+h+i], x[t*q+h+half+i]) * cmplx.Exp(complex(0, float64(p)*freq))
				out[t*q+h+i], out[t*q+h+half+i] = real(z), imag(z)
			}
		}
	}
	return out
}

func checkRoPERef(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const tok, heads, dh, theta = 6, 3, 10, 10000
	x, pos := c.rand(tok*heads*dh, -1, 1), RandInts(c.rng, tok, 0, 4096)
	xT, posT := c.up(x, tok, heads*dh), c.upInts(pos, tok)
	want := naiveRoPE(x, pos, heads*dh, dh, theta)
	// Into another tensor, x unchanged; then in place, and back.
	outT := c.out(tok, heads*dh)
	b.RoPE(outT, xT, posT, dh, theta, false)
	c.same("RoPE into out", c.down(outT), want)
	c.same("RoPE's x", c.down(xT), x)
	b.RoPE(xT, xT, posT, dh, theta, false)
	c.same("RoPE in place", c.down(xT), want)
	b.RoPE(xT, xT, posT, dh, theta, true)
	c.same("inverse(RoPE(x))", c.down(xT), x)
	// A bf16 out holds the rotation rounded once.
	bfT := UploadBF16(b, make([]float64, tok*heads*dh), tok, heads*dh)
	b.RoPE(bfT, xT, posT, dh, theta, false)
	rounded := make([]float64, len(want))
	for i, v := range want {
		rounded[i] = RoundBF16(v)
	}
	c.same("RoPE into bf16 out", Download(b, bfT), rounded)
}

// checkRoPEGrad checks that each direction's backward is the other
// direction: the rotation is orthogonal.
func checkRoPEGrad(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const tok, heads, dh, theta = 4, 2, 6, 500
	posT := c.upInts(RandInts(c.rng, tok, 0, 100), tok)
	for _, inverse := range []bool{false, true} {
		x, r := c.rand(tok*heads*dh, -1, 1), c.rand(tok*heads*dh, -1, 1)
		xT := c.up(x, tok, heads*dh)
		dT := c.up(r, tok, heads*dh)
		b.RoPE(dT, dT, posT, dh, theta, !inverse)
		f := c.projected(xT, x, func() { b.RoPE(xT, xT, posT, dh, theta, inverse) }, xT, r)
		name := "RoPE backward is inverse RoPE"
		if inverse {
			name = "inverse RoPE backward is RoPE"
		}
		CheckGrad(t, name, f, x, c.down(dT), gradTol)
	}
}

func checkSwiGLURef(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const n, f = 4, 9
	a, bv := c.rand(n*f, -6, 6), c.rand(n*f, -1, 1)
	outT := c.out(n, f)
	b.SwiGLUForward(outT, c.up(a, n, f), c.up(bv, n, f))
	want := make([]float64, n*f)
	for i := range want {
		want[i] = a[i] / (1 + math.Exp(-a[i])) * bv[i]
	}
	c.same("SwiGLUForward", c.down(outT), want)
}

func checkSwiGLUGrad(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const n, f = 3, 8
	a, bv, r := c.rand(n*f, -5, 5), c.rand(n*f, -1, 1), c.rand(n*f, -1, 1)
	aT, bT, outT := c.up(a, n, f), c.up(bv, n, f), c.out(n, f)
	forward := func() { b.SwiGLUForward(outT, aT, bT) }
	daT, dbT := c.out(n, f), c.out(n, f)
	b.SwiGLUBackward(daT, dbT, c.up(r, n, f), aT, bT)
	CheckGrad(t, "da", c.projected(aT, a, forward, outT, r), a, c.down(daT), gradTol)
	CheckGrad(t, "db", c.projected(bT, bv, forward, outT, r), bv, c.down(dbT), gradTol)
}

func checkCrossEntropyRef(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const tok, v, scale = 6, 7, 0.25
	logits := c.rand(tok*v, -3, 3)
	targets := RandInts(c.rng, tok, 0, v)
	targets[2] = -1 // ignored
	targetsT := c.upInts(targets, tok)

	// Direct log-softmax, with no max shift (the logits are small).
	loss, dl := make([]float64, tok), make([]float64, tok*v)
	for r, tg := range targets {
		if tg < 0 {
			continue
		}
		var z float64
		for _, l := range logits[r*v : (r+1)*v] {
			z += math.Exp(l)
		}
		loss[r] = -math.Log(math.Exp(logits[r*v+int(tg)]) / z)
		for j, l := range logits[r*v : (r+1)*v] {
			dl[r*v+j] = scale * math.Exp(l) / z
		}
		dl[r*v+int(tg)] -= scale
	}

	lossT, dlT := c.out(tok), c.out(tok, v)
	b.CrossEntropy(lossT, dlT, c.up(logits, tok, v), targetsT, scale)
	c.same("loss", c.down(lossT), loss)
	c.same("dlogits", c.down(dlT), dl)

	// Writing the gradient over the logits, or not at all, changes nothing.
	inPlace, lossT2 := c.up(logits, tok, v), c.out(tok)
	b.CrossEntropy(lossT2, inPlace, inPlace, targetsT, scale)
	c.same("loss (in place)", c.down(lossT2), loss)
	c.same("dlogits (in place)", c.down(inPlace), dl)
	lossT3 := c.out(tok)
	b.CrossEntropy(lossT3, nil, c.up(logits, tok, v), targetsT, scale)
	c.same("loss (no dlogits)", c.down(lossT3), loss)

	// Shifting every logit by 600 (exp overflows) changes neither.
	shifted := make([]float64, len(logits))
	for i, l := range logits {
		shifted[i] = l + 600
	}
	lossT4, dlT4 := c.out(tok), c.out(tok, v)
	b.CrossEntropy(lossT4, dlT4, c.up(shifted, tok, v), targetsT, scale)
	CompareFloats(t, "loss (shifted by 600)", c.down(lossT4), loss, 1e-9)
	CompareFloats(t, "dlogits (shifted by 600)", c.down(dlT4), dl, 1e-9)
}

func checkCrossEntropyGrad(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const tok, v, scale = 5, 6, 0.7
	logits := c.rand(tok*v, -3, 3)
	targets := RandInts(c.rng, tok, 0, v)
	targets[1] = -1
	logitsT, targetsT, lossT := c.up(logits, tok, v), c.upInts(targets, tok), c.out(tok)
	dlT := c.out(tok, v)
	b.CrossEntropy(lossT, dlT, logitsT, targetsT, scale)
	ones := make([]float64, tok)
	for i := range ones {
		ones[i] = scale
	}
	// loss = scale * sum(lossT)
	f := c.projected(logitsT, logits, func() { b.CrossEntropy(lossT, nil, logitsT, targetsT, 1) }, lossT, ones)
	CheckGrad(t, "dlogits", f, logits, c.down(dlT), gradTol)
}

func checkRowsRef(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const tok, n, d = 5, 9, 4 // n > tok: rows repeat
	in, s, rows := c.rand(tok*d, -1, 1), c.rand(n, -1, 1), RandInts(c.rng, n, 0, tok)
	inT, sT, rowsT := c.up(in, tok, d), c.up(s, n), c.upInts(rows, n)

	gathered, gatheredScaled := make([]float64, n*d), make([]float64, n*d)
	for i, r := range rows {
		for j := range d {
			gathered[i*d+j] = in[int(r)*d+j]
			gatheredScaled[i*d+j] = s[i] * in[int(r)*d+j]
		}
	}
	gT := c.out(n, d)
	b.GatherRows(gT, inT, rowsT, nil)
	c.same("GatherRows", c.down(gT), gathered)
	b.GatherRows(gT, inT, rowsT, sT)
	c.same("GatherRows (scaled)", c.down(gT), gatheredScaled)

	src, out0 := c.rand(n*d, -1, 1), c.rand(tok*d, -1, 1)
	want, wantScaled := append([]float64(nil), out0...), append([]float64(nil), out0...)
	for i, r := range rows {
		for j := range d {
			want[int(r)*d+j] += src[i*d+j]
			wantScaled[int(r)*d+j] += s[i] * src[i*d+j]
		}
	}
	outT := c.up(out0, tok, d)
	b.ScatterAddRows(outT, c.up(src, n, d), rowsT, nil)
	c.same("ScatterAddRows", c.down(outT), want)
	outT = c.up(out0, tok, d)
	b.ScatterAddRows(outT, c.up(src, n, d), rowsT, sT)
	c.same("ScatterAddRows (scaled)", c.down(outT), wantScaled)

	// The same additions as a gather: token r's rows are the i with
	// rows[i] = r (at most n), in increasing i, the rest -1.
	const k = n
	pos := make([]int32, tok*k)
	for j := range pos {
		pos[j] = -1
	}
	scaleTK, filled := make([]float64, tok*k), make([]int, tok)
	for i, r := range rows {
		pos[int(r)*k+filled[r]], scaleTK[int(r)*k+filled[r]] = int32(i), s[i]
		filled[r]++
	}
	srcT, posT := c.up(src, n, d), c.upInts(pos, tok, k)
	outT = c.up(out0, tok, d)
	b.GatherSumRows(outT, srcT, posT, nil)
	c.same("GatherSumRows", c.down(outT), want)
	outT = c.up(out0, tok, d)
	b.GatherSumRows(outT, srcT, posT, c.up(scaleTK, tok, k))
	c.same("GatherSumRows (scaled)", c.down(outT), wantScaled)

	dots := make([]float64, n)
	for i, r := range rows {
		dots[i] = Dot(in[int(r)*d:int(r+1)*d], src[i*d:(i+1)*d])
	}
	dT := c.out(n)
	b.RowDots(dT, inT, rowsT, c.up(src, n, d))
	c.same("RowDots", c.down(dT), dots)
}

// checkRowsGrad checks that GatherRows and ScatterAddRows are each other's
// backward, and that RowDots is the backward of either with respect to the
// scales.
func checkRowsGrad(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const tok, n, d = 4, 7, 3
	rowsT := c.upInts(RandInts(c.rng, n, 0, tok), n)

	// out = GatherRows(x, s): dx = ScatterAddRows(R, s), ds = RowDots(x, R).
	x, s, r := c.rand(tok*d, -1, 1), c.rand(n, -1, 1), c.rand(n*d, -1, 1)
	xT, sT, rT, gT := c.up(x, tok, d), c.up(s, n), c.up(r, n, d), c.out(n, d)
	gather := func() { b.GatherRows(gT, xT, rowsT, sT) }
	dxT, dsT := c.up(make([]float64, tok*d), tok, d), c.out(n)
	b.ScatterAddRows(dxT, rT, rowsT, sT)
	b.RowDots(dsT, xT, rowsT, rT)
	CheckGrad(t, "GatherRows dx", c.projected(xT, x, gather, gT, r), x, c.down(dxT), gradTol)
	CheckGrad(t, "GatherRows dscale", c.projected(sT, s, gather, gT, r), s, c.down(dsT), gradTol)

	// out = out0 + ScatterAddRows(y, s): dy = GatherRows(Q, s), ds = RowDots(Q, y).
	y, q, out0 := c.rand(n*d, -1, 1), c.rand(tok*d, -1, 1), c.rand(tok*d, -1, 1)
	yT, qT, oT := c.up(y, n, d), c.up(q, tok, d), c.out(tok, d)
	scatter := func() {
		Set(b, oT, out0)
		b.ScatterAddRows(oT, yT, rowsT, sT)
	}
	dyT := c.out(n, d)
	b.GatherRows(dyT, qT, rowsT, sT)
	b.RowDots(dsT, qT, rowsT, yT)
	CheckGrad(t, "ScatterAddRows din", c.projected(yT, y, scatter, oT, q), y, c.down(dyT), gradTol)
	CheckGrad(t, "ScatterAddRows dscale", c.projected(sT, s, scatter, oT, q), s, c.down(dsT), gradTol)

	// out = out0 + GatherSumRows(y, pos, g): dy[pos[t,k]] = g[t,k]·Q[t],
	// dg[t,k] = dot(Q[t], y[pos[t,k]]), written out.
	const k = 3
	pos := SendPositions(c.rng, tok, k, n)
	g := c.rand(tok*k, -1, 1)
	posT, gT2 := c.upInts(pos, tok, k), c.up(g, tok, k)
	sum := func() {
		Set(b, oT, out0)
		b.GatherSumRows(oT, yT, posT, gT2)
	}
	wantDy, wantDg := make([]float64, n*d), make([]float64, tok*k)
	for j, p := range pos {
		if p < 0 {
			continue
		}
		tk := j / k
		for c := range d {
			wantDy[int(p)*d+c] += g[j] * q[tk*d+c]
		}
		wantDg[j] = Dot(q[tk*d:(tk+1)*d], y[int(p)*d:int(p+1)*d])
	}
	CheckGrad(t, "GatherSumRows din", c.projected(yT, y, sum, oT, q), y, wantDy, gradTol)
	CheckGrad(t, "GatherSumRows dscale", c.projected(gT2, g, sum, oT, q), g, wantDg, gradTol)
}

func checkAdamWRef(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const n = 50
	p, m, v := c.rand(n, -1, 1), make([]float64, n), make([]float64, n)
	pT, mT, vT := c.up(p, n), c.up(m, n), c.up(v, n)
	h := backend.AdamW{LR: 0.01, Beta1: 0.9, Beta2: 0.99, Eps: 1e-6, WeightDecay: 0.2}
	for step := 1; step <= 3; step++ {
		g := c.rand(n, -1, 1)
		h.Step = step
		// Step 1 leaves the gradient as it is (GradScale 0 means 1); the
		// others scale it first, as clipping does before torch's step.
		h.GradScale = []float64{0, 0.5, 1.25}[step-1]
		b.AdamWUpdate(pT, c.up(g, n), mT, vT, h)
		if h.GradScale != 0 {
			for i := range g {
				g[i] *= h.GradScale
			}
		}
		// torch.optim.AdamW, written out.
		for i := range p {
			p[i] *= 1 - h.LR*h.WeightDecay
			m[i] = h.Beta1*m[i] + (1-h.Beta1)*g[i]
			v[i] = h.Beta2*v[i] + (1-h.Beta2)*g[i]*g[i]
			mhat := m[i] / (1 - math.Pow(h.Beta1, float64(step)))
			vhat := v[i] / (1 - math.Pow(h.Beta2, float64(step)))
			p[i] -= h.LR * mhat / (math.Sqrt(vhat) + h.Eps)
		}
		c.same("param", c.down(pT), p)
		c.same("m", c.down(mT), m)
		c.same("v", c.down(vT), v)
	}
}

// CheckAdamWSplit is the AdamWUpdateSplit/ref check, for a backend that
// GradCheck runs in float64 but that also has a float32 build (the CPU).
func CheckAdamWSplit(t *testing.T, b backend.Backend) { checkAdamWSplit(t, b) }

// checkAdamWSplit holds AdamWUpdateSplit to the backend's own AdamWUpdate
// on the joined float32 masters, bit for bit, over three steps: the
// masters (joined from the halves), the moments, and hi being the
// masters' split. The masters include exact ties (low bits 0x8000, which
// round away from zero), values whose rounding carries into the exponent,
// and zeros. A backend whose float type is not float32 must refuse it.
func checkAdamWSplit(t *testing.T, b backend.Backend) {
	const n = 4098
	if b.FloatType() != backend.Float32 {
		defer func() {
			if recover() == nil {
				t.Errorf("AdamWUpdateSplit on a %v backend did not refuse", b.FloatType())
			}
		}()
		b.AdamWUpdateSplit(b.New(backend.BFloat16, 2), b.New(backend.Int32, 1), b.New(b.FloatType(), 2), b.New(b.FloatType(), 2), b.New(b.FloatType(), 2), backend.AdamW{Step: 1})
		return
	}
	rng := rand.New(rand.NewPCG(7, 11))
	w := make([]float32, n)
	for i := range w {
		w[i] = float32(rng.NormFloat64() * 0.05)
		switch i % 7 {
		case 0: // an exact tie
			w[i] = math.Float32frombits(math.Float32bits(w[i])&^0xffff | 0x8000)
		case 1: // the low bits all ones: hi rounds up into the next binade
			w[i] = math.Float32frombits(0x3f7fffff ^ uint32(i%2)<<31)
		case 2:
			w[i] = 0
		}
	}
	hiHost, loHost := backend.SplitMasters(w)
	hiT, loT := b.New(backend.BFloat16, n), b.New(backend.Int32, n/2)
	backend.UploadSlice(b, hiT, hiHost)
	backend.UploadSlice(b, loT, loHost)
	wT := b.New(backend.Float32, n)
	backend.UploadSlice(b, wT, w)
	moments := func() (backend.Tensor, backend.Tensor) {
		m, v := b.New(backend.Float32, n), b.New(backend.Float32, n)
		b.Zero(m)
		b.Zero(v)
		return m, v
	}
	mS, vS := moments()
	mF, vF := moments()
	h := backend.AdamW{LR: 1e-3, Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.1}
	for step := 1; step <= 3; step++ {
		g := make([]float32, n)
		for i := range g {
			g[i] = float32(rng.NormFloat64())
		}
		gT := b.New(backend.Float32, n)
		backend.UploadSlice(b, gT, g)
		h.Step, h.GradScale = step, []float64{0, 0.5, 1.25}[step-1]
		b.AdamWUpdateSplit(hiT, loT, gT, mS, vS, h)
		b.AdamWUpdate(wT, gT, mF, vF, h)
		hi, lo := backend.DownloadFloat32(b, hiT), backend.DownloadInt32(b, loT)
		want := backend.DownloadFloat32(b, wT)
		got := backend.JoinMasters(hi, lo)
		for i := range want {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
				t.Fatalf("step %d: master %d is %x joined from its halves, %x from AdamWUpdate", step, i, math.Float32bits(got[i]), math.Float32bits(want[i]))
			}
			if wantHi, _ := backend.SplitMaster(want[i]); math.Float32bits(hi[i]) != math.Float32bits(wantHi) {
				t.Fatalf("step %d: hi[%d] is %x, want %x (the split of %x)", step, i, math.Float32bits(hi[i]), math.Float32bits(wantHi), math.Float32bits(want[i]))
			}
		}
		for _, mv := range [][2]backend.Tensor{{mS, mF}, {vS, vF}} {
			a, c := backend.DownloadFloat32(b, mv[0]), backend.DownloadFloat32(b, mv[1])
			for i := range a {
				if math.Float32bits(a[i]) != math.Float32bits(c[i]) {
					t.Fatalf("step %d: a moment differs at %d: %g, want %g", step, i, a[i], c[i])
				}
			}
		}
	}
}
