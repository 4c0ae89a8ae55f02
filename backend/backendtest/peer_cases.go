package backendtest

// Conformance cases of the peer-row ops (GatherPeerRows, ScatterPeerRows,
// DispatchSwiGLU, DownCombine and their backward twins DispatchDgradSwiGLU,
// DgradCombine): the MoE dispatch and combine of ranks that read and write
// each other's tensors. Each case draws, for 1, 2 or 4
// ranks, the ranks' sources, token lists (a token may be sent more than
// once, as under top-k routing) and the expert side's row references
// (rank, position), with ranks that send nothing, R = 0, and R not a
// multiple of 128 among them. Run compares the backend with the oracle;
// then the backend's results are compared with a float64 reference
// computed here from the host data, so that the oracle's own peer ops are
// not the only definition.

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// peerShape is one peer-row test: len(send) ranks, rank s sending send[s]
// rows out of a source of src[s] rows, r rows on the expert side, rows d
// wide.
type peerShape struct {
	name      string
	send, src []int
	r, d      int
}

func peerRowShapes() []peerShape {
	return []peerShape{
		{"1-rank", []int{37}, []int{20}, 37, 16},
		// d = 15: no vector width divides the rows.
		{"2-ranks-one-silent", []int{0, 50}, []int{9, 31}, 45, 15},
		{"4-ranks", []int{120, 0, 77, 200}, []int{64, 1, 40, 90}, 300, 64},
		{"R=0", []int{3, 0}, []int{2, 5}, 0, 8},
		{"wide", []int{70, 130}, []int{50, 100}, 171, 260},
	}
}

// peerMoEShape is one test of the fused MoE ops (DispatchSwiGLU,
// DownCombine, DispatchDgradSwiGLU, DgradCombine): the ranks as in
// peerShape, groups of groupRows rows (summing to R) multiplied by [F, D]
// (w1, w3) and [D, F] (w2) matrices. With offsets the ops get the groups
// as device offsets alone (backend.Groups), as the MoE layer's dropless
// forward on one expert rank passes them.
type peerMoEShape struct {
	name      string
	send, src []int
	groupRows []int
	d, f      int
	offsets   bool
}

// groups returns how the ops of s get their groups: the host counts, or
// with s.offsets their device offsets.
func (e *Env) groups(s peerMoEShape) func(Pick) backend.Groups {
	if !s.offsets {
		return func(Pick) backend.Groups { return backend.Groups{Rows: s.groupRows} }
	}
	off := e.IntsOf("offsets", groupOffsets(s.groupRows), len(s.groupRows)+1)
	return func(p Pick) backend.Groups { return backend.Groups{Offsets: p(off)} }
}

func (s peerMoEShape) rows() int {
	r := 0
	for _, g := range s.groupRows {
		r += g
	}
	return r
}

func peerMoEShapes() []peerMoEShape {
	return []peerMoEShape{
		{"1-rank", []int{23}, []int{15}, []int{9, 14}, 16, 24, false},
		{"2-ranks-empty-group", []int{0, 40}, []int{3, 20}, []int{12, 0, 19}, 24, 40, false},
		{"4-ranks", []int{50, 0, 33, 61}, []int{40, 2, 30, 45}, []int{30, 17, 0, 50}, 32, 48, false},
		{"R=0", []int{5, 0}, []int{4, 1}, []int{0, 0}, 16, 32, false},
	}
}

// peerHopperShape is the shape of the MoE layer's bf16 forward that a
// grouped GEMM kernel takes (D and F multiples of 64; the CUDA backend's
// Hopper kernel): 4 ranks, one sending nothing, 4 groups of uneven rows
// with an empty one, R = 702.
func peerHopperShape() peerMoEShape {
	return peerMoEShape{"hopper", []int{200, 0, 300, 260}, []int{180, 4, 256, 200}, []int{250, 0, 321, 131}, 256, 384, false}
}

