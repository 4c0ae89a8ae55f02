package hf

// The tokenizer files of a model directory: tokenizer.json, as the
// Hugging Face tokenizers library writes it, and tokenizer_config.json,
// which tells transformers' AutoTokenizer to load it as a
// PreTrainedTokenizerFast with its special tokens.

import (
	"encoding/json"

	"github.com/mktrain/mktrain/tokenizer"
)

// File names of a model directory's tokenizer.
const (
	TokenizerFile       = "tokenizer.json"
	TokenizerConfigFile = "tokenizer_config.json"
)

// Tokenizer is a model's tokenizer as a model directory holds it.
type Tokenizer struct {
	JSON []byte // tokenizer.json, written byte for byte
	// BOS and EOS are the tokens that begin and end a sequence, "" when the
	// tokenizer has none; BOSID and EOSID their ids.
	BOS, EOS     string
	BOSID, EOSID int
	// UNK is the model's unk_token, "" when it has none.
	UNK string
}

// TokenizerFor describes tok for a model directory.
func TokenizerFor(tok *tokenizer.Tokenizer) *Tokenizer {
	t := &Tokenizer{JSON: tok.JSON(), BOSID: -1, EOSID: -1}
	if id, ok := tok.BOS(); ok {
		t.BOS, _ = tok.Token(id)
		t.BOSID = id
	}
	if id, ok := tok.EOS(); ok {
		t.EOS, _ = tok.Token(id)
		t.EOSID = id
	}
	if id, ok := tok.UNK(); ok {
		t.UNK, _ = tok.Token(id)
	}
	return t
}

// tokenizerConfig is tokenizer_config.json.
type tokenizerConfig struct {
	TokenizerClass string  `json:"tokenizer_class"`
	BOSToken       *string `json:"bos_token"`
	EOSToken       *string `json:"eos_token"`
	UNKToken       *string `json:"unk_token"`
	PadToken       *string `json:"pad_token"`
	ModelMaxLength int     `json:"model_max_length"`
	// false: decode gives the text the tokenizer's decoder gives, as the
	// tokenizers library and mktrain do (transformers' clean-up would
	// remove spaces before punctuation).
	CleanUpTokenizationSpaces bool `json:"clean_up_tokenization_spaces"`
}

// TokenizerConfig is the tokenizer_config.json for t and a model of
// maxLength positions: tokenizer_class PreTrainedTokenizerFast (which reads
// tokenizer.json, post-processor and all), the bos, eos and unk tokens
// (null where there is none), no pad token, and model_max_length.
func TokenizerConfig(t *Tokenizer, maxLength int) ([]byte, error) {
	orNull := func(s string) *string {
		if s == "" {
			return nil
		}
		return &s
	}
	b, err := json.MarshalIndent(tokenizerConfig{
		TokenizerClass: "PreTrainedTokenizerFast",
		BOSToken:       orNull(t.BOS), EOSToken: orNull(t.EOS), UNKToken: orNull(t.UNK),
		ModelMaxLength: maxLength,
	}, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}
