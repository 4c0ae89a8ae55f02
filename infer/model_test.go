package infer

import (
	"context"
	"math"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/data"
	"github.com/mktrain/mktrain/engine"
)

// testConfig is a small model on the embedded corpus whose global batch (8
// sequences) trains in 3 steps (engine's inferenceConfig).
func testConfig() engine.Config {
	cfg := engine.DefaultConfig()
	cfg.Model.Dim, cfg.Model.Layers, cfg.Model.Heads, cfg.Model.KVHeads = 32, 2, 4, 2
	cfg.Model.MoE.Experts, cfg.Model.MoE.TopK, cfg.Model.MoE.FFN = 4, 2, 32
	cfg.Model.MoE.ZLossCoef = 0.001
	cfg.Train.Seq, cfg.Train.GlobalBatch, cfg.Train.Steps = 16, 8, 3
	cfg.Train.LR, cfg.Train.WarmupSteps, cfg.Train.EvalEvery, cfg.Train.EvalBatches = 3e-3, 2, 0, 2
	cfg.Train.Backend = "cpu"
	return cfg
}

// trainRun trains cfg to the end in runDir and returns the result.
func trainRun(t *testing.T, cfg engine.Config, runDir string) engine.Result {
	t.Helper()
	eng, err := engine.New(cfg, engine.WithRunDir(runDir))
	if err != nil {
		t.Fatal(err)
	}
	res, err := eng.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// valShard writes the first windows*seq+1 tokens of the embedded corpus's
// validation part as a shard and returns its path.
func valShard(t *testing.T, seq, windows int) string {
	t.Helper()
	tokens := data.EncodeBytes(data.DefaultCorpus(data.DefaultCorpusSeed))
	split := len(tokens) - int(float64(len(tokens))*data.DefaultValFraction)
	path := filepath.Join(t.TempDir(), "val_000000.bin")
	if err := data.WriteShard(path, tokens[split:split+windows*seq+1], data.ByteVocab); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestEvaluateMatchesTrainingValidation: a loaded model's loss on the run's
// own validation data is the run's final validation loss, bit for bit on
// one rank and within float32 summation order from a 4-rank checkpoint; a
// shard holding the same tokens gives the same loss, and batches <= 0 is
// one pass over the shard.
func TestEvaluateMatchesTrainingValidation(t *testing.T) {
	ctx := context.Background()
	cfg := testConfig()
	dir := t.TempDir()
	res := trainRun(t, cfg, dir)

	m, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	if m.Step() != cfg.Train.Steps || m.Config().Parallel != (engine.ParallelConfig{DP: 1, EP: 1, CP: 1, TP: 1}) || m.Config().Model != cfg.Model {
		t.Fatalf("step %d, config %+v", m.Step(), m.Config())
	}
	got, err := m.Evaluate(ctx, "", cfg.Train.EvalBatches)
	if err != nil {
		t.Fatal(err)
	}
	wantTokens := int64(cfg.Train.EvalBatches * cfg.Train.MicroBatch * cfg.Train.Seq)
	if got.Loss != res.ValLoss || got.Tokens != wantTokens || got.Perplexity != math.Exp(got.Loss) {
		t.Fatalf("evaluate: %+v; the run's validation loss %v over %d tokens", got, res.ValLoss, wantTokens)
	}

	shard := valShard(t, cfg.Train.Seq, 5*cfg.Train.MicroBatch)
	fromShard, err := m.Evaluate(ctx, shard, cfg.Train.EvalBatches)
	if err != nil {
		t.Fatal(err)
	}
	if fromShard.Loss != got.Loss {
		t.Errorf("shard of the same tokens: loss %v, embedded %v", fromShard.Loss, got.Loss)
	}
	full, err := m.Evaluate(ctx, shard, 0)
	if err != nil {
		t.Fatal(err)
	}
	five, err := m.Evaluate(ctx, shard, 5)
	if err != nil {
		t.Fatal(err)
	}
	if full.Batches != 5 || full != five {
		t.Errorf("full pass %+v, 5 batches %+v", full, five)
	}

	// A checkpoint written by 4 expert-parallel ranks loads on one.
	sharded := cfg
	sharded.Parallel.EP, sharded.Train.MicroBatch = 4, 2
	dir4 := t.TempDir()
	res4 := trainRun(t, sharded, dir4)
	m4, err := Load(filepath.Join(dir4, "checkpoints"))
	if err != nil {
		t.Fatal(err)
	}
	got4, err := m4.Evaluate(ctx, "", cfg.Train.EvalBatches*4) // same windows, micro-batches of 2
	if err != nil {
		t.Fatal(err)
	}
	if math.Abs(got4.Loss-res4.ValLoss) > 1e-5*res4.ValLoss {
		t.Errorf("ep=4 checkpoint on one rank: loss %v, the run's %v", got4.Loss, res4.ValLoss)
	}

	// Load's errors are engine.LoadReplica's.
	if _, err := Load(filepath.Join(t.TempDir(), "nope")); err == nil || !strings.Contains(err.Error(), "nope") {
		t.Errorf("missing directory: %v", err)
	}
}

func argmax(z []float32) int32 {
	best := 0
	for i, v := range z {
		if v > z[best] {
			best = i
		}
	}
	return int32(best)
}

// TestSampleGreedy: greedy tokens are the argmax of logits computed by the
// evaluation model (micro-batch of 8, the context in row 3, random tokens
// around it); a prompt longer than train.seq is cut to its last seq tokens;
// a seed reproduces a sample.
func TestSampleGreedy(t *testing.T) {
	ctx := context.Background()
	cfg := testConfig()
	dir := t.TempDir()
	trainRun(t, cfg, dir)
	m, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	seq, V := cfg.Train.Seq, cfg.Model.Vocab
	rng := rand.New(rand.NewPCG(5, 6))
	random := func(n int) []int32 {
		out := make([]int32, n)
		for i := range out {
			out[i] = int32(rng.IntN(V))
		}
		return out
	}
	prompt := random(5)
	got, err := m.Sample(ctx, prompt, 14, 0, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	mod, err := m.rep.Forward(cfg.Train.MicroBatch)
	if err != nil {
		t.Fatal(err)
	}
	tokens := slices.Clone(prompt)
	for i, tok := range got {
		window := tokens[max(0, len(tokens)-seq):]
		ids := random(mod.Batch() * seq)
		copy(ids[3*seq:], window)
		if _, err := mod.Run(ids, make([]int32, len(ids))); err != nil {
			t.Fatal(err)
		}
		logits, err := mod.Logits(3*seq + len(window) - 1)
		if err != nil {
			t.Fatal(err)
		}
		if want := argmax(logits); tok != want {
			t.Fatalf("token %d: sampled %d, argmax %d", i, tok, want)
		}
		tokens = append(tokens, tok)
	}

	long := random(seq + 5)
	a, err := m.Sample(ctx, long, 4, 0, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	b, err := m.Sample(ctx, long[5:], 4, 0, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(a, b) {
		t.Errorf("prompt of seq+5 tokens: %v; its last seq tokens: %v", a, b)
	}

	s1, _ := m.Sample(ctx, prompt, 20, 1, 0, 7)
	s2, _ := m.Sample(ctx, prompt, 20, 1, 0, 7)
	s3, _ := m.Sample(ctx, prompt, 20, 1, 0, 8)
	if !slices.Equal(s1, s2) || slices.Equal(s1, s3) {
		t.Errorf("seed 7: %v and %v; seed 8: %v", s1, s2, s3)
	}

	for _, bad := range []struct {
		prompt []int32
		temp   float64
		topK   int
		want   string
	}{
		{nil, 0, 0, "empty"},
		{[]int32{1, int32(V)}, 0, 0, "position 1"},
		{[]int32{1}, -1, 0, "temperature"},
		{[]int32{1}, 1, -2, "top-k"},
	} {
		if _, err := m.Sample(ctx, bad.prompt, 3, bad.temp, bad.topK, 1); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("prompt %v temperature %v top-k %d: error %v, want one mentioning %q", bad.prompt, bad.temp, bad.topK, err, bad.want)
		}
	}
}

// TestSampleTokenDistribution: draws follow softmax(logits/temperature)
// over the top k, within 5 standard deviations, and never leave the top k.
func TestSampleTokenDistribution(t *testing.T) {
	logits := []float32{0.5, 2, -1, 1.5, 2, 0}
	if got := sampleToken(logits, 0, 0, nil); got != 1 {
		t.Errorf("greedy: %d, want 1 (the first of two maxima)", got)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 100 {
		if got := sampleToken(logits, 2, 1, rng); got != 1 {
			t.Fatalf("top-1 at temperature 2: %d", got)
		}
	}
	const draws = 40000
	for _, c := range []struct {
		temp float64
		topK int
		kept []int // the top k, by logit then id
	}{
		{0.7, 3, []int{1, 4, 3}},
		{1.3, 0, []int{0, 1, 2, 3, 4, 5}},
	} {
		want := make([]float64, len(logits))
		total := 0.0
		for _, i := range c.kept {
			want[i] = math.Exp(float64(logits[i]) / c.temp)
			total += want[i]
		}
		counts := make([]int, len(logits))
		for range draws {
			counts[sampleToken(logits, c.temp, c.topK, rng)]++
		}
		for i := range logits {
			p := want[i] / total
			sd := math.Sqrt(draws * p * (1 - p))
			if math.Abs(float64(counts[i])-draws*p) > 5*sd+1e-9 {
				t.Errorf("temperature %v top-k %d: token %d drawn %d times, expected %.0f ± %.0f", c.temp, c.topK, i, counts[i], draws*p, sd)
			}
		}
	}
}
