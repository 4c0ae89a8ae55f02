package backendtest_test

// The suite must be able to fail. TestSuiteCatchesMutants runs RunAll and
// GradCheck, in a child process (a failing subtest cannot be contained in
// this one), against CPU backends with one deliberate bug each, and expects
// each bug to fail the cases of its op.

import (
	"math"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/backendtest"
	"github.com/mktrain/mktrain/backend/cpu"
)

const (
	envMutant = "BACKENDTEST_MUTANT"
	envMode   = "BACKENDTEST_MODE"
)

// mutants lists each bug with the top-level case names whose RunAll and
// GradCheck cases must catch it ("" where that half need not).
func mutants() []struct{ kind, runAll, gradCheck string } {
	return []struct{ kind, runAll, gradCheck string }{
		{"matmul-beta0-reads-out", "MatMul", "MatMul"},
		{"matmul-clobbers-input", "MatMul", ""},
		{"rmsnorm-dw-overwrites", "RMSNormBackward", "RMSNorm"},
		{"crossentropy-keeps-ignored", "CrossEntropy", "CrossEntropy"},
		{"rope-wrong-direction", "RoPE", "RoPE"},
		{"swiglu-da-off-1e-4", "SwiGLUBackward", "SwiGLU"},
		{"gather-drops-scale", "GatherRows", "Rows"},
		{"adamw-no-bias-correction", "AdamWUpdate", "AdamWUpdate"},
		{"route-unstable", "RouteByExpert", "RouteByExpert"},
		{"grouped-first-matrix", "GroupedMatMul", "Grouped"},
		{"grouped-tn-skips-empty", "GroupedMatMulTN", "Grouped"},
		// One bf16 step of error is within RunAll's tolerance; the float64
		// checks demand round-to-nearest exactly.
		{"bf16-rounds-toward-zero", "", "BF16"},
		{"swiglu-bf16-skips-last", "SwiGLUForward", "BF16"},
		{"peer-gather-drops-scale", "GatherPeerRows", ""},
		{"dispatch-first-matrix", "DispatchSwiGLU", ""},
		{"down-combine-first-matrix", "DownCombine", ""},
		{"dispatch-dgrad-dh3-unscaled", "DispatchDgradSwiGLU", ""},
		{"dgrad-combine-skips-w3", "DgradCombine", ""},
	}
}

func TestSuiteCatchesMutants(t *testing.T) {
	filters := map[string][]string{}
	for _, m := range mutants() {
		for mode, filter := range map[string]string{"runall": m.runAll, "gradcheck": m.gradCheck} {
			if filter == "" {
				continue
			}
			filters[mode] = append(filters[mode], filter)
			out, err := child(m.kind, mode, filter)
			if err == nil {
				t.Errorf("%s: the suite (%s) passed a backend with this bug", m.kind, mode)
				continue
			}
			if !strings.Contains(out, "--- FAIL: TestMutant/"+filter) {
				t.Errorf("%s: the suite (%s) failed, but not in %s:\n%s", m.kind, mode, filter, out)
			}
		}
	}
	// The same filters pass without a bug, so the failures above are the bugs'.
	for mode, fs := range filters {
		if out, err := child("none", mode, strings.Join(fs, "|")); err != nil {
			t.Errorf("the suite (%s) fails on the unmodified CPU backend:\n%s", mode, out)
		}
	}
}

// child runs TestMutant in a new process of this test binary.
func child(kind, mode, filter string) (string, error) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestMutant$/^("+filter+")$", "-test.count=1")
	cmd.Env = append(os.Environ(), envMutant+"="+kind, envMode+"="+mode)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// TestMutant is the child side of TestSuiteCatchesMutants; it does nothing
// unless started by it.
func TestMutant(t *testing.T) {
	kind := os.Getenv(envMutant)
	if kind == "" {
		return
	}
	switch os.Getenv(envMode) {
	case "runall":
		backendtest.RunAll(t, mutant{cpu.New(backend.Float32), kind}, cpu.New(backend.Float64))
	case "gradcheck":
		backendtest.GradCheck(t, mutant{cpu.New(backend.Float64), kind})
	default:
		t.Fatalf("unknown %s", envMode)
	}
}

