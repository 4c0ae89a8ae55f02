// Package moe is the sparse mixture-of-experts block of a Mixtral-style
// decoder layer, forward and backward: the router, the experts, expert
// parallelism (experts sharded over ranks, token rows exchanged between
// them) and load balancing. It is written against backend.Backend ops only,
// with no autograd, so it runs on every backend.
//
// # Use
//
// A Layer is one block on one rank, sized for a fixed number of local
// tokens per micro-step; Config is the recipe's model.moe section and
// Groups its communicators (comm.Ranks.Expert, and DataContext: every rank
// holding distinct tokens):
//
//	w := moe.NewParams(b, cfg, dim, cfg.Experts/ep) // this rank's experts; also for gradients
//	l, err := moe.New(b, cfg, dim, tokens, moe.Groups{Expert: ranks.Expert, Data: ranks.DataContext})
//	st, err := l.Forward(outTD, xTD, w, biasE, lossScale) // biasE may be nil
//	...
//	err = l.Backward(dxTD, doutTD, w, g)                  // writes dx, adds into g
//	err = l.ReadStats(&st)                                // aux and z losses, once the step is done
//
// Every rank of both groups calls Forward and Backward together (they run
// collectives); a rank whose call fails aborts its groups
// (comm.Ranks.Abort). New takes a resolved Config.Dispatcher, "fused" or
// "unfused" (tune.ResolveDispatcher resolves "auto" from measurements). The engine
// builds its layers WithScratch (one Scratch per rank), WithStats (every
// layer's statistics read back at once: FinishStats) and AddToOutput (add
// into the residual stream), and under train.recompute: selective
// RecomputeExperts (the experts' hidden activations h1, h3 and
// silu(h1)*h3 held once in the Scratch and made again in Backward from the
// kept expert inputs), or under train.recompute: full RecomputeLayer
// (every activation held once in the Scratch, the fused dispatcher's
// exchanged rows per layer, and Reforward, Forward without its statistics
// and losses, run right before Backward); with one micro-batch a step
// OverwriteExpertGrads (the weight gradients written, not added), and
// where the experts are updated in the backward (train.optimizer_in_backward)
// UpdateExpertsInBackward instead: Backward hands each local expert
// tensor's weight-gradient product to an ExpertUpdater once nothing later
// in it reads that tensor's weights (w2 after DispatchDgradSwiGLU or the
// products through it, w1 and w3 after the input gradient's products),
// and writes no expert gradients. After each optimizer step UpdateBias
// moves the aux-loss-free balancing bias. WithPhaseHook times the phases for `mktrain
// bench moe`; MeasureDispatch and MeasureDispatchOn time both dispatchers
// for package tune and `mktrain bench kernels`.
//
// # What it computes
//
// What Hugging Face's MixtralSparseMoeBlock computes:
//
//	logits = x·Gateᵀ                    router linear, [T, E]
//	probs  = softmax(logits)            per token
//	idx    = topk(probs (+ bias), K)    the K chosen experts, best first
//	gates  = probs[idx] / Σ probs[idx]  renormalised to sum 1
//	out[t] = Σ_k gates[t,k] · Expert_idx[t,k](x[t])
//	Expert_j(x) = W2_j·(silu(W1_j·x) * W3_j·x)  (SwiGLU)
//
// plus three options, all off by default (Config): shared experts (a dense
// SwiGLU of width SharedExperts*FFN for every token), aux-loss-free bias
// balancing (the bias steers selection only; the gates stay unbiased) and
// an expert capacity. Names carry their shapes (legend in package backend):
//
//	xTD, outTD              [T, D]      the block's input (normalised hidden state) and output
//	GateED                  [E, D]      router weight, replicated on every rank
//	W1EFD, W3EFD            [El, F, D]  this rank's El = E/EP experts; W1EFD[j] is HF experts.j.w1
//	W2EDF                   [El, D, F]  HF experts.j.w2
//	SharedW1FD, SharedW3FD  [Fs, D]     shared experts, Fs = SharedExperts*F
//	SharedW2DF              [D, Fs]
//	logitsTE, probsTE       [T, E]      router logits and probabilities
//	idxTK, gatesTK          [T, K]      chosen experts and their gates
//	...SD                   [S, D]      rows this rank sends: one per kept (token, expert) assignment
//	...RD, ...RF            [R, D|F]    rows this rank's experts process, grouped by expert
//
// Load balancing is global: counts are all-reduced over the data group (on
// the device: the aux-loss gradient needs no host read), so every layout
// computes the same losses. With T the micro-step's global
// tokens, f_e = assignments to e / (T*K) and P_e = (1/T) Σ_t probs[t,e]:
//
//	aux  = E * Σ_e f_e P_e                  Switch Transformer load-balancing loss
//	z    = (1/T) Σ_t logsumexp(logits[t])²  router z-loss (ST-MoE)
//
// Stats holds them unweighted; the engine adds AuxLossCoef*aux +
// ZLossCoef*z to the loss, and Backward adds their gradients scaled by
// Forward's lossScale. With CapacityFactor cf > 0 each source rank sends an
// expert at most ceil(cf*T_local*K/E) rows; later assignments in token
// order are dropped (Stats.Dropped), so results with a capacity depend on
// how tokens are split over ranks, and dropless ones do not.
//
// # Design notes
//
// Expert-group rank r owns experts [r*E/EP, (r+1)*E/EP). Each micro-step
// the router runs on the local tokens; the kept assignments are sorted by
// global expert, which is by destination rank, and within an expert by
// token (RouteByExpert, on the device when dropless; it also writes each
// expert's count and offset). Across expert ranks the [E] counts come to
// the host, to size the exchange, and one small all-reduce completes the
// [EP, E] count matrix. On one expert rank the host reads nothing in the
// forward: the grouped products take the device's offsets
// (backend.Groups), and the counts reach the host by a queued download
// (Backend.StartDownload) that the backward waits for, long after the
// device wrote them, so the GPU's queue never runs dry in the step. The unfused dispatcher
// then gathers the rows into send order, exchanges them (AllToAllRows),
// permutes them into expert-major order, runs the experts as grouped
// products (GroupedMatMul; weight gradients GroupedMatMulTN), and takes the
// outputs back the same way, GatherSumRows adding gate·y into each token's
// row (a gather by token: RouteByExpert also writes where each assignment
// went, so every token row is written once, with no atomics and in a fixed
// order); with one expert rank there is nothing to exchange. Each expert's rows
// are ordered by source rank then token, the global token order, so 1 rank
// or W ranks agree up to the order of floating-point sums.
//
// The fused dispatcher (fused.go) needs an expert group that offers
// comm.PeerAccess (virtual ranks of one process, or GPUs of one process
// with peer access): after one exchange of tensor handles each rank's
// experts read their input rows straight from the sources' tokens and write
// their outputs straight into the sources' send-order buffers
// (DispatchSwiGLU, DownCombine; DispatchDgradSwiGLU, DgradCombine
// backward), raising a per-row flag that the source waits for before
// combining (CombineRows). Both dispatchers compute the same rows in the
// same order, so they agree to the bit on the CPU and a run may resume
// under either.
package moe
