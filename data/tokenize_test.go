package data

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"github.com/parquet-go/parquet-go"
)

// byteEncoder is a tokenizer for the tests: token b+offset for each byte b,
// and one more id (the last) for the end of a document.
type byteEncoder struct{ offset int }

func (e byteEncoder) Encode(text string) []int {
	ids := make([]int, len(text))
	for i := 0; i < len(text); i++ {
		ids[i] = int(text[i]) + e.offset
	}
	return ids
}
func (e byteEncoder) VocabSize() int { return 256 + e.offset + 1 }
func (e byteEncoder) eos() int       { return 256 + e.offset }

// readTokenShards concatenates the tokens of shards of width tokenBytes.
func readTokenShards(t *testing.T, paths []string, tokenBytes int) []uint32 {
	t.Helper()
	var out []uint32
	for _, p := range paths {
		s, err := OpenShard(p)
		if err != nil {
			t.Fatal(err)
		}
		if s.Header().TokenBytes() != tokenBytes {
			t.Fatalf("%s: %d-byte tokens, want %d", p, s.Header().TokenBytes(), tokenBytes)
		}
		ts := make([]uint32, s.Len())
		if err := s.ReadTokens(ts, 0); err != nil {
			t.Fatal(err)
		}
		out = append(out, ts...)
		s.Close()
	}
	return out
}

// splitDocs cuts a token stream after each eos and decodes each document.
func splitDocs(t *testing.T, tokens []uint32, enc byteEncoder) []string {
	t.Helper()
	var docs []string
	var cur []byte
	for _, tok := range tokens {
		if int(tok) == enc.eos() {
			docs = append(docs, string(cur))
			cur = nil
			continue
		}
		cur = append(cur, byte(int(tok)-enc.offset))
	}
	if len(cur) > 0 {
		t.Fatalf("the token stream ends inside a document: %q", cur)
	}
	return docs
}

type parquetDoc struct {
	ID   int64  `parquet:"id"`
	Text string `parquet:"text"`
}

func writeParquet[T any](t *testing.T, path string, rows []T) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	w := parquet.NewGenericWriter[T](f, parquet.PageBufferSize(256)) // small pages: several per file
	if _, err := w.Write(rows); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

func compress(t *testing.T, b []byte, kind string) []byte {
	t.Helper()
	var buf bytes.Buffer
	switch kind {
	case "gz":
		w := gzip.NewWriter(&buf)
		w.Write(b)
		w.Close()
	case "zst":
		w, err := zstd.NewWriter(&buf)
		if err != nil {
			t.Fatal(err)
		}
		w.Write(b)
		w.Close()
	}
	return buf.Bytes()
}

// corpus writes a text file, JSON Lines plain, gzip and zstd, and a Parquet
// file into dir, and returns their paths and every document.
func corpus(t *testing.T, dir string) ([]string, []string) {
	t.Helper()
	rng := rand.New(rand.NewPCG(1, 2))
	word := func() string {
		words := []string{"the", "fox", "héllo", "日本語", "🦊", "  spaces  ", "tab\there", "quote\"d", "back\\slash", "new\nline"}
		return words[rng.IntN(len(words))]
	}
	doc := func() string {
		var b strings.Builder
		for range 1 + rng.IntN(30) {
			b.WriteString(word() + " ")
		}
		return b.String()
	}
	var docs, paths []string
	text := doc() + "\n" + doc()
	writeFile(t, filepath.Join(dir, "a.txt"), []byte(text))
	docs = append(docs, text)
	paths = append(paths, filepath.Join(dir, "a.txt"))
	for _, kind := range []string{"", "gz", "zst"} {
		var lines bytes.Buffer
		for i := range 40 {
			d := doc()
			docs = append(docs, d)
			fmt.Fprintf(&lines, `{"id": %d, "meta": {"text": "not this one", "list": [1, "]"]}, "text": %q}`+"\n", i, d)
			if i%10 == 3 {
				lines.WriteString("\n   \n") // blank lines are skipped
			}
		}
		name := filepath.Join(dir, "b.jsonl")
		b := lines.Bytes()
		if kind != "" {
			name += "." + kind
			b = compress(t, b, kind)
		}
		writeFile(t, name, b)
		paths = append(paths, name)
	}
	var rows []parquetDoc
	for i := range 60 {
		d := doc()
		docs = append(docs, d)
		rows = append(rows, parquetDoc{ID: int64(i), Text: d})
	}
	writeParquet(t, filepath.Join(dir, "c.parquet"), rows)
	paths = append(paths, filepath.Join(dir, "c.parquet"))
	return paths, docs
}

