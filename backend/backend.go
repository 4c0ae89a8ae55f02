// Package backend defines the narrow compute interface every mktrain layer is
// written against, and the tensors it hands out.
//
// The compute model has no autograd: each layer calls a forward op that saves
// what its backward needs, and the engine calls the backward ops in reverse
// order. Every op exists on every backend: backend/cpu is the plain-Go
// reference (float32, or float64 for gradient checks) and later backends are
// compared against it by the conformance suite in backend/backendtest.
//
// Shape legend used in names throughout the project:
//
//	T tokens in a micro-batch (B sequences x S positions)   D model dim
//	H query heads   KV key/value heads   Dh head dim   Q = H*Dh   KD = KV*Dh
//	V vocabulary    E experts   K experts per token (top-k)   F expert FFN dim
//	N rows routed to one expert (or to one rank)
//
// Tensors are row-major. Ops panic on shape mismatches: those are bugs in the
// caller, not bad user input, and the engine turns a panic inside a step into
// an error. Device failures (which the CPU backend never has) are sticky and
// reported by Sync.
//
// Beside Backend, a backend may offer optional capabilities, which callers
// find by type assertion: Precision (its tolerance against the float64
// reference), Deterministic (fixed-order adds on request), LaterReducer
// (reductions queued now and read later, under one wait: SumSquaresLater)
// and SquaringOptimizer (AdamW that sums the gradient's squares in its own
// pass: AdamWUpdateSquares). The helper functions named serve every
// backend, with or without the capability.
//
// Data crosses to and from the host as gorgonia.org/tensor dense tensors
// (Upload, Download; UploadSlice and DownloadFloat32 and the like wrap
// them for plain slices). A dense tensor's values are read through
// HostData, never its Data method directly (host.go says why).
package backend

import (
	"fmt"

	"gorgonia.org/tensor"
)

// DType is the element type of a Tensor.
type DType int

const (
	Float32 DType = iota + 1
	Float64
	Int32
	// BFloat16 holds values of the bfloat16 grid (8 significant bits,
	// float32's exponent range). It serves only as the storage of MatMul
	// operands and of the few ops that produce them (see
	// Backend.OperandType); every write to it rounds to nearest, ties to
	// even, and NaN stays NaN. Other ops refuse it.
	BFloat16
)

func (d DType) String() string {
	switch d {
	case Float32:
		return "float32"
	case Float64:
		return "float64"
	case Int32:
		return "int32"
	case BFloat16:
		return "bfloat16"
	}
	return fmt.Sprintf("DType(%d)", int(d))
}

// Tensor is a handle to backend-owned memory. Its contents are reached only
// through the Backend that made it.
type Tensor interface {
	Shape() []int
	DType() DType
	// Len is the number of elements.
	Len() int
}

// AttnShape describes one attention call: Batch sequences of Seq query
// positions, Heads query heads sharing KVHeads key/value heads (GQA),
// HeadDim per head. Scores are scaled by 1/sqrt(HeadDim) and masked
// causally: key j is visible to query i iff j <= QOffset + i; with Full,
// every key is visible to every query.
//
// KVSeq and QOffset let the queries be a contiguous slice of a longer
// sequence of keys, as on a context-parallel rank: q and out are
// [Batch*Seq, H*Dh], k and v [Batch*Keys(), KV*Dh], lse [Batch, H, Seq].
// Their zero values give plain causal self-attention (KVSeq = Seq,
// QOffset = 0). Ops require 0 <= QOffset and QOffset+Seq <= Keys(); the
// backward writes dk and dv for all Keys() rows, zero where no query sees a
// key.
type AttnShape struct {
	Batch, Seq, Heads, KVHeads, HeadDim int

	// KVSeq is the number of key/value positions per sequence; 0 means Seq.
	KVSeq int
	// QOffset is the position of query 0 counted in key positions.
	QOffset int
	// Full drops the mask: every query sees all Keys() keys of its
	// sequence (QOffset must be 0). A context-parallel ring uses it for
	// the blocks of keys that lie wholly before their queries.
	Full bool
}

