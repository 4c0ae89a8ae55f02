package tokenizer

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// tiktoken rank files (cl100k_base.tiktoken, o200k_base.tiktoken): one
// "<base64 token> <rank>" per line; the rank is the id. tiktoken merges the
// adjacent pair whose concatenation has the lowest rank, and a piece that is
// itself a token is that token: the BPE model here with every split of a
// token as a merge ranked by the token, and ignore_merges.

// TiktokenOptions says how to read a rank file; the zero value picks by
// the file name.
type TiktokenOptions struct {
	// Pattern is "cl100k", "o200k" or a regex; empty: o200k if the file
	// name contains "o200k", else cl100k.
	Pattern string
	// SpecialTokens maps each special token to its id; nil: cl100k_base's
	// or o200k_base's when the file is one of those (by name and size),
	// else <|endoftext|> after the last rank.
	SpecialTokens map[string]int
}

var (
	cl100kSpecial = map[string]int{"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259, "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}
	o200kSpecial  = map[string]int{"<|endoftext|>": 199999, "<|endofprompt|>": 200018}
)

// looksLikeTiktoken says whether data is a rank file rather than JSON.
func looksLikeTiktoken(data []byte, name string) bool {
	if strings.HasSuffix(name, ".tiktoken") {
		return true
	}
	line, _, _ := bytes.Cut(data, []byte("\n"))
	fields := bytes.Fields(line)
	if len(fields) != 2 {
		return false
	}
	_, err1 := base64.StdEncoding.DecodeString(string(fields[0]))
	_, err2 := strconv.Atoi(string(fields[1]))
	return err1 == nil && err2 == nil
}

// ParseTiktoken reads a tiktoken rank file.
func ParseTiktoken(data []byte, name string, opt TiktokenOptions) (*Tokenizer, error) {
	fail := func(format string, args ...any) error {
		return fmt.Errorf("tokenizer %s: %s", name, fmt.Sprintf(format, args...))
	}
	ranks := map[string]int32{}
	var byRank []string
	for n, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		tok, rankText, ok := strings.Cut(line, " ")
		raw, err := base64.StdEncoding.DecodeString(tok)
		if !ok || err != nil {
			return nil, fail("line %d: not \"<base64 token> <rank>\"", n+1)
		}
		rank, err := strconv.Atoi(rankText)
		if err != nil || rank < 0 || rank > 1<<31-2 {
			return nil, fail("line %d: rank %q is not a non-negative integer", n+1, rankText)
		}
		if _, dup := ranks[string(raw)]; dup {
			return nil, fail("line %d: token %q appears twice", n+1, tok)
		}
		ranks[string(raw)] = int32(rank)
		for len(byRank) <= rank {
			byRank = append(byRank, "")
		}
		byRank[rank] = string(raw)
	}
	for b := 0; b < 256; b++ {
		if _, ok := ranks[string([]byte{byte(b)})]; !ok {
			return nil, fail("the single byte 0x%02X has no rank (every byte must be a token)", b)
		}
	}
	base := strings.ToLower(filepath.Base(name))
	patternName := opt.Pattern
	if patternName == "" {
		patternName = "cl100k"
		if strings.Contains(base, "o200k") {
			patternName = "o200k"
		}
	}
	regex := patternName
	switch patternName {
	case "cl100k":
		regex = cl100kRegex
	case "o200k":
		regex = o200kRegex
	}
	pat, err := compileRegex(regex)
	if err != nil {
		return nil, fail("pattern: %v", err)
	}
	special := opt.SpecialTokens
	if special == nil {
		switch {
		case strings.Contains(base, "cl100k") && len(ranks) == 100256:
			special = cl100kSpecial
		case strings.Contains(base, "o200k") && len(ranks) == 199998:
			special = o200kSpecial
		default:
			special = map[string]int{"<|endoftext|>": len(byRank)}
		}
	}

	m := &bpeModel{byteLevel: true, ignoreMerges: true, unk: -1, vocab: make(map[string]int32, len(ranks)), merges: newPairTable(len(ranks))}
	for raw, rank := range ranks {
		m.vocab[toByteAlphabet(raw)] = rank
	}
	var merges []tiktokenMerge
	for raw, rank := range ranks {
		for k := 1; k < len(raw); k++ {
			l, okl := ranks[raw[:k]]
			r, okr := ranks[raw[k:]]
			if okl && okr {
				m.merges.set(pairKey(l, r), uint64(rank)<<32|uint64(rank))
				merges = append(merges, tiktokenMerge{l, r, rank})
			}
		}
	}
	m.index()
	t := &Tokenizer{name: name, model: m, decoder: byteLevelDecoder{},
		preTokenizer: splitPreTokenizer{pat, behaviorIsolated, false}, added: &addedVocab{}}
	for content, id := range special {
		if _, clash := m.vocab[toByteAlphabet(content)]; clash && ranks[content] != int32(id) {
			return nil, fail("special token %q is also an ordinary token", content)
		}
		t.added.tokens = append(t.added.tokens, addedToken{id: id, content: content, special: true})
	}
	t.added.build(func(s string) string { return s })

	slices.SortFunc(merges, func(a, b tiktokenMerge) int {
		if a.merged != b.merged {
			return int(a.merged - b.merged)
		}
		if a.left != b.left {
			return int(a.left - b.left)
		}
		return int(a.right - b.right)
	})
	t.json = tiktokenJSON(byRank, mergeStrings(merges, byRank), t.added.tokens, regex)
	t.finish()
	return t, nil
}

