// Package moe is the sparse mixture-of-experts block of a Mixtral-style
// decoder, forward and backward, with expert parallelism and load balancing.
//
// It computes what Hugging Face's MixtralSparseMoeBlock computes:
//
//	logits = x·Gateᵀ                    router linear, [T, E]
//	probs  = softmax(logits)            per token
//	idx    = topk(probs (+ bias), K)    the K chosen experts, best first
//	gates  = probs[idx] / Σ probs[idx]  renormalised to sum 1
//	out[t] = Σ_k gates[t,k] · Expert_idx[t,k](x[t])
//	Expert_j(x) = W2_j·(silu(W1_j·x) * W3_j·x)  (SwiGLU)
//
// plus three options beyond Mixtral, all off by default (see Config):
// shared experts (a dense SwiGLU of width SharedExperts*FFN added for every
// token), aux-loss-free bias balancing, and an expert capacity.
//
// There is no autograd: Layer.Forward saves what Layer.Backward needs, and
// both are written against the backend.Backend ops only (MatMul, the router
// ops, SwiGLU, GatherRows, ScatterAddRows, RowDots, and for the fused
// dispatcher the peer-row ops), so the block runs on every backend.
//
// # Shapes
//
// Names carry their shapes (legend in package backend):
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
// # Dispatch plan and expert parallelism
//
// Experts are sharded over the expert group: its rank r owns experts
// [r*E/EP, (r+1)*E/EP). Every micro-step:
//
//  1. The router runs on the local tokens.
//  2. This rank's kept assignments are sorted by global expert — which is
//     by destination rank, then local expert — and within an expert by
//     token. sendTok[s] is the token of row s and sendSlot[s] = t*K+k its
//     gate. Dropless, the backend sorts them where they are
//     (RouteByExpert: on a GPU, one kernel) and only the [E] counts come to
//     the host, which needs them to size the expert GEMMs and the
//     exchange; with a capacity the host reads idxTK and decides which
//     assignments to drop.
//  3. The ranks learn how many rows each source sends to each expert: each
//     rank fills its row of an [EP, E] count matrix, and one small
//     all-reduce over the expert group completes it.
//  4. GatherRows copies the token rows into send order and AllToAllRows
//     moves them; only routed rows travel. They arrive by source rank, and
//     a permutation regroups them by local expert so that each expert's
//     rows are contiguous, and the experts run as grouped products
//     (GroupedMatMul, one call for all local experts): h1 = X·W1ᵀ,
//     h3 = X·W3ᵀ, a = silu(h1)*h3, y = a·W2ᵀ. The weight gradients are
//     GroupedMatMulTN products over the same groups.
//  5. The inverse permutation and the reverse AllToAllRows bring the
//     outputs back in send order, and ScatterAddRows adds gate·y into each
//     token's row of out.
//
// With one expert rank there is nothing to exchange and the permutation is
// the identity: the token rows are gathered straight into the experts'
// input rows and the experts write straight into the send-order outputs.
//
// # Dispatchers
//
// Steps 4 and 5 above are the "unfused" dispatcher (Config.Dispatcher),
// which any comm.Group can run. The "fused" one needs an expert group whose
// ranks reach each other's tensors (comm.PeerAccess: the in-process virtual
// ranks, which share one backend, and the NCCL groups of one process with
// peer access between their GPUs). Each rank lists, for its expert-major
// rows, the (source rank, send position) each copies — the rows step 4's
// all-to-all and permutation would bring, in the same order — and after
// one exchange of tensor handles its experts read their input rows from
// the sources' tokens and write their outputs straight into the sources'
// send-order buffers (DispatchSwiGLU: gather, W1 and W3 products and
// SwiGLU; DownCombine: the W2 product scattered to the sources; on a GPU,
// fused kernels). Where the backend's operand type is bf16 (the GPU), the
// rows read are each source's input already in bf16, made once per
// Forward for the router's product too, so the gather moves half the
// bytes of the float rows. The references go to the backend as one block per
// (local expert, source rank), which it expands on the device
// (PeerRowRefs). DownCombine raises each row's completion flag in its
// source's list once the whole row is written, and every rank combines
// its own rows as in step 5, each once its flag is up (CombineRows,
// which clears the flags for the next layer). Backward gathers the
// gate-scaled output gradients from the sources into expert-major order
// and takes them through W2 and SwiGLU's backward (DispatchDgradSwiGLU),
// accumulates the weight gradients, and computes the dx rows straight
// into the sources' send-order buffers (DgradCombine, flagged the same
// way); on a GPU those two are fused kernels too. With virtual ranks on
// one stream a barrier still sits before each combine (fused.go says
// why). The two dispatchers compute the same rows
// in the same order, so they agree to the bit on the CPU. "auto" picks one
// from a measured table (tune.ResolveDispatcher); New takes only a resolved
// value.
//
// Backward mirrors it: dgate[t,k] = dout[t]·y[t,k] (RowDots), dy = gate·dout
// travels the forward path to the experts, their backward accumulates the
// weight gradients and produces dx rows, which travel back and are added to
// their tokens (ScatterAddRows); the router's backward adds dlogits·Gate to
// dx and dlogitsᵀ·x to the gate's gradient. Expert gradients stay on the
// rank that owns the expert; the engine sums them over the expert-replica
// group and the gate and shared-expert gradients over the data group.
//
// Each expert's rows are ordered by source rank and then token, which with
// contiguous token slices is the global token order: 1 rank or W ranks give
// the same results up to the order of floating-point sums.
//
// # Load balancing
//
// All statistics are global: counts and sums are all-reduced over the data
// group (every rank holding distinct tokens), so every rank computes the
// same losses whatever the parallel layout. With T the global tokens of the
// micro-step:
//
//	f_e  = (assignments to e) / (T*K)     the router's choices, before capacity
//	P_e  = (1/T) Σ_t probs[t,e]
//	aux  = E * Σ_e f_e P_e                Switch Transformer load-balancing loss
//	z    = (1/T) Σ_t logsumexp(logits[t])²  router z-loss (ST-MoE)
//
// Stats returns aux and z unweighted; the engine adds
// AuxLossCoef*aux + ZLossCoef*z to the loss it reports. Backward adds their
// gradients, scaled by Forward's lossScale: on probs, AuxLossCoef*E*f_e/T
// (f is piecewise constant, so only P carries gradient), and on logits,
// ZLossCoef*2*lse[t]*probs[t,e]/T.
//
// Aux-loss-free balancing (DeepSeek-V3) adds a per-expert bias to the probs
// for selection only — the gates stay the renormalised unbiased probs — and
// UpdateBias moves it after each optimizer step:
// bias_e += rate * sign(mean load - load_e).
//
// # Capacity
//
// With CapacityFactor cf > 0, each source rank sends an expert at most
// ceil(cf * T_local * K / E) rows per micro-step; assignments beyond it, in
// token order, are dropped: they add nothing to out and get no gradient
// (the token keeps its other experts and the residual path). Stats.Dropped
// counts them. Because the capacity is per source rank, results with
// capacity depend on how tokens are split over ranks; dropless routing
// (cf = 0) does not.
package moe
