package backendtest

// Conformance cases of the core ops: each runs one op on the backend under
// test and on the oracle. Shapes include odd sizes (no multiple of an unroll
// or a block), sizes that cross the CPU kernels' block and parallel-split
// boundaries, and views.

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
)

// coreCases is the core ops' part of the table.
func coreCases() []Case {
	var cs []Case
	cs = append(cs, elementwiseCases()...)
	cs = append(cs, matmulCases()...)
	cs = append(cs, rowCases()...)
	cs = append(cs, normRopeCases()...)
	cs = append(cs, swigluLossCases()...)
	cs = append(cs, adamWCases()...)
	cs = append(cs, checkCases()...)
	return cs
}

func elementwiseCases() []Case {
	var cs []Case
	// 70001 elements span several reduction blocks and parallel chunks.
	for _, n := range []int{5, 70001} {
		cs = append(cs,
			Case{Name: fmt.Sprintf("Zero/%d", n), Compare: func(e *Env) {
				x := e.InOut(e.Rand("t", n))
				e.Run(func(b backend.Backend, p Pick) { b.Zero(p(x)) })
			}},
			Case{Name: fmt.Sprintf("Copy/%d", n), Compare: func(e *Env) {
				src, dst := e.Rand("src", n), e.Out("dst", n)
				e.Run(func(b backend.Backend, p Pick) { b.Copy(p(dst), p(src)) })
			}},
			Case{Name: fmt.Sprintf("Axpy/%d", n), Compare: func(e *Env) {
				dst, x := e.InOut(e.Rand("dst", n)), e.Rand("x", n)
				e.Run(func(b backend.Backend, p Pick) { b.Axpy(p(dst), -0.7, p(x)) })
			}},
			Case{Name: fmt.Sprintf("Scale/%d", n), Compare: func(e *Env) {
				x := e.InOut(e.Rand("t", n))
				e.Run(func(b backend.Backend, p Pick) { b.Scale(p(x), 1.3) })
			}},
			Case{Name: fmt.Sprintf("Sum/%d", n), Compare: func(e *Env) {
				x := e.Rand("t", n)
				e.RunScalar(func(b backend.Backend, p Pick) float64 { return b.Sum(p(x)) })
			}},
			Case{Name: fmt.Sprintf("SumSquares/%d", n), Compare: func(e *Env) {
				x := e.Rand("t", n)
				e.RunScalar(func(b backend.Backend, p Pick) float64 { return b.SumSquares(p(x)) })
			}},
		)
	}
	cs = append(cs,
		Case{Name: "Zero/int32", Compare: func(e *Env) {
			x := e.InOut(e.Ints("t", -50, 50, 3, 7))
			e.Run(func(b backend.Backend, p Pick) { b.Zero(p(x)) })
		}},
		Case{Name: "Copy/int32", Compare: func(e *Env) {
			src, dst := e.Ints("src", -50, 50, 3, 7), e.IntOut("dst", 21)
			e.Run(func(b backend.Backend, p Pick) { b.Copy(p(dst), p(src)) })
		}},
		Case{Name: "Copy/view", Compare: func(e *Env) {
			// Only elements 7..7+15 of the parent may change.
			parent := e.InOut(e.Rand("parent", 6, 5))
			dst := e.View("dst", parent, 7, 3, 5)
			src := e.Rand("src", 3, 5)
			e.Run(func(b backend.Backend, p Pick) { b.Copy(p(dst), p(src)) })
		}},
	)
	return cs
}

// mmShape is one MatMul test: out [m, n] = alpha*op(a)*op(b) + beta*out with
// inner dimension k.
type mmShape struct {
	name        string
	m, n, k     int
	alpha, beta float64
}

