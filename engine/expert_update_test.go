package engine

import (
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/moe"
)

// TestOptimizerInBackwardIsBitExact trains the tiny recipe's model for a
// few steps with the experts updated after the backward and inside it
// (train.optimizer_in_backward off and on), on one rank and on the
// layouts the update in the backward allows (expert and tensor
// parallelism, ZeRO-1 over the expert ranks, recomputation, both
// dispatchers), and requires the same losses, loads, replicated
// gradients, weights and AdamW moments bit for bit, and the same gradient
// norm to float64 rounding (it is summed tensor by tensor). It also checks
// that the gradient store shrank to the replicated tensors and one
// expert tensor.
func TestOptimizerInBackwardIsBitExact(t *testing.T) {
	layouts := []struct {
		name       string
		ep, tp     int
		zero       int
		recompute  string
		dispatcher string
	}{
		{"one rank", 1, 1, 0, RecomputeNone, moe.DispatcherUnfused},
		{"one rank, fused, recompute full", 1, 1, 0, RecomputeFull, moe.DispatcherFused},
		{"ep2", 2, 1, 0, RecomputeNone, moe.DispatcherUnfused},
		{"ep2 fused, zero 1, recompute selective", 2, 1, 1, RecomputeSelective, moe.DispatcherFused},
		{"tp2 sequence parallel", 1, 2, 0, RecomputeNone, moe.DispatcherUnfused},
		{"ep2 tp2 balanced", 2, 2, 0, RecomputeNone, moe.DispatcherUnfused},
	}
	for _, l := range layouts {
		t.Run(l.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Train.Backend, cfg.Train.Steps, cfg.Train.WarmupSteps, cfg.Train.EvalEvery = "cpu", 3, 1, 0
			cfg.Train.GradClip, cfg.Train.Recompute = 0, l.recompute
			cfg.Parallel.EP, cfg.Parallel.TP, cfg.Parallel.Zero = l.ep, l.tp, l.zero
			cfg.Parallel.SequenceParallel = strings.Contains(l.name, "sequence parallel")
			cfg.Train.MicroBatch = cfg.Train.GlobalBatch / l.ep
			if strings.HasSuffix(l.name, "balanced") {
				m := &cfg.Model.MoE
				m.BiasUpdateRate, m.CapacityFactor, m.ZLossCoef, m.SharedExperts = 1e-3, 1, 1e-3, 1
			}
			cfg.Model.MoE.Dispatcher, cfg.Parallel.CPAttention, cfg.Parallel.TPOverlap = l.dispatcher, "allgather", "unfused"

			cfg.Train.OptimizerInBackward = OptimizerInBackwardOff
			want, wantRanks := recomputeRun(t, cfg)
			cfg.Train.OptimizerInBackward = OptimizerInBackwardOn
			got, gotRanks := recomputeRun(t, cfg)

			for i := range want.steps {
				w, g := want.steps[i], got.steps[i]
				if g.loss != w.loss || g.auxLoss != w.auxLoss || g.zLoss != w.zLoss || g.lr != w.lr {
					t.Errorf("step %d: loss %.9g, aux %.9g, z %.9g, lr %g; %.9g, %.9g, %.9g, %g updating after the backward",
						i+1, g.loss, g.auxLoss, g.zLoss, g.lr, w.loss, w.auxLoss, w.zLoss, w.lr)
				}
				if math.Abs(g.gradNorm-w.gradNorm) > 1e-12*w.gradNorm || w.gradNorm == 0 {
					t.Errorf("step %d: gradient norm %.17g, want %.17g", i+1, g.gradNorm, w.gradNorm)
				}
				if !reflect.DeepEqual(g.expertLoad, w.expertLoad) || !slices.Equal(g.dropped, w.dropped) {
					t.Errorf("step %d: expert loads %v, dropped %v; %v, %v", i+1, g.expertLoad, g.dropped, w.expertLoad, w.dropped)
				}
			}
			for r := range want.weights {
				if !slices.Equal(got.weights[r], want.weights[r]) {
					t.Errorf("rank %d: the weights differ", r)
				}
				if !slices.Equal(got.m[r], want.m[r]) || !slices.Equal(got.v[r], want.v[r]) {
					t.Errorf("rank %d: the AdamW moments differ", r)
				}
				lay := gotRanks[r].layout
				if !slices.Equal(got.grads[r], want.grads[r][:lay.experts.lo]) {
					t.Errorf("rank %d: the replicated gradients differ", r)
				}
				// The stores: every layer's experts before, one expert
				// tensor's now (the three tensors of a layer are alike).
				gr, wr := gotRanks[r], wantRanks[r]
				perTensor := (lay.experts.hi - lay.experts.lo) / (3 * cfg.Model.Layers)
				if !gr.expertsInBackward || gr.gStore.flat.Len() != lay.experts.lo || gr.expertGrads.Len() != perTensor {
					t.Errorf("rank %d: gradient store %d + %d elements, want %d + %d (experts in the backward: %v)",
						r, gr.gStore.flat.Len(), gr.expertGrads.Len(), lay.experts.lo, perTensor, gr.expertsInBackward)
				}
				if wr.expertsInBackward || wr.gStore.flat.Len() != lay.total {
					t.Errorf("rank %d: off kept a gradient store of %d elements, want %d", r, wr.gStore.flat.Len(), lay.total)
				}
			}
		})
	}
}

