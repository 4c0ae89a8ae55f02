package plan

// The terms of one rank's device memory, each the allocations of the code
// it names, and what the ranks of one device share. Every b.New of the
// engine, moe and attention packages that lives through a step has its
// line here; the tests build the model on a counting backend and compare
// (plan_test.go), so a new buffer there that is missing here fails them.

// ledger collects allocations into terms.
type ledger struct {
	cuda      bool  // each allocation reserves its size class (backend/cuda/memory.go)
	fineAbove int64 // where the classes get finer (Device.FineClassesAbove)
	terms     []Term
}

// alloc records n allocations of elems elements of size bytes each as the
// term (kind, what); worstElems is an allocation's elements under the
// routing bound (elems where routing does not matter). Each allocation is
// one b.New: on the GPU its size class is what the allocator reserves.
func (l *ledger) alloc(kind Kind, what string, n, elems, worstElems, size int64) {
	bytes, worst := mul(max(elems, 1), size), mul(max(worstElems, 1), size)
	if l.cuda {
		bytes, worst = sizeClass(bytes, l.fineAbove), sizeClass(worst, l.fineAbove)
	}
	bytes, worst = mul(n, bytes), mul(n, worst)
	for i := range l.terms {
		if t := &l.terms[i]; t.Kind == kind && t.What == what {
			t.Bytes, t.Worst = add(t.Bytes, bytes), add(t.Worst, worst)
			return
		}
	}
	l.terms = append(l.terms, Term{Kind: kind, What: what, Bytes: bytes, Worst: worst})
}

// fixed is alloc for an allocation that routing does not change.
func (l *ledger) fixed(kind Kind, what string, n, elems, size int64) {
	l.alloc(kind, what, n, elems, elems, size)
}

const (
	int32Bytes = 4
	bf16Bytes  = 2
)

// rankTerms is one rank's device memory under dispatcher ("fused" or
// "unfused") and cpMode ("allgather" or "ring").
func rankTerms(s shape, dispatcher, cpMode string) []Term {
	s.cpRing = cpMode == CPRing
	l := &ledger{cuda: s.cuda, fineAbove: s.fineAbove}
	stores(l, s)
	modelActivations(l, s)
	attentionActivations(l, s, cpMode == CPRing, s.c.CPRingFused)
	moeActivations(l, s, dispatcher == DispatcherFused)
	collectiveScratch(l, s, cpMode == CPRing)
	tensorParallelFused(l, s)
	return l.terms
}

// tensorParallelFused mirrors tensorpar/fused.go: the fused reduce-scatter
// (the row-parallel o_proj, and the column-parallel products' input
// gradient) lands each rank's blocks in slots of their owner, W blocks of
// [T/W, D] (fused.slotTensor, grown to the largest call), where the
// backend has no float atomics (the CPU) or train.deterministic asks.
func tensorParallelFused(l *ledger, s shape) {
	if s.tpFused && (!s.cuda || s.c.Deterministic) {
		l.fixed(Workspace, "tensor-parallel fused reduce-scatter slots", 1, mul(s.T, s.D), s.ft)
	}
}

// stores mirrors engine/rank.go's newRankRounds and zero.go's newMoments:
// the weights and gradients are one flat store each (newParamStore), the
// products read a bf16 copy of the weights where the operand type is not
// the float type (newOperandStore: the GPU), and AdamW's m and v are
// flat stores of the weights' layout, or under ZeRO-1 the rank's pieces
// of the replicated range and its experts. The aux-loss-free bias is one
// [E] vector per layer (newRankRounds).
func stores(l *ledger, s shape) {
	switch {
	case s.c.SplitMasters && s.ot == 2 && s.ft == 4:
		// engine/master_split.go's newSplitWeightStore: float32 norms and
		// embedding, then the others' bf16 halves and low halves.
		split := s.flatTotal - s.flatPrefix
		l.fixed(Weights, "fp32 master weights (norms and embedding)", 1, s.flatPrefix, s.ft)
		l.fixed(Weights, "split masters: the bf16 halves the products read", 1, split, s.ot)
		l.fixed(Weights, "split masters: the low halves", 1, split/2, int32Bytes)
	case s.ot != s.ft:
		l.fixed(Weights, "fp32 master weights", 1, s.flatTotal, s.ft)
		l.fixed(Weights, "bf16 copy for the products", 1, s.flatTotal, s.ot)
	default:
		l.fixed(Weights, "fp32 master weights", 1, s.flatTotal, s.ft)
	}
	if s.c.ExpertsInBackward {
		// engine/expert_update.go's newLayerExpertGradStore: the store
		// ends where the experts begin, and every expert tensor's
		// gradient takes one tensor's buffer in turn.
		l.fixed(Gradients, "gradients (not the experts')", 1, s.flatReplicated, s.ft)
		l.fixed(Gradients, "expert gradients, one tensor's (updated in the backward)", 1, align(mul(s.El, s.F, s.D)), s.ft)
	} else {
		l.fixed(Gradients, "gradients", 1, s.flatTotal, s.ft)
	}
	what := "AdamW m and v"
	if s.zero {
		what = "AdamW m and v (ZeRO-1: a 1/N share of the replicated)"
	}
	l.fixed(Optimizer, what, 2, s.momentElems, s.ft)
	if s.c.BiasBalancing {
		l.fixed(Optimizer, "aux-loss-free routing bias", s.L, s.E, s.ft)
	}
}