// tiktokenMerge is a merge of two ranks into a third.
type tiktokenMerge struct{ left, right, merged int32 }

func mergeStrings(merges []tiktokenMerge, byRank []string) [][2]string {
	out := make([][2]string, len(merges))
	for i, mg := range merges {
		out[i] = [2]string{toByteAlphabet(byRank[mg.left]), toByteAlphabet(byRank[mg.right])}
	}
	return out
}

// tiktokenJSON writes the equivalent tokenizer.json: the regex Split, a
// ByteLevel step without its own regex, a BPE model with ignore_merges,
// and the special tokens as added tokens.
func tiktokenJSON(byRank []string, merges [][2]string, special []addedToken, regex string) []byte {
	var b bytes.Buffer
	str := func(s string) {
		var sb bytes.Buffer
		enc := json.NewEncoder(&sb)
		enc.SetEscapeHTML(false)
		_ = enc.Encode(s) // a string always encodes
		b.Write(bytes.TrimRight(sb.Bytes(), "\n"))
	}
	b.WriteString("{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n  \"added_tokens\": [")
	for i, a := range special {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, "\n    {\"id\": %d, \"content\": ", a.id)
		str(a.content)
		b.WriteString(", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}")
	}
	b.WriteString("\n  ],\n  \"normalizer\": null,\n  \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": ")
	str(regex)
	b.WriteString("}, \"behavior\": \"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": false}]},\n")
	b.WriteString("  \"post_processor\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": false, \"use_regex\": true},\n")
	b.WriteString("  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": true, \"use_regex\": true},\n")
	b.WriteString("  \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, \"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, \"fuse_unk\": false, \"byte_fallback\": false, \"ignore_merges\": true,\n    \"vocab\": {")
	first := true
	for rank, raw := range byRank {
		if raw == "" && rank > 0 {
			continue // a gap in the ranks
		}
		if !first {
			b.WriteString(",")
		}
		first = false
		b.WriteString("\n      ")
		str(toByteAlphabet(raw))
		fmt.Fprintf(&b, ": %d", rank)
	}
	b.WriteString("\n    },\n    \"merges\": [")
	for i, mg := range merges {
		if i > 0 {
			b.WriteString(",")
		}
		b.WriteString("\n      [")
		str(mg[0])
		b.WriteString(", ")
		str(mg[1])
		b.WriteString("]")
	}
	b.WriteString("\n    ]\n  }\n}\n")
	return b.Bytes()
}

// applyConfig reads eos_token and bos_token from a tokenizer_config.json.
func (t *Tokenizer) applyConfig(raw []byte, path string) error {
	var cfg map[string]json.RawMessage
	if err := json.Unmarshal(raw, &cfg); err != nil {
		return fmt.Errorf("tokenizer config %s: %v", path, err)
	}
	for _, field := range []struct {
		key string
		id  *int
	}{{"eos_token", &t.eos}, {"bos_token", &t.bos}} {
		v, ok := cfg[field.key]
		if !ok || isNull(v) {
			continue
		}
		var s string
		if json.Unmarshal(v, &s) != nil {
			var obj struct {
				Content string `json:"content"`
			}
			if err := json.Unmarshal(v, &obj); err != nil || obj.Content == "" {
				return fmt.Errorf("tokenizer config %s: %s is neither a string nor {\"content\": ...}", path, field.key)
			}
			s = obj.Content
		}
		id, ok := t.ids[s]
		if !ok {
			return fmt.Errorf("tokenizer config %s: %s %q is not a token of %s", path, field.key, s, t.name)
		}
		*field.id = id
	}
	return nil
}
