package engine

import (
	"bytes"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/rs/zerolog"
)

// TestRingMatchesOneRank trains 20 steps under parallel.cp_attention: ring
// at cp 2, cp 4, dp 2 x cp 2 and ep 2 x cp 2 and requires the losses of
// one rank within 2e-4 relative (the tolerance of the other layouts'
// equivalence test: summation orders differ between layouts), and the
// all-gather path's on the same layout bit for bit: virtual ranks run the
// fused ring, whose CPU ops compute in the all-gather path's order
// (attention/ring_fused.go). The portable ring, which groups across
// processes run, agrees with it to rounding (TestDistributedMatchesVirtualRanks).
func TestRingMatchesOneRank(t *testing.T) {
	base := equivalenceConfig()
	base.Train.Steps, base.Train.MicroBatch = 20, 8
	want := trainLosses(t, base)
	for _, l := range []struct{ dp, ep, cp, micro int }{{1, 1, 2, 8}, {1, 1, 4, 8}, {2, 1, 2, 4}, {1, 2, 2, 4}} {
		t.Run(fmt.Sprintf("dp%d_ep%d_cp%d", l.dp, l.ep, l.cp), func(t *testing.T) {
			modes := map[string][]float64{}
			for _, mode := range []string{"ring", "allgather"} {
				cfg := base
				cfg.Parallel.DP, cfg.Parallel.EP, cfg.Parallel.CP, cfg.Train.MicroBatch = l.dp, l.ep, l.cp, l.micro
				cfg.Parallel.CPAttention = mode
				modes[mode] = trainLosses(t, cfg)
			}
			ring := modes["ring"]
			if len(ring) != len(want) {
				t.Fatalf("%d steps, want %d", len(ring), len(want))
			}
			if !slices.Equal(ring, modes["allgather"]) {
				t.Errorf("losses under the ring %v, under allgather %v: want the same bits", ring, modes["allgather"])
			}
			for i := range want {
				if !(math.Abs(ring[i]-want[i]) <= 2e-4*math.Abs(want[i])) {
					t.Errorf("step %d: loss %.7f under the ring, %.7f on one rank", i+1, ring[i], want[i])
				}
			}
		})
	}
}

// TestCPAttentionChoiceLogged: the engine settles parallel.cp_attention
// once per run and says what it chose: auto on the CPU is allgather by
// rule, an explicit ring is the ring, the fused one on virtual ranks.
func TestCPAttentionChoiceLogged(t *testing.T) {
	for _, c := range []struct{ mode, says, runs string }{
		{"auto", "parallel.cp_attention auto: allgather, unmeasured: on the CPU", "context-parallel attention runs the allgather"},
		{"ring", "parallel.cp_attention: ring, as the recipe says", "context-parallel attention runs the fused ring"},
	} {
		cfg := equivalenceConfig()
		cfg.Train.Steps, cfg.Train.MicroBatch, cfg.Parallel.CP, cfg.Parallel.CPAttention = 3, 8, 2, c.mode
		var log bytes.Buffer
		eng, err := New(cfg, WithLogger(zerolog.New(&log)))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := eng.Run(t.Context()); err != nil {
			t.Fatal(err)
		}
		eng.Close()
		for _, want := range []string{c.says, c.runs} {
			if !strings.Contains(log.String(), want) {
				t.Errorf("cp_attention %s: the log does not say %q:\n%s", c.mode, want, log.String())
			}
		}
	}
}