// modelActivations mirrors engine/model.go's newModel: the micro-batch's
// token ids, targets and positions; per layer the residual stream
// entering it (residL, one more for the output), after attention (midL),
// the two normalised inputs (h1L, h2L) and their inverse RMS (rstd1L,
// rstd2L); the final norm's output and inverse RMS; every MoE layer's
// statistics; the backward's three [T, D] gradient streams; the LM head's
// chunk of at most lmHeadChunkRows rows of logits (float, and its bf16
// copy for the head's backward products on the GPU) and per-token losses.
func modelActivations(l *ledger, s shape) {
	T, R, D, L := s.T, s.R, s.D, s.L
	l.fixed(Activations, "embedding: token ids, targets, positions", 3, T, int32Bytes)
	l.fixed(Activations, "residual stream", add(L, 1), mul(R, D), s.ft) // residL
	l.fixed(Activations, "residual stream", L, mul(R, D), s.ft)         // midL
	l.fixed(Activations, "norms", mul(2, L), R, s.ft)                   // rstd1L, rstd2L
	l.fixed(Activations, "norms", 1, mul(R, D), s.normType())           // finalTD
	l.fixed(Activations, "norms", 1, R, s.ft)                           // rstdFinalT
	l.fixed(Activations, "moe router", 1, mul(L, 2*s.E+2), s.ft)        // moeStats: moe.StatsLen
	l.fixed(Workspace, "backward gradient streams", 3, mul(R, D), s.ft) // dResidTD, dBlockTD, dFinalTD

	l.fixed(Activations, s.fullTerm("norms"), mul(2, s.kept()), mul(R, D), s.normType()) // h1L, h2L
	chunk := min(T, lmHeadChunkRows)
	l.fixed(Activations, "lm head logits and loss", 1, mul(chunk, s.Vl), s.ft) // logitsCV
	l.fixed(Activations, "lm head logits and loss", 1, T, s.ft)                // lossT
	if s.ot != s.ft {
		l.fixed(Activations, "lm head logits and loss", 1, mul(chunk, s.Vl), s.ot) // dlogitsCV
	}
	if s.TP > 1 {
		// The vocabulary-parallel head: under sequence parallelism the
		// gathered final rows and their gradient's partial sums; the
		// sharded cross-entropy's per-chunk vectors.
		if R != T {
			l.fixed(Activations, "lm head logits and loss", 2, mul(T, D), s.ft) // finalFullTD, dFullTD
		}
		l.fixed(Activations, "lm head logits and loss", 2, chunk, s.ft)            // lseC, targetC
		l.fixed(Activations, "lm head logits and loss", 1, mul(s.TP, chunk), s.ft) // lseRC
	}
}

// lmHeadChunkRows mirrors engine/model.go's: the LM head and loss run in
// chunks of this many rows, so [T, V] logits never exist whole.
const lmHeadChunkRows = 2048