// peerRefs draws r row references (rank, position) over ranks sending
// send[s] rows: distinct ones (a random r of all positions, in random
// order) or drawn with repeats.
func peerRefs(rng *rand.Rand, send []int, r int, distinct bool) []int32 {
	var all [][2]int32
	for s, n := range send {
		for p := range n {
			all = append(all, [2]int32{int32(s), int32(p)})
		}
	}
	if distinct && r > len(all) {
		panic(fmt.Sprintf("backendtest: %d distinct references out of %d positions", r, len(all)))
	}
	rng.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
	refs := make([]int32, 0, 2*r)
	for i := range r {
		if !distinct {
			i = rng.IntN(len(all))
		}
		refs = append(refs, all[i][0], all[i][1])
	}
	return refs
}

// peerSources makes each rank's source [src[s], d] (values in [lo, hi))
// and token list (send[s] rows of it, repeats allowed).
func (e *Env) peerSources(send, src []int, d int, lo, hi float64) (srcs, toks []*Pair) {
	return e.typedPeerSources(false, send, src, d, lo, hi)
}

// typedPeerSources is peerSources with bf16 source rows when bf16 is set.
func (e *Env) typedPeerSources(bf16 bool, send, src []int, d int, lo, hi float64) (srcs, toks []*Pair) {
	for s := range send {
		srcs = append(srcs, e.typed(bf16, fmt.Sprintf("src%d", s), lo, hi, src[s], d))
		toks = append(toks, e.Ints(fmt.Sprintf("tok%d", s), 0, src[s], send[s]))
	}
	return srcs, toks
}

// picks maps pairs to the running backend's tensors; nil for no pairs.
func picks(p Pick, ps []*Pair) []backend.Tensor {
	if ps == nil {
		return nil
	}
	ts := make([]backend.Tensor, len(ps))
	for i, x := range ps {
		ts[i] = p(x)
	}
	return ts
}

// againstRef compares the tested backend's p, after Run, with want
// computed on the host in float64, by the rule Run applies to p.
func (e *Env) againstRef(p *Pair, want []float64) {
	e.T.Helper()
	what := p.Name + " (against the float64 reference)"
	got := Download(e.B, p.b)
	switch {
	case e.NormWise && e.lowPrecision():
		CompareNormWise(e.T, what, got, want, e.Tol)
	case p.bf16:
		CompareFloats(e.T, what, got, want, max(e.Tol, Tolerance(backend.BFloat16)))
	default:
		CompareFloats(e.T, what, got, want, e.Tol)
	}
}

// hosts returns the pairs' initial float contents; nil for no pairs.
func hosts(ps []*Pair) [][]float64 {
	if ps == nil {
		return nil
	}
	hs := make([][]float64, len(ps))
	for i, p := range ps {
		hs[i] = p.host
	}
	return hs
}

// gatherRef is GatherPeerRows on host data: row i of the result is
// scale[s][p] * src[s][tok[s][p]] for (s, p) = refs[i] (scale nil: 1),
// rounded to bf16 when roundBF16.
func gatherRef(src [][]float64, toks []*Pair, scale [][]float64, refs []int32, d int, roundBF16 bool) []float64 {
	out := make([]float64, 0, len(refs)/2*d)
	for i := 0; i < len(refs); i += 2 {
		s, p := refs[i], refs[i+1]
		t := int(toks[s].ints[p])
		k := 1.0
		if scale != nil {
			k = scale[s][p]
		}
		for _, v := range src[s][t*d : (t+1)*d] {
			out = append(out, k*v)
		}
	}
	if roundBF16 {
		return RoundTo(backend.BFloat16, out)
	}
	return out
}

// scatterRef is ScatterPeerRows on host data: each rank's out, from its
// initial contents out0, with row p replaced by in[i] for (s, p) = refs[i].
func scatterRef(out0 [][]float64, in []float64, refs []int32, d int) [][]float64 {
	want := make([][]float64, len(out0))
	for s, o := range out0 {
		want[s] = append([]float64(nil), o...)
	}
	for i := 0; i < len(refs); i += 2 {
		s, p := refs[i], int(refs[i+1])
		copy(want[s][p*d:(p+1)*d], in[i/2*d:(i/2+1)*d])
	}
	return want
}