// mutant is a CPU backend with the bug named by kind.
type mutant struct {
	*cpu.Backend
	kind string
}

// The float mutants leave bf16 tensors alone: Scale refuses them.

func (m mutant) MatMul(out, a, b backend.Tensor, transA, transB bool, alpha, beta float64) {
	if m.kind == "bf16-rounds-toward-zero" && out.DType() == backend.BFloat16 {
		tmp := m.Backend.New(m.FloatType(), out.Shape()...)
		m.Backend.MatMul(tmp, a, b, transA, transB, alpha, beta)
		m.truncateInto(out, tmp)
		return
	}
	if m.kind == "matmul-beta0-reads-out" && beta == 0 && out.DType() != backend.BFloat16 {
		m.Backend.Scale(out, 0) // NaN*0 is NaN
		beta = 1
	}
	m.Backend.MatMul(out, a, b, transA, transB, alpha, beta)
	if m.kind == "matmul-clobbers-input" && a.DType() != backend.BFloat16 {
		m.Backend.Scale(a, 2)
	}
}

func (m mutant) GroupedMatMul(out, a, bG backend.Tensor, groups backend.Groups, transB bool, alpha, beta float64) {
	if m.kind != "grouped-first-matrix" {
		m.Backend.GroupedMatMul(out, a, bG, groups, transB, alpha, beta)
		return
	}
	groupRows := m.hostRows(groups, a)
	// Every group multiplies by the first group's matrix.
	k, n := a.Shape()[1], out.Shape()[1]
	b0 := m.View(bG, 0, bG.Shape()[0]/len(groupRows), bG.Shape()[1])
	off := 0
	for _, rows := range groupRows {
		if rows > 0 {
			m.Backend.GroupedMatMul(m.View(out, off*n, rows, n), m.View(a, off*k, rows, k), b0, backend.Groups{Rows: []int{rows}}, transB, alpha, beta)
		}
		off += rows
	}
}

func (m mutant) GroupedMatMulTN(out, a, b backend.Tensor, groups backend.Groups, alpha, beta float64) {
	if m.kind != "grouped-tn-skips-empty" {
		m.Backend.GroupedMatMulTN(out, a, b, groups, alpha, beta)
		return
	}
	groupRows := m.hostRows(groups, a)
	// An empty group's block is left as it was, whatever beta.
	rowsM, n := out.Shape()[0]/len(groupRows), out.Shape()[1]
	off := 0
	for g, rows := range groupRows {
		if rows > 0 {
			m.Backend.GroupedMatMulTN(m.View(out, g*rowsM*n, rowsM, n), m.View(a, off*a.Shape()[1], rows, a.Shape()[1]),
				m.View(b, off*b.Shape()[1], rows, b.Shape()[1]), backend.Groups{Rows: []int{rows}}, alpha, beta)
		}
		off += rows
	}
}

// truncateInto writes src's values into the bf16 tensor dst rounded toward
// zero rather than to nearest: values already on the bf16 grid, which
// Upload keeps as they are.
func (m mutant) truncateInto(dst, src backend.Tensor) {
	vals := backend.DownloadFloat32(m.Backend, src)
	for i, v := range vals {
		vals[i] = math.Float32frombits(math.Float32bits(v) &^ 0xffff)
	}
	backend.UploadSlice(m.Backend, dst, vals)
}

func (m mutant) SwiGLUForward(out, a, b backend.Tensor) {
	if m.kind != "swiglu-bf16-skips-last" || out.DType() != backend.BFloat16 || out.Len() == 0 {
		m.Backend.SwiGLUForward(out, a, b)
		return
	}
	// The right values, but the last element is never written.
	tmp := m.Backend.New(backend.BFloat16, out.Shape()...)
	m.Backend.SwiGLUForward(tmp, a, b)
	n := out.Len() - 1
	m.Backend.Copy(m.Backend.View(out, 0, n), m.Backend.View(tmp, 0, n))
}

