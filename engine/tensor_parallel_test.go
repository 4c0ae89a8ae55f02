package engine

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/hf"
	"github.com/mktrain/mktrain/moe"
	"github.com/rs/zerolog"
)

// tensorParallelLayouts are the tensor-parallel layouts the equivalence
// test trains, each with sequence parallelism on and off. micro keeps one
// micro-batch per step of the 8-sequence global batch.
var tensorParallelLayouts = []struct {
	dp, ep, cp, tp, zero, micro int
	dispatcher, cpAttention     string
}{
	{1, 1, 1, 2, 0, 8, "", ""}, {1, 1, 1, 4, 0, 8, "", ""}, {1, 2, 1, 2, 0, 4, "", ""}, {2, 1, 1, 2, 0, 4, "", ""}, {1, 1, 2, 2, 0, 8, "", ""},
	{2, 1, 1, 2, 1, 4, "", ""}, {2, 2, 1, 2, 1, 2, "", ""}, {1, 1, 2, 2, 1, 8, "", ""},
	{1, 2, 1, 2, 0, 4, moe.DispatcherFused, ""}, // the fused dispatcher over the ep x tp expert group
	{1, 1, 2, 2, 0, 8, "", "ring"},              // context parallelism's ring over each tp rank's heads
}

// tpOverlaps are parallel.tp_overlap's settings the tensor-parallel
// equivalence tests train under: on the CPU the fused patterns run the
// backend's fused ops over the virtual ranks' peer access (its twins of
// the kernels), the unfused ones the collectives.
var tpOverlaps = []string{"unfused", "fused"}

// TestTensorParallelMatchesOneRank trains the equivalence model for 20
// steps on one rank and under tp 2, tp 4 (kv heads replicated: 2 kv heads
// over 4 ranks), tp2 x ep2, tp2 x dp2 and tp2 x cp2 (and with ZeRO-1:
// tp2 x dp2, tp2 x dp2 x ep2, tp2 x cp2), with sequence parallelism on
// and off, under parallel.tp_overlap fused and unfused (a subtest each),
// and requires every step's loss within 1e-4 of one rank's (float32), and
// the gradient norms and the final validation loss close too. The fused
// path must say it ran, and give the unfused path's losses bit for bit
// (the CPU's fused ops are the unfused sequences, the reduce-scatter's
// slots summed in rank order as the collective sums).
func TestTensorParallelMatchesOneRank(t *testing.T) {
	base := equivalenceConfig()
	base.Train.Steps, base.Train.MicroBatch = 20, 8
	want := trainEvents(t, base)
	for _, lay := range tensorParallelLayouts {
		for _, sp := range []bool{true, false} {
			name := fmt.Sprintf("dp%d_ep%d_cp%d_tp%d_zero%d_sp%v", lay.dp, lay.ep, lay.cp, lay.tp, lay.zero, sp)
			for _, extra := range []string{lay.dispatcher, lay.cpAttention} {
				if extra != "" {
					name += "_" + extra
				}
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				losses := map[string][]float64{}
				for _, overlap := range tpOverlaps {
					t.Run(overlap, func(t *testing.T) {
						cfg := base
						cfg.Parallel = ParallelConfig{DP: lay.dp, EP: lay.ep, CP: lay.cp, TP: lay.tp, Zero: lay.zero, SequenceParallel: sp, TPOverlap: overlap}
						if lay.dispatcher != "" {
							cfg.Model.MoE.Dispatcher = lay.dispatcher
						}
						if lay.cpAttention != "" {
							cfg.Parallel.CPAttention = lay.cpAttention
						}
						cfg.Train.MicroBatch = lay.micro
						got, log := trainEventsLog(t, cfg)
						if says := "tensor parallelism runs " + overlap; !strings.Contains(log, says) {
							t.Errorf("the log does not say %q:\n%s", says, log)
						}
						compareTensorParallel(t, got, want)
						if t.Failed() {
							// Which paths the run took, to tell a wrong
							// path from a wrong number.
							t.Logf("the run's log:\n%s", log)
						}
						for _, ev := range got {
							losses[overlap] = append(losses[overlap], ev.Loss)
						}
					})
				}
				if u, f := losses["unfused"], losses["fused"]; len(u) == len(want) && !slices.Equal(f, u) {
					t.Errorf("losses fused %v, unfused %v: want the same bits", f, u)
				}
			})
		}
	}
}

