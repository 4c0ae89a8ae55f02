package engine

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/plan"
)

// liveBytes counts the bytes of the tensors a backend has allocated that
// are still reachable: a tensor's bytes leave the count when the
// collector finds it unreachable, as the CUDA backend's memory goes back
// to its allocator. The CPU backend stores a bf16 tensor in its float
// type, and the count says so, unless bf16 asks for the two bytes a GPU
// holds it in (the bf16-operand backend, bf16Operands).
type liveBytes struct {
	backend.Backend
	bf16       bool
	mu         sync.Mutex
	live, peak int64
}

func (c *liveBytes) New(dt backend.DType, shape ...int) backend.Tensor {
	n := int64(1)
	for _, s := range shape {
		n *= int64(s)
	}
	size := int64(dtypeBytes(dt))
	if dt == backend.BFloat16 && !c.bf16 || dt == backend.Float32 || dt == backend.Float64 {
		size = int64(dtypeBytes(c.Backend.FloatType()))
	}
	bytes := max(n, 1) * size
	c.mu.Lock()
	c.live += bytes
	c.mu.Unlock()
	t := c.Backend.New(dt, shape...)
	runtime.AddCleanup(t.(*cpu.Tensor), func(n int64) {
		c.mu.Lock()
		c.live -= n
		c.mu.Unlock()
	}, bytes)
	return t
}

// settle collects the garbage until the count stops changing and keeps
// the largest count seen so.
func (c *liveBytes) settle() {
	last := int64(-1)
	for range 20 {
		runtime.GC()
		time.Sleep(2 * time.Millisecond)
		c.mu.Lock()
		now := c.live
		c.mu.Unlock()
		if now == last {
			break
		}
		last = now
	}
	c.mu.Lock()
	c.peak = max(c.peak, c.live)
	c.mu.Unlock()
}

// allocatedBytes runs cfg for its steps on the CPU (with bf16 operands
// where bf16 says, counted at two bytes) and returns the most bytes of
// live tensors after any step, and the engine's plan.
func allocatedBytes(t *testing.T, cfg Config, bf16 bool) (int64, plan.Plan) {
	t.Helper()
	counter := &liveBytes{bf16: bf16}
	eng, err := New(cfg, WithBackendWrapper(func(b backend.Backend) backend.Backend {
		counter.Backend = b
		if bf16 {
			counter.Backend = bf16Operands{b.(*cpu.Backend)}
		}
		return counter
	}), WithHook(func(StepEvent) { counter.settle() }))
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	p, err := eng.Plan()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	return counter.peak, p
}

// planConfig is a small model whose every tensor the plan must count.
func planConfig() Config {
	cfg := DefaultConfig()
	cfg.Train.Backend = "cpu"
	cfg.Model.Dim, cfg.Model.Heads, cfg.Model.KVHeads = 32, 4, 2
	cfg.Model.MoE.FFN, cfg.Model.MoE.Experts = 48, 4
	cfg.Train.GlobalBatch, cfg.Train.MicroBatch, cfg.Train.Seq = 4, 2, 32
	cfg.Train.Steps, cfg.Train.WarmupSteps, cfg.Train.EvalEvery, cfg.Train.EvalBatches = 2, 0, 0, 1
	return cfg
}

