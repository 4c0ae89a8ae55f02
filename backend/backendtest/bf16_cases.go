package backendtest

// Cases of the ops that take or produce BFloat16 tensors (the operands of
// MatMul, see backend.Backend.OperandType): MatMul with every combination
// of bf16 and float operands and outputs, GatherRows into bf16, SwiGLU
// forward and backward with bf16 inputs and/or outputs, and Zero and Copy.
// Inputs are drawn on the bf16 grid, so both backends hold them exactly.
// bf16 outputs are compared at bf16 tolerance at least (one rounding step
// may separate two correct backends); the float64 checks demand exact
// agreement with the float op on the same values, rounded.

import (
	"fmt"
	"math"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// RoundBF16 is x rounded to bfloat16 (nearest, ties to even) through
// float32, as a backend writing bf16 from float32 results does. It is
// written from the definition (8 significant bits, float32's exponent
// range with its subnormal spacing scaled to 7 fraction bits), not from
// the bit trick backends use. NaN and infinities pass through; values past
// the largest bf16 by half a step or more become infinities.
func RoundBF16(x float64) float64 {
	f := float64(float32(x))
	if f == 0 || math.IsNaN(f) || math.IsInf(f, 0) {
		return f
	}
	_, exp := math.Frexp(f) // |f| = m * 2^exp, m in [0.5, 1)
	quantum := math.Ldexp(1, max(exp-8, -133))
	r := math.RoundToEven(f/quantum) * quantum
	if math.Abs(r) >= 0x1p128 {
		return math.Copysign(math.Inf(1), r)
	}
	return r
}

// UploadBF16 makes a BFloat16 tensor on b holding data rounded to bf16.
func UploadBF16(b backend.Backend, data []float64, shape ...int) backend.Tensor {
	t := b.New(backend.BFloat16, shape...)
	Set(b, t, data)
	return t
}

// BF16Floats makes a BFloat16 input holding data rounded to bf16.
func (e *Env) BF16Floats(name string, data []float64, shape ...int) *Pair {
	e.T.Helper()
	if len(data) != numel(shape) {
		e.T.Fatalf("%s: %d values for shape %v", name, len(data), shape)
	}
	host := RoundTo(backend.BFloat16, data)
	p := &Pair{Name: name, Shape: shape, host: host, bf16: true, role: input}
	p.b = UploadBF16(e.B, host, shape...)
	p.o = UploadBF16(e.Oracle, host, shape...)
	return e.add(p)
}

// BF16Uniform makes a BFloat16 input of values drawn uniformly from
// [lo, hi) and rounded to bf16.
func (e *Env) BF16Uniform(name string, lo, hi float64, shape ...int) *Pair {
	return e.BF16Floats(name, RandFloats(e.Rng, numel(shape), lo, hi), shape...)
}

// BF16 makes a BFloat16 input of values drawn from [-1, 1), rounded to
// bf16.
func (e *Env) BF16(name string, shape ...int) *Pair {
	return e.BF16Uniform(name, -1, 1, shape...)
}

// OutBF16 makes a BFloat16 output filled with NaN, like Out.
func (e *Env) OutBF16(name string, shape ...int) *Pair {
	nan := make([]float64, numel(shape))
	for i := range nan {
		nan[i] = math.NaN()
	}
	p := &Pair{Name: name, Shape: shape, host: nan, bf16: true, role: output}
	p.b = UploadBF16(e.B, nan, shape...)
	p.o = UploadBF16(e.Oracle, nan, shape...)
	return e.add(p)
}

// typed draws an input of shape, bf16 or of the float type, from [lo, hi).
func (e *Env) typed(bf16 bool, name string, lo, hi float64, shape ...int) *Pair {
	if bf16 {
		return e.BF16Uniform(name, lo, hi, shape...)
	}
	return e.Uniform(name, lo, hi, shape...)
}

// typedOut is Out or OutBF16.
func (e *Env) typedOut(bf16 bool, name string, shape ...int) *Pair {
	if bf16 {
		return e.OutBF16(name, shape...)
	}
	return e.Out(name, shape...)
}

func bf16Cases() []Case {
	var cs []Case
	cs = append(cs, bf16MatMulCases()...)
	cs = append(cs, bf16RowCases()...)
	cs = append(cs, bf16SwiGLUCases()...)
	cs = append(cs, bf16StorageCases()...)
	cs = append(cs,
		Case{Name: "BF16/Upload/ref", Check: checkBF16Upload},
		Case{Name: "BF16/Copy/ref", Check: checkBF16Copy},
		Case{Name: "BF16/MatMul/ref", Check: checkBF16MatMul},
		Case{Name: "BF16/Rows/ref", Check: checkBF16Rows},
		Case{Name: "BF16/SwiGLU/ref", Check: checkBF16SwiGLU},
	)
	return cs
}

// mmTypes are MatMul's type combinations: a bf16 operand beside a float
// one (either side), both bf16, a bf16 out, all bf16.
func mmTypes() []struct {
	name      string
	a, b, out bool
} {
	return []struct {
		name      string
		a, b, out bool
	}{
		{"a", true, false, false},
		{"b", false, true, false},
		{"ab", true, true, false},
		{"out", false, false, true},
		{"all", true, true, true},
	}
}

func bf16MatMulCases() []Case {
	var cs []Case
	shapes := []mmShape{
		{"small", 5, 7, 3, 1, 0},
		{"blocked", 20, 600, 150, -0.5, 0},
		{"k0", 4, 6, 0, 1, 0},
	}
	for _, ty := range mmTypes() {
		for _, s := range shapes {
			for _, l := range mmLayouts() {
				cs = append(cs, Case{Name: fmt.Sprintf("MatMul/bf16-%s/%s/%s", ty.name, l.name, s.name), Compare: func(e *Env) {
					a := e.typed(ty.a, "a", -1, 1, l.aShape(s.m, s.k)...)
					bb := e.typed(ty.b, "b", -1, 1, l.bShape(s.k, s.n)...)
					out := e.typedOut(ty.out, "out", s.m, s.n)
					e.Run(func(b backend.Backend, p Pick) {
						b.MatMul(p(out), p(a), p(bb), l.transA, l.transB, s.alpha, s.beta)
					})
				}})
			}
		}
		if !ty.out {
			// A float out accumulates (beta != 0) whatever the operands.
			cs = append(cs, Case{Name: fmt.Sprintf("MatMul/bf16-%s/accumulate", ty.name), Compare: func(e *Env) {
				a, bb := e.typed(ty.a, "a", -1, 1, 33, 69), e.typed(ty.b, "b", -1, 1, 17, 69)
				out := e.InOut(e.Rand("out", 33, 17))
				e.Run(func(b backend.Backend, p Pick) { b.MatMul(p(out), p(a), p(bb), false, true, 0.7, 0.75) })
			}})
		}
	}
	cs = append(cs, Case{Name: "MatMul/bf16/views", Compare: func(e *Env) {
		// A bf16 weight slice at an odd element offset times a float
		// activation slice, into a bf16 view in the middle of a larger
		// buffer: nothing outside the views may change.
		wParent := e.BF16("wParent", 40, 8)
		w := e.View("w", wParent, 17, 12, 8)
		x := e.View("x", e.Rand("xParent", 11, 8), 8, 10, 8)
		parent := e.InOut(e.BF16("outParent", 16, 12))
		out := e.View("out", parent, 25, 10, 12)
		e.Run(func(b backend.Backend, p Pick) { b.MatMul(p(out), p(x), p(w), false, true, 1, 0) })
	}})
	return cs
}

func bf16RowCases() []Case {
	var cs []Case
	// d = 15 leaves rows that no vector width divides.
	for _, s := range []struct{ t, n, d int }{{29, 41, 16}, {64, 300, 200}, {7, 11, 15}} {
		for _, scaled := range []bool{false, true} {
			// bf16 out from a float in; from a bf16 in, a float or bf16 out.
			for _, ty := range []struct {
				name    string
				in, out bool
			}{{"bf16-out", false, true}, {"bf16-in", true, false}, {"bf16", true, true}} {
				name := fmt.Sprintf("GatherRows/%s/%dx%dx%d", ty.name, s.t, s.n, s.d)
				if scaled {
					name += "/scaled"
				}
				cs = append(cs, Case{Name: name, Compare: func(e *Env) {
					in, rows := e.typed(ty.in, "in", -3, 3, s.t, s.d), e.Ints("rows", 0, s.t, s.n)
					var sc *Pair
					if scaled {
						sc = e.Rand("scale", s.n)
					}
					out := e.typedOut(ty.out, "out", s.n, s.d)
					e.Run(func(b backend.Backend, p Pick) { b.GatherRows(p(out), p(in), p(rows), p(sc)) })
				}})
			}
			// The gates' gradient reading bf16 rows (the experts' outputs).
			if !scaled {
				cs = append(cs, Case{Name: fmt.Sprintf("RowDots/bf16-b/%dx%dx%d", s.t, s.n, s.d), Compare: func(e *Env) {
					a, rows, bm := e.Rand("a", s.t, s.d), e.Ints("rows", 0, s.t, s.n), e.typed(true, "b", -3, 3, s.n, s.d)
					out := e.Out("out", s.n)
					e.Run(func(b backend.Backend, p Pick) { b.RowDots(p(out), p(a), p(rows), p(bm)) })
				}})
			}
			// The combine reading bf16 rows (the experts' outputs).
			k := (s.n + s.t - 1) / s.t
			name := fmt.Sprintf("GatherSumRows/bf16-in/%dx%dx%d", s.t, k, s.d)
			if scaled {
				name += "/scaled"
			}
			cs = append(cs, Case{Name: name, Compare: func(e *Env) {
				out := e.InOut(e.Rand("out", s.t, s.d))
				in, pos := e.typed(true, "in", -3, 3, s.n, s.d), e.IntsOf("pos", SendPositions(e.Rng, s.t, k, s.n), s.t, k)
				var sc *Pair
				if scaled {
					sc = e.Rand("scale", s.t, k)
				}
				e.Run(func(b backend.Backend, p Pick) { b.GatherSumRows(p(out), p(in), p(pos), p(sc)) })
			}})
		}
	}
	return cs
}

// swigluTypes are SwiGLU's type combinations: bf16 inputs, bf16 outputs,
// both.
func swigluTypes() []struct {
	name    string
	in, out bool
} {
	return []struct {
		name    string
		in, out bool
	}{{"bf16-in", true, false}, {"bf16-out", false, true}, {"bf16", true, true}}
}

func bf16SwiGLUCases() []Case {
	var cs []Case
	for _, ty := range swigluTypes() {
		// 13x22 leaves a tail that no vector width divides.
		for _, s := range []struct{ n, f int }{{13, 22}, {300, 256}} {
			name := fmt.Sprintf("%s/%dx%d", ty.name, s.n, s.f)
			cs = append(cs,
				Case{Name: "SwiGLUForward/" + name, Compare: func(e *Env) {
					a, bv := e.typed(ty.in, "a", -8, 8, s.n, s.f), e.typed(ty.in, "b", -1, 1, s.n, s.f)
					out := e.typedOut(ty.out, "out", s.n, s.f)
					e.Run(func(b backend.Backend, p Pick) { b.SwiGLUForward(p(out), p(a), p(bv)) })
				}},
				Case{Name: "SwiGLUBackward/" + name, Compare: func(e *Env) {
					a, bv := e.typed(ty.in, "a", -8, 8, s.n, s.f), e.typed(ty.in, "b", -1, 1, s.n, s.f)
					dout := e.Rand("dout", s.n, s.f)
					da, db := e.typedOut(ty.out, "da", s.n, s.f), e.typedOut(ty.out, "db", s.n, s.f)
					e.Run(func(b backend.Backend, p Pick) { b.SwiGLUBackward(p(da), p(db), p(dout), p(a), p(bv)) })
				}},
			)
		}
	}
	cs = append(cs,
		Case{Name: "SwiGLUForward/bf16/views", Compare: func(e *Env) {
			// Views at odd element offsets: no vector alignment.
			a := e.View("a", e.BF16Uniform("aParent", -8, 8, 70), 1, 7, 9)
			bv := e.View("b", e.BF16("bParent", 70), 5, 7, 9)
			parent := e.InOut(e.BF16("outParent", 70))
			out := e.View("out", parent, 3, 7, 9)
			e.Run(func(b backend.Backend, p Pick) { b.SwiGLUForward(p(out), p(a), p(bv)) })
		}},
		Case{Name: "SwiGLUBackward/bf16/views", Compare: func(e *Env) {
			a := e.View("a", e.BF16Uniform("aParent", -8, 8, 70), 1, 7, 9)
			bv := e.View("b", e.BF16("bParent", 70), 5, 7, 9)
			dout := e.View("dout", e.Rand("doutParent", 70), 2, 7, 9)
			parent := e.InOut(e.BF16("dParent", 140))
			da, db := e.View("da", parent, 3, 7, 9), e.View("db", parent, 71, 7, 9)
			e.Run(func(b backend.Backend, p Pick) { b.SwiGLUBackward(p(da), p(db), p(dout), p(a), p(bv)) })
		}},
	)
	return cs
}

func bf16StorageCases() []Case {
	return []Case{
		{Name: "Zero/bf16", Compare: func(e *Env) {
			x := e.InOut(e.BF16("t", 3, 7))
			e.Run(func(b backend.Backend, p Pick) { b.Zero(p(x)) })
		}},
		{Name: "Zero/bf16-view", Compare: func(e *Env) {
			// An odd offset and length: no 32-bit word covers the ends.
			parent := e.InOut(e.BF16("parent", 21))
			x := e.View("t", parent, 3, 11)
			e.Run(func(b backend.Backend, p Pick) { b.Zero(p(x)) })
		}},
		{Name: "Copy/bf16", Compare: func(e *Env) {
			src, dst := e.BF16("src", 3, 7), e.OutBF16("dst", 21)
			e.Run(func(b backend.Backend, p Pick) { b.Copy(p(dst), p(src)) })
		}},
		{Name: "Copy/bf16-view", Compare: func(e *Env) {
			parent := e.InOut(e.BF16("parent", 6, 5))
			dst := e.View("dst", parent, 7, 3, 5)
			src := e.View("src", e.BF16("srcParent", 20), 1, 3, 5)
			e.Run(func(b backend.Backend, p Pick) { b.Copy(p(dst), p(src)) })
		}},
		// A float src rounds into a bf16 dst (the weights' operand copy).
		{Name: "Copy/float-to-bf16", Compare: func(e *Env) {
			src, dst := e.Uniform("src", -3, 3, 5, 41), e.OutBF16("dst", 205)
			e.Run(func(b backend.Backend, p Pick) { b.Copy(p(dst), p(src)) })
		}},
		{Name: "Copy/float-to-bf16-view", Compare: func(e *Env) {
			parent := e.InOut(e.BF16("parent", 40))
			dst := e.View("dst", parent, 3, 29)
			src := e.View("src", e.Uniform("srcParent", -3, 3, 33), 1, 29)
			e.Run(func(b backend.Backend, p Pick) { b.Copy(p(dst), p(src)) })
		}},
	}
}

// exact reports (up to five elements) where got differs from want at all;
// infinities must match, and NaN is never equal.
func exact(t *testing.T, what string, got, want []float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: %d elements, want %d", what, len(got), len(want))
		return
	}
	bad := 0
	for i, w := range want {
		if got[i] == w {
			continue
		}
		if bad < 5 {
			t.Errorf("%s: element %d is %.17g, want exactly %.17g", what, i, got[i], w)
		}
		bad++
	}
	if bad > 5 {
		t.Errorf("%s: %d of %d elements differ", what, bad, len(want))
	}
}

