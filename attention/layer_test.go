package attention_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/attention"
	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/backendtest"
	"github.com/mktrain/mktrain/backend/cpu"
)

// testCase is one block shape and micro-batch size.
type testCase struct {
	s          attention.Shape
	batch, seq int
}

var cases = []testCase{
	{attention.Shape{Dim: 16, Heads: 4, KVHeads: 2, RopeTheta: 10000}, 2, 5}, // GQA
	{attention.Shape{Dim: 12, Heads: 2, KVHeads: 1, RopeTheta: 100}, 1, 6},   // multi-query, Dh=6
	{attention.Shape{Dim: 8, Heads: 2, KVHeads: 2, RopeTheta: 500}, 2, 3},    // multi-head
}

func (c testCase) String() string {
	return fmt.Sprintf("D%d_H%d_KV%d_B%d_S%d", c.s.Dim, c.s.Heads, c.s.KVHeads, c.batch, c.seq)
}

// hostParams are a block's weights on the host, in the same [out, in] layout.
type hostParams struct{ wq, wk, wv, wo []float64 }

// inputs is one block call's host data.
type inputs struct {
	c   testCase
	x   []float64 // [T, D]
	pos []int32   // [T]
	w   hostParams
}

func randn(rng *rand.Rand, n int, std float64) []float64 {
	x := make([]float64, n)
	for i := range x {
		x[i] = rng.NormFloat64() * std
	}
	return x
}

func newInputs(rng *rand.Rand, c testCase) inputs {
	s, T := c.s, c.batch*c.seq
	q, kd := s.Heads*s.HeadDim(), s.KVHeads*s.HeadDim()
	in := inputs{
		c: c,
		x: randn(rng, T*s.Dim, 1),
		w: hostParams{
			wq: randn(rng, q*s.Dim, 0.4),
			wk: randn(rng, kd*s.Dim, 0.4),
			wv: randn(rng, kd*s.Dim, 0.4),
			wo: randn(rng, s.Dim*q, 0.4),
		},
	}
	// Sequence 0 sits at positions 0..S-1; later ones are shifted, as a
	// sequence chunk on a context-parallel rank would be.
	for bi := range c.batch {
		for i := range c.seq {
			in.pos = append(in.pos, int32(i+7*bi))
		}
	}
	return in
}

// linear returns x·wᵀ for x [T, in] and w [out, in].
func linear(x, w []float64, in, out int) []float64 {
	T := len(x) / in
	y := make([]float64, T*out)
	for t := range T {
		for o := range out {
			var s float64
			for d := range in {
				s += x[t*in+d] * w[o*in+d]
			}
			y[t*out+o] = s
		}
	}
	return y
}

// rope applies Hugging Face's apply_rotary_pos_emb to every head of x [T,
// heads*dh]: x*cos + rotate_half(x)*sin with rotate_half(x) = cat(-x2, x1)
// and inv_freq[i] = theta^(-2i/dh), repeated for both halves.
func rope(x []float64, pos []int32, heads, dh int, theta float64) {
	half := dh / 2
	for t, p := range pos {
		for h := range heads {
			row := x[(t*heads+h)*dh : (t*heads+h+1)*dh]
			for i := range half {
				ang := float64(p) / math.Pow(theta, float64(2*i)/float64(dh))
				c, s := math.Cos(ang), math.Sin(ang)
				x1, x2 := row[i], row[i+half]
				row[i] = x1*c - x2*s
				row[i+half] = x2*c + x1*s
			}
		}
	}
}

// reference is MixtralAttention.forward written out plainly.
func reference(in inputs) []float64 {
	return referenceRounding(in, func(x []float64) []float64 { return x })
}

