package cpu

import "github.com/mktrain/mktrain/backend"

// RouteByExpert is a stable counting sort of idxTK's assignments by expert
// (see backend.Backend).
func (b *Backend) RouteByExpert(countsE, sendTokS, sendSlotS, idxTK backend.Tensor) {
	const op = "RouteByExpert"
	if countsE == nil || idxTK == nil {
		fail(op, "counts and idx are required")
	}
	shape := idxTK.Shape()
	if len(shape) != 2 {
		fail(op, "idx has shape %v, want [T, K]", shape)
	}
	E, K, n := countsE.Len(), shape[1], idxTK.Len()
	idx := indices(op, "idx", idxTK, n, E, false)
	counts := indices(op, "counts", countsE, E, 1<<31-1, true)
	tok := indices(op, "sendTok", sendTokS, n, 1<<31-1, true)
	slot := indices(op, "sendSlot", sendSlotS, n, 1<<31-1, true)
	clear(counts)
	for _, e := range idx {
		counts[e]++
	}
	next := make([]int32, E)
	for e := 1; e < E; e++ {
		next[e] = next[e-1] + counts[e-1]
	}
	for a, e := range idx {
		i := next[e]
		next[e]++
		tok[i], slot[i] = int32(a/K), int32(a)
	}
}
