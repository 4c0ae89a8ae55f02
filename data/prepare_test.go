package data

import (
	"bytes"
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// readShards concatenates the tokens of shards, checking each is a uint16
// shard of at most shardTokens tokens and all but the last exactly that.
func readShards(t *testing.T, paths []string, shardTokens int) []byte {
	t.Helper()
	var out []byte
	for i, p := range paths {
		s, err := OpenShard(p)
		if err != nil {
			t.Fatal(err)
		}
		if s.Header().Magic != MagicUint16 {
			t.Fatalf("%s: magic %d, want uint16 shards", p, s.Header().Magic)
		}
		if n := s.Len(); n > int64(shardTokens) || (i < len(paths)-1 && n != int64(shardTokens)) || n == 0 {
			t.Fatalf("%s: %d tokens, shard size %d", p, n, shardTokens)
		}
		ts := make([]uint32, s.Len())
		if err := s.ReadTokens(ts, 0); err != nil {
			t.Fatal(err)
		}
		b, err := DecodeBytes(ts)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, b...)
		s.Close()
	}
	return out
}

func TestPrepareRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	in := t.TempDir()
	out := filepath.Join(t.TempDir(), "shards")
	// Random bytes of every value: the byte-level tokenizer takes any file.
	var contents [][]byte
	var inputs []string
	for i, n := range []int{1000, 0, 2345, 7, 1} {
		b := make([]byte, n)
		for j := range b {
			b[j] = byte(rng.IntN(256))
		}
		name := filepath.Join(in, string(rune('a'+i))+".txt")
		writeFile(t, name, b)
		contents = append(contents, b)
		if i < 2 {
			inputs = append(inputs, name)
		}
	}
	// A glob for the rest, and a file named twice, which is read once.
	inputs = append(inputs, filepath.Join(in, "[c-e].txt"), filepath.Join(in, "a.txt"))

	const valFraction, shardTokens = 0.1, 300
	var calls []int64
	st, err := Prepare(context.Background(), inputs, out, valFraction, shardTokens, func(done, total int64) {
		if total != 3353 {
			t.Errorf("progress total %d, want 3353", total)
		}
		calls = append(calls, done)
	})
	if err != nil {
		t.Fatal(err)
	}
	var wantTrain, wantVal []byte
	for _, b := range contents {
		v := int(math.Ceil(float64(len(b)) * valFraction))
		wantTrain = append(wantTrain, b[:len(b)-v]...)
		wantVal = append(wantVal, b[len(b)-v:]...)
	}
	if got := readShards(t, st.TrainShards, shardTokens); !bytes.Equal(got, wantTrain) {
		t.Fatalf("train shards hold %d bytes, not the %d expected", len(got), len(wantTrain))
	}
	if got := readShards(t, st.ValShards, shardTokens); !bytes.Equal(got, wantVal) {
		t.Fatalf("val shards hold %d bytes, not the %d expected", len(got), len(wantVal))
	}
	if st.Files != 5 || st.Bytes != 3353 || st.TrainTokens != int64(len(wantTrain)) || st.ValTokens != int64(len(wantVal)) {
		t.Fatalf("stats %+v", st)
	}
	if len(st.TrainShards) != 11 || st.TrainShards[0] != filepath.Join(out, "train_000000.bin") ||
		st.ValShards[1] != filepath.Join(out, "val_000001.bin") {
		t.Fatalf("shard paths %v %v", st.TrainShards, st.ValShards)
	}
	if !slices.IsSorted(calls) || len(calls) == 0 || calls[len(calls)-1] != 3353 {
		t.Fatalf("progress calls %v", calls)
	}
	entries, _ := os.ReadDir(out)
	if len(entries) != len(st.TrainShards)+len(st.ValShards) {
		t.Fatalf("%s holds %d entries, want only the shards", out, len(entries))
	}

	// The shards feed the loaders.
	l, err := NewLoader(filepath.Join(out, "train_*.bin"), 16, ByteVocab, 1, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.Next(2); err != nil {
		t.Fatal(err)
	}
	l.Close()

	// A second run into the same directory refuses to mix datasets.
	if _, err := Prepare(context.Background(), inputs, out, valFraction, shardTokens, nil); err == nil || !strings.Contains(err.Error(), "already holds shards") {
		t.Fatalf("second Prepare into %s: error %v", out, err)
	}
}

