package backend

import "fmt"

// MatMulDims returns m, n and k of out[m,n] = op(a)[m,k]·op(b)[k,n], checking
// that a, b and out are 2-D and agree. Backends call it before MatMul's
// kernel so every backend enforces one rule with one message.
func MatMulDims(out, a, b Tensor, transA, transB bool) (m, n, k int, err error) {
	for _, t := range []struct {
		name string
		t    Tensor
	}{{"a", a}, {"b", b}, {"out", out}} {
		if t.t == nil {
			return 0, 0, 0, fmt.Errorf("%s is nil", t.name)
		}
		if s := t.t.Shape(); len(s) != 2 {
			return 0, 0, 0, fmt.Errorf("%s has shape %v, want a 2-D tensor", t.name, s)
		}
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
