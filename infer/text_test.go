package infer

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/data"
	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/hf"
	"github.com/mktrain/mktrain/tokenizer"
)

// gpt2Tokenizer is a byte-level BPE tokenizer made with the Hugging Face
// library (package tokenizer's fixture): 2602 ids, <|endoftext|> its EOS.
const gpt2Tokenizer = "../tokenizer/testdata/gpt2.json"

// tokenizedRun trains testConfig on the embedded corpus's text encoded
// with the tokenizer at path, data.tokenizer set to it, and returns the
// run directory and the tokenizer.
func tokenizedRun(t *testing.T, path string) (string, *tokenizer.Tokenizer, engine.Config) {
	t.Helper()
	tok, err := tokenizer.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig()
	cfg.Model.Vocab = tok.VocabSize()
	eos, _ := tok.EOS()
	var tokens []uint32
	for _, para := range strings.SplitAfter(string(data.DefaultCorpus(data.DefaultCorpusSeed)[:60000]), "\n") {
		for _, id := range tok.EncodeWithSpecial(para) {
			tokens = append(tokens, uint32(id))
		}
		tokens = append(tokens, uint32(eos))
	}
	dir := t.TempDir()
	if err := data.WriteShard(filepath.Join(dir, "train_000000.bin"), tokens, cfg.Model.Vocab); err != nil {
		t.Fatal(err)
	}
	if err := data.WriteShard(filepath.Join(dir, "val_000000.bin"), tokens[:2000], cfg.Model.Vocab); err != nil {
		t.Fatal(err)
	}
	cfg.Data.Train, cfg.Data.Val, cfg.Data.Tokenizer = filepath.Join(dir, "train_*.bin"), filepath.Join(dir, "val_*.bin"), path
	runDir := t.TempDir()
	trainRun(t, cfg, runDir)
	return runDir, tok, cfg
}