// referenceRounding is reference with round applied where a Layer on a
// backend whose operand type is not its float type keeps operands: to x
// before the projections, to the rotated q and k and to v, which the
// attention core reads, and to its output a, which o_proj reads.
func referenceRounding(in inputs, round func([]float64) []float64) []float64 {
	s, B, S := in.c.s, in.c.batch, in.c.seq
	H, KV, Dh := s.Heads, s.KVHeads, s.HeadDim()
	x := round(append([]float64(nil), in.x...))
	q := linear(x, in.w.wq, s.Dim, H*Dh)
	k := linear(x, in.w.wk, s.Dim, KV*Dh)
	v := round(linear(x, in.w.wv, s.Dim, KV*Dh))
	rope(q, in.pos, H, Dh, s.RopeTheta)
	rope(k, in.pos, KV, Dh, s.RopeTheta)
	q, k = round(q), round(k)
	a := make([]float64, B*S*H*Dh)
	for b := range B {
		for h := range H {
			kvh := h / (H / KV) // repeat_kv
			for i := range S {
				scores := make([]float64, S)
				var z float64
				for j := range S {
					if j > i { // causal mask
						continue
					}
					var d float64
					for x := range Dh {
						d += q[((b*S+i)*H+h)*Dh+x] * k[((b*S+j)*KV+kvh)*Dh+x]
					}
					scores[j] = math.Exp(d / math.Sqrt(float64(Dh)))
					z += scores[j]
				}
				for j := 0; j <= i; j++ {
					for x := range Dh {
						a[((b*S+i)*H+h)*Dh+x] += scores[j] / z * v[((b*S+j)*KV+kvh)*Dh+x]
					}
				}
			}
		}
	}
	return linear(round(a), in.w.wo, H*Dh, s.Dim)
}

func uploadParams(b backend.Backend, s attention.Shape, w hostParams) *attention.Params {
	p := attention.NewParams(b, s)
	backend.UploadSlice(b, p.WqQD, w.wq)
	backend.UploadSlice(b, p.WkKD, w.wk)
	backend.UploadSlice(b, p.WvKD, w.wv)
	backend.UploadSlice(b, p.WoDQ, w.wo)
	return p
}

// forward runs the block on b and returns its output.
func forward(b backend.Backend, in inputs) []float64 {
	l, x, pos, out := setup(b, in)
	if err := l.Forward(out, x, pos, uploadParams(b, in.c.s, in.w)); err != nil {
		panic(err) // the tests' shapes are right
	}
	return backend.DownloadFloat64(b, out)
}

func setup(b backend.Backend, in inputs) (l *attention.Layer, xTD, posT, outTD backend.Tensor) {
	T, D := in.c.batch*in.c.seq, in.c.s.Dim
	l = attention.New(b, in.c.s, in.c.batch, in.c.seq)
	xTD, posT, outTD = b.New(b.FloatType(), T, D), b.New(backend.Int32, T), b.New(b.FloatType(), T, D)
	backend.UploadSlice(b, xTD, in.x)
	b.Upload(posT, tensor.New(tensor.WithShape(T), tensor.WithBacking(append([]int32(nil), in.pos...))))
	return l, xTD, posT, outTD
}

func maxRelErr(got, want []float64) float64 {
	var worst float64
	for i := range want {
		worst = max(worst, math.Abs(got[i]-want[i])/max(1, math.Abs(want[i])))
	}
	return worst
}

func TestForwardMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	for _, c := range cases {
		in := newInputs(rng, c)
		want := reference(in)
		for _, dt := range []backend.DType{backend.Float64, backend.Float32} {
			t.Run(fmt.Sprintf("%v/%v", c, dt), func(t *testing.T) {
				tol := 1e-12
				if dt == backend.Float32 {
					tol = 1e-5
				}
				if e := maxRelErr(forward(cpu.New(dt), in), want); e > tol {
					t.Errorf("block output differs from the reference by %.3g (tol %.1g)", e, tol)
				}
			})
		}
	}
}

