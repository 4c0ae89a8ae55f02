package infer

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"

	"github.com/mktrain/mktrain/data"
	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/tokenizer"
)

// Model is a trained model loaded from a checkpoint onto one rank, for
// evaluation and sampling. It is safe for concurrent use: Evaluate and
// Sample may be called from several goroutines (a service's requests), and
// take turns one forward pass at a time (a micro-batch, or a sampled
// token), since they share the model's buffers; each call keeps its own
// tokens and random generator, so a seed reproduces a sample whatever
// runs beside it. Close must come after every call has returned.
type Model struct {
	rep *engine.Replica
	// mu guards rep: its forward passes share buffers (engine.Replica is
	// not safe for concurrent use), and Forward fills a map on first use.
	mu sync.Mutex
	// tok is the checkpoint's tokenizer (text.go); nil: byte-level.
	tok *tokenizer.Tokenizer
}

// Load loads the checkpoint dir stands for (a step directory, or a run
// directory or checkpoints root, whose newest verified checkpoint is taken)
// after verifying its checksums; see engine.LoadReplica for the backend it
// runs on and the options it takes (WithDrivers, WithBackend, WithLogger).
// Close releases a GPU it opened.
func Load(dir string, opts ...engine.Option) (*Model, error) {
	rep, err := engine.LoadReplica(dir, opts...)
	if err != nil {
		return nil, err
	}
	tok, err := checkpointTokenizer(rep.Dir(), rep.Config().Model.Vocab)
	if err != nil {
		rep.Close()
		return nil, err
	}
	return &Model{rep: rep, tok: tok}, nil
}

// Close releases the GPU Load opened, if any; the model must not be used
// afterwards.
func (m *Model) Close() error { return m.rep.Close() }

// Config is the model's configuration as saved with its checkpoint (one rank).
func (m *Model) Config() engine.Config { return m.rep.Config() }

// Step is the training step of the checkpoint.
func (m *Model) Step() int { return m.rep.Step() }

// Dir is the checkpoint directory the model was loaded from.
func (m *Model) Dir() string { return m.rep.Dir() }

// EvalResult is a mean next-token cross-entropy over some tokens.
type EvalResult struct {
	Loss       float64 // mean cross-entropy, nats per token
	Perplexity float64 // exp(Loss)
	Tokens     int64   // tokens scored
	Batches    int     // micro-batches of BatchSize sequences of train.seq tokens
	BatchSize  int     // sequences per micro-batch: train.micro_batch (fewer for a short text)
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
	return m.evaluate(ctx, val, name, batches, m.rep.Config().Train.MicroBatch)
}

// evaluate is Evaluate over val (named name in errors), micro sequences
// per micro-batch.
func (m *Model) evaluate(ctx context.Context, val *data.EvalLoader, name string, batches, micro int) (EvalResult, error) {
	seq := m.rep.Config().Train.Seq
	if batches <= 0 {
		batches = int(val.EpochBatches(micro))
		if batches == 0 {
			return EvalResult{}, fmt.Errorf("%s: %d windows of %d tokens, fewer than one micro-batch (train.micro_batch %d)",
				name, val.Windows(), seq+1, micro)
		}
	}
	sum := 0.0
	for i := 0; i < batches; i++ {
		if err := ctx.Err(); err != nil {
			return EvalResult{}, err
		}
		ids, targets, err := val.Next(micro)
		if err != nil {
			return EvalResult{}, err
		}
		lossSum, _, err := m.forward(micro, ids, targets, -1)
		if err != nil {
			return EvalResult{}, err
		}
		sum += lossSum
	}
	tokens := batches * micro * seq
	loss := sum / float64(tokens)
	return EvalResult{Loss: loss, Perplexity: math.Exp(loss), Tokens: int64(tokens), Batches: batches, BatchSize: micro}, nil
}

// openVal opens the validation windows Evaluate reads, and a name for them.
func (m *Model) openVal(glob string) (*data.EvalLoader, string, error) {
	c := m.rep.Config()
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

// forward runs one micro-batch of batch sequences through the model, as
// the only user of its buffers while it runs, and returns the summed loss
// and, when row >= 0, that row's logits.
func (m *Model) forward(batch int, ids, targets []int32, row int) (lossSum float64, logits []float32, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	f, err := m.rep.Forward(batch)
	if err != nil {
		return 0, nil, err
	}
	if lossSum, err = f.Run(ids, targets); err != nil || row < 0 {
		return lossSum, nil, err
	}
	logits, err = f.Logits(row)
	return lossSum, logits, err
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
	return m.sample(ctx, prompt, n, temperature, topK, seed, -1)
}

// sample is Sample that also stops after the token stop (-1: none).
func (m *Model) sample(ctx context.Context, prompt []int32, n int, temperature float64, topK int, seed uint64, stop int32) ([]int32, error) {
	cfg := m.rep.Config()
	V, seq := cfg.Model.Vocab, cfg.Train.Seq
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
	rng := rand.New(rand.NewPCG(seed, samplePCGStream))
	tokens := slices.Clone(prompt)
	ids, targets := make([]int32, seq), make([]int32, seq)
	for i := range targets {
		targets[i] = -1 // no loss is wanted
	}
	out := make([]int32, 0, n)
	for range n {
		if err := ctx.Err(); err != nil {
			return out, err
		}
		// Attention is causal and dropless routing is per token, so the
		// padding after the window does not change its last row's logits.
		window := tokens[max(0, len(tokens)-seq):]
		copy(ids, window)
		clear(ids[len(window):])
		// One sequence: the context window.
		_, logits, err := m.forward(1, ids, targets, len(window)-1)
		if err != nil {
			return out, err
		}
		next := sampleToken(logits, temperature, topK, rng)
		tokens = append(tokens, next)
		out = append(out, next)
		if next == stop {
			break
		}
	}
	return out, nil
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