func TestPrepareValSplit(t *testing.T) {
	in := t.TempDir()
	small := filepath.Join(in, "small.txt")
	writeFile(t, small, []byte("abc"))
	// A tiny val fraction still gives a val shard.
	st, err := Prepare(context.Background(), []string{small}, filepath.Join(t.TempDir(), "a"), 0.01, 100, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.ValShards) != 1 || st.ValTokens != 1 || st.TrainTokens != 2 {
		t.Fatalf("valFraction 0.01 of 3 bytes: %+v", st)
	}
	// Zero writes none.
	st, err = Prepare(context.Background(), []string{small}, filepath.Join(t.TempDir(), "b"), 0, 100, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.ValShards) != 0 || st.TrainTokens != 3 {
		t.Fatalf("valFraction 0: %+v", st)
	}
}

func TestPrepareErrors(t *testing.T) {
	in := t.TempDir()
	good := filepath.Join(in, "good.txt")
	writeFile(t, good, []byte("hello"))
	missing := filepath.Join(in, "missing.txt")
	for _, tc := range []struct {
		inputs      []string
		valFraction float64
		shardTokens int
		want        string
	}{
		{[]string{good, missing}, 0.1, 100, missing},
		{[]string{filepath.Join(in, "*.md")}, 0.1, 100, filepath.Join(in, "*.md")},
		{[]string{in}, 0.1, 100, in + " is not a regular file"},
		{[]string{good}, 1, 100, "val fraction 1"},
		{[]string{good}, math.NaN(), 100, "val fraction NaN"},
		{[]string{good}, 0.1, 0, "shard size 0"},
		{nil, 0.1, 100, "no input files"},
	} {
		out := filepath.Join(t.TempDir(), "out")
		_, err := Prepare(context.Background(), tc.inputs, out, tc.valFraction, tc.shardTokens, nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Prepare(%v, %v, %d): error %v, want one containing %q", tc.inputs, tc.valFraction, tc.shardTokens, err, tc.want)
		}
		if entries, _ := os.ReadDir(out); len(entries) != 0 {
			t.Errorf("Prepare(%v) failed but left %d files", tc.inputs, len(entries))
		}
	}
}

// TestPrepareStopsWhenCancelled cancels Prepare from its progress callback
// after the first MiB: it must stop there, return the cancel cause and
// leave no shard and no output directory behind.
func TestPrepareStopsWhenCancelled(t *testing.T) {
	in := filepath.Join(t.TempDir(), "big.txt")
	writeFile(t, in, bytes.Repeat([]byte("0123456789abcdef"), 1<<18)) // 4 MiB
	out := filepath.Join(t.TempDir(), "out")
	stopCause := errors.New("stop requested")
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	var seen int64
	_, err := Prepare(ctx, []string{in}, out, 0.1, 1<<16, func(done, total int64) {
		seen = done
		cancel(stopCause)
	})
	if !errors.Is(err, stopCause) {
		t.Fatalf("Prepare after cancel: error %v, want one wrapping %v", err, stopCause)
	}
	if seen != 1<<20 {
		t.Errorf("read %d bytes before stopping, want one block of %d", seen, 1<<20)
	}
	if _, statErr := os.Stat(out); !errors.Is(statErr, os.ErrNotExist) {
		t.Errorf("the output directory %s is left after the stop: %v", out, statErr)
	}
}

func TestEncodeDecodeBytes(t *testing.T) {
	b := make([]byte, 256)
	for i := range b {
		b[i] = byte(255 - i)
	}
	ts := EncodeBytes(b)
	for i, tok := range ts {
		if tok != uint32(b[i]) {
			t.Fatalf("token %d = %d, want %d", i, tok, b[i])
		}
	}
	back, err := DecodeBytes(ts)
	if err != nil || !bytes.Equal(back, b) {
		t.Fatalf("DecodeBytes(EncodeBytes(b)) = %v, %v", back, err)
	}
	if _, err := DecodeBytes([]uint32{65, 256}); err == nil || !strings.Contains(err.Error(), "token 256 at position 1") {
		t.Fatalf("DecodeBytes of 256: error %v", err)
	}
}
