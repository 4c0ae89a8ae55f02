package cuda

// The MoE fused kernels (moe_fused.go) against their unfused sequence on
// the same GPU (backend.DispatchSwiGLUBySteps, DownCombineBySteps,
// DispatchDgradSwiGLUBySteps, DgradCombineBySteps: peer gathers and
// scatters around the grouped products) on fresh random inputs, their
// report of rows that never arrive, and their figures against the
// sequence and the grouped products alone on moe-small's shape.

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
)

// fusedCase is one layer's worth of rows for one destination rank: ranks
// sources with tokens rows each, sendS[s] rows sent by rank s, groups the
// destination's experts (row counts summing to the rows sent).
type fusedCase struct {
	name          string
	ranks, tokens int
	sendS         []int
	groups        []int
	d, f          int
}

// fusedInputs are a case's tensors on b.
type fusedInputs struct {
	srcTD, tokS, outSD []backend.Tensor
	scaleS             []backend.Tensor // per rank, a gate per sent row (the backward's)
	doneS              []backend.Tensor // per rank, its row flags (Int32, zero between combines)
	refsR2             backend.Tensor
	w1, w3, w2         backend.Tensor // bf16 stacks
	rows               int
}

// withBF16Sources is in with bf16 copies of the source rows (the layer's
// operand-type input): the gather of moe_dispatch_swiglu_bf16.
func (in fusedInputs) withBF16Sources(b *Backend) fusedInputs {
	out := in
	out.srcTD = make([]backend.Tensor, len(in.srcTD))
	for s, src := range in.srcTD {
		out.srcTD[s] = b.New(backend.BFloat16, src.Shape()...)
		b.Copy(out.srcTD[s], src)
	}
	return out
}

func (c fusedCase) inputs(b *Backend, seed uint64) fusedInputs {
	rng := rand.New(rand.NewPCG(seed, 7))
	in := fusedInputs{}
	var refs []int32
	for s := range c.ranks {
		src := make([]float32, c.tokens*c.d)
		for i := range src {
			src[i] = float32(rng.NormFloat64())
		}
		st := b.New(backend.Float32, c.tokens, c.d)
		backend.UploadSlice[float32](b, st, src)
		toks := make([]int32, c.sendS[s])
		for i := range toks {
			toks[i] = int32(rng.IntN(c.tokens))
		}
		tt := b.New(backend.Int32, max(len(toks), 1))
		if len(toks) > 0 {
			tt = b.View(tt, 0, len(toks))
			backend.UploadSlice(b, tt, toks)
		} else {
			tt = b.View(tt, 0, 0)
		}
		in.srcTD = append(in.srcTD, st)
		in.tokS = append(in.tokS, tt)
		in.outSD = append(in.outSD, b.New(backend.Float32, c.sendS[s], c.d))
		in.doneS = append(in.doneS, b.View(b.New(backend.Int32, max(c.sendS[s], 1)), 0, c.sendS[s]))
		gates := make([]float32, max(c.sendS[s], 1))
		for i := range gates {
			gates[i] = float32(0.1 + 0.9*rng.Float64())
		}
		gt := b.New(backend.Float32, len(gates))
		backend.UploadSlice(b, gt, gates)
		in.scaleS = append(in.scaleS, b.View(gt, 0, c.sendS[s]))
		for p := range c.sendS[s] {
			refs = append(refs, int32(s), int32(p))
		}
	}
	// Expert-major order is any permutation of the sent rows.
	n := len(refs) / 2
	perm := rng.Perm(n)
	shuffled := make([]int32, 0, len(refs))
	for _, i := range perm {
		shuffled = append(shuffled, refs[2*i], refs[2*i+1])
	}
	in.rows = n
	in.refsR2 = b.New(backend.Int32, max(n, 1), 2)
	if n > 0 {
		in.refsR2 = b.View(in.refsR2, 0, n, 2)
		backend.UploadSlice(b, in.refsR2, shuffled)
	}
	g := len(c.groups)
	bf := func(rows, cols int, scale float64) backend.Tensor {
		v := make([]float32, rows*cols)
		for i := range v {
			v[i] = float32(scale * rng.NormFloat64())
		}
		f := b.New(backend.Float32, rows, cols)
		backend.UploadSlice(b, f, v)
		h := b.New(backend.BFloat16, rows, cols)
		b.Copy(h, f)
		return h
	}
	in.w1 = bf(g*c.f, c.d, 1/math.Sqrt(float64(c.d)))
	in.w3 = bf(g*c.f, c.d, 1/math.Sqrt(float64(c.d)))
	in.w2 = bf(g*c.d, c.f, 1/math.Sqrt(float64(c.f)))
	return in
}

// fusedOut is what one path computed.
type fusedOut struct {
	x, h1, h3, act []float32
	outs           [][]float32
	// The sources' side: each rank's flags after the down product, and
	// its combine of the rows into its tokens (CombineRows, gated as the
	// forward's) and its flags after that.
	raised, cleared [][]int32
	combined        [][]float32
}

// combineRanks runs every source rank's CombineRows of its rows outSD
// (scaled by scaleS, or not when nil) into a fresh [tokens, d] tensor and
// returns the flags before, the combined rows and the flags after.
func (c fusedCase) combineRanks(b *Backend, in fusedInputs, scaleS []backend.Tensor) (raised [][]int32, combined [][]float32, cleared [][]int32) {
	raised = downloadFlags(b, in.doneS)
	var sums []backend.Tensor
	for s := range c.ranks {
		sum := b.New(backend.Float32, c.tokens, c.d)
		var scale backend.Tensor
		if scaleS != nil {
			scale = scaleS[s]
		}
		b.CombineRows(sum, in.outSD[s], in.tokS[s], scale, in.doneS[s], []int{c.sendS[s]})
		sums = append(sums, sum)
	}
	return raised, downloadRanks(b, sums), downloadFlags(b, in.doneS)
}

