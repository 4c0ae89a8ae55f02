package tokenizer

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
)

// TestMergeScanEqualsHeap: the quadratic merge for short words and the
// heap merge for long ones give the same symbols on random words.
func TestMergeScanEqualsHeap(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	texts := fixtureTexts(t)
	for _, name := range []string{"gpt2", "llama2"} {
		tok, _ := loadFixture(t, name)
		m := tok.model
		st := &encodeState{}
		for range 2000 {
			s := texts[r.IntN(len(texts))] + texts[r.IntN(len(texts))]
			if name == "llama2" {
				s = strings.ReplaceAll(s, " ", "▁")
			}
			syms := m.symbols(nil, s)
			scan := m.mergeScan(st, slices.Clone(syms))
			heap := m.mergeHeap(st, slices.Clone(syms))
			if !slices.Equal(scan, heap) {
				t.Fatalf("%s %q: scan %v, heap %v", name, s, scan, heap)
			}
		}
	}
}

// TestConcurrentEncode: many goroutines encoding at once (through the
// shared word cache) get the single-threaded ids. Run with -race.
func TestConcurrentEncode(t *testing.T) {
	texts := fixtureTexts(t)
	for _, name := range []string{"llama3", "mistral"} {
		tok, cases := loadFixture(t, name)
		var wg sync.WaitGroup
		errs := make(chan string, 8)
		for g := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for k := range 3 * len(texts) {
					i := (k*7 + g*13) % len(texts)
					if got := tok.Encode(texts[i]); !slices.Equal(got, cases[i].IDs) {
						errs <- fmt.Sprintf("%s goroutine %d: Encode(%q) = %v, want %v", name, g, texts[i], got, cases[i].IDs)
						return
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for e := range errs {
			t.Error(e)
		}
	}
}

func TestDecodeRoundTrip(t *testing.T) {
	for _, name := range []string{"gpt2", "llama3"} {
		tok, _ := loadFixture(t, name)
		for _, s := range fixtureTexts(t) {
			if strings.Contains(s, "<|sep|>") {
				continue // it strips the whitespace around it, as HF's lstrip and rstrip do
			}
			if got, err := tok.Decode(tok.Encode(s)); err != nil || got != s {
				t.Errorf("%s: Decode(Encode(%q)) = %q, %v", name, s, got, err)
			}
		}
	}
	// SentencePiece style: exact except that the first token's leading "▁" is
	// dropped (so one leading space is lost); no text here starts with a space.
	for _, name := range []string{"llama2", "mistral"} {
		tok, _ := loadFixture(t, name)
		for _, s := range []string{"Hello world", "a\tb\nc", "你好，世界 😀 ꙮ", "x  y  ", "<s>[INST] hi [/INST]"} {
			if got, err := tok.Decode(tok.Encode(s)); err != nil || got != s && !(name == "llama2" && strings.Contains(s, "<s>")) {
				t.Errorf("%s: Decode(Encode(%q)) = %q, %v", name, s, got, err)
			}
		}
	}
}

func TestTokenTables(t *testing.T) {
	tok, _ := loadFixture(t, "llama3")
	bos, ok := tok.BOS()
	if s, _ := tok.Token(bos); !ok || s != "<|begin_of_text|>" {
		t.Errorf("BOS() = %d (%q), %v", bos, s, ok)
	}
	eos, ok := tok.EOS()
	if s, _ := tok.Token(eos); !ok || s != "<|end_of_text|>" {
		t.Errorf("EOS() = %d (%q), %v", eos, s, ok)
	}
	if id, ok := tok.TokenID("<tool>"); !ok || id != tok.VocabSize()-1 {
		t.Errorf("TokenID(<tool>) = %d, %v; want the last id %d", id, ok, tok.VocabSize()-1)
	}
	if id, ok := tok.TokenID("Ġthe"); !ok {
		t.Error("Ġthe is not a token")
	} else if got := tok.Encode(" the"); !slices.Equal(got, []int{id}) {
		t.Errorf("Encode(\" the\") = %v, want [%d]", got, id)
	}
	if _, err := tok.Decode([]int{0, tok.VocabSize()}); err == nil || !strings.Contains(err.Error(), "llama3.json") {
		t.Errorf("Decode of an id out of range: err %v, want one naming the file", err)
	}
	if _, ok := tok.Token(-1); ok {
		t.Error("Token(-1) exists")
	}
	if len(tok.Hash()) != 64 || string(tok.JSON()[:1]) != "{" {
		t.Errorf("Hash %q, JSON %.20q", tok.Hash(), tok.JSON())
	}
	sp, _ := loadFixture(t, "mistral")
	if id, ok := sp.BOS(); !ok || id != 1 {
		t.Errorf("mistral BOS() = %d, %v; want 1", id, ok)
	}
	if id, ok := sp.EOS(); !ok || id != 2 {
		t.Errorf("mistral EOS() = %d, %v; want 2", id, ok)
	}
	if !slices.Equal(sp.SpecialTokens(), []string{"<unk>", "<s>", "</s>", "[INST]", "[/INST]"}) {
		t.Errorf("SpecialTokens() = %q", sp.SpecialTokens())
	}
}

// TestTokenizerConfig: Load takes eos_token and bos_token from a
// tokenizer_config.json beside the file, and refuses one that names no token.
func TestTokenizerConfig(t *testing.T) {
	dir := t.TempDir()
	data, err := os.ReadFile("testdata/llama3.json")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "tokenizer.json")
	config := filepath.Join(dir, "tokenizer_config.json")
	os.WriteFile(path, data, 0o644)
	os.WriteFile(config, []byte(`{"eos_token": "<|eot_id|>", "bos_token": {"content": "<|begin_of_text|>"}}`), 0o644)
	tok, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	eos, _ := tok.EOS()
	if s, _ := tok.Token(eos); s != "<|eot_id|>" {
		t.Errorf("EOS is %q, want the config's <|eot_id|>", s)
	}
	os.WriteFile(config, []byte(`{"eos_token": "<nope>"}`), 0o644)
	if _, err := Load(path); err == nil || !strings.Contains(err.Error(), "eos_token") || !strings.Contains(err.Error(), "tokenizer_config.json") {
		t.Errorf("a config naming no token: err %v", err)
	}
}

// TestErrorsNameFileAndField: what this package cannot read is refused
// with an error that names the file and the field.
func TestErrorsNameFileAndField(t *testing.T) {
	base, err := os.ReadFile("testdata/gpt2.json")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ old, new, want string }{
		{`"type": "BPE"`, `"type": "Unigram"`, "model type Unigram is not supported"},
		{`"type": "BPE"`, `"type": "WordPiece"`, "model type WordPiece"},
		{`"dropout": null`, `"dropout": 0.1`, "model: dropout"},
		{`"type": "ByteLevel",
    "add_prefix_space": false`, `"type": "Whitespace",
    "add_prefix_space": false`, `pre_tokenizer: type "Whitespace" is not supported`},
		{`"normalizer": null`, `"normalizer": {"type": "BertNormalizer"}`, `normalizer: type "BertNormalizer"`},
		{`"merges": [`, `"merges": ["nope nope",`, "merges[0]"},
		{`"unk_token": null`, `"unk_token": "<zzz>"`, "unk_token"},
	} {
		data := strings.Replace(string(base), c.old, c.new, 1)
		if data == string(base) {
			t.Fatalf("%q is not in gpt2.json", c.old)
		}
		_, err := Parse([]byte(data), "bad.json")
		if err == nil || !strings.Contains(err.Error(), "bad.json") || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err %v, want one naming bad.json and %q", c.new, err, c.want)
		}
	}
	if _, err := Parse([]byte("{not json"), "x.json"); err == nil || !strings.Contains(err.Error(), "x.json") {
		t.Errorf("not JSON: %v", err)
	}
	if _, err := Load("testdata/absent.json"); err == nil || !strings.Contains(err.Error(), "absent.json") {
		t.Errorf("absent file: %v", err)
	}
	if _, err := Parse([]byte("IQ== 0\n"), "few.tiktoken"); err == nil || !strings.Contains(err.Error(), "few.tiktoken") {
		t.Errorf("a rank file without every byte: %v", err)
	}
}

func TestLossyUTF8MatchesRust(t *testing.T) {
	for in, want := range map[string]string{
		"ok":             "ok",
		"\xe2\x82":       "\ufffd", // one maximal subpart
		"\xe2\x82x":      "\ufffdx",
		"\xff\xfe":       "\ufffd\ufffd", // bytes that begin nothing
		"\xf0\x9f\x98":   "\ufffd",
		"a\xed\xa0\x80b": "a\ufffd\ufffd\ufffdb", // a surrogate: ED then A0 is out of range
		"\xc3\xa9\xc3":   "é\ufffd",
	} {
		if got := lossyUTF8([]byte(in)); got != want {
			t.Errorf("lossyUTF8(%q) = %q, want %q", in, got, want)
		}
	}
}