func matmulCases() []Case {
	shapes := []mmShape{
		{"1x1x1", 1, 1, 1, 1, 0},
		{"small", 5, 7, 3, 1, 0},
		{"odd-alpha-beta", 33, 17, 69, -0.5, 0.75},
		// n > 512 and k > 128 cross the CPU kernel's blocks; k = 8q+4+r
		// reaches every unrolled path.
		{"blocked", 20, 600, 150, 1, 0},
		{"blocked-accumulate", 9, 530, 141, 2, 1},
		{"k0-beta", 4, 6, 0, 1, 0.5},
		{"k0", 4, 6, 0, 1, 0},
		{"alpha0-beta", 4, 6, 5, 0, 0.5},
	}
	var cs []Case
	for _, s := range shapes {
		for _, l := range mmLayouts() {
			cs = append(cs, Case{Name: fmt.Sprintf("MatMul/%s/%s", l.name, s.name), Compare: func(e *Env) {
				a := e.Rand("a", l.aShape(s.m, s.k)...)
				bb := e.Rand("b", l.bShape(s.k, s.n)...)
				var out *Pair
				if s.beta == 0 {
					out = e.Out("out", s.m, s.n)
				} else {
					out = e.InOut(e.Rand("out", s.m, s.n))
				}
				e.Run(func(b backend.Backend, p Pick) {
					b.MatMul(p(out), p(a), p(bb), l.transA, l.transB, s.alpha, s.beta)
				})
			}})
		}
	}
	cs = append(cs, Case{Name: "MatMul/views", Compare: func(e *Env) {
		// A weight slice times an activation slice, into the middle of a
		// larger buffer: parent elements outside the view must not change.
		wParent := e.Rand("wParent", 40, 8)
		w := e.View("w", wParent, 16, 12, 8)
		x := e.View("x", e.Rand("xParent", 11, 8), 8, 10, 8)
		parent := e.InOut(e.Rand("outParent", 16, 12))
		out := e.View("out", parent, 24, 10, 12)
		e.Run(func(b backend.Backend, p Pick) { b.MatMul(p(out), p(x), p(w), false, true, 1, 0) })
	}})
	return cs
}

// mmLayout is one combination of MatMul's transpose flags.
type mmLayout struct {
	name           string
	transA, transB bool
}

func mmLayouts() []mmLayout {
	return []mmLayout{{"NN", false, false}, {"NT", false, true}, {"TN", true, false}, {"TT", true, true}}
}

// aShape and bShape are the stored shapes of a ([m,k] as op(a)) and b ([k,n]
// as op(b)).
func (l mmLayout) aShape(m, k int) []int {
	if l.transA {
		return []int{k, m}
	}
	return []int{m, k}
}

func (l mmLayout) bShape(k, n int) []int {
	if l.transB {
		return []int{n, k}
	}
	return []int{k, n}
}