// attentionActivations mirrors attention/layer.go's newLayer and
// Scratch.fit, and attention/context.go under context parallelism: per
// layer q and the attention output a [T, H*Dh], k and v [T, KV*Dh] (after
// RoPE, kept for the backward: in the operand type, which the attention
// core reads, or under context parallelism in the float type) and the
// softmax's log-sum-exp [B, H, S/cp]; once per rank the backward's
// gradients of a, q, k, v and, where the operand type is not the float
// type, their bf16 copies and dout's (x comes in the operand type, or
// under tensor parallelism is gathered). With cp > 1, in mode allgather (attention/context.go), each layer
// also keeps k and v of the whole sequences in natural order and the two
// row maps, and the rank shares the all-gathered k, v (then dk, dv) and
// their per-call gradients; in mode ring (attention/ring.go) the rank
// shares only the chunks in flight: two k, v pairs and three dk, dv sums
// of its own size [T, KV*Dh], one block's output [C, H*Dh] and lse [H, C]
// and one block's dk, dv [2C, KV*Dh], C = S/(2cp); on the fused ring
// (attention/ring_fused.go) the rank shares one D_i [B, 2, H, C] for the
// peers' kernels, and in one pass bf16 copies of q, da [T, H*Dh], k and v
// [T, KV*Dh], where in two passes on CUDA with GQA the dk/dv pass writes
// one partial dk, dv [T, KV*Dh] per query head of a group (freed after).
//
// Under train.recompute: selective the output a and the log-sum-exp are
// the Scratch's, one set for the rank's layers (attention.RecomputeCore);
// under full q, k and v too, and the all-gather core's natural-order k
// and v (attention.RecomputeLayer).
func attentionActivations(l *ledger, s shape, ring, fused bool) {
	// This rank's heads under tensor parallelism.
	T, D, Q, KD, L := s.T, s.D, s.Ql, s.KDl, s.L
	core := s.kept() // layers that keep a and lse of their own
	if s.selective() {
		core = 1
	}
	qkv := s.fullTerm("attention")
	l.fixed(Activations, qkv, s.kept(), mul(T, Q), s.qkvType())          // qTQ
	l.fixed(Activations, qkv, mul(2, s.kept()), mul(T, KD), s.qkvType()) // kTK, vTK
	l.fixed(Activations, s.coreTerm(), core, mul(T, Q), s.daType())      // aTQ
	l.fixed(Activations, s.coreTerm(), core, mul(s.B, s.Hl, s.Sl), s.ft)
	l.fixed(Workspace, "attention backward", 1, mul(T, Q), s.daType()) // daTQ
	l.fixed(Workspace, "attention backward", 1, mul(T, Q), s.ft)       // dqTQ
	l.fixed(Workspace, "attention backward", 2, mul(T, KD), s.ft)      // dkTK, dvTK
	if s.ot != s.ft {
		l.fixed(Workspace, "attention backward", 1, mul(T, D), s.ot)  // operand doutTD (x comes in the operand type: no xTD)
		l.fixed(Workspace, "attention backward", 1, mul(T, Q), s.ot)  // operand dqTQ
		l.fixed(Workspace, "attention backward", 2, mul(T, KD), s.ot) // operands dkTK, dvTK
	}
	if s.CP > 1 && ring && fused {
		l.fixed(Workspace, "attention ring", 1, mul(s.B, s.Hl, s.Sl), s.ft) // deltaBHS
		if s.onePassRing() {
			l.fixed(Workspace, "attention ring", 1, mul(T, Q), bf16Bytes) // da rounded
		} else if group := Q / KD; s.cuda && group > 1 { // a rank's query heads per kv head
			l.fixed(Workspace, "attention ring", 1, mul(2, group, s.T, KD), s.ft) // dk, dv partials
		}
	}
	if s.CP > 1 && ring && !fused {
		C := s.Sl / 2
		l.fixed(Workspace, "attention ring", 10, mul(T, KD), s.ft)   // kv[2], sumOut, sumIn, sumStep: k and v each
		l.fixed(Workspace, "attention ring", 1, mul(C, Q), s.ft)     // partTQ
		l.fixed(Workspace, "attention ring", 1, mul(s.Hl, C), s.ft)  // partLseHS
		l.fixed(Workspace, "attention ring", 2, mul(2, C, KD), s.ft) // dkOneTK, dvOneTK
	}
	if s.TP > 1 {
		// tpScratch: the gathered rows, o_proj's partial sums, its rows.
		l.fixed(Workspace, "attention backward", 2, mul(T, D), s.ft) // fullTD, partialTD
		l.fixed(Workspace, "attention backward", 1, mul(s.R, D), s.ft)
	}
	if s.CP > 1 && !ring {
		rows := mul(s.B, s.S)                                            // natural-order rows of the full sequences
		l.fixed(Activations, "attention", mul(2, L), rows, int32Bytes)   // allOfNat, natOfAll
		l.fixed(Activations, qkv, mul(2, s.kept()), mul(rows, KD), s.ft) // kNatTK, vNatTK
		l.fixed(Workspace, "attention backward", 4, mul(rows, KD), s.ft) // kAllTK, vAllTK, dkNatTK, dvNatTK
		l.fixed(Workspace, "attention backward", 2, mul(s.S, KD), s.ft)  // dkOneTK, dvOneTK
	}
}

