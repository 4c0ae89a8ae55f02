package tokenizer

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/dlclark/regexp2/v2"
)

// The Split pre-tokenizer's patterns. The three regexes that byte-level
// tokenizers use (GPT-2's, cl100k's which Llama 3 and Qwen 2 carry, and
// o200k's) have hand-written matchers below, several times faster than a
// backtracking engine; any other regex goes to regexp2, whose .NET
// semantics (leftmost-first alternation, lookaround) are Oniguruma's for
// these patterns. split_test.go fuzzes each matcher against regexp2.

type span struct{ start, end int }

// pattern finds the non-overlapping matches in a string, leftmost first.
type pattern interface {
	matches(dst []span, s string) []span
}

// tilingPattern is a pattern that matches at every position, so that its
// matches cover the whole string: next gives the end of the match at i.
type tilingPattern interface {
	pattern
	next(s string, i int) int
}

// The regexes as tokenizer.json files spell them.
const (
	gpt2Regex   = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
	cl100kRegex = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	o200kRegex  = `[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+`
)

// knownPatterns maps the spellings of the known regexes to their matchers.
var knownPatterns = map[string]tilingPattern{
	gpt2Regex:   gpt2Pattern{},
	cl100kRegex: cl100kPattern{maxDigits: 3},
	// Qwen 2 and 2.5: cl100k with single digits.
	`(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`: cl100kPattern{maxDigits: 1},
	// tiktoken's current cl100k spelling, with possessive quantifiers that do not change its matches.
	`'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+`: cl100kPattern{maxDigits: 3},
	o200kRegex: o200kPattern{},
}

// compileRegex returns the matcher for a Split regex: hand-written for the
// known ones, regexp2 for the rest.
func compileRegex(expr string) (pattern, error) {
	if p, ok := knownPatterns[expr]; ok {
		return p, nil
	}
	re, err := regexp2.Compile(expr)
	if err != nil {
		return nil, fmt.Errorf("regex %q: %v", expr, err)
	}
	return regexPattern{re}, nil
}

func tile(dst []span, s string, p tilingPattern) []span {
	for i := 0; i < len(s); {
		j := p.next(s, i)
		dst = append(dst, span{i, j})
		i = j
	}
	return dst
}

// regexPattern is any other regex, through regexp2.
type regexPattern struct{ re *regexp2.Regexp }

func (p regexPattern) matches(dst []span, s string) []span {
	idx, err := p.re.FindAllStringIndex(s, -1)
	if err != nil { // only a match timeout, and none is set
		return dst
	}
	for _, m := range idx {
		dst = append(dst, span{m[0], m[1]})
	}
	return dst
}

// literalPattern is a Split or Replace pattern given as a string.
type literalPattern string

func (p literalPattern) matches(dst []span, s string) []span {
	if p == "" {
		return dst
	}
	for i := 0; ; {
		j := strings.Index(s[i:], string(p))
		if j < 0 {
			return dst
		}
		dst = append(dst, span{i + j, i + j + len(p)})
		i += j + len(p)
	}
}

// runePattern matches each character for which the predicate holds.
type runePattern func(rune) bool

func (p runePattern) matches(dst []span, s string) []span {
	for i, r := range s {
		if p(r) {
			dst = append(dst, span{i, i + utf8.RuneLen(r)})
		}
	}
	return dst
}

// Character classes as the regexes use them.

func isLetter(r rune) bool {
	if r < utf8.RuneSelf {
		return 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z'
	}
	return unicode.IsLetter(r)
}

func isNumber(r rune) bool {
	if r < utf8.RuneSelf {
		return '0' <= r && r <= '9'
	}
	return unicode.IsNumber(r)
}

// isSpace is \s: Unicode White_Space.
func isSpace(r rune) bool {
	if r < utf8.RuneSelf {
		return r == ' ' || '\t' <= r && r <= '\r'
	}
	return unicode.IsSpace(r)
}

func isNewline(r rune) bool { return r == '\r' || r == '\n' }

// isOther is [^\s\p{L}\p{N}].
func isOther(r rune) bool { return !isSpace(r) && !isLetter(r) && !isNumber(r) }

// decodeAt is the rune at i and its width; an invalid byte is U+FFFD of
// width 1, a symbol (so "other"), as regexp2 sees it.
func decodeAt(s string, i int) (rune, int) {
	if c := s[i]; c < utf8.RuneSelf {
		return rune(c), 1
	}
	return utf8.DecodeRuneInString(s[i:])
}

func runWhile(s string, i int, in func(rune) bool) int {
	for i < len(s) {
		r, w := decodeAt(s, i)
		if !in(r) {
			break
		}
		i += w
	}
	return i
}

// whitespaceEnd matches `\s+(?!\S)|\s+` at i, where s[i] is whitespace:
// a run of whitespace, less its last character when a non-space follows.
func whitespaceEnd(s string, i int) int {
	end, last := i, i
	for end < len(s) {
		r, w := decodeAt(s, end)
		if !isSpace(r) {
			break
		}
		last = end
		end += w
	}
	if end == len(s) || last == i {
		return end
	}
	return last
}

