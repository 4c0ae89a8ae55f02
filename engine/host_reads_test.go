package engine

import (
	"context"
	"sync"
	"testing"

	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/backend"
)

// hostReads counts the calls that make the host wait for the backend's
// queue: Download, Sync and the reductions that return a value.
type hostReads struct {
	backend.Backend
	mu    sync.Mutex
	reads int
}

func (h *hostReads) count() {
	h.mu.Lock()
	h.reads++
	h.mu.Unlock()
}

// The queued reductions (backend.LaterReducer) are not waits for the
// queue: their functions wait for their own copies.
func (h *hostReads) SumLater(t backend.Tensor) func() float64 { return backend.SumLater(h.Backend, t) }
func (h *hostReads) SumSquaresLater(t backend.Tensor) func() float64 {
	return backend.SumSquaresLater(h.Backend, t)
}

func (h *hostReads) Download(t backend.Tensor) *tensor.Dense { h.count(); return h.Backend.Download(t) }
func (h *hostReads) Sync() error                             { h.count(); return h.Backend.Sync() }
func (h *hostReads) Sum(t backend.Tensor) float64            { h.count(); return h.Backend.Sum(t) }
func (h *hostReads) SumSquares(t backend.Tensor) float64     { h.count(); return h.Backend.SumSquares(t) }

// readsPerStep runs cfg and returns the host reads of each step after the
// first (which builds and measures what later steps reuse).
func readsPerStep(t *testing.T, cfg Config) []int {
	t.Helper()
	counter := &hostReads{}
	var perStep []int
	last := 0
	eng, err := New(cfg, WithBackendWrapper(func(b backend.Backend) backend.Backend {
		counter.Backend = b
		return counter
	}), WithHook(func(ev StepEvent) {
		counter.mu.Lock()
		if ev.Step > 1 {
			perStep = append(perStep, counter.reads-last)
		}
		last = counter.reads
		counter.mu.Unlock()
	}))
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	if _, err := eng.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	return perStep
}

// TestHostReadsDoNotGrowWithLayers checks #28's "no host round trips in
// the step" where the engine can: on one expert rank, dropless, a
// training step waits for the backend the same number of times whatever
// the number of layers (the loss, the MoE statistics of all layers at
// once, the gradient norm), not once per layer. The MoE layers' counts
// reach the host by queued downloads (Backend.StartDownload), which are
// not waits for the whole queue; with either dispatcher and every
// recompute setting, and with aux-loss-free balancing, whose biases the
// host keeps (moe.UpdateBias) instead of reading them every step.
func TestHostReadsDoNotGrowWithLayers(t *testing.T) {
	for _, c := range []struct {
		dispatcher, recompute string
		biasRate              float64
	}{
		{"unfused", RecomputeNone, 0}, {"fused", RecomputeNone, 0}, {"fused", RecomputeSelective, 0}, {"unfused", RecomputeFull, 0},
		{"fused", RecomputeNone, 1e-3},
	} {
		name := c.dispatcher + "/" + c.recompute
		if c.biasRate > 0 {
			name += "/bias"
		}
		t.Run(name, func(t *testing.T) {
			var got [2][]int
			for i, layers := range []int{2, 5} {
				cfg := planConfig()
				cfg.Model.Layers = layers
				cfg.Model.MoE.Dispatcher = c.dispatcher
				cfg.Model.MoE.BiasUpdateRate = c.biasRate
				cfg.Train.Recompute = c.recompute
				cfg.Train.Steps = 3
				cfg.Train.GradClip = 1
				got[i] = readsPerStep(t, cfg)
			}
			requireSameReads(t, got, "with 2 layers", "with 5")
		})
	}
}

// opOrder records, in order, the AdamW updates, the waits for the
// device's queue and the embedding lookups that start each forward.
type opOrder struct {
	backend.Backend
	mu  sync.Mutex
	ops []string
}

func (o *opOrder) add(op string) { o.mu.Lock(); o.ops = append(o.ops, op); o.mu.Unlock() }

