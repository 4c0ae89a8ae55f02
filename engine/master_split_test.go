package engine

import (
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/moe"
)

// bf16Operands is the CPU backend with bf16 as its products' operand type,
// as the GPU's: the engine then keeps the weights the products read in
// bf16 (rounded copies, or split masters' halves), and the CPU, which
// holds bf16 tensors on the bf16 grid, multiplies them as it multiplies
// float32 ones.
type bf16Operands struct{ *cpu.Backend }

func (bf16Operands) OperandType() backend.DType { return backend.BFloat16 }

func bf16OperandBackend() backend.Backend { return bf16Operands{cpu.New(backend.Float32)} }

// splitConfig is the tiny recipe's model on the CPU for a few steps.
func splitConfig() Config {
	cfg := DefaultConfig()
	cfg.Train.Backend, cfg.Train.Steps, cfg.Train.WarmupSteps, cfg.Train.EvalEvery = "cpu", 3, 1, 0
	cfg.Parallel.CPAttention, cfg.Parallel.TPOverlap = "allgather", "unfused"
	cfg.Model.MoE.Dispatcher = moe.DispatcherUnfused // ranks built here, not by Run, which settles auto
	return cfg
}

// TestSplitMastersTrainAsCopies trains the tiny model on bf16 operands
// with float32 masters and a rounded copy (fp32) and with split masters
// (split, and auto), on one rank and on expert- and tensor-parallel
// layouts, with the update after the backward and in it: the stores are
// as master_split.go lays them out (no copy; float32 only for the norms
// and the embedding), and the losses and masters follow the copies'
// closely. They are not the same bits: an operand whose master's low
// half is exactly 0x8000 rounds away from zero, not to even, and from
// there every gradient moves a little, and AdamW's normalised step can
// turn where a gradient is near zero. The learning rate is 1e-5, so that
// a step is smaller than half a bf16 ulp of most weights: masters that
// lost their low halves would barely move, an rms difference of
// about 3e-5 from float32 masters (as a mutation that clears them shows).
// Over three steps the losses agree within 1.1e-5 relative (bound 5e-5:
// the bf16 roundings of q, k, v, the normalised inputs and the attention
// output pass a tie's step on) and the masters within 1e-6 each and 8e-9
// in rms (bounds 5e-6 and 5e-8).
func TestSplitMastersTrainAsCopies(t *testing.T) {
	layouts := []struct {
		name   string
		ep, tp int
		clip   float64
	}{
		{"one rank", 1, 1, 1},
		{"one rank, experts updated in the backward", 1, 1, 0},
		{"ep2", 2, 1, 1},
		{"tp2 sequence parallel, experts updated in the backward", 1, 2, 0},
	}
	for _, l := range layouts {
		t.Run(l.name, func(t *testing.T) {
			cfg := splitConfig()
			cfg.Parallel.EP, cfg.Parallel.TP, cfg.Train.GradClip = l.ep, l.tp, l.clip
			cfg.Parallel.SequenceParallel = strings.Contains(l.name, "sequence parallel")
			cfg.Train.MicroBatch = cfg.Train.GlobalBatch / l.ep
			cfg.Train.MasterWeights = MasterWeightsFP32
			cfg.Train.LR, cfg.Train.MinLR = 1e-5, 1e-6 // see above
			want, wantRanks := splitRun(t, cfg)
			for _, mode := range []string{MasterWeightsSplit, MasterWeightsAuto} {
				cfg.Train.MasterWeights = mode
				got, ranks := splitRun(t, cfg)
				for i := range want.steps {
					w, g := want.steps[i], got.steps[i]
					if math.Abs(g.loss-w.loss) > 5e-5*w.loss || math.Abs(g.gradNorm-w.gradNorm) > 1e-3*w.gradNorm {
						t.Errorf("%s: step %d: loss %.9g, grad norm %.6g; %.9g, %.6g with float32 masters", mode, i+1, g.loss, g.gradNorm, w.loss, w.gradNorm)
					}
				}
				for r := range ranks {
					rk, fp := ranks[r], wantRanks[r]
					at := rk.layout.fp32Prefix()
					if rk.split.hi == nil || rk.wStore.flat.Len() != at || rk.split.hi.Len() != rk.layout.total-at ||
						rk.split.lo.Len() != (rk.layout.total-at)/2 || rk.op.flat != nil {
						t.Fatalf("%s: rank %d: stores float32 %d, hi %v, operand copy %v; want float32 %d, hi %d, no copy",
							mode, r, rk.wStore.flat.Len(), rk.split.hi, rk.op.flat != nil, at, rk.layout.total-at)
					}
					if fp.split.hi != nil || fp.op.flat == nil {
						t.Fatalf("fp32: rank %d holds split masters or no copy", r)
					}
					var ss, n float64
					for i, p := range rk.params {
						a, b := p.download(rk.b), fp.params[i].download(fp.b)
						for j := range a {
							d := math.Abs(float64(a[j] - b[j]))
							if d > 5e-6 || math.IsNaN(d) {
								t.Fatalf("%s: rank %d: %s[%d] = %g, %g with float32 masters", mode, r, p.slot.name, j, a[j], b[j])
							}
							ss, n = ss+d*d, n+1
						}
					}
					if rms := math.Sqrt(ss / n); rms > 5e-8 {
						t.Errorf("%s: rank %d: the masters differ from float32 masters' by an rms of %.3g", mode, r, rms)
					}
				}
			}
		})
	}
}

type splitRan struct{ steps []stepResult }