// groupedRef is out[r] = a[r]·W_gᵀ (transB) or a[r]·W_g per group g of
// groupRows, W_g the g-th [n, k] (transB) or [k, n] block of w, in float64.
func groupedRef(a, w []float64, groupRows []int, n, k int, transB bool) []float64 {
	var out []float64
	r := 0
	for g, rows := range groupRows {
		wg := w[g*n*k : (g+1)*n*k]
		out = append(out, naiveMatMul(a[r*k:(r+rows)*k], wg, make([]float64, rows*n), rows, n, k, false, transB, 1, 0)...)
		r += rows
	}
	return out
}

func sigmoid(x float64) float64 { return 1 / (1 + math.Exp(-x)) }

func silu(x float64) float64 { return x * sigmoid(x) }

// siluGrad is silu'(x) = s * (1 + x*(1-s)), s = sigmoid(x): SwiGLU's
// derivative in its gate input, as the CPU backend's SwiGLUBackward writes
// it.
func siluGrad(x float64) float64 {
	s := sigmoid(x)
	return s * (1 + x*(1-s))
}

func peerCases() []Case {
	var cs []Case
	for _, s := range peerRowShapes() {
		for _, bf16 := range []bool{false, true} {
			for _, scaled := range []bool{false, true} {
				name := "GatherPeerRows/" + s.name + "/float-out"
				if bf16 {
					name = "GatherPeerRows/" + s.name + "/bf16-out"
				}
				if scaled {
					name += "/scaled"
				}
				cs = append(cs, Case{Name: name, Compare: func(e *Env) {
					srcs, toks := e.peerSources(s.send, s.src, s.d, -3, 3)
					var scales []*Pair
					if scaled {
						for r, n := range s.send {
							scales = append(scales, e.Rand(fmt.Sprintf("scale%d", r), n))
						}
					}
					refs := e.IntsOf("refs", peerRefs(e.Rng, s.send, s.r, false), s.r, 2)
					out := e.typedOut(bf16, "out", s.r, s.d)
					e.Run(func(b backend.Backend, p Pick) {
						b.GatherPeerRows(p(out), picks(p, srcs), picks(p, toks), picks(p, scales), p(refs))
					})
					e.againstRef(out, gatherRef(hosts(srcs), toks, hosts(scales), refs.ints, s.d, bf16))
				}})
			}
		}
		for _, bf16 := range []bool{false, true} {
			name := "ScatterPeerRows/" + s.name
			if bf16 {
				name += "/bf16"
			}
			cs = append(cs, Case{Name: name, Compare: func(e *Env) {
				// InOut: the positions no reference names keep their rows.
				var outs []*Pair
				for r, n := range s.send {
					outs = append(outs, e.InOut(e.typed(bf16, fmt.Sprintf("out%d", r), -1, 1, n, s.d)))
				}
				in := e.typed(bf16, "in", -1, 1, s.r, s.d)
				refs := e.IntsOf("refs", peerRefs(e.Rng, s.send, s.r, true), s.r, 2)
				e.Run(func(b backend.Backend, p Pick) { b.ScatterPeerRows(picks(p, outs), p(in), p(refs)) })
				for r, want := range scatterRef(hosts(outs), in.host, refs.ints, s.d) {
					e.againstRef(outs[r], want)
				}
			}})
		}
	}
	cs = append(cs, peerViewCases()...)
	cs = append(cs, rowBlockCases()...)
	for _, s := range peerRowShapes() {
		cs = append(cs, Case{Name: "MarkPeerRows/" + s.name, Compare: func(e *Env) {
			refs := e.IntsOf("refs", peerRefs(e.Rng, s.send, s.r, true), s.r, 2)
			done := e.peerFlags(s.send)
			e.Run(func(b backend.Backend, p Pick) { b.MarkPeerRows(picks(p, done), p(refs)) })
			e.flagsRaised(done, refs.ints)
		}})
		for _, scaled := range []bool{false, true} {
			name := "CombineRows/" + s.name
			if scaled {
				name += "/scaled"
			}
			cs = append(cs, Case{Name: name, Compare: func(e *Env) {
				// One rank's combine: its S send rows (s.r of them) into T
				// token rows, several rows to a token.
				S, T := s.r, max(1, s.r/2)
				tok := make([]int32, S)
				for i := range tok {
					tok[i] = int32(e.Rng.IntN(T))
				}
				out := e.InOut(e.Rand("out", T, s.d))
				in, rows := e.Rand("in", S, s.d), e.IntsOf("rows", tok, S)
				var scale *Pair
				if scaled {
					scale = e.Uniform("scale", 0.1, 1, S)
				}
				ones := make([]int32, S)
				for i := range ones {
					ones[i] = 1
				}
				done := e.InOut(e.IntsOf("done", ones, S))
				e.Run(func(b backend.Backend, p Pick) {
					b.CombineRows(p(out), p(in), p(rows), p(scale), p(done), []int{S / 2, S - S/2})
				})
				e.equalInts("done (cleared)", DownloadInts(e.B, done.b), make([]int32, S))
			}})
		}
	}
	for _, s := range peerMoEShapes() {
		// "operand": the tested backend's operand type (bf16 on the GPU);
		// "bf16" on every backend.
		for _, ty := range []string{"operand", "bf16"} {
			cs = append(cs, peerMoECases(s, ty)...)
		}
	}
	cs = append(cs, peerMoECases(peerHopperShape(), "bf16")...)
	// The groups as device offsets: one rank (the layer's case) and the
	// Hopper kernel's shape.
	for _, s := range []peerMoEShape{peerMoEShapes()[0], peerHopperShape()} {
		cs = append(cs, peerMoECases(s, "bf16-offsets")...)
	}
	// The gate/up half from bf16 sources (the layer's operand-type copy of
	// its input), on every shape and the Hopper kernel's; the down half
	// into bf16 rows (the layer's expert outputs), with host and device
	// groups.
	for _, s := range append(peerMoEShapes(), peerHopperShape()) {
		cs = append(cs, Case{Name: "DispatchSwiGLU/bf16-sources/" + s.name, Compare: func(e *Env) { e.dispatchSwiGLUFrom(s, true, true) }})
		cs = append(cs, Case{Name: "DownCombine/bf16-y/" + s.name, Compare: func(e *Env) { e.downCombineTo(s, true, true) }})
		offsets := s
		offsets.offsets = true
		cs = append(cs, Case{Name: "DownCombine/bf16-y-offsets/" + s.name, Compare: func(e *Env) { e.downCombineTo(offsets, true, true) }})
	}
	return cs
}