// ZigzagShape is one rank's part of causal attention over sequences split
// in zigzag order across Ranks ranks (context parallelism): each sequence
// of S = 2*Ranks*Chunk positions is cut into 2*Ranks chunks of Chunk, and
// rank r holds chunks r and 2*Ranks-1-r. Every rank's tensors are laid
// out alike: per sequence b of Batch, its 2*Chunk local rows are chunk r's
// Chunk rows, then chunk 2*Ranks-1-r's; q, out, dout and dq are
// [Batch*2*Chunk, Heads*HeadDim], k, v, dk and dv [Batch*2*Chunk,
// KVHeads*HeadDim], lse and delta [Batch, 2, Heads, Chunk]. A query at
// position p sees the keys at positions 0..p of its sequence, whichever
// rank holds them. Scores are scaled by 1/sqrt(HeadDim), as AttnShape's.
type ZigzagShape struct {
	Ranks, Rank             int // W, and the rank whose rows an op computes
	Batch, Chunk            int // B sequences, C positions per chunk
	Heads, KVHeads, HeadDim int
}

// Seq is the whole sequence length, 2*Ranks*Chunk.
func (s ZigzagShape) Seq() int { return 2 * s.Ranks * s.Chunk }

// Check says in a sentence what is wrong with s, or returns nil.
func (s ZigzagShape) Check() error {
	switch {
	case s.Ranks < 1 || s.Rank < 0 || s.Rank >= s.Ranks:
		return fmt.Errorf("zigzag attention: rank %d of %d is out of range", s.Rank, s.Ranks)
	case s.Batch < 1 || s.Chunk < 1 || s.Heads < 1 || s.KVHeads < 1 || s.HeadDim < 1:
		return fmt.Errorf("zigzag attention: shape %+v: all sizes must be positive", s)
	case s.Heads%s.KVHeads != 0:
		return fmt.Errorf("zigzag attention: heads %d is not a multiple of kv heads %d", s.Heads, s.KVHeads)
	}
	return nil
}

// Owner returns the rank that holds chunk c (0 <= c < 2*Ranks) and the
// first local row of the chunk on that rank (0 or Chunk).
func (s ZigzagShape) Owner(c int) (rank, row int) {
	if c < s.Ranks {
		return c, 0
	}
	return 2*s.Ranks - 1 - c, s.Chunk
}

// LocalChunk returns the chunk that local chunk n (0 or 1) of rank rank is.
func (s ZigzagShape) LocalChunk(rank, n int) int {
	if n == 0 {
		return rank
	}
	return 2*s.Ranks - 1 - rank
}

// Keys is the number of key/value positions per sequence: KVSeq, or Seq
// when KVSeq is 0.
func (s AttnShape) Keys() int {
	if s.KVSeq == 0 {
		return s.Seq
	}
	return s.KVSeq
}

// AdamW holds one optimizer update's hyper-parameters. Step counts from 1 and
// drives the bias correction. GradScale multiplies the gradient before the
// update (gradient clipping folded into the optimizer pass); 0 means 1.
type AdamW struct {
	LR, Beta1, Beta2, Eps, WeightDecay float64
	Step                               int
	GradScale                          float64
}

// GradFactor is the factor AdamWUpdate applies to the gradient: GradScale,
// or 1 when it is 0.
func (h AdamW) GradFactor() float64 {
	if h.GradScale == 0 {
		return 1
	}
	return h.GradScale
}