func TestPrepareTokenizedRoundTrip(t *testing.T) {
	in := t.TempDir()
	inputs, docs := corpus(t, in)
	enc := byteEncoder{offset: 3}
	prepare := func(workers int, seed uint64, val float64) (PrepareStats, []uint32, []uint32) {
		out := filepath.Join(t.TempDir(), "shards")
		var phases []string
		st, err := PrepareTokenized(context.Background(), PrepareOptions{
			Inputs: inputs, OutDir: out, ValFraction: val, ShardTokens: 500, Tokenizer: enc, EOS: enc.eos(),
			Seed: seed, Workers: workers,
			Progress: func(p PrepareProgress) {
				if len(phases) == 0 || phases[len(phases)-1] != p.Phase {
					phases = append(phases, p.Phase)
				}
				if p.Done > p.Total {
					t.Errorf("progress %+v: done past the total", p)
				}
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(phases, []string{"tokenizing", "writing"}) {
			t.Errorf("progress phases %v", phases)
		}
		entries, _ := os.ReadDir(out)
		if len(entries) != len(st.TrainShards)+len(st.ValShards) {
			t.Fatalf("%s holds %d entries, want only the %d shards (the spill file must be gone)", out, len(entries), len(st.TrainShards)+len(st.ValShards))
		}
		return st, readTokenShards(t, st.TrainShards, 2), readTokenShards(t, st.ValShards, 2)
	}

	st, train, val := prepare(1, 7, 0)
	if len(val) != 0 || len(st.ValShards) != 0 {
		t.Fatalf("val fraction 0 wrote %d val tokens", len(val))
	}
	got := splitDocs(t, train, enc)
	if len(got) != len(docs) {
		t.Fatalf("%d documents in the shards, want %d", len(got), len(docs))
	}
	if slices.Equal(got, docs) {
		t.Fatal("the documents are in input order: not shuffled")
	}
	sortedGot, sortedWant := slices.Clone(got), slices.Clone(docs)
	slices.Sort(sortedGot)
	slices.Sort(sortedWant)
	if !slices.Equal(sortedGot, sortedWant) {
		t.Fatal("the shards do not hold the input documents")
	}
	textBytes := 0
	for _, d := range docs {
		textBytes += len(d)
	}
	if st.Documents != int64(len(docs)) || st.EOSTokens != int64(len(docs)) || st.TextBytes != int64(textBytes) ||
		st.TrainTokens != int64(textBytes+len(docs)) || st.Files != len(inputs) || st.Vocab != 260 || st.TokenBytes != 2 ||
		st.BytesPerToken() != 1 {
		t.Fatalf("stats %+v (bytes per token %v)", st, st.BytesPerToken())
	}

	// The same output on any number of workers; another seed, another order.
	for _, workers := range []int{3, 8} {
		_, train2, _ := prepare(workers, 7, 0)
		if !slices.Equal(train2, train) {
			t.Fatalf("%d workers wrote other shards than 1 worker", workers)
		}
	}
	_, train3, _ := prepare(2, 8, 0)
	if slices.Equal(train3, train) || len(train3) != len(train) {
		t.Fatal("seed 8 gave the order of seed 7")
	}

	// A val fraction cuts the shuffled stream once: train then val is the
	// stream of fraction 0.
	st, trainV, valV := prepare(4, 7, 0.25)
	total := int64(len(train))
	if want := int64(math.Ceil(float64(total) * 0.25)); st.ValTokens != want || int64(len(valV)) != want {
		t.Fatalf("val holds %d tokens (stats %d), want %d", len(valV), st.ValTokens, want)
	}
	if !slices.Equal(append(trainV, valV...), train) {
		t.Fatal("train + val differ from the unsplit stream")
	}
}

func TestPrepareTokenizedUint32(t *testing.T) {
	in := t.TempDir()
	writeFile(t, filepath.Join(in, "a.txt"), []byte("hello"))
	writeFile(t, filepath.Join(in, "b.txt"), []byte("world!"))
	enc := byteEncoder{offset: 70000} // ids above 65535: uint32 shards
	st, err := PrepareTokenized(context.Background(), PrepareOptions{
		Inputs: []string{filepath.Join(in, "*.txt")}, OutDir: filepath.Join(t.TempDir(), "o"), ShardTokens: 4,
		Tokenizer: enc, EOS: NoEOS,
	})
	if err != nil {
		t.Fatal(err)
	}
	tokens := readTokenShards(t, st.TrainShards, 4)
	var text []byte
	for _, tok := range tokens {
		text = append(text, byte(tok-70000))
	}
	if s := string(text); s != "helloworld!" && s != "world!hello" {
		t.Fatalf("uint32 shards hold %q", s)
	}
	if st.TokenBytes != 4 || len(st.TrainShards) != 3 || st.EOSTokens != 0 {
		t.Fatalf("stats %+v", st)
	}
}

func TestPrepareTokenizedBadInput(t *testing.T) {
	in := t.TempDir()
	good := filepath.Join(in, "good.jsonl")
	writeFile(t, good, []byte(`{"text": "fine"}`+"\n"))
	put := func(name string, b []byte) string {
		p := filepath.Join(in, name)
		writeFile(t, p, b)
		return p
	}
	var long bytes.Buffer
	for i := range 2000 {
		fmt.Fprintf(&long, `{"text": "line %d with some words to make the gzip stream long enough"}`+"\n", i)
	}
	gz := compress(t, long.Bytes(), "gz")
	truncated := put("cut.jsonl.gz", gz[:len(gz)/2])
	zs := compress(t, long.Bytes(), "zst")
	truncatedZstd := put("cut.jsonl.zst", zs[:len(zs)/2])
	intColumn := filepath.Join(in, "ints.parquet")
	writeParquet(t, intColumn, []struct {
		Text int64 `parquet:"text"`
	}{{1}, {2}})
	nulls := filepath.Join(in, "nulls.parquet")
	hello := "hello"
	writeParquet(t, nulls, []struct {
		Text *string `parquet:"text,optional"`
	}{{&hello}, {&hello}, {nil}})
	for _, tc := range []struct {
		name  string
		input string
		key   string
		eos   int
		want  string
	}{
		{"malformed line", put("bad.jsonl", []byte("{\"text\": \"a\"}\n{\"text\": \"b\"\n")), "", 0, "bad.jsonl:2: not valid JSON"},
		{"missing key", put("nokey.jsonl", []byte("\n{\"text\": \"a\"}\n{\"content\": \"b\", \"id\": 3}\n")), "", 0, `nokey.jsonl:3: no "text" field (the fields are content, id; choose one with --text-key)`},
		{"other key", good, "body", 0, `good.jsonl:1: no "body" field (the fields are text`},
		{"not a string", put("num.jsonl", []byte("{\"text\": 12}\n")), "", 0, `num.jsonl:1: field "text" is a number, not a string`},
		{"null", put("null.jsonl", []byte("{\"text\": null}\n")), "", 0, `null.jsonl:1: field "text" is null, not a string`},
		{"not an object", put("arr.jsonl", []byte("[1, 2]\n")), "", 0, "arr.jsonl:1: a JSON object per line expected, got an array"},
		{"truncated gzip", truncated, "", 0, "cut.jsonl.gz:"},
		{"truncated zstd", truncatedZstd, "", 0, "cut.jsonl.zst:"},
		{"not gzip", put("plain.txt.gz", []byte("hello")), "", 0, "plain.txt.gz: not a gzip file"},
		{"int column", intColumn, "", 0, `ints.parquet: column "text" holds INT64 (INT(64,true)), not strings`},
		{"missing column", intColumn, "body", 0, `ints.parquet: no column "body" (the columns are text; choose one with --text-key)`},
		{"null row", nulls, "", 0, `nulls.parquet: row 2: column "text" is null, not a string`},
		{"not parquet", put("junk.parquet", []byte("this is not parquet at all")), "", 0, "junk.parquet: not a readable Parquet file"},
		{"compressed parquet", put("x.parquet.gz", []byte("x")), "", 0, "x.parquet.gz: a Parquet file compresses its own pages"},
		{"not UTF-8", put("latin1.txt", []byte("caf\xe9 au lait")), "", 0, "latin1.txt: not UTF-8 text (byte 3 of the document"},
		{"no text", put("empty.jsonl", []byte("{\"text\": \"\"}\n\n")), "", 0, "the inputs hold no text (1 files, 1 empty documents)"},
		{"eos outside the vocabulary", good, "", 300, "end-of-document token 300 is not an id"},
	} {
		out := filepath.Join(t.TempDir(), "out")
		inputs := []string{good, tc.input} // a good file first: the error is the bad one's
		if tc.key != "" || tc.name == "no text" {
			inputs = inputs[1:]
		}
		_, err := PrepareTokenized(context.Background(), PrepareOptions{
			Inputs: inputs, OutDir: out, ShardTokens: 100, Tokenizer: byteEncoder{}, EOS: tc.eos, TextKey: tc.key, Workers: 2,
		})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one containing %q", tc.name, err, tc.want)
		}
		if strings.Contains(tc.name, "truncated") && err != nil && !strings.Contains(err.Error(), "truncated") {
			t.Errorf("%s: error %v does not say the file is truncated", tc.name, err)
		}
		if _, statErr := os.Stat(out); !errors.Is(statErr, os.ErrNotExist) {
			t.Errorf("%s: the output directory is left after the error", tc.name)
		}
	}
}

// TestPrepareTokenizedErrorOrder: the error reported is the first in input
// order, whichever worker finds it first.
func TestPrepareTokenizedErrorOrder(t *testing.T) {
	in := t.TempDir()
	var b bytes.Buffer
	for i := range 20000 {
		if i == 5000 || i == 15000 {
			b.WriteString("{broken\n")
			continue
		}
		fmt.Fprintf(&b, `{"text": "document %d"}`+"\n", i)
	}
	writeFile(t, filepath.Join(in, "x.jsonl"), b.Bytes())
	for _, workers := range []int{1, 4} {
		_, err := PrepareTokenized(context.Background(), PrepareOptions{
			Inputs: []string{filepath.Join(in, "x.jsonl")}, OutDir: filepath.Join(t.TempDir(), "o"), ShardTokens: 1000,
			Tokenizer: byteEncoder{}, EOS: NoEOS, Workers: workers,
		})
		if err == nil || !strings.Contains(err.Error(), "x.jsonl:5001:") {
			t.Errorf("%d workers: error %v, want the first bad line, x.jsonl:5001", workers, err)
		}
	}
}

func TestPrepareTokenizedStopsWhenCancelled(t *testing.T) {
	in := t.TempDir()
	var b bytes.Buffer
	for i := range 100000 {
		fmt.Fprintf(&b, `{"text": "document number %d of many"}`+"\n", i)
	}
	writeFile(t, filepath.Join(in, "x.jsonl"), b.Bytes())
	out := filepath.Join(t.TempDir(), "out")
	stopCause := errors.New("stop requested")
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	_, err := PrepareTokenized(ctx, PrepareOptions{
		Inputs: []string{filepath.Join(in, "x.jsonl")}, OutDir: out, ShardTokens: 1000, Tokenizer: byteEncoder{}, EOS: 256,
		Progress: func(p PrepareProgress) { cancel(stopCause) },
	})
	if !errors.Is(err, stopCause) || !strings.Contains(err.Error(), "stopped while tokenizing") {
		t.Fatalf("error %v, want one wrapping %v", err, stopCause)
	}
	if _, statErr := os.Stat(out); !errors.Is(statErr, os.ErrNotExist) {
		t.Errorf("the output directory %s is left after the stop: %v", out, statErr)
	}
}

func TestJSONText(t *testing.T) {
	for _, tc := range []struct {
		line, key, want string
	}{
		{`{"text": "plain"}`, "text", "plain"},
		{` { "a" : [ {"text": "no"} ], "text" : "yes" } `, "text", "yes"},
		{`{"text": "first", "text": "last"}`, "text", "last"},
		{`{"te\u0078t": "escaped key"}`, "text", "escaped key"},
		{`{"text": "line\nbreak \"quoted\" \u00e9 \ud83e\udd8a"}`, "text", "line\nbreak \"quoted\" é 🦊"},
		{`{"x": "a \" } tricky", "body": "b"}`, "body", "b"},
		{`{"n": -1.5e3, "t": true, "f": false, "z": null, "text": ""}`, "text", ""},
	} {
		got, err := jsonText([]byte(tc.line), tc.key)
		if err != nil || got != tc.want {
			t.Errorf("jsonText(%s, %q) = %q, %v; want %q", tc.line, tc.key, got, err, tc.want)
		}
	}
}

func TestInputKind(t *testing.T) {
	for _, tc := range []struct {
		path   string
		format InputFormat
		comp   Compression
	}{
		{"a.txt", FormatText, Uncompressed}, {"a", FormatText, Uncompressed}, {"a.md.gz", FormatText, Gzip},
		{"a.jsonl", FormatJSONL, Uncompressed}, {"d/A.JSON.ZST", FormatJSONL, Zstd}, {"a.ndjson.zstd", FormatJSONL, Zstd},
		{"a.parquet", FormatParquet, Uncompressed}, {"x.jsonl.gz", FormatJSONL, Gzip},
	} {
		if f, c := InputKind(tc.path); f != tc.format || c != tc.comp {
			t.Errorf("InputKind(%q) = %v, %v; want %v, %v", tc.path, f, c, tc.format, tc.comp)
		}
	}
}
