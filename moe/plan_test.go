package moe

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// TestPlanCountsMatchesPlanSource checks that the dropless plan built from
// per-expert counts (the rows sorted on the device) has the counts, sends
// and row total of the host plan built from the choices themselves.
func TestPlanCountsMatchesPlanSource(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	const T, K, E = 57, 3, 8
	for _, ep := range []int{1, 2, 4} {
		idx := make([]int32, T*K)
		counts := make([]int32, E)
		for a := range idx {
			idx[a] = int32(rng.IntN(E))
			counts[idx[a]]++
		}
		want, got := planSource(idx, T, K, E, ep, 0), planCounts(counts, ep)
		if got.sent != want.sent || got.sent != T*K || !slices.Equal(got.countsE, want.countsE) ||
			!slices.Equal(got.keptE, want.keptE) || !slices.Equal(got.sendCounts, want.sendCounts) || got.dropped != 0 {
			t.Errorf("ep %d: planCounts = %+v, planSource = %+v", ep, got, want)
		}
	}
}
