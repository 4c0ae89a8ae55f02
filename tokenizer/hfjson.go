package tokenizer

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// Reading a Hugging Face tokenizer.json into a Tokenizer. Each part's
// "type" picks its implementation; a type this package does not implement
// is refused with an error naming the field and the type.

type hfFile struct {
	AddedTokens   []hfAddedToken  `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Decoder       json.RawMessage `json:"decoder"`
	Model         json.RawMessage `json:"model"`
}

type hfAddedToken struct {
	ID         int    `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	Lstrip     bool   `json:"lstrip"`
	Rstrip     bool   `json:"rstrip"`
	Normalized *bool  `json:"normalized"`
	Special    bool   `json:"special"`
}

type hfModel struct {
	Type                    string          `json:"type"`
	Dropout                 *float64        `json:"dropout"`
	UnkToken                *string         `json:"unk_token"`
	ContinuingSubwordPrefix *string         `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string         `json:"end_of_word_suffix"`
	FuseUnk                 bool            `json:"fuse_unk"`
	ByteFallback            bool            `json:"byte_fallback"`
	IgnoreMerges            bool            `json:"ignore_merges"`
	Vocab                   json.RawMessage `json:"vocab"`
	Merges                  json.RawMessage `json:"merges"`
	MaxInputCharsPerWord    *int            `json:"max_input_chars_per_word"`
}

// hfPart is any normalizer, pre-tokenizer, decoder or post-processor; only
// the fields of its type are set.
type hfPart struct {
	Type string `json:"type"`
	// Sequences.
	Normalizers   []json.RawMessage `json:"normalizers"`
	PreTokenizers []json.RawMessage `json:"pretokenizers"`
	Decoders      []json.RawMessage `json:"decoders"`
	Processors    []json.RawMessage `json:"processors"`
	// Prepend, Replace, Strip, Split, Metaspace, ByteLevel, Digits, BPEDecoder.
	Prepend          string          `json:"prepend"`
	Pattern          *hfPattern      `json:"pattern"`
	Content          json.RawMessage `json:"content"`
	StripLeft        bool            `json:"strip_left"`
	StripRight       bool            `json:"strip_right"`
	Start            int             `json:"start"`
	Stop             int             `json:"stop"`
	Behavior         string          `json:"behavior"`
	Invert           bool            `json:"invert"`
	Replacement      string          `json:"replacement"`
	PrependScheme    *string         `json:"prepend_scheme"`
	AddPrefixSpace   *bool           `json:"add_prefix_space"`
	Split            *bool           `json:"split"`
	UseRegex         *bool           `json:"use_regex"`
	IndividualDigits bool            `json:"individual_digits"`
	Suffix           string          `json:"suffix"`
	// Post-processors.
	Single        []map[string]hfTemplateItem `json:"single"`
	SpecialTokens map[string]struct {
		IDs []int `json:"ids"`
	} `json:"special_tokens"`
	Sep []json.RawMessage `json:"sep"`
	Cls []json.RawMessage `json:"cls"`
}

type hfTemplateItem struct {
	ID string `json:"id"`
}

type hfPattern struct {
	String *string `json:"String"`
	Regex  *string `json:"Regex"`
}

// parseHFJSON reads a tokenizer.json.
func parseHFJSON(data []byte, name string) (*Tokenizer, error) {
	fail := func(field, format string, args ...any) error {
		return fmt.Errorf("tokenizer %s: %s: %s", name, field, fmt.Sprintf(format, args...))
	}
	var f hfFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("tokenizer %s: not a tokenizer.json: %v", name, err)
	}
	if isNull(f.Model) {
		return nil, fail("model", "missing")
	}
	t := &Tokenizer{name: name, json: data}
	var err error
	if t.normalizer, err = parseNormalizer(f.Normalizer, "normalizer"); err != nil {
		return nil, fail("normalizer", "%v", err)
	}
	byteLevel := false
	if t.preTokenizer, byteLevel, err = parsePreTokenizer(f.PreTokenizer, true); err != nil {
		return nil, fail("pre_tokenizer", "%v", err)
	}
	if t.model, err = parseBPE(f.Model, byteLevel); err != nil {
		return nil, fail("model", "%v", err)
	}
	if t.decoder, err = parseDecoder(f.Decoder); err != nil {
		return nil, fail("decoder", "%v", err)
	}
	t.added = &addedVocab{}
	nextID := len(t.model.vocab)
	seen := map[string]int{}
	for i, a := range f.AddedTokens {
		if a.Content == "" {
			continue
		}
		if !utf8.ValidString(a.Content) {
			return nil, fail(fmt.Sprintf("added_tokens[%d].content", i), "not valid UTF-8")
		}
		if _, dup := seen[a.Content]; dup {
			continue
		}
		id, ok := t.model.vocab[a.Content]
		newID := int(id)
		if !ok { // HF gives a token outside the model's vocabulary the next free id
			newID = nextID
			nextID++
		}
		seen[a.Content] = newID
		normalized := !a.Special
		if a.Normalized != nil {
			normalized = *a.Normalized
		}
		t.added.tokens = append(t.added.tokens, addedToken{id: newID, content: a.Content, singleWord: a.SingleWord,
			lstrip: a.Lstrip, rstrip: a.Rstrip, normalized: normalized, special: a.Special})
	}
	t.added.build(func(s string) string {
		if t.normalizer == nil {
			return s
		}
		return t.normalizer.normalize(s)
	})
	ids := func(s string) (int, bool) {
		if id, ok := seen[s]; ok {
			return id, true
		}
		id, ok := t.model.vocab[s]
		return int(id), ok
	}
	if t.specialPrefix, t.specialSuffix, err = parsePostProcessor(f.PostProcessor, ids); err != nil {
		return nil, fail("post_processor", "%v", err)
	}
	t.finish()
	return t, nil
}

func isNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || string(raw) == "null"
}

func parsePart(raw json.RawMessage) (*hfPart, error) {
	var p hfPart
	if err := json.Unmarshal(raw, &p); err != nil {
		return nil, err
	}
	return &p, nil
}

func parsePattern(p *hfPattern) (pattern, error) {
	switch {
	case p == nil:
		return nil, fmt.Errorf("pattern missing")
	case p.String != nil:
		return literalPattern(*p.String), nil
	case p.Regex != nil:
		return compileRegex(*p.Regex)
	}
	return nil, fmt.Errorf("pattern is neither String nor Regex")
}

func parseNormalizer(raw json.RawMessage, field string) (normalizer, error) {
	if isNull(raw) {
		return nil, nil
	}
	p, err := parsePart(raw)
	if err != nil {
		return nil, err
	}
	switch p.Type {
	case "Sequence":
		var seq normalizerSequence
		for i, r := range p.Normalizers {
			n, err := parseNormalizer(r, fmt.Sprintf("normalizers[%d]", i))
			if err != nil {
				return nil, fmt.Errorf("normalizers[%d]: %w", i, err)
			}
			if n != nil {
				seq = append(seq, n)
			}
		}
		return seq, nil
	case "Prepend":
		return prependNormalizer(p.Prepend), nil
	case "Replace":
		pat, err := parsePattern(p.Pattern)
		if err != nil {
			return nil, err
		}
		var content string
		if err := json.Unmarshal(p.Content, &content); err != nil {
			return nil, fmt.Errorf("Replace content: %v", err)
		}
		return replaceNormalizer{pat, content}, nil
	case "NFC":
		return unicodeNormalizer{norm.NFC}, nil
	case "NFD":
		return unicodeNormalizer{norm.NFD}, nil
	case "NFKC":
		return unicodeNormalizer{norm.NFKC}, nil
	case "NFKD":
		return unicodeNormalizer{norm.NFKD}, nil
	case "Lowercase":
		return lowercaseNormalizer{}, nil
	case "Strip":
		return stripNormalizer{p.StripLeft, p.StripRight}, nil
	}
	return nil, fmt.Errorf("type %q is not supported (supported: Sequence, Prepend, Replace, NFC, NFD, NFKC, NFKD, Lowercase, Strip)", p.Type)
}

// parsePreTokenizer also says whether the model sees byte-level text (a
// ByteLevel step, which must come last: the steps after it would see the
// byte alphabet, which this package does not build).
func parsePreTokenizer(raw json.RawMessage, last bool) (preTokenizer, bool, error) {
	if isNull(raw) {
		return nil, false, nil
	}
	p, err := parsePart(raw)
	if err != nil {
		return nil, false, err
	}
	switch p.Type {
	case "Sequence":
		var seq preTokenizerSequence
		byteLevel := false
		for i, r := range p.PreTokenizers {
			pt, bl, err := parsePreTokenizer(r, last && i == len(p.PreTokenizers)-1)
			if err != nil {
				return nil, false, fmt.Errorf("pretokenizers[%d]: %w", i, err)
			}
			byteLevel = byteLevel || bl
			if pt != nil {
				seq = append(seq, pt)
			}
		}
		switch len(seq) {
		case 0:
			return nil, byteLevel, nil
		case 1:
			return seq[0], byteLevel, nil
		}
		return seq, byteLevel, nil
	case "ByteLevel":
		if !last {
			return nil, false, fmt.Errorf("ByteLevel must be the last pre-tokenizer")
		}
		b := byteLevelPreTokenizer{addPrefixSpace: p.AddPrefixSpace == nil || *p.AddPrefixSpace, useRegex: p.UseRegex == nil || *p.UseRegex}
		if !b.addPrefixSpace && !b.useRegex {
			return nil, true, nil // only the byte mapping, which the model does
		}
		return b, true, nil
	case "Split":
		pat, err := parsePattern(p.Pattern)
		if err != nil {
			return nil, false, err
		}
		b, ok := splitBehaviors[p.Behavior]
		if !ok {
			return nil, false, fmt.Errorf("Split behavior %q is not one of Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous", p.Behavior)
		}
		return splitPreTokenizer{pat, b, p.Invert}, false, nil
	case "Metaspace":
		m, err := parseMetaspace(p)
		if err != nil {
			return nil, false, err
		}
		return m, false, nil
	case "Digits":
		return digitsPreTokenizer{p.IndividualDigits}, false, nil
	}
	return nil, false, fmt.Errorf("type %q is not supported (supported: Sequence, ByteLevel, Split, Metaspace, Digits)", p.Type)
}

func parseMetaspace(p *hfPart) (metaspacePreTokenizer, error) {
	m := metaspacePreTokenizer{replacement: p.Replacement, prepend: prependAlways, split_: p.Split == nil || *p.Split}
	if utf8.RuneCountInString(p.Replacement) != 1 {
		return m, fmt.Errorf("Metaspace replacement %q is not one character", p.Replacement)
	}
	if p.PrependScheme != nil {
		switch *p.PrependScheme {
		case "always":
		case "first":
			m.prepend = prependFirst
		case "never":
			m.prepend = prependNever
		default:
			return m, fmt.Errorf("Metaspace prepend_scheme %q is not one of always, first, never", *p.PrependScheme)
		}
	}
	if p.AddPrefixSpace != nil && !*p.AddPrefixSpace {
		if m.prepend != prependNever && p.PrependScheme != nil {
			return m, fmt.Errorf("Metaspace add_prefix_space false does not match prepend_scheme %q", *p.PrependScheme)
		}
		m.prepend = prependNever
	}
	return m, nil
}

func parseDecoder(raw json.RawMessage) (decoder, error) {
	if isNull(raw) {
		return nil, nil
	}
	p, err := parsePart(raw)
	if err != nil {
		return nil, err
	}
	switch p.Type {
	case "Sequence":
		var seq decoderSequence
		for i, r := range p.Decoders {
			d, err := parseDecoder(r)
			if err != nil {
				return nil, fmt.Errorf("decoders[%d]: %w", i, err)
			}
			if d != nil {
				seq = append(seq, d)
			}
		}
		return seq, nil
	case "ByteLevel":
		return byteLevelDecoder{}, nil
	case "Metaspace":
		m, err := parseMetaspace(p)
		if err != nil {
			return nil, err
		}
		return metaspaceDecoder{m.replacement, m.prepend}, nil
	case "Replace":
		pat, err := parsePattern(p.Pattern)
		if err != nil {
			return nil, err
		}
		var content string
		if err := json.Unmarshal(p.Content, &content); err != nil {
			return nil, fmt.Errorf("Replace content: %v", err)
		}
		return replaceDecoder{pat, content}, nil
	case "ByteFallback":
		return byteFallbackDecoder{}, nil
	case "Fuse":
		return fuseDecoder{}, nil
	case "Strip":
		var content string
		if err := json.Unmarshal(p.Content, &content); err != nil || utf8.RuneCountInString(content) != 1 {
			return nil, fmt.Errorf("Strip content %s is not one character", p.Content)
		}
		r, _ := utf8.DecodeRuneInString(content)
		return stripDecoder{r, p.Start, p.Stop}, nil
	case "BPEDecoder":
		return bpeDecoder{p.Suffix}, nil
	}
	return nil, fmt.Errorf("type %q is not supported (supported: Sequence, ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, BPEDecoder)", p.Type)
}

// parsePostProcessor gives the ids put before and after a single sequence
// when special tokens are added.
func parsePostProcessor(raw json.RawMessage, ids func(string) (int, bool)) (prefix, suffix []int, err error) {
	if isNull(raw) {
		return nil, nil, nil
	}
	p, err := parsePart(raw)
	if err != nil {
		return nil, nil, err
	}
	switch p.Type {
	case "Sequence":
		for i, r := range p.Processors {
			pre, suf, err := parsePostProcessor(r, ids)
			if err != nil {
				return nil, nil, fmt.Errorf("processors[%d]: %w", i, err)
			}
			prefix = append(pre, prefix...)
			suffix = append(suffix, suf...)
		}
		return prefix, suffix, nil
	case "ByteLevel":
		return nil, nil, nil
	case "TemplateProcessing":
		seenSequence := false
		for i, item := range p.Single {
			if _, ok := item["Sequence"]; ok {
				seenSequence = true
				continue
			}
			sp, ok := item["SpecialToken"]
			if !ok {
				return nil, nil, fmt.Errorf("single[%d] is neither SpecialToken nor Sequence", i)
			}
			tok, ok := p.SpecialTokens[sp.ID]
			if !ok {
				return nil, nil, fmt.Errorf("single[%d]: special token %q is not in special_tokens", i, sp.ID)
			}
			if seenSequence {
				suffix = append(suffix, tok.IDs...)
			} else {
				prefix = append(prefix, tok.IDs...)
			}
		}
		return prefix, suffix, nil
	case "RobertaProcessing", "BertProcessing":
		cls, err := processorToken(p.Cls, ids)
		if err != nil {
			return nil, nil, fmt.Errorf("cls: %w", err)
		}
		sep, err := processorToken(p.Sep, ids)
		if err != nil {
			return nil, nil, fmt.Errorf("sep: %w", err)
		}
		return []int{cls}, []int{sep}, nil
	}
	return nil, nil, fmt.Errorf("type %q is not supported (supported: Sequence, ByteLevel, TemplateProcessing, RobertaProcessing, BertProcessing)", p.Type)
}

// processorToken reads a ["<s>", 0] pair.
func processorToken(pair []json.RawMessage, ids func(string) (int, bool)) (int, error) {
	var s string
	var id int
	if len(pair) != 2 || json.Unmarshal(pair[0], &s) != nil || json.Unmarshal(pair[1], &id) != nil {
		return 0, fmt.Errorf("not a [token, id] pair")
	}
	return id, nil
}

// parseBPE reads the model; byteLevel says the pre-tokenizer maps bytes to
// the byte alphabet.
func parseBPE(raw json.RawMessage, byteLevel bool) (*bpeModel, error) {
	var hm hfModel
	if err := json.Unmarshal(raw, &hm); err != nil {
		return nil, err
	}
	typ := hm.Type
	if typ == "" { // old files leave the type to be guessed from the fields, as HF does
		switch {
		case !isNull(hm.Merges):
			typ = "BPE"
		case bytes.HasPrefix(bytes.TrimSpace(hm.Vocab), []byte("[")):
			typ = "Unigram"
		case hm.MaxInputCharsPerWord != nil:
			typ = "WordPiece"
		default:
			typ = "WordLevel"
		}
	}
	if typ != "BPE" {
		return nil, fmt.Errorf("model type %s is not supported: this package implements BPE only", typ)
	}
	if hm.Dropout != nil && *hm.Dropout != 0 {
		return nil, fmt.Errorf("dropout %g is not supported (BPE dropout is for training; set it to null)", *hm.Dropout)
	}
	m := &bpeModel{byteLevel: byteLevel, ignoreMerges: hm.IgnoreMerges, fuseUnk: hm.FuseUnk, byteFallback: hm.ByteFallback, unk: -1}
	if err := json.Unmarshal(hm.Vocab, &m.vocab); err != nil {
		return nil, fmt.Errorf("vocab: %v", err)
	}
	if hm.ContinuingSubwordPrefix != nil {
		m.prefix = *hm.ContinuingSubwordPrefix
	}
	if hm.EndOfWordSuffix != nil {
		m.suffix = *hm.EndOfWordSuffix
	}
	if hm.UnkToken != nil {
		id, ok := m.vocab[*hm.UnkToken]
		if !ok {
			return nil, fmt.Errorf("unk_token %q is not in the vocab", *hm.UnkToken)
		}
		m.unk = id
	}
	var merges []json.RawMessage
	if err := json.Unmarshal(hm.Merges, &merges); err != nil {
		return nil, fmt.Errorf("merges: %v", err)
	}
	m.merges = newPairTable(len(merges))
	for rank, r := range merges {
		var a, b string
		var pair []string
		var line string
		if json.Unmarshal(r, &line) == nil {
			var ok bool
			if a, b, ok = strings.Cut(line, " "); !ok {
				return nil, fmt.Errorf("merges[%d] %q is not two tokens separated by a space", rank, line)
			}
		} else if json.Unmarshal(r, &pair) == nil && len(pair) == 2 {
			a, b = pair[0], pair[1]
		} else {
			return nil, fmt.Errorf("merges[%d] is neither \"a b\" nor [\"a\", \"b\"]", rank)
		}
		ida, oka := m.vocab[a]
		idb, okb := m.vocab[b]
		merged := a + strings.TrimPrefix(b, m.prefix)
		idm, okm := m.vocab[merged]
		switch {
		case !oka:
			return nil, fmt.Errorf("merges[%d]: %q is not in the vocab", rank, a)
		case !okb:
			return nil, fmt.Errorf("merges[%d]: %q is not in the vocab", rank, b)
		case !okm:
			return nil, fmt.Errorf("merges[%d]: the merged %q is not in the vocab", rank, merged)
		}
		m.merges.set(pairKey(ida, idb), uint64(rank)<<32|uint64(uint32(idm)))
	}
	m.index()
	return m, nil
}

// index fills the lookup tables the encoder uses from vocab.
func (m *bpeModel) index() {
	for b := range m.byteIDs {
		m.byteIDs[b] = -1
		m.fallbackIDs[b] = -1
		if id, ok := m.vocab[fallbackToken(byte(b))]; ok {
			m.fallbackIDs[b] = id
		}
		if m.byteLevel {
			if id, ok := m.vocab[string(byteLevelChar[b])]; ok {
				m.byteIDs[b] = id
			}
		}
	}
	m.runeIDs = make(map[rune]int32)
	for s, id := range m.vocab {
		if r, w := utf8.DecodeRuneInString(s); w == len(s) && (r != utf8.RuneError || w > 1) {
			m.runeIDs[r] = id
		}
	}
	if m.ignoreMerges {
		if m.byteLevel {
			m.wordIDs = make(map[string]int32, len(m.vocab))
			for s, id := range m.vocab {
				if raw, ok := fromByteAlphabet(s); ok {
					m.wordIDs[string(raw)] = id
				}
			}
		} else {
			m.wordIDs = m.vocab
		}
	}
	m.cache = newWordCache(1 << 16)
}