// Backend is the set of ops the model is built from. Unless an op says it
// accumulates, it overwrites its outputs. Row-vector arguments named ...T,
// ...N, ...TK are Int32 tensors where they hold indices.
type Backend interface {
	// Name is "cpu" or "cuda"; FloatType is the dtype New uses for
	// parameters and activations.
	Name() string
	FloatType() DType
	// OperandType is the dtype in which layers keep the tensors they feed
	// to MatMul (expert activations): BFloat16 where MatMul multiplies in
	// bf16 anyway (cuda), so the product reads them without a conversion;
	// FloatType where it does not (cpu, which stays the exact reference).
	OperandType() DType

	// New allocates a zeroed tensor.
	New(dt DType, shape ...int) Tensor
	// View returns a tensor sharing t's memory, starting offset elements
	// into t, with the given shape.
	View(t Tensor, offset int, shape ...int) Tensor
	// Upload copies host data into dst; src must have dst's length. Float
	// data is converted to dst's float type (rounded to nearest even for a
	// BFloat16 dst).
	Upload(dst Tensor, src *tensor.Dense)
	// Download copies t to a new host tensor of t's dtype and shape; a
	// BFloat16 tensor comes back as float32, which holds its values
	// exactly.
	Download(t Tensor) *tensor.Dense
	// StartDownload is Download without the wait: it queues the copy of
	// t's contents as they are once the work queued before it is done,
	// and returns at once. Calling the result waits for that copy (the
	// rest of the queue goes on) and returns it; call it once. A layer
	// that needs on the host, later in the step, what a kernel writes
	// now (the MoE backward's expert counts) reads it this way instead of
	// stopping the device's queue.
	StartDownload(t Tensor) PendingDownload
	// Sync waits for queued work and returns the first device error since
	// the last Sync.
	Sync() error

	// Elementwise and reductions. Zero and Copy accept every dtype; Copy
	// takes the same dtype on both sides, or a float src into a BFloat16
	// dst, which rounds (to nearest even). The others take the float type.
	Zero(t Tensor)
	Copy(dst, src Tensor)
	Axpy(dst Tensor, alpha float64, x Tensor) // dst += alpha*x
	Scale(t Tensor, alpha float64)
	Sum(t Tensor) float64
	SumSquares(t Tensor) float64

	// MatMul computes out = alpha*op(a)*op(b) + beta*out for 2-D tensors,
	// where op transposes when trans is set. beta=0 ignores out's contents.
	// a and b are each of the float type or BFloat16 (the product is of
	// their values either way); out is of the float type, or BFloat16
	// (the result rounded) only with beta = 0.
	MatMul(out, a, b Tensor, transA, transB bool, alpha, beta float64)

	// GroupedMatMul multiplies consecutive groups of rows by a matrix of
	// their own (the MoE experts' forward and input-gradient products).
	// Group g is the rows [o_g, o_g+n_g) of aRK and outRN (see Groups),
	// and its matrix is block g of bG, which stacks G matrices by rows:
	// [G*N, K] used transposed when transB, else [G*K, N]:
	//   outRN[o_g:o_g+n_g] = alpha*aRK[o_g:o_g+n_g]·op(b_g) + beta*outRN[o_g:o_g+n_g]
	// Rows past the last group are not touched. Types and beta are as
	// for MatMul. Unlike a loop of MatMul calls it tells the backend that
	// the row counts change from call to call (see GroupedMatMulDims).
	GroupedMatMul(outRN, aRK, bG Tensor, groups Groups, transB bool, alpha, beta float64)
	// GroupedMatMulTN is the weight-gradient product of the same groups:
	// for every group g, with outG stacking G blocks [M, N] by rows,
	//   out_g = alpha*aRM[o_g:o_g+n_g]ᵀ·bRN[o_g:o_g+n_g] + beta*out_g
	// A group with no rows gets beta*out_g. out is of the float type.
	GroupedMatMulTN(outGMN, aRM, bRN Tensor, groups Groups, alpha, beta float64)
	// ReadsGroupOffsets reports whether GroupedMatMul's NT products of
	// groups matrices [n, k] (transB, operand-type operands, beta 0) and
	// DispatchSwiGLU and DownCombine of those widths read Groups.Offsets
	// where they are, without the host reading them (which waits for the
	// device): the MoE layer gives its forward's products device offsets
	// alone only where they do.
	ReadsGroupOffsets(n, k, groups int) bool

	// EmbeddingForward gathers rows: outTD[t] = tableVD[idsT[t]].
	EmbeddingForward(outTD, tableVD, idsT Tensor)
	// EmbeddingBackward accumulates dTableVD[idsT[t]] += dOutTD[t].
	EmbeddingBackward(dTableVD, dOutTD, idsT Tensor)

	// RMSNormForward: out = x / rms(x) * w, saving rstdT = 1/rms(x). out
	// is of the float type or BFloat16 (rounded once: the normalised
	// input as the products read it). copyTD, when not nil, gets a copy
	// of x in the same pass (the residual stream that the block after
	// the norm adds its output to).
	RMSNormForward(outTD, rstdT, copyTD, xTD, wD Tensor, eps float64)
	// RMSNormBackward writes dxTD = beta*dxTD + the gradient of x (dx is
	// not read when beta is 0; beta 1 adds the norm's share onto the
	// residual stream's gradient in the same pass) and accumulates into
	// dwD. dx must not overlap dout.
	RMSNormBackward(dxTD, dwD, doutTD, xTD, wD, rstdT Tensor, beta float64)

	// RoPE writes outTQ = xTQ (T rows of heads*headDim) rotated with the
	// rotate-half convention at the positions posT; inverse rotates back,
	// which is the backward. x is of the float type; out is x itself (in
	// place) or a tensor of the same shape that does not overlap it, of
	// the float type or BFloat16 (rounded once, from the float rotation:
	// the attention core's bf16 q and k, and the gradients' bf16 operands,
	// without a separate conversion pass).
	RoPE(outTQ, xTQ, posT Tensor, headDim int, theta float64, inverse bool)

	// AttentionForward computes causal GQA attention. qTQ is [T, H*Dh],
	// kTK and vTK are [T, KV*Dh], outTQ is [T, H*Dh]; lseBHS saves each query
	// row's log-sum-exp of scaled scores for the backward. q, k and v are
	// all of the float type or all BFloat16 (a backend whose kernels
	// multiply in bf16 then reads them as they are); lse is of the float
	// type, and out too or, beside bf16 q, k and v, BFloat16 (rounded
	// once: the output projection's operand).
	AttentionForward(outTQ, lseBHS, qTQ, kTK, vTK Tensor, s AttnShape)
	// AttentionBackward writes dq, dk, dv (of the float type; q, k, v and
	// out as AttentionForward's; dout of the float type, or BFloat16
	// beside bf16 q, k and v, as it must be beside a bf16 out).
	AttentionBackward(dqTQ, dkTK, dvTK, doutTQ, qTQ, kTK, vTK, outTQ, lseBHS Tensor, s AttnShape)
	// AttentionMerge folds the attention of a query row over a second
	// set of keys into its attention over the first: for every row and
	// head (out and part [Batch*Seq, H*Dh], lse and partLse [Batch, H,
	// Seq], as AttentionForward writes them for s),
	//   lse' = log(exp(lse) + exp(partLse))
	//   out' = out*exp(lse-lse') + part*exp(partLse-lse')
	// in place in outTQ and lseBHS. A row whose lse is -inf saw no keys
	// and weighs nothing; where both are -inf, out' is 0 and lse' -inf.
	AttentionMerge(outTQ, lseBHS, partTQ, partLseBHS Tensor, s AttnShape)

	// SwiGLUForward: out = silu(a) * b, elementwise over [N, F]. a and b
	// are both of the float type or both BFloat16; out is either (a
	// BFloat16 out holds the rounded result).
	SwiGLUForward(outNF, aNF, bNF Tensor)
	// SwiGLUBackward writes daNF and dbNF. dout is of the float type; a
	// and b are both of the float type or both BFloat16, and so are da
	// and db (rounded).
	SwiGLUBackward(daNF, dbNF, doutNF, aNF, bNF Tensor)

	// CrossEntropy computes per-row lossT[t] = logsumexp(logits[t]) -
	// logits[t][targets[t]] and writes dlogitsTV = (softmax - onehot) *
	// gradScale. dlogitsTV may be logitsTV itself, or a BFloat16 tensor
	// (rounded once: the operand of the LM head's backward products). A
	// negative target is ignored (loss 0, gradient 0).
	CrossEntropy(lossT, dlogitsTV, logitsTV, targetsT Tensor, gradScale float64)
	// CrossEntropyShard and CrossEntropyShardFinish are CrossEntropy for
	// logits split by vocabulary over tensor-parallel ranks, each holding
	// the logits [T, V_s] of the ids [vocabLo, vocabLo+V_s) (package
	// tensorpar; the engine's LM head). CrossEntropyShard writes per row
	// lseT, the log-sum-exp of the slice, and targetLogitT, the target's
	// logit when the slice holds it and 0 otherwise (or for a negative
	// target). The caller all-gathers lseT into lseRT [R, T] (rank order)
	// and all-reduces targetLogitT; CrossEntropyShardFinish then writes
	// lossT[t] = logsumexp_r(lseRT[r][t]) - targetLogitT[t] (the same on
	// every rank) and dlogitsTV = (softmax over the whole row, this
	// slice's part - onehot) * gradScale. dlogitsTV may be logitsTV. A
	// negative target gives loss 0 and a zero gradient row.
	CrossEntropyShard(lseT, targetLogitT, logitsTV, targetsT Tensor, vocabLo int)
	CrossEntropyShardFinish(lossT, dlogitsTV, logitsTV, lseRT, targetLogitT, targetsT Tensor, vocabLo int, gradScale float64)

	// RouterForward: probsTE = softmax(logitsTE); lseT = logsumexp of each
	// logits row (for the z-loss); idxTK = the k experts with the largest
	// probs+biasE (biasE may be nil; it steers selection only), best first;
	// gatesTK = probs at idxTK renormalised to sum 1.
	RouterForward(probsTE, lseT, idxTK, gatesTK, logitsTE, biasE Tensor)
	// RouterBackward writes dlogitsTE from the gradient of the gates
	// (dgatesTK), plus auxDProbE[e] added to every row's dprobs (the
	// load-balancing loss), plus zScale*lse[t]*probs[t,e] (the z-loss
	// gradient, zScale = 2*coef/tokens).
	RouterBackward(dlogitsTE, dgatesTK, probsTE, lseT, idxTK, gatesTK, auxDProbE Tensor, zScale float64)

	// RouteByExpert sorts a router's choices for the dispatch, on the
	// device: with E = countsE.Len(), countsE[e] (of the float type: the
	// counts are exact below 2^24 assignments) is the number of
	// assignments to expert e, offsetsE1 (Int32 [E+1]) their prefix sums
	// (offsetsE1[e] the assignments to experts below e, offsetsE1[E] =
	// T*K: the dispatch's Groups.Offsets), and sendTokS and sendSlotS
	// ([T*K] each) list every assignment a = t*K + k of idxTK grouped by
	// expert (expert 0's first) and in assignment order within an expert:
	// sendSlotS[i] = a, sendTokS[i] = a / K; and sendPosTK (Int32
	// [T*K], or nil) the inverse, where each assignment went:
	// sendPosTK[a] = i (GatherSumRows' positions). Every idxTK entry must
	// lie in [0, E).
	RouteByExpert(countsE, offsetsE1, sendTokS, sendSlotS, sendPosTK, idxTK Tensor)

	// GatherRows: outND[i] = scale[i] * inTD[rowsN[i]]; scaleN may be nil
	// (1). scale is of the float type; in is too, or BFloat16; out is of
	// the float type, or BFloat16 (rounded).
	GatherRows(outND, inTD, rowsN, scaleN Tensor)
	// ScatterAddRows: outTD[rowsN[i]] += scale[i] * inND[i]; scaleN may be nil.
	ScatterAddRows(outTD, inND, rowsN, scaleN Tensor)
	// GatherSumRows is ScatterAddRows turned into a gather, for rows that
	// reach each output row at most K times (the MoE combine and its
	// backward): outTD[t] += Σ_k scaleTK[t,k]·inSD[posTK[t,k]], skipping
	// posTK[t,k] < 0 (nothing sent), the terms added in increasing
	// position (the order a scatter over inSD's rows adds them), each
	// product and sum rounded on its own, so backends of one float type
	// give the same bits, and ScatterAddRows' on the CPU. posTK is Int32
	// [T, K], its entries in [-1, S) and a row's non-negative ones
	// distinct; scaleTK [T, K] of the float type, or nil (1); inSD of the
	// float type or BFloat16; outTD of the float type. Each output row is
	// read and written once, with no atomics.
	GatherSumRows(outTD, inSD, posTK, scaleTK Tensor)
	// RowDots: outN[i] = dot(aTD[rowsN[i]], bND[i]). out and a are of the
	// float type; b too, or BFloat16 (the MoE layer's expert outputs).
	RowDots(outN, aTD, rowsN, bND Tensor)

	// Peer-row ops: the MoE dispatch and combine when a rank reaches its
	// peers' buffers directly (the virtual ranks of one backend, or GPUs of
	// one process with peer access) instead of through an all-to-all. The
	// slices hold one tensor per rank of the expert group, in group-rank
	// order; refsR2 is an Int32 [R, 2] tensor of row references (s, p):
	// rank s, position p of that rank's send order. Every referenced
	// position must exist.

	// PeerRowRefs writes refsR2 (Int32 [R, 2]) from blocks of consecutive
	// references: row r belongs to the last block b with First <= r, and
	// refsR2[r] = (blocks[b].Rank, blocks[b].Pos + r - blocks[b].First).
	// The blocks are in order of First, the first at row 0 when R > 0
	// (empty blocks may repeat a First). Only the table crosses to the
	// device, not R references (moe's fused dispatcher: one block per
	// source rank and local expert).
	PeerRowRefs(refsR2 Tensor, blocks []RowBlock)
	// GatherPeerRows: for row r with (s, p) = refsR2[r] and t = tokS[s][p],
	//   outRD[r] = scaleS[s][p] * srcTD[s][t]
	// scaleS may be nil (1). Sources and scales are of the float type; out
	// is too, or BFloat16 (rounded). The sources may instead all be
	// BFloat16 (the operand type), with a BFloat16 out and no scales: each
	// row is then copied exactly.
	GatherPeerRows(outRD Tensor, srcTD, tokS, scaleS []Tensor, refsR2 Tensor)
	// ScatterPeerRows: outSD[s][p] = inRD[r] for (s, p) = refsR2[r]; the
	// references must be distinct. All of the float type, or all BFloat16
	// (rows copied as they are).
	ScatterPeerRows(outSD []Tensor, inRD, refsR2 Tensor)
	// MarkPeerRows raises the completion flag of every referenced row:
	// doneS[s][p] = 1 for (s, p) = refsR2[r], published after the work
	// queued before it (the rows it completes). doneS are Int32, one flag
	// per send row of each rank.
	MarkPeerRows(doneS []Tensor, refsR2 Tensor)
	// CombineRows is the source rank's combine of rows that its peers
	// write and flag (DownCombine, DgradCombine with flags): for each
	// send row i, once doneS[i] is 1,
	//   outTD[rowsS[i]] += scaleS[i] * inSD[i], then doneS[i] = 0
	// (scaleS may be nil: 1), so the flags are clear for the next step.
	// sendCounts ([EP]) are the rows sent to each rank of the expert
	// group, in send order: a row whose flag never rises is reported, at
	// the next Sync, with the rank that owed it (a bounded wait on the
	// GPU; at once on the CPU), and is not added.
	CombineRows(outTD, inSD, rowsS, scaleS, doneS Tensor, sendCounts []int)
	// DispatchSwiGLU is the experts' gate/up half fused with the dispatch
	// (Dispatch+GEMM): the rows are gathered as by GatherPeerRows(xRD,
	// srcTD, tokS, nil, refsR2) (srcTD of the float type, or BFloat16:
	// half the bytes to move), then, per group g of groups (as in
	// GroupedMatMul),
	//   h1RF = xRD·W1_gᵀ, h3RF = xRD·W3_gᵀ, actRF = silu(h1RF) * h3RF
	// with w1GFD and w3GFD stacking the G matrices [F, D] by rows. xRD,
	// h1RF, h3RF and actRF are of the operand type; xRD, h1RF and h3RF are
	// kept for the backward.
	DispatchSwiGLU(xRD, h1RF, h3RF, actRF Tensor, srcTD, tokS []Tensor, refsR2, w1GFD, w3GFD Tensor, groups Groups)
	// DownCombine is the experts' down projection fused with the combine
	// (GEMM+Combine): per group g, y = actRF·W2_gᵀ (w2GDF stacking the G
	// matrices [D, F]), and row r of y is written to outSD[s][p], (s, p) =
	// refsR2[r]: straight into its source rank's buffer, in the source's
	// send order. outSD are of the float type, or all BFloat16 (each value
	// rounded once from the float product). doneS, when not nil, are
	// the ranks' row flags: each row's is raised once the whole row is
	// written (as MarkPeerRows), for the source's CombineRows.
	DownCombine(outSD, doneS []Tensor, refsR2, actRF, w2GDF Tensor, groups Groups)
	// DispatchDgradSwiGLU is the experts' backward through the down
	// projection and SwiGLU, fused with the dispatch of the output
	// gradients: the rows are gathered, scaled by their gates, as by
	// GatherPeerRows(dyRD, srcTD, tokS, scaleS, refsR2), then per group g
	//   dAct  = dyRD·W2_g              (w2GDF stacking the G matrices [D, F])
	//   dh1RF = dAct * h3RF * silu'(h1RF)
	//   dh3RF = dAct * silu(h1RF)
	// dAct is not kept (the fused kernel holds it in float32). dyRD, dh1RF
	// and dh3RF are of the operand type and are kept for the weight
	// gradients.
	DispatchDgradSwiGLU(dyRD, dh1RF, dh3RF Tensor, srcTD, tokS, scaleS []Tensor, refsR2, h1RF, h3RF, w2GDF Tensor, groups Groups)
	// DgradCombine is the experts' input gradient fused with its combine:
	// per group g, dx = dh1RF·W1_g + dh3RF·W3_g (w1GFD and w3GFD stacking
	// the G matrices [F, D]), and row r of dx is written to outSD[s][p],
	// (s, p) = refsR2[r], as DownCombine writes y, and flagged in doneS
	// (when not nil) as DownCombine flags them. outSD are of the float
	// type.
	DgradCombine(outSD, doneS []Tensor, refsR2, dh1RF, dh3RF, w1GFD, w3GFD Tensor, groups Groups)

	// The zigzag context-parallel attention of one rank that reads its
	// peers' tensors directly (the fused ring; see ZigzagShape for the
	// layout). kTK, vTK and the other per-rank lists hold every rank's
	// tensor, indexed by rank, this rank's own included.
	//
	// ZigzagAttentionForward writes this rank's out [B*2C, H*Dh] and lse
	// [B, 2, H, C] for its queries qTQ, over the keys of every rank that
	// they see: exactly the attention of the whole sequence, restricted to
	// this rank's rows.
	ZigzagAttentionForward(outTQ, lseBHS, qTQ Tensor, kTK, vTK []Tensor, s ZigzagShape)
	// ZigzagAttentionSupports says why the three zigzag ops do not take s,
	// or returns nil when they do (the CPU takes every valid shape; the
	// CUDA kernels have limits on head dim and chunk length). Callers use
	// another context-parallel path where they do not.
	ZigzagAttentionSupports(s ZigzagShape) error
	// ZigzagAttentionBackwardDQ writes this rank's dq and deltaBHS
	// ([B, 2, H, C], D_i = rowsum(dout_i * out_i), for the peers' dk/dv)
	// from its dout, q, out and lse and every rank's k and v.
	ZigzagAttentionBackwardDQ(dqTQ, deltaBHS, doutTQ, qTQ, outTQ, lseBHS Tensor, kTK, vTK []Tensor, s ZigzagShape)
	// ZigzagAttentionBackwardDKDV writes this rank's dk and dv (overwrites)
	// for its keys kTK and values vTK from every query that sees them:
	// every rank's q, dout, lse and delta (as ZigzagAttentionBackwardDQ
	// left it). The peers' deltas must be complete before the call.
	ZigzagAttentionBackwardDKDV(dkTK, dvTK, kTK, vTK Tensor, qTQ, doutTQ, lseBHS, deltaBHS []Tensor, s ZigzagShape)
	// The one-pass fused ring, where ZigzagAttentionOnePass says the
	// backend takes s: ZigzagAttentionForward on bf16 q, k and v (every
	// rank's k and v read in place), then per rank ZigzagAttentionPrepare
	// and one ZigzagAttentionBackward, which writes its own dk and dv and
	// adds its keys' share of every rank's dq into that rank's dq. The
	// kernels need no second pass and no per-head sums, at the price of
	// dq's adds landing in no fixed order.
	//
	// ZigzagAttentionOnePass says why the one-pass ops do not take s on
	// this backend (its device, or SetDeterministic), or returns nil when
	// they do. Where it is nil, ZigzagAttentionForward also takes bf16 q,
	// k and v.
	ZigzagAttentionOnePass(s ZigzagShape) error
	// ZigzagAttentionPrepare readies this rank's inputs to the one-pass
	// backward from its doutTQ and outTQ (float): deltaBHS [B, 2, H, C],
	// D_i = rowsum(dout_i * out_i) per row and head; doutBF16TQ, dout
	// rounded to bf16; and dqTQ (float) zeroed.
	ZigzagAttentionPrepare(deltaBHS, doutBF16TQ, dqTQ, doutTQ, outTQ Tensor, s ZigzagShape)
	// ZigzagAttentionBackward writes this rank's dk and dv (overwrites,
	// float) for its bf16 keys kTK and values vTK from every query that
	// sees them, and adds their share of each rank's dq into dqTQ[rank]
	// (float, zeroed by its owner before the meeting), from every rank's
	// bf16 q and dout and float lse and delta (ZigzagAttentionPrepare's).
	// Every rank's zeroed dq and delta must be complete before the call,
	// and no rank may read its dq before every rank's call is done.
	ZigzagAttentionBackward(dqTQ []Tensor, dkTK, dvTK, kTK, vTK Tensor, qTQ, doutTQ, lseBHS, deltaBHS []Tensor, s ZigzagShape)

	// Tensor parallelism's fused products (see tensorpar.go): a product
	// and the collective around it in one op that reads or writes the
	// peers' tensors directly. The lists hold every rank's tensor, indexed
	// by rank; rank is the caller's.
	//
	// AllGatherMatMul writes fullRK, the row blocks shardsBK stacked in
	// rank order, and outs[i] = fullRK·op(ws[i]) (op transposes when
	// transW). fullRK nil: the gathered rows are not kept.
	AllGatherMatMul(fullRK Tensor, outs []Tensor, shardsBK []Tensor, ws []Tensor, transW bool, rank int)
	// MatMulScatter computes p = a·op(w), [R, N], and lands row block s of
	// p (R/len(dstsS) rows) in dstsS[s] from row row0, as landing says.
	MatMulScatter(dstsS []Tensor, row0 int, a, w Tensor, transW bool, landing ScatterLanding, rank int)

	// AdamWUpdate updates param in place from grad with moments m and v.
	AdamWUpdate(param, grad, m, v Tensor, h AdamW)
	// AdamWUpdateSplit is AdamWUpdate on split float32 masters
	// (SplitMaster): hi [n] BFloat16 and lo [n/2] Int32 are the halves of
	// n masters (n even), which it updates bit for bit as AdamWUpdate
	// updates float32 ones, writing their halves back; grad, m and v are
	// float [n]. A backend whose float type is not float32 refuses it.
	AdamWUpdateSplit(hi, lo, grad, m, v Tensor, h AdamW)
}

