// Package tensorpar is tensor parallelism's plumbing, Megatron style: the
// collectives of a tensor-parallel group (comm.Ranks.Tensor) around the
// backend's matrix products, in the three patterns every tensor-parallel
// layer is built from. Each pattern is one function, and a Parallel runs
// it either as that function (the collective around the product) or
// fused (Options.Fused, fused.go: the backend's AllGatherMatMul and
// MatMulScatter, the communication inside the product), without the
// layers changing:
//
//	AllGatherMatMul       gather the row shards of x, then outs[i] = x·op(W_i)
//	MatMulReduceScatter   partial = Σ A_i·op(W_i), then each rank its rows of the sum
//	MatMulAllReduce       out = Σ A_i·op(W_i), then summed over the group
//
// The backward of each is another of them: the input gradient of
// AllGatherMatMul is a MatMulReduceScatter and the other way round, and
// MatMulAllReduce's weight gradients need no collective; the weight
// gradients reuse the gathered input.
//
// # Use
//
// A Parallel is one rank's group and mode. Its methods pick the pattern a
// column- or row-parallel product needs in that mode (GatherRows, which
// feeds no product of its own, stays the collective in both):
//
//	tp := tensorpar.NewWith(b, ranks.Tensor, tensorpar.Options{SequenceParallel: true, Fused: true})
//	err := tp.ColumnProducts(xFullTD, xTD, []backend.Tensor{qTQ}, []backend.Tensor{WqQD}, true) // the gathered rows not kept
//	err = tp.RowForward(outTD, partialTD, []tensorpar.Term{{A: aTQ, W: WoDQ, TransW: true}})
//	dout, err := tp.ColumnForward(doutFullTD, doutTD, []backend.Tensor{daTQ}, []backend.Tensor{WoDQ}, false) // a row-parallel product's dgrad
//	x, err = tp.GatherRows(xFullTD, xTD)             // rows for the weight gradients alone
//	err = tp.ColumnBackward(dxTD, partialTD, terms)  // dx of a column-parallel product
//
// x and dout are the whole rows the products read (the gathered buffer,
// or the input itself without sequence parallelism); the weight gradients
// multiply by them. ColumnForward returns them; ColumnProducts, for a
// forward whose backward gathers x again, keeps none (the fused op then
// writes no gathered rows, the unfused one uses xFullTD as scratch). The
// layers of package attention (WithTensorParallel) and the engine's LM
// head are built this way; they run wherever
// comm.Group's collectives do: virtual ranks and TCP on the CPU,
// in-process and NCCL groups on CUDA.
//
// With sequence parallelism (sequence_parallel: true) a rank's activations
// between the blocks are its shard of the rows, T/tp of T: ColumnForward
// all-gathers them (AllGatherMatMul), RowForward reduce-scatters the
// partial products back to shards (MatMulReduceScatter), and in the
// backward ColumnBackward reduce-scatters and GatherRows all-gathers.
// Without it the activations are replicated: ColumnForward multiplies
// without communication, RowForward and ColumnBackward all-reduce
// (MatMulAllReduce), GatherRows copies.
//
// # Layout choices (the engine's, documented here with the patterns)
//
//   - Attention: q_proj, k_proj and v_proj column-parallel (query heads
//     split over the group; key/value heads split, or, when there are
//     fewer than tp, each rank keeping the whole k_proj and v_proj and
//     multiplying by the rows of the one head its queries use); o_proj
//     row-parallel.
//   - Experts: folded into expert parallelism, not split along the ffn
//     dimension. The expert group spans the ep x tp ranks of a data and
//     context position (comm's mesh), each holding experts/(ep*tp) whole
//     experts, and the MoE layer runs on each tp rank's share of the rows.
//     Folding needs no new collective (the token all-to-all is the one
//     expert parallelism has), keeps every expert's weights whole, so
//     checkpoints shard experts exactly as expert parallelism does, and
//     keeps the grouped expert products as large as they are.
//   - LM head: vocabulary-parallel, each rank's logits only for its slice
//     of the vocabulary, with a parallel cross-entropy: every rank's
//     log-sum-exp of its slice is all-gathered (one collective carries the
//     max and the sum of exponentials together) and combined, and the
//     target's logit, held by one rank, all-reduced
//     (backend.Backend's CrossEntropyShard and CrossEntropyShardFinish).
//   - Embedding: replicated. Its forward is a row lookup with no product to
//     split, a vocabulary-parallel one would cost a reduce-scatter of the
//     activations per layer pass for a table that is small next to the
//     experts, and its gradient is summed over the group like a norm's.
//   - Norms, the router (and shared experts): replicated; their gradients
//     are summed over the group where the ranks compute them on different
//     rows (sequence parallelism, and always the router, which sees one
//     rank's share of the rows).
package tensorpar