func (m mutant) RMSNormBackward(dx, dw, dout, x, w, rstd backend.Tensor, beta float64) {
	if m.kind == "rmsnorm-dw-overwrites" {
		m.Backend.Zero(dw)
	}
	m.Backend.RMSNormBackward(dx, dw, dout, x, w, rstd, beta)
}

func (m mutant) CrossEntropy(loss, dlogits, logits, targets backend.Tensor, gradScale float64) {
	if m.kind == "crossentropy-keeps-ignored" {
		kept := m.Backend.New(backend.Int32, targets.Len()).(*cpu.Tensor)
		for i, v := range targets.(*cpu.Tensor).Int32s() {
			kept.Int32s()[i] = max(v, 0)
		}
		targets = kept
	}
	m.Backend.CrossEntropy(loss, dlogits, logits, targets, gradScale)
}

func (m mutant) RouteByExpert(counts, offsets, tok, slot, pos, idx backend.Tensor) {
	m.Backend.RouteByExpert(counts, offsets, tok, slot, pos, idx)
	if m.kind != "route-unstable" {
		return
	}
	// Reverse each expert's rows: the right rows, the wrong order.
	off := offsets.(*cpu.Tensor).Int32s()
	for e := range len(off) - 1 {
		slices.Reverse(tok.(*cpu.Tensor).Int32s()[off[e]:off[e+1]])
		slices.Reverse(slot.(*cpu.Tensor).Int32s()[off[e]:off[e+1]])
	}
}

func (m mutant) RoPE(out, x, pos backend.Tensor, headDim int, theta float64, inverse bool) {
	if m.kind == "rope-wrong-direction" {
		inverse = !inverse
	}
	m.Backend.RoPE(out, x, pos, headDim, theta, inverse)
}

func (m mutant) SwiGLUBackward(da, db, dout, a, b backend.Tensor) {
	m.Backend.SwiGLUBackward(da, db, dout, a, b)
	if m.kind == "swiglu-da-off-1e-4" && da.DType() != backend.BFloat16 {
		m.Backend.Scale(da, 1+1e-4)
	}
}

func (m mutant) GatherRows(out, in, rows, scale backend.Tensor) {
	if m.kind == "bf16-rounds-toward-zero" && out.DType() == backend.BFloat16 {
		tmp := m.Backend.New(m.FloatType(), out.Shape()...)
		m.Backend.GatherRows(tmp, in, rows, scale)
		m.truncateInto(out, tmp)
		return
	}
	if m.kind == "gather-drops-scale" {
		scale = nil
	}
	m.Backend.GatherRows(out, in, rows, scale)
}

func (m mutant) GatherPeerRows(out backend.Tensor, src, tok, scale []backend.Tensor, refs backend.Tensor) {
	if m.kind == "peer-gather-drops-scale" {
		scale = nil
	}
	m.Backend.GatherPeerRows(out, src, tok, scale, refs)
}

// hostRows is groups' row counts over a's rows, read from the offsets
// when need be.
func (m mutant) hostRows(groups backend.Groups, a backend.Tensor) []int {
	rows, err := backend.GroupRows(m.Backend, groups, a.Shape()[0])
	if err != nil {
		panic(err)
	}
	return rows
}

// firstGroup puts every row of groups in the first group: every row is
// multiplied by the first matrix.
func (m mutant) firstGroup(groups backend.Groups, a backend.Tensor) backend.Groups {
	groupRows := m.hostRows(groups, a)
	all := make([]int, len(groupRows))
	for _, r := range groupRows {
		all[0] += r
	}
	return backend.Groups{Rows: all}
}

