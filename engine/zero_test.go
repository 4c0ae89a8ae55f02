package engine

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
)

// sizedGroup is a group of n ranks for plans that only ask its size.
type sizedGroup struct {
	comm.Group
	n int
}

func (g sizedGroup) Size() int { return g.n }

// The pieces of a plan tile its rounds, the rounds tile the padded span,
// every piece is aligned and no round is much longer than asked.
func TestShardPlanCut(t *testing.T) {
	for _, c := range []struct{ length, ranks, roundElems, rounds int }{
		{64 * 5, 1, 1 << 20, 1}, {64 * 5, 2, 1 << 20, 1}, {64 * 7, 4, 1 << 20, 1},
		{64 * 1000, 3, 64 * 100, 10}, {64 * 1001, 8, 64 * 100, 11}, {23104, 4, 4096, 6},
	} {
		t.Run(fmt.Sprint(c.length, "/", c.ranks, "/", c.roundElems), func(t *testing.T) {
			p := newShardPlan(sizedGroup{n: c.ranks}, span{0, c.length}, c.roundElems)
			if p.rounds != c.rounds {
				t.Errorf("%d rounds, want %d", p.rounds, c.rounds)
			}
			if p.padded() < c.length || (c.ranks > 1 && p.padded() >= c.length+p.rounds*c.ranks*flatAlign) {
				t.Errorf("padded to %d for %d elements: too little or too much", p.padded(), c.length)
			}
			if c.ranks == 1 && (p.piece != c.length || p.rounds != 1) {
				t.Errorf("one rank: pieces of %d in %d rounds, want the span in one", p.piece, p.rounds)
			}
			at := 0
			for k := range p.rounds {
				r := p.round(k)
				if r.lo != at || r.hi-r.lo > c.roundElems+c.ranks*flatAlign {
					t.Fatalf("round %d is %v after %d", k, r, at)
				}
				for q := range c.ranks {
					own := p.own(k, q)
					if own.lo != at || own.lo%flatAlign != 0 || own.empty() {
						t.Fatalf("round %d, rank %d: piece %v, want one aligned from %d", k, q, own, at)
					}
					at = own.hi
				}
				if at != r.hi {
					t.Fatalf("round %d's pieces end at %d, the round at %d", k, at, r.hi)
				}
			}
			if at != p.padded() || p.moments()*c.ranks != p.padded() {
				t.Errorf("the rounds end at %d, padded %d, moments %d x %d ranks", at, p.padded(), p.moments(), c.ranks)
			}
		})
	}
}

// zeroConfig is equivalenceConfig with clipping that acts on most steps.
func zeroConfig() Config {
	cfg := equivalenceConfig()
	cfg.Train.GradClip = 0.2
	return cfg
}

// zeroLayouts are the layouts of the ZeRO tests, each with two
// micro-batches per step.
var zeroLayouts = []struct{ dp, ep, cp, micro int }{
	{2, 1, 1, 2}, {4, 1, 1, 1}, {2, 2, 1, 1}, {2, 1, 2, 2},
}

// With parallel.zero: 1 the virtual ranks make bitwise the steps of
// zero: 0: losses, gradient norms (so the clipping, active here), the
// auxiliary losses and the validation loss.
func TestZeroMatchesNoZero(t *testing.T) {
	for _, l := range zeroLayouts {
		t.Run(fmt.Sprintf("dp%d_ep%d_cp%d", l.dp, l.ep, l.cp), func(t *testing.T) {
			cfg := zeroConfig()
			cfg.Parallel.DP, cfg.Parallel.EP, cfg.Parallel.CP, cfg.Train.MicroBatch = l.dp, l.ep, l.cp, l.micro
			cfg.Train.Steps, cfg.Train.EvalEvery = 6, 3
			want := trainEvents(t, cfg)
			cfg.Parallel.Zero = 1
			got := trainEvents(t, cfg)
			clipped := 0
			for i := range want {
				g, w := got[i], want[i]
				if g.Loss != w.Loss || g.GradNorm != w.GradNorm || g.AuxLoss != w.AuxLoss || g.ZLoss != w.ZLoss ||
					!(g.ValLoss == w.ValLoss || math.IsNaN(g.ValLoss) && math.IsNaN(w.ValLoss)) {
					t.Errorf("step %d: loss %.9g, grad norm %.9g, aux %.9g, z %.9g, val %.9g with zero 1; %.9g, %.9g, %.9g, %.9g, %.9g with zero 0",
						i+1, g.Loss, g.GradNorm, g.AuxLoss, g.ZLoss, g.ValLoss, w.Loss, w.GradNorm, w.AuxLoss, w.ZLoss, w.ValLoss)
				}
				if w.GradNorm > cfg.Train.GradClip {
					clipped++
				}
			}
			if clipped == 0 {
				t.Errorf("no step was clipped (grad_clip %g): the test does not cover clipping", cfg.Train.GradClip)
			}
		})
	}
}

