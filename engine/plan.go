package engine

// The memory plan (package plan) of a run, checked before anything large
// is allocated: Run and RunDistributed refuse a run that cannot fit its
// device with a *plan.Refusal (an InputError), instead of an
// out-of-memory crash halfway through building the model.

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/registry"
	"github.com/mktrain/mktrain/moe"
	"github.com/mktrain/mktrain/plan"
	"github.com/mktrain/mktrain/tune"
)

// PlanConfig is the part of c the memory plan reads. processRanks and
// deviceRanks are the ranks one process trains and those that share one
// device (0: all, as virtual ranks of one process); checkpoints says the
// run writes checkpoints (a run directory).
func PlanConfig(c Config, processRanks, deviceRanks int, checkpoints bool) plan.Config {
	m, t, p := c.Model, c.Train, c.Parallel
	return plan.Config{
		Vocab: m.Vocab, Dim: m.Dim, Layers: m.Layers, Heads: m.Heads, KVHeads: m.KVHeads,
		Experts: m.MoE.Experts, TopK: m.MoE.TopK, FFN: m.MoE.FFN, SharedExperts: m.MoE.SharedExperts,
		CapacityFactor: m.MoE.CapacityFactor, BiasBalancing: m.MoE.BiasUpdateRate > 0, Dispatcher: m.MoE.Dispatcher,
		GlobalBatch: t.GlobalBatch, MicroBatch: t.MicroBatch, Seq: t.Seq,
		DP: p.DP, EP: p.EP, CP: p.CP, TP: p.TP, Zero: p.Zero, CPAttention: p.CPAttention, SequenceParallel: p.SequenceParallel,
		TPOverlap: p.TPOverlap, Deterministic: t.Deterministic, Recompute: t.Recompute,
		ExpertsInBackward: c.ExpertsUpdatedInBackward(), ExpertsInBackwardUnclipped: c.expertsInBackwardUnclipped(),
		SplitMasters: c.masterWeightsSplit(),
		Checkpoints:  checkpoints, ProcessRanks: processRanks, DeviceRanks: deviceRanks,
	}
}

// Plan is the memory plan of Run on the engine's backend: its device (the
// GPU the engine opened, with the memory the driver reports free plus what
// the backend holds; or the host's memory for the CPU backend) and the
// placement Run would choose (virtual ranks on the one device, or one
// rank per GPU when enough are visible).
func (e *Engine) Plan() (plan.Plan, error) {
	deviceRanks, err := e.ranksPerDevice()
	if err != nil {
		return plan.Plan{}, err
	}
	return e.plan(e.cfg.mesh().World(), deviceRanks)
}

// plan is the plan for processRanks ranks in this process, deviceRanks
// of them on each device.
func (e *Engine) plan(processRanks, deviceRanks int) (plan.Plan, error) {
	dev, err := e.planDevice()
	if err != nil {
		return plan.Plan{}, err
	}
	c := PlanConfig(e.cfg, processRanks, deviceRanks, e.runDir != "")
	c.Dispatcher = e.planDispatcher(processRanks, deviceRanks)
	c.CPAttention = e.planCPAttention(processRanks, deviceRanks)
	c.CPRingFused, c.CPRingOnePass = PlanRing(e.cfg, processRanks, deviceRanks, e.backend)
	c.TPOverlap = e.planTPOverlap(processRanks, deviceRanks)
	return plan.New(c, dev)
}

// planTPOverlap is the path the tensor-parallel groups will run where it
// can be known without measuring (resolveTPOverlap,
// tune.ResolveTPOverlap, and the groups' peer access): unfused with tp 1,
// under unfused, where the ranks are in several processes (no peer
// access), and for auto on the CPU, under train.deterministic and with a
// rank per device; fused under fused otherwise (one rank per GPU asks
// for peer access: placeOnDevices); for auto on virtual ranks the
// table's choice when it has this machine and shape; "" (the plan takes
// the larger, fused) when only a measurement would say.
func (e *Engine) planTPOverlap(processRanks, deviceRanks int) string {
	p, world := e.cfg.Parallel, e.cfg.mesh().World()
	switch {
	case p.TP < 2 || p.TPOverlap == plan.TPUnfused || processRanks < world:
		return plan.TPUnfused
	case p.TPOverlap == plan.TPFused:
		return plan.TPFused
	case e.backend.Name() == "cpu", e.cfg.Train.Deterministic, deviceRanks < processRanks:
		return plan.TPUnfused
	}
	cache, err := tune.DefaultTPOverlapCache()
	if err != nil {
		return ""
	}
	if entry, ok, err := cache.Lookup(tune.NewTPOverlapKey(e.backend, tpOverlapCase(e.cfg, true))); err == nil && ok {
		return entry.Choice
	}
	return ""
}

