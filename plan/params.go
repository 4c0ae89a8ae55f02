package plan

// Parameter counts, FLOPs per token, and the flat stores that hold a
// rank's parameters.

import "math"

// shape is a Config's sizes as int64, with the derived ones, and the
// device's element sizes: what every term multiplies.
type shape struct {
	c Config
	d Device

	V, D, L, H, KV, Q, KD  int64 // vocab, dim, layers, heads, kv heads, H*Dh (= D), KV*Dh
	E, K, F, Fs, El        int64 // experts, top-k, ffn, shared width SharedExperts*F, experts per rank
	B, S, T, Sl            int64 // micro-batch, seq, local tokens B*S/cp, local positions per sequence S/cp
	DP, EP, CP             int64
	ft, ot                 int64 // bytes of the float and operand types
	cuda                   bool  // the CUDA allocator's size classes and bf16 copies apply
	zero                   bool  // ZeRO-1 shards the replicated moments (parallel.zero 1 on several ranks)
	dataContext            int64 // ranks with distinct tokens: dp*ep*cp
	capRows                int64 // rows per expert a source may send (capacity); 0 dropless
	sent, recv             int64 // routed rows a rank sends and receives (balanced)
	sentWorst, recvWorst   int64 // the same under the routing bound, with rowBuf's growth
	sendIdx, sendIdxWorst  int64 // rows of the send index vectors: T*K dropless, else sent
	flatNorms, flatMatrix  int64 // elements of the flat store's norm and matrix ranges (padded)
	flatExperts, flatTotal int64 // its expert range, and the whole store (with ZeRO's padding)
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
	s.El = s.E / s.EP
	s.B, s.S = int64(c.MicroBatch), int64(c.Seq)
	s.Sl = s.S / s.CP // attention.ZigzagPositions: 2*(S/(2cp)) positions, or S with one rank
	s.T = mul(s.B, s.Sl)
	s.ft, s.ot = int64(d.FloatBytes), int64(d.OperandBytes)
	s.cuda = d.Backend == BackendCUDA
	s.dataContext = mul(s.DP, s.EP, s.CP)
	s.zero = c.Zero == 1 && s.dataContext > 1
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
	tk := mul(s.T, s.K)
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
	if s.EP > 1 {
		bound := mul(s.EP, s.T, min(s.K, s.El))
		if s.capRows > 0 {
			bound = min(bound, mul(s.El, s.EP, s.capRows))
		}
		s.recvWorst = grown(bound)
	}
}

// grown is n and the quarter a growing rowBuf may hold beyond it.
func grown(n int64) int64 { return add(n, n/4) }

// align is n rounded up to flatAlign.
func align(n int64) int64 { return roundUp(n, flatAlign) }

// flatLayout mirrors engine/params.go's newFlatLayout (and zero.go's
// padReplicated): norms first, then the replicated matrices, then this
// rank's experts, every tensor padded to flatAlign elements; under ZeRO-1
// the replicated range is padded to rounds*N*piece elements.
func (s *shape) flatLayout() {
	D, L := s.D, s.L
	s.flatNorms = mul(2*L+1, align(D)) // per layer input_layernorm and post_attention_layernorm, and the final norm
	perLayer := add(align(mul(s.Q, D)), mul(2, align(mul(s.KD, D))), align(mul(D, s.Q)), align(mul(s.E, D)))
	if s.Fs > 0 {
		perLayer = add(perLayer, mul(3, align(mul(s.Fs, D)))) // shared w1, w3 [Fs, D] and w2 [D, Fs]
	}
	s.layerMatrices = perLayer
	s.flatMatrix = add(mul(2, align(mul(s.V, D))), mul(L, perLayer)) // embedding and LM head, then the layers
	s.flatExperts = mul(L, 3, align(mul(s.El, s.F, D)))              // w1, w3 [El, F, D] and w2 [El, D, F]
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
	s.flatTotal = add(replicated, s.flatExperts)
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
	p.Rank = p.Total - mul(L, expertsPerLayer) + mul(L, 3, E/int64(c.EP), F, D)
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