// normType is the bytes per element of the normalised inputs (attention's,
// the MoE block's, the LM head's: engine/model.go's normType): the
// operand type's, the float type's under tensor parallelism.
// moe/layer.go makes no operand copy (xoTD) of an input of the operand
// type.
func (s shape) normType() int64 {
	if s.TP > 1 {
		return s.ft
	}
	return s.ot
}

// onePassRing reports context parallelism on the fused ring in one pass
// (attention/ring_fused.go), whose layers keep q, k and v in bf16.
func (s shape) onePassRing() bool {
	return s.CP > 1 && s.cpRing && s.c.CPRingFused && s.c.CPRingOnePass
}

// qkvType is the bytes per element of the rotated q, k and v a layer
// keeps (attention.Layer's qkvType): the operand type's where the core is
// the backend's attention or the fused ring in one pass, the float type's
// under the other context-parallel paths.
func (s shape) qkvType() int64 {
	if s.CP > 1 && !s.onePassRing() {
		return s.ft
	}
	return s.ot
}

// daType is the bytes per element of the attention core's output a and
// its gradient da (attention/layer.go's daType): the operand type's on
// one rank, the float type's under context or tensor parallelism.
func (s shape) daType() int64 {
	if s.TP > 1 || s.CP > 1 {
		return s.ft
	}
	return s.ot
}

// selective reports train.recompute: selective.
func (s shape) selective() bool { return s.c.Recompute == RecomputeSelective }

// full reports train.recompute: full.
func (s shape) full() bool { return s.c.Recompute == RecomputeFull }

// kept is how many sets of a layer's activations the rank keeps: one per
// layer, or under train.recompute: full one for all of them (the shared
// scratch, refilled by each layer's rerun forward).
func (s shape) kept() int64 {
	if s.full() {
		return 1
	}
	return s.L
}

// fullTerm is the name of a term of activations that train.recompute:
// full keeps once per rank: what, or its recomputed set's name.
func (s shape) fullTerm(what string) string {
	if s.full() {
		return what + ", recomputed (one layer's)"
	}
	return what
}

// coreTerm and hiddenTerm name the terms of the activations that
// train.recompute: selective keeps once per rank instead of per layer.
func (s shape) coreTerm() string {
	if s.selective() {
		return "attention core, recomputed (one layer's)"
	}
	return s.fullTerm("attention")
}

func (s shape) hiddenTerm() string {
	if s.selective() {
		return "moe expert hidden, recomputed (one layer's)"
	}
	return s.fullTerm("moe experts")
}