// TestOptimizerInBackwardSetting: auto turns the update in the backward
// on exactly where nothing needs the experts' gradients after their
// layer's backward, and on is refused elsewhere with a sentence naming
// the field that stands in the way.
func TestOptimizerInBackwardSetting(t *testing.T) {
	base := DefaultConfig()
	base.Train.GradClip = 0
	cases := []struct {
		name   string
		set    func(*Config)
		auto   bool
		refuse string // what Validate's error names under on; "" accepts on
	}{
		{"no clipping, one micro-batch", func(c *Config) {}, true, ""},
		{"ep 2, tp 2", func(c *Config) { c.Parallel.EP, c.Parallel.TP, c.Train.MicroBatch = 2, 2, 4 }, true, ""},
		{"clipping", func(c *Config) { c.Train.GradClip = 1 }, false, "train.grad_clip is 1"},
		{"two micro-batches", func(c *Config) { c.Train.MicroBatch = 4 }, false, "2 micro-batches per step"},
		{"dp 2", func(c *Config) { c.Parallel.DP, c.Train.MicroBatch = 2, 4 }, false, "parallel.dp is 2"},
		{"cp 2", func(c *Config) { c.Parallel.CP = 2 }, false, "parallel.cp is 2"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := base
			tc.set(&c)
			for _, auto := range []string{OptimizerInBackwardAuto, ""} {
				c.Train.OptimizerInBackward = auto
				if err := c.Validate(); err != nil {
					t.Fatal(err)
				}
				if got := c.ExpertsUpdatedInBackward(); got != tc.auto {
					t.Errorf("%q: experts updated in the backward %v, want %v", auto, got, tc.auto)
				}
			}
			c.Train.OptimizerInBackward = OptimizerInBackwardOff
			if err := c.Validate(); err != nil || c.ExpertsUpdatedInBackward() {
				t.Errorf("off: %v, in the backward %v", err, c.ExpertsUpdatedInBackward())
			}
			c.Train.OptimizerInBackward = OptimizerInBackwardOn
			err := c.Validate()
			switch {
			case tc.refuse == "" && err != nil:
				t.Errorf("on: %v", err)
			case tc.refuse != "" && (err == nil || !strings.Contains(err.Error(), "train.optimizer_in_backward") || !strings.Contains(err.Error(), tc.refuse)):
				t.Errorf("on: %v; want a refusal naming train.optimizer_in_backward and %q", err, tc.refuse)
			}
		})
	}
	// Clipping alone in the way: the plan's refusal may offer grad_clip 0.
	for _, tc := range []struct {
		name string
		set  func(*Config)
		want bool
	}{
		{"clipping", func(c *Config) { c.Train.GradClip = 1 }, true},
		{"clipping, off", func(c *Config) { c.Train.GradClip, c.Train.OptimizerInBackward = 1, OptimizerInBackwardOff }, false},
		{"clipping and dp 2", func(c *Config) { c.Train.GradClip, c.Parallel.DP, c.Train.MicroBatch = 1, 2, 4 }, false},
		{"no clipping", func(c *Config) {}, false},
	} {
		c := base
		tc.set(&c)
		if got := c.expertsInBackwardUnclipped(); got != tc.want {
			t.Errorf("%s: in the backward but for clipping %v, want %v", tc.name, got, tc.want)
		}
	}
	c := base
	c.Train.OptimizerInBackward = "sometimes"
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "train.optimizer_in_backward") {
		t.Errorf("optimizer_in_backward sometimes: %v", err)
	}
}