// ZigzagKernels is what a backend's fused ring takes: the
// ZigzagAttentionSupports and ZigzagAttentionOnePass of backend.Backend,
// or of a description of a GPU not at hand (cuda.HopperZigzag, for a plan
// of a named GPU).
type ZigzagKernels interface {
	ZigzagAttentionSupports(s backend.ZigzagShape) error
	ZigzagAttentionOnePass(s backend.ZigzagShape) error
}

// PlanRing says how mode ring would run context parallelism for c's
// processRanks ranks in one process, deviceRanks of them on each device,
// on a backend whose zigzag ops are zz: fused (attention/ring_fused.go)
// where the context groups offer peer access (every rank in this
// process, as virtual ranks of one device, or one per GPU where
// placeOnDevices asks for peer access) and zz takes the layer's shape;
// and then in one pass where zz's one-pass ops take it and the run is not
// deterministic (the backend refuses them under SetDeterministic; the
// config says so whether or not the backend has been told yet). The
// plan's CPRingFused and CPRingOnePass.
func PlanRing(c Config, processRanks, deviceRanks int, zz ZigzagKernels) (fused, onePass bool) {
	p := c.Parallel
	if p.CP < 2 || processRanks < c.mesh().World() || (deviceRanks < processRanks && p.CPAttention != plan.CPRing) {
		return false, false
	}
	s := rankZigzagShape(c)
	if zz.ZigzagAttentionSupports(s) != nil {
		return false, false
	}
	return true, !c.Train.Deterministic && zz.ZigzagAttentionOnePass(s) == nil
}

// rankZigzagShape is one context-parallel rank's zigzag attention shape.
func rankZigzagShape(c Config) backend.ZigzagShape {
	p, s := c.Parallel, rankAttentionShape(c)
	return backend.ZigzagShape{
		Ranks: p.CP, Batch: c.Train.MicroBatch, Chunk: c.Train.Seq / (2 * p.CP),
		Heads: s.Heads, KVHeads: s.KVHeads, HeadDim: s.HeadDim(),
	}
}

// planCPAttention is the parallel.cp_attention mode the run will settle
// on where it can be known without measuring (resolveCPAttention,
// tune.ResolveCPAttention): the recipe's, or for auto allgather with one
// context rank, on the CPU, under train.deterministic and where the ranks
// are not virtual ranks of one device, else the table's choice when it
// has this machine and shape; "" (the plan takes the larger of the two)
// when only a measurement would say.
func (e *Engine) planCPAttention(processRanks, deviceRanks int) string {
	p, world := e.cfg.Parallel, e.cfg.mesh().World()
	switch {
	case p.CPAttention == plan.CPRing || p.CPAttention == plan.CPAllGather:
		return p.CPAttention
	case p.CP == 1, e.backend.Name() == "cpu", e.cfg.Train.Deterministic, processRanks < world, deviceRanks < processRanks:
		return plan.CPAllGather
	}
	cache, err := tune.DefaultCPAttentionCache()
	if err != nil {
		return ""
	}
	key := tune.NewCPAttentionKey(e.backend, tune.CPAttentionCase{Shape: rankAttentionShape(e.cfg), Batch: e.cfg.Train.MicroBatch, Seq: e.cfg.Train.Seq, CP: p.CP})
	if entry, ok, err := cache.Lookup(key); err == nil && ok {
		return entry.Choice
	}
	return ""
}

// planDispatcher is the dispatcher the run will settle on where it can be
// known without measuring (resolveDispatcher, tune.ResolveDispatcher):
// the recipe's, or for auto unfused on the CPU, under train.deterministic
// and where the expert groups have no peer access (one rank per GPU
// without an explicit fused, several processes), else the table's choice when it has this
// machine and shape; "" (the plan takes the larger of the two) when only
// a measurement would say.
func (e *Engine) planDispatcher(processRanks, deviceRanks int) string {
	m := e.cfg.Model.MoE
	world := e.cfg.mesh().World()
	switch {
	case m.Dispatcher == moe.DispatcherFused || m.Dispatcher == moe.DispatcherUnfused:
		return m.Dispatcher
	case e.backend.Name() == "cpu", processRanks < world, deviceRanks == 1 && world > 1, e.cfg.Train.Deterministic:
		return moe.DispatcherUnfused
	}
	tokens := e.cfg.Train.MicroBatch * e.cfg.Train.Seq / e.cfg.Parallel.CP / e.cfg.Parallel.TP
	cache, err := tune.DefaultDispatchCache()
	if err != nil {
		return ""
	}
	if entry, ok, err := cache.Lookup(tune.NewDispatchKey(e.backend, m, e.cfg.Model.Dim, tokens, e.cfg.Parallel.EP)); err == nil && ok {
		return entry.Choice
	}
	return ""
}

