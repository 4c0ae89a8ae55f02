package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// The fixtures in testdata were written by scripts/tokenizer_fixtures.js
// with the Hugging Face tokenizers library (and tiktoken for the rank
// file); see testdata/README.md.

type fixtureCase struct {
	IDs        []int  `json:"ids"`
	IDsSpecial []int  `json:"ids_special"`
	Decoded    string `json:"decoded"`
}

func readJSON(t testing.TB, path string, v any) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

func fixtureTexts(t testing.TB) []string {
	var texts []string
	readJSON(t, filepath.Join("testdata", "texts.json"), &texts)
	return texts
}

func loadFixture(t testing.TB, name string) (*Tokenizer, []fixtureCase) {
	t.Helper()
	file := filepath.Join("testdata", name+".json")
	if filepath.Ext(name) == ".tiktoken" {
		file = filepath.Join("testdata", name)
		name = name[:len(name)-len(".tiktoken")]
	}
	tok, err := Load(file)
	if err != nil {
		t.Fatal(err)
	}
	var cases []fixtureCase
	readJSON(t, filepath.Join("testdata", name+".expected.json"), &cases)
	return tok, cases
}

// TestFixturesMatchHF: ids, ids with special tokens, and decoded text equal
// the Hugging Face library's for every text and every tokenizer.
func TestFixturesMatchHF(t *testing.T) {
	texts := fixtureTexts(t)
	for _, name := range []string{"gpt2", "gpt2-prefix-space", "custom-a", "custom-b", "llama3", "llama2", "mistral", "metaspace-split"} {
		t.Run(name, func(t *testing.T) {
			tok, cases := loadFixture(t, name)
			if len(cases) != len(texts) {
				t.Fatalf("%d expected cases for %d texts", len(cases), len(texts))
			}
			bad := 0
			for i, text := range texts {
				c := cases[i]
				if got := tok.Encode(text); !slices.Equal(got, c.IDs) {
					t.Errorf("Encode(%q)\n got %v\nwant %v", text, got, c.IDs)
					bad++
				}
				if got := tok.EncodeWithSpecial(text); !slices.Equal(got, c.IDsSpecial) {
					t.Errorf("EncodeWithSpecial(%q)\n got %v\nwant %v", text, got, c.IDsSpecial)
					bad++
				}
				got, err := tok.Decode(c.IDs)
				if err != nil || got != c.Decoded {
					t.Errorf("Decode(Encode(%q)) = %q, %v; want %q", text, got, err, c.Decoded)
					bad++
				}
				if bad > 20 {
					t.Fatal("too many differences")
				}
			}
		})
	}
}

// TestTiktokenFixture: the rank file's ids and decoding equal tiktoken's,
// and its converted tokenizer.json encodes the same.
func TestTiktokenFixture(t *testing.T) {
	texts := fixtureTexts(t)
	tok, cases := loadFixture(t, "tiny_cl100k.tiktoken")
	conv, err := Parse(tok.JSON(), "converted.json")
	if err != nil {
		t.Fatalf("the converted tokenizer.json does not load: %v", err)
	}
	for i, text := range texts {
		c := cases[i]
		if got := tok.Encode(text); !slices.Equal(got, c.IDs) {
			t.Errorf("Encode(%q)\n got %v\nwant %v", text, got, c.IDs)
		}
		if got := conv.Encode(text); !slices.Equal(got, c.IDs) {
			t.Errorf("converted: Encode(%q)\n got %v\nwant %v", text, got, c.IDs)
		}
		if got, err := tok.Decode(c.IDs); err != nil || got != c.Decoded {
			t.Errorf("Decode(Encode(%q)) = %q, %v; want %q", text, got, err, c.Decoded)
		}
	}
	if id, ok := tok.EOS(); !ok || id != tok.VocabSize()-1 {
		t.Errorf("EOS() = %d, %v; want <|endoftext|> after the last rank, %d", id, ok, tok.VocabSize()-1)
	}
}

// TestPreTokenizersMatchHF: the pre-tokenizers cut each text where the
// library's do (Oniguruma's matches for the regexes).
func TestPreTokenizersMatchHF(t *testing.T) {
	texts := fixtureTexts(t)
	var want map[string][][]string
	readJSON(t, filepath.Join("testdata", "pretokenized.json"), &want)
	for name, cuts := range want {
		var tok *Tokenizer
		if name == "o200k" {
			tok = loadO200k(t)
		} else {
			tok, _ = loadFixture(t, name)
		}
		for i, text := range texts {
			var got []string
			if text != "" {
				for _, p := range tok.preTokenizer.split(&encodeState{}, nil, piece{text, true}) {
					s := p.s
					if tok.model.byteLevel {
						s = toByteAlphabet(s)
					}
					got = append(got, s)
				}
			}
			if !slices.Equal(got, cuts[i]) && !(len(got) == 0 && len(cuts[i]) == 0) {
				t.Errorf("%s: %q cut as %q, want %q", name, text, got, cuts[i])
			}
		}
	}
}

// loadO200k is the fixture rank file read with o200k's pattern.
func loadO200k(t testing.TB) *Tokenizer {
	data, err := os.ReadFile(filepath.Join("testdata", "tiny_cl100k.tiktoken"))
	if err != nil {
		t.Fatal(err)
	}
	tok, err := ParseTiktoken(data, "tiny.tiktoken", TiktokenOptions{Pattern: "o200k"})
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// TestTiktokenO200kFixture: with o200k's pattern, tiktoken's ids.
func TestTiktokenO200kFixture(t *testing.T) {
	texts := fixtureTexts(t)
	tok := loadO200k(t)
	var cases []fixtureCase
	readJSON(t, filepath.Join("testdata", "tiny_o200k.expected.json"), &cases)
	for i, text := range texts {
		if got := tok.Encode(text); !slices.Equal(got, cases[i].IDs) {
			t.Errorf("Encode(%q)\n got %v\nwant %v", text, got, cases[i].IDs)
		}
	}
}