// peerMoECases are the fused MoE ops' cases on s, ty "operand" or "bf16"
// ("Op/ty/shape"): the forward pair and its backward twins.
func peerMoECases(s peerMoEShape, ty string) []Case {
	bf16 := strings.HasPrefix(ty, "bf16")
	s.offsets = strings.HasSuffix(ty, "-offsets")
	name := func(op string) string { return op + "/" + ty + "/" + s.name }
	return []Case{
		{Name: name("DispatchSwiGLU"), Compare: func(e *Env) { e.dispatchSwiGLU(s, bf16) }},
		{Name: name("DownCombine"), Compare: func(e *Env) { e.downCombine(s, bf16) }},
		{Name: name("DispatchDgradSwiGLU"), Compare: func(e *Env) { e.dispatchDgrad(s, bf16) }},
		{Name: name("DgradCombine"), Compare: func(e *Env) { e.dgradCombine(s, bf16) }},
	}
}

// peerViewCases put a rank's tensor, or the gather's out, at an odd
// element offset in a larger one, so that rows are not aligned for
// four-wide accesses while d is a multiple of 4.
func peerViewCases() []Case {
	send, src, r, d := []int{30, 25}, []int{12, 18}, 40, 16
	return []Case{
		{Name: "GatherPeerRows/views/source", Compare: func(e *Env) {
			src0 := e.Uniform("src0", -3, 3, src[0], d)
			src1Parent := e.Uniform("src1Parent", -3, 3, src[1]*d+1)
			srcs := []*Pair{src0, e.View("src1", src1Parent, 1, src[1], d)}
			toks := []*Pair{e.Ints("tok0", 0, src[0], send[0]), e.Ints("tok1", 0, src[1], send[1])}
			refs := e.IntsOf("refs", peerRefs(e.Rng, send, r, false), r, 2)
			out := e.Out("out", r, d)
			e.Run(func(b backend.Backend, p Pick) {
				b.GatherPeerRows(p(out), picks(p, srcs), picks(p, toks), nil, p(refs))
			})
			e.againstRef(out, gatherRef([][]float64{src0.host, src1Parent.host[1:]}, toks, nil, refs.ints, d, false))
		}},
		{Name: "GatherPeerRows/views/bf16-sources", Compare: func(e *Env) {
			srcs, toks := e.typedPeerSources(true, send, src, d, -3, 3)
			refs := e.IntsOf("refs", peerRefs(e.Rng, send, r, false), r, 2)
			out := e.OutBF16("out", r, d)
			e.Run(func(b backend.Backend, p Pick) {
				b.GatherPeerRows(p(out), picks(p, srcs), picks(p, toks), nil, p(refs))
			})
			e.againstRef(out, gatherRef(hosts(srcs), toks, nil, refs.ints, d, true))
		}},
		{Name: "GatherPeerRows/views/bf16-out", Compare: func(e *Env) {
			srcs, toks := e.peerSources(send, src, d, -3, 3)
			refs := e.IntsOf("refs", peerRefs(e.Rng, send, r, false), r, 2)
			// InOut: the parent's elements outside the view keep their values.
			parent := e.InOut(e.BF16("outParent", r*d+2))
			out := e.View("out", parent, 1, r, d)
			e.Run(func(b backend.Backend, p Pick) {
				b.GatherPeerRows(p(out), picks(p, srcs), picks(p, toks), nil, p(refs))
			})
			want := append([]float64{parent.host[0]}, gatherRef(hosts(srcs), toks, nil, refs.ints, d, true)...)
			e.againstRef(parent, append(want, parent.host[r*d+1]))
		}},
		{Name: "ScatterPeerRows/views", Compare: func(e *Env) {
			out0 := e.InOut(e.Rand("out0", send[0], d))
			parent := e.InOut(e.Rand("out1Parent", send[1]*d+3))
			outs := []*Pair{out0, e.View("out1", parent, 3, send[1], d)}
			in := e.Rand("in", r, d)
			refs := e.IntsOf("refs", peerRefs(e.Rng, send, r, true), r, 2)
			e.Run(func(b backend.Backend, p Pick) { b.ScatterPeerRows(picks(p, outs), p(in), p(refs)) })
			want := scatterRef([][]float64{out0.host, parent.host[3:]}, in.host, refs.ints, d)
			e.againstRef(out0, want[0])
			e.againstRef(parent, append(append([]float64(nil), parent.host[:3]...), want[1]...))
		}},
	}
}

