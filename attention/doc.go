// Package attention is the self-attention block of a Mixtral decoder layer:
// grouped-query attention with rotary position embeddings, forward and
// backward, written against backend.Backend. The RMSNorm in front of it and
// the residual add after it belong to the engine.
//
// # What it computes
//
// Exactly what Hugging Face's MixtralAttention computes (no biases, no
// dropout, no sliding window), for x the normalised input of T = B*S tokens:
//
//	q = x · Wqᵀ                 [T, H*Dh]    q_proj.weight  Wq [H*Dh, D]
//	k = x · Wkᵀ                 [T, KV*Dh]   k_proj.weight  Wk [KV*Dh, D]
//	v = x · Wvᵀ                 [T, KV*Dh]   v_proj.weight  Wv [KV*Dh, D]
//	q, k = rope(q, pos), rope(k, pos)        rotate-half, base RopeTheta
//	a = softmax(q·kᵀ/sqrt(Dh) + causal mask) · v    per sequence and head
//	out = a · Woᵀ               [T, D]       o_proj.weight  Wo [D, H*Dh]
//
// Head dim Dh = Dim/Heads. Query head h attends with key/value head
// h/(Heads/KVHeads): the first Heads/KVHeads query heads share kv head 0, as
// repeat_kv orders them. RoPE rotates each head's pair (x[i], x[i+Dh/2]) by
// the angle pos * RopeTheta^(-2i/Dh), as apply_rotary_pos_emb does with
// rotate_half. The causal mask is by position within the sequence (row i of
// a sequence sees rows 0..i of the same sequence); the rotation uses the
// positions in posT, which are 0..S-1 per sequence in a plain run and other
// values when a sequence is split across ranks.
//
// Weights keep Hugging Face's Linear layout [out, in], so a checkpoint is
// exported without transposes; the projections are MatMuls with transB.
//
// # Forward and backward
//
// A Layer belongs to one decoder layer and holds the activations of one
// micro-batch between Forward and Backward:
//
//	l := attention.New(b, shape, batch, seq)       // buffers for batch*seq tokens
//	err := l.Forward(outTD, xTD, posT, params)     // saves q, k (rotated), v, a, lse
//	...
//	err = l.Backward(dxTD, doutTD, params, grads)  // writes dx, adds into grads
//
// Forward saves the rotated q and k, v, the attention output a (before
// o_proj) and the per-row log-sum-exp of the scores (lse, [B, H, S]), which
// is all the flash-style attention backward needs to recompute the
// probabilities. It keeps xTD and posT by reference: the caller must keep
// both alive, holding the same values when Backward runs (it may use the
// memory in between and recompute them, as the engine does with xTD). Backward overwrites dxTD and
// accumulates (adds) the weight gradients into grads, so gradients of several
// micro-batches sum without extra copies; the caller zeroes them per step.
//
// Both return an error, and write nothing useful, for tensors of the wrong
// shape and, on a context-parallel Layer, when a collective fails (a peer
// aborted the group); a Backward needs a successful Forward before it.
//
// The backward scratch (the gradients of a, q, k and v, and the keys and
// values in transit under context parallelism) lives in a Scratch. Each
// Layer has its own unless built WithScratch(s): the layers of one rank run
// one after another, so they can share one and keep only their saved
// activations each. A Layer is not safe for concurrent use, and serves one
// micro-batch at a time.
//
// # Context parallelism
//
// NewContextParallel builds a Layer whose sequences are split over the W
// ranks of a comm.Group (comm.Ranks.Context) in zigzag order: the sequence
// is cut into 2W chunks and rank r holds chunks r and 2W-1-r, which evens
// out the causal work. Each rank calls the same Forward and Backward on its
// own B*S/W tokens, per sequence the rows of chunk r and then those of
// chunk 2W-1-r, with posT holding their global positions
// (ZigzagPositions). Keys and values are all-gathered over the group for
// the attention and their gradients reduce-scattered back (context.go has
// the details). Outputs and dx are exactly the rows of a one-rank run;
// weight gradients are this rank's share, to be summed over the group (and
// over data parallelism) like any replicated weight's. With W = 1 it is
// the Layer of New.
package attention
