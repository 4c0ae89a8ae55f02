package engine

import (
	"bytes"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/mktrain/mktrain/backend"
)

// TestRingCUDA trains 20 steps of the equivalence model under
// parallel.cp_attention: ring at cp 2, cp 4, dp 2 x cp 2 and ep 2 x cp 2
// on virtual ranks of one GPU, and requires the losses of one rank on the
// GPU and of the all-gather path on the same layout within
// virtualRanksTol, the other layouts' tolerance on the GPU (bf16 products,
// float atomics). The model's head dim (8) runs every attention call on
// the float32 kernels, so the ring and the all-gather path differ only in
// the order of their sums; the log gives the largest differences measured
// (issue 27's bar for the ring is 2e-4 from one rank).
func TestRingCUDA(t *testing.T) {
	gpu := openGPU(t)
	base := equivalenceConfig()
	base.Train.Steps, base.Train.MicroBatch = 20, 8
	one := trainOn(t, base, gpu, "dp1 ep1")
	for _, l := range []struct{ dp, ep, cp, micro int }{{1, 1, 2, 8}, {1, 1, 4, 8}, {2, 1, 2, 4}, {1, 2, 2, 4}} {
		layout := fmt.Sprintf("dp%d ep%d cp%d", l.dp, l.ep, l.cp)
		runs := map[string][]float64{}
		for _, mode := range []string{"ring", "allgather"} {
			cfg := base
			cfg.Parallel.DP, cfg.Parallel.EP, cfg.Parallel.CP, cfg.Train.MicroBatch = l.dp, l.ep, l.cp, l.micro
			cfg.Parallel.CPAttention = mode
			runs[mode] = trainOn(t, cfg, gpu, layout+" "+mode).losses
		}
		var worstOne, worstGather float64
		for i, want := range one.losses {
			ring := runs["ring"][i]
			relOne, relGather := math.Abs(ring-want)/math.Abs(want), math.Abs(ring-runs["allgather"][i])/math.Abs(runs["allgather"][i])
			worstOne, worstGather = max(worstOne, relOne), max(worstGather, relGather)
			if !(relOne <= virtualRanksTol) || !(relGather <= virtualRanksTol) {
				t.Errorf("%s ring: step %d: loss %.6f, one rank %.6f, allgather %.6f (relative %.3g, %.3g > %g)",
					layout, i+1, ring, want, runs["allgather"][i], relOne, relGather, virtualRanksTol)
			}
		}
		t.Logf("%s ring: max relative loss difference %.2e from one rank, %.2e from allgather", layout, worstOne, worstGather)
	}
}

// fusedRingTol bounds the fused ring's loss differences from one rank and
// from the all-gather path over the first fusedRingTightSteps steps: two
// kernel families that round P at different points (see
// TestFusedRingCUDA). Later steps are held to fusedRingDriftTol: the MoE
// routing turns those rounding differences into ever larger ones, and
// they are not the ring's error (an H200 at e8a197d: 9.8e-3 at step 18 of
// seq 256 on cp 2, dp 1 and dp 2 alike, within 3e-3 before step 17).
const (
	fusedRingTol        = 3e-3
	fusedRingTightSteps = 12
	fusedRingDriftTol   = 2e-2
)

// ringLayout is a context-parallel layout of the fused-ring tests: dp x
// ep x cp virtual ranks, micro sequences of seq tokens each a rank.
type ringLayout struct{ dp, ep, cp, micro, seq int }

func (l ringLayout) String() string {
	return fmt.Sprintf("dp%d ep%d cp%d seq%d", l.dp, l.ep, l.cp, l.seq)
}

// config is base on layout l with parallel.cp_attention mode.
func (l ringLayout) config(base Config, mode string) Config {
	cfg := base
	cfg.Parallel.DP, cfg.Parallel.EP, cfg.Parallel.CP = l.dp, l.ep, l.cp
	cfg.Train.MicroBatch, cfg.Train.Seq = l.micro, l.seq
	cfg.Parallel.CPAttention = mode
	return cfg
}

// checkRingLosses requires the ring's loss at every step (0-based) within
// tol(step), relative, of one rank's (want) and of the all-gather path's
// (runs["ring"], runs["allgather"]), and returns the largest differences:
// the ring from one rank, the ring from the all-gather path, and the
// all-gather path from one rank.
func checkRingLosses(t *testing.T, what string, want []float64, runs map[string][]float64, tol func(step int) float64) (worstOne, worstGather, gatherOne float64) {
	t.Helper()
	for i, w := range want {
		ring, gather := runs["ring"][i], runs["allgather"][i]
		relOne, relGather := math.Abs(ring-w)/math.Abs(w), math.Abs(ring-gather)/math.Abs(gather)
		worstOne, worstGather = max(worstOne, relOne), max(worstGather, relGather)
		gatherOne = max(gatherOne, math.Abs(gather-w)/math.Abs(w))
		if tl := tol(i); !(relOne <= tl) || !(relGather <= tl) {
			t.Errorf("%s: step %d: loss %.6f, one rank %.6f, allgather %.6f (relative %.3g, %.3g > %g)",
				what, i+1, ring, w, gather, relOne, relGather, tl)
		}
	}
	return worstOne, worstGather, gatherOne
}

