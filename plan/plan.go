package plan

import (
	"fmt"
	"slices"
)

// Config is what the plan reads of a run: the model's shape, the batch
// and the parallel layout (engine.Config's fields of the same names; the
// engine fills it in, see engine.PlanFor). It must have passed the
// engine's validation: sizes positive, heads dividing dim, experts
// divisible by ep, seq a multiple of 2*cp.
type Config struct {
	Vocab, Dim, Layers, Heads, KVHeads int
	Experts, TopK, FFN, SharedExperts  int
	// CapacityFactor is model.moe.capacity_factor: 0 is dropless.
	CapacityFactor float64
	// BiasBalancing is model.moe.bias_update_rate > 0 (a bias vector per
	// layer).
	BiasBalancing bool
	// Dispatcher is model.moe.dispatcher: "fused", "unfused", or "auto"
	// (or ""), for which the plan takes the larger of the two.
	Dispatcher string
	// CPAttention is parallel.cp_attention: "ring", "allgather", or
	// "auto" (or ""), for which the plan takes the larger of the two when
	// cp > 1.
	CPAttention string
	// CPRingFused says mode ring runs the fused ring
	// (attention/ring_fused.go: the ranks share one process with peer
	// access and the backend's zigzag ops take the shape), which holds no
	// chunk in flight; else the portable ring's buffers are counted.
	CPRingFused bool
	// CPRingOnePass says the fused ring runs in one pass
	// (backend.ZigzagAttentionOnePass takes the shape, not under
	// train.deterministic): bf16 copies of q, k, v and da instead of the
	// two-pass dk/dv partials.
	CPRingOnePass bool
	// TPOverlap is parallel.tp_overlap as the tp groups will run it:
	// "fused" (tensorpar's fused ops: the groups offer peer access),
	// "unfused", or "auto" (or ""), for which the plan takes the larger,
	// fused, when tp > 1.
	TPOverlap string
	// Deterministic is train.deterministic: the fused reduce-scatter
	// lands its blocks in slots instead of adding atomically.
	Deterministic bool
	// Recompute is train.recompute: "none" (or "") keeps every layer's
	// activations; "selective" keeps the attention core's output and
	// log-sum-exp and the experts' hidden activations once per rank
	// instead of once per layer (attention.RecomputeCore,
	// moe.RecomputeExperts); "full" keeps every activation of a layer
	// once per rank (attention.RecomputeLayer, moe.RecomputeLayer), the
	// residual stream and the norms' inverse RMS still per layer.
	Recompute string
	// ExpertsInBackward says AdamW updates each layer's experts inside
	// the backward (train.optimizer_in_backward, as the engine settles
	// it: engine/expert_update.go), so the gradient store holds one
	// layer's expert gradients instead of every layer's.
	ExpertsInBackward bool
	// ExpertsInBackwardUnclipped says the experts would be updated in the
	// backward but for clipping (train.grad_clip above 0 is all that
	// stands in the way): the refusal's advice then offers grad_clip 0
	// where that makes the run fit.
	ExpertsInBackwardUnclipped bool
	// SplitMasters says the masters of the weights the products read are
	// split where the products multiply in bf16 (train.master_weights, as
	// the engine settles it: engine/master_split.go): their bf16 halves
	// are the operands, and their low halves are the rest of the masters,
	// instead of float32 masters and a bf16 copy.
	SplitMasters bool

	GlobalBatch, MicroBatch, Seq int
	DP, EP, CP, TP               int
	Zero                         int // parallel.zero
	// SequenceParallel is parallel.sequence_parallel (with TP above 1:
	// the residual stream on 1/TP of the rows).
	SequenceParallel bool

	// Checkpoints says the run saves checkpoints (it has a run
	// directory): the host then holds a snapshot at each save.
	Checkpoints bool

	// ProcessRanks is how many ranks this process trains (0: all of
	// them, as one process does). DeviceRanks is how many of them share
	// one device: all of the process's as virtual ranks, 1 with a
	// device per rank (0: ProcessRanks).
	ProcessRanks, DeviceRanks int
}

// Device is where a rank's tensors live and what the plan mirrors.
type Device struct {
	// Name is the device in messages: "NVIDIA H200", "host memory".
	Name string
	// Backend is the backend whose allocations the plan mirrors: "cuda"
	// (size classes, bf16 operand copies, cuBLASLt's workspace) or
	// "cpu" (Go slices of the float type).
	Backend string
	// Memory is the bytes one device offers a run; 0 means unknown, and
	// the plan then gives no verdict on fitting.
	Memory int64
	// FloatBytes and OperandBytes are the sizes of the backend's float
	// type and of its products' operand type: 4 and 2 on the GPU (fp32,
	// bf16), 4 and 4 on the CPU (8 and 8 for a float64 CPU backend).
	FloatBytes, OperandBytes int
	// PeakFLOPs is the device's dense bf16 peak (for a step-time bound);
	// 0 when unknown.
	PeakFLOPs float64
	// FineClassesAbove is the block size above which the CUDA
	// allocator's size classes step by 1/64 of a power of two instead of
	// 1/8 (CUDAFineClassesAbove, as CUDADevice sets it). 0 rounds every
	// block in eighths, as the allocator did before it had the finer
	// classes: the peaks measured then (bench results that record no
	// allocator_fine_classes_above) compare with a plan made so.
	FineClassesAbove int64
}