// LaterReducer is an optional capability of a backend whose reductions
// wait for the device: SumLater and SumSquaresLater queue Sum(t) and
// SumSquares(t) of t as it is once the work queued before is done, and
// return a function that waits for it and returns it, so that a step's
// reductions share one wait instead of a round trip each. The function
// must be called once. SumLater and SumSquaresLater (the functions) serve
// every backend.
type LaterReducer interface {
	SumLater(t Tensor) func() float64
	SumSquaresLater(t Tensor) func() float64
}

// SumLater is b's SumLater where b is a LaterReducer, else Sum(t) now,
// returned as the function.
func SumLater(b Backend, t Tensor) func() float64 {
	if r, ok := b.(LaterReducer); ok {
		return r.SumLater(t)
	}
	s := b.Sum(t)
	return func() float64 { return s }
}

// SumSquaresLater is b's SumSquaresLater where b is a LaterReducer, else
// SumSquares(t) now, returned as the function.
func SumSquaresLater(b Backend, t Tensor) func() float64 {
	if r, ok := b.(LaterReducer); ok {
		return r.SumSquaresLater(t)
	}
	s := b.SumSquares(t)
	return func() float64 { return s }
}

// SquaringOptimizer is an optional capability of a LaterReducer: AdamW
// updates that also queue the sum of the squares of the gradient they
// read (as given, before GradScale), each returning SumSquaresLater's
// function. Where the norm does not gate the update (the experts' AdamW
// in the backward, which nothing clips) that saves a second pass over the
// gradient. The sum may add in another order than SumSquares; a backend
// adds in a fixed order all the same. AdamWUpdateSquares and
// AdamWUpdateSplitSquares (the functions) serve every backend.
type SquaringOptimizer interface {
	AdamWUpdateSquares(param, grad, m, v Tensor, h AdamW) func() float64
	AdamWUpdateSplitSquares(hi, lo, grad, m, v Tensor, h AdamW) func() float64
}

