package cuda

// The MoE router ops on kernels/router.cu: one warp per token, which holds
// up to 256 experts in registers and selects up to 8 of them.

import (
	"github.com/mktrain/mktrain/backend"
)

// Router limits of kernels/router.cu: one warp holds a token's experts in
// registers, 8 per lane, and its selection.
const (
	RouterMaxExperts = 256
	RouterMaxTopK    = 8
)

// routerRowsPerBlk is the warps (rows) per block of 256 threads.
const routerRowsPerBlk = 8

// RouterForward: probs = softmax(logits), lse, the top-k experts by
// probs+bias (best first, ties to the lower index) and their renormalised
// gates.
func (b *Backend) RouterForward(probsTE, lseT, idxTK, gatesTK, logitsTE, biasE backend.Tensor) {
	const op = "RouterForward"
	probs, lse, idx, gates, bias, T, E, K := checkRouter(op, probsTE, lseT, idxTK, gatesTK, biasE)
	logits := vector(op, "logits", logitsTE, T*E)
	if T > 0 {
		b.launch(b.k.routerFwd, Grid1D((T+routerRowsPerBlk-1)/routerRowsPerBlk, 256),
			probs, lse, idx, gates, logits, bias, int32(T), int32(E), int32(K))
	}
}

// RouterBackward writes dlogitsTE from dgatesTK, plus auxDProbE[e] added to
// every row's dprobs and the z-loss term zScale*lse*probs.
func (b *Backend) RouterBackward(dlogitsTE, dgatesTK, probsTE, lseT, idxTK, gatesTK, auxDProbE backend.Tensor, zScale float64) {
	const op = "RouterBackward"
	probs, lse, idx, gates, aux, T, E, K := checkRouter(op, probsTE, lseT, idxTK, gatesTK, auxDProbE)
	dlogits := vector(op, "dlogits", dlogitsTE, T*E)
	dgates := vector(op, "dgates", dgatesTK, T*K)
	if T > 0 {
		b.launch(b.k.routerBwd, Grid1D((T+routerRowsPerBlk-1)/routerRowsPerBlk, 256),
			dlogits, dgates, probs, lse, idx, gates, aux, int32(T), int32(E), int32(K), float32(zScale))
	}
}

// checkRouter reads T, E and K from probsTE [T, E] and idxTK [T, K] and
// panics unless the other tensors agree and the sizes fit the kernels. vecE
// is the optional per-expert vector (bias or aux gradient).
func checkRouter(op string, probsTE, lseT, idxTK, gatesTK, vecE backend.Tensor) (probs, lse, idx, gates, vec *Tensor, T, E, K int) {
	probs, T, E = matrix(op, "probs", probsTE)
	if idxTK == nil {
		fail(op, "idx is nil")
	}
	is := idxTK.Shape()
	if len(is) != 2 || is[0] != T {
		fail(op, "router probs %v and idx %v must be [T, E] and [T, K]", probs.shape, is)
	}
	K = is[1]
	if K < 1 || K > E {
		fail(op, "router top-k %d must be in [1, %d experts]", K, E)
	}
	if E > RouterMaxExperts || K > RouterMaxTopK {
		fail(op, "%d experts, top-%d: the CUDA router handles at most %d experts and top-%d", E, K, RouterMaxExperts, RouterMaxTopK)
	}
	fitsInt32(op, T)
	idx = indices(op, "idx", idxTK, T*K)
	lse = vector(op, "lse", lseT, T)
	gates = vector(op, "gates", gatesTK, T*K)
	vec = optFloat(op, "per-expert vector", vecE, E)
	return probs, lse, idx, gates, vec, T, E, K
}

// RouteByExpert sorts idxTK's assignments by expert on the GPU (see
// backend.Backend and kernels/route.cu): one block per expert, which
// writes its count and offset too.
func (b *Backend) RouteByExpert(countsE, offsetsE1, sendTokS, sendSlotS, sendPosTK, idxTK backend.Tensor) {
	const op = "RouteByExpert"
	if countsE == nil || offsetsE1 == nil || idxTK == nil {
		fail(op, "counts, offsets and idx are required")
	}
	shape := idxTK.Shape()
	if len(shape) != 2 {
		fail(op, "idx has shape %v, want [T, K]", shape)
	}
	E, K, n := countsE.Len(), shape[1], idxTK.Len()
	if n >= 1<<24 {
		fail(op, "%d assignments: the float counts are exact below 2^24", n)
	}
	idx := indices(op, "idx", idxTK, n)
	counts := vector(op, "counts", countsE, E)
	offsets := indices(op, "offsets", offsetsE1, E+1)
	tok := indices(op, "sendTok", sendTokS, n)
	slot := indices(op, "sendSlot", sendSlotS, n)
	var pos *Tensor // nil: the kernel's null send_pos
	if sendPosTK != nil {
		pos = indices(op, "sendPos", sendPosTK, n)
	}
	fitsInt32(op, n, E)
	if E > 0 {
		b.launch(b.k.route, Grid1D(E, 1024), counts, offsets, tok, slot, pos, idx, int32(n), int32(K))
	}
}
