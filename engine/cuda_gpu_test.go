package engine

// The engine on the GPU: the tiny recipe trained on the CUDA backend and on
// the CPU from the same initialisation and batches. It skips, with one line,
// where there is no GPU; scripts/gpu-test.sh runs it on a GPU machine.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/cuda"
	"github.com/mktrain/mktrain/moe"
)

// cudaVsCPUTol bounds the relative difference of the two runs' losses: the
// GPU multiplies matrices in bf16, so the runs drift apart at about bf16's
// precision.
const cudaVsCPUTol = 2e-2

// tinyRecipeConfig is recipes/tiny.yaml (engine cannot import recipes):
// DefaultConfig's model with the recipe's batch and schedule.
func tinyRecipeConfig() Config {
	cfg := DefaultConfig()
	cfg.Train.GlobalBatch, cfg.Train.MicroBatch, cfg.Train.Seq = 16, 16, 64
	cfg.Train.Steps, cfg.Train.LR, cfg.Train.MinLR, cfg.Train.WarmupSteps = 300, 3e-3, 3e-4, 20
	return cfg
}

// runSteps trains cfg on b for its first steps (stopping the run there, so
// the schedule is the recipe's) and returns the losses and the median
// tokens/s of the steps after the first two (which compile and warm up).
// With b nil the engine opens its backend itself (train.backend), and so
// places a layout's ranks one per GPU where there are enough.
func runSteps(t *testing.T, cfg Config, b backend.Backend, steps int) (losses []float64, tokensPerSec float64) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var rates []float64
	name := "its own " + cfg.Train.Backend + " backend"
	opts := []Option{withCUDA()}
	if b != nil {
		name = b.Name()
		opts = append(opts, WithBackend(b))
	}
	eng, err := New(cfg, append(opts, WithHook(func(ev StepEvent) {
		losses = append(losses, ev.Loss)
		if ev.Step > 2 {
			rates = append(rates, ev.TokensPerSec)
		}
		if ev.Step == steps {
			cancel()
		}
	}))...)
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	if _, err := eng.Run(ctx); !errors.Is(err, ErrStopped) {
		t.Fatalf("run on %s: %v, want ErrStopped after step %d", name, err, steps)
	}
	if len(losses) != steps {
		t.Fatalf("%d losses on %s, want %d", len(losses), name, steps)
	}
	slices.Sort(rates)
	return losses, rates[len(rates)/2]
}

func TestTinyRecipeCUDAMatchesCPU(t *testing.T) {
	gpu := openGPU(t)
	const steps = 20
	cfg := tinyRecipeConfig()
	want, cpuRate := runSteps(t, cfg, cpu.New(backend.Float32), steps)
	got, gpuRate := runSteps(t, cfg, gpu, steps)
	worst := 0.0
	for i := range want {
		rel := math.Abs(got[i]-want[i]) / math.Abs(want[i])
		worst = max(worst, rel)
		t.Logf("step %2d: loss %.5f on CUDA, %.5f on the CPU (relative difference %.2e)", i+1, got[i], want[i], rel)
		if !(rel <= cudaVsCPUTol) {
			t.Errorf("step %d: loss %.5f on CUDA, %.5f on the CPU: relative difference %.3g > %g", i+1, got[i], want[i], rel, cudaVsCPUTol)
		}
	}
	if want[steps-1] >= want[0] {
		t.Errorf("the CPU loss did not fall: %.4f -> %.4f", want[0], want[steps-1])
	}
	t.Logf("figure: engine tiny loss max relative difference CUDA vs CPU = %.3g ratio", worst)
	t.Logf("figure: engine tiny tokens/s CUDA = %.4g tokens/s", gpuRate)
	t.Logf("figure: engine tiny tokens/s CPU float32 = %.4g tokens/s", cpuRate)
}

// openGPU opens the first GPU for a test and closes it when the test ends;
// without a GPU the test skips with one line saying why.
func openGPU(t *testing.T) *cuda.Backend {
	t.Helper()
	gpu, err := cuda.OpenBackend(cuda.Options{})
	if cuda.NoGPU(err) {
		reason, _, _ := strings.Cut(err.Error(), "\n")
		t.Skip("no GPU: " + strings.TrimSuffix(reason, "; looked in:"))
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := gpu.Close(); err != nil {
			t.Error(err)
		}
	})
	return gpu
}

