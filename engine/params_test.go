package engine

import (
	"context"
	"math"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/backendtest"
	"github.com/mktrain/mktrain/backend/cpu"
)

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

// TestBF16OperandWeights trains with bf16 operand weights and activations
// and checks that the losses follow the float run within bf16 error but
// are not identical (the bf16 path ran), and that the run keeps learning:
// a stale operand copy (never refreshed after the optimizer steps) would
// leave the later losses at the first step's level.
func TestBF16OperandWeights(t *testing.T) {
	cfg := equivalenceConfig()
	cfg.Train.Steps = 8
	losses := func(b backend.Backend) []float64 {
		var out []float64
		eng, err := New(cfg, WithBackend(b), WithHook(func(ev StepEvent) { out = append(out, ev.Loss) }))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := eng.Run(context.Background()); err != nil {
			t.Fatal(err)
		}
		return out
	}
	want, got := losses(cpu.New(backend.Float32)), losses(backendtest.BF16Operands(cpu.New(backend.Float32)))
	same := true
	for i := range want {
		rel := math.Abs(got[i]-want[i]) / math.Abs(want[i])
		if !(rel <= 2e-2) {
			t.Errorf("step %d: loss %.6f with bf16 operands, %.6f in float: relative difference %.3g", i+1, got[i], want[i], rel)
		}
		same = same && got[i] == want[i]
	}
	if same {
		t.Errorf("the bf16 run's losses equal the float run's bit for bit: the bf16 path did not run")
	}
	if !(got[len(got)-1] < got[0]-0.05) {
		t.Errorf("losses %v: the bf16 run does not learn", got)
	}
}