// zeroSteps trains cfg.Train.Steps steps on the ranks of world (all of the
// mesh, in this process) with ZeRO rounds of about roundElems elements,
// calling trainStep directly, and returns world rank 0's results and the
// ranks by world rank.
func zeroSteps(t *testing.T, cfg Config, b backend.Backend, world []*comm.Ranks, roundElems int) ([]stepResult, []*rank) {
	t.Helper()
	e, err := New(cfg, WithBackend(b))
	if err != nil {
		t.Fatal(err)
	}
	ranks := make([]*rank, len(world))
	for _, g := range world {
		train, val, err := e.openData(g.Data.Rank(), g.Data.Size())
		if err != nil {
			t.Fatal(err)
		}
		if ranks[g.Rank], err = newRankRounds(context.Background(), cfg, b, g, train, val, roundElems); err != nil {
			t.Fatal(err)
		}
	}
	results := trainRanks(t, ranks, cfg.Train.Steps)
	return results[0], ranks
}

// replicatedWeights is the replicated tensors of r's weights, in slot order.
func replicatedWeights(r *rank) []float32 {
	var out []float32
	for _, p := range r.params {
		if p.slot.role != roleExpert {
			out = append(out, backend.DownloadFloat32(r.b, p.w)...)
		}
	}
	return out
}