// Kind is a class of memory in the plan.
type Kind string

const (
	Weights     Kind = "weights"     // fp32 masters and the bf16 copy the products read
	Gradients   Kind = "gradients"   // fp32 gradient store
	Optimizer   Kind = "optimizer"   // AdamW's m and v
	Activations Kind = "activations" // what a forward keeps for its backward
	Workspace   Kind = "workspace"   // scratch of the backward, dispatch, products, collectives
	Host        Kind = "host"        // host memory besides a CPU run's tensors
)

// Term is one line of the plan: the bytes of one kind of memory for one
// part of the model. Worst differs from Bytes only for the routed rows of
// the MoE layers with more than one expert rank: Bytes assumes balanced
// routing, Worst the most rows routing can send one rank.
type Term struct {
	Kind  Kind   `json:"kind"`
	What  string `json:"what"`
	Bytes int64  `json:"bytes"`
	Worst int64  `json:"worst_bytes"`
}

// Params counts the model's parameters.
type Params struct {
	Total  int64 `json:"total"`  // every parameter, all experts
	Active int64 `json:"active"` // those one token's forward multiplies by: top-k experts, no embedding table
	Rank   int64 `json:"rank"`   // those one rank holds: the replicated ones and its experts
}

// Plan is the memory and compute a run needs, per rank and per device.
type Plan struct {
	Config Config `json:"config"`
	Device Device `json:"device"`
	Params Params `json:"params"`
	// FLOPsPerToken is what bench train divides by to get MFU: 6 per
	// active parameter plus causal attention (FLOPsPerToken).
	FLOPsPerToken float64 `json:"flops_per_token"`
	TokensPerStep int64   `json:"tokens_per_step"`
	// MicroBatches is how many forward/backward passes each rank runs per
	// optimizer step (train.global_batch / (micro_batch * dp*ep)).
	MicroBatches int64 `json:"micro_batches_per_step"`
	// Rank is one rank's device memory; Shared what the ranks on one
	// device share (the products' workspace). Host is the process's host
	// memory besides the tensors (on the CPU, its tensors are Rank).
	Rank   []Term `json:"rank"`
	Shared []Term `json:"shared"`
	Host   []Term `json:"host"`
	// DeviceRanks is how many ranks share one device; Peak and Worst are
	// one device's bytes: DeviceRanks times the rank's terms plus the
	// shared ones, with balanced routing and with the routing bound.
	DeviceRanks int   `json:"device_ranks"`
	Peak        int64 `json:"peak_bytes"`
	Worst       int64 `json:"worst_bytes"`
	// HostPeak is the process's host memory at its highest: on the CPU
	// its tensors and the larger of its transients (initialisation, a
	// checkpoint's snapshot); on the GPU the transients alone.
	HostPeak int64 `json:"host_peak_bytes"`
}

// New computes the plan of c on d. It does not judge whether the run
// fits: Check does.
func New(c Config, d Device) (Plan, error) {
	if err := c.check(); err != nil {
		return Plan{}, err
	}
	if d.FloatBytes <= 0 || d.OperandBytes <= 0 {
		return Plan{}, fmt.Errorf("plan: device %q has float and operand sizes %d and %d bytes; both must be positive", d.Name, d.FloatBytes, d.OperandBytes)
	}
	if d.Backend != BackendCUDA && d.Backend != BackendCPU {
		return Plan{}, fmt.Errorf("plan: device %q has backend %q; the plan mirrors %q and %q", d.Name, d.Backend, BackendCPU, BackendCUDA)
	}
	c = c.withDefaults()
	p := Plan{Config: c, Device: d, DeviceRanks: c.DeviceRanks}
	p.Params = countParams(c)
	p.FLOPsPerToken = flopsPerToken(c, p.Params)
	p.TokensPerStep = mul(int64(c.GlobalBatch), int64(c.Seq))
	p.MicroBatches = int64(c.GlobalBatch) / max(1, mul(int64(c.MicroBatch), int64(c.DP), int64(c.EP)))

	s := newShape(c, d)
	// auto settles on either at run time: plan for the larger.
	dispatchers := []string{DispatcherUnfused, DispatcherFused}
	if c.Dispatcher == DispatcherFused || c.Dispatcher == DispatcherUnfused {
		dispatchers = []string{c.Dispatcher}
	}
	cpModes := []string{CPAllGather, CPRing}
	if c.CPAttention == CPAllGather || c.CPAttention == CPRing {
		cpModes = []string{c.CPAttention}
	}
	for i, dispatcher := range dispatchers {
		for j, cpMode := range cpModes {
			terms := rankTerms(s, dispatcher, cpMode)
			if i+j == 0 || total(terms, false) > total(p.Rank, false) {
				p.Rank = terms
			}
		}
	}
	p.Shared = sharedTerms(s)
	p.Host = hostTerms(s, p.Params, c.Checkpoints)
	ranks := int64(c.DeviceRanks)
	p.Peak = add(mul(ranks, total(p.Rank, false)), total(p.Shared, false))
	p.Worst = add(mul(ranks, total(p.Rank, true)), total(p.Shared, true))
	p.HostPeak = hostPeak(p.Host)
	if d.Backend == BackendCPU {
		// The CPU's tensors are host memory: every rank of the process.
		p.HostPeak = add(mul(int64(c.ProcessRanks), total(p.Rank, false)), total(p.Shared, false), p.HostPeak)
	}
	return p, nil
}

