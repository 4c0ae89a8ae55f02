package backendtest

import (
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"testing"

	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/backend"
)

// Case is one entry of the suite's table. Either function may be nil.
type Case struct {
	// Name names the subtest, for example "MatMul/NT/blocked".
	Name string
	// Compare builds inputs through e, runs the op on both backends with
	// e.Run or e.RunScalar, and lets e compare the results. RunAll runs it.
	Compare func(e *Env)
	// Check verifies the op on a float64 backend against central finite
	// differences or an independent naive formulation. GradCheck runs it.
	Check func(t *testing.T, b64 backend.Backend)
}

// cases is the whole table: the core ops and the ops of the attention and
// router kernels.
func cases() []Case {
	var all []Case
	all = append(all, coreCases()...)
	all = append(all, groupedCases()...)
	all = append(all, attentionCases()...)
	all = append(all, routerCases()...)
	all = append(all, routeCases()...)
	all = append(all, bf16Cases()...)
	all = append(all, peerCases()...)
	all = append(all, zigzagCases()...)
	return all
}

// RunAll runs every Case's Compare on b against oracle (usually the float64
// CPU backend), one subtest per case, with tolerances set by b's float type,
// or by b itself when it implements backend.Precision.
func RunAll(t *testing.T, b, oracle backend.Backend) {
	tol := Tolerance(b.FloatType())
	if p, ok := b.(backend.Precision); ok {
		tol = p.RelTolerance()
	}
	for _, c := range cases() {
		if c.Compare == nil {
			continue
		}
		t.Run(c.Name, func(t *testing.T) {
			e := &Env{T: t, B: b, Oracle: oracle, Rng: NewRand(c.Name), Tol: tol}
			c.Compare(e)
			if !e.ran {
				t.Fatalf("case %s never called Run or RunScalar", c.Name)
			}
		})
	}
}

// GradCheck runs every Case's Check on b64, which must compute in float64.
func GradCheck(t *testing.T, b64 backend.Backend) {
	if b64.FloatType() != backend.Float64 {
		t.Fatalf("GradCheck needs a float64 backend, got %s computing in %v", b64.Name(), b64.FloatType())
	}
	for _, c := range cases() {
		if c.Check == nil {
			continue
		}
		t.Run(c.Name, func(t *testing.T) { c.Check(t, b64) })
	}
}

// Tolerance is the relative tolerance for comparing a backend computing in
// dt with a float64 oracle (see CompareFloats).
func Tolerance(dt backend.DType) float64 {
	switch dt {
	case backend.Float64:
		return 1e-12
	case backend.Float32:
		return 1e-5
	}
	// Half-precision types (bf16) keep 8 bits of mantissa.
	return 1e-2
}

// NewRand returns a generator seeded from name, so each case draws the same
// inputs on every run whatever other cases exist.
func NewRand(name string) *rand.Rand {
	h := fnv.New64a()
	h.Write([]byte(name))
	return rand.New(rand.NewPCG(h.Sum64(), 0x6d6b747261696e))
}

// Pick maps a Pair to its tensor on the backend being run (nil for a nil
// Pair, for optional arguments).
type Pick func(*Pair) backend.Tensor

// All is x of each of ps, in order (every rank's tensor of a per-rank
// list, for the ops that take them all).
func (x Pick) All(ps []*Pair) []backend.Tensor {
	ts := make([]backend.Tensor, len(ps))
	for i, p := range ps {
		ts[i] = x(p)
	}
	return ts
}

// role says how Run treats a Pair afterwards.
type role int

const (
	input  role = iota // must come back unchanged
	output             // poisoned with NaN before the run, compared after
	inOut              // random before the run, compared after
	view               // a view of another Pair, checked through its parent
)

// Pair is one tensor allocated on both backends of an Env with the same
// contents.
type Pair struct {
	Name  string
	Shape []int
	b, o  backend.Tensor
	host  []float64 // initial float contents (after rounding)
	ints  []int32   // initial int contents
	isInt bool
	bf16  bool // a BFloat16 tensor (bf16_cases.go)
	role  role
}

// Env holds one case's two backends and the tensors it made on them.
type Env struct {
	T         *testing.T
	B, Oracle backend.Backend
	// Rng is seeded from the case name (NewRand).
	Rng *rand.Rand
	// Tol is Tolerance(B.FloatType()), or B's RelTolerance when B
	// implements backend.Precision.
	Tol float64
	// NormWise compares outputs as whole tensors (CompareNormWise) instead
	// of element by element, when B computes below float32 (Tol is looser
	// than float32's). A case sets it before Run where each output element
	// is a long reduction over rounded operands (see CompareNormWise).
	NormWise bool
	pairs    []*Pair
	ran      bool
}

