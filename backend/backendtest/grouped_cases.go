package backendtest

// Conformance cases of the grouped products (GroupedMatMul,
// GroupedMatMulTN): the MoE experts' GEMMs. Group counts include empty
// groups, groups of one row, and rows after the last group that must stay
// untouched; the "ref" check compares with naive products written here.
// The groups come as host counts, and in the "offsets" cases as device
// offsets alone or beside the counts (backend.Groups), as the MoE layer's
// dropless dispatch on one expert rank gives them.

import (
	"fmt"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// groupedShape is one grouped test: len(rows) groups of the given counts
// over total rows (at least their sum), each [count, k]·[k, n].
type groupedShape struct {
	name        string
	rows        []int
	total       int
	n, k        int
	alpha, beta float64
}

// groupedNormWise makes the grouped cases compare outputs as whole tensors
// (CompareNormWise) on bf16 backends, as attention's do. Their outputs are
// many short dot products of rounded operands, and over some 10^5 elements
// the largest element-wise error lands at 4 to 5 standard deviations: at
// the element-wise bound of CompareFloats by chance alone. The rms there
// also counts the blocks of empty groups, which makes it smaller.
const groupedNormWise = true

func groupedShapes() []groupedShape {
	return []groupedShape{
		{"one-group", []int{7}, 7, 5, 3, 1, 0},
		{"empty-groups", []int{0, 9, 0, 1, 13}, 23, 6, 11, 1, 0},
		{"trailing-rows", []int{4, 3}, 10, 17, 8, -0.5, 0},
		{"accumulate", []int{5, 0, 12}, 17, 9, 14, 0.7, 1},
		{"alpha-beta", []int{3, 8, 2}, 13, 10, 7, 1.5, 0.25},
		// n > 512 and k > 128 cross the CPU kernel's blocks.
		{"blocked", []int{21, 0, 40}, 61, 530, 141, 1, 0},
	}
}

// groupOffsets is the prefix sums of rows (Groups.Offsets).
func groupOffsets(rows []int) []int32 {
	off := make([]int32, len(rows)+1)
	for g, r := range rows {
		off[g+1] = off[g] + int32(r)
	}
	return off
}

func (s groupedShape) sum() int {
	total := 0
	for _, r := range s.rows {
		total += r
	}
	return total
}

func groupedCases() []Case {
	var cs []Case
	for _, s := range groupedShapes() {
		G := len(s.rows)
		for _, transB := range []bool{false, true} {
			cs = append(cs, Case{Name: fmt.Sprintf("GroupedMatMul/transB=%v/%s", transB, s.name), Compare: func(e *Env) {
				e.NormWise = groupedNormWise
				a := e.Rand("a", s.total, s.k)
				bShape := []int{G * s.k, s.n}
				if transB {
					bShape = []int{G * s.n, s.k}
				}
				bb := e.Rand("b", bShape...)
				// InOut: the rows past the groups must keep their values.
				out := e.InOut(e.Rand("out", s.total, s.n))
				e.Run(func(b backend.Backend, p Pick) {
					b.GroupedMatMul(p(out), p(a), p(bb), backend.Groups{Rows: s.rows}, transB, s.alpha, s.beta)
				})
			}})
		}
		// The weight-gradient product: out is [G*k, n] from a [R, k] and
		// b [R, n]; an empty group's block is scaled by beta.
		cs = append(cs, Case{Name: "GroupedMatMulTN/" + s.name, Compare: func(e *Env) {
			e.NormWise = groupedNormWise
			a, bb := e.Rand("a", s.total, s.k), e.Rand("b", s.total, s.n)
			out := e.InOut(e.Rand("out", G*s.k, s.n))
			e.Run(func(b backend.Backend, p Pick) {
				b.GroupedMatMulTN(p(out), p(a), p(bb), backend.Groups{Rows: s.rows}, s.alpha, s.beta)
			})
		}})
	}
	// bf16 operands and outs, as the MoE layer passes them.
	s := groupedShapes()[1]
	G := len(s.rows)
	for _, ty := range mmTypes() {
		cs = append(cs, Case{Name: "GroupedMatMul/bf16-" + ty.name, Compare: func(e *Env) {
			e.NormWise = groupedNormWise
			a := e.typed(ty.a, "a", -1, 1, s.total, s.k)
			bb := e.typed(ty.b, "b", -1, 1, G*s.n, s.k)
			var out *Pair
			if ty.out {
				out = e.InOut(e.BF16Uniform("out", -1, 1, s.total, s.n))
			} else {
				out = e.InOut(e.Rand("out", s.total, s.n))
			}
			e.Run(func(b backend.Backend, p Pick) {
				b.GroupedMatMul(p(out), p(a), p(bb), backend.Groups{Rows: s.rows}, true, 1, 0)
			})
		}})
		if !ty.out {
			cs = append(cs, Case{Name: "GroupedMatMulTN/bf16-" + ty.name, Compare: func(e *Env) {
				e.NormWise = groupedNormWise
				a, bb := e.typed(ty.a, "a", -1, 1, s.total, s.k), e.typed(ty.b, "b", -1, 1, s.total, s.n)
				out := e.InOut(e.Rand("out", G*s.k, s.n))
				e.Run(func(b backend.Backend, p Pick) {
					b.GroupedMatMulTN(p(out), p(a), p(bb), backend.Groups{Rows: s.rows}, 1, 1)
				})
			}})
		}
	}
	// All-bf16 operands with sizes that are multiples of 8, as the MoE
	// forward passes them: the shape a grouped GEMM kernel takes (the
	// CUDA backend's Hopper kernel), with an empty group, rows past the
	// groups, groups that are not a multiple of a 128-row tile and several
	// n tiles.
	for _, k := range []struct {
		name    string
		rows    []int
		total   int
		n, k    int
		outBF16 bool
	}{
		{"small", []int{5, 0, 19}, 30, 40, 64, true},
		{"small-float-out", []int{5, 0, 19}, 30, 40, 64, false},
		{"tiles", []int{130, 0, 257, 1}, 400, 264, 136, true},
		{"tiles-float-out", []int{130, 0, 257, 1}, 400, 264, 136, false},
		// The groups as device offsets (they end at the last row).
		{"offsets", []int{130, 0, 257, 13}, 400, 264, 136, true},
		{"offsets-float-out", []int{130, 0, 257, 13}, 400, 264, 136, false},
	} {
		groups := func(e *Env) func(Pick) backend.Groups {
			if !strings.HasPrefix(k.name, "offsets") {
				return func(Pick) backend.Groups { return backend.Groups{Rows: k.rows} }
			}
			off := e.IntsOf("offsets", groupOffsets(k.rows), len(k.rows)+1)
			return func(p Pick) backend.Groups { return backend.Groups{Offsets: p(off)} }
		}
		cs = append(cs, Case{Name: "GroupedMatMul/bf16-kernel-" + k.name, Compare: func(e *Env) {
			e.NormWise = groupedNormWise
			a := e.BF16Uniform("a", -1, 1, k.total, k.k)
			bb := e.BF16Uniform("b", -1, 1, len(k.rows)*k.n, k.k)
			var out *Pair
			if k.outBF16 {
				out = e.InOut(e.BF16Uniform("out", -1, 1, k.total, k.n))
			} else {
				out = e.InOut(e.Rand("out", k.total, k.n))
			}
			g := groups(e)
			e.Run(func(b backend.Backend, p Pick) { b.GroupedMatMul(p(out), p(a), p(bb), g(p), true, 0.5, 0) })
		}})
		if !k.outBF16 {
			// The weight gradients of the same groups, accumulated into
			// float32 (the shapes the CUDA backend's TN kernel takes):
			// groups that end inside a 64-row k-block, an empty group, the
			// rows past the groups, partial m and n tiles.
			cs = append(cs, Case{Name: "GroupedMatMulTN/bf16-kernel-" + k.name, Compare: func(e *Env) {
				e.NormWise = groupedNormWise
				a, bb := e.BF16Uniform("a", -1, 1, k.total, k.k), e.BF16Uniform("b", -1, 1, k.total, k.n)
				out := e.InOut(e.Rand("out", len(k.rows)*k.k, k.n))
				g := groups(e)
				e.Run(func(b backend.Backend, p Pick) { b.GroupedMatMulTN(p(out), p(a), p(bb), g(p), 0.5, 1) })
			}})
		}
	}
	// Offsets alone and beside the counts, for every shape whose groups
	// end at the last row, both grouped products.
	for _, s := range groupedShapes() {
		if s.sum() != s.total {
			continue
		}
		G := len(s.rows)
		for _, both := range []bool{false, true} {
			via := "offsets"
			if both {
				via = "rows-and-offsets"
			}
			groups := func(e *Env) func(Pick) backend.Groups {
				off := e.IntsOf("offsets", groupOffsets(s.rows), G+1)
				return func(p Pick) backend.Groups {
					g := backend.Groups{Offsets: p(off)}
					if both {
						g.Rows = s.rows
					}
					return g
				}
			}
			cs = append(cs, Case{Name: fmt.Sprintf("GroupedMatMul/%s/%s", via, s.name), Compare: func(e *Env) {
				e.NormWise = groupedNormWise
				a, bb := e.Rand("a", s.total, s.k), e.Rand("b", G*s.n, s.k)
				out := e.InOut(e.Rand("out", s.total, s.n))
				g := groups(e)
				e.Run(func(b backend.Backend, p Pick) { b.GroupedMatMul(p(out), p(a), p(bb), g(p), true, s.alpha, s.beta) })
			}})
			cs = append(cs, Case{Name: fmt.Sprintf("GroupedMatMulTN/%s/%s", via, s.name), Compare: func(e *Env) {
				e.NormWise = groupedNormWise
				a, bb := e.Rand("a", s.total, s.k), e.Rand("b", s.total, s.n)
				out := e.InOut(e.Rand("out", G*s.k, s.n))
				g := groups(e)
				e.Run(func(b backend.Backend, p Pick) { b.GroupedMatMulTN(p(out), p(a), p(bb), g(p), s.alpha, s.beta) })
			}})
		}
	}
	cs = append(cs, Case{Name: "Grouped/ref", Check: checkGrouped})
	return cs
}

// checkGrouped compares both grouped products with naive per-group
// products over slices of the host data.
func checkGrouped(t *testing.T, b backend.Backend) {
	c := newChecker(t, b)
	for _, s := range groupedShapes() {
		G, k, n := len(s.rows), s.k, s.n
		a := c.rand(s.total*k, -1, 1)
		out0 := c.rand(s.total*n, -1, 1)
		for _, transB := range []bool{false, true} {
			w := c.rand(G*k*n, -1, 1)
			wShape := []int{G * k, n}
			if transB {
				wShape = []int{G * n, k}
			}
			outT := c.up(out0, s.total, n)
			b.GroupedMatMul(outT, c.up(a, s.total, k), c.up(w, wShape...), backend.Groups{Rows: s.rows}, transB, s.alpha, s.beta)
			want := append([]float64(nil), out0...)
			off := 0
			for g, r := range s.rows {
				rows := want[off*n : (off+r)*n]
				copy(rows, naiveMatMul(a[off*k:(off+r)*k], w[g*k*n:(g+1)*k*n], rows, r, n, k, false, transB, s.alpha, s.beta))
				off += r
			}
			c.same(fmt.Sprintf("GroupedMatMul %s transB=%v", s.name, transB), c.down(outT), want)
		}
		bm := c.rand(s.total*n, -1, 1)
		outG0 := c.rand(G*k*n, -1, 1)
		outT := c.up(outG0, G*k, n)
		b.GroupedMatMulTN(outT, c.up(a, s.total, k), c.up(bm, s.total, n), backend.Groups{Rows: s.rows}, s.alpha, s.beta)
		want := append([]float64(nil), outG0...)
		off := 0
		for g, r := range s.rows {
			block := want[g*k*n : (g+1)*k*n]
			copy(block, naiveMatMul(a[off*k:(off+r)*k], bm[off*n:(off+r)*n], block, k, n, r, true, false, s.alpha, s.beta))
			off += r
		}
		c.same("GroupedMatMulTN "+s.name, c.down(outT), want)
	}
}
