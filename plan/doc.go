// Package plan is mktrain's memory plan: from a validated recipe and a
// device it computes, per rank, the parameters (all, active per token,
// held), the FLOPs per token that bench train's MFU counts, and the bytes
// of every kind of memory a run holds at its peak, against the memory the
// device offers, and gives a verdict. `mktrain plan` prints it; the engine
// checks it before it allocates anything (engine.Engine.Plan, Run), so a
// recipe too large for its device is refused with one sentence that names
// the fields to change, instead of running out of memory halfway through
// building the model.
//
// # Use
//
//	p, err := plan.New(engine.PlanConfig(cfg, 0, 0, true), dev) // dev: plan.NamedDevice("h200"), plan.CPUDevice(4), ...
//	fmt.Println(plan.FormatBytes(p.Peak))                       // one device's predicted peak
//	if err := p.Check(); err != nil { ... }                     // a *Refusal: a sentence, and Fields to change
//
// Config is what the plan reads of a recipe (engine.PlanConfig fills it);
// Device is where the tensors live: the backend whose allocations the
// plan mirrors ("cuda" or "cpu"), its element sizes and its memory.
// NamedDevice knows GPUs by name for planning another machine; the engine
// describes the device it opened.
//
// # What it counts
//
// Every term mirrors the code that allocates it, and says which in its
// comment (terms.go): the flat stores of engine/params.go and zero.go
// (fp32 master weights, the GPU's bf16 copy the products read, gradients,
// AdamW's m and v or their ZeRO-1 share); the activations engine/model.go,
// attention/layer.go and context.go, and moe/layer.go keep for the
// backward, by layer kind (residual stream, norms, attention, MoE router,
// routed expert rows, shared experts, LM head chunk); the working memory
// of the backward, the MoE dispatch Scratch, the in-process collectives'
// scratch, and on the GPU cuBLASLt's workspace, its operand scratch and
// autotuning output, kernel tables and the largest transient of an op
// (backend/cuda). On the GPU each allocation is rounded to the caching
// allocator's size class, which is what its peak counts. docs/memory.md
// explains each term with moe-small's figures.
//
// The MoE layers' routed rows depend on routing: with one expert rank
// every (token, choice) is a row, exactly T*K; with several, Term.Bytes
// assumes balanced routing and Term.Worst the most rows a rank can
// receive (with moe/buffers.go's growth headroom). A run is refused when
// the balanced peak does not fit; Warning says when only the bound does
// not.
//
// On the CPU the tensors are host memory, and the plan adds the host's
// transients (initialisation's float64 copy of the largest tensor, a
// checkpoint's snapshot), the larger of which counts at the peak. Sizes
// are int64 and saturate at Saturated instead of wrapping, so a recipe of
// absurd sizes ("model.vocab: 2000000000") is planned, found too large and
// refused in microseconds.
//
// The plan's tests build models on the CPU and compare its terms with the
// bytes of every tensor the engine allocates (engine/plan_test.go), and
// hold its GPU peak to bench train's measured peaks within 10%
// (cmd/mktrain/plan_test.go, bench/results/h200/train-*.json).
package plan