// Several rounds, on virtual ranks and on two TCP nodes: the steps and the
// final weights of every rank are bitwise those of zero: 0, and each rank's
// moments are its pieces plus its experts.
func TestZeroRounds(t *testing.T) {
	cfg := zeroConfig()
	cfg.Parallel.DP, cfg.Parallel.EP, cfg.Train.MicroBatch = 2, 2, 1
	cfg.Train.Steps = 3
	cfg.Model.MoE.Dispatcher = moe.DispatcherUnfused // the ranks are built here, not by Run
	const roundElems = 4096
	b := cpu.New(backend.Float32)
	local := func() []*comm.Ranks {
		w, err := comm.NewLocal(cfg.mesh(), b)
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	want, plain := zeroSteps(t, cfg, b, local(), roundElems)
	wantW := replicatedWeights(plain[0])
	cfg.Parallel.Zero = 1
	for _, run := range []struct {
		name  string
		world []*comm.Ranks
	}{{"virtual ranks", local()}, {"tcp", tcpWorld(t, cfg.mesh(), 2, b)}} {
		t.Run(run.name, func(t *testing.T) {
			got, ranks := zeroSteps(t, cfg, b, run.world, roundElems)
			for i := range want {
				if got[i].loss != want[i].loss || got[i].gradNorm != want[i].gradNorm {
					t.Errorf("step %d: loss %.9g, grad norm %.9g with zero 1; %.9g, %.9g with zero 0",
						i+1, got[i].loss, got[i].gradNorm, want[i].loss, want[i].gradNorm)
				}
			}
			for q, r := range ranks {
				if !r.zero || r.shards.rounds < 3 {
					t.Fatalf("rank %d: zero %v, %d rounds: the test wants several", q, r.zero, r.shards.rounds)
				}
				w := replicatedWeights(r)
				for i := range wantW {
					if math.Float32bits(w[i]) != math.Float32bits(wantW[i]) {
						t.Fatalf("rank %d: replicated weight %d is %v, %v with zero 0", q, i, w[i], wantW[i])
					}
				}
				experts := r.layout.experts.hi - r.layout.experts.lo
				if r.m.Len() != r.shards.moments()+experts || r.v.Len() != r.m.Len() {
					t.Errorf("rank %d: moments of %d and %d elements, want %d pieces + %d experts", q, r.m.Len(), r.v.Len(), r.shards.moments(), experts)
				}
				if full := plain[q].m.Len(); r.m.Len() >= full-r.shards.tensors.hi/2 {
					t.Errorf("rank %d: %d moment elements with zero 1, %d without, for a replicated span of %d over 4 ranks", q, r.m.Len(), full, r.shards.tensors.hi)
				}
			}
		})
	}
}

// The saving is logged; a run of one data-parallel rank says that zero
// does nothing there.
func TestZeroLogsMemory(t *testing.T) {
	for _, dp := range []int{4, 1} {
		cfg := zeroConfig()
		cfg.Parallel.DP, cfg.Train.MicroBatch, cfg.Parallel.Zero = dp, 8/dp, 1
		cfg.Model.MoE.Dispatcher = moe.DispatcherUnfused
		var logBuf bytes.Buffer
		b := cpu.New(backend.Float32)
		e, err := New(cfg, WithBackend(b), WithLogger(zerolog.New(&logBuf)))
		if err != nil {
			t.Fatal(err)
		}
		world, err := comm.NewLocal(cfg.mesh(), b)
		if err != nil {
			t.Fatal(err)
		}
		train, val, err := e.openData(world[0].Data.Rank(), world[0].Data.Size())
		if err != nil {
			t.Fatal(err)
		}
		r, err := newRank(context.Background(), cfg, b, world[0], train, val)
		if err != nil {
			t.Fatal(err)
		}
		e.logOptimizerMemory([]*rank{r})
		log := logBuf.String()
		if dp == 1 {
			if !strings.Contains(log, "shards nothing") {
				t.Errorf("dp 1: %s", log)
			}
			continue
		}
		now, without := r.momentBytes()
		experts, p := r.layout.experts.hi-r.layout.experts.lo, r.shards
		if now != int64(8*(p.moments()+experts)) || without != int64(8*(p.tensors.hi-p.tensors.lo+experts)) || now >= without || !strings.Contains(log, "zero-1: the AdamW moments take") ||
			!strings.Contains(log, fmt.Sprintf(`"moment_bytes":%d,"moment_bytes_without_zero":%d`, now, without)) {
			t.Errorf("dp 4: %d bytes of moments, %d without zero; log:\n%s", now, without, log)
		}
	}
}

// checkpointFiles is the tensor files of the newest checkpoint under runDir,
// by name.
func checkpointFiles(t *testing.T, runDir string) map[string][]byte {
	t.Helper()
	dir, err := checkpoint.Latest(filepath.Join(runDir, "checkpoints"))
	if err != nil {
		t.Fatal(err)
	}
	names, err := filepath.Glob(filepath.Join(dir, "*.safetensors*"))
	if err != nil || len(names) == 0 {
		t.Fatalf("no tensor files in %s (%v)", dir, err)
	}
	out := map[string][]byte{}
	for _, n := range names {
		if out[filepath.Base(n)], err = os.ReadFile(n); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// A run with zero: 1 writes the checkpoint of zero: 0, byte for byte; a
// checkpoint resumes with the other setting with the same losses, and
// under another layout within float32 tolerance.
func TestZeroCheckpoints(t *testing.T) {
	type layout struct{ dp, ep, zero int }
	config := func(l layout) Config {
		c := checkpointConfig()
		c.Train.GradClip = 0.2
		c.Parallel.DP, c.Parallel.EP, c.Parallel.Zero = l.dp, l.ep, l.zero
		c.Train.MicroBatch = 4 / (l.dp * l.ep) // two micro-batches per step
		return c
	}
	plainDir, zeroDir := t.TempDir(), t.TempDir()
	want, _ := runLosses(t, config(layout{2, 1, 0}), plainDir, 0)
	got, _ := runLosses(t, config(layout{2, 1, 1}), zeroDir, 0)
	for step := 1; step <= 8; step++ {
		if got[step] != want[step] {
			t.Errorf("straight, step %d: loss %v with zero 1, %v with zero 0", step, got[step], want[step])
		}
	}
	plainFiles, zeroFiles := checkpointFiles(t, plainDir), checkpointFiles(t, zeroDir)
	if len(plainFiles) != len(zeroFiles) {
		t.Errorf("%d tensor files with zero 1, %d with zero 0", len(zeroFiles), len(plainFiles))
	}
	for name, w := range plainFiles {
		if !bytes.Equal(zeroFiles[name], w) {
			t.Errorf("%s differs between zero 1 and zero 0", name)
		}
	}

	for _, pair := range [][2]layout{
		{{2, 1, 1}, {2, 1, 0}}, {{2, 1, 0}, {2, 1, 1}},
		{{2, 1, 1}, {4, 1, 1}}, {{2, 2, 1}, {1, 1, 0}},
	} {
		dir := t.TempDir()
		runLosses(t, config(pair[0]), dir, 3)
		got, log := runLosses(t, config(pair[1]), dir, 0)
		if !strings.Contains(log, "resuming") {
			t.Fatalf("%+v -> %+v did not resume:\n%s", pair[0], pair[1], log)
		}
		sameLayout := pair[0].dp == pair[1].dp && pair[0].ep == pair[1].ep
		for step := 4; step <= 8; step++ {
			if sameLayout && got[step] != want[step] || !(math.Abs(got[step]-want[step]) <= 2e-4*want[step]) {
				t.Errorf("%+v -> %+v, step %d: loss %.9g, uninterrupted %.9g", pair[0], pair[1], step, got[step], want[step])
			}
		}
	}
}

// Two TCP nodes with zero: 1 train the losses of virtual ranks with zero:
// 0 and write the same checkpoint (the ranks' pieces of the moments travel
// to world rank 0 with their shares).
func TestZeroDistributed(t *testing.T) {
	cfg := zeroConfig()
	cfg.Parallel.DP, cfg.Train.MicroBatch = 2, 2
	cfg.Train.Steps = 3
	plainDir := t.TempDir()
	want, _ := runLosses(t, cfg, plainDir, 0)
	cfg.Parallel.Zero = 1
	shared := t.TempDir()
	runs := runNodes(t, cfg, []string{shared, shared})
	for i, r := range runs {
		if r.err != nil {
			t.Fatalf("node %d: %v", i, r.err)
		}
	}
	for step := 1; step <= cfg.Train.Steps; step++ {
		if got := runs[0].losses; len(got) != cfg.Train.Steps || got[step-1] != want[step] {
			t.Fatalf("two nodes with zero 1: losses %v, virtual ranks with zero 0 %v", got, want)
		}
	}
	plainFiles, zeroFiles := checkpointFiles(t, plainDir), checkpointFiles(t, shared)
	for name, w := range plainFiles {
		if !bytes.Equal(zeroFiles[name], w) {
			t.Errorf("%s differs between two nodes with zero 1 and virtual ranks with zero 0", name)
		}
	}
}

// joinMoments refuses blocks that do not make whole tensors.
func TestJoinMomentsChecks(t *testing.T) {
	m := zeroConfig().Model
	n := m.Dim
	name := layerName(0, "input_layernorm.weight") + suffixAvg
	block := func(rank, off, size int) rankSnapshot {
		return rankSnapshot{worldRank: rank, optim: []checkpoint.NamedTensor{{Name: name, Shape: []int{size}, Data: make([]float32, size),
			Slice: &checkpoint.Slice{Offset: []int{off}, GlobalShape: []int{n}}}}}
	}
	if out, err := joinMoments([]rankSnapshot{block(0, 0, n/2), block(1, n/2, n/2)}, m); err != nil ||
		len(out[0].optim) != 1 || out[0].optim[0].Slice != nil || len(out[1].optim) != 0 {
		t.Errorf("two halves: %+v, %v", out, err)
	}
	for _, c := range []struct {
		snaps []rankSnapshot
		want  string
	}{
		{[]rankSnapshot{block(0, 0, n/2)}, "hold 16 of its 32 elements"},
		{[]rankSnapshot{block(0, 0, n/2), block(1, n/2+1, n/2)}, "no flat range"},
		{[]rankSnapshot{block(1, 0, n)}, "no checkpoint share of world rank 0"},
	} {
		if _, err := joinMoments(c.snaps, m); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("got %v, want %q", err, c.want)
		}
	}
}
