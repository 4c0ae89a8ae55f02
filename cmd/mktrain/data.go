package main

import (
	"fmt"
	"io"

	"github.com/schollz/progressbar/v3"

	"github.com/mktrain/mktrain/data"
)

const dataUsage = `Usage: mktrain data prepare [--out DIR] [--val-fraction F] [--shard-tokens N] FILE|GLOB...

Turns text files into byte-level token shards (llm.c format, vocab 256):
DIR/train_000000.bin, ... and DIR/val_000000.bin, ... The last F of each
file's bytes go to validation. Point a recipe's data.train at DIR/train_*.bin
and data.val at DIR/val_*.bin.

Flags:
`

func cmdData(args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] != "prepare" {
		if len(args) > 0 && (args[0] == "--help" || args[0] == "-h") {
			fmt.Fprint(stdout, dataUsage)
			return errHelp
		}
		fmt.Fprint(stderr, dataUsage)
		return usageError{"data takes the subcommand prepare"}
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
	stats, err := data.Prepare(inputs, *out, *valFraction, *shardTokens, func(done, total int64) {
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