// newlineWhitespaceEnd matches `\s*[\r\n]+` then `\s+(?!\S)|\s+` at i,
// where s[i] is whitespace: through the run's last newline if it has one.
func newlineWhitespaceEnd(s string, i int) int {
	end, lastNewline := i, -1
	for end < len(s) {
		r, w := decodeAt(s, end)
		if !isSpace(r) {
			break
		}
		if isNewline(r) {
			lastNewline = end
		}
		end += w
	}
	if lastNewline >= 0 {
		return lastNewline + 1
	}
	return whitespaceEnd(s, i)
}

// gpt2Pattern: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
type gpt2Pattern struct{}

func (p gpt2Pattern) matches(dst []span, s string) []span { return tile(dst, s, p) }

func (gpt2Pattern) next(s string, i int) int {
	c, w := decodeAt(s, i)
	if c == '\'' {
		if n := contraction(s, i+1, false); n > 0 {
			return i + 1 + n
		}
	}
	j, r := i, c
	if c == ' ' && i+1 < len(s) {
		r, _ = decodeAt(s, i+1)
		if !isSpace(r) {
			j = i + 1
		} else {
			r = c
		}
	}
	switch {
	case isLetter(r):
		return runWhile(s, j, isLetter)
	case isNumber(r):
		return runWhile(s, j, isNumber)
	case !isSpace(r):
		return runWhile(s, j, isOther)
	}
	_ = w
	return whitespaceEnd(s, i)
}

// contraction matches s|t|re|ve|m|ll|d at i (after an apostrophe), case
// folded when fold (as Oniguruma's (?i), where ſ, U+017F, is an s); it
// returns the length matched or 0.
func contraction(s string, i int, fold bool) int {
	if fold && strings.HasPrefix(s[i:], "ſ") {
		return len("ſ")
	}
	at := func(k int) byte {
		if i+k >= len(s) {
			return 0
		}
		b := s[i+k]
		if fold && 'A' <= b && b <= 'Z' {
			b += 'a' - 'A'
		}
		return b
	}
	switch at(0) {
	case 's', 't', 'm', 'd':
		return 1
	case 'r', 'v':
		if at(1) == 'e' {
			return 2
		}
	case 'l':
		if at(1) == 'l' {
			return 2
		}
	}
	return 0
}

// cl100kPattern: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// (maxDigits 1: Qwen's \p{N} in place of \p{N}{1,3}).
type cl100kPattern struct{ maxDigits int }

func (p cl100kPattern) matches(dst []span, s string) []span { return tile(dst, s, p) }

func (p cl100kPattern) next(s string, i int) int {
	c, w := decodeAt(s, i)
	if c == '\'' {
		if n := contraction(s, i+1, true); n > 0 {
			return i + 1 + n
		}
	}
	if isLetter(c) {
		return runWhile(s, i+w, isLetter)
	}
	if !isNewline(c) && !isNumber(c) && i+w < len(s) {
		if r, _ := decodeAt(s, i+w); isLetter(r) {
			return runWhile(s, i+w, isLetter)
		}
	}
	if isNumber(c) {
		j := i + w
		for k := 1; k < p.maxDigits && j < len(s); k++ {
			r, rw := decodeAt(s, j)
			if !isNumber(r) {
				break
			}
			j += rw
		}
		return j
	}
	if j, ok := otherRun(s, i, c, w, isNewline); ok {
		return j
	}
	return newlineWhitespaceEnd(s, i)
}

// otherRun matches ` ?[^\s\p{L}\p{N}]+` then trailing characters for which
// tail holds, at i where the rune is c of width w.
func otherRun(s string, i int, c rune, w int, tail func(rune) bool) (int, bool) {
	j := i
	if c == ' ' && i+1 < len(s) {
		if r, _ := decodeAt(s, i+1); isOther(r) {
			j = i + 1
		}
	}
	if j == i && !isOther(c) {
		return 0, false
	}
	j = runWhile(s, j, isOther)
	return runWhile(s, j, tail), true
}

// o200kPattern: tiktoken's o200k_base, with its case-aware letter runs.
type o200kPattern struct{}

func (p o200kPattern) matches(dst []span, s string) []span { return tile(dst, s, p) }

// isUpperish is [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}], isLowerish [\p{Ll}\p{Lm}\p{Lo}\p{M}].
func isUpperish(r rune) bool {
	if r < utf8.RuneSelf {
		return 'A' <= r && r <= 'Z'
	}
	return unicode.In(r, unicode.Lu, unicode.Lt, unicode.Lm, unicode.Lo, unicode.M)
}

func isLowerish(r rune) bool {
	if r < utf8.RuneSelf {
		return 'a' <= r && r <= 'z'
	}
	return unicode.In(r, unicode.Ll, unicode.Lm, unicode.Lo, unicode.M)
}