func rowCases() []Case {
	var cs []Case
	// 300 rows of 256 pass the CPU backend's parallel split.
	for _, s := range []struct{ v, t, d int }{{50, 37, 24}, {40, 300, 256}} {
		name := fmt.Sprintf("%dx%dx%d", s.v, s.t, s.d)
		cs = append(cs,
			Case{Name: "EmbeddingForward/" + name, Compare: func(e *Env) {
				table, ids := e.Rand("table", s.v, s.d), e.Ints("ids", 0, s.v, s.t)
				out := e.Out("out", s.t, s.d)
				e.Run(func(b backend.Backend, p Pick) { b.EmbeddingForward(p(out), p(table), p(ids)) })
			}},
			Case{Name: "EmbeddingBackward/" + name, Compare: func(e *Env) {
				// ids from a tenth of the vocabulary repeat, so rows
				// accumulate several times.
				dTable := e.InOut(e.Rand("dTable", s.v, s.d))
				dOut, ids := e.Rand("dOut", s.t, s.d), e.Ints("ids", 0, max(s.v/10, 1), s.t)
				e.Run(func(b backend.Backend, p Pick) { b.EmbeddingBackward(p(dTable), p(dOut), p(ids)) })
			}},
		)
	}
	for _, s := range []struct{ t, n, d int }{{29, 41, 16}, {64, 300, 200}} {
		for _, scaled := range []bool{false, true} {
			name := fmt.Sprintf("%dx%dx%d", s.t, s.n, s.d)
			if scaled {
				name += "/scaled"
			}
			scale := func(e *Env) *Pair {
				if !scaled {
					return nil
				}
				return e.Rand("scale", s.n)
			}
			cs = append(cs,
				Case{Name: "GatherRows/" + name, Compare: func(e *Env) {
					in, rows, sc := e.Rand("in", s.t, s.d), e.Ints("rows", 0, s.t, s.n), scale(e)
					out := e.Out("out", s.n, s.d)
					e.Run(func(b backend.Backend, p Pick) { b.GatherRows(p(out), p(in), p(rows), p(sc)) })
				}},
				Case{Name: "ScatterAddRows/" + name, Compare: func(e *Env) {
					out := e.InOut(e.Rand("out", s.t, s.d))
					in, rows, sc := e.Rand("in", s.n, s.d), e.Ints("rows", 0, s.t, s.n), scale(e)
					e.Run(func(b backend.Backend, p Pick) { b.ScatterAddRows(p(out), p(in), p(rows), p(sc)) })
				}},
			)
			// The combine's shape: n rows reach t tokens at most k at a
			// time, some assignments dropped (-1).
			k := (s.n + s.t - 1) / s.t
			sumName := fmt.Sprintf("GatherSumRows/%dx%dx%d", s.t, k, s.d)
			if scaled {
				sumName += "/scaled"
			}
			cs = append(cs, Case{Name: sumName, Compare: func(e *Env) {
				out := e.InOut(e.Rand("out", s.t, s.d))
				in, pos := e.Rand("in", s.n, s.d), e.IntsOf("pos", SendPositions(e.Rng, s.t, k, s.n), s.t, k)
				var sc *Pair
				if scaled {
					sc = e.Rand("scale", s.t, k)
				}
				e.Run(func(b backend.Backend, p Pick) { b.GatherSumRows(p(out), p(in), p(pos), p(sc)) })
			}})
			if !scaled {
				cs = append(cs, Case{Name: "RowDots/" + name, Compare: func(e *Env) {
					a, rows, bm := e.Rand("a", s.t, s.d), e.Ints("rows", 0, s.t, s.n), e.Rand("b", s.n, s.d)
					out := e.Out("out", s.n)
					e.Run(func(b backend.Backend, p Pick) { b.RowDots(p(out), p(a), p(rows), p(bm)) })
				}})
			}
		}
	}
	return cs
}

