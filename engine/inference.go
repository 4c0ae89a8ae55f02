package engine

// A trained model loaded back from a checkpoint, on one rank, for evaluation
// and sampling. Tensors are read by name, so a checkpoint written under any
// parallel layout loads; the model is the same code as training's, run with
// train=false.

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/rs/zerolog"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/data"
	"github.com/mktrain/mktrain/moe"
)

// CheckpointsRoot is where the checkpoints under dir live: dir/checkpoints
// when dir is a run directory (it has that subdirectory), else dir itself,
// taken to be a checkpoints root.
func CheckpointsRoot(dir string) string {
	if st, err := os.Stat(filepath.Join(dir, "checkpoints")); err == nil && st.IsDir() {
		return filepath.Join(dir, "checkpoints")
	}
	return dir
}

// IsCheckpointDir reports whether dir is one checkpoint (a step directory:
// it holds MANIFEST.json) rather than a run directory or a checkpoints root.
func IsCheckpointDir(dir string) bool {
	st, err := os.Stat(filepath.Join(dir, "MANIFEST.json"))
	return err == nil && st.Mode().IsRegular()
}

// ResolveCheckpoint names the verified checkpoint dir stands for: dir itself
// when it is a step directory, otherwise the newest checkpoint that passes
// checkpoint.Verify under CheckpointsRoot(dir). warn, when not nil, hears of
// each newer checkpoint skipped as corrupt. The error of a corrupt step
// directory names the bad file.
func ResolveCheckpoint(dir string, warn func(string)) (string, error) {
	if IsCheckpointDir(dir) {
		if err := checkpoint.Verify(dir); err != nil {
			return "", err
		}
		return dir, nil
	}
	st, err := os.Stat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("%s does not exist", dir)
	}
	if err != nil {
		return "", err
	}
	if !st.IsDir() {
		return "", fmt.Errorf("%s is not a directory: name a checkpoint (step_* directory), a run directory or a checkpoints root", dir)
	}
	found, err := checkpoint.FindResumable(CheckpointsRoot(dir), warn)
	if errors.Is(err, checkpoint.ErrNoCheckpoint) {
		return "", fmt.Errorf("%s holds no checkpoint: it is not a step directory (no MANIFEST.json), and neither it nor %s has step_* directories",
			dir, filepath.Join(dir, "checkpoints"))
	}
	return found, err
}

// CheckpointInfo is what a checkpoint's state.json records about its run.
type CheckpointInfo struct {
	Dir        string
	Step       int
	Tokens     int64   // tokens trained on up to Step
	LR         float64 // the schedule's rate at Step
	Config     Config  // the run's whole configuration
	Recipe     string  // the recipe's YAML snapshot ("" when the run had none)
	RecipeHash string
	Mesh       comm.Mesh
	Backend    string
	Version    string // mktrain release that wrote it
	SavedAt    time.Time
}

// ReadCheckpointInfo reads the state of the checkpoint in step directory
// dir. It checks file sizes, not checksums (see checkpoint.Verify).
func ReadCheckpointInfo(dir string) (CheckpointInfo, error) {
	ck, err := checkpoint.Open(dir)
	if err != nil {
		return CheckpointInfo{}, err
	}
	defer ck.Close()
	var st trainState
	if err := ck.ReadState(&st); err != nil {
		return CheckpointInfo{}, err
	}
	return CheckpointInfo{
		Dir: dir, Step: st.Step, Tokens: st.Tokens, LR: st.LR, Config: st.Config, Recipe: st.Recipe,
		RecipeHash: st.RecipeHash, Mesh: st.Mesh, Backend: st.Backend, Version: st.Version, SavedAt: st.SavedAt,
	}, nil
}

// Model is a trained model loaded from a checkpoint onto one rank, for
// evaluation and sampling. It is not safe for concurrent use.
type Model struct {
	cfg  Config
	dir  string
	step int
	b    backend.Backend
	r    *rank  // the weights, and the model of train.micro_batch sequences that Evaluate runs
	one  *model // a model of one sequence sharing r's weights, built by Sample on first use

	engine *Engine // holds the backend LoadModel opened, for Close
}

