package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"

	"github.com/mktrain/mktrain/backend/all"
	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/infer"
)

const sampleUsage = `Usage: mktrain sample --checkpoint DIR --prompt TEXT [--tokens N] [--temperature T] [--top-k K] [--seed S]

Continues TEXT with up to N tokens from a checkpoint's model and prints the
prompt and its continuation. The text is encoded and decoded with the
tokenizer the checkpoint holds (the run's data.tokenizer; the prompt gets
the special tokens its post-processor adds, as Hugging Face's tokenizer(TEXT)
does), and the continuation stops after its end-of-document token, as
transformers' generate stops at eos_token_id; a run without a tokenizer is
byte-level: each byte of TEXT is one token and each token one byte. Each
new token sees the last train.seq tokens. --temperature 0 takes the most
likely token every time; higher temperatures sample more freely; --top-k K
samples among the K most likely tokens only. The same seed gives the same
text. DIR is a checkpoint (a step_* directory), or a run directory or
checkpoints root (its newest checkpoint that verifies).

Flags:
`

func cmdSample(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("sample", sampleUsage, stderr)
	dir := fs.String("checkpoint", "", "checkpoint, run directory or checkpoints root")
	prompt := fs.String("prompt", "", "text to continue")
	n := fs.Int("tokens", 200, "tokens to generate (at most: the end-of-document token stops it)")
	temperature := fs.Float64("temperature", 0.8, "sampling temperature (0: greedy)")
	topK := fs.Int("top-k", 0, "sample among the K most likely tokens only (0: all)")
	seed := fs.Uint64("seed", 1, "random seed")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		fs.Usage()
		return usageError{fmt.Sprintf("sample takes no arguments besides flags; got %q (quote the prompt: --prompt \"...\")", pos[0])}
	}
	if err := requireFlag(fs, "checkpoint", *dir); err != nil {
		return err
	}
	if err := requireFlag(fs, "prompt", *prompt); err != nil {
		return err
	}
	switch {
	case *n < 0:
		return usageError{fmt.Sprintf("--tokens must not be negative, got %d", *n)}
	case *temperature < 0 || math.IsNaN(*temperature) || math.IsInf(*temperature, 0):
		return usageError{fmt.Sprintf("--temperature must be 0 or positive, got %v", *temperature)}
	case *topK < 0:
		return usageError{fmt.Sprintf("--top-k must be 0 or positive, got %d", *topK)}
	}
	m, err := infer.Load(*dir, engine.WithDrivers(all.Drivers()...), engine.WithLogger(warnLogger(stderr)))
	if err != nil {
		return err
	}
	defer m.Close()
	text, _, err := m.SampleText(ctx, *prompt, *n, *temperature, *topK, *seed)
	if errors.Is(err, context.Canceled) {
		return stoppedError(ctx, "sampling stopped")
	}
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(stdout, "%s\n", text)
	return err
}
