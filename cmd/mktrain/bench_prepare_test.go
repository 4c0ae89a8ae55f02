package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestBenchPrepare: bench prepare measures data prepare --tokenizer, reads
// the peer's JSON, and writes the figures and the ratio per core.
func TestBenchPrepare(t *testing.T) {
	dir := t.TempDir()
	var b strings.Builder
	for i := range 300 {
		fmt.Fprintf(&b, "{\"text\": \"Document %d: the quick brown fox jumps over the lazy dog, %d times.\"}\n", i, i*7)
	}
	corpus := writeFile(t, filepath.Join(dir, "c.jsonl"), b.String())
	peer := writeFile(t, filepath.Join(dir, "peer.json"), `{"library": "tokenizers", "version": "0.23.2", "processes": 1, "documents": 300,
		"text_bytes": 20000, "tokens": 5000, "seconds": 0.01, "mb_per_s": 2.0, "mb_per_s_per_core": 2.0, "add_special_tokens": true}`)
	out := filepath.Join(dir, "results")
	code, stdout, stderr := runCLI(t, "bench", "prepare", "--tokenizer", testTokenizer, "--cores", "2", "--repeat", "2",
		"--peer-json", peer, "--out", out, corpus)
	if code != exitOK {
		t.Fatalf("exit %d\n%s%s", code, stdout, stderr)
	}
	for _, want := range []string{"pass 1: ", "pass 2: ", "mktrain: ", "per core; 300 documents", "peer:     2.00 MB/s in 1 processes", "ratio:    "} {
		if !strings.Contains(stdout, want) {
			t.Errorf("output lacks %q:\n%s", want, stdout)
		}
	}
	raw, err := os.ReadFile(filepath.Join(out, "prepare-gpt2.json"))
	if err != nil {
		t.Fatal(err)
	}
	var res struct {
		Benchmark string         `json:"benchmark"`
		Figures   map[string]any `json:"figures"`
	}
	if err := json.Unmarshal(raw, &res); err != nil {
		t.Fatal(err)
	}
	f := res.Figures
	perCore, _ := f["mb_per_s_per_core"].(float64)
	ratio, _ := f["ratio_per_core"].(float64)
	if res.Benchmark != "prepare" || f["documents"] != float64(300) || f["cores"] != float64(2) || !(perCore > 0) || ratio != perCore/2.0 {
		t.Fatalf("result %s", raw)
	}
	if code, _, stderr := runCLI(t, "bench", "prepare", corpus); code != exitFailure || !strings.Contains(stderr, "needs --tokenizer") {
		t.Fatalf("without --tokenizer: exit %d, %s", code, stderr)
	}
}
