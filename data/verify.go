package data

// This file checks shards in full before anything trains on them: headers,
// sizes, and every token id against the vocabulary. The loaders check ids
// only as windows are read, so without this one bad id in the middle of a
// shard fails a run at the step that reads it, after the steps before it
// were spent, and again on every resume.

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
)

// verifyChunkBytes is how much of a shard one worker reads at a time: the
// check's memory is this times the number of workers, whatever the data's
// size.
const verifyChunkBytes = 4 << 20

// ShardSummary describes one shard Verify checked.
type ShardSummary struct {
	Path     string
	Header   ShardHeader
	Bytes    int64  // file size: HeaderBytes + Tokens*TokenBytes
	MaxToken uint32 // the largest token id (0 when the shard has no tokens)
}

// Summary is what Verify found in shards that passed.
type Summary struct {
	Shards   []ShardSummary // in the order of the paths given
	Tokens   int64
	Bytes    int64
	MaxToken uint32 // the largest token id of all the shards
}

// TokenError is Verify's error for a token id that is not below the
// vocabulary: the first such id, where it is.
type TokenError struct {
	Path       string
	Position   int64 // token index in the shard
	ByteOffset int64 // in the file: HeaderBytes + Position*TokenBytes
	ID         uint32
	Vocab      int
}

func (e *TokenError) Error() string {
	return fmt.Sprintf("%s: token id %d at position %d (byte offset %d) is >= vocab %d",
		e.Path, e.ID, e.Position, e.ByteOffset, e.Vocab)
}

// Glob is the sorted list of files matching pattern; matching nothing is an
// error. The loaders read their shards in this order.
func Glob(pattern string) ([]string, error) {
	paths, err := filepath.Glob(pattern)
	if err != nil {
		return nil, fmt.Errorf("data glob %q: %w", pattern, err)
	}
	if len(paths) == 0 {
		return nil, fmt.Errorf("data glob %q matches no files", pattern)
	}
	slices.Sort(paths)
	return paths, nil
}

// Verify checks the shards at paths in full: each header (magic, version,
// token count), that each file's size is the header's plus tokens times
// the token width, and, when vocab > 0, that every token id is below
// vocab. It reads the shards in chunks of a few MiB on one worker per core,
// so its memory stays bounded and its time is the disk's (or the page
// cache's) read time. The first problem, in the order of paths and then
// of positions, is the error, naming the file; a bad id is a *TokenError,
// with its position (token index) and byte offset. A cancelled ctx stops it with
// ctx's error.
func Verify(ctx context.Context, paths []string, vocab int) (Summary, error) {
	sum := Summary{Shards: make([]ShardSummary, len(paths))}
	for i, p := range paths {
		h, size, err := statShard(p)
		if err != nil {
			return Summary{}, err
		}
		sum.Shards[i] = ShardSummary{Path: p, Header: h, Bytes: size}
		sum.Tokens += h.Tokens
		sum.Bytes += size
	}
	chunks := verifyChunks(sum.Shards)
	maxTokens, err := scanChunks(ctx, sum.Shards, chunks, vocab)
	if err != nil {
		return Summary{}, err
	}
	for i := range sum.Shards {
		sum.Shards[i].MaxToken = maxTokens[i]
		sum.MaxToken = max(sum.MaxToken, maxTokens[i])
	}
	return sum, nil
}

// statShard reads and checks the header of the shard at path and that the
// file's size matches it, with OpenShard's errors.
func statShard(path string) (ShardHeader, int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return ShardHeader{}, 0, err // *PathError names the file
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return ShardHeader{}, 0, err
	}
	if st.IsDir() {
		return ShardHeader{}, 0, fmt.Errorf("%s: is a directory, not a token shard", path)
	}
	// A memory limit of -1 checks the header and size and reads no tokens.
	s, err := newShard(path, f, st.Size(), -1)
	if err != nil {
		return ShardHeader{}, 0, err
	}
	return s.header, st.Size(), nil
}

// verifyChunk is a run of tokens of one shard that one worker checks.
type verifyChunk struct {
	shard      int   // index into the shards
	start, end int64 // token positions [start, end)
}

// verifyChunks cuts the shards into chunks in (shard, position) order, so
// that a lower chunk index is an earlier place in the data.
func verifyChunks(shards []ShardSummary) []verifyChunk {
	var chunks []verifyChunk
	for i, s := range shards {
		step := int64(verifyChunkBytes / s.Header.TokenBytes())
		for start := int64(0); start < s.Header.Tokens; start += step {
			chunks = append(chunks, verifyChunk{shard: i, start: start, end: min(start+step, s.Header.Tokens)})
		}
	}
	return chunks
}