// AdamWUpdateSquares is b's AdamWUpdateSquares where b is a
// SquaringOptimizer, else SumSquaresLater(b, grad) and then
// b.AdamWUpdate.
func AdamWUpdateSquares(b Backend, param, grad, m, v Tensor, h AdamW) func() float64 {
	if o, ok := b.(SquaringOptimizer); ok {
		return o.AdamWUpdateSquares(param, grad, m, v, h)
	}
	sq := SumSquaresLater(b, grad)
	b.AdamWUpdate(param, grad, m, v, h)
	return sq
}

// AdamWUpdateSplitSquares is AdamWUpdateSquares for
// AdamWUpdateSplit.
func AdamWUpdateSplitSquares(b Backend, hi, lo, grad, m, v Tensor, h AdamW) func() float64 {
	if o, ok := b.(SquaringOptimizer); ok {
		return o.AdamWUpdateSplitSquares(hi, lo, grad, m, v, h)
	}
	sq := SumSquaresLater(b, grad)
	b.AdamWUpdateSplit(hi, lo, grad, m, v, h)
	return sq
}

// Deterministic is an optional capability of a backend some of whose ops
// add with float atomics, in an order that varies from run to run, and
// that can add in a fixed order instead, at some cost: after
// SetDeterministic(true) the same ops on the same inputs give the same bits
// on every run (train.deterministic). A backend without it adds in a fixed
// order already (the CPU backend).
type Deterministic interface {
	SetDeterministic(on bool)
}

// Precision is an optional capability: a Backend that computes some ops
// below the precision of its FloatType (the CUDA backend stores float32 but
// multiplies matrices in bf16) reports the relative tolerance it meets
// against a float64 reference. The conformance suite (backend/backendtest)
// uses it instead of the tolerance of the float type.
type Precision interface {
	RelTolerance() float64
}