func (c fusedCase) run(b *Backend, in fusedInputs, fused bool) fusedOut {
	r := max(in.rows, 1)
	x, h1, h3, act := b.New(backend.BFloat16, r, c.d), b.New(backend.BFloat16, r, c.f), b.New(backend.BFloat16, r, c.f), b.New(backend.BFloat16, r, c.f)
	x, h1, h3, act = b.View(x, 0, in.rows, c.d), b.View(h1, 0, in.rows, c.f), b.View(h3, 0, in.rows, c.f), b.View(act, 0, in.rows, c.f)
	for _, o := range in.outSD {
		b.Zero(o)
	}
	if fused {
		b.DispatchSwiGLU(x, h1, h3, act, in.srcTD, in.tokS, in.refsR2, in.w1, in.w3, backend.Groups{Rows: c.groups})
		b.DownCombine(in.outSD, in.doneS, in.refsR2, act, in.w2, backend.Groups{Rows: c.groups})
	} else {
		backend.DispatchSwiGLUBySteps(b, x, h1, h3, act, in.srcTD, in.tokS, in.refsR2, in.w1, in.w3, backend.Groups{Rows: c.groups})
		backend.DownCombineBySteps(b, b.New(backend.Float32, in.rows, c.d), in.outSD, in.doneS, in.refsR2, act, in.w2, backend.Groups{Rows: c.groups})
	}
	o := fusedOut{outs: downloadRanks(b, in.outSD)}
	o.raised, o.combined, o.cleared = c.combineRanks(b, in, in.scaleS)
	if in.rows > 0 {
		o.x, o.h1, o.h3, o.act = backend.DownloadFloat32(b, x), backend.DownloadFloat32(b, h1), backend.DownloadFloat32(b, h3), backend.DownloadFloat32(b, act)
	}
	return o
}

// downloadRanks downloads every rank's output rows (nil for a rank with
// none).
func downloadRanks(b *Backend, outSD []backend.Tensor) [][]float32 {
	return downloadEach(b, outSD, backend.DownloadFloat32)
}

// downloadFlags downloads every rank's row flags.
func downloadFlags(b *Backend, doneS []backend.Tensor) [][]int32 {
	return downloadEach(b, doneS, backend.DownloadInt32)
}

// downloadEach downloads every tensor of ts (nil for an empty one).
func downloadEach[T any](b *Backend, ts []backend.Tensor, download func(backend.Backend, backend.Tensor) []T) [][]T {
	var all [][]T
	for _, t := range ts {
		var v []T
		if t.Len() > 0 {
			v = download(b, t)
		}
		all = append(all, v)
	}
	return all
}

// fusedGrads is what one path of the backward computed.
type fusedGrads struct {
	dy, dh1, dh3    []float32
	outs            [][]float32
	raised, cleared [][]int32 // as fusedOut's (the combine not scaled)
	combined        [][]float32
}

// runBackward runs the backward ops on in, with the source rows standing
// for the output gradients and h1, h3 the forward's, fused or as their
// unfused sequence.
func (c fusedCase) runBackward(b *Backend, in fusedInputs, h1, h3 backend.Tensor, fused bool) fusedGrads {
	r := max(in.rows, 1)
	dy, dh1, dh3 := b.New(backend.BFloat16, r, c.d), b.New(backend.BFloat16, r, c.f), b.New(backend.BFloat16, r, c.f)
	dy, dh1, dh3 = b.View(dy, 0, in.rows, c.d), b.View(dh1, 0, in.rows, c.f), b.View(dh3, 0, in.rows, c.f)
	for _, o := range in.outSD {
		b.Zero(o)
	}
	if fused {
		b.DispatchDgradSwiGLU(dy, dh1, dh3, in.srcTD, in.tokS, in.scaleS, in.refsR2, h1, h3, in.w2, backend.Groups{Rows: c.groups})
		b.DgradCombine(in.outSD, in.doneS, in.refsR2, dh1, dh3, in.w1, in.w3, backend.Groups{Rows: c.groups})
	} else {
		backend.DispatchDgradSwiGLUBySteps(b, b.New(backend.Float32, in.rows, c.f), dy, dh1, dh3, in.srcTD, in.tokS, in.scaleS, in.refsR2, h1, h3, in.w2, backend.Groups{Rows: c.groups})
		backend.DgradCombineBySteps(b, b.New(backend.Float32, in.rows, c.d), in.outSD, in.doneS, in.refsR2, dh1, dh3, in.w1, in.w3, backend.Groups{Rows: c.groups})
	}
	o := fusedGrads{outs: downloadRanks(b, in.outSD)}
	o.raised, o.combined, o.cleared = c.combineRanks(b, in, nil)
	if in.rows > 0 {
		o.dy, o.dh1, o.dh3 = backend.DownloadFloat32(b, dy), backend.DownloadFloat32(b, dh1), backend.DownloadFloat32(b, dh3)
	}
	return o
}

// relL2 is ||a-b|| / ||b||.
func relL2(a, b []float32) float64 {
	var num, den float64
	for i := range a {
		d := float64(a[i]) - float64(b[i])
		num += d * d
		den += float64(b[i]) * float64(b[i])
	}
	if den == 0 {
		return math.Sqrt(num)
	}
	return math.Sqrt(num / den)
}