// moeActivations mirrors moe/layer.go's New and Forward, moe/fused.go and
// moe/buffers.go. Per layer the router's [T, E] logits, probabilities
// and logits' gradient, [T, K] choices, gates and gates' gradient, [T]
// log-sum-exp and ones, and a few [E] vectors; the shared experts' six
// [T, Fs] activations and gradients; the routed rows, grown on demand
// (rowBuf) and kept through the backward: send indices, gates and their
// gradients per sent row, the expert inputs x [R, D] and hidden h1, h3,
// silu(h1)*h3 [R, F] in the operand type, the outputs y [S, D] (of the
// operand type on one expert rank); the unfused dispatcher's
// permutations (several expert ranks) or the fused one's row references
// and its bf16 input per layer. Once per rank the
// Scratch: the rows in transit and the experts' activation gradients, and
// under train.recompute: selective the hidden h1, h3 and silu(h1)*h3
// instead of per layer (moe.RecomputeExperts). Under full the Scratch
// holds one set of every layer activation (moe.RecomputeLayer) but the
// statistics' vectors, and of the send order's indices and gates and the
// outputs y too unless the dispatcher is fused, whose peers read a
// layer's after this rank has moved on.
func moeActivations(l *ledger, s shape, fused bool) {
	T, D, E, K, F, L := s.Tm, s.D, s.E, s.K, s.F, s.L // the MoE layers' tokens: 1/tp of the rows
	S, Sw, R, Rw := s.sent, s.sentWorst, s.recv, s.recvWorst
	n, router, routed := s.kept(), s.fullTerm("moe router"), s.fullTerm("moe experts")
	exch, exchTerm := n, routed // the exchanged tensors (moe/layer.go): per layer when fused
	if fused {
		exch, exchTerm = L, "moe experts"
	}
	l.fixed(Activations, router, mul(3, n), mul(T, E), s.ft)       // logitsTE, probsTE, dlogitsTE
	l.fixed(Activations, router, n, T, s.ft)                       // lseT
	l.fixed(Activations, "moe router", L, T, s.ft)                 // onesT
	l.fixed(Activations, router, mul(2, n), mul(T, K), int32Bytes) // idxTK, sendPosTK
	l.fixed(Activations, router, mul(2, n), mul(T, K), s.ft)       // gatesTK, dgatesTK
	l.fixed(Activations, "moe router", L, E, s.ft)                 // auxDProbE
	l.fixed(Activations, "moe router", L, 1, int32Bytes)           // zeroRow
	l.fixed(Activations, router, n, E+1, int32Bytes)               // offsetsE1 (the counts are in moeStats)
	if s.Fs > 0 {
		l.fixed(Activations, s.fullTerm("shared experts"), mul(6, n), mul(T, s.Fs), s.ft) // sharedH1, H3, Act and their gradients
	}
	// Routed rows, per layer. Dropless, the send index vectors are sized
	// T*K every step (RouteByExpert's vectors); with a capacity, the kept
	// rows.
	l.alloc(Activations, exchTerm, exch, s.sendIdx, s.sendIdxWorst, int32Bytes) // sendTokS
	l.alloc(Activations, routed, n, s.sendIdx, s.sendIdxWorst, int32Bytes)      // sendSlotS
	l.alloc(Activations, exchTerm, exch, S, Sw, s.ft)                           // gateS
	l.alloc(Activations, routed, n, S, Sw, s.ft)                                // dgateS
	l.alloc(Activations, routed, n, mul(R, D), mul(Rw, D), s.ot)                // xRD
	yt := s.ft                                                                  // moe.Layer.outputType: the operand type on one expert rank
	if s.EG == 1 {
		yt = s.ot
	}
	l.alloc(Activations, exchTerm, exch, mul(S, D), mul(Sw, D), yt) // ySD
	hidden := n                                                     // layers that keep h1, h3 and silu(h1)*h3 of their own
	if s.selective() {
		hidden = 1
	}
	l.alloc(Activations, s.hiddenTerm(), mul(3, hidden), mul(R, F), mul(Rw, F), s.ot)
	switch {
	case fused:
		l.alloc(Activations, routed, n, mul(R, 2), mul(Rw, 2), int32Bytes) // refsR2
		if s.ot != s.normType() {
			l.fixed(Activations, "moe experts", L, mul(T, D), s.ot) // Layer.xoTD: peers read it after this rank moves on
		}
	case s.EG > 1:
		l.alloc(Activations, routed, mul(2, n), R, Rw, int32Bytes) // permR, invPermR
	}
	// The Scratch, shared by the rank's layers.
	switch {
	case fused: // fusedBackward: dy and the hidden gradients expert-major, dx rows in send order
		l.alloc(Workspace, "moe dispatch", 1, mul(R, D), mul(Rw, D), s.ot) // dyRD
		l.fixed(Workspace, "moe dispatch", 1, mul(S, D), s.ft)             // rowsSD
		l.alloc(Workspace, "moe dispatch", 2, mul(R, F), mul(Rw, F), s.ot) // dh1RF, dh3RF
		if s.EG > 1 {
			l.fixed(Workspace, "moe dispatch", 1, S, int32Bytes) // doneS
		}
		if !s.cuda {
			// The CPU's fused ops are the unfused sequence through a
			// float [R, max(D, F)] temporary per call
			// (backend/cpu/ops_peer.go): garbage for the collector.
			l.alloc(Workspace, "moe dispatch (transient)", 1, mul(R, max(D, F)), mul(Rw, max(D, F)), s.ft)
		}
	case s.EG == 1: // dispatchBackward, one rank: dy gathered into dyRD, dx rows in rowsR1D
		l.fixed(Workspace, "moe dispatch", 1, mul(S, D), s.ot) // dyRD
		l.fixed(Workspace, "moe dispatch", 1, mul(S, D), s.ft) // rowsR1D
	default: // dispatchForward/Backward over the expert group
		l.fixed(Workspace, "moe dispatch", 1, mul(S, D), s.ft)             // rowsSD
		l.alloc(Workspace, "moe dispatch", 2, mul(R, D), mul(Rw, D), s.ft) // rowsR1D, rowsR2D
	}
	if !fused {
		l.alloc(Workspace, "moe dispatch", 1, mul(R, F), mul(Rw, F), s.ft) // dActRF
		l.alloc(Workspace, "moe dispatch", 2, mul(R, F), mul(Rw, F), s.ot) // dh1RF, dh3RF
		if s.ot != s.normType() {
			l.fixed(Workspace, "moe dispatch", 1, mul(T, D), s.ot) // Scratch.xoTD
		}
	}
}