// checkPlan refuses a run whose plan does not fit (an InputError around
// the *plan.Refusal) and logs the plan's peak, and its warnings.
func (e *Engine) checkPlan(processRanks, deviceRanks int) error {
	p, err := e.plan(processRanks, deviceRanks)
	if err != nil {
		return err
	}
	if err := p.Check(); err != nil {
		return &InputError{Err: err}
	}
	host := int64(0)
	if p.Device.Backend != plan.BackendCPU {
		host, _, _ = plan.HostMemory()
	}
	if w := p.Warning(host); w != "" {
		e.log.Warn().Msg("memory plan: " + w)
	}
	ev := e.log.Debug().Str("device", p.Device.Name).Int64("peak_bytes", p.Peak).Str("peak", plan.FormatBytes(p.Peak))
	if p.Device.Memory > 0 {
		ev = ev.Str("memory", plan.FormatBytes(p.Device.Memory))
	}
	ev.Msg("memory plan")
	return nil
}

// ranksPerDevice is how many of the process's ranks Run puts on one
// device: one when the driver places a rank per device and enough are
// visible (placeRanks), else all of them.
func (e *Engine) ranksPerDevice() (int, error) {
	n := e.cfg.mesh().World()
	placer, ok := e.driver.(registry.RankPerDevice)
	if !ok || e.device == nil || n == 1 {
		return n, nil
	}
	visible, err := placer.Devices()
	if err != nil {
		return 0, fmt.Errorf("counting the %ss: %w", placer.Capabilities().Device, err)
	}
	if visible >= n {
		return 1, nil
	}
	return n, nil
}

// planDevice describes the engine's backend to the plan: the GPU it
// opened, with the memory its driver reports usable
// (registry.MemoryReporter; the CUDA backend has it), or the host's
// memory for the CPU backend; the sizes of the backend's float and
// operand types either way.
func (e *Engine) planDevice() (plan.Device, error) {
	b := e.backend
	ft, ot := dtypeBytes(b.FloatType()), dtypeBytes(b.OperandType())
	if b.Name() == plan.BackendCUDA {
		d := plan.CUDADevice("GPU", 0, 0)
		d.FloatBytes, d.OperandBytes = ft, ot
		if e.device != nil {
			d.Name = e.device.Describe()
		}
		if r, ok := e.device.(registry.MemoryReporter); ok {
			_, usable, err := r.Memory()
			if err != nil {
				return d, fmt.Errorf("memory plan: %w", err)
			}
			d.Memory = usable
		}
		return d, nil
	}
	d, err := plan.CPUDevice(ft)
	d.Name, d.OperandBytes = "host", ot
	if err != nil {
		// Without /proc/meminfo the plan still counts, but judges no fit.
		e.log.Debug().Err(err).Msg("memory plan: host memory unknown")
		d.Memory = 0
	}
	return d, nil
}

// dtypeBytes is the size of an element of a float type as backends store
// it: 8 for float64, 2 for bf16 on a backend that stores it (the GPU; a
// backend whose operand type is its float type reports that), else 4.
func dtypeBytes(dt backend.DType) int {
	switch dt {
	case backend.Float64:
		return 8
	case backend.BFloat16:
		return 2
	}
	return 4
}

// checkDistributedPlan is checkPlan for this node's share of a run over
// several processes: world/nodes ranks, one per GPU on a driver that
// spans processes (CUDA), else virtual ranks of this process (TCP).
func (e *Engine) checkDistributedPlan(d Distributed) error {
	nodes := len(d.TCP.Addrs)
	if nodes == 0 && d.Rendezvous != nil {
		nodes = len(d.Rendezvous.Nodes())
	}
	world := e.cfg.mesh().World()
	if nodes < 1 || world%nodes != 0 {
		return nil // RunDistributed's own checks say what is wrong
	}
	local := world / nodes
	deviceRanks := local
	if _, ok := e.multiProcess(); ok {
		deviceRanks = 1
	}
	return e.checkPlan(local, deviceRanks)
}
