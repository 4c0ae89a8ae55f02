package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/mktrain/mktrain/data"
	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/recipes"
	"github.com/mktrain/mktrain/tokenizer"
)

const dataUsage = `Usage: mktrain data prepare [--out DIR] [--val-fraction F] [--shard-tokens N]
                           [--tokenizer FILE [--text-key K] [--eos TOKEN] [--seed S]] FILE|GLOB...

Turns a corpus into token shards (llm.c format): DIR/train_000000.bin, ...
and DIR/val_000000.bin, ... Point a recipe's data.train at DIR/train_*.bin
and data.val at DIR/val_*.bin.

Without --tokenizer the shards are byte-level (vocab 256): each byte of each
text file is one token, and the last F of each file's bytes go to
validation.

With --tokenizer (a Hugging Face tokenizer.json or a tiktoken rank file; set
the recipe's data.tokenizer to the same file) the inputs are documents:
  - a .jsonl, .ndjson or .json file (JSON Lines) has one per line, its text
    in the string field K (default text); blank lines are skipped;
  - a .parquet file has one per row, its text in the string column K;
  - any other file is one document (the whole file, UTF-8 text);
  - .gz, .zst or .zstd after the name means gzip or zstd compression.
Each document is encoded (with the special tokens the tokenizer's
post-processor adds, such as Llama's <s>) and followed by the end-of-document
token: --eos TOKEN (a token such as "</s>", or an id), by default the
tokenizer's EOS; --eos none puts nothing between documents. The documents
are shuffled with the seed S, and the last F of the shuffled tokens go to
validation. Shards hold uint16 ids when the vocabulary has at most 65536,
else uint32. Every core tokenizes; the output is the same on any number of
cores. A malformed line, a missing field, a column that is not strings or a
truncated file stops it, naming the file and the line or row. A progress
bar shows on a terminal; a summary (documents, tokens, bytes per token,
MB/s) ends it.

Flags:
`

const dataVerifyUsage = `Usage: mktrain data verify [--vocab N | --recipe RECIPE] [GLOB...]

Reads token shards in full and checks each header (magic, version, token
count), that the file is exactly 1024 + tokens*2 (or *4) bytes, and that
every token id is below the vocabulary. A Megatron indexed dataset (a .bin
with its .idx; GLOB may name its prefix, its .bin or its .idx) is checked
too: its index, that the .bin holds exactly the tokens the index gives, and
every id. The vocabulary is --vocab N, or the model.vocab of
RECIPE (a file or a shipped name), whose data.train and data.val are
checked when no GLOB is given. Prints one line per shard and a total; on a
problem exits 2 naming the file and, for a bad id, its position. A run
makes the same check on its shards before step 1.

Flags:
`

const dataCommandsUsage = `Usage:
  mktrain data prepare [--out DIR] [--val-fraction F] [--shard-tokens N] [--tokenizer FILE [--text-key K] [--eos TOKEN] [--seed S]] FILE|GLOB...
  mktrain data verify [--vocab N | --recipe RECIPE] [GLOB...]
Run 'mktrain data prepare --help' or 'mktrain data verify --help' for details.
`

func cmdData(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == "verify" {
		return cmdDataVerify(ctx, args[1:], stdout, stderr)
	}
	if len(args) == 0 || args[0] != "prepare" {
		if len(args) > 0 && (isHelpFlag(args[0]) || args[0] == "help") {
			fmt.Fprint(stdout, dataCommandsUsage)
			return errHelp
		}
		fmt.Fprint(stderr, dataCommandsUsage)
		return usageError{"data takes the subcommand prepare or verify"}
	}
	fs := newFlagSet("data prepare", dataUsage, stderr)
	out := fs.String("out", "data", "output directory")
	valFraction := fs.Float64("val-fraction", 0.1, "share of the tokens used for validation (byte-level: of each file's bytes)")
	shardTokens := fs.Int("shard-tokens", 100_000_000, "tokens per shard file")
	tokenizerPath := fs.String("tokenizer", "", "tokenizer.json or tiktoken file (default: byte-level)")
	textKey := fs.String("text-key", data.DefaultTextKey, "JSON field or Parquet column holding the text (with --tokenizer)")
	eos := fs.String("eos", "", "end-of-document token or id, or none (default: the tokenizer's EOS)")
	seed := fs.Uint64("seed", 1, "seed of the document shuffle (with --tokenizer)")
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
	if *tokenizerPath == "" {
		for _, name := range []string{"text-key", "eos", "seed"} {
			if flagSet(fs, name) {
				return usageError{fmt.Sprintf("--%s goes with --tokenizer; without one the shards are byte-level", name)}
			}
		}
		return prepareBytes(ctx, inputs, *out, *valFraction, *shardTokens, stdout, stderr)
	}
	tok, err := tokenizer.Load(*tokenizerPath)
	if err != nil {
		return err
	}
	eosID, err := eosToken(tok, *eos)
	if err != nil {
		return err
	}
	bar := newPrepareBar(stderr)
	stats, err := data.PrepareTokenized(ctx, data.PrepareOptions{
		Inputs: inputs, OutDir: *out, ValFraction: *valFraction, ShardTokens: *shardTokens,
		Tokenizer: documentEncoder{tok}, EOS: eosID, TextKey: *textKey, Seed: *seed, Progress: bar.update,
	})
	bar.finish()
	if err != nil {
		return err
	}
	printPrepareSummary(stdout, stats, tok, eosID, *out)
	return nil
}

