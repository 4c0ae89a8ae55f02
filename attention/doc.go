// Package attention is the self-attention block of a Mixtral decoder layer:
// grouped-query attention with rotary position embeddings, forward and
// backward, written against backend.Backend so that it runs on every
// backend. The RMSNorm in front of it and the residual add after it belong
// to the engine.
//
// # Use
//
// A Layer serves one decoder layer and keeps the activations of one
// micro-batch of batch sequences of seq tokens (T = batch*seq rows) between
// Forward and Backward:
//
//	s := attention.Shape{Dim: 64, Heads: 4, KVHeads: 2, RopeTheta: 1e6}
//	w, g := attention.NewParams(b, s), attention.NewParams(b, s) // weights, gradients
//	l := attention.New(b, s, batch, seq)
//	err := l.Forward(outTD, xTD, posT, w)   // out [T, D]; posT [T] int32 positions
//	...
//	err = l.Backward(dxTD, doutTD, w, g)    // writes dx, adds into g
//
// Forward keeps xTD and posT by reference: they must hold the same values
// when Backward runs (the engine reuses xTD's memory in between and
// recomputes it). Backward overwrites dxTD and adds the weight gradients
// into g, so micro-batches accumulate; the caller zeroes g per step. Both
// return an error, and write nothing useful, for tensors of the wrong shape
// or a failed collective; Backward needs a successful Forward first. A
// Layer is not safe for concurrent use.
//
// Options: WithScratch(s) shares one Scratch (the backward's working memory,
// from NewScratch) among the layers of a rank, which run one after another;
// AddToOutput makes Forward add into outTD (the residual stream) instead of
// overwriting it. The engine uses both. RecomputeCore (the engine's
// train.recompute: selective) keeps the core's output a and log-sum-exp
// once in the shared Scratch instead of per layer, and Backward reruns the
// core on the kept q, k and v to refill them before o_proj's backward.
// RecomputeLayer (train.recompute: full) keeps q, k, v, a and the
// log-sum-exp (and an all-gather context core's natural-order k and v)
// once in the shared Scratch, and the caller runs Forward again on the
// same input right before Backward.
//
// NewContextParallel builds a Layer whose sequences are split over the
// ranks of a comm.Group (comm.Ranks.Context); each rank passes its own
// batch*seq/W tokens with their global positions from ZigzagPositions, and
// all ranks call Forward and Backward together. The attention between
// the ranks runs on a ContextCore (NewContextCore), which can also be run
// alone on explicit q, k, v tensors (benchmarks); its mode (CPMode,
// WithContextMode) says how keys and values reach the other ranks'
// queries.
//
// WithTensorParallel(p) makes a Layer one rank's share of a tensor-parallel
// block (package tensorpar): its Params are its rows of q_proj (and of
// k_proj and v_proj, or those whole when there are fewer kv heads than
// ranks: TensorParallelShape) and its columns of o_proj; x and out are the
// rank's rows of the micro-batch under sequence parallelism (gathered
// before the projections, o_proj's partial sums reduce-scattered back), or
// all of them (o_proj's sums all-reduced). NewTensorParallel builds one
// with an error instead of a panic; NewContextParallel takes the option
// too, each tp rank then running the ring over its own heads.
//
// # What it computes
//
// Exactly Hugging Face's MixtralAttention (no biases, dropout or sliding
// window), for x the normalised input:
//
//	q = x · Wqᵀ                 [T, H*Dh]    q_proj.weight  Wq [H*Dh, D]
//	k = x · Wkᵀ                 [T, KV*Dh]   k_proj.weight  Wk [KV*Dh, D]
//	v = x · Wvᵀ                 [T, KV*Dh]   v_proj.weight  Wv [KV*Dh, D]
//	q, k = rope(q, pos), rope(k, pos)        rotate-half, base RopeTheta
//	a = softmax(q·kᵀ/sqrt(Dh) + causal mask) · v    per sequence and head
//	out = a · Woᵀ               [T, D]       o_proj.weight  Wo [D, H*Dh]
//
// Dh = Dim/Heads. Query head h uses key/value head h/(Heads/KVHeads), as
// repeat_kv orders them. RoPE rotates each head's pair (x[i], x[i+Dh/2]) by
// pos * RopeTheta^(-2i/Dh). The causal mask is by row within the sequence;
// the rotation uses posT, so a sequence split across ranks rotates at its
// global positions. Weights keep Hugging Face's Linear layout [out, in]
// (Params), so export needs no transposes.
//
// # Design notes
//
// There is no autograd. Forward saves the rotated q and k, v, the output a
// before o_proj and the per-row log-sum-exp of the scores (lse, [B, H, S]):
// all a flash-style backward needs to recompute the probabilities. On a
// backend whose operand type is bf16 (the GPU) q, k and v are kept in
// bf16, the type the attention core multiplies in: the projections of q
// and k write float32 into the backward's scratch, and RoPE rotates them
// in float32 and rounds once into the kept tensors; v's product writes
// bf16 itself. The core reads them as they are, with no conversion pass,
// and they take half the memory. The core's output a, which o_proj reads,
// and its gradient da, which o_proj's backward writes, are bf16 too
// (float32 under tensor parallelism, whose products take them so). In
// the backward RoPE's inverse writes the gradients of q and k straight
// into the bf16 operands of the projections' products. A
// context-parallel Layer keeps q, k and v in the type its ContextCore
// reads them in (ContextCore.QKVType): bf16 for the fused ring in one
// pass, whose kernels read bf16 tiles, else the float type, which the
// collectives move; a and da are of the float type there.
//
// Context parallelism cuts each sequence into 2W chunks and gives rank r
// chunks r and 2W-1-r (zigzag), which evens out the causal work. In mode
// allgather keys and values are all-gathered over the group and their
// gradients reduce-scattered back (context.go). Mode ring holds no rank's
// whole sequences. Where the group offers comm.PeerAccess (ranks of one
// process) and the backend's zigzag ops take the shape, it is the fused
// ring (ring_fused.go): each rank's kernels read the peers' keys and
// values in place, tile by tile, the online softmax in registers across
// every chunk, and the backward reads the peers' queries and output
// gradients, so nothing is copied or reduced across ranks; it gives the
// all-gather path's results (on the CPU, its bits). Elsewhere it is the
// portable ring (ring.go): each rank's keys and values travel the ring of
// ranks over the group's Send and Recv while every rank computes on the
// chunk it holds, partial results merged by their log-sum-exp (backend
// AttentionMerge), and the key and value gradients travel back with them:
// only the chunks in flight are held, and the results equal the
// all-gather path's up to rounding (the merges add in another order).
// core.go chooses (ContextCore.Path names the choice). Outputs and dx are exactly the rows
// of a one-rank run; weight gradients are this rank's share, summed over
// the group by the engine like any replicated weight's. With W = 1 it is
// the Layer of New.
package attention
