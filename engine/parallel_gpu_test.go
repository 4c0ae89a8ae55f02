package engine

// The layouts of TestVirtualRanksMatchOneRank trained on the CUDA backend:
// as virtual ranks of one GPU, every rank's tensors in its memory and the
// collectives running as device copies and kernels; and, where the machine
// has several GPUs, one rank per GPU with NCCL between them. The tests skip,
// with one line, where there is no GPU (or one, for the second);
// scripts/gpu-test.sh runs them on a GPU machine.

import (
	"context"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/cuda"
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
// the configured one. With b nil the engine opens its backend itself
// (train.backend), and so places a layout's ranks one per GPU where there
// are enough.
func trainOn(t *testing.T, cfg Config, b backend.Backend, layout string) layoutRun {
	t.Helper()
	var run layoutRun
	var rates []float64
	opts := []Option{withCUDA(), WithHook(func(ev StepEvent) {
		run.losses = append(run.losses, ev.Loss)
		if ev.Step > 2 {
			rates = append(rates, ev.TokensPerSec)
		}
	})}
	name := "its own " + cfg.Train.Backend + " backend"
	if b != nil {
		name = b.Name()
		opts = append(opts, WithBackend(b))
	}
	eng, err := New(cfg, opts...)
	if err != nil {
		t.Fatalf("%s on %s: New: %v", layout, name, err)
	}
	defer eng.Close()
	if _, err := eng.Run(context.Background()); err != nil {
		t.Fatalf("%s on %s: Run: %v", layout, name, err)
	}
	if len(run.losses) != cfg.Train.Steps {
		t.Fatalf("%s on %s: %d losses, want one per step (%d)", layout, name, len(run.losses), cfg.Train.Steps)
	}
	for i, l := range run.losses {
		if math.IsNaN(l) || math.IsInf(l, 0) {
			t.Fatalf("%s on %s: step %d loss is %v", layout, name, i+1, l)
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
	if err := unsupported(cuda.NewDriver(cuda.Options{}), base); err != nil {
		t.Fatalf("the equivalence model does not fit the CUDA kernels: %v", err)
	}
	layoutsMatchOneRank(t, gpu, "CUDA", 4)
}

// TestLayoutsOnGPUs is TestVirtualRanksCUDA with one rank per GPU: the
// engine opens the GPUs itself, so each layout whose world the machine's
// GPUs cover trains with NCCL between its ranks (the parallel runtime's
// equivalence on real GPUs). It skips with fewer than 2 GPUs.
func TestLayoutsOnGPUs(t *testing.T) {
	gpuList(t, 2) // skips with fewer than 2 GPUs
	n, err := cuda.VisibleGPUs(cuda.Options{})
	if err != nil {
		t.Fatal(err)
	}
	layoutsMatchOneRank(t, nil, "GPUs", n)
}

// layoutsMatchOneRank is TestVirtualRanksCUDA's body on the backend b
// (nil: the engine opens the GPUs itself, one per rank), called name in
// messages and figures, for the layouts of at most maxWorld ranks.
func layoutsMatchOneRank(t *testing.T, b backend.Backend, name string, maxWorld int) {
	t.Helper()
	config := func() Config {
		cfg := equivalenceConfig()
		if b == nil {
			cfg.Train.Backend = "cuda"
		}
		return cfg
	}
	base := config()
	base.Train.MicroBatch = 8
	one := trainOn(t, base, b, "dp1 ep1")
	cpuBase := base
	cpuBase.Train.Backend = "cpu"
	cpuRun := trainOn(t, cpuBase, cpu.New(backend.Float32), "dp1 ep1")
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
		if l.dp*l.ep*l.cp > maxWorld {
			continue
		}
		layout := fmt.Sprintf("dp%d ep%d", l.dp, l.ep)
		if l.cp > 1 {
			layout += fmt.Sprintf(" cp%d", l.cp) // the figures of the others keep their names
		}
		cfg := config()
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