func fusedCases() []fusedCase {
	return []fusedCase{
		{"w1 one group", 1, 300, []int{300}, []int{300}, 256, 384},
		{"w2 uneven with an empty group", 2, 256, []int{333, 190}, []int{200, 0, 129, 194}, 256, 384},
		{"w4 one rank sends nothing", 4, 200, []int{250, 0, 400, 77}, []int{1, 127, 128, 471}, 512, 256},
		{"w8 skewed: all to one group", 8, 64, []int{100, 90, 80, 70, 60, 50, 40, 30}, []int{0, 520, 0, 0}, 256, 384},
		{"tails: D and F not multiples of 64", 2, 100, []int{150, 99}, []int{120, 129}, 200, 136},
	}
}

// withMoEKernels runs b's fused MoE kernels from a build of the tests'
// own (key names it in the device's module table; text and defines make
// it, a build of moe_fused.cu's kernels) until the returned restore is
// called; use, when not nil, picks which of its kernels replace the
// production ones (prod, changed in place), else all do. Every kernel is
// loaded and opted in before any is swapped, so a Fatal leaves the
// production ones in place.
func withMoEKernels(t *testing.T, b *Backend, key string, text func() (string, error), use func(prod *moeKernels, build moeKernels), defines ...string) (restore func()) {
	t.Helper()
	src, _ := kernelSource(t, "moe_fused.cu")
	m, err := b.dev.load(src, key, text, defines...)
	if err != nil {
		t.Fatal(err)
	}
	x, ok := b.expertKernels() // made on first use
	if !ok {
		t.Fatalf("grouped GEMM kernels: %v", x.err)
	}
	gg := x.bf16Out
	build, err := gg.loadMoEKernels(m)
	if err != nil {
		t.Fatalf("%s: %v", key, err)
	}
	prod := gg.moe
	if use == nil {
		gg.moe = build
	} else {
		use(&gg.moe, build)
	}
	return func() { gg.moe = prod }
}

// withLostRows runs b's fused MoE kernels (those use picks, as
// withMoEKernels) from moe_fused.cu built with MOE_TEST_LOST_ROWS: the
// gathers never publish the last m-tile's first chunk, the combines never
// raise expert-major row 0's flag.
func withLostRows(t *testing.T, b *Backend, use func(prod *moeKernels, build moeKernels)) (restore func()) {
	t.Helper()
	src, _ := kernelSource(t, "moe_fused.cu")
	return withMoEKernels(t, b, "moe_fused.cu+lost-rows", src.Text, use, "MOE_TEST_LOST_ROWS=1")
}

func TestMoEFusedMatchesUnfused(t *testing.T) {
	testGroupedGemm(t) // the canary and the Hopper check
	b := testBackend(t)
	for i, c := range fusedCases() {
		t.Run(c.name, func(t *testing.T) { c.testAgainstUnfused(t, b, uint64(100+i)) })
	}
}

// testAgainstUnfused runs c on fresh inputs from seed both ways.
func (c fusedCase) testAgainstUnfused(t *testing.T, b *Backend, seed uint64) {
	in := c.inputs(b, seed)
	got := c.run(b, in, true)
	want := c.run(b, in, false)
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	if in.rows > 0 {
		for j := range want.x {
			if got.x[j] != want.x[j] {
				t.Fatalf("x[%d] = %v, the unfused gather gives %v (the gather is exact)", j, got.x[j], want.x[j])
			}
		}
		for _, p := range []struct {
			name      string
			got, want []float32
		}{{"h1", got.h1, want.h1}, {"h3", got.h3, want.h3}, {"act", got.act, want.act}} {
			if e := relL2(p.got, p.want); !(e < 1e-2) {
				t.Errorf("%s: rel L2 %.3g against the unfused sequence", p.name, e)
			}
		}
	}
	for s := range got.outs {
		if e := relL2(got.outs[s], want.outs[s]); !(e < 2e-2) {
			t.Errorf("rank %d's combined rows: rel L2 %.3g against the unfused sequence", s, e)
		}
	}
	checkCombine(t, "forward", got.outs, got.raised, got.combined, got.cleared, want.combined)
	if t.Failed() || in.rows == 0 {
		return
	}
	// From bf16 sources (moe_dispatch_swiglu_bf16, and the unfused gather
	// of bf16 rows): the rows gathered are bf16(src) either way, so every
	// output is the float sources' bit for bit.
	inB := in.withBF16Sources(b)
	for _, fused := range []bool{true, false} {
		gotB, ref := c.run(b, inB, fused), got
		if !fused {
			ref = want
		}
		if err := b.Sync(); err != nil {
			t.Fatal(err)
		}
		for _, p := range []struct {
			name      string
			got, want []float32
		}{{"x", gotB.x, ref.x}, {"h1", gotB.h1, ref.h1}, {"h3", gotB.h3, ref.h3}, {"act", gotB.act, ref.act}} {
			for j := range p.want {
				if math.Float32bits(p.got[j]) != math.Float32bits(p.want[j]) {
					t.Fatalf("bf16 sources (fused %v): %s[%d] = %v, the float sources give %v", fused, p.name, j, p.got[j], p.want[j])
				}
			}
		}
	}
	// The backward, on the forward's h1 and h3 (the unfused path's).
	r := in.rows
	h1, h3 := bf16Of(b, want.h1, r, c.f), bf16Of(b, want.h3, r, c.f)
	gotG := c.runBackward(b, in, h1, h3, true)
	wantG := c.runBackward(b, in, h1, h3, false)
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	for j := range wantG.dy {
		if gotG.dy[j] != wantG.dy[j] {
			t.Fatalf("dy[%d] = %v, the unfused gather gives %v (the scaled gather is exact)", j, gotG.dy[j], wantG.dy[j])
		}
	}
	for _, p := range []struct {
		name      string
		got, want []float32
	}{{"dh1", gotG.dh1, wantG.dh1}, {"dh3", gotG.dh3, wantG.dh3}} {
		if e := relL2(p.got, p.want); !(e < 1e-2) {
			t.Errorf("%s: rel L2 %.3g against the unfused sequence", p.name, e)
		}
	}
	for s := range gotG.outs {
		if e := relL2(gotG.outs[s], wantG.outs[s]); !(e < 2e-2) {
			t.Errorf("rank %d's dx rows: rel L2 %.3g against the unfused sequence", s, e)
		}
	}
	checkCombine(t, "backward", gotG.outs, gotG.raised, gotG.combined, gotG.cleared, wantG.combined)
}