func (o *opOrder) AdamWUpdate(p, g, m, v backend.Tensor, h backend.AdamW) {
	o.add("adamw")
	o.Backend.AdamWUpdate(p, g, m, v, h)
}
func (o *opOrder) AdamWUpdateSplit(hi, lo, g, m, v backend.Tensor, h backend.AdamW) {
	o.add("adamw")
	o.Backend.AdamWUpdateSplit(hi, lo, g, m, v, h)
}
func (o *opOrder) EmbeddingForward(out, table, ids backend.Tensor) {
	o.add("forward")
	o.Backend.EmbeddingForward(out, table, ids)
}
func (o *opOrder) Download(t backend.Tensor) *tensor.Dense {
	o.add("wait")
	return o.Backend.Download(t)
}
func (o *opOrder) Sync() error                         { o.add("wait"); return o.Backend.Sync() }
func (o *opOrder) Sum(t backend.Tensor) float64        { o.add("wait"); return o.Backend.Sum(t) }
func (o *opOrder) SumSquares(t backend.Tensor) float64 { o.add("wait"); return o.Backend.SumSquares(t) }

// TestStepDoesNotWaitForOptimizer: after a step queues its AdamW, nothing
// waits for the device before the next forward is queued (rank.trainStep
// returns without a Sync), so the host prepares the next step while the
// device runs the optimizer; with aux-loss-free balancing too.
func TestStepDoesNotWaitForOptimizer(t *testing.T) {
	for _, rate := range []float64{0, 1e-3} {
		cfg := planConfig()
		cfg.Model.MoE.BiasUpdateRate = rate
		cfg.Train.Steps = 4
		cfg.Train.GradClip = 1
		order := &opOrder{}
		eng, err := New(cfg, WithBackendWrapper(func(b backend.Backend) backend.Backend {
			order.Backend = b
			return order
		}), WithHook(func(StepEvent) { order.add("step") }))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := eng.Run(context.Background()); err != nil {
			t.Fatal(err)
		}
		eng.Close()
		steps, updates, afterUpdate := 0, 0, false
		for i, op := range order.ops {
			switch op {
			case "step":
				steps++
			case "adamw":
				updates++
				afterUpdate = true
			case "forward":
				afterUpdate = false
			case "wait":
				// The first step's bias update reads the biases, once.
				if afterUpdate && !(rate > 0 && steps == 0) {
					t.Fatalf("bias rate %g, step %d: op %d waits for the device between an AdamW update and the next forward: %v", rate, steps+1, i, order.ops)
				}
			}
		}
		if updates == 0 || steps != cfg.Train.Steps {
			t.Fatalf("bias rate %g: %d AdamW updates over %d steps among %v", rate, updates, steps, order.ops)
		}
	}
}

// TestHostReadsDoNotGrowWithMicroBatches: a step of four micro-batches
// waits for the backend as often as a step of one: each micro-batch's loss
// sum and MoE statistics are queued behind its backward and read after the
// last one's, so the device goes from one micro-batch to the next without
// waiting for the host.
func TestHostReadsDoNotGrowWithMicroBatches(t *testing.T) {
	var got [2][]int
	for i, micro := range []int{4, 1} {
		cfg := planConfig()
		cfg.Train.GlobalBatch, cfg.Train.MicroBatch = 4, micro
		cfg.Train.Steps = 3
		cfg.Train.GradClip = 1
		got[i] = readsPerStep(t, cfg)
	}
	requireSameReads(t, got, "in one micro-batch", "in four")
}

// requireSameReads fails unless two runs' steps (readsPerStep, from step
// 2 on) waited for the backend as often, step by step; first and second
// say how each run was made.
func requireSameReads(t *testing.T, got [2][]int, first, second string) {
	t.Helper()
	if len(got[0]) == 0 || len(got[0]) != len(got[1]) {
		t.Fatalf("steps counted: %v and %v", got[0], got[1])
	}
	for s := range got[0] {
		if got[0][s] != got[1][s] {
			t.Errorf("step %d waited for the backend %d times %s and %d %s; want the same", s+2, got[0][s], first, got[1][s], second)
		}
	}
}