func splitRun(t *testing.T, cfg Config) (splitRan, []*rank) {
	t.Helper()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	_, ranks := ranksOn(t, cfg, bf16OperandBackend())
	res := trainRanks(t, ranks, cfg.Train.Steps)
	return splitRan{steps: res[0]}, ranks
}

// TestSplitMastersCheckpoint: a checkpoint of split masters holds the
// float32 masters joined from their halves, bit for bit; restored into
// new split ranks they come back bit for bit, and both go on training
// identically. Restored into float32 masters (fp32) they are the same
// masters too: the checkpoint does not depend on the setting.
func TestSplitMastersCheckpoint(t *testing.T) {
	cfg := splitConfig()
	cfg.Parallel.EP, cfg.Train.MicroBatch, cfg.Train.Steps = 2, 4, 4
	cfg.Train.MasterWeights = MasterWeightsSplit
	e, ranks := ranksOn(t, cfg, bf16OperandBackend())
	trainRanks(t, ranks, 2)
	dir, saved := savedTensors(t, e, ranks, t.TempDir(), 2)
	for _, p := range ranks[0].params {
		if p.slot.role == roleExpert {
			continue // saved per expert
		}
		if w := p.download(ranks[0].b); !slices.Equal(saved[p.slot.name], w) {
			t.Fatalf("%s: the checkpoint's tensor is not the joined masters", p.slot.name)
		}
	}
	for _, mode := range []string{MasterWeightsFP32, MasterWeightsSplit} {
		c := cfg
		c.Train.MasterWeights = mode
		_, again := ranksOn(t, c, bf16OperandBackend())
		restoreRanks(t, again, dir)
		for r := range ranks {
			for i, p := range ranks[r].params {
				if a, b := p.download(ranks[r].b), again[r].params[i].download(again[r].b); !slices.Equal(a, b) {
					t.Fatalf("%s: rank %d: %s restored differs", mode, r, p.slot.name)
				}
			}
		}
		if mode != MasterWeightsSplit {
			continue
		}
		// The same two steps on, from the same batches (fresh streams for
		// both): the same losses and masters, bit for bit.
		for _, rs := range [][]*rank{ranks, again} {
			for _, r := range rs {
				var err error
				if r.train, _, err = e.openData(r.groups.Data.Rank(), r.groups.Data.Size()); err != nil {
					t.Fatal(err)
				}
			}
		}
		want, got := trainRanks(t, ranks, 2), trainRanks(t, again, 2)
		for i := range want[0] {
			if got[0][i].loss != want[0][i].loss {
				t.Errorf("step %d after the restore: loss %.9g, want %.9g", i+3, got[0][i].loss, want[0][i].loss)
			}
		}
		for r := range ranks {
			if !slices.Equal(backend.DownloadFloat32(ranks[r].b, ranks[r].split.hi), backend.DownloadFloat32(again[r].b, again[r].split.hi)) ||
				!slices.Equal(backend.DownloadInt32(ranks[r].b, ranks[r].split.lo), backend.DownloadInt32(again[r].b, again[r].split.lo)) {
				t.Errorf("rank %d: the masters differ two steps after the restore", r)
			}
		}
	}
}

// TestMasterWeightsSetting: auto splits except under ZeRO-1, "" keeps
// float32 masters (configurations saved before the field), split with
// ZeRO-1 is refused naming the field, and a backend that multiplies in
// float32 never splits.
func TestMasterWeightsSetting(t *testing.T) {
	c := DefaultConfig()
	for mode, want := range map[string]bool{MasterWeightsAuto: true, MasterWeightsSplit: true, MasterWeightsFP32: false, "": false} {
		c.Train.MasterWeights = mode
		if err := c.Validate(); err != nil {
			t.Fatal(err)
		}
		if got := c.SplitsMasters(bf16OperandBackend()); got != want {
			t.Errorf("%q: split %v, want %v", mode, got, want)
		}
		if c.SplitsMasters(cpu.New(backend.Float32)) {
			t.Errorf("%q: split masters on a float32-operand backend", mode)
		}
	}
	c.Parallel.DP, c.Parallel.Zero, c.Train.MicroBatch = 2, 1, 4
	c.Train.MasterWeights = MasterWeightsAuto
	if err := c.Validate(); err != nil || c.SplitsMasters(bf16OperandBackend()) {
		t.Errorf("auto under zero 1: %v, split %v", err, c.SplitsMasters(bf16OperandBackend()))
	}
	c.Train.MasterWeights = MasterWeightsSplit
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "train.master_weights") {
		t.Errorf("split under zero 1: %v", err)
	}
	c.Train.MasterWeights = "half"
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "train.master_weights") {
		t.Errorf("master_weights half: %v", err)
	}
}

// TestFP32PrefixIsNormsAndEmbedding: the float32 part of split masters is
// the norms and the embedding table, at the front of every layout, as
// package plan counts it (flatPrefix): 2·layers+1 norms and [vocab, dim].
func TestFP32PrefixIsNormsAndEmbedding(t *testing.T) {
	m := DefaultConfig().Model
	align := func(n int) int { return (n + flatAlign - 1) / flatAlign * flatAlign }
	want := (2*m.Layers+1)*align(m.Dim) + align(m.Vocab*m.Dim)
	for _, tp := range []tpRank{noTP, {n: 2, r: 1, sp: true}, {n: 2, r: 0}} {
		if got := newFlatLayoutTP(m, m.MoE.Experts/tp.n, tp).fp32Prefix(); got != want {
			t.Errorf("tp %+v: the float32 prefix ends at %d, want %d", tp, got, want)
		}
	}
}
