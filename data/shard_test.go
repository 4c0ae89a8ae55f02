package data

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// rawShard builds a shard's bytes independently of the package's encoder:
// 256 little-endian int32 via encoding/binary, then the payload as given.
func rawShard(magic, version, ntok int32, payload []byte) []byte {
	var hdr [256]int32
	hdr[0], hdr[1], hdr[2] = magic, version, ntok
	var b bytes.Buffer
	binary.Write(&b, binary.LittleEndian, hdr)
	b.Write(payload)
	return b.Bytes()
}

func writeFile(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func randomTokens(rng *rand.Rand, n, vocab int) []uint32 {
	ts := make([]uint32, n)
	for i := range ts {
		ts[i] = uint32(rng.IntN(vocab))
	}
	if n > 0 {
		ts[n-1] = uint32(vocab - 1) // the largest id must survive the round trip
	}
	return ts
}

func TestWriteShardRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	dir := t.TempDir()
	for _, tc := range []struct {
		vocab          int
		magic, version int32
		tokenBytes     int
	}{
		{256, MagicUint16, VersionUint16, 2},
		{65536, MagicUint16, VersionUint16, 2},
		{65537, MagicUint32, VersionUint32, 4},
		{1 << 20, MagicUint32, VersionUint32, 4},
	} {
		path := filepath.Join(dir, fmt.Sprintf("v%d.bin", tc.vocab))
		tokens := randomTokens(rng, 1000+rng.IntN(100), tc.vocab)
		if err := WriteShard(path, tokens, tc.vocab); err != nil {
			t.Fatal(err)
		}
		raw, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		// Independent decode of the bytes on disk.
		var hdr [256]int32
		if err := binary.Read(bytes.NewReader(raw), binary.LittleEndian, &hdr); err != nil {
			t.Fatal(err)
		}
		if hdr[0] != tc.magic || hdr[1] != tc.version || int(hdr[2]) != len(tokens) {
			t.Fatalf("vocab %d: header %v, want magic %d version %d tokens %d", tc.vocab, hdr[:3], tc.magic, tc.version, len(tokens))
		}
		if want := 1024 + len(tokens)*tc.tokenBytes; len(raw) != want {
			t.Fatalf("vocab %d: file is %d bytes, want %d", tc.vocab, len(raw), want)
		}
		for i, tok := range tokens {
			var got uint32
			if tc.tokenBytes == 2 {
				got = uint32(raw[1024+2*i]) | uint32(raw[1024+2*i+1])<<8
			} else {
				got = binary.LittleEndian.Uint32(raw[1024+4*i:])
			}
			if got != tok {
				t.Fatalf("vocab %d: token %d on disk is %d, want %d", tc.vocab, i, got, tok)
			}
		}

		h, err := ReadShardHeader(bytes.NewReader(raw))
		if err != nil {
			t.Fatal(err)
		}
		if h != (ShardHeader{Magic: tc.magic, Version: tc.version, Tokens: int64(len(tokens))}) || h.TokenBytes() != tc.tokenBytes {
			t.Fatalf("vocab %d: ReadShardHeader = %+v", tc.vocab, h)
		}

		// Both access paths: payload in memory (OpenShard here) and read
		// window by window (newShard with no memory allowance).
		s, err := OpenShard(path)
		if err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		disk, err := newShard(path, f, int64(len(raw)), 0)
		if err != nil {
			t.Fatal(err)
		}
		if !s.inMemory || disk.inMemory {
			t.Fatalf("access paths: OpenShard in memory %v, newShard(limit 0) in memory %v", s.inMemory, disk.inMemory)
		}
		for _, src := range []*Shard{s, disk} {
			if src.Len() != int64(len(tokens)) {
				t.Fatalf("Len = %d, want %d", src.Len(), len(tokens))
			}
			for range 20 {
				off := rng.IntN(len(tokens))
				n := rng.IntN(len(tokens) - off + 1)
				got := make([]uint32, n)
				if err := src.ReadTokens(got, int64(off)); err != nil {
					t.Fatal(err)
				}
				if !slicesEqual(got, tokens[off:off+n]) {
					t.Fatalf("vocab %d in memory %v: ReadTokens(%d, %d) differs", tc.vocab, src.inMemory, off, n)
				}
			}
			err := src.ReadTokens(make([]uint32, 2), int64(len(tokens)-1))
			if err == nil || !strings.Contains(err.Error(), path) {
				t.Fatalf("read past the end: error %v, want one naming %s", err, path)
			}
		}
		s.Close()
		f.Close()
	}
}

func slicesEqual[T comparable](a, b []T) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestWriteShardErrors(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "bad.bin")
	err := WriteShard(path, []uint32{1, 2, 300, 4}, 256)
	if err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "token 300 at position 2") {
		t.Fatalf("token >= vocab: error %v", err)
	}
	if err := WriteShard(path, []uint32{1}, 0); err == nil || !strings.Contains(err.Error(), path) {
		t.Fatalf("vocab 0: error %v", err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("a failed WriteShard left %s behind (%v)", path, err)
	}
}