// collectiveScratch mirrors comm/local.go's scratchView for the virtual
// ranks of one process: each of a rank's groups keeps one scratch tensor,
// grown to the largest block it reduced. AllReduceSum reduces a 1/N chunk
// of each gradient bucket (grad_overlap.go's cutBuckets: the norms
// together, the embedding, each layer's matrices, the LM head, and each
// layer's experts, each at most gradBucket elements); ReduceScatterSum
// reduces the block it receives: a ZeRO-1 round's piece (zero.go), and
// under context parallelism attention's dk and dv [T, KV*Dh] (mode
// allgather; the ring's Send and Recv need no scratch); under tensor
// parallelism the tensor group's sums and the MoE load counts. With one
// rank per device (NCCL) the scratch is a few descriptors
// (backend/cuda/nccl_group.go's growScratch) and NCCL's own buffers are
// outside the allocator.
func collectiveScratch(l *ledger, s shape, ring bool) {
	if s.c.DeviceRanks == 1 && s.cuda {
		return
	}
	scratch := func(n, elems int64) {
		if n > 1 {
			l.fixed(Workspace, "collectives", 1, elems, s.ft)
		}
	}
	replicated := ceilDiv(s.replicatedBucket(), s.dataContext)
	if s.zero {
		replicated = s.zeroPiece
	}
	scratch(s.dataContext, replicated)             // replicated gradients
	scratch(s.DP, ceilDiv(s.expertBucket(), s.DP)) // experts over their replicas
	attnDKV := mul(s.T, s.KDl)                     // the all-gather path's reduce-scatter of dk, dv
	if ring {
		attnDKV = 0
	}
	scratch(s.CP, max(ceilDiv(s.expertBucket(), s.CP), attnDKV)) // experts, and attention's dk, dv
	if s.TP > 1 {
		// The tensor group: the gradients held whole but computed on
		// different rows (engine/rank.go's tpSummed), and the blocks of
		// the row-parallel sums: o_proj's output and the projections'
		// (and the LM head's) input gradient, reduce-scattered to R rows
		// under sequence parallelism or all-reduced in 1/TP chunks, and
		// the target logits of an LM head chunk.
		summed := s.replicatedRuns().largestSummed(s.R != s.T)
		rows := mul(s.R, s.D)
		if s.R == s.T {
			rows = ceilDiv(mul(s.T, s.D), s.TP)
		}
		scratch(s.TP, max(ceilDiv(summed, s.TP), rows, ceilDiv(min(s.T, lmHeadChunkRows), s.TP)))
		// The MoE layers' load counts, summed over every rank (their data
		// group under tensor parallelism: engine/rank.go's moeData) for
		// the aux-loss gradient (moe/balance.go).
		world := mul(s.dataContext, s.TP)
		scratch(world, ceilDiv(s.E, world))
	}
}

// replicatedBucket is the largest gradient bucket of the replicated
// range (grad_overlap.go's cutBuckets): the norms, the embedding, one
// layer's matrices or the LM head, at most gradBucket elements.
func (s shape) replicatedBucket() int64 {
	return s.replicatedRuns().largest(s.L)
}

// expertBucket is the largest gradient bucket of the experts: one
// layer's, at most gradBucket elements.
func (s shape) expertBucket() int64 {
	return min(gradBucket, mul(3, align(mul(s.El, s.F, s.D))))
}

