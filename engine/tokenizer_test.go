package engine

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/data"
	"github.com/mktrain/mktrain/hf"
	"github.com/mktrain/mktrain/tokenizer"
)

// Tokenizers made with the Hugging Face library (package tokenizer's
// fixtures): GPT-2 style and Llama 2 style, about 2,200 to 2,600 ids.
const (
	gpt2Tokenizer   = "../tokenizer/testdata/gpt2.json"
	llama2Tokenizer = "../tokenizer/testdata/llama2.json"
)

// tokenizerRun is a small run on shards of ids below vocab, with data.tokenizer
// set to path.
func tokenizerRun(t *testing.T, path string, vocab int) Config {
	t.Helper()
	cfg := equivalenceConfig()
	cfg.Model.Vocab = vocab
	cfg.Train.Steps, cfg.Train.WarmupSteps, cfg.Checkpoint.Every = 2, 1, 1
	dir := t.TempDir()
	tokens := make([]uint32, 4000)
	for i := range tokens {
		tokens[i] = uint32(i*37) % 2000
	}
	for _, name := range []string{"train_000000.bin", "val_000000.bin"} {
		if err := data.WriteShard(filepath.Join(dir, name), tokens, vocab); err != nil {
			t.Fatal(err)
		}
	}
	cfg.Data.Train, cfg.Data.Val, cfg.Data.Tokenizer = filepath.Join(dir, "train_*.bin"), filepath.Join(dir, "val_*.bin"), path
	return cfg
}

func runIn(t *testing.T, cfg Config, runDir string) error {
	t.Helper()
	eng, err := New(cfg, WithRunDir(runDir))
	if err != nil {
		return err
	}
	_, err = eng.Run(context.Background())
	return err
}

// TestTokenizerTravels: the run's tokenizer is copied into the run
// directory and into every checkpoint (listed and hashed in the manifest),
// state.json records its SHA-256, and a resume under another tokenizer, or
// none, is refused.
func TestTokenizerTravels(t *testing.T) {
	tok, err := tokenizer.Load(gpt2Tokenizer)
	if err != nil {
		t.Fatal(err)
	}
	cfg := tokenizerRun(t, gpt2Tokenizer, tok.VocabSize()+100)
	runDir := t.TempDir()
	if err := runIn(t, cfg, runDir); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(runDir, hf.TokenizerFile)); err != nil || !bytes.Equal(b, tok.JSON()) {
		t.Fatalf("the run directory's tokenizer.json is not the tokenizer's (%v)", err)
	}
	infos, err := checkpoint.List(filepath.Join(runDir, "checkpoints"))
	if err != nil || len(infos) != 2 {
		t.Fatalf("checkpoints: %v, %v", infos, err)
	}
	for _, info := range infos {
		if err := checkpoint.Verify(info.Dir); err != nil {
			t.Fatal(err)
		}
		m, err := checkpoint.ReadManifest(info.Dir)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, f := range m.Files {
			names = append(names, f.Name)
		}
		if !slices.Contains(names, hf.TokenizerFile) || !slices.Contains(names, hf.TokenizerConfigFile) {
			t.Fatalf("%s's manifest lists %v, without the tokenizer's files", info.Dir, names)
		}
		ci, err := ReadCheckpointInfo(info.Dir)
		if err != nil || ci.TokenizerSHA256 != tok.Hash() {
			t.Fatalf("%s records the tokenizer %q (%v), want %s", info.Dir, ci.TokenizerSHA256, err, tok.Hash())
		}
		// The copy loads as the same tokenizer, its EOS included.
		back, err := tokenizer.Load(filepath.Join(info.Dir, hf.TokenizerFile))
		if err != nil {
			t.Fatal(err)
		}
		e1, _ := back.EOS()
		e2, _ := tok.EOS()
		if back.Hash() != tok.Hash() || e1 != e2 {
			t.Fatalf("the checkpoint's tokenizer loads with hash %s and EOS %d, want %s and %d", back.Hash(), e1, tok.Hash(), e2)
		}
	}

	// More steps with the same tokenizer resume; another one, or none, is
	// refused, naming both.
	more := cfg
	more.Train.Steps = 3
	if err := runIn(t, more, runDir); err != nil {
		t.Fatal(err)
	}
	more.Train.Steps = 4
	other := more
	other.Data.Tokenizer = llama2Tokenizer
	err = runIn(t, other, runDir)
	if err == nil || !strings.Contains(err.Error(), "cannot resume from") || !strings.Contains(err.Error(), "trained with the tokenizer of sha256 "+tok.Hash()[:16]) {
		t.Fatalf("resuming with another tokenizer: %v", err)
	}
	// The refused run left the run directory's tokenizer as it was.
	if b, err := os.ReadFile(filepath.Join(runDir, "tokenizer.json")); err != nil || !bytes.Equal(b, tok.JSON()) {
		t.Fatalf("after the refused resume the run directory's tokenizer.json is not the run's (%v)", err)
	}
	none := more
	none.Data.Tokenizer = ""
	err = runIn(t, none, runDir)
	if err == nil || !strings.Contains(err.Error(), "this run has the byte-level tokenizer") {
		t.Fatalf("resuming without a tokenizer: %v", err)
	}
}