// trainEventsLog is trainEvents with the run's log.
func trainEventsLog(t *testing.T, cfg Config) ([]StepEvent, string) {
	t.Helper()
	var evs []StepEvent
	var log bytes.Buffer
	eng, err := New(cfg, WithLogger(zerolog.New(zerolog.SyncWriter(&log))), WithHook(func(ev StepEvent) { evs = append(evs, ev) }))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Run(context.Background()); err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	return evs, log.String()
}

// compareTensorParallel fails unless a tensor-parallel run's steps got
// match one rank's (want): losses and aux losses within 1e-4, gradient
// norms within 1e-3 relative, the final validation loss within 1e-4.
func compareTensorParallel(t *testing.T, got, want []StepEvent) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%d steps, want %d", len(got), len(want))
	}
	for i := range want {
		if d := math.Abs(got[i].Loss - want[i].Loss); d > 1e-4 {
			t.Errorf("step %d: loss %.7f, one rank %.7f (off by %.2g)", i+1, got[i].Loss, want[i].Loss, d)
		}
		if d := math.Abs(got[i].GradNorm-want[i].GradNorm) / want[i].GradNorm; d > 1e-3 {
			t.Errorf("step %d: grad norm %.6f, one rank %.6f", i+1, got[i].GradNorm, want[i].GradNorm)
		}
		if d := math.Abs(got[i].AuxLoss - want[i].AuxLoss); d > 1e-4 {
			t.Errorf("step %d: aux loss %.6f, one rank %.6f", i+1, got[i].AuxLoss, want[i].AuxLoss)
		}
	}
	maxDiff := 0.0
	for i := range want {
		maxDiff = max(maxDiff, math.Abs(got[i].Loss-want[i].Loss))
	}
	t.Logf("largest loss difference %.2g over %d steps (losses %.4f -> %.4f)", maxDiff, len(want), got[0].Loss, got[len(got)-1].Loss)
	last := len(want) - 1
	if d := math.Abs(got[last].ValLoss - want[last].ValLoss); d > 1e-4 {
		t.Errorf("validation loss %.6f, one rank %.6f", got[last].ValLoss, want[last].ValLoss)
	}
}

// A run saved under one tensor-parallel layout resumes under another (tp 2
// -> 1 -> 4, with ZeRO-1 and data parallelism on one side) and continues
// with the losses of the uninterrupted run on one rank.
func TestTensorParallelResume(t *testing.T) {
	type layout struct {
		dp, tp, zero int
		sp           bool
	}
	config := func(l layout) Config {
		c := checkpointConfig()
		c.Parallel = ParallelConfig{DP: l.dp, EP: 1, CP: 1, TP: l.tp, Zero: l.zero, SequenceParallel: l.sp}
		c.Train.MicroBatch = 4 / l.dp // two micro-batches per step
		return c
	}
	want, _ := runLosses(t, config(layout{1, 1, 0, true}), t.TempDir(), 0)
	for _, pair := range [][2]layout{
		{{1, 2, 0, true}, {1, 1, 0, true}}, {{1, 2, 0, false}, {1, 4, 0, true}}, {{1, 1, 0, true}, {1, 2, 0, false}},
		{{2, 2, 1, true}, {1, 4, 0, false}}, {{1, 4, 0, true}, {2, 2, 1, true}},
	} {
		dir := t.TempDir()
		runLosses(t, config(pair[0]), dir, 3)
		got, log := runLosses(t, config(pair[1]), dir, 0)
		if !strings.Contains(log, "resuming") {
			t.Fatalf("%+v -> %+v did not resume:\n%s", pair[0], pair[1], log)
		}
		for step := 4; step <= 8; step++ {
			if d := math.Abs(got[step] - want[step]); !(d <= 1e-4) {
				t.Errorf("%+v -> %+v, step %d: loss %.7f, uninterrupted on one rank %.7f", pair[0], pair[1], step, got[step], want[step])
			}
		}
	}
}

// tensorParallelRanks builds the ranks of cfg's layout on one CPU backend,
// each with its data, as Run would, without training them; ranks[i] is
// world rank i.
func tensorParallelRanks(t *testing.T, cfg Config) (*Engine, []*rank) {
	t.Helper()
	return ranksOn(t, cfg, cpu.New(backend.Float32))
}

// ranksOn is tensorParallelRanks on the backend b.
func ranksOn(t *testing.T, cfg Config, b backend.Backend) (*Engine, []*rank) {
	t.Helper()
	e, err := New(cfg, WithBackend(b))
	if err != nil {
		t.Fatal(err)
	}
	world, err := comm.NewLocal(cfg.mesh(), b)
	if err != nil {
		t.Fatal(err)
	}
	ranks := make([]*rank, len(world))
	for _, g := range world {
		train, val, err := e.openData(g.Data.Rank(), g.Data.Size())
		if err != nil {
			t.Fatal(err)
		}
		if ranks[g.Rank], err = newRank(context.Background(), cfg, b, g, train, val); err != nil {
			t.Fatal(err)
		}
	}
	return e, ranks
}