// checkBF16Upload checks that Upload rounds to bf16 as RoundBF16 does, ties
// and overflow included, and that Download returns the values exactly.
func checkBF16Upload(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	data := c.rand(1000, -3, 3)
	// Ties between bf16 neighbours (even and odd kept part), values just
	// off a tie, the largest bf16, and a value that overflows.
	data = append(data, 1+0x1p-8, 1+3*0x1p-8, 1+0x1p-8+0x1p-20, -(1 + 3*0x1p-8 - 0x1p-20), 0x1.fep127, -3.4e38, 0x1p-140)
	xT := UploadBF16(b, data, len(data))
	if xT.DType() != backend.BFloat16 {
		t.Fatalf("New(BFloat16) made a %v tensor", xT.DType())
	}
	if _, ok := backend.HostData(b.Download(xT)).([]float32); !ok {
		t.Errorf("a bfloat16 tensor downloads as %T, want []float32", backend.HostData(b.Download(xT)))
	}
	want := RoundTo(backend.BFloat16, data)
	if want[len(want)-2] != math.Inf(-1) || want[len(want)-7] != 1 || want[len(want)-6] != 1+0x1p-6 {
		t.Fatalf("RoundBF16 is wrong on its own test values: %v", want[len(want)-7:])
	}
	got := c.down(xT)
	exact(t, "upload", got, want)
	for i, v := range got {
		if !math.IsInf(v, 0) && RoundBF16(v) != v {
			t.Fatalf("element %d = %v is not on the bf16 grid", i, v)
		}
	}
}

