package data

import (
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// testData writes shards of the given sizes whose tokens are their global
// positions (so every window is unique) and returns the glob and the
// windows, computed naively, in file order.
func testData(t *testing.T, sizes []int, seqLen int) (glob string, windows [][]int32) {
	t.Helper()
	dir := t.TempDir()
	pos := 0
	for i, n := range sizes {
		tokens := make([]uint32, n)
		for j := range tokens {
			tokens[j] = uint32(pos)
			pos++
		}
		if err := WriteShard(filepath.Join(dir, fmt.Sprintf("train_%06d.bin", i)), tokens, 1<<20); err != nil {
			t.Fatal(err)
		}
		for start := 0; start+seqLen+1 <= n; start += seqLen {
			w := make([]int32, seqLen+1)
			for j := range w {
				w[j] = int32(tokens[start+j])
			}
			windows = append(windows, w)
		}
	}
	return filepath.Join(dir, "train_*.bin"), windows
}

// nextWindows reads n single-sequence batches and returns them as windows
// of seqLen+1 tokens, checking that targets are inputs shifted by one.
func nextWindows(t *testing.T, next func(int) ([]int32, []int32, error), n, seqLen int) [][]int32 {
	t.Helper()
	var out [][]int32
	for range n {
		in, tg, err := next(1)
		if err != nil {
			t.Fatal(err)
		}
		if len(in) != seqLen || len(tg) != seqLen {
			t.Fatalf("batch of 1 has %d inputs and %d targets, want %d", len(in), len(tg), seqLen)
		}
		if !slices.Equal(in[1:], tg[:seqLen-1]) {
			t.Fatalf("targets %v are not inputs %v shifted by one", tg, in)
		}
		out = append(out, append(slices.Clone(in), tg[seqLen-1]))
	}
	return out
}

func key(w []int32) string { return fmt.Sprint(w) }

func sortedKeys(ws [][]int32) []string {
	ks := make([]string, len(ws))
	for i, w := range ws {
		ks[i] = key(w)
	}
	slices.Sort(ks)
	return ks
}

func TestLoaderEpochIsAPermutation(t *testing.T) {
	const seqLen = 8
	// The 5-token shard holds no window; the others end in partial windows.
	glob, windows := testData(t, []int{300, 5, 131, 77}, seqLen)
	l, err := NewLoader(glob, seqLen, 1<<20, 7, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if l.Tokens() != 513 {
		t.Fatalf("Tokens = %d, want 513", l.Tokens())
	}
	if l.Windows() != int64(len(windows)) {
		t.Fatalf("Windows = %d, naive count %d", l.Windows(), len(windows))
	}
	var epochs [][]string
	for e := range 2 {
		got := nextWindows(t, l.Next, len(windows), seqLen)
		if !slices.Equal(sortedKeys(got), sortedKeys(windows)) {
			t.Fatalf("epoch %d does not visit every window exactly once", e)
		}
		var order []string
		for _, w := range got {
			order = append(order, key(w))
		}
		epochs = append(epochs, order)
	}
	if slices.Equal(epochs[0], epochs[1]) {
		t.Fatal("two epochs have the same order")
	}
	var naive []string
	for _, w := range windows {
		naive = append(naive, key(w))
	}
	if slices.Equal(epochs[0], naive) {
		t.Fatal("the training order is file order: not shuffled")
	}
	if c := l.Cursor(); c != (Cursor{Epoch: 2, Index: 0}) {
		t.Fatalf("cursor after two epochs = %+v", c)
	}
}

func TestLoaderDeterminism(t *testing.T) {
	const seqLen = 16
	glob, windows := testData(t, []int{1000, 700}, seqLen)
	read := func(seed uint64) [][]int32 {
		l, err := NewLoader(glob, seqLen, 1<<20, seed, 0, 1)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		var out [][]int32
		for range 2 * len(windows) / 3 { // across an epoch boundary
			in, tg, err := l.Next(3)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, in, tg)
		}
		return out
	}
	a, b, c := read(5), read(5), read(6)
	for i := range a {
		if !slices.Equal(a[i], b[i]) {
			t.Fatalf("same seed, batch %d differs", i/2)
		}
	}
	same := 0
	for i := range a {
		if slices.Equal(a[i], c[i]) {
			same++
		}
	}
	if same > len(a)/10 {
		t.Fatalf("seeds 5 and 6 agree on %d of %d batches", same, len(a))
	}
}

func TestLoaderRanks(t *testing.T) {
	const seqLen, ranks = 4, 3
	glob, windows := testData(t, []int{130, 61, 90}, seqLen) // 32+15+22 = 69 windows
	if len(windows)%ranks != 0 {
		t.Fatalf("test data has %d windows, want a multiple of %d", len(windows), ranks)
	}
	one, err := NewLoader(glob, seqLen, 1<<20, 11, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	order := nextWindows(t, one.Next, len(windows), seqLen) // the epoch order, all ranks together

	var all [][]int32
	for r := range ranks {
		l, err := NewLoader(glob, seqLen, 1<<20, 11, r, ranks)
		if err != nil {
			t.Fatal(err)
		}
		if got := l.EpochBatches(1); got != int64(len(windows)/ranks) {
			t.Fatalf("rank %d: EpochBatches(1) = %d, want %d", r, got, len(windows)/ranks)
		}
		got := nextWindows(t, l.Next, len(windows)/ranks, seqLen)
		for i, w := range got {
			if !slices.Equal(w, order[r+i*ranks]) {
				t.Fatalf("rank %d's window %d is not position %d of the epoch order", r, i, r+i*ranks)
			}
		}
		all = append(all, got...)
		if c := l.Cursor(); c != (Cursor{Epoch: 1}) {
			t.Fatalf("rank %d: cursor after its share of the epoch = %+v, want epoch 1", r, c)
		}
		l.Close()
	}
	if !slices.Equal(sortedKeys(all), sortedKeys(windows)) {
		t.Fatal("the ranks' windows are not disjoint or do not cover the epoch")
	}

	// With 4 ranks and 69 windows each epoch drops its last position; the
	// ranks still read disjoint windows.
	seen := map[string]int{}
	for r := range 4 {
		l, err := NewLoader(glob, seqLen, 1<<20, 11, r, 4)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range nextWindows(t, l.Next, 17, seqLen) {
			seen[key(w)]++
		}
		if c := l.Cursor(); c != (Cursor{Epoch: 1}) {
			t.Fatalf("4 ranks: cursor after 17 windows = %+v, want epoch 1", c)
		}
		l.Close()
	}
	if len(seen) != 68 {
		t.Fatalf("4 ranks read %d distinct windows in an epoch, want 68", len(seen))
	}
	if _, ok := seen[key(order[68])]; ok {
		t.Fatal("4 ranks read the epoch's last position, which has no full group")
	}
}

func TestLoaderCursorResume(t *testing.T) {
	const seqLen = 8
	glob, windows := testData(t, []int{400, 250}, seqLen)
	rng := rand.New(rand.NewPCG(3, 4))
	for _, ranks := range []int{1, 2} {
		for trial := range 4 {
			before := rng.IntN(2 * len(windows) / ranks) // may cross an epoch
			batch := 1 + rng.IntN(3)
			for r := range ranks {
				a, err := NewLoader(glob, seqLen, 1<<20, 9, r, ranks)
				if err != nil {
					t.Fatal(err)
				}
				for range before {
					if _, _, err := a.Next(1); err != nil {
						t.Fatal(err)
					}
				}
				c := a.Cursor()
				var want [][]int32
				for range 10 {
					in, tg, err := a.Next(batch)
					if err != nil {
						t.Fatal(err)
					}
					want = append(want, in, tg)
				}
				b, err := NewLoader(glob, seqLen, 1<<20, 9, r, ranks)
				if err != nil {
					t.Fatal(err)
				}
				if err := b.Seek(c); err != nil {
					t.Fatal(err)
				}
				for i := 0; i < len(want); i += 2 {
					in, tg, err := b.Next(batch)
					if err != nil {
						t.Fatal(err)
					}
					if !slices.Equal(in, want[i]) || !slices.Equal(tg, want[i+1]) {
						t.Fatalf("ranks %d rank %d trial %d: batch %d after Seek(%+v) differs", ranks, r, trial, i/2, c)
					}
				}
				if a.Cursor() != b.Cursor() {
					t.Fatalf("cursors differ after the same reads: %+v and %+v", a.Cursor(), b.Cursor())
				}
				a.Close()
				b.Close()
			}
		}
	}
	l, err := NewLoader(glob, seqLen, 1<<20, 9, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for _, bad := range []Cursor{{Epoch: -1}, {Index: -1}, {Index: l.Windows() + 1}} {
		if err := l.Seek(bad); err == nil || !strings.Contains(err.Error(), glob) {
			t.Fatalf("Seek(%+v): error %v, want one naming the glob", bad, err)
		}
	}
}

func TestLoaderVocabError(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "train_000.bin")
	tokens := make([]uint32, 1000)
	tokens[123] = 70000
	if err := WriteShard(path, tokens, 100000); err != nil {
		t.Fatal(err)
	}
	l, err := NewLoader(filepath.Join(dir, "*.bin"), 64, 32768, 1, 0, 1)
	if err != nil {
		t.Fatalf("the vocab check is per window, so opening must succeed: %v", err)
	}
	defer l.Close()
	want := path + ": token 70000 at position 123 is >= model.vocab 32768"
	for range l.Windows() {
		c := l.Cursor()
		_, _, err := l.Next(1)
		if err == nil {
			continue
		}
		if err.Error() != want {
			t.Fatalf("error %q, want %q", err, want)
		}
		if l.Cursor() != c {
			t.Fatalf("a failed Next moved the cursor from %+v to %+v", c, l.Cursor())
		}
		return
	}
	t.Fatal("an epoch read without meeting the bad token")
}

func TestLoaderArgumentErrors(t *testing.T) {
	glob, _ := testData(t, []int{100}, 8)
	nomatch := filepath.Join(t.TempDir(), "nothing_*.bin")
	for _, tc := range []struct {
		glob          string
		seqLen, vocab int
		rank, ranks   int
		want          string
	}{
		{nomatch, 8, 1 << 20, 0, 1, "matches no files"},
		{"[", 8, 1 << 20, 0, 1, "syntax error"},
		{glob, 0, 1 << 20, 0, 1, "sequence length 0"},
		{glob, 8, 0, 0, 1, "vocab 0"},
		{glob, 8, 1 << 20, 2, 2, "rank 2 is outside 0..1"},
		{glob, 8, 1 << 20, 0, 0, "ranks 0"},
		{glob, 8, 1 << 20, 0, 13, "number of ranks, 13"}, // 100 tokens hold 12 windows
		{glob, 200, 1 << 20, 0, 1, "0 windows"},
	} {
		_, err := NewLoader(tc.glob, tc.seqLen, tc.vocab, 1, tc.rank, tc.ranks)
		if err == nil || !strings.Contains(err.Error(), tc.glob) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewLoader(%q, seq %d, vocab %d, rank %d/%d): error %v, want one naming the glob and saying %q",
				tc.glob, tc.seqLen, tc.vocab, tc.rank, tc.ranks, err, tc.want)
		}
	}
	// A bad shard among good ones is named.
	dir := filepath.Dir(glob)
	writeFile(t, filepath.Join(dir, "train_000009.bin"), rawShard(MagicUint16, 1, 10, nil))
	if _, err := NewLoader(glob, 8, 1<<20, 1, 0, 1); err == nil || !strings.Contains(err.Error(), "train_000009.bin") {
		t.Fatalf("truncated shard in the glob: error %v", err)
	}
	l, err := NewLoader(filepath.Join(dir, "train_000000.bin"), 8, 1<<20, 1, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.Next(0); err == nil {
		t.Fatal("Next(0) succeeded")
	}
}

func TestEvalLoader(t *testing.T) {
	const seqLen, ranks = 8, 2
	glob, windows := testData(t, []int{200, 90}, seqLen) // 24+11 = 35 windows
	for r := range ranks {
		e, err := NewEvalLoader(glob, seqLen, 1<<20, r, ranks)
		if err != nil {
			t.Fatal(err)
		}
		n := len(windows) / ranks
		first := nextWindows(t, e.Next, n, seqLen)
		for i, w := range first {
			if !slices.Equal(w, windows[r+i*ranks]) {
				t.Fatalf("rank %d: eval window %d is not file-order window %d", r, i, r+i*ranks)
			}
		}
		// Past the end it wraps to the beginning.
		wrapped := nextWindows(t, e.Next, 1, seqLen)
		if !slices.Equal(wrapped[0], windows[r]) {
			t.Fatalf("rank %d: reading past the end does not wrap to the first window", r)
		}
		e.Reset()
		if e.Cursor() != (Cursor{}) {
			t.Fatalf("cursor after Reset = %+v", e.Cursor())
		}
		again := nextWindows(t, e.Next, n, seqLen)
		if !slices.Equal(sortedKeys(again), sortedKeys(first)) || key(again[0]) != key(first[0]) {
			t.Fatalf("rank %d: batches after Reset differ", r)
		}
		e.Close()
	}
}

func TestMemorySourceLoader(t *testing.T) {
	tokens := make([]uint32, 500)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	src := NewMemorySource("mem", tokens)
	l, err := NewLoaderFromSources("mem", []TokenSource{src}, 10, 512, 3, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int32]bool{}
	for range 49 / 7 {
		in, tg, err := l.Next(7)
		if err != nil {
			t.Fatal(err)
		}
		for b := range 7 {
			start := in[b*10]
			if start%10 != 0 || seen[start] {
				t.Fatalf("row %d starts at token %d: not a new window start", b, start)
			}
			seen[start] = true
			for j := range int32(10) {
				if in[b*10+int(j)] != start+j || tg[b*10+int(j)] != start+j+1 {
					t.Fatalf("row %d is not the window at %d", b, start)
				}
			}
		}
	}
	if len(seen) != 49 {
		t.Fatalf("an epoch read %d distinct windows of 49", len(seen))
	}
	if _, err := NewLoaderFromSources("mem", []TokenSource{src}, 10, 256, 3, 0, 1); err != nil {
		t.Fatal(err) // tokens >= 256 are found only when read
	}
	if err := src.ReadTokens(make([]uint32, 2), 499); err == nil || !strings.Contains(err.Error(), "mem") {
		t.Fatalf("read past the end: %v", err)
	}
}
