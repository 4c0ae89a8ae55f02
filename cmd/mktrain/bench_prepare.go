package main

// mktrain bench prepare: the speed of data prepare --tokenizer in MB of
// text per second per core, beside the Rust tokenizers library's
// (scripts/peer/tokenize_peer.py) on the same files when its JSON is given.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/mktrain/mktrain/data"
	"github.com/mktrain/mktrain/tokenizer"
)

const benchPrepareUsage = `Usage: mktrain bench prepare --tokenizer FILE [--text-key K] [--cores N] [--repeat R] [--peer-json FILE] [--out DIR] FILE|GLOB...

Measures data prepare --tokenizer on FILE... (text, JSON Lines or Parquet,
as data prepare reads them) with N cores (default every core: GOMAXPROCS is
set to N for the run, so the reader, the workers and the writer share
them), R times into a temporary directory that is removed after, and prints
the fastest pass's tokenize speed: MB (10^6 bytes) of text per second, in
all and per core, with the documents, tokens and bytes per token. The pass
that is timed reads, parses and tokenizes every document and writes the
tokens; the shuffle and the shards after it are timed apart.

--peer-json FILE adds the figures of the peer, the Hugging Face tokenizers
library (Rust) run on the same files by scripts/peer/tokenize_peer.py (its
JSON output), and the ratio of mktrain's MB/s per core to the peer's.
Writes prepare-<tokenizer>.json, with the commit, the machine and the
command, into bench/results/cpu/ (the latest result, overwritten by the
next run) or into the folder --out names.

Flags:
`

// peerResult is what scripts/peer/tokenize_peer.py prints.
type peerResult struct {
	Library          string  `json:"library"`
	Version          string  `json:"version"`
	Processes        int     `json:"processes"`
	Documents        int64   `json:"documents"`
	TextBytes        int64   `json:"text_bytes"`
	Tokens           int64   `json:"tokens"`
	Seconds          float64 `json:"seconds"`
	MBPerSecond      float64 `json:"mb_per_s"`
	MBPerSecondCore  float64 `json:"mb_per_s_per_core"`
	AddSpecialTokens bool    `json:"add_special_tokens"`
}

