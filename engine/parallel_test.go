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
	eng, err := New(cfg, WithHook(func(ev StepEvent) { losses = append(losses, ev.Loss) }))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	return losses
}

// TestVirtualRanksMatchOneRank trains the same global batches on one rank
// and on layouts of 2 and 4 virtual ranks (expert parallel, and data x
// expert parallel) and requires the same loss sequence within float32
// tolerance.
func TestVirtualRanksMatchOneRank(t *testing.T) {
	base := equivalenceConfig()
	base.Train.MicroBatch = 8
	want := trainLosses(t, base)
	for _, layout := range []struct{ dp, ep, micro int }{{1, 2, 4}, {1, 4, 2}, {2, 2, 2}, {2, 1, 4}} {
		t.Run(fmt.Sprintf("dp%d_ep%d", layout.dp, layout.ep), func(t *testing.T) {
			cfg := equivalenceConfig()
			cfg.Parallel.DP, cfg.Parallel.EP, cfg.Train.MicroBatch = layout.dp, layout.ep, layout.micro
			got := trainLosses(t, cfg)
			if len(got) != len(want) {
				t.Fatalf("%d losses, want %d", len(got), len(want))
			}
			for i := range want {
				if math.Abs(got[i]-want[i]) > 2e-4*math.Abs(want[i]) {
					t.Errorf("step %d: loss %.6f, one rank %.6f", i+1, got[i], want[i])
				}
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
