package data

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// megatronIndex builds an .idx by hand, field by field as Megatron's
// _IndexWriter lays it out, so that the tests do not depend on
// WriteIndexed alone.
func megatronIndex(code byte, lengths []int32, pointers, docIndex []int64) []byte {
	le := binary.LittleEndian
	b := []byte("MMIDIDX\x00\x00")
	b = le.AppendUint64(b, 1)
	b = append(b, code)
	b = le.AppendUint64(b, uint64(len(lengths)))
	b = le.AppendUint64(b, uint64(len(docIndex)))
	for _, n := range lengths {
		b = le.AppendUint32(b, uint32(n))
	}
	for _, p := range pointers {
		b = le.AppendUint64(b, uint64(p))
	}
	for _, d := range docIndex {
		b = le.AppendUint64(b, uint64(d))
	}
	return b
}

func TestIndexedDatasetReadsWhatMegatronWrites(t *testing.T) {
	dir := t.TempDir()
	le := binary.LittleEndian
	// Three sequences of int32 tokens in two documents (the first of two
	// sentences), as preprocess_data.py --split-sentences would write.
	seqs := [][]int32{{5, 6, 7}, {8}, {9, 10, 11, 12}}
	var bin []byte
	var lengths []int32
	var pointers []int64
	for _, s := range seqs {
		pointers = append(pointers, int64(len(bin)))
		lengths = append(lengths, int32(len(s)))
		for _, t := range s {
			bin = le.AppendUint32(bin, uint32(t))
		}
	}
	prefix := filepath.Join(dir, "corpus_text_sentence")
	writeFile(t, prefix+".bin", bin)
	writeFile(t, prefix+".idx", megatronIndex(4, lengths, pointers, []int64{0, 2, 3}))

	for _, name := range []string{prefix, prefix + ".bin", prefix + ".idx"} {
		d, err := OpenIndexed(name)
		if err != nil {
			t.Fatal(err)
		}
		if d.Name() != prefix+".bin" || d.Len() != 8 || d.Documents() != 2 || d.Sequences() != 3 || d.TokenType() != "int32" {
			t.Fatalf("OpenIndexed(%s): name %s, %d tokens, %d documents, %d sequences, %s", name, d.Name(), d.Len(), d.Documents(), d.Sequences(), d.TokenType())
		}
		got := make([]uint32, 5)
		if err := d.ReadTokens(got, 2); err != nil || !slices.Equal(got, []uint32{7, 8, 9, 10, 11}) {
			t.Fatalf("ReadTokens at 2: %v, %v", got, err)
		}
		if err := d.ReadTokens(got, 4); err == nil || !strings.Contains(err.Error(), "out of range") {
			t.Fatalf("ReadTokens past the end: %v", err)
		}
		d.Close()
	}
}

func TestWriteIndexedRoundTrip(t *testing.T) {
	dir := t.TempDir()
	docs := [][]uint32{{1, 2, 3, 0}, {}, {4, 5, 0}, {999, 0}}
	for _, vocab := range []int{1000, 100000} {
		prefix := filepath.Join(dir, fmt.Sprintf("vocab%d", vocab))
		if err := WriteIndexed(prefix, docs, vocab); err != nil {
			t.Fatal(err)
		}
		d, err := OpenIndexed(prefix)
		if err != nil {
			t.Fatal(err)
		}
		want := slices.Concat(docs...)
		got := make([]uint32, d.Len())
		if err := d.ReadTokens(got, 0); err != nil || !slices.Equal(got, want) {
			t.Fatalf("vocab %d: read %v (%v), want %v", vocab, got, err, want)
		}
		wantType := map[int]string{1000: "uint16", 100000: "int32"}[vocab]
		if d.TokenType() != wantType || d.Documents() != 4 {
			t.Fatalf("vocab %d: %s tokens, %d documents", vocab, d.TokenType(), d.Documents())
		}
		d.Close()
	}
	if err := WriteIndexed(filepath.Join(dir, "bad"), [][]uint32{{7}}, 5); err == nil || !strings.Contains(err.Error(), "token 7 at position 0 of document 0 is >= vocab 5") {
		t.Fatalf("a token >= vocab: %v", err)
	}
}

