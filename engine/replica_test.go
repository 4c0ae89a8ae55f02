package engine

import (
	"context"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/checkpoint"
)

// trainRun trains cfg to the end in runDir and returns the result.
func trainRun(t *testing.T, cfg Config, runDir string) Result {
	t.Helper()
	eng, err := New(cfg, WithRunDir(runDir))
	if err != nil {
		t.Fatal(err)
	}
	res, err := eng.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func inferenceConfig() Config {
	cfg := equivalenceConfig()
	cfg.Train.Steps, cfg.Train.EvalBatches = 3, 2
	return cfg
}

// TestRowLogitsMatchLoss: the logits Forward.Logits reads agree with the
// loss the forward computed from its own logits: loss[t] = logsumexp(z) -
// z[y].
func TestRowLogitsMatchLoss(t *testing.T) {
	cfg := inferenceConfig()
	dir := t.TempDir()
	trainRun(t, cfg, dir)
	p, err := LoadReplica(dir)
	if err != nil {
		t.Fatal(err)
	}
	if p.Step() != cfg.Train.Steps || p.Config().Parallel != (ParallelConfig{DP: 1, EP: 1, CP: 1, TP: 1}) || p.Config().Model != cfg.Model {
		t.Fatalf("step %d, config %+v", p.Step(), p.Config())
	}
	f, err := p.Forward(cfg.Train.MicroBatch)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	T := f.Batch() * f.Seq()
	ids, targets := make([]int32, T), make([]int32, T)
	for i := range ids {
		ids[i], targets[i] = int32(rng.IntN(cfg.Model.Vocab)), int32(rng.IntN(cfg.Model.Vocab))
	}
	sum, err := f.Run(ids, targets)
	if err != nil {
		t.Fatal(err)
	}
	losses := f.TokenLosses()
	total := 0.0
	for _, l := range losses {
		total += float64(l)
	}
	if math.Abs(total-sum) > 1e-4*math.Abs(sum) {
		t.Errorf("Run's loss sum %v, the token losses sum to %v", sum, total)
	}
	for _, row := range []int{0, 5, T - 1} {
		z, err := f.Logits(row)
		if err != nil {
			t.Fatal(err)
		}
		top := math.Inf(-1)
		for _, v := range z {
			top = math.Max(top, float64(v))
		}
		sum := 0.0
		for _, v := range z {
			sum += math.Exp(float64(v) - top)
		}
		want := top + math.Log(sum) - float64(z[targets[row]])
		if math.Abs(want-float64(losses[row])) > 1e-5 {
			t.Errorf("row %d: loss from logits %v, forward's %v", row, want, losses[row])
		}
	}
}

// TestForwardShapes: a Forward of another batch shares the weights (the
// same sequence gives the same logits in any row of any batch size), the
// same batch gives the same Forward, and wrong sizes are errors.
func TestForwardShapes(t *testing.T) {
	cfg := inferenceConfig()
	dir := t.TempDir()
	trainRun(t, cfg, dir)
	p, err := LoadReplica(dir)
	if err != nil {
		t.Fatal(err)
	}
	one, err := p.Forward(1)
	if err != nil {
		t.Fatal(err)
	}
	if again, _ := p.Forward(1); again != one || one.Batch() != 1 || one.Seq() != cfg.Train.Seq {
		t.Fatalf("Forward(1) twice: %p, %p; batch %d seq %d", one, again, one.Batch(), one.Seq())
	}
	three, err := p.Forward(3)
	if err != nil {
		t.Fatal(err)
	}
	seq := cfg.Train.Seq
	rng := rand.New(rand.NewPCG(9, 9))
	ids := make([]int32, 3*seq)
	for i := range ids {
		ids[i] = int32(rng.IntN(cfg.Model.Vocab))
	}
	noTargets := func(n int) []int32 {
		out := make([]int32, n)
		for i := range out {
			out[i] = -1
		}
		return out
	}
	if _, err := three.Run(ids, noTargets(3*seq)); err != nil {
		t.Fatal(err)
	}
	if losses := three.TokenLosses(); losses[0] != 0 || losses[len(losses)-1] != 0 {
		t.Errorf("targets -1 scored: %v", losses)
	}
	wantRow := 2*seq + seq - 1
	want, err := three.Logits(wantRow)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := one.Run(ids[2*seq:], noTargets(seq)); err != nil {
		t.Fatal(err)
	}
	got, err := one.Logits(seq - 1)
	if err != nil {
		t.Fatal(err)
	}
	for i := range want {
		if math.Abs(float64(got[i]-want[i])) > 1e-5 {
			t.Fatalf("logit %d: batch of 1 %v, row %d of a batch of 3 %v", i, got[i], wantRow, want[i])
		}
	}

	if _, err := one.Run(ids, noTargets(3*seq)); err == nil || !strings.Contains(err.Error(), "1 sequences") {
		t.Errorf("three sequences into a Forward of one: %v", err)
	}
	if _, err := one.Logits(seq); err == nil || !strings.Contains(err.Error(), "row") {
		t.Errorf("row past the micro-batch: %v", err)
	}
	if _, err := p.Forward(0); err == nil {
		t.Error("Forward(0) succeeded")
	}
}

// TestLoadReplicaErrors: a missing directory, an empty one and a corrupt
// checkpoint are errors that name the path or the bad file.
func TestLoadReplicaErrors(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "nope")
	if _, err := LoadReplica(missing); err == nil || !strings.Contains(err.Error(), "nope") {
		t.Errorf("missing directory: %v", err)
	}
	empty := t.TempDir()
	if _, err := LoadReplica(empty); err == nil || !strings.Contains(err.Error(), "no checkpoint") {
		t.Errorf("empty directory: %v", err)
	}
	dir := t.TempDir()
	trainRun(t, inferenceConfig(), dir)
	ckDir, err := checkpoint.Latest(filepath.Join(dir, "checkpoints"))
	if err != nil {
		t.Fatal(err)
	}
	victim := filepath.Join(ckDir, checkpoint.ModelFile(0))
	raw, err := os.ReadFile(victim)
	if err != nil {
		t.Fatal(err)
	}
	raw[len(raw)-3] ^= 1
	if err := os.WriteFile(victim, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{ckDir, dir} {
		if _, err := LoadReplica(d); err == nil || !strings.Contains(err.Error(), "model-rank00000.safetensors") {
			t.Errorf("LoadReplica(%s) with a corrupt model file: %v", d, err)
		}
	}
}