func normRopeCases() []Case {
	var cs []Case
	// 8200 columns: wider than the one-pass backward takes on the GPU;
	// 256, 384 and 1024 (moe-small's rows): the GPU's warp-per-row
	// kernels, with blocks of rows that end early.
	for _, s := range []struct{ t, d int }{{19, 48}, {300, 256}, {33, 384}, {70, 1024}, {5, 8200}} {
		name := fmt.Sprintf("%dx%d", s.t, s.d)
		cs = append(cs,
			Case{Name: "RMSNormForward/copy/" + name, Compare: func(e *Env) {
				x, w := e.Uniform("x", -3, 3, s.t, s.d), e.Uniform("w", 0.5, 1.5, s.d)
				out, rstd, cp := e.OutBF16("out", s.t, s.d), e.Out("rstd", s.t), e.Out("copy", s.t, s.d)
				e.Run(func(b backend.Backend, p Pick) { b.RMSNormForward(p(out), p(rstd), p(cp), p(x), p(w), 1e-5) })
			}},
			Case{Name: "RMSNormForward/" + name, Compare: func(e *Env) {
				x, w := e.Uniform("x", -3, 3, s.t, s.d), e.Uniform("w", 0.5, 1.5, s.d)
				out, rstd := e.Out("out", s.t, s.d), e.Out("rstd", s.t)
				e.Run(func(b backend.Backend, p Pick) { b.RMSNormForward(p(out), p(rstd), nil, p(x), p(w), 1e-5) })
			}},
			Case{Name: "RMSNormForward/bf16-out/" + name, Compare: func(e *Env) {
				x, w := e.Uniform("x", -3, 3, s.t, s.d), e.Uniform("w", 0.5, 1.5, s.d)
				out, rstd := e.OutBF16("out", s.t, s.d), e.Out("rstd", s.t)
				e.Run(func(b backend.Backend, p Pick) { b.RMSNormForward(p(out), p(rstd), nil, p(x), p(w), 1e-5) })
			}},
			Case{Name: "RMSNormBackward/" + name, Compare: func(e *Env) {
				x, w := e.Uniform("x", -3, 3, s.t, s.d), e.Uniform("w", 0.5, 1.5, s.d)
				dout := e.Rand("dout", s.t, s.d)
				out, rstd, dx := e.Out("out", s.t, s.d), e.Out("rstd", s.t), e.Out("dx", s.t, s.d)
				dw := e.InOut(e.Rand("dw", s.d)) // accumulates
				e.Run(func(b backend.Backend, p Pick) {
					b.RMSNormForward(p(out), p(rstd), nil, p(x), p(w), 1e-6)
					b.RMSNormBackward(p(dx), p(dw), p(dout), p(x), p(w), p(rstd), 0)
				})
			}},
			Case{Name: "RMSNormBackward/add/" + name, Compare: func(e *Env) {
				x, w := e.Uniform("x", -3, 3, s.t, s.d), e.Uniform("w", 0.5, 1.5, s.d)
				dout := e.Rand("dout", s.t, s.d)
				out, rstd := e.Out("out", s.t, s.d), e.Out("rstd", s.t)
				dx := e.InOut(e.Rand("dx", s.t, s.d)) // the stream's gradient, added onto
				dw := e.InOut(e.Rand("dw", s.d))
				e.Run(func(b backend.Backend, p Pick) {
					b.RMSNormForward(p(out), p(rstd), nil, p(x), p(w), 1e-6)
					b.RMSNormBackward(p(dx), p(dw), p(dout), p(x), p(w), p(rstd), 1)
				})
			}},
		)
	}
	for _, s := range []struct {
		t, heads, dh int
		theta        float64
	}{{7, 3, 8, 10000}, {300, 4, 64, 1e6}, {5, 1, 2, 500}} {
		for _, inverse := range []bool{false, true} {
			name := fmt.Sprintf("%dx%dx%d/inverse=%v", s.t, s.heads, s.dh, inverse)
			cs = append(cs, Case{Name: "RoPE/" + name, Compare: func(e *Env) {
				// Positions up to 32k check the angles' precision.
				x := e.InOut(e.Rand("x", s.t, s.heads*s.dh))
				pos := e.Ints("pos", 0, 32768, s.t)
				e.Run(func(b backend.Backend, p Pick) { b.RoPE(p(x), p(x), p(pos), s.dh, s.theta, inverse) })
			}})
			for _, bf16 := range []bool{false, true} {
				label := "RoPE/out/"
				if bf16 {
					label = "RoPE/bf16-out/"
				}
				cs = append(cs, Case{Name: label + name, Compare: func(e *Env) {
					x, pos := e.Rand("x", s.t, s.heads*s.dh), e.Ints("pos", 0, 32768, s.t)
					out := e.typedOut(bf16, "out", s.t, s.heads*s.dh)
					e.Run(func(b backend.Backend, p Pick) { b.RoPE(p(out), p(x), p(pos), s.dh, s.theta, inverse) })
				}})
			}
		}
	}
	return cs
}

