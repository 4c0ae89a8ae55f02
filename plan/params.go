package plan

// Parameter counts, FLOPs per token, and the flat stores that hold a
// rank's parameters.

import "math"

// shape is a Config's sizes as int64, with the derived ones, and the
// device's element sizes: what every term multiplies.
type shape struct {
	c Config
	d Device

	V, D, L, H, KV, Q, KD int64 // vocab, dim, layers, heads, kv heads, H*Dh (= D), KV*Dh
	E, K, F, Fs, El       int64 // experts, top-k, ffn, shared width SharedExperts*F, experts per rank
	B, S, T, Sl           int64 // micro-batch, seq, local tokens B*S/cp, local positions per sequence S/cp
	DP, EP, CP            int64
	// Tensor parallelism: TP ranks; R the residual stream's rows (T/TP
	// under sequence parallelism, else T); Tm the MoE layers' tokens
	// (T/TP); EG the expert group (EP*TP); Hl, Ql, KDl this rank's query
	// heads and widths of q and of k, v (one head's when the kv heads are
	// fewer than TP); KDw the rows of k_proj and v_proj it holds (then
	// all KD); Vl its vocabulary slice.
	TP, R, Tm, EG          int64
	Hl, Ql, KDl, KDw, Vl   int64
	ft, ot                 int64 // bytes of the float and operand types
	cuda                   bool  // the CUDA allocator's size classes and bf16 copies apply
	fineAbove              int64 // Device.FineClassesAbove
	zero                   bool  // ZeRO-1 shards the replicated moments (parallel.zero 1 on several ranks)
	tpFused                bool  // tp > 1 on tensorpar's fused ops (parallel.tp_overlap fused, or auto: the larger)
	cpRing                 bool  // the context-parallel cores run mode ring (set per mode by rankTerms)
	dataContext            int64 // ranks with distinct tokens: dp*ep*cp
	capRows                int64 // rows per expert a source may send (capacity); 0 dropless
	sent, recv             int64 // routed rows a rank sends and receives (balanced)
	sentWorst, recvWorst   int64 // the same under the routing bound, with rowBuf's growth
	sendIdx, sendIdxWorst  int64 // rows of the send index vectors: T*K dropless, else sent
	flatNorms, flatMatrix  int64 // elements of the flat store's norm and matrix ranges (padded)
	flatExperts, flatTotal int64 // its expert range, and the whole store (with ZeRO's padding)
	flatReplicated         int64 // the range before the experts (with ZeRO's padding)
	flatPrefix             int64 // the norms and the embedding, which stay float32 under split masters
	momentElems            int64 // elements of each AdamW moment store
	layerMatrices          int64 // elements of one layer's replicated matrices (padded)
	zeroPiece              int64 // ZeRO-1: elements of a rank's piece of a round
}

// flatAlign mirrors engine/params.go's flatAlign: every tensor of a flat
// store starts on a 64-element boundary.
const flatAlign = 64

// gradBucket mirrors engine/rank.go's gradBucket: the most elements one
// gradient all-reduce (and one ZeRO-1 round) moves.
const gradBucket = 16 << 20

func newShape(c Config, d Device) shape {
	s := shape{c: c, d: d}
	s.V, s.D, s.L, s.H, s.KV = int64(c.Vocab), int64(c.Dim), int64(c.Layers), int64(c.Heads), int64(c.KVHeads)
	dh := s.D / s.H
	s.Q, s.KD = s.H*dh, s.KV*dh
	s.E, s.K, s.F = int64(c.Experts), int64(c.TopK), int64(c.FFN)
	s.Fs = mul(int64(c.SharedExperts), s.F)
	s.DP, s.EP, s.CP = int64(c.DP), int64(c.EP), int64(c.CP)
	s.TP = max(1, int64(c.TP))
	s.EG = mul(s.EP, s.TP)
	s.El = s.E / s.EG // the experts are folded over ep x tp
	s.B, s.S = int64(c.MicroBatch), int64(c.Seq)
	s.Sl = s.S / s.CP // attention.ZigzagPositions: 2*(S/(2cp)) positions, or S with one rank
	s.T = mul(s.B, s.Sl)
	s.R, s.Tm = s.T, s.T/s.TP
	if s.TP > 1 && c.SequenceParallel {
		s.R = s.T / s.TP
	}
	s.Hl, s.Ql, s.KDl, s.KDw, s.Vl = s.H/s.TP, s.Q/s.TP, dh, s.KD, s.V/s.TP
	if s.KV%s.TP == 0 {
		s.KDl, s.KDw = s.KD/s.TP, s.KD/s.TP
	}
	s.ft, s.ot = int64(d.FloatBytes), int64(d.OperandBytes)
	s.cuda, s.fineAbove = d.Backend == BackendCUDA, d.FineClassesAbove
	s.dataContext = mul(s.DP, s.EP, s.CP)
	s.zero = c.Zero == 1 && s.dataContext > 1
	s.tpFused = s.TP > 1 && c.TPOverlap != TPUnfused
	s.routedRows(c)
	s.flatLayout()
	return s
}

