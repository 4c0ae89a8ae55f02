package hf

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/mktrain/mktrain/tokenizer"
)

// TestWriteTokenizer: an export with a tokenizer holds tokenizer.json byte
// for byte and a tokenizer_config.json naming its special tokens, and
// config.json records the bos and eos ids; loading the directory's
// tokenizer gives the same tokenizer (hash, BOS, EOS). Without one,
// bos_token_id and eos_token_id stay null.
func TestWriteTokenizer(t *testing.T) {
	for _, tc := range []struct {
		fixture       string
		bos, eos, unk any // nil: JSON null
	}{
		{fixture: "llama2.json", bos: "<s>", eos: "</s>", unk: "<unk>"},
		{fixture: "gpt2.json", bos: nil, eos: "<|endoftext|>", unk: nil},
	} {
		tok, err := tokenizer.Load(filepath.Join("..", "tokenizer", "testdata", tc.fixture))
		if err != nil {
			t.Fatal(err)
		}
		m := tinyModel()
		m.Vocab = tok.VocabSize()
		m.Tokenizer = TokenizerFor(tok)
		dir := filepath.Join(t.TempDir(), "hf")
		if err := Write(dir, m, FP32, func(string, []float32) error { return nil }); err != nil {
			t.Fatal(err)
		}
		raw, err := os.ReadFile(filepath.Join(dir, TokenizerFile))
		if err != nil || !bytes.Equal(raw, tok.JSON()) {
			t.Fatalf("%s: tokenizer.json is not the tokenizer's JSON byte for byte (%v)", tc.fixture, err)
		}
		var cfg map[string]any
		readJSON(t, filepath.Join(dir, TokenizerConfigFile), &cfg)
		want := map[string]any{"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tc.bos, "eos_token": tc.eos,
			"unk_token": tc.unk, "pad_token": nil, "model_max_length": float64(m.MaxPositions), "clean_up_tokenization_spaces": false}
		for k, v := range want {
			if cfg[k] != v {
				t.Errorf("%s: tokenizer_config.json %s = %v, want %v", tc.fixture, k, cfg[k], v)
			}
		}
		var model map[string]any
		readJSON(t, filepath.Join(dir, ConfigFile), &model)
		eos, _ := tok.EOS()
		if model["eos_token_id"] != float64(eos) {
			t.Errorf("%s: config.json eos_token_id %v, want %d", tc.fixture, model["eos_token_id"], eos)
		}
		if bos, ok := tok.BOS(); ok != (model["bos_token_id"] != nil) || ok && model["bos_token_id"] != float64(bos) {
			t.Errorf("%s: config.json bos_token_id %v, tokenizer BOS %d (%v)", tc.fixture, model["bos_token_id"], bos, ok)
		}
		back, err := tokenizer.Load(filepath.Join(dir, TokenizerFile))
		if err != nil {
			t.Fatal(err)
		}
		b1, ok1 := back.BOS()
		b2, ok2 := tok.BOS()
		e1, _ := back.EOS()
		if back.Hash() != tok.Hash() || b1 != b2 || ok1 != ok2 || e1 != eos {
			t.Errorf("%s: the exported tokenizer loads with BOS %d/%v EOS %d, hash %s; want %d/%v, %d, %s", tc.fixture, b1, ok1, e1, back.Hash(), b2, ok2, eos, tok.Hash())
		}
	}

	dir := filepath.Join(t.TempDir(), "hf")
	if err := Write(dir, tinyModel(), FP32, func(string, []float32) error { return nil }); err != nil {
		t.Fatal(err)
	}
	var model map[string]any
	readJSON(t, filepath.Join(dir, ConfigFile), &model)
	if model["eos_token_id"] != nil || model["bos_token_id"] != nil {
		t.Errorf("without a tokenizer: bos %v eos %v, want null", model["bos_token_id"], model["eos_token_id"])
	}
	if _, err := os.Stat(filepath.Join(dir, TokenizerFile)); !os.IsNotExist(err) {
		t.Errorf("an export without a tokenizer has %s (%v)", TokenizerFile, err)
	}
}

func readJSON(t *testing.T, path string, v any) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}