// TestTokenizerLargerThanVocabIsRefused: a sentence naming both numbers.
func TestTokenizerLargerThanVocabIsRefused(t *testing.T) {
	tok, err := tokenizer.Load(gpt2Tokenizer)
	if err != nil {
		t.Fatal(err)
	}
	n := tok.VocabSize()
	cfg := tokenizerRun(t, gpt2Tokenizer, n-2)
	_, err = New(cfg)
	want := fmt.Sprintf("data.tokenizer: the tokenizer %s has %d ids, more than model.vocab (%d)", gpt2Tokenizer, n, n-2)
	if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), fmt.Sprintf("set model.vocab to at least %d", n)) {
		t.Fatalf("got %v\nwant %s...", err, want)
	}
	cfg.Data.Tokenizer = filepath.Join(t.TempDir(), "missing.json")
	if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), "data.tokenizer: ") || !strings.Contains(err.Error(), "missing.json") {
		t.Fatalf("a missing tokenizer file: %v", err)
	}
	cfg = equivalenceConfig()
	cfg.Data.Tokenizer = gpt2Tokenizer
	if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), "data.tokenizer is set but data.train is empty") {
		t.Fatalf("a tokenizer with the embedded corpus: %v", err)
	}
}

// TestInitFromTakesTheHFTokenizer: a run that starts from a Hugging Face
// directory with a tokenizer.json, and names none itself, takes it.
func TestInitFromTakesTheHFTokenizer(t *testing.T) {
	tok, err := tokenizer.Load(llama2Tokenizer)
	if err != nil {
		t.Fatal(err)
	}
	cfg := tokenizerRun(t, "", tok.VocabSize())
	m := HFModel(cfg)
	m.Tokenizer = hf.TokenizerFor(tok)
	hfDir := filepath.Join(t.TempDir(), "hf")
	if err := hf.Write(hfDir, m, hf.FP32, func(name string, dst []float32) error {
		for i := range dst {
			dst[i] = 0.01 * float32(i%7)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	cfg.Checkpoint.InitFrom = hfDir
	runDir := t.TempDir()
	if err := runIn(t, cfg, runDir); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(runDir, hf.TokenizerFile)); err != nil || !bytes.Equal(b, tok.JSON()) {
		t.Fatalf("the run did not take the Hugging Face directory's tokenizer.json (%v)", err)
	}
	info, err := ReadCheckpointInfo(filepath.Join(runDir, "checkpoints", checkpoint.StepDirName(2)))
	if err != nil || info.TokenizerSHA256 != tok.Hash() {
		t.Fatalf("the checkpoint records %q (%v), want %s", info.TokenizerSHA256, err, tok.Hash())
	}
}