// routedRows sizes the MoE layers' routed rows, as moe/layer.go's Forward
// and moe/plan.go decide them: dropless, every (token, choice) is sent,
// S = T*K; with a capacity cf each source sends an expert at most
// ceil(cf*T*K/E) rows (moe/plan.go's capacity). With one expert rank the
// rows received are the rows sent. With EP ranks, balanced routing
// brings a rank as many rows as it sends; at most, every token of every
// rank of the expert group sends all of its choices that this rank's
// experts can take (min(K, E/EP)), or each of its experts' capacity from
// every source. Where the rows change from step to step (several expert
// ranks, or a capacity that drops some), moe/buffers.go's rowBuf grows by
// at least a quarter each time it grows, so it may end up to 5/4 of the
// most rows a step needs: the bound's worst includes that.
func (s *shape) routedRows(c Config) {
	tk := mul(s.Tm, s.K)
	s.sent, s.sendIdx = tk, tk
	if c.CapacityFactor > 0 {
		s.capRows = tk // a capacity above every row the source has drops nothing
		if f := math.Ceil(c.CapacityFactor * float64(tk) / float64(s.E)); f < float64(tk) {
			s.capRows = int64(f)
		}
		s.sent = min(tk, mul(s.E, s.capRows))
		s.sendIdx = s.sent
	}
	s.sentWorst, s.sendIdxWorst = s.sent, s.sendIdx
	if s.capRows > 0 {
		s.sentWorst, s.sendIdxWorst = grown(s.sent), grown(s.sendIdx)
	}
	s.recv, s.recvWorst = s.sent, s.sentWorst
	if s.EG > 1 {
		bound := mul(s.EG, s.Tm, min(s.K, s.El))
		if s.capRows > 0 {
			bound = min(bound, mul(s.El, s.EG, s.capRows))
		}
		s.recvWorst = grown(bound)
	}
}

// grown is n and the quarter a growing rowBuf may hold beyond it.
func grown(n int64) int64 { return add(n, n/4) }

// align is n rounded up to flatAlign.
func align(n int64) int64 { return roundUp(n, flatAlign) }

// flatLayout mirrors engine/params.go's newFlatLayoutTP (and zero.go's
// padReplicated): norms first, then the replicated matrices, then this
// rank's experts, every tensor padded to flatAlign elements; under ZeRO-1
// the replicated range is padded to rounds*N*piece elements. Under tensor
// parallelism a rank holds its block of q_proj, o_proj, the LM head (and
// of k_proj and v_proj when the kv heads divide over tp).
func (s *shape) flatLayout() {
	D, L := s.D, s.L
	s.flatNorms = mul(2*L+1, align(D)) // per layer input_layernorm and post_attention_layernorm, and the final norm
	perLayer := add(align(mul(s.Ql, D)), mul(2, align(mul(s.KDw, D))), align(mul(D, s.Ql)), align(mul(s.E, D)))
	if s.Fs > 0 {
		perLayer = add(perLayer, mul(3, align(mul(s.Fs, D)))) // shared w1, w3 [Fs, D] and w2 [D, Fs]
	}
	s.layerMatrices = perLayer
	s.flatMatrix = add(align(mul(s.V, D)), align(mul(s.Vl, D)), mul(L, perLayer)) // embedding and LM head, then the layers
	s.flatExperts = mul(L, 3, align(mul(s.El, s.F, D)))                           // w1, w3 [El, F, D] and w2 [El, D, F]
	replicated := add(s.flatNorms, s.flatMatrix)
	s.momentElems = add(replicated, s.flatExperts)
	if s.zero {
		// zero.go's newShardPlan: rounds of at most about gradBucket
		// elements, each cut into N pieces of a multiple of flatAlign.
		n := s.dataContext
		rounds := max(1, ceilDiv(replicated, gradBucket))
		piece := roundUp(ceilDiv(replicated, mul(rounds, n)), flatAlign)
		replicated = max(replicated, mul(rounds, n, piece))
		s.zeroPiece = piece
		s.momentElems = add(mul(rounds, piece), s.flatExperts)
	}
	s.flatReplicated = replicated
	s.flatPrefix = add(s.flatNorms, align(mul(s.V, D)))
	s.flatTotal = add(replicated, s.flatExperts)
}

