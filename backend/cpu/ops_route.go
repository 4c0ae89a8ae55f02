package cpu

import "github.com/mktrain/mktrain/backend"

// RouteByExpert is a stable counting sort of idxTK's assignments by expert
// (see backend.Backend).
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
	idx := indices(op, "idx", idxTK, n, E, false)
	b.vector(op, "counts", countsE, E)
	offsets := indices(op, "offsets", offsetsE1, E+1, 1<<31-1, true)
	tok := indices(op, "sendTok", sendTokS, n, 1<<31-1, true)
	slot := indices(op, "sendSlot", sendSlotS, n, 1<<31-1, true)
	var pos []int32
	if sendPosTK != nil {
		pos = indices(op, "sendPos", sendPosTK, n, 1<<31-1, true)
	}
	clear(offsets)
	for _, e := range idx {
		offsets[e+1]++
	}
	for e := range E {
		offsets[e+1] += offsets[e]
	}
	for e := range E {
		n := offsets[e+1] - offsets[e]
		if b.dt == backend.Float64 {
			floats[float64](countsE)[e] = float64(n)
		} else {
			floats[float32](countsE)[e] = float32(n)
		}
	}
	next := append([]int32(nil), offsets[:E]...)
	for a, e := range idx {
		i := next[e]
		next[e]++
		tok[i], slot[i] = int32(a/K), int32(a)
		if pos != nil {
			pos[a] = i
		}
	}
}
