package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/tokenizer"
)

// TestCorpusToHuggingFace walks README's "From a corpus to a Hugging Face
// model": a JSON Lines corpus and a tokenizer.json through data prepare,
// run (data.tokenizer set), sample, eval --text and export; the export
// holds the tokenizer beside the weights.
func TestCorpusToHuggingFace(t *testing.T) {
	dir := t.TempDir()
	tok, err := tokenizer.Load(testTokenizer)
	if err != nil {
		t.Fatal(err)
	}
	var corpus strings.Builder
	for i := range 400 {
		fmt.Fprintf(&corpus, "{\"text\": \"The %s fox number %d runs to the %s and back.\"}\n",
			[]string{"quick", "lazy", "small"}[i%3], i, []string{"garden", "river", "market"}[i%3])
	}
	writeFile(t, filepath.Join(dir, "corpus.jsonl"), corpus.String())
	shards := filepath.Join(dir, "data")
	if code, stdout, stderr := runCLI(t, "data", "prepare", "--tokenizer", testTokenizer, "--out", shards, filepath.Join(dir, "corpus.jsonl")); code != exitOK {
		t.Fatalf("data prepare: exit %d\n%s%s", code, stdout, stderr)
	}
	runDir := filepath.Join(dir, "run")
	args := append([]string{"run", "tiny", "--run-dir", runDir,
		"--set", "data.train=" + filepath.Join(shards, "train_*.bin"), "--set", "data.val=" + filepath.Join(shards, "val_*.bin"),
		"--set", "data.tokenizer=" + testTokenizer, "--set", fmt.Sprintf("model.vocab=%d", tok.VocabSize())}, quick...)
	if code, stdout, stderr := runCLI(t, args...); code != exitOK {
		t.Fatalf("run: exit %d\n%s%s", code, stdout, stderr)
	}
	if b, err := os.ReadFile(filepath.Join(runDir, "tokenizer.json")); err != nil || !bytes.Equal(b, tok.JSON()) {
		t.Fatalf("the run directory lacks the tokenizer (%v)", err)
	}

	code, stdout, stderr := runCLI(t, "ckpt", "inspect", runDir)
	if want := "tokenizer      tokenizer.json, sha256 " + tok.Hash(); code != exitOK || !strings.Contains(stdout, want) {
		t.Fatalf("ckpt inspect: exit %d, output lacks %q:\n%s%s", code, want, stdout, stderr)
	}
	code, stdout, stderr = runCLI(t, "sample", "--checkpoint", runDir, "--prompt", "The quick fox", "--tokens", "5", "--temperature", "0")
	if code != exitOK || !strings.HasPrefix(stdout, "The quick fox") {
		t.Fatalf("sample: exit %d, %q\n%s", code, stdout, stderr)
	}
	text := writeFile(t, filepath.Join(dir, "held-out.txt"), strings.Repeat("The small fox number 7 runs to the market and back.\n", 10))
	code, stdout, stderr = runCLI(t, "eval", "--checkpoint", runDir, "--text", text, "--json")
	if code != exitOK || !strings.Contains(stdout, `"data":"`+text+`"`) || !strings.Contains(stdout, `"loss":`) {
		t.Fatalf("eval --text: exit %d, %q\n%s", code, stdout, stderr)
	}
	if code, _, stderr := runCLI(t, "eval", "--checkpoint", runDir, "--text", text, "--data", "x*.bin"); code != exitFailure || !strings.Contains(stderr, "give --data or --text, not both") {
		t.Fatalf("eval --text with --data: exit %d, %s", code, stderr)
	}

	hfDir := filepath.Join(dir, "hf")
	code, stdout, stderr = runCLI(t, "export", runDir, hfDir)
	if code != exitOK || !strings.Contains(stdout, filepath.Join(hfDir, "tokenizer_config.json")) {
		t.Fatalf("export: exit %d, %q\n%s", code, stdout, stderr)
	}
	for _, name := range []string{"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} {
		if _, err := os.Stat(filepath.Join(hfDir, name)); err != nil {
			t.Errorf("the export lacks %s: %v", name, err)
		}
	}
	if b, err := os.ReadFile(filepath.Join(hfDir, "tokenizer.json")); err != nil || !bytes.Equal(b, tok.JSON()) {
		t.Fatalf("the export's tokenizer.json is not the run's (%v)", err)
	}
}