// TestPlanCountsEveryTensor builds models of several options and layouts
// on the CPU and compares the bytes they allocate with the plan's: equal
// where routing sizes nothing (one expert rank, or a capacity); with
// several expert ranks between the balanced estimate's reach and the
// routing bound. A buffer added to the model that the plan does not
// mirror fails this test.
func TestPlanCountsEveryTensor(t *testing.T) {
	cases := []struct {
		name  string
		set   func(*Config)
		exact bool
	}{
		{"one rank, unfused", func(c *Config) {}, true},
		// A GPU's bf16 operands (counted at two bytes): split masters,
		// bf16 q, k, v and normalised inputs, the operands' scratch.
		{"bf16 operands", func(c *Config) {}, true},
		{"bf16 operands, fused, recompute selective", func(c *Config) { c.Train.Recompute, c.Model.MoE.Dispatcher = RecomputeSelective, "fused" }, true},
		{"bf16 operands, recompute full", func(c *Config) { c.Train.Recompute = RecomputeFull }, true},
		{"bf16 operands, master weights fp32, optimizer in backward", func(c *Config) {
			c.Train.MasterWeights, c.Train.GradClip, c.Train.OptimizerInBackward, c.Train.MicroBatch = MasterWeightsFP32, 0, OptimizerInBackwardOn, 4
		}, true},
		{"bf16 operands, cp 2 ring", func(c *Config) { c.Parallel.CP, c.Parallel.CPAttention = 2, "ring" }, true},
		{"bf16 operands, tp 2, every expert", func(c *Config) { c.Parallel.TP, c.Parallel.SequenceParallel, c.Model.MoE.TopK = 2, true, 4 }, true},
		{"fused", func(c *Config) { c.Model.MoE.Dispatcher = "fused" }, true},
		// The recomputed activations held once per rank.
		{"recompute selective", func(c *Config) { c.Train.Recompute = RecomputeSelective }, true},
		{"recompute selective, fused", func(c *Config) { c.Train.Recompute, c.Model.MoE.Dispatcher = RecomputeSelective, "fused" }, true},
		{"recompute selective, cp 2", func(c *Config) { c.Train.Recompute, c.Parallel.CP = RecomputeSelective, 2 }, true},
		{"recompute selective, ep 2", func(c *Config) { c.Train.Recompute, c.Parallel.EP, c.Train.MicroBatch = RecomputeSelective, 2, 1 }, false},
		{"recompute selective, tp 2, every expert", func(c *Config) {
			c.Train.Recompute, c.Parallel.TP, c.Parallel.SequenceParallel, c.Model.MoE.TopK = RecomputeSelective, 2, true, 4
		}, true},
		// Under full every layer activation once per rank, the fused
		// dispatcher's exchanged rows per layer.
		{"recompute full", func(c *Config) { c.Train.Recompute = RecomputeFull }, true},
		{"recompute full, fused, shared experts, capacity", func(c *Config) {
			c.Train.Recompute, c.Model.MoE.Dispatcher = RecomputeFull, "fused"
			c.Model.MoE.SharedExperts, c.Model.MoE.CapacityFactor, c.Model.MoE.BiasUpdateRate = 1, 1.5, 1e-3
		}, true},
		{"recompute full, cp 2", func(c *Config) { c.Train.Recompute, c.Parallel.CP = RecomputeFull, 2 }, true},
		{"recompute full, cp 2 ring", func(c *Config) { c.Train.Recompute, c.Parallel.CP, c.Parallel.CPAttention = RecomputeFull, 2, "ring" }, true},
		{"recompute full, ep 2", func(c *Config) { c.Train.Recompute, c.Parallel.EP, c.Train.MicroBatch = RecomputeFull, 2, 1 }, false},
		{"recompute full, ep 2 fused", func(c *Config) {
			c.Train.Recompute, c.Parallel.EP, c.Train.MicroBatch, c.Model.MoE.Dispatcher = RecomputeFull, 2, 1, "fused"
		}, false},
		{"recompute full, tp 2, every expert", func(c *Config) {
			c.Train.Recompute, c.Parallel.TP, c.Parallel.SequenceParallel, c.Model.MoE.TopK = RecomputeFull, 2, true, 4
		}, true},
		{"shared experts, capacity, bias", func(c *Config) {
			c.Model.MoE.SharedExperts, c.Model.MoE.CapacityFactor, c.Model.MoE.BiasUpdateRate = 1, 1.5, 1e-3
		}, true},
		{"dp 2, zero 1", func(c *Config) { c.Parallel.DP, c.Parallel.Zero = 2, 1; c.Train.MicroBatch = 1 }, true},
		// One layer's expert gradients instead of every layer's.
		{"optimizer in backward", func(c *Config) {
			c.Train.GradClip, c.Train.OptimizerInBackward, c.Train.MicroBatch = 0, OptimizerInBackwardOn, 4
		}, true},
		{"optimizer in backward, ep 2, zero 1, recompute full", func(c *Config) {
			c.Train.GradClip, c.Train.OptimizerInBackward, c.Train.Recompute = 0, OptimizerInBackwardOn, RecomputeFull
			c.Parallel.EP, c.Parallel.Zero = 2, 1
			c.Train.MicroBatch = c.Train.GlobalBatch / 2
		}, false},
		{"optimizer in backward, tp 2, every expert", func(c *Config) {
			c.Train.GradClip, c.Train.OptimizerInBackward, c.Train.MicroBatch = 0, OptimizerInBackwardOn, 4
			c.Parallel.TP, c.Parallel.SequenceParallel, c.Model.MoE.TopK = 2, true, 4
		}, true},
		{"cp 2", func(c *Config) { c.Parallel.CP = 2 }, true},
		{"cp 2 ring", func(c *Config) { c.Parallel.CP, c.Parallel.CPAttention = 2, "ring" }, true},
		{"cp 4 ring, dp 2", func(c *Config) {
			c.Parallel.CP, c.Parallel.DP, c.Parallel.CPAttention = 4, 2, "ring"
			c.Train.MicroBatch = 1
		}, true},
		{"ep 2", func(c *Config) { c.Parallel.EP = 2; c.Train.MicroBatch = 1 }, false},
		{"ep 2 fused", func(c *Config) { c.Parallel.EP = 2; c.Train.MicroBatch = 1; c.Model.MoE.Dispatcher = "fused" }, false},
		// Tensor parallelism folds the experts over ep x tp ranks, so the
		// routed rows depend on routing as with ep 2, except where every
		// token chooses every expert (top_k = experts): exact then.
		{"tp 2", func(c *Config) { c.Parallel.TP, c.Parallel.SequenceParallel = 2, true }, false},
		{"tp 2, every expert", func(c *Config) { c.Parallel.TP, c.Parallel.SequenceParallel, c.Model.MoE.TopK = 2, true, 4 }, true},
		{"tp 2, sequence_parallel false, every expert", func(c *Config) {
			c.Parallel.TP, c.Parallel.SequenceParallel, c.Model.MoE.TopK = 2, false, 4
		}, true},
		{"tp 4, kv heads whole, shared experts, every expert", func(c *Config) {
			c.Parallel.TP, c.Parallel.SequenceParallel, c.Model.MoE.SharedExperts, c.Model.MoE.TopK = 4, true, 1, 4
		}, true},
		{"tp 2, dp 2, zero 1, every expert", func(c *Config) {
			c.Parallel.TP, c.Parallel.DP, c.Parallel.Zero, c.Parallel.SequenceParallel, c.Model.MoE.TopK = 2, 2, 1, true, 4
			c.Train.MicroBatch = 1
		}, true},
		{"tp 2, cp 2, every expert", func(c *Config) {
			c.Parallel.TP, c.Parallel.CP, c.Parallel.SequenceParallel, c.Model.MoE.TopK = 2, 2, false, 4
		}, true},
		// The fused path's slots (the CPU has no float atomics).
		{"tp 2, tp_overlap fused, every expert", func(c *Config) {
			c.Parallel.TP, c.Parallel.TPOverlap, c.Parallel.SequenceParallel, c.Model.MoE.TopK = 2, "fused", true, 4
		}, true},
		{"tp 4, tp_overlap fused, sequence_parallel false, every expert", func(c *Config) {
			c.Parallel.TP, c.Parallel.TPOverlap, c.Parallel.SequenceParallel, c.Model.MoE.TopK = 4, "fused", false, 4
		}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := planConfig()
			tc.set(&cfg)
			if err := cfg.Validate(); err != nil {
				t.Fatal(err)
			}
			got, p := allocatedBytes(t, cfg, strings.HasPrefix(tc.name, "bf16 operands"))
			planned := p.HostPeak - hostTransients(p) - rankTransients(p)
			if tc.exact && got != planned {
				t.Errorf("allocated %d bytes, the plan says %d (%+d)\n%s", got, planned, planned-got, termsText(p))
			}
			if !tc.exact {
				worst := p.Worst
				if got > worst || got < planned {
					t.Errorf("allocated %d bytes; the plan says %d balanced, %d at most\n%s", got, planned, worst, termsText(p))
				}
			}
		})
	}
}

