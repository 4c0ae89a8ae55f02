package tokenizer

import (
	"strconv"
	"strings"
	"unicode/utf8"
)

// Decoders turn the tokens of ids back into text; each takes the previous
// one's output, as HF's decode_chain.
type decoder interface {
	decode(tokens []string) []string
}

type decoderSequence []decoder

func (q decoderSequence) decode(tokens []string) []string {
	for _, d := range q {
		tokens = d.decode(tokens)
	}
	return tokens
}

// byteLevelDecoder maps each token from the byte alphabet back to bytes
// (a token with a character outside it stays as it is) and reads the whole
// as UTF-8, invalid sequences becoming U+FFFD as Rust's from_utf8_lossy.
type byteLevelDecoder struct{}

func (byteLevelDecoder) decode(tokens []string) []string {
	var b []byte
	for _, t := range tokens {
		if raw, ok := fromByteAlphabet(t); ok {
			b = append(b, raw...)
		} else {
			b = append(b, t...)
		}
	}
	return []string{lossyUTF8(b)}
}

// metaspaceDecoder turns the replacement back into spaces, dropping it from
// the first token unless the prepend scheme is never.
type metaspaceDecoder struct {
	replacement string
	prepend     prependScheme
}

func (m metaspaceDecoder) decode(tokens []string) []string {
	out := make([]string, len(tokens))
	for i, t := range tokens {
		with := " "
		if i == 0 && m.prepend != prependNever {
			with = ""
		}
		out[i] = strings.ReplaceAll(t, m.replacement, with)
	}
	return out
}

type replaceDecoder struct {
	pattern pattern
	content string
}

func (r replaceDecoder) decode(tokens []string) []string {
	out := make([]string, len(tokens))
	for i, t := range tokens {
		out[i] = replaceAll(t, r.pattern, r.content)
	}
	return out
}

// byteFallbackDecoder turns runs of <0xNN> tokens into their bytes: one
// string if they are valid UTF-8, else one U+FFFD per byte.
type byteFallbackDecoder struct{}

func (byteFallbackDecoder) decode(tokens []string) []string {
	out := make([]string, 0, len(tokens))
	var run []byte
	flush := func() {
		if len(run) == 0 {
			return
		}
		if utf8.Valid(run) {
			out = append(out, string(run))
		} else {
			for range run {
				out = append(out, "\uFFFD")
			}
		}
		run = run[:0]
	}
	for _, t := range tokens {
		if len(t) == 6 && strings.HasPrefix(t, "<0x") && t[5] == '>' {
			if v, err := strconv.ParseUint(t[3:5], 16, 8); err == nil {
				run = append(run, byte(v))
				continue
			}
		}
		flush()
		out = append(out, t)
	}
	flush()
	return out
}

type fuseDecoder struct{}

func (fuseDecoder) decode(tokens []string) []string { return []string{strings.Join(tokens, "")} }

// stripDecoder removes up to start leading and stop trailing content
// characters from each token.
type stripDecoder struct {
	content     rune
	start, stop int
}

func (d stripDecoder) decode(tokens []string) []string {
	out := make([]string, len(tokens))
	for i, t := range tokens {
		r := []rune(t)
		lo := 0
		for lo < d.start && lo < len(r) && r[lo] == d.content {
			lo++
		}
		hi := len(r)
		for k := 0; k < d.stop && hi > lo && r[hi-1] == d.content; k++ {
			hi--
		}
		out[i] = string(r[lo:hi])
	}
	return out
}

// bpeDecoder (HF's BPEDecoder) turns the end-of-word suffix into a space,
// and drops it from the last token.
type bpeDecoder struct{ suffix string }

func (d bpeDecoder) decode(tokens []string) []string {
	out := make([]string, len(tokens))
	for i, t := range tokens {
		with := " "
		if i == len(tokens)-1 {
			with = ""
		}
		out[i] = strings.ReplaceAll(t, d.suffix, with)
	}
	return out
}

// lossyUTF8 is Rust's String::from_utf8_lossy: each maximal prefix of a
// valid sequence that does not complete, or byte that begins none, becomes
// one U+FFFD.
func lossyUTF8(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	var sb strings.Builder
	for i := 0; i < len(b); {
		r, w := utf8.DecodeRune(b[i:])
		if r != utf8.RuneError || w > 1 {
			sb.Write(b[i : i+w])
			i += w
			continue
		}
		sb.WriteRune(utf8.RuneError)
		i += invalidPrefixLen(b[i:])
	}
	return sb.String()
}

// invalidPrefixLen is the length of the maximal subpart of an ill-formed
// sequence at the start of b (at least 1).
func invalidPrefixLen(b []byte) int {
	c := b[0]
	var need int
	lo, hi := byte(0x80), byte(0xBF)
	switch {
	case c >= 0xC2 && c <= 0xDF:
		need = 1
	case c == 0xE0:
		need, lo = 2, 0xA0
	case c >= 0xE1 && c <= 0xEC, c == 0xEE, c == 0xEF:
		need = 2
	case c == 0xED:
		need, hi = 2, 0x9F
	case c == 0xF0:
		need, lo = 3, 0x90
	case c >= 0xF1 && c <= 0xF3:
		need = 3
	case c == 0xF4:
		need, hi = 3, 0x8F
	default:
		return 1
	}
	n := 1
	for k := 0; k < need && n < len(b); k++ {
		if k == 0 {
			if b[n] < lo || b[n] > hi {
				break
			}
		} else if b[n] < 0x80 || b[n] > 0xBF {
			break
		}
		n++
	}
	return n
}
