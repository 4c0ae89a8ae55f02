package data

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// uint16Shard is a uint16 shard of n tokens, token i being i%vocab, with
// the ids of bad (position -> id) put in.
func uint16Shard(n, vocab int, bad map[int]uint16) []byte {
	payload := make([]byte, 2*n)
	for i := range n {
		binary.LittleEndian.PutUint16(payload[2*i:], uint16(i%vocab))
	}
	for pos, id := range bad {
		binary.LittleEndian.PutUint16(payload[2*pos:], id)
	}
	return rawShard(MagicUint16, VersionUint16, int32(n), payload)
}

func TestVerifyGoodShards(t *testing.T) {
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a.bin"), filepath.Join(dir, "b.bin")
	writeFile(t, a, uint16Shard(1000, 256, nil))
	if err := WriteShard(b, []uint32{5, 70000, 3}, 70001); err != nil { // uint32 tokens
		t.Fatal(err)
	}
	sum, err := Verify(context.Background(), []string{a, b}, 70001)
	if err != nil {
		t.Fatal(err)
	}
	if len(sum.Shards) != 2 || sum.Tokens != 1003 || sum.MaxToken != 70000 {
		t.Fatalf("summary %+v: want 2 shards, 1003 tokens, largest id 70000", sum)
	}
	if s := sum.Shards[0]; s.Path != a || s.Header.TokenBytes() != 2 || s.Bytes != HeaderBytes+2000 || s.MaxToken != 255 {
		t.Errorf("shard a: %+v", s)
	}
	if s := sum.Shards[1]; s.Header.TokenBytes() != 4 || s.Bytes != HeaderBytes+12 || s.MaxToken != 70000 {
		t.Errorf("shard b: %+v", s)
	}
	if sum.Bytes != sum.Shards[0].Bytes+sum.Shards[1].Bytes {
		t.Errorf("total bytes %d", sum.Bytes)
	}
	// Without a vocabulary only the format is checked; the largest id is
	// still reported.
	if sum, err := Verify(context.Background(), []string{a, b}, 0); err != nil || sum.MaxToken != 70000 {
		t.Errorf("vocab 0: %+v, %v", sum, err)
	}
	// The largest id itself is the limit: 70000 is not below 70000.
	if _, err := Verify(context.Background(), []string{b}, 70000); err == nil ||
		!strings.Contains(err.Error(), "token id 70000 at position 1 (byte offset 1028) is >= vocab 70000") {
		t.Errorf("vocab 70000: got %v", err)
	}
}

// TestVerifyBadIDNamesTheFirst: shards larger than one chunk, bad ids in
// several chunks and shards; whichever worker finds one first, the error
// is the earliest in path order, then position order.
func TestVerifyBadIDNamesTheFirst(t *testing.T) {
	dir := t.TempDir()
	chunkTokens := verifyChunkBytes / 2
	n := 2*chunkTokens + 1000
	good := filepath.Join(dir, "0.bin")
	first := filepath.Join(dir, "1.bin")
	later := filepath.Join(dir, "2.bin")
	writeFile(t, good, uint16Shard(n, 256, nil))
	writeFile(t, first, uint16Shard(n, 256, map[int]uint16{chunkTokens + 7: 300, 2*chunkTokens + 5: 999}))
	writeFile(t, later, uint16Shard(n, 256, map[int]uint16{3: 400}))
	for range 5 { // the workers race: the answer must not depend on which wins
		_, err := Verify(context.Background(), []string{good, first, later}, 256)
		pos := chunkTokens + 7
		want := fmt.Sprintf("%s: token id 300 at position %d (byte offset %d) is >= vocab 256", first, pos, HeaderBytes+2*pos)
		if err == nil || err.Error() != want {
			t.Fatalf("got %v\nwant %s", err, want)
		}
	}
	// A vocabulary large enough for every id passes.
	if sum, err := Verify(context.Background(), []string{good, first, later}, 1000); err != nil || sum.MaxToken != 999 {
		t.Fatalf("vocab 1000: %+v, %v", sum.MaxToken, err)
	}
}

func TestVerifyFormatErrors(t *testing.T) {
	dir := t.TempDir()
	good := uint16Shard(100, 256, nil)
	cases := []struct {
		name string
		data []byte
		want string
	}{
		{"truncated", good[:len(good)-2], "truncated: the header says 100 tokens of 2 bytes, so the file should be 1224 bytes, but it is 1222 bytes"},
		{"trailing", append(append([]byte{}, good...), 0, 0), "2 trailing bytes"},
		{"badmagic", rawShard(12345, 1, 1, []byte{0, 0}), "bad magic 12345"},
		{"badversion", rawShard(MagicUint16, 7, 1, []byte{0, 0}), "found version 7"},
		{"short", []byte{1, 2, 3}, "header is 3 bytes, want 1024"},
	}
	for _, c := range cases {
		p := filepath.Join(dir, c.name+".bin")
		writeFile(t, p, c.data)
		_, err := Verify(context.Background(), []string{p}, 256)
		if err == nil || !strings.HasPrefix(err.Error(), p+": ") || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %v, want %s: ...%s", c.name, err, p, c.want)
		}
	}
	if _, err := Verify(context.Background(), []string{filepath.Join(dir, "missing.bin")}, 256); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: got %v", err)
	}
	if _, err := Verify(context.Background(), []string{dir}, 256); err == nil || !strings.Contains(err.Error(), "is a directory") {
		t.Errorf("directory: got %v", err)
	}
}

func TestVerifyCancelled(t *testing.T) {
	p := filepath.Join(t.TempDir(), "a.bin")
	writeFile(t, p, uint16Shard(1000, 256, nil))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Verify(ctx, []string{p}, 256); !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want context.Canceled", err)
	}
}

func TestGlob(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"b.bin", "a.bin", "c.txt"} {
		writeFile(t, filepath.Join(dir, name), nil)
	}
	paths, err := Glob(filepath.Join(dir, "*.bin"))
	if err != nil || len(paths) != 2 || filepath.Base(paths[0]) != "a.bin" || filepath.Base(paths[1]) != "b.bin" {
		t.Fatalf("got %v, %v", paths, err)
	}
	if _, err := Glob(filepath.Join(dir, "*.none")); err == nil || !strings.Contains(err.Error(), "matches no files") {
		t.Fatalf("no match: got %v", err)
	}
}
