package infer

// Text in and out of a model: with the tokenizer its checkpoint holds (the
// run's data.tokenizer, copied into every checkpoint by package engine),
// or byte by byte when the run had none.

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/mktrain/mktrain/data"
	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/hf"
	"github.com/mktrain/mktrain/tokenizer"
)

// checkpointTokenizer reads the tokenizer of the checkpoint in step
// directory dir: nil when the run was byte-level (state.json records no
// tokenizer). The copy must be the one state.json's SHA-256 names, and fit
// the model's vocabulary.
func checkpointTokenizer(dir string, vocab int) (*tokenizer.Tokenizer, error) {
	info, err := engine.ReadCheckpointInfo(dir)
	if err != nil {
		return nil, err
	}
	if info.TokenizerSHA256 == "" {
		return nil, nil
	}
	tok, err := tokenizer.Load(filepath.Join(dir, hf.TokenizerFile))
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: its state.json records a tokenizer: %w", dir, err)
	}
	switch {
	case tok.Hash() != info.TokenizerSHA256:
		return nil, fmt.Errorf("checkpoint %s: %s has sha256 %s, but state.json records %s", dir, hf.TokenizerFile, tok.Hash(), info.TokenizerSHA256)
	case tok.VocabSize() > vocab:
		return nil, fmt.Errorf("checkpoint %s: its tokenizer has %d ids, more than model.vocab (%d)", dir, tok.VocabSize(), vocab)
	}
	return tok, nil
}

// Tokenizer is the checkpoint's tokenizer; nil when the run was byte-level.
func (m *Model) Tokenizer() *tokenizer.Tokenizer { return m.tok }

// Encode turns text into the model's token ids as data prepare encodes the
// start of a document: with the checkpoint's tokenizer and the special
// tokens its post-processor adds (Llama's <s>, say; what Hugging Face's
// tokenizer(text) gives), or one id per byte for a byte-level model.
func (m *Model) Encode(text string) []int32 {
	if m.tok == nil {
		return toInt32(data.EncodeBytes([]byte(text)))
	}
	ids := m.tok.EncodeWithSpecial(text)
	out := make([]int32, len(ids))
	for i, id := range ids {
		out[i] = int32(id)
	}
	return out
}

// Decode turns ids back into text with the checkpoint's tokenizer (special
// tokens are kept), or byte by byte; an id outside the tokenizer's
// vocabulary (a model's vocabulary may be larger) is an error.
func (m *Model) Decode(ids []int32) (string, error) {
	if m.tok == nil {
		ts := make([]uint32, len(ids))
		for i, id := range ids {
			ts[i] = uint32(id)
		}
		b, err := data.DecodeBytes(ts)
		if err != nil {
			return "", fmt.Errorf("the model is byte-level (no tokenizer in its checkpoint): %w", err)
		}
		return string(b), nil
	}
	in := make([]int, len(ids))
	for i, id := range ids {
		in[i] = int(id)
	}
	return m.tok.Decode(in)
}

// EOS is the tokenizer's end-of-document token; false for a byte-level
// model, which has none.
func (m *Model) EOS() (int32, bool) {
	if m.tok == nil {
		return 0, false
	}
	id, ok := m.tok.EOS()
	return int32(id), ok
}

// SampleText continues prompt, encoded with Encode, by at most n tokens as
// Sample does, stopping after the tokenizer's end-of-document token (as
// transformers' generate stops at eos_token_id), and returns the whole
// text (the prompt's ids decoded, then the new ones', a leading BOS left
// out) and the new ids, EOS included when it came.
func (m *Model) SampleText(ctx context.Context, prompt string, n int, temperature float64, topK int, seed uint64) (string, []int32, error) {
	ids := m.Encode(prompt)
	stop := int32(-1)
	if eos, ok := m.EOS(); ok {
		stop = eos
	}
	out, err := m.sample(ctx, ids, n, temperature, topK, seed, stop)
	if err != nil {
		return "", out, err
	}
	all := append(ids, out...)
	if m.tok != nil {
		// The text, not its markers: a leading BOS and a final EOS are
		// left out of it (HF's decode with skip_special_tokens would drop
		// them too).
		if bos, ok := m.tok.BOS(); ok && len(all) > 0 && all[0] == int32(bos) {
			all = all[1:]
		}
		if len(all) > 0 && all[len(all)-1] == stop && len(out) > 0 && out[len(out)-1] == stop {
			all = all[:len(all)-1]
		}
	}
	text, err := m.Decode(all)
	return text, out, err
}

// EvaluateText is Evaluate on text: encoded as data prepare encodes a
// document (Encode, then the end-of-document token when the tokenizer has
// one), cut into windows of train.seq+1 tokens as validation data is, and
// scored in micro-batches of train.micro_batch windows (all the windows in
// one when there are fewer). name stands for the text in errors. batches <=
// 0 means every full micro-batch.
func (m *Model) EvaluateText(ctx context.Context, name, text string, batches int) (EvalResult, error) {
	ids := m.Encode(text)
	if eos, ok := m.EOS(); ok && (len(ids) == 0 || ids[len(ids)-1] != eos) {
		ids = append(ids, eos)
	}
	cfg := m.rep.Config()
	seq := cfg.Train.Seq
	tokens := make([]uint32, len(ids))
	for i, id := range ids {
		tokens[i] = uint32(id)
	}
	windows := int64(0)
	if len(tokens) > seq {
		windows = int64(len(tokens)-1) / int64(seq)
	}
	if windows == 0 {
		return EvalResult{}, fmt.Errorf("%s: %d tokens, fewer than one window of train.seq+1 = %d tokens", name, len(tokens), seq+1)
	}
	val, err := data.NewEvalLoaderFromSources(name, []data.TokenSource{data.NewMemorySource(name, tokens)}, seq, cfg.Model.Vocab, 0, 1)
	if err != nil {
		return EvalResult{}, err
	}
	defer val.Close()
	return m.evaluate(ctx, val, name, batches, int(min(int64(cfg.Train.MicroBatch), windows)))
}

func toInt32(ts []uint32) []int32 {
	out := make([]int32, len(ts))
	for i, t := range ts {
		out[i] = int32(t)
	}
	return out
}