// sharedTerms is what the ranks of one device share: on the GPU the
// backend's own buffers (backend/cuda), on the CPU nothing (the CPU's
// products need no workspace). The transient line is the largest buffer
// an op allocates and frees within itself.
func sharedTerms(s shape) []Term {
	if !s.cuda {
		return nil
	}
	l := &ledger{cuda: true, fineAbove: s.fineAbove}
	// matmul.go's NewGemm: cuBLASLt's workspace (DefaultGemmWorkspace).
	l.fixed(Workspace, "cuBLASLt workspace and operand scratch", 1, cublasWorkspace, 1)
	// matmul.go's convertInto: a float32 operand of a bf16 product is
	// rounded into scratchA or scratchB, each grown to the largest seen.
	a, b := gemmScratch(s)
	l.fixed(Workspace, "cuBLASLt workspace and operand scratch", 1, a, 2)
	l.fixed(Workspace, "cuBLASLt workspace and operand scratch", 1, b, 2)
	// matmul.go's run: an autotuned product's trial runs write into
	// tuneOut, grown to the largest such output.
	if n := tuneOut(s); n > 0 {
		l.fixed(Workspace, "cuBLASLt autotuning output", 1, n, 4)
	}
	// experts.go's offsets, moe_fused.go's tables, flags and fault word.
	l.fixed(Workspace, "kernel tables", 1, ggMaxExperts+1, int32Bytes)
	l.fixed(Workspace, "kernel tables", 1, fusedTablesBytes, 1)
	l.fixed(Workspace, "kernel tables", 1, 16, 1)
	flags := max(1024, 2*(ceilDiv(s.recvWorst, 128)+s.El))
	if s.tpFused {
		// tp_gather's flags: one per m-tile of the gathered rows, and one.
		flags = max(flags, 2*(ceilDiv(s.T, 128)+1))
	}
	l.fixed(Workspace, "kernel tables", 1, flags, int32Bytes)
	// rope.go's cos/sin table: a float32 (cos, sin) pair per position
	// below the RoPE calls' rows (the attention's T) and per dim pair.
	l.fixed(Workspace, "kernel tables", 1, mul(s.T, s.D/s.H/2), 8)
	if s.tpFused {
		// tp_fused.go's tpScratch.rows: the bf16 operand the fused ops
		// round into, grown to the largest: the gathered rows [T, D] under
		// sequence parallelism, else the row-parallel products' float32
		// inputs, o_proj's a and the q gradient [T, Ql] (the k, v
		// gradients' [T, KDl] are no larger). Its weights are the bf16
		// operand copies already, so tpScratch.wght stays empty.
		rows := mul(s.T, s.Ql)
		if s.R != s.T {
			rows = max(rows, mul(s.T, s.D))
		}
		l.fixed(Workspace, "tensor-parallel fused operand scratch", 1, rows, 2)
	}
	// The largest buffer an op takes and frees: attention.go's backward
	// delta [B, H, S/cp], backend_ops.go's RMSNorm weight-gradient
	// partial sums (one row of D per 32 rows of x), and on the GPU
	// attention_hopper.go's scratch, the larger of its forward's and
	// backward's: with float32 q, k and v (context parallelism) their
	// bf16 copies, of q and dout [T, Ql] and of k and v [keys, KDl], and
	// float32 delta; with bf16 q, k and v the backward's delta and, where
	// dout is float32 (tensor parallelism), its bf16 copy. Where the
	// Hopper kernels do not serve (other head dims, or the tensor-core
	// ordered backward of train.deterministic) the float32 widening of q, k, v and a
	// bf16 dout and out ([T, Ql] + 2 [keys, KDl], + 2 [T, Ql]) under the
	// older kernels' delta (the forward widens q, k, v and its out alike,
	// no more).
	delta := mul(s.B, s.Hl, s.Sl)
	partial := mul(ceilDiv(s.R, max(rmsRowsPerBlock, ceilDiv(s.R, 65535))), s.D)
	scratch := mul(4, max(delta, partial))
	if s.cuda {
		keys := s.T
		if s.CP > 1 && s.c.CPAttention != CPRing {
			keys = mul(s.B, s.S) // the all-gather path's calls see every key
		}
		hopper := s.D/s.H == 64 || s.D/s.H == 128
		switch {
		case s.onePassRing():
			// The ring's kernels take none (its delta and da are the
			// attention Scratch's, counted above).
		case s.qkvType() == s.ft && hopper:
			scratch = max(scratch, add(mul(2, add(mul(2, s.T, s.Ql), mul(2, keys, s.KDl))), mul(4, delta)))
		case s.qkvType() != s.ft && hopper && !s.c.Deterministic:
			dout := mul(2, s.T, s.Ql)
			if s.daType() != s.ft {
				dout = 0
			}
			scratch = max(scratch, add(dout, mul(4, delta)))
		case s.qkvType() != s.ft:
			widened := add(roundUp(mul(s.T, s.Ql), 4), mul(2, roundUp(mul(keys, s.KDl), 4)))
			if s.daType() != s.ft {
				widened = add(widened, mul(2, roundUp(mul(s.T, s.Ql), 4))) // dout and out
			}
			scratch = max(scratch, add(mul(4, widened), mul(4, delta)))
		}
	}
	l.fixed(Workspace, "kernel scratch (transient)", 1, scratch, 1)
	return l.terms
}