// TestModelUsesTheCheckpointsTokenizer: a model whose run had a tokenizer
// encodes, decodes, samples and scores text with it; the same model's
// export carries it.
func TestModelUsesTheCheckpointsTokenizer(t *testing.T) {
	ctx := context.Background()
	runDir, tok, cfg := tokenizedRun(t, gpt2Tokenizer)
	m, err := Load(runDir)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.Tokenizer() == nil || m.Tokenizer().Hash() != tok.Hash() {
		t.Fatal("the model does not carry its run's tokenizer")
	}
	const prompt = "The quick brown fox sees the lazy dog. 12 + 7 = 19."
	ids := m.Encode(prompt)
	want := tok.EncodeWithSpecial(prompt)
	if len(ids) != len(want) {
		t.Fatalf("Encode gives %d ids, the tokenizer %d", len(ids), len(want))
	}
	for i := range ids {
		if int(ids[i]) != want[i] {
			t.Fatalf("Encode gives %v, the tokenizer %v", ids, want)
		}
	}
	if text, err := m.Decode(ids); err != nil || text != prompt {
		t.Fatalf("Decode(Encode(prompt)) = %q, %v", text, err)
	}

	// Greedy SampleText is Sample on the encoded prompt, cut after the
	// first EOS, and its text starts with the prompt.
	text, out, err := m.SampleText(ctx, prompt, 40, 0, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	plain, err := m.Sample(ctx, ids, 40, 0, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	eos, _ := m.EOS()
	if cut := slices.Index(plain, eos); cut >= 0 {
		plain = plain[:cut+1]
	}
	if !slices.Equal(out, plain) {
		t.Fatalf("SampleText's ids %v, Sample's up to the EOS %v", out, plain)
	}
	if !strings.HasPrefix(text, prompt) {
		t.Fatalf("SampleText's text %q does not start with the prompt", text)
	}

	// EvaluateText scores what a shard of the same tokens scores.
	long := strings.Repeat("the small fox runs in the garden. ", 30)
	tokens := m.Encode(long)
	tokens = append(tokens, eos)
	shard := filepath.Join(t.TempDir(), "text.bin")
	u := make([]uint32, len(tokens))
	for i, x := range tokens {
		u[i] = uint32(x)
	}
	if err := data.WriteShard(shard, u, cfg.Model.Vocab); err != nil {
		t.Fatal(err)
	}
	fromText, err := m.EvaluateText(ctx, "long.txt", long, 0)
	if err != nil {
		t.Fatal(err)
	}
	fromShard, err := m.Evaluate(ctx, shard, 0)
	if err != nil {
		t.Fatal(err)
	}
	if fromText != fromShard || fromText.BatchSize != cfg.Train.MicroBatch {
		t.Fatalf("EvaluateText %+v, Evaluate on the same tokens %+v", fromText, fromShard)
	}
	// A text of fewer windows than a micro-batch is scored in one.
	short, err := m.EvaluateText(ctx, "short.txt", "the fox runs. the dog sleeps. the owl waits in the barn.", 0)
	if err != nil || short.Batches != 1 || short.BatchSize < 1 || short.BatchSize >= cfg.Train.MicroBatch {
		t.Fatalf("a short text: %+v, %v", short, err)
	}
	if _, err := m.EvaluateText(ctx, "tiny.txt", "fox", 0); err == nil || !strings.Contains(err.Error(), "tiny.txt: ") {
		t.Fatalf("a text shorter than a window: %v", err)
	}

	// The export carries the tokenizer.
	out2 := filepath.Join(t.TempDir(), "hf")
	if err := ExportHF(ctx, runDir, out2, "fp32"); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(out2, hf.TokenizerFile)); err != nil || !bytes.Equal(b, tok.JSON()) {
		t.Fatalf("the export's tokenizer.json is not the run's (%v)", err)
	}
	var config map[string]any
	raw, err := os.ReadFile(filepath.Join(out2, hf.ConfigFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &config); err != nil || config["eos_token_id"] != float64(eos) {
		t.Fatalf("config.json eos_token_id %v (%v), want %d", config["eos_token_id"], err, eos)
	}
	if _, err := os.Stat(filepath.Join(out2, hf.TokenizerConfigFile)); err != nil {
		t.Fatal(err)
	}
}

// TestTamperedTokenizerIsRefused: a checkpoint whose tokenizer.json was
// changed fails its checksum, so the model is not loaded with it.
func TestTamperedTokenizerIsRefused(t *testing.T) {
	runDir, _, cfg := tokenizedRun(t, gpt2Tokenizer)
	dir := filepath.Join(runDir, "checkpoints", checkpoint.StepDirName(cfg.Train.Steps))
	path := filepath.Join(dir, hf.TokenizerFile)
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, bytes.Replace(raw, []byte("<|endoftext|>"), []byte("<|endoftexx|>"), 1), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(dir); err == nil || !strings.Contains(err.Error(), hf.TokenizerFile) {
		t.Fatalf("Load of a checkpoint with a changed tokenizer.json: %v", err)
	}
}

// TestByteLevelText: without a tokenizer, text is bytes.
func TestByteLevelText(t *testing.T) {
	ctx := context.Background()
	cfg := testConfig()
	dir := t.TempDir()
	trainRun(t, cfg, dir)
	m, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.Tokenizer() != nil {
		t.Fatal("a byte-level run's model has a tokenizer")
	}
	if ids := m.Encode("hé"); !slices.Equal(ids, []int32{'h', 0xc3, 0xa9}) {
		t.Fatalf("Encode(hé) = %v", ids)
	}
	text, out, err := m.SampleText(ctx, "The fox", 10, 0, 0, 1)
	if err != nil || len(out) != 10 || !strings.HasPrefix(text, "The fox") || len(text) != len("The fox")+10 {
		t.Fatalf("SampleText: %q, %v, %v", text, out, err)
	}
	if _, err := m.EvaluateText(ctx, "x", strings.Repeat("the fox runs. ", 40), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Decode([]int32{300}); err == nil || !strings.Contains(err.Error(), "byte-level") {
		t.Fatalf("Decode of an id above 255: %v", err)
	}
}