// lowPrecision reports whether B computes below float32, so that the
// tolerance it asks for is looser than float32's.
func (e *Env) lowPrecision() bool { return e.Tol > Tolerance(backend.Float32) }

// grid returns the float type on whose grid inputs are drawn: the coarser
// of the two backends' types, so that both see exactly the same inputs.
func (e *Env) grid() backend.DType {
	if e.B.FloatType() == backend.Float64 && e.Oracle.FloatType() == backend.Float64 {
		return backend.Float64
	}
	return backend.Float32
}

func (e *Env) add(p *Pair) *Pair {
	e.pairs = append(e.pairs, p)
	return p
}

// Floats makes an input holding data (rounded to the input grid).
func (e *Env) Floats(name string, data []float64, shape ...int) *Pair {
	e.T.Helper()
	if len(data) != numel(shape) {
		e.T.Fatalf("%s: %d values for shape %v", name, len(data), shape)
	}
	host := RoundTo(e.grid(), data)
	p := &Pair{Name: name, Shape: shape, host: host, role: input}
	p.b = Upload(e.B, host, shape...)
	p.o = Upload(e.Oracle, host, shape...)
	return e.add(p)
}

// Uniform makes an input of values drawn uniformly from [lo, hi).
func (e *Env) Uniform(name string, lo, hi float64, shape ...int) *Pair {
	return e.Floats(name, RandFloats(e.Rng, numel(shape), lo, hi), shape...)
}

// Rand makes an input of values drawn uniformly from [-1, 1).
func (e *Env) Rand(name string, shape ...int) *Pair {
	return e.Uniform(name, -1, 1, shape...)
}

// IntsOf makes an Int32 input holding data.
func (e *Env) IntsOf(name string, data []int32, shape ...int) *Pair {
	e.T.Helper()
	if len(data) != numel(shape) {
		e.T.Fatalf("%s: %d values for shape %v", name, len(data), shape)
	}
	p := &Pair{Name: name, Shape: shape, ints: append([]int32(nil), data...), isInt: true, role: input}
	p.b = UploadInts(e.B, p.ints, shape...)
	p.o = UploadInts(e.Oracle, p.ints, shape...)
	return e.add(p)
}

// Ints makes an Int32 input of values drawn uniformly from [lo, hi).
func (e *Env) Ints(name string, lo, hi int, shape ...int) *Pair {
	return e.IntsOf(name, RandInts(e.Rng, numel(shape), lo, hi), shape...)
}

// Out makes a float output, filled with NaN on both backends so that an op
// that leaves part of it unwritten, or reads it, fails the comparison.
func (e *Env) Out(name string, shape ...int) *Pair {
	nan := make([]float64, numel(shape))
	for i := range nan {
		nan[i] = math.NaN()
	}
	p := &Pair{Name: name, Shape: shape, host: nan, role: output}
	p.b = Upload(e.B, nan, shape...)
	p.o = Upload(e.Oracle, nan, shape...)
	return e.add(p)
}

// IntOut makes an Int32 output, filled with math.MinInt32.
func (e *Env) IntOut(name string, shape ...int) *Pair {
	poison := make([]int32, numel(shape))
	for i := range poison {
		poison[i] = math.MinInt32
	}
	p := e.IntsOf(name, poison, shape...)
	p.role = output
	return p
}

// InOut marks p as updated by the op (an accumulating output or an
// in-place argument): Run compares it between the backends instead of
// checking that it is unchanged.
func (e *Env) InOut(p *Pair) *Pair {
	p.role = inOut
	return p
}

// View makes a view of parent on both backends, offset elements in. The view
// itself is not checked; parent is, by its own role (make it InOut when the
// op writes through the view).
func (e *Env) View(name string, parent *Pair, offset int, shape ...int) *Pair {
	p := &Pair{Name: name, Shape: shape, isInt: parent.isInt, bf16: parent.bf16, role: view}
	p.b = e.B.View(parent.b, offset, shape...)
	p.o = e.Oracle.View(parent.o, offset, shape...)
	return e.add(p)
}

// Run runs f on B, then on Oracle, and checks every Pair: outputs and InOut
// pairs must agree within Tol (and never be NaN), inputs must be unchanged.
// A case calls Run (or RunScalar) once.
func (e *Env) Run(f func(b backend.Backend, x Pick)) {
	e.T.Helper()
	e.RunScalar(func(b backend.Backend, x Pick) float64 { f(b, x); return 0 })
}