func (o200kPattern) next(s string, i int) int {
	c, w := decodeAt(s, i)
	prefixOK := !isNewline(c) && !isLetter(c) && !isNumber(c) && i+w < len(s)
	// [^\r\n\p{L}\p{N}]?[upper]*[lower]+(contraction)?, with the prefix, then without.
	if prefixOK {
		if j := upperLower(s, i+w); j > 0 {
			return withContraction(s, j)
		}
	}
	if j := upperLower(s, i); j > 0 {
		return withContraction(s, j)
	}
	// [^\r\n\p{L}\p{N}]?[upper]+[lower]*(contraction)?
	if prefixOK {
		if j := runWhile(s, i+w, isUpperish); j > i+w {
			return withContraction(s, runWhile(s, j, isLowerish))
		}
	}
	if j := runWhile(s, i, isUpperish); j > i {
		return withContraction(s, runWhile(s, j, isLowerish))
	}
	if isNumber(c) {
		j := i + w
		for k := 1; k < 3 && j < len(s); k++ {
			r, rw := decodeAt(s, j)
			if !isNumber(r) {
				break
			}
			j += rw
		}
		return j
	}
	if j, ok := otherRun(s, i, c, w, func(r rune) bool { return isNewline(r) || r == '/' }); ok {
		return j
	}
	return newlineWhitespaceEnd(s, i)
}

// upperLower matches [upper]*[lower]+ at p, backtracking as a regex engine
// would; it returns the end, or 0 when there is no match.
func upperLower(s string, p int) int {
	e := p
	lastLower := -1 // end of the last lowerish character inside the upper run
	for e < len(s) {
		r, w := decodeAt(s, e)
		if !isUpperish(r) {
			break
		}
		e += w
		if isLowerish(r) {
			lastLower = e
		}
	}
	if e < len(s) {
		if r, _ := decodeAt(s, e); isLowerish(r) {
			return runWhile(s, e, isLowerish)
		}
	}
	if lastLower > 0 {
		return lastLower
	}
	return 0
}

func withContraction(s string, j int) int {
	if j < len(s) && s[j] == '\'' {
		if n := contraction(s, j+1, true); n > 0 {
			return j + 1 + n
		}
	}
	return j
}

// splitBehavior is how a Split pre-tokenizer treats its matches.
type splitBehavior int

const (
	behaviorRemoved splitBehavior = iota
	behaviorIsolated
	behaviorMergedWithPrevious
	behaviorMergedWithNext
	behaviorContiguous
)

var splitBehaviors = map[string]splitBehavior{
	"Removed": behaviorRemoved, "Isolated": behaviorIsolated, "MergedWithPrevious": behaviorMergedWithPrevious,
	"MergedWithNext": behaviorMergedWithNext, "Contiguous": behaviorContiguous,
}

// splitBy cuts s as HF's NormalizedString::split does: the matches of p
// (inverted: the text between them) treated by behavior; empty pieces are
// dropped.
func splitBy(st *encodeState, dst []piece, p piece, pat pattern, behavior splitBehavior, invert bool) []piece {
	s := p.s
	if tp, ok := pat.(tilingPattern); ok && behavior == behaviorIsolated && !invert {
		for i := 0; i < len(s); {
			j := tp.next(s, i)
			dst = append(dst, piece{s[i:j], p.atStart && i == 0})
			i = j
		}
		return dst
	}
	st.spans = pat.matches(st.spans[:0], s)
	type part struct {
		span
		match bool
	}
	var parts []part
	prev := 0
	for _, m := range st.spans {
		if m.start > prev {
			parts = append(parts, part{span{prev, m.start}, invert})
		}
		parts = append(parts, part{m, !invert})
		prev = m.end
	}
	if prev < len(s) {
		parts = append(parts, part{span{prev, len(s)}, invert})
	}
	var out []span
	switch behavior {
	case behaviorIsolated:
		for _, pt := range parts {
			out = append(out, pt.span)
		}
	case behaviorRemoved:
		for _, pt := range parts {
			if !pt.match {
				out = append(out, pt.span)
			}
		}
	case behaviorContiguous:
		prevMatch := false
		for k, pt := range parts {
			if k > 0 && pt.match == prevMatch {
				out[len(out)-1].end = pt.end
			} else {
				out = append(out, pt.span)
			}
			prevMatch = pt.match
		}
	case behaviorMergedWithPrevious:
		prevMatch := false
		for _, pt := range parts {
			if pt.match && !prevMatch && len(out) > 0 {
				out[len(out)-1].end = pt.end
			} else {
				out = append(out, pt.span)
			}
			prevMatch = pt.match
		}
	case behaviorMergedWithNext:
		prevMatch := false
		for k := len(parts) - 1; k >= 0; k-- {
			pt := parts[k]
			if pt.match && !prevMatch && len(out) > 0 {
				out[len(out)-1].start = pt.start
			} else {
				out = append(out, pt.span)
			}
			prevMatch = pt.match
		}
		for a, b := 0, len(out)-1; a < b; a, b = a+1, b-1 {
			out[a], out[b] = out[b], out[a]
		}
	}
	for _, sp := range out {
		if sp.end > sp.start {
			dst = append(dst, piece{s[sp.start:sp.end], p.atStart && sp.start == 0})
		}
	}
	return dst
}
