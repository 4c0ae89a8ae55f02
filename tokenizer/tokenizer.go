package tokenizer

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
)

// Tokenizer turns text into token ids and back. It is immutable once
// loaded, and all its methods are safe for concurrent use.
type Tokenizer struct {
	name string // the file it came from, for errors
	json []byte // the tokenizer.json form (the file itself, or converted)
	hash string // sha256 of json, hex

	normalizer   normalizer   // nil: none
	preTokenizer preTokenizer // nil: each piece is one word
	model        *bpeModel
	added        *addedVocab
	decoder      decoder // nil: tokens joined by " " (as HF does)

	specialPrefix []int // ids the post-processor puts before a sequence
	specialSuffix []int // ... and after it

	tokens    []string       // id -> token string; "" where no token has the id
	decodeAs  map[int]string // added tokens with normalized=true whose normalized form differs: HF decodes that form
	hasToken  []bool         // id -> whether it names a token
	ids       map[string]int // token string -> id, added tokens included
	vocabSize int            // largest id + 1
	eos, bos  int            // -1: none

	scratch sync.Pool // *encodeState, reused across Encode calls
}

// Load reads a tokenizer from path: a Hugging Face tokenizer.json, or a
// tiktoken rank file (a name ending in .tiktoken, or a file whose first line
// is "<base64> <rank>"). For a tokenizer.json, a tokenizer_config.json in the
// same directory, when there is one, names the eos and bos tokens.
func Load(path string) (*Tokenizer, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	t, err := Parse(data, path)
	if err != nil {
		return nil, err
	}
	if t.isHFJSON(data) {
		config := filepath.Join(filepath.Dir(path), "tokenizer_config.json")
		if raw, err := os.ReadFile(config); err == nil {
			if err := t.applyConfig(raw, config); err != nil {
				return nil, err
			}
		}
	}
	return t, nil
}

// Parse reads a tokenizer from data; name is the file name errors carry
// and, for a tiktoken rank file, picks the split pattern and special
// tokens (see ParseTiktoken).
func Parse(data []byte, name string) (*Tokenizer, error) {
	if looksLikeTiktoken(data, name) {
		return ParseTiktoken(data, name, TiktokenOptions{})
	}
	return parseHFJSON(data, name)
}

// isHFJSON says whether data was the tokenizer.json form (not a rank file).
func (t *Tokenizer) isHFJSON(data []byte) bool {
	return len(data) == len(t.json) && string(data) == string(t.json)
}

// Encode returns the ids of text without the post-processor's special
// tokens (HF's add_special_tokens=False). Special tokens written in the text
// are recognised and become their ids.
func (t *Tokenizer) Encode(text string) []int {
	return t.AppendEncode(nil, text)
}

// EncodeWithSpecial returns the ids of text with the special tokens the
// post-processor adds (HF's add_special_tokens=True: Llama's BOS, say).
func (t *Tokenizer) EncodeWithSpecial(text string) []int {
	ids := append([]int(nil), t.specialPrefix...)
	ids = t.AppendEncode(ids, text)
	return append(ids, t.specialSuffix...)
}

// Name is the file the tokenizer was loaded from.
func (t *Tokenizer) Name() string { return t.name }

// VocabSize is the largest id + 1, added tokens included.
func (t *Tokenizer) VocabSize() int { return t.vocabSize }

// EOS is the id of the token that ends a document: tokenizer_config.json's
// eos_token when Load found one, else the first present of <|endoftext|>,
// <|end_of_text|>, </s>, <eos>, <|im_end|>.
func (t *Tokenizer) EOS() (id int, ok bool) { return t.eos, t.eos >= 0 }

// BOS is the id of the token that begins a sequence: tokenizer_config.json's
// bos_token when Load found one, else the first special token the
// post-processor puts before a sequence, else the first present of <s>,
// <|begin_of_text|>, <bos>, <|startoftext|>.
func (t *Tokenizer) BOS() (id int, ok bool) { return t.bos, t.bos >= 0 }

// UNK is the id of the model's unk_token, which stands for text the
// vocabulary cannot spell; ok is false when it has none (byte-level and
// byte-fallback tokenizers usually do not).
func (t *Tokenizer) UNK() (id int, ok bool) { return int(t.model.unk), t.model.unk >= 0 }

// TokenID is the id of the token s (a vocabulary entry in its stored form,
// e.g. "Ġthe" for a byte-level tokenizer, or an added token).
func (t *Tokenizer) TokenID(s string) (int, bool) {
	id, ok := t.ids[s]
	return id, ok
}

// Token is the stored form of token id.
func (t *Tokenizer) Token(id int) (string, bool) {
	if id < 0 || id >= len(t.tokens) || !t.hasToken[id] {
		return "", false
	}
	return t.tokens[id], true
}

// SpecialTokens lists the added tokens marked special, in id order.
func (t *Tokenizer) SpecialTokens() []string {
	return t.added.specialContents()
}

// JSON is the tokenizer in Hugging Face's tokenizer.json form: the file as
// loaded, or for a tiktoken rank file an equivalent converted one.
func (t *Tokenizer) JSON() []byte { return t.json }

// Hash is the hex sha256 of JSON().
func (t *Tokenizer) Hash() string { return t.hash }

// Decode turns ids back into text through the tokenizer's decoder. An id
// that names no token is an error.
func (t *Tokenizer) Decode(ids []int) (string, error) {
	toks := make([]string, len(ids))
	for i, id := range ids {
		s, ok := t.Token(id)
		if !ok {
			return "", fmt.Errorf("tokenizer %s: id %d (position %d) is not in the vocabulary of %d ids", t.name, id, i, t.vocabSize)
		}
		if n, ok := t.decodeAs[id]; ok {
			s = n
		}
		toks[i] = s
	}
	if t.decoder == nil {
		return strings.Join(toks, " "), nil
	}
	return strings.Join(t.decoder.decode(toks), ""), nil
}

// finish fills the id tables, the special ids and the hash once the parts
// are built.
func (t *Tokenizer) finish() {
	t.ids = make(map[string]int, len(t.model.vocab)+len(t.added.tokens))
	maxID := -1
	for s, id := range t.model.vocab {
		t.ids[s] = int(id)
		maxID = max(maxID, int(id))
	}
	for _, a := range t.added.tokens {
		t.ids[a.content] = a.id
		maxID = max(maxID, a.id)
	}
	t.vocabSize = maxID + 1
	t.tokens = make([]string, t.vocabSize)
	t.hasToken = make([]bool, t.vocabSize)
	for s, id := range t.model.vocab {
		t.tokens[id], t.hasToken[id] = s, true
	}
	for _, a := range t.added.tokens {
		t.tokens[a.id], t.hasToken[a.id] = a.content, true
		if a.normalized && t.normalizer != nil {
			if n := t.normalizer.normalize(a.content); n != a.content {
				if t.decodeAs == nil {
					t.decodeAs = map[int]string{}
				}
				t.decodeAs[a.id] = n
			}
		}
	}
	t.eos = t.firstPresent("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
	t.bos = -1
	if len(t.specialPrefix) > 0 {
		t.bos = t.specialPrefix[0]
	} else {
		t.bos = t.firstPresent("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
	}
	sum := sha256.Sum256(t.json)
	t.hash = hex.EncodeToString(sum[:])
}

func (t *Tokenizer) firstPresent(names ...string) int {
	for _, n := range names {
		if id, ok := t.ids[n]; ok {
			return id
		}
	}
	return -1
}