// dispatchSwiGLU runs DispatchSwiGLU on s with bf16 operands (or the
// tested backend's operand type) and checks x, h1, h3 and act against the
// gather, the grouped products and SwiGLU in float64.
func (e *Env) dispatchSwiGLU(s peerMoEShape, bf16 bool) { e.dispatchSwiGLUFrom(s, bf16, false) }

// dispatchSwiGLUFrom is dispatchSwiGLU from bf16 source rows when srcBF16
// is set (the operands are then bf16 too).
func (e *Env) dispatchSwiGLUFrom(s peerMoEShape, bf16, srcBF16 bool) {
	e.NormWise = groupedNormWise
	bf16 = bf16 || srcBF16 || e.B.OperandType() == backend.BFloat16
	r, d, f, g := s.rows(), s.d, s.f, len(s.groupRows)
	srcs, toks := e.typedPeerSources(srcBF16, s.send, s.src, d, -1, 1)
	refs := e.IntsOf("refs", peerRefs(e.Rng, s.send, r, true), r, 2)
	// Weights of about 1/sqrt(d): h1 and h3 of order 1, where SwiGLU bends.
	w1 := e.typed(bf16, "w1", -2/math.Sqrt(float64(d)), 2/math.Sqrt(float64(d)), g*f, d)
	w3 := e.typed(bf16, "w3", -2/math.Sqrt(float64(d)), 2/math.Sqrt(float64(d)), g*f, d)
	x, h1, h3, act := e.typedOut(bf16, "x", r, d), e.typedOut(bf16, "h1", r, f), e.typedOut(bf16, "h3", r, f), e.typedOut(bf16, "act", r, f)
	groups := e.groups(s)
	e.Run(func(b backend.Backend, p Pick) {
		b.DispatchSwiGLU(p(x), p(h1), p(h3), p(act), picks(p, srcs), picks(p, toks), p(refs), p(w1), p(w3), groups(p))
	})
	xRef := gatherRef(hosts(srcs), toks, nil, refs.ints, d, bf16)
	h1Ref, h3Ref := groupedRef(xRef, w1.host, s.groupRows, f, d, true), groupedRef(xRef, w3.host, s.groupRows, f, d, true)
	actRef := make([]float64, len(h1Ref))
	for i, v := range h1Ref {
		actRef[i] = silu(v) * h3Ref[i]
	}
	e.againstRef(x, xRef)
	e.againstRef(h1, h1Ref)
	e.againstRef(h3, h3Ref)
	e.againstRef(act, actRef)
}