// TestBF16Operands runs the block on a backend whose operand type is
// bf16 (the CUDA backend's; here the float64 CPU backend with
// backendtest.BF16Operands). Its forward must be the plain reference with
// x, v, the rotated q and k and the core's output rounded to bf16 once
// each, to float64's precision: q and k are rotated in the float type and
// rounded by RoPE itself, not rotated after rounding. Its gradients must be the float64
// block's within bf16's error (their operands are rounded too).
func TestBF16Operands(t *testing.T) {
	rng := rand.New(rand.NewPCG(31, 32))
	bf := backendtest.BF16Operands(cpu.New(backend.Float64))
	ref := cpu.New(backend.Float64)
	roundAll := func(x []float64) []float64 {
		for i, v := range x {
			x[i] = backendtest.RoundBF16(v)
		}
		return x
	}
	for _, c := range cases {
		t.Run(c.String(), func(t *testing.T) {
			in := newInputs(rng, c)
			if e := maxRelErr(forward(bf, in), referenceRounding(in, roundAll)); e > 1e-12 {
				t.Errorf("forward differs from the reference with bf16 q, k, v by %.3g", e)
			}
			T, D := c.batch*c.seq, c.s.Dim
			dout := randn(rng, T*D, 1)
			grads := func(b backend.Backend) [][]float64 {
				l, xTD, posT, outTD := setup(b, in)
				p := uploadParams(b, c.s, in.w)
				g := uploadParams(b, c.s, hostParams{
					wq: make([]float64, len(in.w.wq)), wk: make([]float64, len(in.w.wk)),
					wv: make([]float64, len(in.w.wv)), wo: make([]float64, len(in.w.wo)),
				})
				if err := l.Forward(outTD, xTD, posT, p); err != nil {
					t.Fatal(err)
				}
				doutTD, dxTD := b.New(b.FloatType(), T, D), b.New(b.FloatType(), T, D)
				backend.UploadSlice(b, doutTD, dout)
				if err := l.Backward(dxTD, doutTD, p, g); err != nil {
					t.Fatal(err)
				}
				out := [][]float64{backend.DownloadFloat64(b, dxTD)}
				for _, w := range []backend.Tensor{g.WqQD, g.WkKD, g.WvKD, g.WoDQ} {
					out = append(out, backend.DownloadFloat64(b, w))
				}
				return out
			}
			got, want := grads(bf), grads(ref)
			for i, name := range []string{"dx", "dWq", "dWk", "dWv", "dWo"} {
				if e := relNormErr(got[i], want[i]); e > 3e-2 {
					t.Errorf("%s differs from the float64 block's by %.3g of its norm", name, e)
				}
			}
		})
	}
}

// relNormErr is |got - want| / |want| in the 2-norm.
func relNormErr(got, want []float64) float64 {
	var d, w float64
	for i := range want {
		d += (got[i] - want[i]) * (got[i] - want[i])
		w += want[i] * want[i]
	}
	return math.Sqrt(d / w)
}