// replicatedRuns is the replicated range as engine/params.go lays it out,
// in the runs engine/grad_overlap.go's cutBuckets cuts into buckets (the
// tensors final at the same point of the backward, the norms travelling
// with layer 0): the norms; the embedding; with tp 1 each layer's
// matrices (q, k, v, o, router, shared experts); with tp above 1 each
// layer's matrices held whole (router, shared experts, and k, v when not
// split: whole), then each layer's blocks (q, o, and k, v when split:
// split); the LM head.
type replicatedRuns struct {
	norms, embed, whole, split, head int64
}

func (s shape) replicatedRuns() replicatedRuns {
	D := s.D
	r := replicatedRuns{norms: s.flatNorms, embed: align(mul(s.V, D)), head: align(mul(s.Vl, D))}
	kv := mul(2, align(mul(s.KDw, D)))
	r.whole = align(mul(s.E, D))
	if s.Fs > 0 {
		r.whole = add(r.whole, mul(3, align(mul(s.Fs, D))))
	}
	qo := mul(2, align(mul(s.Ql, D)))
	switch {
	case s.TP == 1:
		r.whole, r.split = add(r.whole, qo, kv), 0 // one run per layer
	case s.KV%s.TP == 0:
		r.split = add(qo, kv)
	default:
		r.whole, r.split = add(r.whole, kv), qo
	}
	return r
}

// largest is the largest bucket of the whole replicated range: each run at
// most gradBucket elements. With one layer and tp above 1 the layer's
// whole run and its blocks are neighbours final at the same point: one run.
func (r replicatedRuns) largest(layers int64) int64 {
	layer := max(r.whole, r.split)
	if layers == 1 && r.split > 0 {
		layer = add(r.whole, r.split)
	}
	return min(gradBucket, max(r.norms, r.embed, layer, r.head))
}

// largestSummed is the largest bucket of the range summed over the tensor
// group (engine/params.go's tpSummed): the whole matrices' runs, and under
// sequence parallelism the norms and the embedding too.
func (r replicatedRuns) largestSummed(sequenceParallel bool) int64 {
	n := r.whole
	if sequenceParallel {
		n = max(n, r.norms, r.embed)
	}
	return min(gradBucket, n)
}

// countParams mirrors engine.ParamCount (total) and bench train's active
// count, and adds the rank's share.
func countParams(c Config) Params {
	V, D, L := int64(c.Vocab), int64(c.Dim), int64(c.Layers)
	E, K, F := int64(c.Experts), int64(c.TopK), int64(c.FFN)
	dh := D / int64(c.Heads)
	Q, KD := int64(c.Heads)*dh, int64(c.KVHeads)*dh
	Fs := mul(int64(c.SharedExperts), F)
	expertsPerLayer := mul(3, E, F, D)
	perLayer := add(2*D, mul(2, Q, D), mul(2, KD, D), mul(E, D), expertsPerLayer, mul(3, Fs, D))
	p := Params{Total: add(mul(2, V, D), D, mul(L, perLayer))}
	// A token visits K of each layer's E experts; the embedding is a
	// lookup, not a product.
	p.Active = p.Total - mul(L, expertsPerLayer) + mul(L, 3, K, F, D) - mul(V, D)
	if p.Total == Saturated {
		p.Active = Saturated
	}
	// A rank's share: its experts (folded over ep x tp) and, under tensor
	// parallelism, its blocks of q_proj, o_proj, the LM head (and k_proj,
	// v_proj when the kv heads divide over tp).
	tp := max(1, int64(c.TP))
	split := add(mul(L, 2, Q, D), mul(V, D))
	if int64(c.KVHeads)%tp == 0 {
		split = add(split, mul(L, 2, KD, D))
	}
	p.Rank = p.Total - mul(L, expertsPerLayer) + mul(L, 3, E/(int64(c.EP)*tp), F, D) - split + split/tp
	if p.Total == Saturated {
		p.Rank = Saturated
	}
	return p
}

// FLOPsPerToken counts a training step's FLOPs per token as bench train's
// MFU and the PyTorch peer (scripts/peer/torch_moe_train.py) do: 6 per
// active parameter (forward and backward of every product) plus 6*L*D*S
// for causal attention (half of 12*L*D*S).
func flopsPerToken(c Config, p Params) float64 {
	return 6*float64(p.Active) + 6*float64(c.Layers)*float64(c.Dim)*float64(c.Seq)
}