// downCombine runs DownCombine on s with bf16 operands (or the tested
// backend's operand type) and checks the ranks' outputs against the
// grouped product in float64, scattered.
func (e *Env) downCombine(s peerMoEShape, bf16 bool) { e.downCombineTo(s, bf16, false) }

// downCombineTo is downCombine into float outputs, or bf16 ones with yBF16
// (the MoE layer's expert outputs on one expert rank).
func (e *Env) downCombineTo(s peerMoEShape, bf16, yBF16 bool) {
	e.NormWise = groupedNormWise
	bf16 = bf16 || e.B.OperandType() == backend.BFloat16
	r, d, f, g := s.rows(), s.d, s.f, len(s.groupRows)
	act := e.typed(bf16, "act", -1, 1, r, f)
	w2 := e.typed(bf16, "w2", -2/math.Sqrt(float64(f)), 2/math.Sqrt(float64(f)), g*d, f)
	refs := e.IntsOf("refs", peerRefs(e.Rng, s.send, r, true), r, 2)
	outs, done := e.peerOutputs(s.send, d), e.peerFlags(s.send)
	if yBF16 {
		outs = outs[:0]
		for i, n := range s.send {
			outs = append(outs, e.InOut(e.typed(true, fmt.Sprintf("out%d", i), -1, 1, n, d)))
		}
	}
	groups := e.groups(s)
	e.Run(func(b backend.Backend, p Pick) {
		b.DownCombine(picks(p, outs), picks(p, done), p(refs), p(act), p(w2), groups(p))
	})
	y := groupedRef(act.host, w2.host, s.groupRows, d, f, true)
	for i, want := range scatterRef(hosts(outs), y, refs.ints, d) {
		e.againstRef(outs[i], want)
	}
	e.flagsRaised(done, refs.ints)
}

// peerFlags are the ranks' send-order row flags, zero and InOut (compared
// with the oracle's after the run).
func (e *Env) peerFlags(send []int) []*Pair {
	var done []*Pair
	for i, n := range send {
		done = append(done, e.InOut(e.IntsOf(fmt.Sprintf("done%d", i), make([]int32, n), n)))
	}
	return done
}

