package recipes

import (
	"strings"
	"testing"

	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/plan"
)

// TestLongContextFitsOneH200: long-context trains its 4 context-parallel
// ranks as virtual ranks of one H200, with room to spare, whichever
// parallel.cp_attention mode auto settles on (the plan takes the larger),
// and under either explicit mode. The peak must stay under 85% of the
// memory the run has (the H200's less the CUDA context): the plan counts
// every tensor, and the margin is for a later model change that adds one.
func TestLongContextFitsOneH200(t *testing.T) {
	cfg, _, err := Load("long-context.yaml", nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Train.Seq < 65536 || cfg.Model.HeadDim() != 128 || cfg.Model.KVHeads >= cfg.Model.Heads || cfg.Parallel.CP != 4 {
		t.Fatalf("long-context is seq %d, head dim %d, %d heads over %d kv heads, cp %d; want seq >= 65536, head dim 128, GQA, cp 4",
			cfg.Train.Seq, cfg.Model.HeadDim(), cfg.Model.Heads, cfg.Model.KVHeads, cfg.Parallel.CP)
	}
	dev, err := plan.NamedDevice("h200")
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []string{cfg.Parallel.CPAttention, "ring", "allgather"} {
		c := cfg
		c.Parallel.CPAttention = mode
		p, err := plan.New(engine.PlanConfig(c, 0, 0, true), dev) // every rank on the one device
		if err != nil {
			t.Fatal(err)
		}
		if p.DeviceRanks != 4 {
			t.Fatalf("%d ranks on the device, want 4", p.DeviceRanks)
		}
		if err := p.Check(); err != nil {
			t.Errorf("cp_attention %s: %v", mode, err)
		}
		if limit := dev.Memory / 100 * 85; p.Peak > limit {
			t.Errorf("cp_attention %s: the peak is %s of %s, more than 85%%", mode, plan.FormatBytes(p.Peak), plan.FormatBytes(dev.Memory))
		}
		t.Logf("cp_attention %s: peak %s of %s (%.0f%%)", mode, plan.FormatBytes(p.Peak), plan.FormatBytes(dev.Memory), 100*float64(p.Peak)/float64(dev.Memory))
	}
}

// TestMoELargeFitsOnlyWithRecompute is issue 28's larger recipe: moe-fine
// at twice its depth and batch, which one H200 holds with train.recompute:
// full (its setting, at most 95% of the memory) and refuses without
// recomputation, before allocating anything, the sentence naming
// train.recompute; selective needs more than full and less than none.
func TestMoELargeFitsOnlyWithRecompute(t *testing.T) {
	large, _, err := Load("moe-large", nil)
	if err != nil {
		t.Fatal(err)
	}
	fine, _, err := Load("moe-fine", nil)
	if err != nil {
		t.Fatal(err)
	}
	if large.Model.Layers != 2*fine.Model.Layers || large.Train.GlobalBatch != 2*fine.Train.GlobalBatch ||
		large.Train.Recompute != engine.RecomputeFull {
		t.Fatalf("moe-large: %d layers, batch %d, recompute %s; want twice moe-fine's %d layers and batch %d, recompute full",
			large.Model.Layers, large.Train.GlobalBatch, large.Train.Recompute, fine.Model.Layers, fine.Train.GlobalBatch)
	}
	asFine := large
	asFine.Model.Layers, asFine.Train.GlobalBatch, asFine.Train.MicroBatch, asFine.Train.Recompute = fine.Model.Layers, fine.Train.GlobalBatch, fine.Train.MicroBatch, fine.Train.Recompute
	if asFine != fine {
		t.Errorf("moe-large differs from moe-fine beyond layers, batch and recompute:\n%+v\n%+v", asFine, fine)
	}
	dev, err := plan.NamedDevice("h200")
	if err != nil {
		t.Fatal(err)
	}
	var peaks []int64
	for _, rc := range []string{engine.RecomputeFull, engine.RecomputeSelective, engine.RecomputeNone} {
		c := large
		c.Train.Recompute = rc
		p, err := plan.New(engine.PlanConfig(c, 1, 1, false), dev)
		if err != nil {
			t.Fatal(err)
		}
		err = p.Check()
		t.Logf("recompute %s: peak %s of %s", rc, plan.FormatBytes(p.Peak), plan.FormatBytes(dev.Memory))
		peaks = append(peaks, p.Peak)
		switch {
		case rc == engine.RecomputeFull && (err != nil || p.Peak > dev.Memory/100*95):
			t.Errorf("recompute full: peak %s of %s: %v", plan.FormatBytes(p.Peak), plan.FormatBytes(dev.Memory), err)
		case rc == engine.RecomputeNone && (err == nil || !strings.Contains(err.Error(), "train.recompute: ")):
			t.Errorf("recompute none: %v; want a refusal that offers train.recompute", err)
		}
	}
	if !(peaks[0] < peaks[1] && peaks[1] < peaks[2]) {
		t.Errorf("the peaks of full, selective and none are %v; want them rising", peaks)
	}
}