// LoadModel loads the checkpoint dir stands for (see ResolveCheckpoint:
// a step directory, or a run directory or checkpoints root, whose newest
// verified checkpoint is taken) after verifying its checksums. The
// configuration is the one saved with the checkpoint, its parallel section
// reset to one rank. The model runs on the first GPU when there is one (and
// WithDrivers links its driver) and on the float32 CPU backend otherwise
// (whatever backend trained it), unless WithBackend names one; WithLogger
// receives warnings about skipped corrupt checkpoints and the backend
// chosen; other options are ignored. Close releases a GPU the model
// opened.
func LoadModel(dir string, opts ...Option) (_ *Model, err error) {
	e := &Engine{log: zerolog.Nop()}
	for _, o := range opts {
		o(e)
	}
	ckDir, err := ResolveCheckpoint(dir, func(msg string) { e.log.Warn().Msg(msg) })
	if err != nil {
		return nil, err
	}
	ck, err := checkpoint.Open(ckDir)
	if err != nil {
		return nil, err
	}
	defer ck.Close()
	var st trainState
	if err := ck.ReadState(&st); err != nil {
		return nil, err
	}
	cfg := st.Config
	cfg.Parallel = ParallelConfig{DP: 1, EP: 1, CP: 1, TP: 1}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("checkpoint %s: the saved configuration does not validate: %w", ckDir, err)
	}
	if e.backend == nil {
		e.cfg = cfg
		e.cfg.Train.Backend = "auto"
		if e.backend, err = e.pickBackend(); err != nil {
			return nil, err
		}
		defer func() {
			if err != nil {
				e.Close()
			}
		}()
	}
	b := e.backend
	world, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: 1, TP: 1}, b)
	if err != nil {
		return nil, err
	}
	r, err := newRank(servingConfig(cfg), b, world[0], nil, nil)
	if err != nil {
		return nil, err
	}
	if err := r.restore(ck, false); err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", ckDir, err)
	}
	return &Model{cfg: cfg, dir: ckDir, step: st.Step, b: b, r: r, engine: e}, nil
}

// Close releases the GPU LoadModel opened, if any; the model must not be
// used afterwards.
func (m *Model) Close() error { return m.engine.Close() }

// Config is the model's configuration as saved with its checkpoint (one rank).
func (m *Model) Config() Config { return m.cfg }

// Step is the training step of the checkpoint.
func (m *Model) Step() int { return m.step }

// Dir is the checkpoint directory the model was loaded from.
func (m *Model) Dir() string { return m.dir }

// EvalResult is a mean next-token cross-entropy over some tokens.
type EvalResult struct {
	Loss       float64 // mean cross-entropy, nats per token
	Perplexity float64 // exp(Loss)
	Tokens     int64   // tokens scored
	Batches    int     // micro-batches of train.micro_batch sequences of train.seq tokens
}

// Evaluate computes the mean next-token loss over batches micro-batches of
// validation windows, read in file order from the start (see
// data.EvalLoader), exactly as training's validation does. glob names token
// shards; "" means the run's own validation data (the recipe's data.val, or
// the embedded corpus's held-out part). batches <= 0 means one full pass
// over the data. Cancelling ctx stops between two micro-batches.
func (m *Model) Evaluate(ctx context.Context, glob string, batches int) (EvalResult, error) {
	val, name, err := m.openVal(glob)
	if err != nil {
		return EvalResult{}, err
	}
	defer val.Close()
	micro, seq := m.cfg.Train.MicroBatch, m.cfg.Train.Seq
	if batches <= 0 {
		batches = int(val.EpochBatches(micro))
		if batches == 0 {
			return EvalResult{}, fmt.Errorf("%s: %d windows of %d tokens, fewer than one micro-batch (train.micro_batch %d)",
				name, val.Windows(), seq+1, micro)
		}
	}
	sum := 0.0
	m.r.op.refresh(m.b)
	for i := 0; i < batches; i++ {
		if err := ctx.Err(); err != nil {
			return EvalResult{}, err
		}
		ids, targets, err := val.Next(micro)
		if err != nil {
			return EvalResult{}, err
		}
		m.r.model.setBatch(ids, targets)
		st, err := m.r.model.forward(false, 0, 0, m.r.biasE)
		if err != nil {
			return EvalResult{}, err
		}
		sum += st.lossSum
	}
	tokens := batches * micro * seq
	loss := sum / float64(tokens)
	return EvalResult{Loss: loss, Perplexity: math.Exp(loss), Tokens: int64(tokens), Batches: batches}, nil
}

// openVal opens the validation windows Evaluate reads, and a name for them.
func (m *Model) openVal(glob string) (*data.EvalLoader, string, error) {
	c := m.cfg
	switch {
	case glob != "":
		l, err := data.NewEvalLoader(glob, c.Train.Seq, c.Model.Vocab, 0, 1)
		return l, glob, err
	case c.Data.Val != "":
		l, err := data.NewEvalLoader(c.Data.Val, c.Train.Seq, c.Model.Vocab, 0, 1)
		if err != nil {
			return nil, "", fmt.Errorf("data.val of the checkpoint's recipe: %w", err)
		}
		return l, c.Data.Val, nil
	}
	train, val, err := data.DefaultSources(c.Train.Seq, c.Model.Vocab, c.Train.Seed, 0, 1)
	if err != nil {
		return nil, "", err
	}
	train.Close()
	return val, "default-corpus/val", nil
}