// flagsRaised checks the tested backend's flags: 1 exactly at the
// referenced (rank, position) pairs.
func (e *Env) flagsRaised(done []*Pair, refs []int32) {
	e.T.Helper()
	want := make([][]int32, len(done))
	for s, p := range done {
		want[s] = make([]int32, p.Shape[0])
	}
	for r := 0; r < len(refs); r += 2 {
		want[refs[r]][refs[r+1]] = 1
	}
	for s, p := range done {
		e.equalInts(p.Name+" (the referenced rows' flags)", DownloadInts(e.B, p.b), want[s])
	}
}

// peerOutputs are the ranks' send-order output rows [send[s], d], random
// and InOut: the positions no reference names keep their rows.
func (e *Env) peerOutputs(send []int, d int) []*Pair {
	var outs []*Pair
	for i, n := range send {
		outs = append(outs, e.InOut(e.Rand(fmt.Sprintf("out%d", i), n, d)))
	}
	return outs
}

// dispatchDgrad runs DispatchDgradSwiGLU on s with bf16 operands (or the
// tested backend's operand type) and checks dy against the scaled gather,
// and dh1 and dh3 against the grouped product dAct = dy·W2_g and SwiGLU's
// derivative in float64. dAct is kept in float64 here, as the fused kernel
// keeps it in float32: its rounding is the implementation's own error.
func (e *Env) dispatchDgrad(s peerMoEShape, bf16 bool) {
	e.NormWise = groupedNormWise
	bf16 = bf16 || e.B.OperandType() == backend.BFloat16
	r, d, f, g := s.rows(), s.d, s.f, len(s.groupRows)
	// The sources are the output gradients of each rank's tokens; the
	// scales its gates, away from 0 so that a dropped scale shows.
	srcs, toks := e.peerSources(s.send, s.src, d, -1, 1)
	var scales []*Pair
	for i, n := range s.send {
		scales = append(scales, e.Uniform(fmt.Sprintf("scale%d", i), 0.1, 1, n))
	}
	refs := e.IntsOf("refs", peerRefs(e.Rng, s.send, r, true), r, 2)
	// h1 and h3 over [-2, 2], where silu bends; w2 of about 1/sqrt(d), so
	// that dAct (a sum over d) is of order 1.
	h1, h3 := e.typed(bf16, "h1", -2, 2, r, f), e.typed(bf16, "h3", -2, 2, r, f)
	w2 := e.typed(bf16, "w2", -2/math.Sqrt(float64(d)), 2/math.Sqrt(float64(d)), g*d, f)
	dy, dh1, dh3 := e.typedOut(bf16, "dy", r, d), e.typedOut(bf16, "dh1", r, f), e.typedOut(bf16, "dh3", r, f)
	groups := e.groups(s)
	e.Run(func(b backend.Backend, p Pick) {
		b.DispatchDgradSwiGLU(p(dy), p(dh1), p(dh3), picks(p, srcs), picks(p, toks), picks(p, scales), p(refs), p(h1), p(h3), p(w2), groups(p))
	})
	dyRef := gatherRef(hosts(srcs), toks, hosts(scales), refs.ints, d, bf16)
	dAct := groupedRef(dyRef, w2.host, s.groupRows, f, d, false)
	dh1Ref, dh3Ref := make([]float64, len(dAct)), make([]float64, len(dAct))
	for i, v := range dAct {
		dh1Ref[i] = v * h3.host[i] * siluGrad(h1.host[i])
		dh3Ref[i] = v * silu(h1.host[i])
	}
	e.againstRef(dy, dyRef)
	e.againstRef(dh1, dh1Ref)
	e.againstRef(dh3, dh3Ref)
}