// TestFusedRingCUDA is TestRingCUDA at shapes the fused ring's kernels
// take (head dim 64; chunks of 64 positions, seq 256 at cp 2 and 512 at
// cp 4, which run in two passes; on a Hopper GPU chunks of 128, seq 512
// at cp 2 and 1024 at cp 4, which run in one), so that mode ring runs the
// fused ring (attention/ring_fused.go), which the log must say. Its losses over its first fusedRingTightSteps
// steps must stay within fusedRingTol of one rank's and of the all-gather
// path's on the same layout (a wrong kernel shows from the first steps),
// the rest of its 20 within fusedRingDriftTol; the log gives the
// differences against issue 27's 2e-4, beside
// the all-gather path's
// own difference from one rank. The two-pass ring runs attention_tc.cu's
// zigzag kernels (64-key tiles), while on a Hopper GPU one rank and the
// all-gather path run attention_hopper.cu (128-key tiles, so P is rounded
// to bf16 after another sequence of online-softmax rescalings, and dq is
// added by TMA reductions in the order blocks run); dk and dv add in
// another order too (per head, per rank). At this model's width and
// length the MoE routing turns such bf16- and float32-level rounding into
// loss differences of order 1e-3 within 20 steps, whichever path runs
// (an H200 at 9529949: up to 1.8e-3 from one rank, 2.1e-3 from the
// all-gather path), hence fusedRingTol. One rank trains twice, and the
// log gives its own difference between the two runs too: the floor under
// any path's difference from it (an H100 at e781755: 7.2e-5 to 6.9e-4
// over the seven layouts, so issue 27's 2e-4 is below what one rank
// repeats at these shapes).
func TestFusedRingCUDA(t *testing.T) {
	gpu := openGPU(t)
	base := equivalenceConfig()
	base.Model.Dim, base.Model.Heads, base.Model.KVHeads = 128, 2, 1
	base.Train.Steps, base.Train.GlobalBatch = 20, 4
	layouts := []ringLayout{{1, 1, 2, 4, 256}, {1, 1, 4, 4, 512}, {2, 1, 2, 2, 256}, {1, 2, 2, 2, 256}}
	onePass := gpu.ZigzagAttentionOnePass(backend.ZigzagShape{Ranks: 2, Batch: 4, Chunk: 128, Heads: 2, KVHeads: 1, HeadDim: 64}) == nil
	if onePass {
		layouts = append(layouts, []ringLayout{{1, 1, 2, 4, 512}, {1, 1, 4, 4, 1024}, {1, 2, 2, 2, 512}}...)
	} else {
		t.Logf("the one-pass ring is not tested here: %v", gpu.ZigzagAttentionOnePass(backend.ZigzagShape{Ranks: 2, Batch: 4, Chunk: 128, Heads: 2, KVHeads: 1, HeadDim: 64}))
	}
	for _, l := range layouts {
		one := base
		one.Train.Seq, one.Train.MicroBatch = l.seq, 4
		want := trainOn(t, one, gpu, fmt.Sprintf("dp1 ep1 seq%d", l.seq)).losses
		// One rank again: its own run-to-run difference (dq's and the
		// MoE kernels' float additions land in the order blocks run), the
		// floor under any path's difference from it.
		again := trainOn(t, one, gpu, fmt.Sprintf("dp1 ep1 seq%d again", l.seq)).losses
		layout := l.String()
		runs := map[string][]float64{}
		for _, mode := range []string{"ring", "allgather"} {
			runs[mode] = trainOn(t, l.config(base, mode), gpu, layout+" "+mode).losses
		}
		worstOne, worstGather, gatherOne := checkRingLosses(t, layout+" fused ring", want, runs, func(step int) float64 {
			if step >= fusedRingTightSteps {
				return fusedRingDriftTol
			}
			return fusedRingTol
		})
		var oneOne float64
		for i, w := range want {
			oneOne = max(oneOne, math.Abs(again[i]-w)/math.Abs(w))
		}
		t.Logf("%s fused ring: max relative loss difference %.2e from one rank (2e-4 held: %v), %.2e from allgather; allgather from one rank %.2e; one rank from itself %.2e",
			layout, worstOne, worstOne <= 2e-4, worstGather, gatherOne, oneOne)
		t.Logf("%s losses by step: one rank %.5f; again %.5f; ring %.5f; allgather %.5f", layout, want, again, runs["ring"], runs["allgather"])
	}
	// The path the layers took, from the engine's log.
	paths := []struct {
		seq  int
		want string
	}{{256, "context-parallel attention runs the fused ring\""}}
	if onePass {
		paths = append(paths, struct {
			seq  int
			want string
		}{512, "context-parallel attention runs the fused ring in one pass"})
	}
	for _, p := range paths {
		cfg := base
		cfg.Parallel.CP, cfg.Train.MicroBatch, cfg.Train.Seq, cfg.Train.Steps, cfg.Parallel.CPAttention = 2, 4, p.seq, 3, "ring"
		var log bytes.Buffer
		eng, err := New(cfg, withCUDA(), WithBackend(gpu), WithLogger(zerolog.New(&log)))
		if err != nil {
			t.Fatal(err)
		}
		_, err = eng.Run(t.Context())
		eng.Close()
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(log.String(), p.want) {
			t.Errorf("seq %d: the log does not say %q:\n%s", p.seq, p.want, log.String())
		}
	}
}