// TestDispatchersOnGPUs is TestDispatchersCUDA with one rank per GPU (2
// to 4 GPUs, opened by the engine): fused, where the expert group's NCCL
// communicators offer peer access and the fused kernels read and write
// the peers' rows on their GPUs, against unfused, whose rows cross in
// NCCL's all-to-all.
func TestDispatchersOnGPUs(t *testing.T) {
	gpuList(t, 2) // skips with fewer than 2 GPUs
	n, err := cuda.VisibleGPUs(cuda.Options{})
	if err != nil {
		t.Fatal(err)
	}
	n = min(n, 4)
	cfg := tinyRecipeConfig()
	cfg.Train.Backend = "cuda"
	cfg.Parallel.EP, cfg.Train.MicroBatch = n, 16/n
	layout := fmt.Sprintf("ep%d on %d GPUs", n, n)
	worst, fusedRate, unfusedRate := dispatchersAgree(t, cfg, nil, layout)
	t.Logf("figure: engine tiny %s loss max relative difference fused vs unfused = %.3g ratio", layout, worst)
	t.Logf("figure: engine tiny %s tokens/s fused = %.4g tokens/s", layout, fusedRate)
	t.Logf("figure: engine tiny %s tokens/s unfused = %.4g tokens/s", layout, unfusedRate)
}

// TestDispatchersCUDA trains 20 steps of the tiny recipe at ep = 1, 2 and 4
// (virtual ranks of one GPU) with each dispatcher and wants the same
// losses within bf16 tolerance: the fused kernels compute the same rows in
// the same order, but round their intermediates differently.
func TestDispatchersCUDA(t *testing.T) {
	gpu := openGPU(t)
	for _, l := range []struct{ ep, micro int }{{1, 16}, {2, 8}, {4, 4}} {
		cfg := tinyRecipeConfig()
		cfg.Parallel.EP, cfg.Train.MicroBatch = l.ep, l.micro
		worst, fusedRate, unfusedRate := dispatchersAgree(t, cfg, gpu, fmt.Sprintf("ep%d", l.ep))
		t.Logf("figure: engine tiny ep%d loss max relative difference fused vs unfused CUDA = %.3g ratio", l.ep, worst)
		t.Logf("figure: engine tiny ep%d tokens/s CUDA fused = %.4g tokens/s", l.ep, fusedRate)
		t.Logf("figure: engine tiny ep%d tokens/s CUDA unfused = %.4g tokens/s", l.ep, unfusedRate)
	}
}

// dispatchersAgree trains the first 20 steps of cfg on b (nil: the
// engine's own backend) with each dispatcher and fails the test, naming
// the layout, where a step's losses differ by more than virtualRanksTol
// or the fused run's loss did not fall. It returns the worst relative
// difference and each run's tokens/s.
func dispatchersAgree(t *testing.T, cfg Config, b backend.Backend, layout string) (worst, fusedRate, unfusedRate float64) {
	t.Helper()
	const steps = 20
	cfg.Model.MoE.Dispatcher = moe.DispatcherUnfused
	want, unfusedRate := runSteps(t, cfg, b, steps)
	cfg.Model.MoE.Dispatcher = moe.DispatcherFused
	got, fusedRate := runSteps(t, cfg, b, steps)
	for i := range want {
		rel := math.Abs(got[i]-want[i]) / math.Abs(want[i])
		worst = max(worst, rel)
		if !(rel <= virtualRanksTol) {
			t.Errorf("%s: step %d: loss %.6f fused, %.6f unfused: relative difference %.3g > %g",
				layout, i+1, got[i], want[i], rel, virtualRanksTol)
		}
	}
	if got[steps-1] >= got[0] {
		t.Errorf("%s fused: the loss did not fall: %.4f -> %.4f", layout, got[0], got[steps-1])
	}
	return worst, fusedRate, unfusedRate
}