// checkBF16Copy checks that Copy from a float tensor into a bf16 one rounds
// as Upload does, exactly.
func checkBF16Copy(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	data := append(c.rand(777, -3, 3), 1+0x1p-8, 1+3*0x1p-8, -(1 + 3*0x1p-8 - 0x1p-20))
	dst := b.New(backend.BFloat16, len(data))
	b.Copy(dst, c.up(data, len(data)))
	exact(t, "copy into bf16", c.down(dst), RoundTo(backend.BFloat16, data))
}

// checkBF16MatMul checks that MatMul with bf16 operands equals the float
// MatMul of the same values exactly (and a naive product within refTol),
// and that a bf16 out holds that result rounded.
func checkBF16MatMul(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const m, n, k = 5, 530, 141 // crosses the CPU kernel's blocks
	for _, ty := range mmTypes() {
		for _, l := range mmLayouts() {
			a := RoundTo(backend.BFloat16, c.rand(m*k, -1, 1))
			bm := RoundTo(backend.BFloat16, c.rand(k*n, -1, 1))
			floatOut := c.out(m, n)
			b.MatMul(floatOut, c.up(a, l.aShape(m, k)...), c.up(bm, l.bShape(k, n)...), l.transA, l.transB, 0.7, 0)
			want := c.down(floatOut)
			c.same(ty.name+" "+l.name+" float reference", want, naiveMatMul(a, bm, make([]float64, m*n), m, n, k, l.transA, l.transB, 0.7, 0))

			up := func(bf16 bool, data []float64, shape ...int) backend.Tensor {
				if bf16 {
					return UploadBF16(b, data, shape...)
				}
				return c.up(data, shape...)
			}
			outT := c.out(m, n)
			if ty.out {
				outT = UploadBF16(b, make([]float64, m*n), m, n)
				Set(b, outT, RoundTo(backend.BFloat16, c.rand(m*n, -1, 1))) // not read: beta = 0
				want = RoundTo(backend.BFloat16, want)
			}
			b.MatMul(outT, up(ty.a, a, l.aShape(m, k)...), up(ty.b, bm, l.bShape(k, n)...), l.transA, l.transB, 0.7, 0)
			exact(t, "bf16-"+ty.name+" "+l.name, c.down(outT), want)
		}
	}
}

