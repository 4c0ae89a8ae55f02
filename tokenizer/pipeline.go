package tokenizer

import (
	"strings"
	"unicode"

	"golang.org/x/text/unicode/norm"
)

// The normalizers and pre-tokenizers this package runs; hfjson.go builds
// them from a tokenizer.json.

type normalizer interface {
	normalize(s string) string
}

type normalizerSequence []normalizer

func (q normalizerSequence) normalize(s string) string {
	for _, n := range q {
		s = n.normalize(s)
	}
	return s
}

// prependNormalizer puts its string before any non-empty piece (Llama 2's
// "▁").
type prependNormalizer string

func (p prependNormalizer) normalize(s string) string {
	if s == "" {
		return s
	}
	return string(p) + s
}

// replaceNormalizer replaces each match of its pattern with content.
type replaceNormalizer struct {
	pattern pattern
	content string
}

func (r replaceNormalizer) normalize(s string) string { return replaceAll(s, r.pattern, r.content) }

func replaceAll(s string, p pattern, content string) string {
	if lit, ok := p.(literalPattern); ok {
		if lit == "" {
			return s
		}
		return strings.ReplaceAll(s, string(lit), content)
	}
	var sb strings.Builder
	prev := 0
	for _, m := range p.matches(nil, s) {
		sb.WriteString(s[prev:m.start])
		sb.WriteString(content)
		prev = m.end
	}
	sb.WriteString(s[prev:])
	return sb.String()
}

type unicodeNormalizer struct{ form norm.Form }

func (u unicodeNormalizer) normalize(s string) string {
	if u.form.IsNormalString(s) {
		return s
	}
	return u.form.String(s)
}

type lowercaseNormalizer struct{}

func (lowercaseNormalizer) normalize(s string) string { return strings.ToLower(s) }

type stripNormalizer struct{ left, right bool }

func (n stripNormalizer) normalize(s string) string {
	if n.left {
		s = strings.TrimLeftFunc(s, unicode.IsSpace)
	}
	if n.right {
		s = strings.TrimRightFunc(s, unicode.IsSpace)
	}
	return s
}

// preTokenizer cuts a piece into words, appending them to dst.
type preTokenizer interface {
	split(st *encodeState, dst []piece, p piece) []piece
}

type preTokenizerSequence []preTokenizer

func (q preTokenizerSequence) split(st *encodeState, dst []piece, p piece) []piece {
	cur := append(st.next[:0], p)
	var next []piece
	for k, pt := range q {
		if k == len(q)-1 {
			for _, c := range cur {
				dst = pt.split(st, dst, c)
			}
			break
		}
		next = next[:0]
		for _, c := range cur {
			next = pt.split(st, next, c)
		}
		cur, next = next, cur
	}
	st.next = cur[:0]
	return dst
}

// byteLevelPreTokenizer is HF's ByteLevel: a space before each piece that
// does not start with one (add_prefix_space), then GPT-2's regex
// (use_regex). Its mapping of bytes to the byte alphabet is implicit: the
// model works on raw bytes.
type byteLevelPreTokenizer struct{ addPrefixSpace, useRegex bool }

func (b byteLevelPreTokenizer) split(st *encodeState, dst []piece, p piece) []piece {
	if b.addPrefixSpace && p.s[0] != ' ' {
		p.s = " " + p.s
	}
	if !b.useRegex {
		return append(dst, p)
	}
	return splitBy(st, dst, p, gpt2Pattern{}, behaviorIsolated, false)
}

// splitPreTokenizer is HF's Split.
type splitPreTokenizer struct {
	pattern  pattern
	behavior splitBehavior
	invert   bool
}

func (s splitPreTokenizer) split(st *encodeState, dst []piece, p piece) []piece {
	return splitBy(st, dst, p, s.pattern, s.behavior, s.invert)
}

// metaspacePreTokenizer is HF's Metaspace: spaces become the replacement
// ("▁"), one is put first per prepend_scheme, and with split each
// replacement begins a word.
type metaspacePreTokenizer struct {
	replacement string
	prepend     prependScheme
	split_      bool
}

type prependScheme int

const (
	prependAlways prependScheme = iota
	prependFirst
	prependNever
)

func (m metaspacePreTokenizer) split(st *encodeState, dst []piece, p piece) []piece {
	s := strings.ReplaceAll(p.s, " ", m.replacement)
	if !strings.HasPrefix(s, m.replacement) && (m.prepend == prependAlways || m.prepend == prependFirst && p.atStart) {
		s = m.replacement + s
	}
	if !m.split_ {
		return append(dst, piece{s, p.atStart})
	}
	start := 0
	for {
		k := strings.Index(s[start+1:], m.replacement)
		if k < 0 {
			break
		}
		end := start + 1 + k
		dst = append(dst, piece{s[start:end], p.atStart && start == 0})
		start = end
	}
	return append(dst, piece{s[start:], p.atStart && start == 0})
}

// digitsPreTokenizer is HF's Digits: runs of digits apart from the rest,
// or each digit alone.
type digitsPreTokenizer struct{ individual bool }

func (d digitsPreTokenizer) split(st *encodeState, dst []piece, p piece) []piece {
	b := behaviorContiguous
	if d.individual {
		b = behaviorIsolated
	}
	return splitBy(st, dst, p, runePattern(unicode.IsNumber), b, false)
}
