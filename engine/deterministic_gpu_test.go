package engine

// train.deterministic on the GPU: the same run twice gives the same losses
// bit for bit. It skips, with one line, where there is no GPU;
// scripts/gpu-test.sh runs it on a GPU machine.

import (
	"math"
	"testing"

	"github.com/mktrain/mktrain/moe"
)

// deterministicConfig is a model large enough that the GPU's atomics race
// (many tokens per embedding row and per combined row): 4 layers of width
// 512, 8 experts top-2, 8 sequences of 512 byte-level tokens a step.
func deterministicConfig() Config {
	cfg := DefaultConfig()
	cfg.Model.Dim, cfg.Model.Layers, cfg.Model.Heads, cfg.Model.KVHeads = 512, 4, 8, 4
	cfg.Model.MoE = moe.Config{Experts: 8, TopK: 2, FFN: 1024, AuxLossCoef: 0.01, Dispatcher: moe.DispatcherAuto}
	cfg.Train.Backend, cfg.Train.GlobalBatch, cfg.Train.MicroBatch, cfg.Train.Seq = "cuda", 8, 8, 512
	cfg.Train.Steps, cfg.Train.WarmupSteps, cfg.Train.EvalEvery = 100, 2, 0
	return cfg
}

func TestDeterministicGPURunsRepeat(t *testing.T) {
	openGPU(t) // skips without a GPU
	const steps = 12
	cfg := deterministicConfig()
	cfg.Train.Deterministic = true
	first, _ := runSteps(t, cfg, nil, steps)
	second, _ := runSteps(t, cfg, nil, steps)
	for i := range first {
		if math.Float64bits(first[i]) != math.Float64bits(second[i]) {
			t.Errorf("train.deterministic: step %d's loss is %.9g in the first run, %.9g in the second", i+1, first[i], second[i])
		}
	}
	// Without it the atomics' order varies; say by how much (not checked:
	// two runs may happen to agree).
	cfg.Train.Deterministic = false
	a, _ := runSteps(t, cfg, nil, steps)
	b, _ := runSteps(t, cfg, nil, steps)
	worst := 0.0
	for i := range a {
		worst = max(worst, math.Abs(a[i]-b[i])/math.Abs(a[i]))
	}
	t.Logf("figure: engine repeated-run loss max relative difference without train.deterministic = %.3g ratio", worst)
}

// TestRecomputeCUDA: train.recompute: selective reruns the attention core
// and the experts' gate/up products in the backward instead of keeping
// their outputs, and full reruns each layer's whole forward; under
// train.deterministic (the unfused dispatcher, no float atomics) the
// reruns give the kept values' bits, so the losses of the three settings
// are equal bit for bit on the GPU as on the CPU (recompute_test.go).
func TestRecomputeCUDA(t *testing.T) {
	openGPU(t) // skips without a GPU
	const steps = 8
	cfg := deterministicConfig()
	cfg.Train.Deterministic = true
	kept, _ := runSteps(t, cfg, nil, steps)
	for _, mode := range []string{RecomputeSelective, RecomputeFull} {
		cfg.Train.Recompute = mode
		recomputed, _ := runSteps(t, cfg, nil, steps)
		for i := range kept {
			if math.Float64bits(kept[i]) != math.Float64bits(recomputed[i]) {
				t.Errorf("train.recompute: %s: step %d's loss is %.9g, %.9g with none", mode, i+1, recomputed[i], kept[i])
			}
		}
	}
}