// scanChunks reads every chunk on GOMAXPROCS workers and returns each
// shard's largest token id, or the error of the earliest chunk that failed.
// Once a chunk has failed, the chunks after it are skipped: they cannot hold
// an earlier problem.
func scanChunks(ctx context.Context, shards []ShardSummary, chunks []verifyChunk, vocab int) ([]uint32, error) {
	workers := min(runtime.GOMAXPROCS(0), len(chunks))
	var (
		next      atomic.Int64 // the next chunk to take
		firstBad  atomic.Int64 // the earliest chunk that failed; len(chunks) while none has
		mu        sync.Mutex
		errs      = make(map[int]error)
		maxTokens = make([][]uint32, workers) // by worker, then shard: no sharing while scanning
		wg        sync.WaitGroup
	)
	firstBad.Store(int64(len(chunks)))
	for w := range workers {
		maxTokens[w] = make([]uint32, len(shards))
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, verifyChunkBytes)
			for {
				c := int(next.Add(1) - 1)
				if c >= len(chunks) || int64(c) > firstBad.Load() {
					return
				}
				if ctx.Err() != nil {
					return
				}
				m, err := scanChunk(shards[chunks[c].shard], chunks[c], buf, vocab)
				if err != nil {
					mu.Lock()
					errs[c] = err
					mu.Unlock()
					for {
						old := firstBad.Load()
						if int64(c) >= old || firstBad.CompareAndSwap(old, int64(c)) {
							break
						}
					}
					continue
				}
				s := chunks[c].shard
				maxTokens[w][s] = max(maxTokens[w][s], m)
			}
		}()
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if bad := int(firstBad.Load()); bad < len(chunks) {
		return nil, errs[bad]
	}
	out := make([]uint32, len(shards))
	for _, perWorker := range maxTokens {
		for s, m := range perWorker {
			out[s] = max(out[s], m)
		}
	}
	return out, nil
}

// scanChunk reads chunk c of shard s into buf and returns its largest
// token id, or an error naming the first id >= vocab (when vocab > 0).
func scanChunk(s ShardSummary, c verifyChunk, buf []byte, vocab int) (uint32, error) {
	tb := int64(s.Header.TokenBytes())
	raw := buf[:(c.end-c.start)*tb]
	f, err := os.Open(s.Path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	off := HeaderBytes + c.start*tb
	if err := readFullAt(f, raw, off); err != nil {
		return 0, fmt.Errorf("%s: reading tokens [%d, %d): %w", s.Path, c.start, c.end, err)
	}
	m := maxToken(raw, int(tb))
	if vocab > 0 && int64(m) >= int64(vocab) {
		i := firstAtLeast(raw, int(tb), uint32(min(int64(vocab), int64(^uint32(0)))))
		pos := c.start + int64(i)
		return 0, &TokenError{Path: s.Path, Position: pos, ByteOffset: HeaderBytes + pos*tb, ID: tokenAt(raw, int(tb), i), Vocab: vocab}
	}
	return m, nil
}

// maxToken is the largest of the little-endian tokens of tokenBytes bytes
// in raw: the fast path, without a branch on the vocabulary per token.
func maxToken(raw []byte, tokenBytes int) uint32 {
	var m uint32
	if tokenBytes == 2 {
		var m16 uint16
		for i := 0; i+1 < len(raw); i += 2 {
			m16 = max(m16, binary.LittleEndian.Uint16(raw[i:]))
		}
		return uint32(m16)
	}
	for i := 0; i+3 < len(raw); i += 4 {
		m = max(m, binary.LittleEndian.Uint32(raw[i:]))
	}
	return m
}

// firstAtLeast is the index of the first token >= limit in raw, or -1.
func firstAtLeast(raw []byte, tokenBytes int, limit uint32) int {
	for i := 0; i < len(raw)/tokenBytes; i++ {
		if tokenAt(raw, tokenBytes, i) >= limit {
			return i
		}
	}
	return -1
}

func tokenAt(raw []byte, tokenBytes, i int) uint32 {
	if tokenBytes == 2 {
		return uint32(binary.LittleEndian.Uint16(raw[2*i:]))
	}
	return binary.LittleEndian.Uint32(raw[4*i:])
}
