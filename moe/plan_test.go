package moe

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// TestPlanCountsMatchesPlanSource checks that the dropless plan built from
// per-expert counts (the rows sorted on the device) has the counts, sends
// and row total of the host plan built from the choices themselves.
func TestPlanCountsMatchesPlanSource(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	const T, K, E = 57, 3, 8
	for _, ep := range []int{1, 2, 4} {
		idx := make([]int32, T*K)
		counts := make([]int, E)
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

// TestPeerRefs checks the fused dispatcher's row references (peerBlocks,
// expanded as PeerRowRefs does) against the
// unfused route: for every destination rank, expert-major row i copies the
// row the all-to-all and perm bring there, whatever the routing (random,
// all on two experts, with capacity drops, some ranks receiving nothing).
func TestPeerRefs(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	const T, K, E = 23, 2, 8
	type row struct{ src, tok, expert int32 }
	for _, ep := range []int{1, 2, 4, 8} {
		for _, c := range []struct {
			name     string
			pick     func(src, a int) int32
			capacity int
		}{
			{"random", func(int, int) int32 { return int32(rng.IntN(E)) }, 0},
			{"every token to experts 7 and 0", func(_, a int) int32 { return int32((E - 1 + a%K) % E) }, 0},
			{"source 0 only to experts 0 and 1", func(src, a int) int32 {
				if src == 0 {
					return int32(a % K)
				}
				return int32(rng.IntN(E))
			}, 0},
			{"capacity", func(int, int) int32 { return int32(rng.IntN(E)) }, 3},
		} {
			plans := make([]*plan, ep)
			sends := make([][]row, ep) // each source's rows in send order
			counts := make([]int, ep*E)
			for s := range ep {
				idx := make([]int32, T*K)
				for a := range idx {
					idx[a] = c.pick(s, a)
				}
				plans[s] = planSource(idx, T, K, E, ep, c.capacity)
				for i := range plans[s].sent {
					a := plans[s].sendSlot[i]
					sends[s] = append(sends[s], row{int32(s), plans[s].sendTok[i], idx[a]})
				}
				for e, n := range plans[s].keptE {
					counts[s*E+e] = n
				}
			}
			local := E / ep
			for r := range ep {
				p := &plan{}
				p.planDest(counts, ep, E, r*local, local)
				// The all-to-all: each source's block for r, in source order.
				var recv []row
				for s := range ep {
					from := 0
					for d := range r {
						from += plans[s].sendCounts[d]
					}
					recv = append(recv, sends[s][from:from+plans[s].sendCounts[r]]...)
				}
				blocks := p.peerBlocks()
				if err := backend.CheckRowBlocks(blocks, len(p.perm)); err != nil {
					t.Fatalf("ep %d %s rank %d: %v", ep, c.name, r, err)
				}
				refs := backend.ExpandRowBlocks(blocks, len(p.perm))
				if len(refs) != 2*len(recv) {
					t.Fatalf("ep %d %s rank %d: %d refs for %d rows", ep, c.name, r, len(refs)/2, len(recv))
				}
				for i, j := range p.perm {
					s, pos := refs[2*i], refs[2*i+1]
					if got, want := sends[s][pos], recv[j]; got != want {
						t.Fatalf("ep %d %s rank %d: row %d refers to %+v, the all-to-all brings %+v", ep, c.name, r, i, got, want)
					}
				}
			}
		}
	}
}