// checkCombine checks the sources' side of a fused combine: every sent
// row's flag raised by the fused kernel (every sent row is some expert
// row's in these cases), every flag cleared by CombineRows, and the
// combined token rows against the unfused path's.
func checkCombine(t *testing.T, pass string, outs [][]float32, raised [][]int32, combined [][]float32, cleared [][]int32, want [][]float32) {
	t.Helper()
	for s := range outs {
		for p, f := range raised[s] {
			if f != 1 {
				t.Errorf("%s: rank %d's flag of send row %d is %v after the fused kernel, want 1", pass, s, p, f)
				break
			}
		}
		for p, f := range cleared[s] {
			if f != 0 {
				t.Errorf("%s: rank %d's flag of send row %d is %v after CombineRows, want 0", pass, s, p, f)
				break
			}
		}
		if e := relL2(combined[s], want[s]); !(e < 2e-2) {
			t.Errorf("%s: rank %d's combined token rows: rel L2 %.3g against the unfused path", pass, s, e)
		}
	}
}

// bf16Of uploads float32 values that are bf16 already (a download of a
// bf16 tensor) as a bf16 tensor [rows, cols], exactly.
func bf16Of(b *Backend, v []float32, rows, cols int) backend.Tensor {
	f := b.New(backend.Float32, rows, cols)
	backend.UploadSlice(b, f, v)
	h := b.New(backend.BFloat16, rows, cols)
	b.Copy(h, f)
	return h
}

// forceDgrad makes every moe_dispatch_dgrad call of b run build
// (dgradBeside or dgradFirst) until the returned restore is called.
func forceDgrad(t *testing.T, b *Backend, build int) (restore func()) {
	t.Helper()
	x, ok := b.expertKernels()
	if !ok {
		t.Fatalf("grouped GEMM kernels: %v", x.err)
	}
	set := func(v int) {
		if err := b.dev.Do(func() error { x.bf16Out.dgrad.force = v; return nil }); err != nil {
			t.Fatal(err)
		}
	}
	set(build)
	return func() { set(-1) }
}

// TestMoEFusedDgradBuildsAgree runs the fused backward of every case with
// each build of the dispatch+dgrad kernel: the gathered rows, dh1, dh3 and
// the rows sent back must be the same bit for bit (the builds differ only
// in which warps gather, and when).
func TestMoEFusedDgradBuildsAgree(t *testing.T) {
	testGroupedGemm(t)
	b := testBackend(t)
	for i, c := range fusedCases() {
		t.Run(c.name, func(t *testing.T) {
			in := c.inputs(b, uint64(500+i))
			if in.rows == 0 {
				t.Skip("no rows")
			}
			fw := c.run(b, in, false)
			h1, h3 := bf16Of(b, fw.h1, in.rows, c.f), bf16Of(b, fw.h3, in.rows, c.f)
			var got [2]fusedGrads
			for _, build := range []int{dgradBeside, dgradFirst} {
				restore := forceDgrad(t, b, build)
				got[build] = c.runBackward(b, in, h1, h3, true)
				err := b.Sync()
				restore()
				if err != nil {
					t.Fatalf("dgrad build %d: %v", build, err)
				}
			}
			for _, p := range []struct {
				name        string
				beside, fst []float32
			}{{"dy", got[0].dy, got[1].dy}, {"dh1", got[0].dh1, got[1].dh1}, {"dh3", got[0].dh3, got[1].dh3}} {
				if len(p.beside) != len(p.fst) {
					t.Fatalf("%s: %d values against %d", p.name, len(p.beside), len(p.fst))
				}
				for j := range p.beside {
					if math.Float32bits(p.beside[j]) != math.Float32bits(p.fst[j]) {
						t.Fatalf("%s[%d]: %v gathering beside, %v gathering first", p.name, j, p.beside[j], p.fst[j])
					}
				}
			}
			for s := range got[0].outs {
				for j := range got[0].outs[s] {
					if math.Float32bits(got[0].outs[s][j]) != math.Float32bits(got[1].outs[s][j]) {
						t.Fatalf("rank %d's dx[%d]: %v gathering beside, %v gathering first", s, j, got[0].outs[s][j], got[1].outs[s][j])
					}
				}
			}
		})
	}
}