func cmdBenchPrepare(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench prepare", benchPrepareUsage, stderr)
	tokPath := fs.String("tokenizer", "", "tokenizer.json or tiktoken file")
	textKey := fs.String("text-key", data.DefaultTextKey, "JSON field or Parquet column holding the text")
	cores := fs.Int("cores", runtime.GOMAXPROCS(0), "cores to tokenize on")
	repeat := fs.Int("repeat", 3, "passes; the fastest is reported")
	peerJSON := fs.String("peer-json", "", "the output of scripts/peer/tokenize_peer.py on the same files")
	out := fs.String("out", "", "directory for the JSON result (default bench/results/cpu)")
	inputs, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if err := requireFlag(fs, "tokenizer", *tokPath); err != nil {
		return err
	}
	switch {
	case len(inputs) == 0:
		fs.Usage()
		return usageError{"bench prepare needs at least one input file"}
	case *cores < 1:
		return usageError{fmt.Sprintf("--cores must be positive, got %d", *cores)}
	case *repeat < 1:
		return usageError{fmt.Sprintf("--repeat must be positive, got %d", *repeat)}
	}
	var peer *peerResult
	if *peerJSON != "" {
		peer = new(peerResult)
		raw, err := os.ReadFile(*peerJSON)
		if err != nil {
			return err
		}
		if err := json.Unmarshal(raw, peer); err != nil || peer.MBPerSecondCore <= 0 {
			return fmt.Errorf("%s: not the JSON of scripts/peer/tokenize_peer.py (%v)", *peerJSON, err)
		}
	}
	tok, err := tokenizer.Load(*tokPath)
	if err != nil {
		return err
	}
	eos := data.NoEOS
	if id, ok := tok.EOS(); ok {
		eos = id
	}
	prev := runtime.GOMAXPROCS(*cores)
	defer runtime.GOMAXPROCS(prev)

	var best data.PrepareStats
	var passes []float64
	for pass := range *repeat {
		scratch, err := os.MkdirTemp("", "mktrain-bench-prepare-")
		if err != nil {
			return err
		}
		st, err := data.PrepareTokenized(ctx, data.PrepareOptions{
			Inputs: inputs, OutDir: filepath.Join(scratch, "shards"), ShardTokens: 1 << 30,
			Tokenizer: documentEncoder{tok}, EOS: eos, TextKey: *textKey, Seed: 1, Workers: *cores,
		})
		os.RemoveAll(scratch)
		if err != nil {
			return err
		}
		mbs := st.TokenizeMBPerSecond()
		passes = append(passes, mbs)
		fmt.Fprintf(stdout, "pass %d: %.2f MB/s on %d cores (%.2f per core), %s tokenizing, %s writing\n",
			pass+1, mbs, *cores, mbs/float64(*cores), st.TokenizeTime.Round(time.Millisecond), st.WriteTime.Round(time.Millisecond))
		if pass == 0 || mbs > best.TokenizeMBPerSecond() {
			best = st
		}
	}
	mbs := best.TokenizeMBPerSecond()
	perCore := mbs / float64(*cores)
	tokens := best.TrainTokens + best.ValTokens
	figures := map[string]any{
		"mb_per_s": mbs, "mb_per_s_per_core": perCore, "cores": *cores, "passes_mb_per_s": passes,
		"files": best.Files, "file_bytes": best.Bytes, "documents": best.Documents, "text_bytes": best.TextBytes,
		"tokens": tokens, "eos_tokens": best.EOSTokens, "bytes_per_token": best.BytesPerToken(),
		"tokenize_s": best.TokenizeTime.Seconds(), "write_s": best.WriteTime.Seconds(),
		"vocab": best.Vocab, "token_bytes": best.TokenBytes,
	}
	fmt.Fprintf(stdout, "mktrain:  %.2f MB/s on %d cores, %.2f MB/s per core; %d documents, %d tokens, %.3f bytes per token\n",
		mbs, *cores, perCore, best.Documents, tokens, best.BytesPerToken())
	if peer != nil {
		ratio := perCore / peer.MBPerSecondCore
		figures["peer"] = peer
		figures["ratio_per_core"] = ratio
		fmt.Fprintf(stdout, "peer:     %.2f MB/s in %d processes, %.2f MB/s per core (%s %s); %d documents, %d tokens\n",
			peer.MBPerSecond, peer.Processes, peer.MBPerSecondCore, peer.Library, peer.Version, peer.Documents, peer.Tokens)
		fmt.Fprintf(stdout, "ratio:    %.2fx the peer's MB/s per core (bar 0.5x, goal 1.0x)\n", ratio)
		if peer.Documents != best.Documents || peer.Tokens != tokens-best.EOSTokens {
			fmt.Fprintf(stdout, "note: the peer counted %d documents and %d tokens, mktrain %d and %d (end-of-document tokens not counted): the files or the tokenizers differ\n",
				peer.Documents, peer.Tokens, best.Documents, tokens-best.EOSTokens)
		}
	}
	settings := map[string]any{"tokenizer": *tokPath, "tokenizer_sha256": tok.Hash(), "inputs": inputs, "text_key": *textKey, "cores": *cores, "repeat": *repeat}
	name := strings.TrimSuffix(filepath.Base(*tokPath), filepath.Ext(*tokPath))
	return writeResult(stdout, *out, "prepare-"+name, nil, benchResult{
		Benchmark: "prepare", Commit: commit(), Date: time.Now().UTC().Format(time.RFC3339),
		Command: "mktrain bench prepare " + strings.Join(args, " "), Machine: machine(""), Recipe: name,
		Config: settings, Figures: figures,
	})
}
