package engine

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/moe"
)

// TestRecomputeIsBitExact trains the tiny recipe's model for a few steps
// with train.recompute none, selective and full, on one rank and on
// virtual-rank layouts of data, expert, context and tensor parallelism,
// and requires every step's loss, aux loss, gradient norm and expert
// loads, and every rank's gradients and weights after the last step, to
// be the same bits: the remade activations are the kept ones, and full's
// rerun of each layer's forward counts nothing twice. The layouts named
// "bf16 operands" run on a backend whose operand type is bf16, as the
// GPU's: split masters, and the activations the GPU keeps in bf16 (q, k,
// v, the attention output, the normalised inputs) in the shared
// recomputed sets too.
func TestRecomputeIsBitExact(t *testing.T) {
	layouts := []struct {
		name                string
		dp, ep, cp, tp      int
		micro               int
		dispatcher, cpModes string
	}{
		{"one rank", 1, 1, 1, 1, 8, moe.DispatcherUnfused, "allgather"},
		{"dp2 ep2", 2, 2, 1, 1, 2, moe.DispatcherUnfused, "allgather"},
		{"dp2 ep2 fused", 2, 2, 1, 1, 2, moe.DispatcherFused, "allgather"},
		{"cp2 allgather", 1, 1, 2, 1, 8, moe.DispatcherUnfused, "allgather"},
		{"cp2 ring", 1, 1, 2, 1, 8, moe.DispatcherUnfused, "ring"},
		{"tp2", 1, 1, 1, 2, 8, moe.DispatcherUnfused, "allgather"},
		{"tp2 sequence parallel", 1, 1, 1, 2, 8, moe.DispatcherUnfused, "allgather"},
		// The gradient reduction overlapping the backward, and the
		// reruns' collectives on the groups beside it.
		{"dp2 cp2 allgather", 2, 1, 2, 1, 4, moe.DispatcherUnfused, "allgather"},
		{"dp2 ep2 tp2 sequence parallel", 2, 2, 1, 2, 2, moe.DispatcherUnfused, "allgather"},
		// Every piece of MoE bookkeeping a rerun must not redo: the bias
		// update's loads, a capacity's drops, the z-loss, shared experts.
		{"dp2 ep2 balanced", 2, 2, 1, 1, 2, moe.DispatcherUnfused, "allgather"},
		{"dp2 ep2 fused balanced", 2, 2, 1, 1, 2, moe.DispatcherFused, "allgather"},
		{"bf16 operands: one rank", 1, 1, 1, 1, 8, moe.DispatcherUnfused, "allgather"},
		{"bf16 operands: dp2 ep2 fused", 2, 2, 1, 1, 2, moe.DispatcherFused, "allgather"},
		{"bf16 operands: cp2 ring", 1, 1, 2, 1, 8, moe.DispatcherUnfused, "ring"},
		{"bf16 operands: tp2 sequence parallel", 1, 1, 1, 2, 8, moe.DispatcherUnfused, "allgather"},
	}
	for _, l := range layouts {
		t.Run(l.name, func(t *testing.T) {
			cfg := DefaultConfig() // the tiny recipe's model
			cfg.Train.Backend, cfg.Train.Steps, cfg.Train.WarmupSteps, cfg.Train.EvalEvery = "cpu", 3, 1, 0
			cfg.Parallel.DP, cfg.Parallel.EP, cfg.Parallel.CP, cfg.Parallel.TP = l.dp, l.ep, l.cp, l.tp
			cfg.Parallel.SequenceParallel = strings.HasSuffix(l.name, "sequence parallel")
			if strings.HasSuffix(l.name, "balanced") {
				m := &cfg.Model.MoE
				m.BiasUpdateRate, m.CapacityFactor, m.ZLossCoef, m.SharedExperts = 1e-3, 1, 1e-3, 1
			}
			cfg.Train.MicroBatch = l.micro
			// The ranks are built here, not by Run, which settles "auto".
			cfg.Model.MoE.Dispatcher, cfg.Parallel.CPAttention, cfg.Parallel.TPOverlap = l.dispatcher, l.cpModes, "unfused"
			var b backend.Backend = cpu.New(backend.Float32)
			if strings.HasPrefix(l.name, "bf16 operands") {
				b = bf16OperandBackend()
			}
			want, _ := recomputeRunOn(t, cfg, b)
			for _, mode := range []string{RecomputeSelective, RecomputeFull} {
				cfg.Train.Recompute = mode
				got, _ := recomputeRunOn(t, cfg, b)
				for i := range want.steps {
					w, g := want.steps[i], got.steps[i]
					if g.loss != w.loss || g.gradNorm != w.gradNorm || g.auxLoss != w.auxLoss || g.zLoss != w.zLoss {
						t.Errorf("%s: step %d: loss %.9g, grad norm %.9g, aux %.9g, z %.9g; %.9g, %.9g, %.9g, %.9g under none",
							mode, i+1, g.loss, g.gradNorm, g.auxLoss, g.zLoss, w.loss, w.gradNorm, w.auxLoss, w.zLoss)
					}
					if !reflect.DeepEqual(g.expertLoad, w.expertLoad) || !slices.Equal(g.dropped, w.dropped) {
						t.Errorf("%s: step %d: expert loads %v, dropped %v; %v, %v under none", mode, i+1, g.expertLoad, g.dropped, w.expertLoad, w.dropped)
					}
				}
				for r := range want.grads {
					if !slices.Equal(got.grads[r], want.grads[r]) {
						t.Errorf("%s: rank %d: the gradients differ", mode, r)
					}
					if !slices.Equal(got.weights[r], want.weights[r]) {
						t.Errorf("%s: rank %d: the weights differ", mode, r)
					}
				}
			}
		})
	}
}

// recomputed is what TestRecomputeIsBitExact and
// TestOptimizerInBackwardIsBitExact compare: world rank 0's step results,
// and every rank's flat gradients, weights (with split masters their
// float32 part and both halves of the rest) and AdamW moments after the
// last step.
type recomputed struct {
	steps                []stepResult
	grads, weights, m, v [][]float64
}

// recomputeRun trains cfg on virtual ranks of one CPU backend, and
// returns the ranks too.
func recomputeRun(t *testing.T, cfg Config) (recomputed, []*rank) {
	t.Helper()
	return recomputeRunOn(t, cfg, cpu.New(backend.Float32))
}

// recomputeRunOn is recomputeRun on the backend b.
func recomputeRunOn(t *testing.T, cfg Config, b backend.Backend) (recomputed, []*rank) {
	t.Helper()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	// ranksOn orders the ranks by world rank.
	_, ranks := ranksOn(t, cfg, b)
	var out recomputed
	for i, rs := range trainRanks(t, ranks, cfg.Train.Steps) {
		if i == 0 {
			out.steps = rs
		}
		r := ranks[i]
		out.grads = append(out.grads, backend.DownloadFloat64(r.b, r.gStore.flat))
		w := backend.DownloadFloat64(r.b, r.wStore.flat)
		if r.split.hi != nil {
			w = append(w, backend.DownloadFloat64(r.b, r.split.hi)...)
			for _, lo := range backend.DownloadInt32(r.b, r.split.lo) {
				w = append(w, float64(lo))
			}
		}
		out.weights = append(out.weights, w)
		out.m = append(out.m, backend.DownloadFloat64(r.b, r.m))
		out.v = append(out.v, backend.DownloadFloat64(r.b, r.v))
	}
	return out, ranks
}