// prepareBytes is data prepare without a tokenizer: byte-level shards.
func prepareBytes(ctx context.Context, inputs []string, out string, valFraction float64, shardTokens int, stdout, stderr io.Writer) error {
	var bar *progressbar.ProgressBar
	stats, err := data.Prepare(ctx, inputs, out, valFraction, shardTokens, func(done, total int64) {
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
		stats.Files, stats.Bytes, stats.TrainTokens, len(stats.TrainShards), stats.ValTokens, len(stats.ValShards), out)
	return nil
}

// documentEncoder encodes a document as the tokenizer's post-processor
// would for a whole sequence (Llama's <s> first, say), as Megatron's and
// Hugging Face's data preparation do.
type documentEncoder struct{ t *tokenizer.Tokenizer }

func (d documentEncoder) Encode(text string) []int { return d.t.EncodeWithSpecial(text) }
func (d documentEncoder) VocabSize() int           { return d.t.VocabSize() }

// eosToken resolves --eos: "" for the tokenizer's EOS, "none", an id, or a
// token.
func eosToken(tok *tokenizer.Tokenizer, flag string) (int, error) {
	switch flag {
	case "":
		id, ok := tok.EOS()
		if !ok {
			return 0, usageError{fmt.Sprintf("the tokenizer %s has no end-of-document token that mktrain recognises; name one with --eos TOKEN (or --eos none for nothing between documents)", tok.Name())}
		}
		return id, nil
	case "none":
		return data.NoEOS, nil
	}
	if id, ok := tok.TokenID(flag); ok {
		return id, nil
	}
	if id, err := strconv.Atoi(flag); err == nil {
		if _, ok := tok.Token(id); !ok {
			return 0, usageError{fmt.Sprintf("--eos %d is not an id of the tokenizer %s (its vocabulary has %d ids)", id, tok.Name(), tok.VocabSize())}
		}
		return id, nil
	}
	return 0, usageError{fmt.Sprintf("--eos %q is neither a token of the tokenizer %s nor an id (its special tokens: %s)", flag, tok.Name(), strings.Join(tok.SpecialTokens(), " "))}
}

// flagSet reports whether the flag name was given on the command line.
func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// prepareBar is data prepare's progress bar: bytes of input while
// tokenizing, then tokens while writing; only on a terminal.
type prepareBar struct {
	out   io.Writer
	show  bool
	phase string
	bar   *progressbar.ProgressBar
}

func newPrepareBar(stderr io.Writer) *prepareBar {
	f, ok := stderr.(*os.File)
	return &prepareBar{out: stderr, show: ok && term.IsTerminal(int(f.Fd()))}
}

func (b *prepareBar) update(p data.PrepareProgress) {
	if !b.show {
		return
	}
	if b.phase != p.Phase {
		b.finish()
		b.phase = p.Phase
		opts := []progressbar.Option{progressbar.OptionSetWriter(b.out), progressbar.OptionSetDescription(p.Phase),
			progressbar.OptionShowIts(), progressbar.OptionThrottle(100 * time.Millisecond)}
		if p.Phase == "tokenizing" {
			opts = append(opts, progressbar.OptionShowBytes(true))
		} else {
			opts = append(opts, progressbar.OptionSetItsString("tokens"))
		}
		b.bar = progressbar.NewOptions64(p.Total, opts...)
	}
	_ = b.bar.Set64(p.Done)
}

func (b *prepareBar) finish() {
	if b.bar != nil {
		_ = b.bar.Finish()
		fmt.Fprintln(b.out)
		b.bar = nil
	}
}

// printPrepareSummary says what data prepare --tokenizer made.
func printPrepareSummary(w io.Writer, st data.PrepareStats, tok *tokenizer.Tokenizer, eos int, out string) {
	sep := "none"
	if eos != data.NoEOS {
		name, _ := tok.Token(eos)
		sep = fmt.Sprintf("%q (id %d)", name, eos)
	}
	fmt.Fprintf(w, "prepared %d files, %s: %d documents", st.Files, engine.FormatBytes(st.Bytes), st.Documents)
	if st.EmptyDocuments > 0 {
		fmt.Fprintf(w, " (and %d empty ones, skipped)", st.EmptyDocuments)
	}
	fmt.Fprintf(w, ", %s of text\n", engine.FormatBytes(st.TextBytes))
	fmt.Fprintf(w, "tokens: %d (uint%d, vocabulary %d, end-of-document %s), %.2f bytes of text per token\n",
		st.TrainTokens+st.ValTokens, 8*st.TokenBytes, st.Vocab, sep, st.BytesPerToken())
	fmt.Fprintf(w, "train: %d tokens in %d shards; val: %d tokens in %d shards; in %s\n",
		st.TrainTokens, len(st.TrainShards), st.ValTokens, len(st.ValShards), out)
	fmt.Fprintf(w, "tokenized at %.1f MB/s on %d cores (%.2f MB/s per core) in %s; shuffled and written in %s\n",
		st.TokenizeMBPerSecond(), runtime.GOMAXPROCS(0), st.TokenizeMBPerSecond()/float64(runtime.GOMAXPROCS(0)),
		st.TokenizeTime.Round(time.Millisecond), st.WriteTime.Round(time.Millisecond))
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
		kind := s.TokenType
		if s.Format == "megatron" {
			kind = fmt.Sprintf("Megatron dataset of %s, %d documents", s.TokenType, s.Documents)
		}
		fmt.Fprintf(stdout, "%s: %s, %d tokens, %d bytes, largest id %d\n", s.Path, kind, s.Tokens, s.Bytes, s.MaxToken)
	}
	ids := "ids not checked (no --vocab)"
	if *vocab > 0 {
		ids = fmt.Sprintf("every id < %d", *vocab)
	}
	fmt.Fprintf(stdout, "ok: %d shards, %d tokens, %d bytes, largest id %d, %s; checked in %s\n",
		len(sum.Shards), sum.Tokens, sum.Bytes, sum.MaxToken, ids, time.Since(start).Round(time.Millisecond))
	return nil
}
