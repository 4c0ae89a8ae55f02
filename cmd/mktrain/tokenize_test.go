package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// The tokenizers are package tokenizer's fixtures, made with the Hugging
// Face library; their expected ids are checked there, the CLI's plumbing here.
var (
	llama3Fixture = filepath.Join("..", "..", "tokenizer", "testdata", "llama3.json")
	rankFixture   = filepath.Join("..", "..", "tokenizer", "testdata", "tiny_cl100k.tiktoken")
)

// fixtureIDs is the HF library's ids for the fixture text at index i.
func fixtureIDs(t *testing.T, name string, i int) (text string, ids, idsSpecial []int) {
	t.Helper()
	dir := filepath.Join("..", "..", "tokenizer", "testdata")
	var texts []string
	var cases []struct {
		IDs        []int `json:"ids"`
		IDsSpecial []int `json:"ids_special"`
	}
	for path, v := range map[string]any{filepath.Join(dir, "texts.json"): &texts, filepath.Join(dir, name+".expected.json"): &cases} {
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(data, v); err != nil {
			t.Fatal(err)
		}
	}
	return texts[i], cases[i].IDs, cases[i].IDsSpecial
}

func parseIDLine(t *testing.T, line string) []int {
	t.Helper()
	var ids []int
	for _, f := range strings.Fields(line) {
		id, err := strconv.Atoi(f)
		if err != nil {
			t.Fatalf("output %q is not ids", line)
		}
		ids = append(ids, id)
	}
	return ids
}

func TestTokenizeEncodesAsHF(t *testing.T) {
	text, want, wantSpecial := fixtureIDs(t, "llama3", 9) // "Hello world"
	code, stdout, stderr := runCLI(t, "tokenize", "--tokenizer", llama3Fixture, text)
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if got := parseIDLine(t, stdout); !slices.Equal(got, want) {
		t.Errorf("ids %v, want %v", got, want)
	}
	code, stdout, stderr = runCLI(t, "tokenize", "--json", "--special", "--tokenizer", llama3Fixture, text)
	var got []int
	if code != exitOK || json.Unmarshal([]byte(stdout), &got) != nil || !slices.Equal(got, wantSpecial) {
		t.Errorf("--json --special: exit %d, %q (%s); want %v", code, stdout, stderr, wantSpecial)
	}
	code, stdout, _ = runCLI(t, "tokenize", "--json", "--tokenizer", llama3Fixture, "")
	if code != exitOK || stdout != "[]\n" {
		t.Errorf("empty text: exit %d, %q; want []", code, stdout)
	}
}

// TestTokenizeStdinRoundTrip: text from standard input, its ids decoded
// back (from a space list, a comma list and a JSON array) give the text.
func TestTokenizeStdinRoundTrip(t *testing.T) {
	text := "Hello <|end_of_text|> wörld\n\tcode();  😀\n"
	for _, file := range []string{llama3Fixture, rankFixture} {
		var out, errOut bytes.Buffer
		if err := cmdTokenize(context.Background(), []string{"--tokenizer", file}, strings.NewReader(text), &out, &errOut); err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		ids := strings.TrimSpace(out.String())
		for _, in := range []string{ids, strings.ReplaceAll(ids, " ", ", "), "[" + strings.ReplaceAll(ids, " ", ",") + "]"} {
			var dec bytes.Buffer
			if err := cmdTokenize(context.Background(), []string{"--tokenizer", file, "--decode"}, strings.NewReader(in), &dec, &errOut); err != nil {
				t.Fatalf("%s: --decode %q: %v", file, in, err)
			}
			if dec.String() != text {
				t.Errorf("%s: --decode %q = %q, want %q", file, in, dec.String(), text)
			}
		}
	}
	code, stdout, _ := runCLI(t, "tokenize", "--decode", "--json", "--tokenizer", llama3Fixture, "39 82")
	var s string
	if code != exitOK || json.Unmarshal([]byte(stdout), &s) != nil || !strings.HasSuffix(stdout, "\n") {
		t.Errorf("--decode --json: exit %d, %q", code, stdout)
	}
}

func TestTokenizeBadInput(t *testing.T) {
	dir := t.TempDir()
	unigram := writeFile(t, filepath.Join(dir, "unigram.json"), `{"model": {"type": "Unigram", "vocab": [["a", 0.0]]}}`)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"tokenize", "hi"}, "--tokenizer"},
		{[]string{"tokenize", "--tokenizer", filepath.Join(dir, "absent.json"), "hi"}, "absent.json"},
		{[]string{"tokenize", "--tokenizer", unigram, "hi"}, "unigram.json"},
		{[]string{"tokenize", "--tokenizer", unigram, "hi"}, "Unigram is not supported"},
		{[]string{"tokenize", "--tokenizer", llama3Fixture, "--decode", "1 x 2"}, `"x" is not a token id`},
		{[]string{"tokenize", "--tokenizer", llama3Fixture, "--decode", "99999999"}, "llama3.json"},
		{[]string{"tokenize", "--tokenizer", llama3Fixture, "a", "b"}, "one TEXT argument"},
	} {
		code, _, stderr := runCLI(t, c.args...)
		if code != exitFailure || !strings.Contains(stderr, c.want) {
			t.Errorf("%q: exit %d, stderr %q; want exit 2 naming %q", c.args, code, stderr, c.want)
		}
	}
}
