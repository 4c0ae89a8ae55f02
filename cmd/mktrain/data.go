package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/schollz/progressbar/v3"

	"github.com/mktrain/mktrain/data"
	"github.com/mktrain/mktrain/recipes"
)

const dataUsage = `Usage: mktrain data prepare [--out DIR] [--val-fraction F] [--shard-tokens N] FILE|GLOB...

Turns text files into byte-level token shards (llm.c format, vocab 256):
DIR/train_000000.bin, ... and DIR/val_000000.bin, ... The last F of each
file's bytes go to validation. Point a recipe's data.train at DIR/train_*.bin
and data.val at DIR/val_*.bin.

Flags:
`

const dataVerifyUsage = `Usage: mktrain data verify [--vocab N | --recipe RECIPE] [GLOB...]

Reads token shards in full and checks each header (magic, version, token
count), that the file is exactly 1024 + tokens*2 (or *4) bytes, and that
every token id is below the vocabulary: --vocab N, or the model.vocab of
RECIPE (a file or a shipped name), whose data.train and data.val are
checked when no GLOB is given. Prints one line per shard and a total; on a
problem exits 2 naming the file and, for a bad id, its position. A run
makes the same check on its shards before step 1.

Flags:
`

const dataCommandsUsage = `Usage:
  mktrain data prepare [--out DIR] [--val-fraction F] [--shard-tokens N] FILE|GLOB...
  mktrain data verify [--vocab N | --recipe RECIPE] [GLOB...]
Run 'mktrain data prepare --help' or 'mktrain data verify --help' for details.
`

func cmdData(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == "verify" {
		return cmdDataVerify(ctx, args[1:], stdout, stderr)
	}
	if len(args) == 0 || args[0] != "prepare" {
		if len(args) > 0 && (args[0] == "--help" || args[0] == "-h") {
			fmt.Fprint(stdout, dataCommandsUsage)
			return errHelp
		}
		fmt.Fprint(stderr, dataCommandsUsage)
		return usageError{"data takes the subcommand prepare or verify"}
	}
	fs := newFlagSet("data prepare", dataUsage, stderr)
	out := fs.String("out", "data", "output directory")
	valFraction := fs.Float64("val-fraction", 0.1, "share of each file's bytes used for validation")
	shardTokens := fs.Int("shard-tokens", 100_000_000, "tokens per shard file")
	inputs, err := parseInterspersed(fs, args[1:])
	if err != nil {
		return err
	}
	if len(inputs) == 0 {
		fs.Usage()
		return usageError{"data prepare needs at least one input file"}
	}
	if *valFraction < 0 || *valFraction >= 1 {
		return usageError{fmt.Sprintf("--val-fraction must be in [0, 1), got %g", *valFraction)}
	}
	if *shardTokens < 1 {
		return usageError{fmt.Sprintf("--shard-tokens must be positive, got %d", *shardTokens)}
	}
	var bar *progressbar.ProgressBar
	stats, err := data.Prepare(ctx, inputs, *out, *valFraction, *shardTokens, func(done, total int64) {
		if bar == nil {
			bar = progressbar.NewOptions64(total, progressbar.OptionSetWriter(stderr),
				progressbar.OptionShowBytes(true), progressbar.OptionSetDescription("preparing"))
		}
		_ = bar.Set64(done)
	})
	if bar != nil {
		_ = bar.Finish()
		fmt.Fprintln(stderr)
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "prepared %d files, %d bytes: %d train tokens in %d shards, %d val tokens in %d shards, in %s\n",
		stats.Files, stats.Bytes, stats.TrainTokens, len(stats.TrainShards), stats.ValTokens, len(stats.ValShards), *out)
	return nil
}

func cmdDataVerify(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("data verify", dataVerifyUsage, stderr)
	vocab := fs.Int("vocab", 0, "check that every token id is below N (0: check headers and sizes only)")
	recipe := fs.String("recipe", "", "take the vocabulary (model.vocab), and with no GLOB the shards (data.train, data.val), from this recipe")
	globs, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if *vocab < 0 {
		return usageError{fmt.Sprintf("--vocab must be positive, got %d", *vocab)}
	}
	if *recipe != "" {
		if *vocab != 0 {
			return usageError{"give --vocab or --recipe, not both"}
		}
		cfg, _, err := recipes.Load(*recipe, nil)
		if err != nil {
			return err
		}
		*vocab = cfg.Model.Vocab
		if len(globs) == 0 {
			for _, g := range []string{cfg.Data.Train, cfg.Data.Val} {
				if g != "" {
					globs = append(globs, g)
				}
			}
			if len(globs) == 0 {
				return fmt.Errorf("recipe %s sets no data.train or data.val (it trains on the embedded corpus); name the shards to check", *recipe)
			}
		}
	}
	if len(globs) == 0 {
		fs.Usage()
		return usageError{"data verify needs at least one shard or glob (or --recipe)"}
	}
	var paths []string
	for _, g := range globs {
		if !strings.ContainsAny(g, "*?[\\") {
			paths = append(paths, g) // a plain path: a missing file is reported as such
			continue
		}
		matched, err := data.Glob(g)
		if err != nil {
			return err
		}
		paths = append(paths, matched...)
	}
	start := time.Now()
	sum, err := data.Verify(ctx, paths, *vocab)
	if err != nil {
		return err
	}
	for _, s := range sum.Shards {
		fmt.Fprintf(stdout, "%s: uint%d, %d tokens, %d bytes, largest id %d\n",
			s.Path, 8*s.Header.TokenBytes(), s.Header.Tokens, s.Bytes, s.MaxToken)
	}
	ids := "ids not checked (no --vocab)"
	if *vocab > 0 {
		ids = fmt.Sprintf("every id < %d", *vocab)
	}
	fmt.Fprintf(stdout, "ok: %d shards, %d tokens, %d bytes, largest id %d, %s; checked in %s\n",
		len(sum.Shards), sum.Tokens, sum.Bytes, sum.MaxToken, ids, time.Since(start).Round(time.Millisecond))
	return nil
}