// TestMoEFusedDgradChooses runs one shape's fused backward until the
// chooser has timed both builds dgradTrialRuns times, and checks that it
// then keeps the faster one; every result on the way matches the unfused
// sequence (the builds alternate while they are timed).
func TestMoEFusedDgradChooses(t *testing.T) {
	testGroupedGemm(t)
	b := testBackend(t)
	c := fusedCases()[2]
	in := c.inputs(b, 61)
	fw := c.run(b, in, false)
	h1, h3 := bf16Of(b, fw.h1, in.rows, c.f), bf16Of(b, fw.h3, in.rows, c.f)
	want := c.runBackward(b, in, h1, h3, false)
	gg := b.experts.bf16Out
	shape := newDgradShape(in.rows, c.f, c.d, len(c.groups))
	var trials dgradTrials
	for call := 0; call <= 2*dgradTrialRuns+1; call++ {
		got := c.runBackward(b, in, h1, h3, true)
		if err := b.Sync(); err != nil {
			t.Fatalf("call %d: %v", call, err)
		}
		if e := relL2(got.dh1, want.dh1); !(e < 1e-2) {
			t.Fatalf("call %d: dh1 rel L2 %.3g against the unfused sequence", call, e)
		}
		if err := b.dev.Do(func() error {
			if tr := gg.dgrad.shapes[shape]; tr != nil {
				trials = *tr
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	// The last call read the timings of the ones before it.
	if trials.choice < 0 || len(trials.ms[dgradBeside]) != dgradTrialRuns || len(trials.ms[dgradFirst]) != dgradTrialRuns {
		t.Fatalf("after %d calls: choice %d, timings %v; want a choice from %d timings of each build", 2*dgradTrialRuns+2, trials.choice, trials.ms, dgradTrialRuns)
	}
	if faster := slices.Min(trials.ms[dgradFirst]) < slices.Min(trials.ms[dgradBeside]); faster != (trials.choice == dgradFirst) {
		t.Errorf("chose build %d from timings %v", trials.choice, trials.ms)
	}
	t.Logf("build %d chosen; timings (ms) beside %v, first %v", trials.choice, trials.ms[dgradBeside], trials.ms[dgradFirst])
}

// TestMoEFusedReportsLostRows makes the gathers of both dispatch kernels
// lose one chunk of rows (the MOE_TEST_LOST_ROWS build, as a peer that
// never delivers): Sync must return an error naming the kernel, the
// m-tile and the rank, within the (shortened) bound, and the device must
// work afterwards.
func TestMoEFusedReportsLostRows(t *testing.T) {
	testGroupedGemm(t)
	b := testBackend(t)
	c := fusedCases()[2] // 4 ranks, 727 rows: m-tiles 0..6 over the groups
	in := c.inputs(b, 31)
	gg := b.experts.bf16Out
	restore := withLostRows(t, b, nil)
	defer restore()
	gg.fusedTimeout = 200 * time.Millisecond
	defer func() { gg.fusedTimeout = 0 }()
	fw := c.run(b, in, true)
	err := b.Sync()
	if err == nil || !strings.Contains(err.Error(), "moe_dispatch_swiglu") || !strings.Contains(err.Error(), "m-tile") ||
		!strings.Contains(err.Error(), "rank") {
		t.Fatalf("forward with a lost chunk: Sync gave %v, want the dispatch kernel's report of the m-tile and rank", err)
	}
	t.Logf("forward: %v", err)
	h1, h3 := bf16Of(b, fw.h1, in.rows, c.f), bf16Of(b, fw.h3, in.rows, c.f)
	for _, build := range []int{dgradBeside, dgradFirst} {
		restore := forceDgrad(t, b, build)
		c.runBackward(b, in, h1, h3, true)
		err = b.Sync()
		restore()
		if err == nil || !strings.Contains(err.Error(), "moe_dispatch_dgrad") || !strings.Contains(err.Error(), "m-tile") {
			t.Fatalf("backward (dgrad build %d) with a lost chunk: Sync gave %v, want the dgrad kernel's report", build, err)
		}
		t.Logf("backward (dgrad build %d): %v", build, err)
	}
	// Healthy again: the record was re-armed and the context lives.
	restore()
	c.testAgainstUnfused(t, b, 32)
}

// TestMoEFusedReportsLostCombineRow makes the down product never raise
// the flag of expert-major row 0 (the MOE_TEST_LOST_ROWS build of the
// combining kernels): the source's CombineRows must give up on that row within the
// (shortened) bound, Sync must name the kernel, the send row and the rank
// that owed it, and the device must work afterwards.
func TestMoEFusedReportsLostCombineRow(t *testing.T) {
	testGroupedGemm(t)
	b := testBackend(t)
	c := fusedCases()[1] // 2 ranks sending 333 and 190 rows
	in := c.inputs(b, 41)
	x, h1, h3, act := b.New(backend.BFloat16, in.rows, c.d), b.New(backend.BFloat16, in.rows, c.f), b.New(backend.BFloat16, in.rows, c.f), b.New(backend.BFloat16, in.rows, c.f)
	b.DispatchSwiGLU(x, h1, h3, act, in.srcTD, in.tokS, in.refsR2, in.w1, in.w3, backend.Groups{Rows: c.groups})
	restore := withLostRows(t, b, func(prod *moeKernels, lost moeKernels) { prod.downCombine = lost.downCombine })
	defer restore()
	b.fused.combineTimeout = 200 * time.Millisecond
	defer func() { b.fused.combineTimeout = 0 }()
	b.DownCombine(in.outSD, in.doneS, in.refsR2, act, in.w2, backend.Groups{Rows: c.groups})
	restore()
	refs := backend.DownloadInt32(b, in.refsR2)
	start := time.Now()
	_, _, cleared := c.combineRanks(b, in, in.scaleS)
	err := b.Sync()
	want := fmt.Sprintf("send row %d never arrived from rank 0", refs[1])
	if err == nil || !strings.Contains(err.Error(), "combine_rows_f32") || !strings.Contains(err.Error(), want) {
		t.Fatalf("a row never flagged: Sync gave %v, want combine_rows_f32's report with %q", err, want)
	}
	t.Logf("after %v: %v", time.Since(start).Round(time.Millisecond), err)
	for s, flags := range cleared {
		for p, f := range flags {
			if f != 0 {
				t.Errorf("rank %d's flag of send row %d is %v after the combine, want 0", s, p, f)
			}
		}
	}
	c.testAgainstUnfused(t, b, 42)
}

// moeFigureShape is a shape the MoE figures time: one rank's expert block
// at each of worlds expert-parallel ranks.
type moeFigureShape struct {
	prefix                   string // of the subtest and figure names
	d, f, experts, k, tokens int
	worlds                   []int
}

// moeFigureShapes are moe-small at W = 1, 4 and 8 (16384 tokens a rank,
// top-2: each rank's 8/W experts get 32768 rows on average, a W-th from
// every rank) and the fine-grained shape at W = 1 and 4 (D 2048, F 1408,
// 64 experts, top-6 of 4096 tokens a rank: 24576 rows).
func moeFigureShapes() []moeFigureShape {
	return []moeFigureShape{
		{"", 1024, 2816, 8, 2, 16384, []int{1, 4, 8}},
		{"fine_", 2048, 1408, 64, 6, 4096, []int{1, 4}},
	}
}

// moeBench is one rank's expert block of a figure shape at W ranks on b:
// its inputs and outputs, the calls the figures time, and the figures
// taken so far (ms, by name).
type moeBench struct {
	t   *testing.T
	b   *Backend
	tag string // the subtest's name, in every figure's
	ms  map[string]float64
	// The pair fused, unfused and as its products alone, and the halves:
	// gate/up (with the gather) and down (with the scatter), each fused,
	// unfused and as its products alone; the fused ones also from bf16
	// sources, as the layer runs them (moe.Layer's xoTD).
	fused, unfused, gemms                           func() error
	gateUpFused, gateUpUnfused, gateUpGemm          func() error
	fusedBF16, gateUpFusedBF16, downFused, downGemm func() error
	dgradFused                                      func() error // the backward's dispatch+dgrad, fused
	bwd                                             []moeRun     // the backward's calls
	flop                                            float64      // the pair's products
}

// moeRun is a named call the figures time.
type moeRun struct {
	name string
	run  func() error
}

// newMoEBench makes sh's block at w ranks on b.
func newMoEBench(t *testing.T, b *Backend, sh moeFigureShape, w int) *moeBench {
	d, f, experts, k, tokens := sh.d, sh.f, sh.experts, sh.k, sh.tokens
	g := experts / w
	send := make([]int, w)
	for s := range send {
		send[s] = tokens * k / w
	}
	rows := 0
	for _, n := range send {
		rows += n
	}
	groups := make([]int, g)
	rng := rand.New(rand.NewPCG(9, uint64(w)))
	left := rows
	for e := range groups[:g-1] {
		groups[e] = rows/g + rng.IntN(rows/(4*g)) - rows/(8*g)
		left -= groups[e]
	}
	groups[g-1] = left
	tag := fmt.Sprintf("%sW%d", sh.prefix, w)
	c := fusedCase{tag, w, tokens, send, groups, d, f}
	in := c.inputs(b, 5)
	inB := in.withBF16Sources(b)
	x, h1, h3, act := b.New(backend.BFloat16, rows, d), b.New(backend.BFloat16, rows, f), b.New(backend.BFloat16, rows, f), b.New(backend.BFloat16, rows, f)
	y := b.New(backend.Float32, rows, d)
	m := &moeBench{t: t, b: b, tag: tag, ms: map[string]float64{}, flop: 2 * float64(rows) * float64(d) * float64(f) * 3}
	m.fused = func() error {
		b.DispatchSwiGLU(x, h1, h3, act, in.srcTD, in.tokS, in.refsR2, in.w1, in.w3, backend.Groups{Rows: groups})
		b.DownCombine(in.outSD, in.doneS, in.refsR2, act, in.w2, backend.Groups{Rows: groups})
		return nil
	}
	m.unfused = func() error {
		backend.DispatchSwiGLUBySteps(b, x, h1, h3, act, in.srcTD, in.tokS, in.refsR2, in.w1, in.w3, backend.Groups{Rows: groups})
		backend.DownCombineBySteps(b, y, in.outSD, in.doneS, in.refsR2, act, in.w2, backend.Groups{Rows: groups})
		return nil
	}
	m.gemms = func() error {
		b.GroupedMatMul(h1, x, in.w1, backend.Groups{Rows: groups}, true, 1, 0)
		b.GroupedMatMul(h3, x, in.w3, backend.Groups{Rows: groups}, true, 1, 0)
		b.GroupedMatMul(y, act, in.w2, backend.Groups{Rows: groups}, true, 1, 0)
		return nil
	}
	m.gateUpFused = func() error {
		b.DispatchSwiGLU(x, h1, h3, act, in.srcTD, in.tokS, in.refsR2, in.w1, in.w3, backend.Groups{Rows: groups})
		return nil
	}
	m.gateUpUnfused = func() error {
		backend.DispatchSwiGLUBySteps(b, x, h1, h3, act, in.srcTD, in.tokS, in.refsR2, in.w1, in.w3, backend.Groups{Rows: groups})
		return nil
	}
	m.gateUpGemm = func() error {
		b.GroupedMatMul(h1, x, in.w1, backend.Groups{Rows: groups}, true, 1, 0)
		b.GroupedMatMul(h3, x, in.w3, backend.Groups{Rows: groups}, true, 1, 0)
		return nil
	}
	m.fusedBF16 = func() error {
		b.DispatchSwiGLU(x, h1, h3, act, inB.srcTD, inB.tokS, inB.refsR2, in.w1, in.w3, backend.Groups{Rows: groups})
		b.DownCombine(in.outSD, in.doneS, in.refsR2, act, in.w2, backend.Groups{Rows: groups})
		return nil
	}
	m.gateUpFusedBF16 = func() error {
		b.DispatchSwiGLU(x, h1, h3, act, inB.srcTD, inB.tokS, inB.refsR2, in.w1, in.w3, backend.Groups{Rows: groups})
		return nil
	}
	m.downFused = func() error {
		b.DownCombine(in.outSD, in.doneS, in.refsR2, act, in.w2, backend.Groups{Rows: groups})
		return nil
	}
	m.downGemm = func() error { b.GroupedMatMul(y, act, in.w2, backend.Groups{Rows: groups}, true, 1, 0); return nil }
	// The backward: the fused pair, its unfused sequence (cuBLASLt NN
	// products per group), and its three products alone as plain NT
	// grouped GEMMs on K-major weights of the same shapes (zeros: the
	// timing does not depend on the values; the fused kernels read the
	// weights as stored, MN-major).
	dy, dh1, dh3 := b.New(backend.BFloat16, rows, d), b.New(backend.BFloat16, rows, f), b.New(backend.BFloat16, rows, f)
	dAct := b.New(backend.Float32, rows, f)
	w2T, w1T, w3T := b.New(backend.BFloat16, g*f, d), b.New(backend.BFloat16, g*d, f), b.New(backend.BFloat16, g*d, f)
	m.dgradFused = func() error {
		b.DispatchDgradSwiGLU(dy, dh1, dh3, in.srcTD, in.tokS, in.scaleS, in.refsR2, h1, h3, in.w2, backend.Groups{Rows: groups})
		return nil
	}
	m.bwd = []moeRun{
		{"bwd_fused", func() error {
			b.DispatchDgradSwiGLU(dy, dh1, dh3, in.srcTD, in.tokS, in.scaleS, in.refsR2, h1, h3, in.w2, backend.Groups{Rows: groups})
			b.DgradCombine(in.outSD, in.doneS, in.refsR2, dh1, dh3, in.w1, in.w3, backend.Groups{Rows: groups})
			return nil
		}},
		{"bwd_unfused", func() error {
			backend.DispatchDgradSwiGLUBySteps(b, dAct, dy, dh1, dh3, in.srcTD, in.tokS, in.scaleS, in.refsR2, h1, h3, in.w2, backend.Groups{Rows: groups})
			backend.DgradCombineBySteps(b, y, in.outSD, in.doneS, in.refsR2, dh1, dh3, in.w1, in.w3, backend.Groups{Rows: groups})
			return nil
		}},
		{"bwd_gemm_nt", func() error {
			b.GroupedMatMul(h1, dy, w2T, backend.Groups{Rows: groups}, true, 1, 0)
			b.GroupedMatMul(x, dh1, w1T, backend.Groups{Rows: groups}, true, 1, 0)
			b.GroupedMatMul(x, dh3, w3T, backend.Groups{Rows: groups}, true, 1, 0)
			return nil
		}},
		// The halves: dispatch+dgrad (with the gather and SwiGLU's
		// backward) and dgrad+combine, each fused and as its products
		// alone.
		{"bwd_dgrad_fused", m.dgradFused},
		{"bwd_dgrad_gemm", func() error { b.GroupedMatMul(h1, dy, w2T, backend.Groups{Rows: groups}, true, 1, 0); return nil }},
		{"bwd_combine_fused", func() error {
			b.DgradCombine(in.outSD, in.doneS, in.refsR2, dh1, dh3, in.w1, in.w3, backend.Groups{Rows: groups})
			return nil
		}},
		{"bwd_combine_gemm", func() error {
			b.GroupedMatMul(x, dh1, w1T, backend.Groups{Rows: groups}, true, 1, 0)
			b.GroupedMatMul(x, dh3, w3T, backend.Groups{Rows: groups}, true, 1, 0)
			return nil
		}},
	}
	return m
}

// timed times run (ggTime), logs it as figure moe_fused_<tag>_<name>_ms
// and keeps it in m.ms.
func (m *moeBench) timed(name string, run func() error) float64 {
	v, err := ggTime(m.b.dev, run)
	if err != nil {
		m.t.Fatal(err)
	}
	if err := m.b.Sync(); err != nil {
		m.t.Fatal(err)
	}
	m.ms[name] = v
	figure(m.t, fmt.Sprintf("moe_fused_%s_%s_ms", m.tag, name), v, "ms")
	return v
}

// sustained times run back to back for ~300 ms, as a training step runs
// it (ggTime's launches each start from an idle device): the clock the
// device holds under sustained load is what the block's ratio meets. It
// logs the figure moe_fused_<tag>_<name>_sustained_ms and its host
// window, for the device's clock and power log (scripts/gpu-test.sh
// samples nvidia-smi).
func (m *moeBench) sustained(name string, run func() error) {
	if err := run(); err != nil { // x holds the sources' rows
		m.t.Fatal(err)
	}
	v, window, err := sustainedTime(m.b.dev, 300*time.Millisecond, m.ms[name], run)
	if err != nil {
		m.t.Fatal(err)
	}
	m.ms[name+"_sustained"] = v
	figure(m.t, fmt.Sprintf("moe_fused_%s_%s_sustained_ms", m.tag, name), v, "ms")
	m.t.Logf("window: moe_fused_%s_%s_sustained %s", m.tag, name, window)
}

// TestMoEFusedFigures times the figure shapes' blocks: the fused pair,
// the unfused sequence, and the grouped products alone on the same rows,
// forward and backward, single and back to back. The experiments on the
// fused kernels (kernels/dev) are timed by TestMoELabFigures.
func TestMoEFusedFigures(t *testing.T) {
	testGroupedGemm(t)
	b := testBackend(t)
	for _, sh := range moeFigureShapes() {
		for _, w := range sh.worlds {
			t.Run(fmt.Sprintf("%sW%d", sh.prefix, w), func(t *testing.T) {
				m := newMoEBench(t, b, sh, w)
				for _, p := range []moeRun{{"fused", m.fused}, {"unfused", m.unfused}, {"gemm_alone", m.gemms},
					{"gateup_fused", m.gateUpFused}, {"gateup_unfused", m.gateUpUnfused}, {"gateup_gemm", m.gateUpGemm},
					{"down_fused", m.downFused}, {"down_gemm", m.downGemm},
					{"fused_bf16src", m.fusedBF16}, {"gateup_fused_bf16src", m.gateUpFusedBF16}} {
					v := m.timed(p.name, p.run)
					if p.name == "fused" || p.name == "unfused" || p.name == "gemm_alone" {
						figure(t, fmt.Sprintf("moe_fused_%s_%s_tflops", m.tag, p.name), m.flop/v/1e9, "TFLOP/s")
					}
				}
				for _, p := range m.bwd {
					m.timed(p.name, p.run)
				}
				figure(t, "moe_fused_"+m.tag+"_bwd_unfused_over_fused", m.ms["bwd_unfused"]/m.ms["bwd_fused"], "x")
				figure(t, "moe_fused_"+m.tag+"_bwd_fused_over_parts", m.ms["bwd_fused"]/m.ms["bwd_gemm_nt"], "x")
				gg := b.experts.bf16Out
				for _, k := range []*Kernel{gg.moe.dispatchSwiGLU, gg.moe.dispatchDgrad, gg.moe.downCombine, gg.moe.dgradCombine} {
					figure(t, k.Desc.Name+"_local_bytes", float64(k.LocalBytes), "B")
				}
				for _, p := range []moeRun{{"gateup_gemm", m.gateUpGemm}, {"gateup_fused_bf16src", m.gateUpFusedBF16},
					{"gemm_alone", m.gemms}, {"fused_bf16src", m.fusedBF16}} {
					m.sustained(p.name, p.run)
				}
				figure(t, "moe_fused_"+m.tag+"_fused_bf16src_over_gemm_sustained",
					m.ms["fused_bf16src_sustained"]/m.ms["gemm_alone_sustained"], "x")
				// Each build of the dgrad kernel alone (bwd_dgrad_fused
				// above is the chooser's pick).
				for _, build := range []struct {
					name  string
					build int
				}{{"bwd_dgrad_fused_beside", dgradBeside}, {"bwd_dgrad_fused_first", dgradFirst}} {
					restore := forceDgrad(t, b, build.build)
					m.timed(build.name, m.dgradFused)
					restore()
				}
				figure(t, "moe_dispatch_dgrad_first_local_bytes", float64(gg.moe.dispatchDgradFirst.LocalBytes), "B")
				figure(t, "moe_fused_"+m.tag+"_fused_over_gemm", m.ms["fused"]/m.ms["gemm_alone"], "x")
				figure(t, "moe_fused_"+m.tag+"_fused_bf16src_over_gemm", m.ms["fused_bf16src"]/m.ms["gemm_alone"], "x")
				figure(t, "moe_fused_"+m.tag+"_unfused_over_fused", m.ms["unfused"]/m.ms["fused"], "x")
			})
		}
	}
}

// sustainedTime runs run back to back for about span, after three
// warm-up calls, and returns the mean time of a call on the device and
// the host's window around the timed calls (UTC, as nvidia-smi's
// timestamps read on the device machine). estMS, a first estimate of one
// call, sizes the window; 0, and a burst of five calls measures it.
func sustainedTime(d *Device, span time.Duration, estMS float64, run func() error) (float64, string, error) {
	for range 3 {
		if err := run(); err != nil {
			return 0, "", err
		}
	}
	if err := d.Sync(); err != nil {
		return 0, "", err
	}
	if estMS <= 0 { // no single-call figure: a short burst sizes the window
		var err error
		if estMS, err = timeGPU(d, 0, 5, run); err != nil {
			return 0, "", err
		}
	}
	n := max(20, int(float64(span.Milliseconds())/estMS))
	const stamp = "2006/01/02 15:04:05.000"
	from := time.Now().UTC()
	ms, err := timeGPU(d, 0, n, run) // the mean of n calls; ends with a Sync
	if err != nil {
		return 0, "", err
	}
	window := fmt.Sprintf("%s .. %s (%d calls)", from.Format(stamp), time.Now().UTC().Format(stamp), n)
	return ms, window, nil
}