// Constants of backend/cuda mirrored here (the plan does not link the
// CUDA backend): matmul.go's DefaultGemmWorkspace, grouped_gemm.go's
// ggMaxExperts, moe_fused.go's fusedTablesB (32*fusedMaxRanks +
// 4*(ggMaxExperts+1)), backend_ops.go's rmsRowsPerBlock, and matmul.go's
// autotuning rule.
const (
	cublasWorkspace  = 32 << 20
	ggMaxExperts     = 1024
	fusedTablesBytes = 32*256 + 4*(ggMaxExperts+1)
	rmsRowsPerBlock  = 32
	autotuneMultiple = 128
	autotuneMinFLOPs = 1 << 31
)

// gemmScratch is the elements of the largest float32 operand the model's
// bf16 products round into scratchA (a) and scratchB (b), mirroring each
// MatMul whose operand is float32 while the other is bf16 (or both are
// float32): attention's o_proj reads a [T, Q] where it is float32 (under
// context or tensor parallelism; forward: a; backward's weight gradient:
// b); the router's statistics read ones [1, T] and
// probs [T, E]; its backward dlogits [T, E] (a, twice); the shared
// experts' products read dout [T, D] and their hidden [T, Fs] in float32.
// The normalised inputs (the router's and shared experts' x, the LM
// head's final hidden rows) are bf16 already (normType) but under tensor
// parallelism, whose float32 rows [T, D] the branch below counts.
func gemmScratch(s shape) (a, b int64) {
	T := s.T
	a, b = max(T, mul(T, s.E)), mul(T, s.E)
	if s.daType() == s.ft {
		a, b = max(a, mul(T, s.Ql)), max(b, mul(T, s.Ql))
	}
	if s.TP > 1 {
		// The tensor-parallel products read the gathered rows and the
		// gradients in float32.
		a, b = max(a, mul(T, s.D), mul(T, s.Ql), mul(T, s.KDl)), max(b, mul(T, s.D))
	}
	if s.Fs > 0 {
		a = max(a, mul(T, s.D), mul(T, s.Fs))
		b = max(b, mul(T, s.Fs))
	}
	return a, b
}

// tuneOut is the elements of the largest output of an autotuned product
// (matmul.go's autotunes: not ragged, m, n and k multiples of 128, at
// least 2^31 FLOPs), over the model's dense products [m, n] = [m, k]·[k, n]:
// attention's projections and their backward, the LM head's three
// products per chunk, the router's, the shared experts'.
func tuneOut(s shape) int64 {
	T, D, Q, KD, V, E, Fs := s.T, s.D, s.Ql, s.KDl, s.Vl, s.E, s.Fs
	chunk := min(T, lmHeadChunkRows)
	products := [][3]int64{
		{T, Q, D}, {T, KD, D}, {T, D, Q}, // q, k, v, o forward
		{D, Q, T}, {Q, D, T}, {KD, D, T}, {T, D, KD}, // backward: weight gradients, dx
		{chunk, V, D}, {chunk, D, V}, {V, D, chunk}, // LM head, per chunk
		{T, E, D}, {1, E, T}, {T, D, E}, {E, D, T}, // router, statistics, backward
	}
	if last := T % chunk; last > 0 {
		products = append(products, [3]int64{last, V, D}, [3]int64{last, D, V}, [3]int64{V, D, last})
	}
	if Fs > 0 {
		products = append(products, [3]int64{T, Fs, D}, [3]int64{T, D, Fs}, [3]int64{D, Fs, T}, [3]int64{Fs, D, T})
	}
	best := int64(0)
	for _, p := range products {
		m, n, k := p[0], p[1], p[2]
		if m%autotuneMultiple == 0 && n%autotuneMultiple == 0 && k%autotuneMultiple == 0 &&
			2*float64(m)*float64(n)*float64(k) >= autotuneMinFLOPs {
			best = max(best, mul(m, n))
		}
	}
	return best
}
