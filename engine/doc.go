// Package engine is mktrain's trainer: it assembles the Mixtral-style model
// from its layers, runs the training loop over one or more ranks, and reports
// every step. It is the public Go API: a service embeds it as
//
//	cfg := engine.DefaultConfig()            // or recipes.Load("recipes/tiny.yaml", nil)
//	eng, err := engine.New(cfg,
//		engine.WithDrivers(all.Drivers()...),  // package backend/all: the GPU, if any
//		engine.WithLogger(logger),
//		engine.WithHook(func(ev engine.StepEvent) { ... }))
//	res, err := eng.Run(ctx)                 // cancel ctx to stop between two steps
//
// Run returns errors, never panics or exits; a cancelled context returns the
// result so far and ErrStopped. With WithRunDir, Run saves checkpoints under
// DIR/checkpoints (every checkpoint.every steps, on stop and at the end)
// and resumes from the newest valid one when started again. A trained
// checkpoint is evaluated, sampled and exported by package infer.
//
// # Where things are
//
//   - config.go, validate.go: Config, the typed recipe, and its checks.
//   - engine.go: New, options, backend and data selection, Run. Backends
//     other than the CPU come as drivers (WithDrivers; package
//     backend/registry), which the engine never imports: train.backend
//     names one, and auto takes the GPU when there is one and the model
//     fits its kernels' limits; otherwise the CPU, with the reason logged.
//   - placement.go: where the ranks train: virtual ranks of one backend,
//     or one per GPU (registry.RankPerDevice).
//   - train.go: the training loop, read top to bottom.
//   - rank.go: one rank's step: micro-batches, gradient reduction, clipping,
//     AdamW, expert-bias updates; evaluation.
//   - grad_overlap.go: the gradients' cross-rank sums, in buckets started
//     during the step's last backward as they become final.
//   - model.go: the decoder's forward and backward over a micro-batch:
//     embedding, per layer RMSNorm, attention (package attention), residual,
//     RMSNorm, sparse MoE (package moe), residual; final RMSNorm; the LM head
//     fused with the cross-entropy in chunks of rows.
//   - params.go: parameters, their Hugging Face names, initialisation, and
//     their storage (below).
//   - schedule.go: the learning-rate schedules.
//   - events.go: StepEvent and the metrics.jsonl line.
//   - checkpointing.go: what a rank saves, resume (with resharding by tensor
//     name), the recipe-change check.
//   - init_from.go: checkpoint.init_from, a fresh run starting from a
//     Hugging Face Mixtral directory (read by package hf); HFModel, the
//     recipe's model as Mixtral's config.json describes it.
//   - checkpoint_info.go: finding a run's newest verified checkpoint
//     (ResolveCheckpoint) and reading what one records (ReadCheckpointInfo).
//   - replica.go: a trained checkpoint's model on one rank (LoadReplica)
//     and its forward pass without training (Forward: losses, logits).
//     Evaluation, sampling and the Hugging Face export built on it are
//     package infer's.
//
// # The model
//
// The model computes what Hugging Face's MixtralForCausalLM computes: token
// embedding; per layer x += attn(rmsnorm(x)), x += moe(rmsnorm(x)); final
// RMSNorm; untied LM head; next-token cross-entropy averaged over the global
// batch. The objective adds, per MoE layer, aux_loss_coef times the Switch
// load-balancing loss and z_loss_coef times the router z-loss (both computed
// over the global batch of each micro-step); StepEvent reports the
// cross-entropy and the two auxiliary losses separately.
//
// # Ranks
//
// The recipe's parallel section becomes a mesh of ranks (package comm). Each
// rank owns a model replica with all non-expert weights and its share of the
// experts (model.moe.experts / parallel.ep), and exchanges routed tokens with
// the other ranks of its expert group: by all-to-all (the unfused
// dispatcher) or by reading and writing the peers' rows directly in the
// fused kernels (model.moe.dispatcher; auto is resolved once per run,
// before the ranks start, from the measured table of tune.ResolveDispatcher,
// so every rank uses the same). Each of the dp*ep data ranks reads a
// disjoint part of the data; under context parallelism the parallel.cp
// ranks of one data rank read the same sequences and each keeps its zigzag
// share of every sequence (attention.ZigzagPositions): attention gathers the
// keys and values of whole sequences over the context group, and everything
// else runs per token. The loss and the MoE load statistics are summed over
// every rank with distinct tokens (data x context), gradients of replicated
// weights likewise, those of experts over the ranks holding the same
// experts, so every layout trains the same model as one rank would, up to
// floating-point summation order.
// The ranks are goroutines of one process (virtual ranks) sharing the one
// backend: the CPU, or one GPU, where each rank's tensors are separate
// allocations and the collectives move data with device copies and kernels
// (comm.NewLocal). On the CUDA backend, when the machine shows at least as
// many GPUs as the layout has ranks, each rank takes a GPU of its own and
// the groups are NCCL communicators (its driver's
// registry.RankPerDevice.MeshRanks) instead.
// Engine.RunDistributed spreads the ranks over several
// processes (nodes) instead, each training its own ranks: on the CPU with
// the collectives over TCP (comm.NewTCPRanks), where the losses are bitwise
// those of the same layout in one process; on CUDA one GPU per rank, the
// groups cut from one NCCL world across the nodes (its driver's
// registry.MultiProcess.NodeRanks).
// Node 0 writes the metrics and the checkpoints (see distributed.go).
//
// # Storage and precision
//
// A rank's weights, gradients and AdamW moments are each one flat tensor
// (flatLayout): norms first, then the other replicated matrices, then the
// rank's experts, every parameter a view into it. Zeroing the gradients,
// their norm, the cross-rank reductions (in buckets) and AdamW (with the
// clipping factor folded in) are a few calls over long ranges.
//
// The model reads the weights through an operandStore: on a backend whose
// operand type differs from its float type (the GPU: bf16 products with
// float32 accumulation), a bf16 copy of the matrices rounded from the
// float32 masters at the start of every step and evaluation; on the CPU,
// the masters themselves. The blocks add their outputs onto the residual
// stream (attention.AddToOutput, moe.AddToOutput). What the host needs to
// read from a forward (the summed token losses, the MoE auxiliary losses)
// is read once per micro-batch after its backward is queued
// (model.finishStep), so the GPU never waits for the host in mid-step
// except for the MoE layers' per-expert row counts.
package engine