func TestWriteShardReplacesAtomically(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "s.bin")
	for _, tokens := range [][]uint32{{1, 2, 3, 4, 5}, {9, 8}} {
		if err := WriteShard(path, tokens, 256); err != nil {
			t.Fatal(err)
		}
		s, err := OpenShard(path)
		if err != nil {
			t.Fatal(err)
		}
		got := make([]uint32, s.Len())
		if err := s.ReadTokens(got, 0); err != nil {
			t.Fatal(err)
		}
		if !slicesEqual(got, tokens) {
			t.Fatalf("read back %v, want %v", got, tokens)
		}
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Fatalf("directory holds %d entries after two writes, want 1 (temporary files left?)", len(entries))
	}
}

func TestOpenShardErrors(t *testing.T) {
	dir := t.TempDir()
	payload16 := make([]byte, 2*100)
	for _, tc := range []struct {
		name  string
		bytes []byte
		want  []string // substrings of the error besides the path
	}{
		{"bad_magic.bin", rawShard(12345, 1, 100, payload16), []string{"bad magic 12345"}},
		{"bad_version16.bin", rawShard(MagicUint16, 7, 100, payload16), []string{"version 1", "found version 7"}},
		{"bad_version32.bin", rawShard(MagicUint32, 1, 50, payload16), []string{"version 7", "found version 1"}},
		{"truncated.bin", rawShard(MagicUint16, 1, 100, payload16[:150]), []string{"truncated", "1224 bytes", "1174 bytes"}},
		{"truncated32.bin", rawShard(MagicUint32, 7, 100, payload16), []string{"truncated", "1424 bytes", "1224 bytes"}},
		{"trailing.bin", rawShard(MagicUint16, 1, 99, payload16), []string{"trailing", "1222 bytes", "1224 bytes"}},
		{"negative.bin", rawShard(MagicUint16, 1, -5, nil), []string{"negative token count -5"}},
		{"short.bin", rawShard(MagicUint16, 1, 0, nil)[:500], []string{"header is 500 bytes, want 1024"}},
		{"empty.bin", nil, []string{"header is 0 bytes"}},
	} {
		path := filepath.Join(dir, tc.name)
		writeFile(t, path, tc.bytes)
		_, err := OpenShard(path)
		if err == nil {
			t.Fatalf("%s: OpenShard succeeded", tc.name)
		}
		for _, w := range append([]string{path}, tc.want...) {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: error %q does not contain %q", tc.name, err, w)
			}
		}
	}
	if _, err := OpenShard(filepath.Join(dir, "missing.bin")); err == nil || !strings.Contains(err.Error(), "missing.bin") {
		t.Fatalf("missing file: error %v", err)
	}
	// An empty but valid shard opens.
	path := filepath.Join(dir, "zero.bin")
	writeFile(t, path, rawShard(MagicUint32, 7, 0, nil))
	s, err := OpenShard(path)
	if err != nil || s.Len() != 0 {
		t.Fatalf("empty shard: %v, %v", s, err)
	}
}

func TestSplitMix64KnownAnswers(t *testing.T) {
	// The first outputs of SplitMix64 seeded with 0, as the reference C
	// implementation (Vigna, splitmix64.c) prints them.
	r := SplitMix64{}
	for i, want := range []uint64{0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f} {
		if got := r.Uint64(); got != want {
			t.Fatalf("output %d = %#x, want %#x", i, got, want)
		}
	}
	saved := r
	a, b := r.Uint64(), saved.Uint64()
	if a != b {
		t.Fatal("a copied state does not continue the same stream")
	}
	for range 1000 {
		if v := r.Intn(7); v < 0 || v >= 7 {
			t.Fatalf("Intn(7) = %d", v)
		}
	}
}

func TestPermutation(t *testing.T) {
	for _, n := range []uint64{1, 2, 3, 4, 5, 7, 8, 9, 31, 64, 65, 1000, 4097} {
		p := newPermutation(n, 42, 3)
		seen := make([]bool, n)
		var displacement float64
		for i := range n {
			v := p.at(i)
			if v >= n || seen[v] {
				t.Fatalf("n=%d: at(%d) = %d is out of range or repeated", n, i, v)
			}
			seen[v] = true
			displacement += float64(max(v, i) - min(v, i))
		}
		// A uniform random permutation moves an element n/3 on average.
		if n >= 1000 {
			if mean := displacement / float64(n); mean < 0.28*float64(n) || mean > 0.39*float64(n) {
				t.Errorf("n=%d: mean displacement %.0f, want about %.0f", n, mean, float64(n)/3)
			}
		}
	}
	// Different epochs and seeds give different orders.
	a, b, c := newPermutation(1000, 42, 0), newPermutation(1000, 42, 1), newPermutation(1000, 43, 0)
	var sameAB, sameAC int
	for i := range uint64(1000) {
		if a.at(i) == b.at(i) {
			sameAB++
		}
		if a.at(i) == c.at(i) {
			sameAC++
		}
	}
	if sameAB > 20 || sameAC > 20 {
		t.Fatalf("orders agree at %d (epochs) and %d (seeds) of 1000 positions", sameAB, sameAC)
	}
}