// dgradCombine runs DgradCombine on s with bf16 operands (or the tested
// backend's operand type) and checks the ranks' outputs against
// dx = dh1·W1_g + dh3·W3_g in float64, scattered.
func (e *Env) dgradCombine(s peerMoEShape, bf16 bool) {
	e.NormWise = groupedNormWise
	bf16 = bf16 || e.B.OperandType() == backend.BFloat16
	r, d, f, g := s.rows(), s.d, s.f, len(s.groupRows)
	dh1, dh3 := e.typed(bf16, "dh1", -1, 1, r, f), e.typed(bf16, "dh3", -1, 1, r, f)
	// Weights of about 1/sqrt(f): dx (a sum over f) of order 1.
	w1 := e.typed(bf16, "w1", -2/math.Sqrt(float64(f)), 2/math.Sqrt(float64(f)), g*f, d)
	w3 := e.typed(bf16, "w3", -2/math.Sqrt(float64(f)), 2/math.Sqrt(float64(f)), g*f, d)
	refs := e.IntsOf("refs", peerRefs(e.Rng, s.send, r, true), r, 2)
	outs, done := e.peerOutputs(s.send, d), e.peerFlags(s.send)
	groups := e.groups(s)
	e.Run(func(b backend.Backend, p Pick) {
		b.DgradCombine(picks(p, outs), picks(p, done), p(refs), p(dh1), p(dh3), p(w1), p(w3), groups(p))
	})
	dx := groupedRef(dh1.host, w1.host, s.groupRows, d, f, false)
	for i, v := range groupedRef(dh3.host, w3.host, s.groupRows, d, f, false) {
		dx[i] += v
	}
	for i, want := range scatterRef(hosts(outs), dx, refs.ints, d) {
		e.againstRef(outs[i], want)
	}
	e.flagsRaised(done, refs.ints)
}

// rowBlockCases compare PeerRowRefs with the oracle and check it against
// a row-by-row reading of the table: blocks of random sizes (some empty,
// as an expert group's source ranks that send an expert nothing), one
// block per (local expert, source rank) as moe's fused dispatcher builds
// them.
func rowBlockCases() []Case {
	shapes := []struct {
		name          string
		experts, srcs int
		maxRows       int
	}{
		{"one_block", 1, 1, 40},
		{"4x2_with_empty", 4, 2, 9},
		{"8x8", 8, 8, 300},
		{"no_rows", 3, 2, 0},
	}
	var cs []Case
	for _, sh := range shapes {
		name := "PeerRowRefs/" + sh.name
		blocksOf := func(rng *rand.Rand) ([]backend.RowBlock, int) {
			var blocks []backend.RowBlock
			R := 0
			for range sh.experts {
				for src := range sh.srcs {
					n := 0
					if sh.maxRows > 0 && rng.IntN(4) != 0 {
						n = rng.IntN(sh.maxRows + 1)
					}
					blocks = append(blocks, backend.RowBlock{First: R, Rank: src, Pos: rng.IntN(1000)})
					R += n
				}
			}
			return blocks, R
		}
		cs = append(cs, Case{
			Name: name,
			Compare: func(e *Env) {
				blocks, R := blocksOf(e.Rng)
				refs := e.IntOut("refs", R, 2)
				e.Run(func(b backend.Backend, p Pick) { b.PeerRowRefs(p(refs), blocks) })
			},
			Check: func(t *testing.T, b backend.Backend) {
				blocks, R := blocksOf(NewRand(name))
				refs := b.New(backend.Int32, R, 2)
				b.PeerRowRefs(refs, blocks)
				got := DownloadInts(b, refs)
				for r := range R {
					bl := blocks[0]
					for _, c := range blocks {
						if c.First <= r {
							bl = c
						}
					}
					if got[2*r] != int32(bl.Rank) || got[2*r+1] != int32(bl.Pos+r-bl.First) {
						t.Fatalf("refs[%d] = (%d, %d), want (%d, %d)", r, got[2*r], got[2*r+1], bl.Rank, bl.Pos+r-bl.First)
					}
				}
			},
		})
	}
	return cs
}