// RunScalar is Run for ops that return a number; the two numbers must agree
// within Tol as well.
func (e *Env) RunScalar(f func(b backend.Backend, x Pick) float64) {
	e.T.Helper()
	if e.ran {
		e.T.Fatalf("Run called twice in one case")
	}
	e.ran = true
	got := f(e.B, func(p *Pair) backend.Tensor {
		if p == nil {
			return nil
		}
		return p.b
	})
	want := f(e.Oracle, func(p *Pair) backend.Tensor {
		if p == nil {
			return nil
		}
		return p.o
	})
	if err := e.B.Sync(); err != nil {
		e.T.Fatalf("%s: Sync: %v", e.B.Name(), err)
	}
	if err := e.Oracle.Sync(); err != nil {
		e.T.Fatalf("oracle %s: Sync: %v", e.Oracle.Name(), err)
	}
	CompareFloats(e.T, "returned value", []float64{got}, []float64{want}, e.Tol)
	for _, p := range e.pairs {
		e.check(p)
	}
}

// check compares one Pair after a run.
func (e *Env) check(p *Pair) {
	e.T.Helper()
	switch {
	case p.role == view:
	case p.isInt && p.role == input:
		e.equalInts(p.Name+" (input, changed)", DownloadInts(e.B, p.b), p.ints)
		e.equalInts(p.Name+" (input, changed on the oracle)", DownloadInts(e.Oracle, p.o), p.ints)
	case p.isInt:
		e.equalInts(p.Name, DownloadInts(e.B, p.b), DownloadInts(e.Oracle, p.o))
	case p.role == input:
		// Inputs lie on both backends' grids, so they must come back exact.
		CompareFloats(e.T, p.Name+" (input, changed)", Download(e.B, p.b), p.host, 0)
		CompareFloats(e.T, p.Name+" (input, changed on the oracle)", Download(e.Oracle, p.o), p.host, 0)
	case e.NormWise && e.lowPrecision():
		CompareNormWise(e.T, p.Name, Download(e.B, p.b), Download(e.Oracle, p.o), e.Tol)
	case p.bf16:
		// Both backends round their result to bf16; where the results
		// straddle a rounding boundary they differ by one bf16 step.
		CompareFloats(e.T, p.Name, Download(e.B, p.b), Download(e.Oracle, p.o), max(e.Tol, Tolerance(backend.BFloat16)))
	default:
		CompareFloats(e.T, p.Name, Download(e.B, p.b), Download(e.Oracle, p.o), e.Tol)
	}
}

func (e *Env) equalInts(what string, got, want []int32) {
	e.T.Helper()
	for i := range want {
		if got[i] != want[i] {
			e.T.Errorf("%s: element %d is %d, want %d", what, i, got[i], want[i])
			return
		}
	}
}

// CompareFloats reports (through t.Errorf, up to five elements) where got
// and want differ: element i passes when both are finite and
// |got-want| <= tol*(|want| + rms(want)). The rms term keeps elements that
// cancel to near zero from demanding more than the type's precision. It
// returns whether all passed.
func CompareFloats(t testing.TB, what string, got, want []float64, tol float64) bool {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: %d elements, want %d", what, len(got), len(want))
		return false
	}
	var ss float64
	for _, w := range want {
		ss += w * w
	}
	rms := math.Sqrt(ss / float64(max(len(want), 1)))
	bad := 0
	for i, w := range want {
		g := got[i]
		finite := !math.IsNaN(g) && !math.IsInf(g, 0) && !math.IsNaN(w) && !math.IsInf(w, 0)
		if finite && math.Abs(g-w) <= tol*(math.Abs(w)+rms) {
			continue
		}
		if bad < 5 {
			t.Errorf("%s: element %d is %.17g, want %.17g (diff %.3g, tolerance %.3g)",
				what, i, g, w, math.Abs(g-w), tol*(math.Abs(w)+rms))
		}
		bad++
	}
	if bad > 5 {
		t.Errorf("%s: %d of %d elements differ", what, bad, len(want))
	}
	return bad == 0
}

// RoundTo rounds data onto dt's grid (a copy): values a backend computing in
// dt stores exactly. BFloat16 rounds through float32, as backends writing
// bf16 do (see RoundBF16).
func RoundTo(dt backend.DType, data []float64) []float64 {
	out := append([]float64(nil), data...)
	switch dt {
	case backend.Float32:
		for i, v := range out {
			out[i] = float64(float32(v))
		}
	case backend.BFloat16:
		for i, v := range out {
			out[i] = RoundBF16(v)
		}
	}
	return out
}

// RandFloats draws n values uniformly from [lo, hi), rounded to float32 so
// that float32 and float64 backends see the same inputs.
func RandFloats(rng *rand.Rand, n int, lo, hi float64) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = float64(float32(lo + (hi-lo)*rng.Float64()))
	}
	return out
}

// RandInts draws n values uniformly from [lo, hi).
func RandInts(rng *rand.Rand, n, lo, hi int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(lo + rng.IntN(hi-lo))
	}
	return out
}

