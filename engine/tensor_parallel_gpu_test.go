package engine

// The tensor-parallel layouts of TestTensorParallelMatchesOneRank trained
// as virtual ranks of one GPU under both parallel.tp_overlap settings
// (tpOverlaps): unfused, comm's in-process collectives around cuBLASLt's
// products; fused, the backend's fused ops (tp_gather, tp_scatter) over
// the virtual ranks' peer access; and the sharded cross-entropy's kernels
// in both. It skips, with one line, where there is no GPU.

import (
	"fmt"
	"math"
	"testing"
)

func TestTensorParallelCUDA(t *testing.T) {
	gpu := openGPU(t)
	base := equivalenceConfig()
	base.Train.Steps, base.Train.MicroBatch = 20, 8
	one := trainOn(t, base, gpu, "tp1")
	for _, lay := range tensorParallelLayouts {
		for _, sp := range []bool{true, false} {
			for _, overlap := range tpOverlaps {
				layout := fmt.Sprintf("dp%d ep%d cp%d tp%d zero%d sp %v %s", lay.dp, lay.ep, lay.cp, lay.tp, lay.zero, sp, overlap)
				cfg := base
				cfg.Parallel = ParallelConfig{DP: lay.dp, EP: lay.ep, CP: lay.cp, TP: lay.tp, Zero: lay.zero, SequenceParallel: sp, TPOverlap: overlap}
				cfg.Train.MicroBatch = lay.micro
				if lay.dispatcher != "" {
					cfg.Model.MoE.Dispatcher = lay.dispatcher
					layout += " " + lay.dispatcher
				}
				if lay.cpAttention != "" {
					cfg.Parallel.CPAttention = lay.cpAttention
					layout += " " + lay.cpAttention
				}
				got := trainOn(t, cfg, gpu, layout)
				worst := 0.0
				for i, want := range one.losses {
					rel := math.Abs(got.losses[i]-want) / math.Abs(want)
					worst = max(worst, rel)
					if !(rel <= virtualRanksTol) {
						t.Errorf("%s: step %d: loss %.6f, one rank %.6f: relative difference %.3g > %g", layout, i+1, got.losses[i], want, rel, virtualRanksTol)
					}
				}
				t.Logf("%s: loss %.5f -> %.5f, max relative difference from one rank %.2e", layout, got.losses[0], got.losses[len(got.losses)-1], worst)
			}
		}
	}
}
