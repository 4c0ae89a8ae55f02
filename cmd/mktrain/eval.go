package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/rs/zerolog"

	"github.com/mktrain/mktrain/backend/all"
	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/infer"
)

const evalUsage = `Usage: mktrain eval --checkpoint DIR [--data GLOB | --text FILE] [--batches N] [--json]

Computes a checkpoint's mean next-token loss (nats per token) and perplexity
on validation data: the token shards GLOB matches, the text of FILE
(encoded with the checkpoint's tokenizer as data prepare encodes a
document, or byte by byte for a byte-level run; scored in micro-batches of
train.micro_batch windows, or all its windows in one when there are fewer),
or by default the run's own validation data (the recipe's data.val, or the
embedded corpus's held-out part). As in training's validation, windows of train.seq+1 tokens are read in
file order from the first, train.micro_batch windows per batch. DIR is a
checkpoint (a step_* directory), or a run directory or checkpoints root (its
newest checkpoint that verifies).

--json prints one object: checkpoint, step, data, loss, perplexity, tokens,
batches, seq and windows (the first windows windows of the data were scored;
scripts/hf_check.py --seq and --windows score the same ones).

Flags:
`

// evalJSON is what eval --json prints.
type evalJSON struct {
	Checkpoint string  `json:"checkpoint"`
	Step       int     `json:"step"`
	Data       string  `json:"data"`
	Loss       float64 `json:"loss"`
	Perplexity float64 `json:"perplexity"`
	Tokens     int64   `json:"tokens"`
	Batches    int     `json:"batches"`
	Seq        int     `json:"seq"`
	Windows    int     `json:"windows"`
}

func cmdEval(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("eval", evalUsage, stderr)
	dir := fs.String("checkpoint", "", "checkpoint, run directory or checkpoints root")
	glob := fs.String("data", "", "glob of token shards (default: the run's validation data)")
	textFile := fs.String("text", "", "a text file to score, encoded with the checkpoint's tokenizer")
	batches := fs.Int("batches", 0, "micro-batches to score (0: one full pass over the data)")
	asJSON := fs.Bool("json", false, "print the result as one JSON object")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		fs.Usage()
		return usageError{fmt.Sprintf("eval takes no arguments besides flags; got %q", pos[0])}
	}
	if err := requireFlag(fs, "checkpoint", *dir); err != nil {
		return err
	}
	if *batches < 0 {
		return usageError{fmt.Sprintf("--batches must be 0 (a full pass) or positive, got %d", *batches)}
	}
	if *glob != "" && *textFile != "" {
		return usageError{"give --data or --text, not both"}
	}
	var text []byte
	if *textFile != "" {
		if text, err = os.ReadFile(*textFile); err != nil {
			return err
		}
	}
	m, err := infer.Load(*dir, engine.WithDrivers(all.Drivers()...), engine.WithLogger(warnLogger(stderr)))
	if err != nil {
		return err
	}
	defer m.Close()
	var res infer.EvalResult
	if *textFile != "" {
		res, err = m.EvaluateText(ctx, *textFile, string(text), *batches)
	} else {
		res, err = m.Evaluate(ctx, *glob, *batches)
	}
	if errors.Is(err, context.Canceled) {
		return stoppedError(ctx, "evaluation stopped")
	}
	if err != nil {
		return err
	}
	cfg := m.Config()
	data := *glob
	if *textFile != "" {
		data = *textFile
	}
	if data == "" {
		data = cfg.Data.Val
	}
	if data == "" {
		data = "default-corpus/val"
	}
	if *asJSON {
		out, err := json.Marshal(evalJSON{
			Checkpoint: m.Dir(), Step: m.Step(), Data: data, Loss: res.Loss, Perplexity: res.Perplexity,
			Tokens: res.Tokens, Batches: res.Batches, Seq: cfg.Train.Seq, Windows: res.Batches * res.BatchSize,
		})
		if err != nil {
			return err
		}
		fmt.Fprintln(stdout, string(out))
		return nil
	}
	fmt.Fprintf(stdout, "step %d (%s) on %s: loss %.4f, perplexity %.4f over %d tokens (%d batches of %d x %d)\n",
		m.Step(), m.Dir(), data, res.Loss, res.Perplexity, res.Tokens, res.Batches, res.BatchSize, cfg.Train.Seq)
	return nil
}

// warnLogger prints the engine's warnings (a skipped corrupt checkpoint)
// on stderr.
func warnLogger(stderr io.Writer) zerolog.Logger {
	return zerolog.New(zerolog.ConsoleWriter{Out: stderr, NoColor: true, TimeFormat: time.TimeOnly}).
		Level(zerolog.WarnLevel).With().Timestamp().Logger()
}