func swigluLossCases() []Case {
	var cs []Case
	for _, s := range []struct{ n, f int }{{13, 22}, {300, 256}} {
		name := fmt.Sprintf("%dx%d", s.n, s.f)
		cs = append(cs,
			Case{Name: "SwiGLUForward/" + name, Compare: func(e *Env) {
				a, bv := e.Uniform("a", -8, 8, s.n, s.f), e.Rand("b", s.n, s.f)
				out := e.Out("out", s.n, s.f)
				e.Run(func(b backend.Backend, p Pick) { b.SwiGLUForward(p(out), p(a), p(bv)) })
			}},
			Case{Name: "SwiGLUBackward/" + name, Compare: func(e *Env) {
				a, bv, dout := e.Uniform("a", -8, 8, s.n, s.f), e.Rand("b", s.n, s.f), e.Rand("dout", s.n, s.f)
				da, db := e.Out("da", s.n, s.f), e.Out("db", s.n, s.f)
				e.Run(func(b backend.Backend, p Pick) { b.SwiGLUBackward(p(da), p(db), p(dout), p(a), p(bv)) })
			}},
		)
	}
	for _, s := range []struct{ t, v int }{{23, 50}, {150, 1000}} {
		name := fmt.Sprintf("%dx%d", s.t, s.v)
		// Targets from -1: some rows are ignored.
		cs = append(cs,
			Case{Name: "CrossEntropy/" + name, Compare: func(e *Env) {
				logits, targets := e.Uniform("logits", -6, 6, s.t, s.v), e.Ints("targets", -1, s.v, s.t)
				loss, dlogits := e.Out("loss", s.t), e.Out("dlogits", s.t, s.v)
				e.Run(func(b backend.Backend, p Pick) { b.CrossEntropy(p(loss), p(dlogits), p(logits), p(targets), 0.37) })
			}},
			Case{Name: "CrossEntropy/bf16-dlogits/" + name, Compare: func(e *Env) {
				logits, targets := e.Uniform("logits", -6, 6, s.t, s.v), e.Ints("targets", -1, s.v, s.t)
				loss, dlogits := e.Out("loss", s.t), e.OutBF16("dlogits", s.t, s.v)
				e.Run(func(b backend.Backend, p Pick) { b.CrossEntropy(p(loss), p(dlogits), p(logits), p(targets), 0.37) })
			}},
			Case{Name: "CrossEntropy/in-place/" + name, Compare: func(e *Env) {
				logits := e.InOut(e.Uniform("logits", -6, 6, s.t, s.v))
				targets, loss := e.Ints("targets", -1, s.v, s.t), e.Out("loss", s.t)
				e.Run(func(b backend.Backend, p Pick) { b.CrossEntropy(p(loss), p(logits), p(logits), p(targets), 1.5) })
			}},
		)
	}
	cs = append(cs, Case{Name: "CrossEntropy/large-logits", Compare: func(e *Env) {
		// exp of these overflows without the max shift.
		logits, targets := e.Uniform("logits", 500, 520, 4, 9), e.Ints("targets", 0, 9, 4)
		loss, dlogits := e.Out("loss", 4), e.Out("dlogits", 4, 9)
		e.Run(func(b backend.Backend, p Pick) { b.CrossEntropy(p(loss), p(dlogits), p(logits), p(targets), 1) })
	}})
	// The sharded cross-entropy: the middle of three slices of a 3V
	// vocabulary, targets in all three (and -1).
	for _, s := range []struct{ t, v int }{{23, 50}, {150, 1000}} {
		name := fmt.Sprintf("%dx%d", s.t, s.v)
		cs = append(cs,
			Case{Name: "CrossEntropyShard/" + name, Compare: func(e *Env) {
				logits, targets := e.Uniform("logits", -6, 6, s.t, s.v), e.Ints("targets", -1, 3*s.v, s.t)
				lse, target := e.Out("lse", s.t), e.Out("targetLogit", s.t)
				e.Run(func(b backend.Backend, p Pick) { b.CrossEntropyShard(p(lse), p(target), p(logits), p(targets), s.v) })
			}},
			Case{Name: "CrossEntropyShardFinish/in-place/" + name, Compare: func(e *Env) {
				logits := e.InOut(e.Uniform("logits", -6, 6, s.t, s.v))
				targets, loss := e.Ints("targets", -1, 3*s.v, s.t), e.Out("loss", s.t)
				lseR, target := e.Uniform("lseR", 5, 9, 3, s.t), e.Uniform("targetLogit", -6, 6, s.t)
				e.Run(func(b backend.Backend, p Pick) {
					b.CrossEntropyShardFinish(p(loss), p(logits), p(logits), p(lseR), p(target), p(targets), s.v, 0.37)
				})
			}},
		)
	}
	return cs
}

func adamWCases() []Case {
	var cs []Case
	for _, step := range []int{1, 7} {
		cs = append(cs, Case{Name: fmt.Sprintf("AdamWUpdate/step%d", step), Compare: func(e *Env) {
			const n = 70001
			param, grad := e.InOut(e.Rand("param", n)), e.Rand("grad", n)
			m := e.InOut(e.Uniform("m", -0.1, 0.1, n))
			v := e.InOut(e.Uniform("v", 0, 0.01, n))
			// Step 7 also scales the gradient, as clipping does.
			h := backend.AdamW{LR: 0.1, Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.1, Step: step}
			if step > 1 {
				h.GradScale = 0.37
			}
			e.Run(func(b backend.Backend, p Pick) { b.AdamWUpdate(p(param), p(grad), p(m), p(v), h) })
		}})
	}
	return cs
}
