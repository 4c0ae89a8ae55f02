package engine

import (
	"context"
	"fmt"
	"math"
	"testing"
)

// equivalenceConfig is a small model on the embedded corpus whose global
// batch (8 sequences) is split over the ranks of each layout.
func equivalenceConfig() Config {
	cfg := DefaultConfig()
	cfg.Model.Dim, cfg.Model.Layers, cfg.Model.Heads, cfg.Model.KVHeads = 32, 2, 4, 2
	cfg.Model.MoE.Experts, cfg.Model.MoE.TopK, cfg.Model.MoE.FFN = 4, 2, 32
	cfg.Model.MoE.ZLossCoef = 0.001
	cfg.Train.Seq, cfg.Train.GlobalBatch, cfg.Train.Steps = 16, 8, 10
	cfg.Train.LR, cfg.Train.WarmupSteps, cfg.Train.EvalEvery, cfg.Train.EvalBatches = 3e-3, 2, 0, 1
	cfg.Train.Backend = "cpu"
	return cfg
}

func trainLosses(t *testing.T, cfg Config) []float64 {
	t.Helper()
	var losses []float64
	for _, ev := range trainEvents(t, cfg) {
		losses = append(losses, ev.Loss)
	}
	return losses
}

// trainEvents trains cfg and returns the event of every step.
func trainEvents(t *testing.T, cfg Config) []StepEvent {
	t.Helper()
	var evs []StepEvent
	eng, err := New(cfg, WithHook(func(ev StepEvent) { evs = append(evs, ev) }))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	return evs
}

// equivalenceLayouts are the layouts of 2 and 4 virtual ranks the
// equivalence tests train: expert, data and context parallel and their
// products. micro is the micro-batch that keeps one micro-batch per step.
var equivalenceLayouts = []struct{ dp, ep, cp, micro int }{
	{1, 2, 1, 4}, {1, 4, 1, 2}, {2, 2, 1, 2}, {2, 1, 1, 4},
	{1, 1, 2, 8}, {2, 1, 2, 4}, {1, 2, 2, 4},
}

// TestVirtualRanksMatchOneRank trains the same global batches on one rank
// and on layouts of 2 and 4 virtual ranks (equivalenceLayouts) and requires
// the same loss sequence within float32 tolerance, and the same auxiliary
// losses, gradient norms and final validation loss, which every layout
// must compute over the global batch too.
func TestVirtualRanksMatchOneRank(t *testing.T) {
	base := equivalenceConfig()
	base.Train.MicroBatch = 8
	want := trainEvents(t, base)
	for _, layout := range equivalenceLayouts {
		t.Run(fmt.Sprintf("dp%d_ep%d_cp%d", layout.dp, layout.ep, layout.cp), func(t *testing.T) {
			cfg := equivalenceConfig()
			cfg.Parallel.DP, cfg.Parallel.EP, cfg.Parallel.CP, cfg.Train.MicroBatch = layout.dp, layout.ep, layout.cp, layout.micro
			got := trainEvents(t, cfg)
			if len(got) != len(want) {
				t.Fatalf("%d steps, want %d", len(got), len(want))
			}
			for i := range want {
				for _, q := range []struct {
					name      string
					got, want float64
					tol       float64
				}{
					{"loss", got[i].Loss, want[i].Loss, 2e-4},
					{"aux loss", got[i].AuxLoss, want[i].AuxLoss, 1e-3},
					{"z loss", got[i].ZLoss, want[i].ZLoss, 1e-3},
					{"grad norm", got[i].GradNorm, want[i].GradNorm, 1e-3},
				} {
					if !(math.Abs(q.got-q.want) <= q.tol*math.Abs(q.want)) {
						t.Errorf("step %d: %s %.6f, one rank %.6f", i+1, q.name, q.got, q.want)
					}
				}
			}
			last := len(want) - 1
			if g, w := got[last].ValLoss, want[last].ValLoss; !(math.Abs(g-w) <= 2e-4*w) {
				t.Errorf("validation loss %.6f, one rank %.6f", g, w)
			}
		})
	}
}

// TestGradientAccumulationMatchesOneMicroBatch: two micro-batches of 4
// sequences make the same steps as one of 8 (the aux losses aside, which
// are defined per micro-step, so they are off here).
func TestGradientAccumulationMatchesOneMicroBatch(t *testing.T) {
	cfg := equivalenceConfig()
	cfg.Model.MoE.AuxLossCoef, cfg.Model.MoE.ZLossCoef = 0, 0
	cfg.Train.Steps = 4
	cfg.Train.MicroBatch = 8
	want := trainLosses(t, cfg)
	cfg.Train.MicroBatch = 4
	got := trainLosses(t, cfg)
	for i := range want {
		if math.Abs(got[i]-want[i]) > 2e-4*math.Abs(want[i]) {
			t.Errorf("step %d: loss %.6f with accumulation, %.6f without", i+1, got[i], want[i])
		}
	}
}