// restoreRanks loads the checkpoint in dir into every rank, optimizer
// state too.
func restoreRanks(t *testing.T, ranks []*rank, dir string) {
	t.Helper()
	ck, err := checkpoint.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	for _, r := range ranks {
		if err := r.restore(context.Background(), ck, true); err != nil {
			t.Fatal(err)
		}
	}
}

// savedTensors writes the ranks' snapshots as the checkpoint of step in the
// run directory runDir (as Run's saver does) and returns its directory and
// every tensor in it, model and optimizer, by name.
func savedTensors(t *testing.T, e *Engine, ranks []*rank, runDir string, step int) (string, map[string][]float32) {
	t.Helper()
	var snaps []rankSnapshot
	for i, r := range ranks {
		snaps = append(snaps, r.snapshot(i))
	}
	s := &saver{e: e, root: filepath.Join(runDir, "checkpoints")}
	if err := s.write(snaps, trainState{Step: step, Config: e.cfg, Mesh: e.cfg.mesh()}); err != nil {
		t.Fatal(err)
	}
	ck, err := checkpoint.Open(s.lastDir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	out := map[string][]float32{}
	for _, set := range []*checkpoint.TensorSet{ck.Model(), ck.Optim()} {
		for _, name := range set.Names() {
			data, _, err := set.Tensor(name)
			if err != nil {
				t.Fatal(err)
			}
			out[name] = data
		}
	}
	return s.lastDir, out
}

// A checkpoint holds whole tensors whatever the tensor-parallel layout:
// saved at tp 2 (with and without ZeRO-1), loaded at tp 1 and tp 4 and
// saved again, every model tensor and moment is bitwise the same, and the
// Hugging Face export of the tp 1 checkpoint is byte for byte the export
// of the tp 2 one. An export imported (checkpoint.init_from) at tp 4 gives
// back the same tensors.
func TestTensorParallelCheckpointIsLayoutFree(t *testing.T) {
	cfg := checkpointConfig()
	cfg.Train.Steps, cfg.Train.WarmupSteps = 2, 1
	cfg.Model.MoE.Dispatcher = moe.DispatcherUnfused // the ranks are built here, not by Run
	type layout struct {
		dp, tp, zero int
		sp           bool
	}
	config := func(l layout) Config {
		c := cfg
		c.Parallel = ParallelConfig{DP: l.dp, EP: 1, CP: 1, TP: l.tp, Zero: l.zero, SequenceParallel: l.sp}
		c.Train.MicroBatch = 4 / l.dp
		return c
	}
	for _, from := range []layout{{1, 2, 0, true}, {2, 2, 1, false}} {
		e, ranks := tensorParallelRanks(t, config(from))
		trainRanks(t, ranks, cfg.Train.Steps)
		fromRun := t.TempDir()
		dir, want := savedTensors(t, e, ranks, fromRun, cfg.Train.Steps)
		if len(want) == 0 {
			t.Fatal("the checkpoint holds no tensors")
		}
		fromHF := filepath.Join(t.TempDir(), "hf")
		exportHF(t, cfg, fromRun, fromHF, hf.FP32)
		for _, to := range []layout{{1, 1, 0, true}, {1, 4, 0, false}, {2, 2, 1, true}} {
			e2, ranks2 := tensorParallelRanks(t, config(to))
			restoreRanks(t, ranks2, dir)
			toRun := t.TempDir()
			_, got := savedTensors(t, e2, ranks2, toRun, cfg.Train.Steps)
			if len(got) != len(want) {
				t.Errorf("%+v -> %+v: %d tensors saved again, %d at first", from, to, len(got), len(want))
			}
			for name, w := range want {
				if !slices.Equal(got[name], w) {
					t.Errorf("%+v -> %+v: %s differs", from, to, name)
				}
			}
			toHF := filepath.Join(t.TempDir(), "hf")
			exportHF(t, cfg, toRun, toHF, hf.FP32)
			sameFiles(t, fmt.Sprintf("%+v -> %+v: the Hugging Face export", from, to), toHF, fromHF)
		}
		// The export imported at tp 4: the same model tensors.
		imp := config(layout{1, 4, 0, true})
		imp.Train.Seed = 99 // a different initialisation, overwritten
		e4, ranks4 := tensorParallelRanks(t, imp)
		if err := e4.loadHF(fromHF, ranks4); err != nil {
			t.Fatal(err)
		}
		_, got := savedTensors(t, e4, ranks4, t.TempDir(), cfg.Train.Steps)
		for name, w := range want {
			if !strings.HasSuffix(name, suffixAvg) && !strings.HasSuffix(name, suffixAvgSq) && !strings.HasSuffix(name, "expert_bias") && !slices.Equal(got[name], w) {
				t.Errorf("%+v, imported at tp 4: %s differs", from, name)
			}
		}
	}
}

// sameFiles fails unless the folders got and want hold the same files,
// byte for byte.
func sameFiles(t *testing.T, what, got, want string) {
	t.Helper()
	names, err := os.ReadDir(want)
	if err != nil || len(names) == 0 {
		t.Fatalf("%s: %s holds no files (%v)", what, want, err)
	}
	for _, n := range names {
		w, err1 := os.ReadFile(filepath.Join(want, n.Name()))
		g, err2 := os.ReadFile(filepath.Join(got, n.Name()))
		if err1 != nil || err2 != nil || !bytes.Equal(g, w) {
			t.Errorf("%s: %s differs (%v, %v)", what, n.Name(), err1, err2)
		}
	}
}

// Tensor-parallel ranks split over two TCP nodes (the tensor group across
// the nodes) train bitwise the losses of the same layout as virtual ranks.
// Under parallel.tp_overlap fused the TCP groups offer no peer access: the
// nodes say they fall back to the collectives, and still give the fused
// virtual ranks' bits.
func TestTensorParallelDistributed(t *testing.T) {
	for _, p := range []ParallelConfig{
		{DP: 1, EP: 1, CP: 1, TP: 2, SequenceParallel: true},
		{DP: 1, EP: 1, CP: 1, TP: 2, SequenceParallel: false},
		{DP: 2, EP: 1, CP: 1, TP: 2, Zero: 1, SequenceParallel: true},
		{DP: 1, EP: 1, CP: 1, TP: 2, SequenceParallel: true, TPOverlap: "fused"},
	} {
		name := fmt.Sprintf("dp%d_tp%d_zero%d_sp%v", p.DP, p.TP, p.Zero, p.SequenceParallel)
		if p.TPOverlap != "" {
			name += "_" + p.TPOverlap
		}
		t.Run(name, func(t *testing.T) {
			cfg := equivalenceConfig()
			cfg.Parallel, cfg.Train.MicroBatch, cfg.Train.Steps = p, 8/p.DP, 3
			want := trainLosses(t, cfg)
			logs := make([]bytes.Buffer, 2)
			runs := runNodes(t, cfg, []string{"", ""}, func(node int) []Option {
				return []Option{WithLogger(zerolog.New(zerolog.SyncWriter(&logs[node])))}
			})
			for i, r := range runs {
				if r.err != nil {
					t.Fatalf("node %d: %v", i, r.err)
				}
			}
			if !slices.Equal(runs[0].losses, want) {
				t.Errorf("two nodes: losses %v, virtual ranks %v", runs[0].losses, want)
			}
			if p.TPOverlap == "fused" {
				for i := range logs {
					if says := "fall back to the unfused collectives"; !strings.Contains(logs[i].String(), says) {
						t.Errorf("node %d: the log does not say %q:\n%s", i, says, logs[i].String())
					}
				}
			}
		})
	}
}

// The engine settles parallel.tp_overlap once per run and says what it
// chose and which path the tensor-parallel groups run: auto on the CPU is
// unfused by rule; an explicit fused runs fused on virtual ranks.
func TestTPOverlapChoiceLogged(t *testing.T) {
	for _, c := range []struct{ mode, says, runs string }{
		{"auto", "parallel.tp_overlap auto: unfused, unmeasured: on the CPU", "tensor parallelism runs unfused"},
		{"", "parallel.tp_overlap auto: unfused, unmeasured: on the CPU", "tensor parallelism runs unfused"},
		{"fused", "parallel.tp_overlap: fused, as the recipe says", "tensor parallelism runs fused"},
	} {
		cfg := equivalenceConfig()
		cfg.Train.Steps, cfg.Train.MicroBatch, cfg.Parallel.TP, cfg.Parallel.TPOverlap = 3, 8, 2, c.mode
		_, log := trainEventsLog(t, cfg)
		for _, want := range []string{c.says, c.runs} {
			if !strings.Contains(log, want) {
				t.Errorf("tp_overlap %q: the log does not say %q:\n%s", c.mode, want, log)
			}
		}
	}
}