// TestLoaderTrainsOnMegatronData: a loader reads Megatron datasets named by
// prefix, by a glob of .bin or of .idx files, mixed with llm.c shards, and
// Verify checks them.
func TestLoaderTrainsOnMegatronData(t *testing.T) {
	dir := t.TempDir()
	var want []uint32
	for i, name := range []string{"a_text_document", "b_text_document"} {
		var docs [][]uint32
		for d := range 5 {
			doc := make([]uint32, 10+d)
			for j := range doc {
				doc[j] = uint32(100*i + 10*d + j)
			}
			docs = append(docs, doc)
			want = append(want, doc...)
		}
		if err := WriteIndexed(filepath.Join(dir, name), docs, 1000); err != nil {
			t.Fatal(err)
		}
	}
	shard := make([]uint32, 50)
	for i := range shard {
		shard[i] = uint32(900 + i)
	}
	if err := WriteShard(filepath.Join(dir, "c_shard.bin"), shard, 1000); err != nil {
		t.Fatal(err)
	}
	for _, pattern := range []string{filepath.Join(dir, "*.bin"), filepath.Join(dir, "*"), filepath.Join(dir, "*.idx")} {
		paths, err := Glob(pattern)
		if err != nil {
			t.Fatal(err)
		}
		wantPaths := []string{filepath.Join(dir, "a_text_document.bin"), filepath.Join(dir, "b_text_document.bin"), filepath.Join(dir, "c_shard.bin")}
		if pattern == filepath.Join(dir, "*.idx") {
			wantPaths = wantPaths[:2]
		}
		if !slices.Equal(paths, wantPaths) {
			t.Fatalf("Glob(%s) = %v, want %v", pattern, paths, wantPaths)
		}
	}
	paths, err := Glob(filepath.Join(dir, "a_text_document"))
	if err != nil || !slices.Equal(paths, []string{filepath.Join(dir, "a_text_document.bin")}) {
		t.Fatalf("Glob of a prefix: %v, %v", paths, err)
	}

	// An eval loader reads every window in file order: the datasets'
	// tokens, then the shard's.
	const seq = 9
	l, err := NewEvalLoader(filepath.Join(dir, "*.bin"), seq, 1000, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	inputs, targets, err := l.Next(1)
	if err != nil {
		t.Fatal(err)
	}
	for j := range seq {
		if uint32(inputs[j]) != want[j] || uint32(targets[j]) != want[j+1] {
			t.Fatalf("window 0: inputs %v targets %v, want the tokens %v", inputs, targets, want[:seq+1])
		}
	}
	if l.Tokens() != int64(len(want)+len(shard)) {
		t.Fatalf("the loader sees %d tokens, want %d", l.Tokens(), len(want)+len(shard))
	}
	train, err := NewLoader(filepath.Join(dir, "b_text_document"), seq, 1000, 1, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := train.Next(2); err != nil {
		t.Fatal(err)
	}
	train.Close()

	sum, err := Verify(context.Background(), paths, 1000)
	if err != nil {
		t.Fatal(err)
	}
	s := sum.Shards[0]
	if s.Format != "megatron" || s.TokenType != "uint16" || s.Tokens != 60 || s.Documents != 5 || s.MaxToken != 53 {
		t.Fatalf("Verify summary %+v", s)
	}
	// An id >= vocab is a *TokenError at its position and byte offset in the .bin.
	_, err = Verify(context.Background(), paths, 50)
	var te *TokenError
	pos := slices.IndexFunc(want, func(t uint32) bool { return t >= 50 })
	if !errors.As(err, &te) || te.Position != int64(pos) || te.ByteOffset != int64(2*pos) || te.ID != want[pos] || te.Path != paths[0] {
		t.Fatalf("Verify with vocab 50: %v", err)
	}
}

func TestVerifyMegatronSignedTokens(t *testing.T) {
	dir := t.TempDir()
	le := binary.LittleEndian
	var bin []byte
	for _, v := range []int32{3, 4, -7, 5} {
		bin = le.AppendUint32(bin, uint32(v))
	}
	prefix := filepath.Join(dir, "neg")
	writeFile(t, prefix+".bin", bin)
	writeFile(t, prefix+".idx", megatronIndex(4, []int32{4}, []int64{0}, []int64{0, 1}))
	_, err := Verify(context.Background(), []string{prefix + ".bin"}, 100)
	if err == nil || err.Error() != prefix+".bin: token -7 at position 2 (byte offset 8) is not a token id" {
		t.Fatalf("Verify of a negative token: %v", err)
	}
	// int32 ids above a vocabulary: the offset counts 4-byte tokens.
	_, err = Verify(context.Background(), []string{prefix + ".bin"}, 4)
	var te *TokenError
	if !errors.As(err, &te) || te.Position != 1 || te.ByteOffset != 4 {
		t.Fatalf("Verify with vocab 4: %v", err)
	}
	d, err := OpenIndexed(prefix)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.ReadTokens(make([]uint32, 4), 0); err == nil || !strings.Contains(err.Error(), "token -7 at position 2 is not a token id") {
		t.Fatalf("ReadTokens over a negative token: %v", err)
	}
}

func TestOpenIndexedRefusesDamage(t *testing.T) {
	dir := t.TempDir()
	good := megatronIndex(8, []int32{2, 3}, []int64{0, 4}, []int64{0, 2})
	bin := make([]byte, 10)
	for _, tc := range []struct {
		name string
		idx  []byte
		bin  []byte
		want string
	}{
		{"version", func() []byte { b := slices.Clone(good); b[9] = 2; return b }(), bin, "index version 2"},
		{"float tokens", func() []byte { b := slices.Clone(good); b[17] = 7; return b }(), bin, "token dtype code 7 is not an integer type"},
		{"short index", good[:len(good)-3], bin, "bytes, but its header gives 2 sequences and 2 document indices"},
		{"multimodal", append(slices.Clone(good), 0, 0), bin, "a multimodal index"},
		{"gap between sequences", megatronIndex(8, []int32{2, 3}, []int64{0, 6}, []int64{0, 2}), bin, "sequence 1 starts at byte 6, not right after the one before (byte 4)"},
		{"negative length", megatronIndex(8, []int32{2, -3}, []int64{0, 4}, []int64{0, 2}), bin, "sequence 1 has a negative length -3"},
		{"documents not from 0", megatronIndex(8, []int32{2, 3}, []int64{0, 4}, []int64{1, 2}), bin, "the first document starts at sequence 1"},
		{"documents past the end", megatronIndex(8, []int32{2, 3}, []int64{0, 4}, []int64{0, 3}), bin, "document index 1 is 3"},
		{"documents short of the end", megatronIndex(8, []int32{2, 3}, []int64{0, 4}, []int64{0, 1}), bin, "the last document index is 1, not the sequence count 2"},
		{"short bin", good, bin[:8], "8 bytes, but"},
		{"long bin", good, append(bin, 0, 0), "12 bytes, but"},
	} {
		prefix := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "_"))
		writeFile(t, prefix+".bin", tc.bin)
		writeFile(t, prefix+".idx", tc.idx)
		_, err := OpenIndexed(prefix)
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), prefix) {
			t.Errorf("%s: error %v, want one naming the file and containing %q", tc.name, err, tc.want)
		}
		// A loader and Verify report the same.
		if _, err := NewEvalLoader(prefix, 2, 100, 0, 1); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: loader error %v", tc.name, err)
		}
		if _, err := Verify(context.Background(), []string{prefix + ".bin"}, 100); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Verify error %v", tc.name, err)
		}
	}
	if _, err := OpenIndexed(filepath.Join(dir, "missing")); err == nil || !strings.Contains(err.Error(), "not a Megatron indexed dataset") {
		t.Errorf("a missing dataset: %v", err)
	}
	if _, err := Glob(filepath.Join(dir, "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Glob of a missing plain path: %v", err)
	}
}