// The backends and dispatchers the plan knows.
const (
	BackendCPU  = "cpu"
	BackendCUDA = "cuda"

	DispatcherFused    = "fused"
	DispatcherUnfused  = "unfused"
	CPAllGather        = "allgather" // parallel.cp_attention's modes (attention.CPMode)
	CPRing             = "ring"
	TPFused            = "fused" // parallel.tp_overlap's paths
	TPUnfused          = "unfused"
	RecomputeNone      = "none" // train.recompute's settings
	RecomputeSelective = "selective"
	RecomputeFull      = "full"
)

func (c Config) check() error {
	for _, f := range []struct {
		name string
		v    int
	}{
		{"model.vocab", c.Vocab}, {"model.dim", c.Dim}, {"model.layers", c.Layers}, {"model.heads", c.Heads},
		{"model.kv_heads", c.KVHeads}, {"model.moe.experts", c.Experts}, {"model.moe.top_k", c.TopK},
		{"model.moe.ffn", c.FFN}, {"train.global_batch", c.GlobalBatch}, {"train.micro_batch", c.MicroBatch},
		{"train.seq", c.Seq}, {"parallel.dp", c.DP}, {"parallel.ep", c.EP}, {"parallel.cp", c.CP}, {"parallel.tp", c.TP},
	} {
		if f.v <= 0 {
			return fmt.Errorf("plan: %s is %d; the plan needs a validated recipe (every size positive)", f.name, f.v)
		}
	}
	switch {
	case c.Dim%c.Heads != 0 || c.Heads%c.KVHeads != 0:
		return fmt.Errorf("plan: model.heads (%d) must divide model.dim (%d) and model.kv_heads (%d) model.heads", c.Heads, c.Dim, c.KVHeads)
	case c.Experts%c.EP != 0:
		return fmt.Errorf("plan: parallel.ep (%d) must divide model.moe.experts (%d)", c.EP, c.Experts)
	case c.CP > 1 && c.Seq%(2*c.CP) != 0:
		return fmt.Errorf("plan: train.seq (%d) must be a multiple of 2 x parallel.cp (%d)", c.Seq, c.CP)
	case c.SharedExperts < 0 || c.CapacityFactor < 0:
		return fmt.Errorf("plan: model.moe.shared_experts (%d) and capacity_factor (%g) cannot be negative", c.SharedExperts, c.CapacityFactor)
	case c.Recompute != "" && c.Recompute != RecomputeNone && c.Recompute != RecomputeSelective && c.Recompute != RecomputeFull:
		return fmt.Errorf("plan: train.recompute is %q; the plan knows %q, %q and %q", c.Recompute, RecomputeNone, RecomputeSelective, RecomputeFull)
	}
	return nil
}

func (c Config) withDefaults() Config {
	world := c.DP * c.EP * c.CP * c.TP
	if c.ProcessRanks <= 0 {
		c.ProcessRanks = world
	}
	if c.DeviceRanks <= 0 {
		c.DeviceRanks = c.ProcessRanks
	}
	return c
}

// total sums terms' Bytes, or their Worst.
func total(terms []Term, worst bool) int64 {
	s := int64(0)
	for _, t := range terms {
		if worst {
			s = add(s, t.Worst)
		} else {
			s = add(s, t.Bytes)
		}
	}
	return s
}

// Total is the sum of the terms' bytes of kind k (all kinds when k is
// ""), per rank.
func (p Plan) Total(k Kind) int64 {
	s := int64(0)
	for _, t := range p.Rank {
		if k == "" || t.Kind == k {
			s = add(s, t.Bytes)
		}
	}
	return s
}

// Kinds lists the kinds of the rank's terms, in the plan's order.
func (p Plan) Kinds() []Kind {
	var ks []Kind
	for _, t := range p.Rank {
		if !slices.Contains(ks, t.Kind) {
			ks = append(ks, t.Kind)
		}
	}
	return ks
}