// samplePCGStream is the second word of Sample's PCG state, so that a seed
// alone picks the stream.
const samplePCGStream = 0x6d6b747261696e // "mktrain"

// Sample continues prompt by n tokens, one at a time: each step runs the
// model on the last train.seq tokens of prompt and what was sampled so far
// and draws the next token from the last position's logits. temperature 0
// takes the most likely token (greedy); otherwise tokens are drawn from
// softmax(logits/temperature), restricted to the topK most likely ones when
// topK > 0. The draws come from a PCG generator seeded with seed, so a seed
// reproduces a sample. It returns the n new tokens. Cancelling ctx stops
// between two tokens.
func (m *Model) Sample(ctx context.Context, prompt []int32, n int, temperature float64, topK int, seed uint64) ([]int32, error) {
	V, seq := m.cfg.Model.Vocab, m.cfg.Train.Seq
	switch {
	case len(prompt) == 0:
		return nil, fmt.Errorf("sample: the prompt is empty; give at least one token")
	case n < 0:
		return nil, fmt.Errorf("sample: %d tokens to generate; want 0 or more", n)
	case math.IsNaN(temperature) || math.IsInf(temperature, 0) || temperature < 0:
		return nil, fmt.Errorf("sample: temperature %v; want 0 (greedy) or a positive number", temperature)
	case topK < 0:
		return nil, fmt.Errorf("sample: top-k %d; want 0 (no limit) or a positive number", topK)
	}
	for i, t := range prompt {
		if t < 0 || int(t) >= V {
			return nil, fmt.Errorf("sample: prompt token %d at position %d is outside the vocabulary [0, %d)", t, i, V)
		}
	}
	if m.one == nil {
		one, err := newModel(m.b, m.r.cfg.Model, m.r.op.p, m.r.g, 1, seq,
			moe.Groups{Expert: m.r.groups.Expert, Data: m.r.groups.Data}, nil)
		if err != nil {
			return nil, err
		}
		m.one = one
	}
	rng := rand.New(rand.NewPCG(seed, samplePCGStream))
	tokens := slices.Clone(prompt)
	ids, targets := make([]int32, seq), make([]int32, seq)
	for i := range targets {
		targets[i] = -1 // no loss is wanted
	}
	out := make([]int32, 0, n)
	m.r.op.refresh(m.b)
	for range n {
		if err := ctx.Err(); err != nil {
			return out, err
		}
		// Attention is causal and dropless routing is per token, so the
		// padding after the window does not change its last row's logits.
		window := tokens[max(0, len(tokens)-seq):]
		copy(ids, window)
		clear(ids[len(window):])
		m.one.setBatch(ids, targets)
		if _, err := m.one.forward(false, 0, 0, m.r.biasE); err != nil {
			return out, err
		}
		next := sampleToken(m.one.rowLogits(len(window)-1), temperature, topK, rng)
		tokens = append(tokens, next)
		out = append(out, next)
	}
	return out, nil
}

// rowLogits computes the LM head's logits of row t of the last forward
// (which left the logits buffer holding the loss gradient, not logits).
func (m *model) rowLogits(t int) []float32 {
	b := m.b
	D, V := m.cfg.Dim, m.cfg.Vocab
	out := b.View(m.logitsCV, 0, 1, V)
	b.MatMul(out, b.View(m.finalTD, t*D, 1, D), m.w.lmHeadVD, false, true, 1, 0)
	return backend.DownloadFloat32(b, out)
}

// sampleToken draws a token from one row of logits: the first largest when
// temperature is 0, else from softmax(logits/temperature) over the topK
// largest logits (all of them when topK is 0 or not below the vocabulary).
func sampleToken(logits []float32, temperature float64, topK int, rng *rand.Rand) int32 {
	best := 0
	for i, l := range logits {
		if l > logits[best] {
			best = i
		}
	}
	if temperature == 0 {
		return int32(best)
	}
	candidates := make([]int32, len(logits))
	for i := range candidates {
		candidates[i] = int32(i)
	}
	if topK > 0 && topK < len(logits) {
		// Stable: among equal logits the lower ids come first.
		slices.SortStableFunc(candidates, func(a, b int32) int {
			switch {
			case logits[a] > logits[b]:
				return -1
			case logits[a] < logits[b]:
				return 1
			}
			return 0
		})
		candidates = candidates[:topK]
	}
	top := float64(logits[best])
	weights := make([]float64, len(candidates))
	total := 0.0
	for i, c := range candidates {
		weights[i] = math.Exp((float64(logits[c]) - top) / temperature)
		total += weights[i]
	}
	u := rng.Float64() * total
	for i, w := range weights {
		if u < w {
			return candidates[i]
		}
		u -= w
	}
	return candidates[len(candidates)-1] // u fell past the end by rounding
}