// TestMemorySavingsCUDA trains the tiny recipe (without clipping, one
// micro-batch a step) on the GPU under train.deterministic with the
// experts updated after the backward and in it (train.optimizer_in_backward
// off and on), which must give the same losses bit for bit, and with
// float32 masters and a bf16 copy against split masters
// (train.master_weights fp32 and split), within virtualRanksTol (the
// operands differ at exact ties, which round away from zero).
func TestMemorySavingsCUDA(t *testing.T) {
	gpu := openGPU(t)
	const steps = 20
	cfg := tinyRecipeConfig()
	cfg.Train.GradClip, cfg.Train.Deterministic = 0, true
	cfg.Train.OptimizerInBackward, cfg.Train.MasterWeights = OptimizerInBackwardOff, MasterWeightsFP32
	want, _ := runSteps(t, cfg, gpu, steps)
	cfg.Train.OptimizerInBackward = OptimizerInBackwardOn
	inBackward, _ := runSteps(t, cfg, gpu, steps)
	if !slices.Equal(inBackward, want) {
		t.Errorf("experts updated in the backward: losses %v, want %v (after the backward) bit for bit", inBackward, want)
	}
	cfg.Train.MasterWeights = MasterWeightsSplit
	split, _ := runSteps(t, cfg, gpu, steps)
	worst := 0.0
	for i := range want {
		rel := math.Abs(split[i]-want[i]) / math.Abs(want[i])
		worst = max(worst, rel)
		if !(rel <= virtualRanksTol) {
			t.Errorf("split masters: step %d: loss %.6f, %.6f with float32 masters: relative difference %.3g > %g", i+1, split[i], want[i], rel, virtualRanksTol)
		}
	}
	t.Logf("figure: engine tiny loss max relative difference split vs float32 masters CUDA = %.3g ratio", worst)
}

// TestGPUStepWaitsDoNotGrowWithLayers is TestHostReadsDoNotGrowWithLayers
// on the GPU: a training step of the tiny model on one expert rank waits
// for the device's whole queue as often with 5 layers as with 2. On a
// Hopper GPU the grouped GEMM kernels also take the experts' shapes with
// device offsets (moe-small's and the tiny recipe's), so the forward does
// not wait for its counts at all (backend.Backend.ReadsGroupOffsets).
func TestGPUStepWaitsDoNotGrowWithLayers(t *testing.T) {
	gpu := openGPU(t)
	if gpu.Device().Info().Major == 9 {
		for _, s := range []struct{ n, k, groups int }{{2816, 1024, 8}, {1024, 2816, 8}, {128, 64, 4}, {64, 128, 4}} {
			if !gpu.ReadsGroupOffsets(s.n, s.k, s.groups) {
				t.Errorf("ReadsGroupOffsets(%d, %d, %d) is false on %s; the forward would wait for its counts", s.n, s.k, s.groups, gpu.Device().Info())
			}
		}
	}
	var got [2][]int
	for i, layers := range []int{2, 5} {
		cfg := tinyRecipeConfig()
		cfg.Train.Backend = "cuda"
		cfg.Model.Layers = layers
		cfg.Model.MoE.Dispatcher = moe.DispatcherFused
		cfg.Train.Steps, cfg.Train.WarmupSteps, cfg.Train.EvalEvery = 4, 0, 0
		counter := &hostReads{}
		last := 0
		eng, err := New(cfg, withCUDA(), WithBackendWrapper(func(b backend.Backend) backend.Backend {
			counter.Backend = b
			return counter
		}), WithHook(func(ev StepEvent) {
			counter.mu.Lock()
			if ev.Step > 1 {
				got[i] = append(got[i], counter.reads-last)
			}
			last = counter.reads
			counter.mu.Unlock()
		}))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := eng.Run(context.Background()); err != nil {
			t.Fatal(err)
		}
		if err := eng.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if len(got[0]) == 0 || !slices.Equal(got[0], got[1]) {
		t.Fatalf("waits per step after the first: %v with 2 layers, %v with 5; want the same", got[0], got[1])
	}
	t.Logf("figure: engine tiny waits for the GPU per step (2 layers, fused, after the first) = %d waits", got[0][len(got[0])-1])
}