// checkBF16Rows checks GatherRows into bf16 against the float gather,
// rounded.
func checkBF16Rows(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const tok, n, d = 5, 9, 6
	inT, rowsT := c.up(c.rand(tok*d, -3, 3), tok, d), c.upInts(RandInts(c.rng, n, 0, tok), n)
	for _, sT := range []backend.Tensor{nil, c.up(c.rand(n, -1, 1), n)} {
		fT, hT := c.out(n, d), UploadBF16(b, make([]float64, n*d), n, d)
		b.GatherRows(fT, inT, rowsT, sT)
		b.GatherRows(hT, inT, rowsT, sT)
		exact(t, fmt.Sprintf("GatherRows (scaled %v)", sT != nil), c.down(hT), RoundTo(backend.BFloat16, c.down(fT)))
	}
}

// checkBF16SwiGLU checks SwiGLU forward and backward with bf16 inputs
// and/or outputs against the float ops on the same values, rounded where
// the output is bf16.
func checkBF16SwiGLU(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	const n, f = 4, 9
	a := RoundTo(backend.BFloat16, c.rand(n*f, -6, 6))
	bv := RoundTo(backend.BFloat16, c.rand(n*f, -1, 1))
	dout := c.rand(n*f, -1, 1)
	aT, bT, doutT := c.up(a, n, f), c.up(bv, n, f), c.up(dout, n, f)
	outT, daT, dbT := c.out(n, f), c.out(n, f), c.out(n, f)
	b.SwiGLUForward(outT, aT, bT)
	b.SwiGLUBackward(daT, dbT, doutT, aT, bT)
	out, da, db := c.down(outT), c.down(daT), c.down(dbT)
	for _, ty := range swigluTypes() {
		in := func(x []float64) backend.Tensor {
			if ty.in {
				return UploadBF16(b, x, n, f)
			}
			return c.up(x, n, f)
		}
		res := func() backend.Tensor {
			if ty.out {
				return UploadBF16(b, make([]float64, n*f), n, f)
			}
			return c.out(n, f)
		}
		want := func(x []float64) []float64 {
			if ty.out {
				return RoundTo(backend.BFloat16, x)
			}
			return x
		}
		hA, hB := in(a), in(bv)
		o, gda, gdb := res(), res(), res()
		b.SwiGLUForward(o, hA, hB)
		b.SwiGLUBackward(gda, gdb, doutT, hA, hB)
		exact(t, ty.name+" forward", c.down(o), want(out))
		exact(t, ty.name+" da", c.down(gda), want(da))
		exact(t, ty.name+" db", c.down(gdb), want(db))
	}
}

// BF16Operands returns b with BFloat16 as its operand type, as the CUDA
// backend has, so that code which keeps matrix-product operands in
// Backend.OperandType runs its bf16 path on a backend without a GPU. b must
// implement the ops on bf16 tensors (the CPU backend does).
func BF16Operands(b backend.Backend) backend.Backend { return bf16Operands{b} }

type bf16Operands struct{ backend.Backend }

func (bf16Operands) OperandType() backend.DType { return backend.BFloat16 }
