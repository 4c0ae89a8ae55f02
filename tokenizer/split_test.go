package tokenizer

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/dlclark/regexp2/v2"
)

// The hand-written matchers must cut every string exactly as the regex
// they replace does under a backtracking engine (regexp2, whose semantics
// are Oniguruma's for these patterns).

var handWritten = []struct {
	name  string
	regex string
	p     tilingPattern
}{
	{"gpt2", gpt2Regex, gpt2Pattern{}},
	{"cl100k", cl100kRegex, cl100kPattern{maxDigits: 3}},
	{"qwen", `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`, cl100kPattern{maxDigits: 1}},
	{"o200k", o200kRegex, o200kPattern{}},
}

// splitAlphabet holds characters from every class the patterns tell apart.
var splitAlphabet = []string{"a", "b", "Z", "Q", "é", "ß", "Ǆ", "ǅ", "ʰ", "я", "Ж", "中", "ー", "ｱ", "\u0301", "\u0308", "\u0903",
	"0", "7", "٣", "½", "Ⅻ", " ", " ", " ", "\t", "\n", "\r", "\v", "\f", "\u0085", "\u00a0", "\u2003", "\u3000", "\u2028",
	"'", "'s", "'S", "'t", "'re", "'VE", "'m", "'ll", "'d", "'x", ".", ",", "!", "/", "-", "_", "😀", "\u200d", "<", "|", "\"", "\ufffd"}

func randomSplitText(r *rand.Rand) string {
	var sb strings.Builder
	for n := 1 + r.IntN(16); n > 0; n-- {
		sb.WriteString(splitAlphabet[r.IntN(len(splitAlphabet))])
	}
	return sb.String()
}

func checkSplit(t *testing.T, name string, re *regexp2.Regexp, p tilingPattern, s string) {
	t.Helper()
	idx, err := re.FindAllStringIndex(s, -1)
	if err != nil {
		t.Fatal(err)
	}
	var want []span
	for _, m := range idx {
		want = append(want, span{m[0], m[1]})
	}
	if got := p.matches(nil, s); !slices.Equal(got, want) {
		t.Errorf("%s: %q\n got %v\nwant %v", name, s, pieces(s, got), pieces(s, want))
	}
}

func pieces(s string, spans []span) []string {
	var out []string
	for _, sp := range spans {
		out = append(out, s[sp.start:sp.end])
	}
	return out
}

func TestHandWrittenSplittersEqualRegexp2(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	texts := fixtureTexts(t)
	for range 3000 {
		texts = append(texts, randomSplitText(r))
	}
	for _, h := range handWritten {
		re := regexp2.MustCompile(h.regex)
		for _, s := range texts {
			checkSplit(t, h.name, re, h.p, s)
		}
	}
}

func FuzzHandWrittenSplitters(f *testing.F) {
	for _, s := range []string{"Hello world", "  spaces", "'s", "I'M", "a\r\n\n b", "x1234y", "ǅemal'S", "e\u0301'll", "\u00a0\u00a0x"} {
		f.Add(s)
	}
	res := make([]*regexp2.Regexp, len(handWritten))
	for i, h := range handWritten {
		res[i] = regexp2.MustCompile(h.regex)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if !utf8.ValidString(s) {
			return // regexp2 sees U+FFFD where the matchers see one invalid byte; HF never gets invalid text
		}
		for i, h := range handWritten {
			checkSplit(t, h.name, res[i], h.p, s)
		}
	})
}

// TestGPT2KnownSplits pins GPT-2's documented behaviour: the space goes
// with the word after it, a run of spaces leaves its last one to the next
// word, contractions and digit runs stay whole.
func TestGPT2KnownSplits(t *testing.T) {
	for s, want := range map[string][]string{
		"Hello world":          {"Hello", " world"},
		"  spaces":             {" ", " spaces"},
		"'s":                   {"'s"},
		"it's 2024, isn't it?": {"it", "'s", " 2024", ",", " isn", "'t", " it", "?"},
		"x  \n y":              {"x", "  \n", " y"},
		"trailing   ":          {"trailing", "   "},
		"1234567 ab12":         {"1234567", " ab", "12"},
		"don't YOU'LL":         {"don", "'t", " YOU", "'", "LL"},
		"Hello<|endoftext|>":   {"Hello", "<|", "endoftext", "|>"},
	} {
		if got := pieces(s, gpt2Pattern{}.matches(nil, s)); !slices.Equal(got, want) {
			t.Errorf("%q: got %q, want %q", s, got, want)
		}
	}
}

// TestGPT2FixtureHandChecked: through fixture (a), these strings give the
// tokens of those pieces (a piece that is in the vocabulary is one token).
func TestGPT2FixtureHandChecked(t *testing.T) {
	tok, err := Load("testdata/gpt2.json")
	if err != nil {
		t.Fatal(err)
	}
	tokens := func(text string) []string {
		var out []string
		for _, id := range tok.Encode(text) {
			s, _ := tok.Token(id)
			out = append(out, s)
		}
		return out
	}
	for text, want := range map[string][]string{
		"Hello world":   {"Hello", "Ġworld"},
		"  spaces":      {"Ġ", "Ġspaces"},
		"'s":            {"'s"},
		"2024":          {"20", "24"},
		"<|endoftext|>": {"<|endoftext|>"},
	} {
		if got := tokens(text); !slices.Equal(got, want) {
			t.Errorf("%q: tokens %q, want %q", text, got, want)
		}
	}
}