// hostTransients is the part of a CPU plan's host peak that is not the
// tensors.
func hostTransients(p plan.Plan) int64 {
	peak := int64(0)
	for _, t := range p.Host {
		peak = max(peak, t.Bytes)
	}
	return peak
}

// rankTransients is the bytes of the rank's terms that an op allocates
// and drops within itself, gone by the end of a step.
func rankTransients(p plan.Plan) int64 {
	n := int64(0)
	for _, t := range p.Rank {
		if strings.HasSuffix(t.What, "(transient)") {
			n += t.Bytes
		}
	}
	return n
}

func termsText(p plan.Plan) string {
	var b strings.Builder
	for _, t := range p.Rank {
		b.WriteString(t.What + ": " + plan.FormatBytes(t.Bytes) + "\n")
	}
	return b.String()
}

// TestPlanRefusesBeforeAllocating is issue 32's item 2: values that pass
// validation but cannot fit the host (a vocabulary of 2e9, a width of
// 1e6, 1e8 layers) or cannot make a step (a global batch of 1e9) are
// refused by Run at once, as an InputError naming the fields, before any
// tensor is allocated.
func TestPlanRefusesBeforeAllocating(t *testing.T) {
	cases := []struct {
		name  string
		set   func(*Config)
		field string
	}{
		{"vocab", func(c *Config) { c.Model.Vocab = 2_000_000_000 }, "model.vocab"},
		{"dim", func(c *Config) { c.Model.Dim = 1_000_000 }, "model.dim"},
		{"global batch", func(c *Config) { c.Train.GlobalBatch = 1_000_000_000 }, "train.global_batch"},
		{"layers", func(c *Config) { c.Model.Layers = 100_000_000 }, "model.layers"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Train.Backend = "cpu"
			tc.set(&cfg)
			if err := cfg.Validate(); err != nil {
				t.Fatalf("the case must pass validation: %v", err)
			}
			counter := &allocCounter{}
			eng, err := New(cfg, WithBackendWrapper(func(b backend.Backend) backend.Backend {
				counter.Backend = b
				return counter
			}))
			if err != nil {
				t.Fatal(err)
			}
			defer eng.Close()
			start := time.Now()
			_, err = eng.Run(context.Background())
			var refusal *plan.Refusal
			if !errors.As(err, &refusal) || !IsInputError(err) {
				t.Fatalf("Run: %v; want an InputError around a *plan.Refusal", err)
			}
			if !strings.Contains(err.Error(), tc.field) {
				t.Errorf("refusal %q does not name %s", err, tc.field)
			}
			if n := counter.n.Load(); n != 0 {
				t.Errorf("%d tensors allocated before the refusal", n)
			}
			if d := time.Since(start); d > 2*time.Second {
				t.Errorf("the refusal took %v", d)
			}
		})
	}
}

// TestPlanCountsAsBench keeps the plan's parameter count and FLOPs per
// token those of ParamCount and ModelFLOPsPerToken (bench train's MFU).
func TestPlanCountsAsBench(t *testing.T) {
	for _, m := range []ModelConfig{DefaultConfig().Model, planConfig().Model} {
		m.MoE.SharedExperts = 1
		cfg := DefaultConfig()
		cfg.Model = m
		p, err := plan.New(PlanConfig(cfg, 0, 0, false), plan.Device{Name: "test", Backend: plan.BackendCPU, FloatBytes: 4, OperandBytes: 4})
		if err != nil {
			t.Fatal(err)
		}
		if p.Params.Total != int64(ParamCount(m)) {
			t.Errorf("plan: %d parameters, ParamCount %d", p.Params.Total, ParamCount(m))
		}
		if want := ModelFLOPsPerToken(m, cfg.Train.Seq); p.FLOPsPerToken != want {
			t.Errorf("plan: %g FLOPs per token, ModelFLOPsPerToken %g", p.FLOPsPerToken, want)
		}
	}
}