// TestFusedRingDeterministicCUDA is TestFusedRingCUDA with the run-to-run
// floor taken out. Under train.deterministic every path adds in a fixed
// order (one rank and the all-gather path on attention_tc.cu's ordered
// backward, the ring on its two-pass kernels, the MoE layers on the
// unfused dispatcher), so each run must repeat its own losses bit for
// bit, and what separates the ring from one rank is where it sums and
// rounds alone. That difference starts at the float32 level and the MoE
// routing amplifies it step by step, for the all-gather path as for the
// ring (an H100 at a75df4d: the ring 1.8e-6 to 3.6e-6 from one rank at
// step 1 and at most 5.3e-5 over the first 5 steps, first over 2e-4 at
// step 7 to 12; the all-gather path first over 2e-4 at step 8 to 14, and
// 1.7e-3 to 2.6e-3 from one rank over 20 steps, the ring 2.0e-3 to
// 3.7e-3). So issue 27's 2e-4 holds the ring, against one rank and
// against the all-gather path, over the first deterministicRingSteps
// steps, before the routing has amplified anything; the rest are held to
// TestFusedRingCUDA's tolerances, and the log gives the 20-step
// differences of both paths.
func TestFusedRingDeterministicCUDA(t *testing.T) {
	gpu := openGPU(t)
	const (
		bar                    = 2e-4
		deterministicRingSteps = 5
	)
	base := equivalenceConfig()
	base.Model.Dim, base.Model.Heads, base.Model.KVHeads = 128, 2, 1
	base.Train.Steps, base.Train.GlobalBatch, base.Train.Deterministic = 20, 4, true
	layouts := []ringLayout{{1, 1, 2, 4, 256}, {1, 1, 4, 4, 512}, {2, 1, 2, 2, 256}, {1, 2, 2, 2, 256}, {1, 1, 2, 4, 512}}
	repeats := func(what string, a, b []float64) {
		for i := range a {
			if math.Float64bits(a[i]) != math.Float64bits(b[i]) {
				t.Errorf("%s: step %d's loss is %.9g in the first run, %.9g in the second (train.deterministic)", what, i+1, a[i], b[i])
				return
			}
		}
	}
	for _, l := range layouts {
		one := base
		one.Train.Seq, one.Train.MicroBatch = l.seq, 4
		oneName := fmt.Sprintf("dp1 ep1 seq%d", l.seq)
		want := trainOn(t, one, gpu, oneName).losses
		repeats(oneName, want, trainOn(t, one, gpu, oneName+" again").losses)
		layout := l.String()
		ringCfg := l.config(base, "ring")
		world := ringCfg.mesh().World()
		if fused, onePass := PlanRing(ringCfg, world, world, gpu); !fused || onePass {
			t.Fatalf("%s: mode ring plans fused %v, one pass %v; want the two-pass fused ring", layout, fused, onePass)
		}
		runs := map[string][]float64{
			"ring":      trainOn(t, ringCfg, gpu, layout+" ring").losses,
			"allgather": trainOn(t, l.config(base, "allgather"), gpu, layout+" allgather").losses,
		}
		repeats(layout+" ring", runs["ring"], trainOn(t, ringCfg, gpu, layout+" ring again").losses)
		worstOne, worstGather, gatherOne := checkRingLosses(t, layout+" deterministic fused ring", want, runs, func(step int) float64 {
			switch {
			case step < deterministicRingSteps:
				return bar
			case step < fusedRingTightSteps:
				return fusedRingTol
			}
			return fusedRingDriftTol
		})
		t.Logf("%s deterministic fused ring: max relative loss difference over 20 steps %.2e from one rank, %.2e from allgather; allgather from one rank %.2e", layout, worstOne, worstGather, gatherOne)
		t.Logf("%s deterministic losses by step: one rank %.5f; ring %.5f; allgather %.5f", layout, want, runs["ring"], runs["allgather"])
	}
}
