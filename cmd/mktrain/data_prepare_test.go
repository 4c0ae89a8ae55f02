package main

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/data"
	"github.com/mktrain/mktrain/tokenizer"
)

// testTokenizer is a byte-level BPE tokenizer.json made with the Hugging
// Face library (the tokenizer package's fixture, GPT-2 style, with
// <|endoftext|>).
const testTokenizer = "../../tokenizer/testdata/gpt2.json"

// TestDataPrepareWithTokenizer: JSON Lines and a text file become uint16
// shards of the tokenizer's ids, each document followed by <|endoftext|>;
// decoding the shards gives the documents back; data verify passes them.
func TestDataPrepareWithTokenizer(t *testing.T) {
	dir := t.TempDir()
	tok, err := tokenizer.Load(testTokenizer)
	if err != nil {
		t.Fatal(err)
	}
	docs := []string{"The quick brown fox.", "naïve café 🦊 — def f(x):\n    return x  # code", "Numbers 12345 and spaces     here."}
	var jsonl strings.Builder
	for _, d := range docs[:2] {
		fmt.Fprintf(&jsonl, "{\"id\": 1, \"body\": %q}\n", d)
	}
	writeFile(t, filepath.Join(dir, "a.jsonl"), jsonl.String())
	writeFile(t, filepath.Join(dir, "b.txt"), docs[2])
	out := filepath.Join(dir, "shards")
	code, stdout, stderr := runCLI(t, "data", "prepare", "--tokenizer", testTokenizer, "--text-key", "body", "--val-fraction", "0",
		"--seed", "3", "--out", out, filepath.Join(dir, "a.jsonl"), filepath.Join(dir, "b.txt"))
	if code != exitOK {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	eos, _ := tok.EOS()
	for _, want := range []string{"prepared 2 files", ": 3 documents", "end-of-document \"<|endoftext|>\" (id", "bytes of text per token", "MB/s per core", "train: "} {
		if !strings.Contains(stdout, want) {
			t.Errorf("summary lacks %q:\n%s", want, stdout)
		}
	}
	paths, err := data.Glob(filepath.Join(out, "train_*.bin"))
	if err != nil {
		t.Fatal(err)
	}
	var ids []int
	for _, p := range paths {
		s, err := data.OpenShard(p)
		if err != nil {
			t.Fatal(err)
		}
		ts := make([]uint32, s.Len())
		if err := s.ReadTokens(ts, 0); err != nil {
			t.Fatal(err)
		}
		s.Close()
		for _, x := range ts {
			ids = append(ids, int(x))
		}
	}
	var got []string
	for len(ids) > 0 {
		end := slices.Index(ids, eos)
		if end < 0 {
			t.Fatalf("the shards end without <|endoftext|>: %v", ids)
		}
		text, err := tok.Decode(ids[:end])
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, text)
		ids = ids[end+1:]
	}
	slices.Sort(got)
	want := slices.Clone(docs)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("the shards decode to %q, want %q", got, want)
	}
	code, stdout, stderr = runCLI(t, "data", "verify", "--vocab", fmt.Sprint(tok.VocabSize()), filepath.Join(out, "*.bin"))
	if code != exitOK || !strings.Contains(stdout, "ok: ") {
		t.Fatalf("data verify of the prepared shards: exit %d\n%s%s", code, stdout, stderr)
	}
}

func TestDataPrepareWithTokenizerErrors(t *testing.T) {
	dir := t.TempDir()
	good := writeFile(t, filepath.Join(dir, "good.jsonl"), "{\"text\": \"hello\"}\n")
	bad := writeFile(t, filepath.Join(dir, "bad.jsonl"), "{\"text\": \"hello\"}\n{\"text\": \n")
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"malformed line", []string{"--tokenizer", testTokenizer, bad}, bad + ":2: not valid JSON"},
		{"missing key", []string{"--tokenizer", testTokenizer, "--text-key", "content", good}, good + `:1: no "content" field (the fields are text; choose one with --text-key)`},
		{"unknown eos", []string{"--tokenizer", testTokenizer, "--eos", "</s>", good}, `--eos "</s>" is neither a token of the tokenizer`},
		{"eos id outside", []string{"--tokenizer", testTokenizer, "--eos", "99999999", good}, "--eos 99999999 is not an id of the tokenizer"},
		{"text key without tokenizer", []string{"--text-key", "body", good}, "--text-key goes with --tokenizer"},
		{"missing tokenizer", []string{"--tokenizer", filepath.Join(dir, "nope.json"), good}, "nope.json"},
	} {
		out := filepath.Join(t.TempDir(), "o")
		code, _, stderr := runCLI(t, append([]string{"data", "prepare", "--out", out}, tc.args...)...)
		if code != exitFailure || !strings.Contains(stderr, tc.want) {
			t.Errorf("%s: exit %d, stderr %q; want exit 2 and %q", tc.name, code, stderr, tc.want)
		}
	}
	// --eos none and --eos by token both work.
	for _, eos := range []string{"none", "<|endoftext|>"} {
		out := filepath.Join(t.TempDir(), "o")
		if code, stdout, stderr := runCLI(t, "data", "prepare", "--out", out, "--tokenizer", testTokenizer, "--eos", eos, good); code != exitOK {
			t.Errorf("--eos %s: exit %d\n%s%s", eos, code, stdout, stderr)
		}
	}
}

// TestDataVerifyMegatron: data verify takes a Megatron dataset by its
// prefix and says what it is.
func TestDataVerifyMegatron(t *testing.T) {
	dir := t.TempDir()
	prefix := filepath.Join(dir, "corpus_text_document")
	if err := data.WriteIndexed(prefix, [][]uint32{{1, 2, 3, 0}, {4, 5, 0}}, 1000); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := runCLI(t, "data", "verify", "--vocab", "1000", prefix)
	if code != exitOK || !strings.Contains(stdout, prefix+".bin: Megatron dataset of uint16, 2 documents, 7 tokens") {
		t.Fatalf("exit %d\n%s%s", code, stdout, stderr)
	}
	code, _, stderr = runCLI(t, "data", "verify", "--vocab", "5", prefix+".idx")
	if code != exitFailure || !strings.Contains(stderr, prefix+".bin: token id 5 at position 5 (byte offset 10) is >= vocab 5") {
		t.Fatalf("an id >= vocab: exit %d, %s", code, stderr)
	}
}
