package engine

import "testing"

// TestFlatLayout checks the placement of parameters in the flat stores:
// every tensor aligned, none overlapping, norms first, then the replicated
// matrices, then the experts, with the spans covering exactly their roles.
func TestFlatLayout(t *testing.T) {
	m := tinyModelForLayout()
	lay := newFlatLayout(m, 2)
	type iv struct{ lo, hi int }
	var seen []iv
	for i, s := range lay.slots {
		n := 1
		for _, d := range lay.shape[i] {
			n *= d
		}
		lo, hi := lay.offset[i], lay.offset[i]+n
		if lo%flatAlign != 0 {
			t.Errorf("%s starts at %d, not a multiple of %d", s.name, lo, flatAlign)
		}
		want := lay.replicated
		switch s.role {
		case roleNorm:
			want = lay.norms
		case roleExpert:
			want = lay.experts
			if lay.shape[i][0] != 2 {
				t.Errorf("%s has shape %v, want 2 local experts first", s.name, lay.shape[i])
			}
		}
		if lo < want.lo || hi > want.hi {
			t.Errorf("%s [%d, %d) lies outside its role's span %v", s.name, lo, hi, want)
		}
		for _, o := range seen {
			if lo < o.hi && o.lo < hi {
				t.Errorf("%s [%d, %d) overlaps [%d, %d)", s.name, lo, hi, o.lo, o.hi)
			}
		}
		seen = append(seen, iv{lo, hi})
	}
	if lay.norms.lo != 0 || lay.norms.hi > lay.replicated.hi || lay.replicated.hi != lay.experts.lo || lay.experts.hi != lay.total {
		t.Errorf("spans norms %v, replicated %v, experts %v, total %d: want norms ⊂ replicated, then experts to the end",
			lay.norms, lay.replicated, lay.experts, lay.total)
	}
}

func tinyModelForLayout() ModelConfig {
	m := ModelConfig{Vocab: 64, Dim: 12, Layers: 2, Heads: 3, KVHeads: 1, RopeTheta: 1e4, NormEps: 1e-5, InitStd: 0.02}
	m.MoE.Experts, m.MoE.TopK, m.MoE.FFN, m.MoE.SharedExperts = 4, 2, 20, 1
	return m
}
