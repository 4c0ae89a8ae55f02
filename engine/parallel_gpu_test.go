package engine

// Virtual ranks on one GPU: the layouts of TestVirtualRanksMatchOneRank
// trained on the CUDA backend, every rank's tensors in the one GPU's memory
// and the collectives running as device copies and kernels. It skips, with
// one line, where there is no GPU; scripts/gpu-test.sh runs it on a GPU
// machine.

import (
	"context"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
)

// virtualRanksTol bounds the relative difference between a layout's losses
// and one rank's on the GPU. Both runs round the same matrices to bf16;
// they differ in fp32 summation order (the ranks' shares of the batch, the
// gradient reduce), which a few bf16 roundings amplify. The CPU version of
// this test holds 2e-4 in float32.
const virtualRanksTol = 2e-3

// layoutRun is one training run's loss per step and median throughput.
type layoutRun struct {
	losses       []float64
	tokensPerSec float64 // median over the steps after the first two
}

// trainOn trains cfg on b to the end (cfg.Train.Steps) and fails the test,
// naming the layout, when the run fails or reports a step count other than
// the configured one.
func trainOn(t *testing.T, cfg Config, b backend.Backend, layout string) layoutRun {
	t.Helper()
	var run layoutRun
	var rates []float64
	eng, err := New(cfg, WithBackend(b), WithHook(func(ev StepEvent) {
		run.losses = append(run.losses, ev.Loss)
		if ev.Step > 2 {
			rates = append(rates, ev.TokensPerSec)
		}
	}))
	if err != nil {
		t.Fatalf("%s on %s: New: %v", layout, b.Name(), err)
	}
	if _, err := eng.Run(context.Background()); err != nil {
		t.Fatalf("%s on %s: Run: %v", layout, b.Name(), err)
	}
	if len(run.losses) != cfg.Train.Steps {
		t.Fatalf("%s on %s: %d losses, want one per step (%d)", layout, b.Name(), len(run.losses), cfg.Train.Steps)
	}
	for i, l := range run.losses {
		if math.IsNaN(l) || math.IsInf(l, 0) {
			t.Fatalf("%s on %s: step %d loss is %v", layout, b.Name(), i+1, l)
		}
	}
	if len(rates) > 0 {
		slices.Sort(rates)
		run.tokensPerSec = rates[len(rates)/2]
	}
	return run
}

// TestVirtualRanksCUDA trains the same global batches on one rank and on 2
// and 4 virtual ranks sharing the GPU (equivalenceLayouts: ep=2, ep=4,
// dp=2 x ep=2, dp=2, cp=2, dp=2 x cp=2, ep=2 x cp=2) and requires each layout's loss sequence to follow one rank's within
// virtualRanksTol. One rank's GPU run is also held to the CPU's within
// cudaVsCPUTol, so that a GPU run that went wrong the same way at every
// layout still fails.
func TestVirtualRanksCUDA(t *testing.T) {
	gpu := openGPU(t)
	base := equivalenceConfig()
	if err := cudaUnsupported(base); err != nil {
		t.Fatalf("the equivalence model does not fit the CUDA kernels: %v", err)
	}
	layoutsMatchOneRank(t, gpu, "CUDA")
}

// layoutsMatchOneRank is TestVirtualRanksCUDA's body on the backend b,
// called name in messages and figures.
func layoutsMatchOneRank(t *testing.T, b backend.Backend, name string) {
	t.Helper()
	base := equivalenceConfig()
	base.Train.MicroBatch = 8
	one := trainOn(t, base, b, "dp1 ep1")
	cpuRun := trainOn(t, base, cpu.New(backend.Float32), "dp1 ep1")
	for i, want := range cpuRun.losses {
		if rel := math.Abs(one.losses[i]-want) / math.Abs(want); !(rel <= cudaVsCPUTol) {
			t.Errorf("dp1 ep1: step %d: loss %.6f on %s, %.6f on the CPU: relative difference %.3g > %g",
				i+1, one.losses[i], name, want, rel, cudaVsCPUTol)
		}
	}
	if one.losses[len(one.losses)-1] >= one.losses[0] {
		t.Errorf("dp1 ep1 on %s: the loss did not fall: %.4f -> %.4f", name, one.losses[0], one.losses[len(one.losses)-1])
	}
	t.Logf("figure: engine virtual ranks dp1 ep1 tokens/s %s = %.4g tokens/s", name, one.tokensPerSec)

	for _, l := range equivalenceLayouts {
		layout := fmt.Sprintf("dp%d ep%d", l.dp, l.ep)
		if l.cp > 1 {
			layout += fmt.Sprintf(" cp%d", l.cp) // the figures of the others keep their names
		}
		cfg := equivalenceConfig()
		cfg.Parallel.DP, cfg.Parallel.EP, cfg.Parallel.CP, cfg.Train.MicroBatch = l.dp, l.ep, l.cp, l.micro
		got := trainOn(t, cfg, b, layout)
		worst := 0.0
		for i, want := range one.losses {
			rel := math.Abs(got.losses[i]-want) / math.Abs(want)
			worst = max(worst, rel)
			if !(rel <= virtualRanksTol) {
				t.Errorf("%s (%d virtual ranks on %s): step %d: loss %.6f, one rank %.6f: relative difference %.3g > %g",
					layout, l.dp*l.ep*l.cp, name, i+1, got.losses[i], want, rel, virtualRanksTol)
			}
		}
		t.Logf("%s: loss %.5f -> %.5f, max relative difference from one rank %.2e", layout, got.losses[0], got.losses[len(got.losses)-1], worst)
		t.Logf("figure: engine virtual ranks %s tokens/s %s = %.4g tokens/s", layout, name, got.tokensPerSec)
	}
}