// TestBackwardFiniteDifferences checks dx at every coordinate and each weight
// gradient at random coordinates against central differences of
// L = sum(out * dout), in float64. Gradients start non-zero to check that
// Backward adds into them, and dx starts as garbage to check it is
// overwritten.
func TestBackwardFiniteDifferences(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 14))
	b := cpu.New(backend.Float64)
	for _, c := range cases {
		t.Run(c.String(), func(t *testing.T) {
			in := newInputs(rng, c)
			T, D := c.batch*c.seq, c.s.Dim
			dout := randn(rng, T*D, 1)

			l, xTD, posT, outTD := setup(b, in)
			p := uploadParams(b, c.s, in.w)
			g0 := hostParams{
				wq: randn(rng, len(in.w.wq), 1), wk: randn(rng, len(in.w.wk), 1),
				wv: randn(rng, len(in.w.wv), 1), wo: randn(rng, len(in.w.wo), 1),
			}
			g := uploadParams(b, c.s, g0)
			if err := l.Forward(outTD, xTD, posT, p); err != nil {
				t.Fatal(err)
			}
			doutTD, dxTD := b.New(b.FloatType(), T, D), b.New(b.FloatType(), T, D)
			backend.UploadSlice(b, doutTD, dout)
			backend.UploadSlice(b, dxTD, randn(rng, T*D, 100))
			if err := l.Backward(dxTD, doutTD, p, g); err != nil {
				t.Fatal(err)
			}

			loss := func() float64 {
				out := forward(b, in)
				var s float64
				for i := range out {
					s += out[i] * dout[i]
				}
				return s
			}
			check := func(name string, x []float64, i int, grad float64) {
				const eps = 1e-5
				orig := x[i]
				x[i] = orig + eps
				lp := loss()
				x[i] = orig - eps
				lm := loss()
				x[i] = orig
				fd := (lp - lm) / (2 * eps)
				if math.Abs(fd-grad) > 1e-6*max(1, math.Abs(fd)) {
					t.Errorf("%s[%d] = %.10g, finite difference %.10g", name, i, grad, fd)
				}
			}

			dx := backend.DownloadFloat64(b, dxTD)
			for i := range in.x {
				check("dx", in.x, i, dx[i])
			}
			for _, w := range []struct {
				name       string
				host, g0   []float64
				gradTensor backend.Tensor
			}{
				{"dWq", in.w.wq, g0.wq, g.WqQD}, {"dWk", in.w.wk, g0.wk, g.WkKD},
				{"dWv", in.w.wv, g0.wv, g.WvKD}, {"dWo", in.w.wo, g0.wo, g.WoDQ},
			} {
				got := backend.DownloadFloat64(b, w.gradTensor)
				for range 12 {
					i := rng.IntN(len(w.host))
					check(w.name, w.host, i, got[i]-w.g0[i])
				}
			}
		})
	}
}

func TestShapeValidate(t *testing.T) {
	if err := (attention.Shape{Dim: 16, Heads: 4, KVHeads: 2, RopeTheta: 1e6}).Validate(); err != nil {
		t.Fatalf("valid shape rejected: %v", err)
	}
	for _, s := range []attention.Shape{
		{Dim: 0, Heads: 4, KVHeads: 2, RopeTheta: 1e4},
		{Dim: 16, Heads: 0, KVHeads: 1, RopeTheta: 1e4},
		{Dim: 16, Heads: 3, KVHeads: 1, RopeTheta: 1e4}, // dim not a multiple of heads
		{Dim: 16, Heads: 4, KVHeads: 3, RopeTheta: 1e4}, // heads not a multiple of kv heads
		{Dim: 12, Heads: 4, KVHeads: 2, RopeTheta: 1e4}, // odd head dim
		{Dim: 16, Heads: 4, KVHeads: 2, RopeTheta: 0},
		{Dim: 16, Heads: 4, KVHeads: 2, RopeTheta: math.NaN()},
	} {
		if err := s.Validate(); err == nil {
			t.Errorf("%+v: no error", s)
		}
	}
}

// TestAddToOutput checks that a Layer built with AddToOutput adds the
// block's output onto what out held.
func TestAddToOutput(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	b := cpu.New(backend.Float64)
	for _, c := range cases {
		in := newInputs(rng, c)
		want := forward(b, in)
		T, D := c.batch*c.seq, c.s.Dim
		prior := randn(rng, T*D, 1)
		_, x, pos, out := setup(b, in)
		l := attention.New(b, c.s, c.batch, c.seq, attention.AddToOutput())
		backend.UploadSlice(b, out, prior)
		if err := l.Forward(out, x, pos, uploadParams(b, c.s, in.w)); err != nil {
			t.Fatal(err)
		}
		got := backend.DownloadFloat64(b, out)
		for i := range want {
			if d := math.Abs(got[i] - (prior[i] + want[i])); d > 1e-12 {
				t.Fatalf("%v: element %d is %v, want %v + %v", c, i, got[i], prior[i], want[i])
			}
		}
	}
}