// SendPositions draws a combine's positions (GatherSumRows): t tokens of
// k assignments, rows 0..n-1 each at one assignment picked at random,
// the other assignments -1 (nothing sent).
func SendPositions(rng *rand.Rand, t, k, n int) []int32 {
	pos := make([]int32, t*k)
	for i := range pos {
		pos[i] = -1
	}
	for r, a := range rng.Perm(t * k)[:min(n, t*k)] {
		pos[a] = int32(r)
	}
	return pos
}

// Upload makes a tensor of b's float type holding data.
func Upload(b backend.Backend, data []float64, shape ...int) backend.Tensor {
	t := b.New(b.FloatType(), shape...)
	Set(b, t, data)
	return t
}

// Set overwrites float tensor t with data.
func Set(b backend.Backend, t backend.Tensor, data []float64) {
	if len(data) != t.Len() {
		panic(fmt.Sprintf("backendtest.Set: %d values for a tensor of shape %v", len(data), t.Shape()))
	}
	if len(data) > 0 {
		b.Upload(t, tensor.New(tensor.WithShape(len(data)), tensor.WithBacking(append([]float64(nil), data...))))
	}
}

// UploadInts makes an Int32 tensor holding data.
func UploadInts(b backend.Backend, data []int32, shape ...int) backend.Tensor {
	t := b.New(backend.Int32, shape...)
	if len(data) != t.Len() {
		panic(fmt.Sprintf("backendtest.UploadInts: %d values for shape %v", len(data), shape))
	}
	if len(data) > 0 {
		b.Upload(t, tensor.New(tensor.WithShape(len(data)), tensor.WithBacking(append([]int32(nil), data...))))
	}
	return t
}

// Download returns float tensor t's contents as float64.
func Download(b backend.Backend, t backend.Tensor) []float64 {
	n := t.Len()
	if n == 0 {
		return nil
	}
	switch d := backend.HostData(b.Download(t)).(type) {
	case []float32:
		out := make([]float64, n)
		for i := range out {
			out[i] = float64(d[i])
		}
		return out
	case []float64:
		return append([]float64(nil), d[:n]...)
	default:
		panic(fmt.Sprintf("backendtest.Download: tensor of shape %v holds %T, not floats", t.Shape(), d))
	}
}

// DownloadInts returns Int32 tensor t's contents.
func DownloadInts(b backend.Backend, t backend.Tensor) []int32 {
	if t.Len() == 0 {
		return nil
	}
	d, ok := backend.HostData(b.Download(t)).([]int32)
	if !ok {
		panic(fmt.Sprintf("backendtest.DownloadInts: tensor of shape %v is %v", t.Shape(), t.DType()))
	}
	return append([]int32(nil), d[:t.Len()]...)
}

// Dot returns the dot product of a and b.
func Dot(a, b []float64) float64 {
	var s float64
	for i, v := range a {
		s += v * b[i]
	}
	return s
}

func numel(shape []int) int {
	n := 1
	for _, s := range shape {
		n *= s
	}
	return n
}

// normWiseElementFactor bounds single elements under CompareNormWise: each
// may stray up to this many times the tolerance of CompareFloats, so that an
// error confined to a few elements (a wrong mask entry, a missed tile edge)
// still fails even when the tensor's norm hides it.
const normWiseElementFactor = 8

// CompareNormWise reports where got and want differ as tensors: it passes
// when every element of both is finite, the relative error of the whole
// tensor ||got-want||₂ / ||want||₂ is at most tol, and every element is
// within normWiseElementFactor times CompareFloats' bound.
//
// It is the metric for ops whose every output element is a long reduction
// over operands rounded to a half-precision type (attention on bf16 tensor
// cores: a row of out sums Seq products of bf16 probabilities and values).
// Rounding the inputs alone moves single elements by more than 1e-2 of the
// tensor's rms, while the tensor as a whole stays within a few 1e-3.
func CompareNormWise(t testing.TB, what string, got, want []float64, tol float64) bool {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: %d elements, want %d", what, len(got), len(want))
		return false
	}
	var diff2, want2 float64
	for i, w := range want {
		g := got[i]
		if math.IsNaN(g) || math.IsInf(g, 0) || math.IsNaN(w) || math.IsInf(w, 0) {
			t.Errorf("%s: element %d is %v, want %v (both must be finite)", what, i, g, w)
			return false
		}
		diff2 += (g - w) * (g - w)
		want2 += w * w
	}
	ok := true
	if rel := math.Sqrt(diff2 / max(want2, math.SmallestNonzeroFloat64)); rel > tol {
		t.Errorf("%s: relative L2 error %.3g, over the tolerance %.3g", what, rel, tol)
		ok = false
	}
	return CompareFloats(t, what+" (element-wise, loosened)", got, want, normWiseElementFactor*tol) && ok
}