func (m mutant) DispatchSwiGLU(x, h1, h3, act backend.Tensor, src, tok []backend.Tensor, refs, w1, w3 backend.Tensor, groups backend.Groups) {
	if m.kind == "dispatch-first-matrix" {
		groups = m.firstGroup(groups, x)
	}
	m.Backend.DispatchSwiGLU(x, h1, h3, act, src, tok, refs, w1, w3, groups)
}

func (m mutant) DownCombine(out, done []backend.Tensor, refs, act, w2 backend.Tensor, groups backend.Groups) {
	if m.kind == "down-combine-first-matrix" {
		groups = m.firstGroup(groups, act)
	}
	m.Backend.DownCombine(out, done, refs, act, w2, groups)
}

func (m mutant) DispatchDgradSwiGLU(dy, dh1, dh3 backend.Tensor, src, tok, scale []backend.Tensor, refs, h1, h3, w2 backend.Tensor, groups backend.Groups) {
	m.Backend.DispatchDgradSwiGLU(dy, dh1, dh3, src, tok, scale, refs, h1, h3, w2, groups)
	if m.kind != "dispatch-dgrad-dh3-unscaled" {
		return
	}
	// dh3 from the unscaled rows, as a kernel applying the gates to one
	// epilogue only would write it; dy and dh1 stay right.
	m.Backend.DispatchDgradSwiGLU(m.New(dy.DType(), dy.Shape()...), m.New(dh1.DType(), dh1.Shape()...), dh3,
		src, tok, nil, refs, h1, h3, w2, groups)
}

func (m mutant) DgradCombine(out, done []backend.Tensor, refs, dh1, dh3, w1, w3 backend.Tensor, groups backend.Groups) {
	if m.kind == "dgrad-combine-skips-w3" {
		// dh3·W3 is dropped: the second product overwrites instead of
		// accumulating, or is never issued.
		zero := m.New(dh3.DType(), dh3.Shape()...)
		m.Zero(zero)
		dh3 = zero
	}
	m.Backend.DgradCombine(out, done, refs, dh1, dh3, w1, w3, groups)
}

func (m mutant) AdamWUpdate(param, grad, mm, v backend.Tensor, h backend.AdamW) {
	if m.kind == "adamw-no-bias-correction" {
		h.Step = 1 << 20
	}
	m.Backend.AdamWUpdate(param, grad, mm, v, h)
}

// countingTB records failures instead of failing the test.
type countingTB struct {
	testing.TB
	errors int
}

func (c *countingTB) Helper()               {}
func (c *countingTB) Errorf(string, ...any) { c.errors++ }

// TestCompareNormWise checks the bf16 attention metric: spread-out noise
// within the tolerance passes; the same noise scaled past it, one element
// far off, or a NaN fails.
func TestCompareNormWise(t *testing.T) {
	rng := backendtest.NewRand(t.Name())
	want := backendtest.RandFloats(rng, 4096, -1, 1)
	noisy := func(scale float64) []float64 {
		got := make([]float64, len(want))
		for i, w := range want {
			got[i] = w + scale*(2*rng.Float64()-1)
		}
		return got
	}
	const tol = 1e-2
	for _, c := range []struct {
		name string
		got  []float64
		pass bool
	}{
		// Uniform noise of amplitude a has rms a/sqrt(3); want's rms is
		// 1/sqrt(3), so the relative L2 error is about a.
		{"noise 0.5%", noisy(0.005), true},
		{"noise 2%", noisy(0.02), false},
		{"one element off by 0.5", func() []float64 { g := noisy(0.001); g[77] += 0.5; return g }(), false},
		{"a NaN", func() []float64 { g := noisy(0.001); g[5] = math.NaN(); return g }(), false},
	} {
		rec := &countingTB{TB: t}
		ok := backendtest.CompareNormWise(rec, c.name, c.got, want, tol)
		if ok != c.pass || (rec.errors == 0) != c.pass {
			t.Errorf("%s: CompareNormWise = %v with %d errors, want pass = %v", c.name, ok, rec.errors, c.pass)
		}
	}
}
