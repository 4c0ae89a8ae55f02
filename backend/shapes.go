package backend

import "fmt"

// MatMulDims returns m, n and k of out[m,n] = op(a)[m,k]·op(b)[k,n], checking
// that a, b and out are 2-D and agree. Backends call it before MatMul's
// kernel so every backend enforces one rule with one message.
func MatMulDims(out, a, b Tensor, transA, transB bool) (m, n, k int, err error) {
	if err := check2D(a, b, out); err != nil {
		return 0, 0, 0, err
	}
	as, bs := a.Shape(), b.Shape()
	m, k = as[0], as[1]
	if transA {
		m, k = k, m
	}
	kb, n := bs[0], bs[1]
	if transB {
		kb, n = n, kb
	}
	if k != kb {
		return 0, 0, 0, fmt.Errorf("inner dimensions differ: op(a) is [%d %d] (a %v, transA=%v), op(b) is [%d %d] (b %v, transB=%v)",
			m, k, as, transA, kb, n, bs, transB)
	}
	if os := out.Shape(); os[0] != m || os[1] != n {
		return 0, 0, 0, fmt.Errorf("out has shape %v, want [%d %d]", os, m, n)
	}
	return m, n, k, nil
}

// GroupedMatMulDims checks GroupedMatMul's arguments and returns the
// product's n and k (each group is [n_g, k]·[k, n]). The groups must pass
// CheckGroups for a's rows, and out must have a's rows.
func GroupedMatMulDims(outRN, aRK, bG Tensor, groups Groups, transB bool) (n, k int, err error) {
	if err := check2D(aRK, bG, outRN); err != nil {
		return 0, 0, err
	}
	if err := CheckGroups(groups, aRK.Shape()[0]); err != nil {
		return 0, 0, err
	}
	G := groups.Len()
	as, bs, os := aRK.Shape(), bG.Shape(), outRN.Shape()
	k = as[1]
	if transB {
		if bs[0]%G != 0 || bs[1] != k {
			return 0, 0, fmt.Errorf("b has shape %v, want [%d*N %d] (%d matrices [N %d], transB)", bs, G, k, G, k)
		}
		n = bs[0] / G
	} else {
		if bs[0] != G*k {
			return 0, 0, fmt.Errorf("b has shape %v, want [%d %d] (%d matrices [%d N])", bs, G*k, bs[1], G, k)
		}
		n = bs[1]
	}
	if os[0] != as[0] || os[1] != n {
		return 0, 0, fmt.Errorf("out has shape %v, want [%d %d] (a has %d rows, each group's product %d columns)", os, as[0], n, as[0], n)
	}
	return n, k, nil
}

// GroupedMatMulTNDims checks GroupedMatMulTN's arguments and returns m and
// n: a is [R, m], b [R, n] and out [G*m, n].
func GroupedMatMulTNDims(outGMN, aRM, bRN Tensor, groups Groups) (m, n int, err error) {
	if err := check2D(aRM, bRN, outGMN); err != nil {
		return 0, 0, err
	}
	if err := CheckGroups(groups, aRM.Shape()[0]); err != nil {
		return 0, 0, err
	}
	G := groups.Len()
	as, bs, os := aRM.Shape(), bRN.Shape(), outGMN.Shape()
	m, n = as[1], bs[1]
	if bs[0] != as[0] {
		return 0, 0, fmt.Errorf("a has %d rows and b %d; the groups split both the same way (a %v, b %v)", as[0], bs[0], as, bs)
	}
	if os[0] != G*m || os[1] != n {
		return 0, 0, fmt.Errorf("out has shape %v, want [%d %d] (%d blocks [%d %d])", os, G*m, n, G, m, n)
	}
	return m, n, nil
}

// checkGroupRows checks that the counts are non-negative and fit rows.
func checkGroupRows(groupRows []int, rows int) error {
	sum := 0
	for g, c := range groupRows {
		if c < 0 {
			return fmt.Errorf("group %d has %d rows", g, c)
		}
		sum += c
	}
	if sum > rows {
		return fmt.Errorf("the groups hold %d rows, more than the %d of the operands", sum, rows)
	}
	return nil
}

// check2D checks that a product's operands and output are present and
// 2-D; errors name them a, b and out.
func check2D(a, b, out Tensor) error {
	for _, t := range []struct {
		name string
		t    Tensor
	}{{"a", a}, {"b", b}, {"out", out}} {
		if t.t == nil {
			return fmt.Errorf("%s is nil", t.name)
		}
		if s := t.t.Shape(); len(s) != 2 {
			return fmt.Errorf("%s has shape %v, want a 2-D tensor", t.name, s)
		}
	}
	return nil
}

// GatherSumK is the K of GatherSumRows' posTK, which must be [t, K] for t
// output rows, or an error naming what is wrong with it.
func GatherSumK(posTK Tensor, t int) (int, error) {
	if posTK == nil {
		return 0, fmt.Errorf("pos is nil")
	}
	if s := posTK.Shape(); len(s) == 2 && s[0] == t {
		return s[1], nil
	}
	return 0, fmt.Errorf("pos has shape %v, want [%d K]", posTK.Shape(), t)
}
