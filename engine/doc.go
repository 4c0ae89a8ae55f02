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
// Run returns errors, never panics or exits (a hook's panic comes back as a
// *HookPanicError); a cancelled context returns the result so far and
// ErrStopped. Before it allocates anything Run checks the run's memory plan
// (package plan; Engine.Plan) and refuses a run that cannot fit its device
// with a *plan.Refusal; that and every other error in what it was given
// (the recipe, its data, the run directory, the checkpoint to resume) is an
// InputError, while any other error is the run failing as it ran. With WithRunDir, Run saves checkpoints under DIR/checkpoints
// (every checkpoint.every steps, on stop and at the end) and resumes from
// the newest valid one when started again; without it nothing is saved,
// which Run logs as a warning and Result.Unsaved records. RunDistributed
// trains one node's share of a multi-node run. A trained checkpoint is
// evaluated, sampled and exported by package infer, on LoadReplica.
//
// # Where things are
//
//   - config.go, validate.go: Config, the typed recipe, and its checks.
//   - engine.go: New, options, backend and data selection, Run. Backends
//     other than the CPU come as drivers (WithDrivers; package
//     backend/registry), which the engine never imports: train.backend
//     names one, and auto takes the GPU when there is one and the model
//     fits its kernels' limits; otherwise the CPU, with the reason logged.
//   - plan.go: the memory plan of a run (package plan: PlanConfig,
//     Engine.Plan), checked by Run and RunDistributed before anything large
//     is allocated; a run that cannot fit is refused.
//   - input_error.go: InputError, bad input (the recipe, its data, the run
//     directory, the plan) as opposed to a run that failed while it ran.
//   - placement.go: where the ranks train: virtual ranks of one backend,
//     or one per GPU (registry.RankPerDevice).
//   - distributed.go: RunDistributed and RendezvousBlob, a run over several
//     processes (nodes), each training the ranks it hosts.
//   - train.go: the training loop, read top to bottom.
//   - rank.go: one rank's step: micro-batches, gradient reduction, clipping,
//     AdamW, expert-bias updates; evaluation.
//   - grad_overlap.go: the gradients' cross-rank sums, in buckets started
//     during the step's last backward as they become final.
//   - zero.go: ZeRO-1 (parallel.zero: 1), the AdamW moments of the
//     replicated weights sharded over the ranks that share them.
//   - expert_update.go: train.optimizer_in_backward, the experts' AdamW
//     run by the backward layer by layer, so the gradient store holds one
//     layer's expert gradients.
//   - master_split.go: train.master_weights, the product weights' float32
//     masters held as their bf16 operands and low halves on the GPU.
//   - model.go: the decoder's forward and backward over a micro-batch:
//     embedding, per layer RMSNorm, attention (package attention), residual,
//     RMSNorm, sparse MoE (package moe), residual; final RMSNorm; the LM head
//     fused with the cross-entropy in chunks of rows. Under
//     train.recompute: selective its layers keep the attention core's
//     output and the experts' hidden activations once, in the scratch they
//     share, and remake them in Backward (attention.RecomputeCore,
//     moe.RecomputeExperts); under full they keep all their activations
//     there (attention.RecomputeLayer, moe.RecomputeLayer), and the
//     backward reruns each layer's forward from its kept input (residL,
//     midL) right before its backward (reforward; moe.Layer.Reforward
//     counts no statistics or losses again).
//   - params.go: parameters, their Hugging Face names, initialisation, and
//     their storage (below).
//   - schedule.go: the learning-rate schedules.
//   - events.go: StepEvent, HookPanicError and the metrics.jsonl line
//     (StepEvent.MarshalJSON).
//   - metrics_file.go: metrics.jsonl in a run directory (WithMetricsFile),
//     cut back to the step a run starts from.
//   - observers.go: StartEvent and SaveEvent (WithStartHook, WithSaveHook),
//     and a step's log line ("step 10/300", loss first, ETA last).
//   - perf.go: a step's MFU (ModelFLOPsPerToken, PeakFLOPs), peak memory
//     and time left.
//   - tensorboard.go: log.tensorboard, the run's figures as TensorBoard
//     event files (package observe/tensorboard).
//   - rundir_lock.go, rundir_lock_unix.go, rundir_lock_other.go: the run
//     directory's lock (LockRunDir), one run per directory.
//   - comm_timing.go: the NCCL collectives timed in a profiled step (kind
//     communication of package backend/profile).
//   - checkpointing.go: what a rank saves, resume (with resharding by tensor
//     name), the recipe-change check.
//   - init_from.go: checkpoint.init_from, a fresh run starting from a
//     Hugging Face Mixtral directory (read by package hf); HFModel, the
//     recipe's model as Mixtral's config.json describes it.
//   - tokenizer.go: the run's tokenizer (data.tokenizer, or
//     checkpoint.init_from's tokenizer.json): checked against model.vocab,
//     copied into the run directory and every checkpoint, its SHA-256 in
//     state.json and checked on resume.
//   - checkpoint_info.go: finding a run's newest verified checkpoint
//     (ResolveCheckpoint) and reading what one records (ReadCheckpointInfo).
//   - replica.go: a trained checkpoint's model on one rank (LoadReplica)
//     and its forward pass without training (Replica.Forward).
//   - version.go: Version, the release that checkpoints record.
//
// # The model
//
// The model computes what Hugging Face's MixtralForCausalLM computes: token
// embedding; per layer x += attn(rmsnorm(x)), x += moe(rmsnorm(x)); final
// RMSNorm; untied LM head; next-token cross-entropy averaged over the global
// batch. The objective adds, per MoE layer, aux_loss_coef times the Switch
// load-balancing loss and z_loss_coef times the router z-loss (both over
// the global batch of each micro-step); StepEvent reports the cross-entropy
// and the two auxiliary losses separately.
//
// # Ranks
//
// The recipe's parallel section becomes a mesh of ranks (package comm).
// Each rank holds all non-expert weights and its share of the experts
// (model.moe.experts / (parallel.ep * parallel.tp)), and exchanges routed
// tokens with its expert group (the ep x tp ranks) through the dispatcher model.moe.dispatcher names ("auto"
// resolved once per run, before the ranks start, by tune.ResolveDispatcher).
// Each of the dp*ep data ranks reads a disjoint part of the data; the
// parallel.cp ranks of one data rank share its sequences, each keeping its
// zigzag share (attention.ZigzagPositions), and their attention reaches
// the other ranks' keys and values in the mode parallel.cp_attention names
// (ring or allgather; "auto" resolved once per run by
// tune.ResolveCPAttention). The parallel.tp ranks of one data and context
// position share its tokens too and split the model (package tensorpar):
// attention heads, the LM head's vocabulary, the rows of the residual
// stream under parallel.sequence_parallel, and the rows the MoE layers
// take; the weights they split are blocks of the whole tensors
// (flatLayout's tpSharded range), those they hold whole but compute on
// different rows have their gradients summed over the tensor group
// (tpSummed). Their collectives run around the products or inside them
// (the backend's fused ops, where a tensor group offers peer access) as
// parallel.tp_overlap says (fused or unfused; "auto" resolved once per
// run by tune.ResolveTPOverlap, and the path each group runs logged).
// The loss, the MoE statistics
// and the gradients of replicated weights are summed over every rank with
// distinct tokens, those of experts over the ranks holding the same
// experts, so every layout trains the same model as one rank would, up to
// floating-point summation order.
//
// Ranks are goroutines of one process sharing one backend (virtual ranks,
// comm.NewLocal); or, on the CUDA backend with at least as many GPUs as
// ranks, one GPU each with NCCL groups (the driver's
// registry.RankPerDevice). RunDistributed spreads them over processes: on
// the CPU with TCP collectives (comm.NewTCPRanks), bitwise the losses of
// the same layout in one process; on CUDA with one NCCL world across the
// nodes (registry.MultiProcess). Node 0 writes the metrics and checkpoints.
//
// # Storage and precision
//
// A rank's weights, gradients and AdamW moments are each one flat tensor
// (flatLayout): norms first, then the other replicated matrices, then the
// rank's experts, every parameter a view into it, so zeroing, norms,
// reductions and AdamW are a few calls over long ranges. The model reads
// the weights through an operandStore: where the backend's operand type is
// not its float type (the GPU: bf16 products, float32 accumulation), a bf16
// copy rounded from the float32 masters at the start of every step; on the
// CPU, the masters themselves.
//
// # Where a step waits for the device
//
// Ops only queue work on the GPU, and a step waits for it once: what the
// host reads from each micro-batch's forward (token losses, MoE
// statistics) and after the last backward (the gradients' square sums for
// the norm) is queued as it is produced (model.queueStats) and read
// together after the last backward is queued (model.finishStats). The MoE
// layers' per-expert counts come by queued downloads read in the
// backward, long after the device wrote them. The step then queues AdamW
// and returns without waiting for it: the host reads and uploads the next
// batch and queues its forward while the device runs the optimizer. The
// ranks' vote to stop before each step meets on the host (session.votes,
// stopVotes): a process's ranks in a group of their own, and across
// processes whose groups are the devices' (NCCL) the processes' sums go
// over the rendezvous's connections (launch.Rendezvous.AllReduceFloat64),
// never over a collective that would wait for the device's queue. Errors
// of queued work surface at the next wait: the next step's Sync, before
// its loss is trusted, the checkpoint's, which writes nothing after a
// fault, and the run's end.
package engine
