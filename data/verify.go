package data

// This file checks shards in full before anything trains on them: headers,
// sizes, and every token id against the vocabulary. The loaders check ids
// only as windows are read, so without this one bad id in the middle of a
// shard fails a run at the step that reads it, after the steps before it
// were spent, and again on every resume.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
)

// verifyChunkBytes is how much of a shard one worker reads at a time: the
// check's memory is this times the number of workers, whatever the data's
// size.
const verifyChunkBytes = 4 << 20

// ShardSummary describes one data file Verify checked: an llm.c shard or
// a Megatron indexed dataset.
type ShardSummary struct {
	Path      string
	Format    string      // "llm.c" or "megatron"
	Header    ShardHeader // an llm.c shard's header (zero for a Megatron dataset)
	TokenType string      // the tokens' type on disk: "uint16", "uint32", or a Megatron dtype ("int32", ...)
	Tokens    int64
	Documents int64  // a Megatron dataset's documents (0 for an llm.c shard, which does not mark them)
	Bytes     int64  // the files' size: an llm.c shard's, or a Megatron .bin's and .idx's together
	MaxToken  uint32 // the largest token id (0 when there are no tokens)

	dtype      tokenType
	dataPath   string // the file holding the tokens
	dataOffset int64  // where they start in it
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

// Glob is the sorted list of data files that pattern names, as the
// loaders and Verify take them: llm.c shards, and Megatron indexed datasets
// by their .bin (see IndexedPaths). pattern is a glob, or a plain path; a
// match that is a Megatron .idx stands for its dataset's .bin, and a plain
// path may be a Megatron dataset's prefix ("corpus_text_document" for
// corpus_text_document.bin and .idx). Matching nothing is an error.
func Glob(pattern string) ([]string, error) {
	if !hasGlobMeta(pattern) {
		if _, err := os.Stat(pattern); err != nil {
			if bin, _, ok := IndexedPaths(pattern); ok {
				return []string{bin}, nil
			}
			return nil, err // *PathError names the file
		}
	}
	matches, err := filepath.Glob(pattern)
	if err != nil {
		return nil, fmt.Errorf("data glob %q: %w", pattern, err)
	}
	if len(matches) == 0 {
		return nil, fmt.Errorf("data glob %q matches no files", pattern)
	}
	seen := map[string]bool{}
	var paths []string
	for _, m := range matches {
		if strings.HasSuffix(m, ".idx") {
			bin, _, ok := IndexedPaths(m)
			if !ok {
				return nil, fmt.Errorf("data glob %q matches %s, which is not the index of a Megatron dataset (a .bin beside it, and the magic %q)", pattern, m, strings.TrimRight(indexedMagic, "\x00"))
			}
			m = bin
		}
		if !seen[m] {
			seen[m] = true
			paths = append(paths, m)
		}
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
		s, err := statSource(p)
		if err != nil {
			return Summary{}, err
		}
		sum.Shards[i] = s
		sum.Tokens += s.Tokens
		sum.Bytes += s.Bytes
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

// statSource checks what can be checked of the data file at path without
// reading its tokens: a Megatron dataset's index and .bin size (as
// OpenIndexed does), or an llm.c shard's header and size (with OpenShard's
// errors).
func statSource(path string) (ShardSummary, error) {
	if _, _, ok := IndexedPaths(path); ok {
		d, err := OpenIndexed(path)
		if err != nil {
			return ShardSummary{}, err
		}
		d.Close()
		return ShardSummary{Path: d.binPath, Format: "megatron", TokenType: d.dtype.name, Tokens: d.tokens,
			Documents: d.documents, Bytes: d.binBytes + d.idxBytes, dtype: d.dtype, dataPath: d.binPath}, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return ShardSummary{}, err // *PathError names the file
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return ShardSummary{}, err
	}
	if st.IsDir() {
		return ShardSummary{}, fmt.Errorf("%s: is a directory, not a token shard", path)
	}
	// A memory limit of -1 checks the header and size and reads no tokens.
	s, err := newShard(path, f, st.Size(), -1)
	if err != nil {
		return ShardSummary{}, err
	}
	tb := s.header.TokenBytes()
	return ShardSummary{Path: path, Format: "llm.c", Header: s.header, TokenType: fmt.Sprintf("uint%d", 8*tb), Tokens: s.header.Tokens,
		Bytes: st.Size(), dtype: tokenType{name: fmt.Sprintf("uint%d", 8*tb), size: tb}, dataPath: path, dataOffset: HeaderBytes}, nil
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
		step := int64(verifyChunkBytes / s.dtype.size)
		for start := int64(0); start < s.Tokens; start += step {
			chunks = append(chunks, verifyChunk{shard: i, start: start, end: min(start+step, s.Tokens)})
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
// token id, or an error naming the first id >= vocab (when vocab > 0), or
// the first value that is no id at all (a negative one, in a Megatron
// dataset of signed tokens).
func scanChunk(s ShardSummary, c verifyChunk, buf []byte, vocab int) (uint32, error) {
	tb := int64(s.dtype.size)
	raw := buf[:(c.end-c.start)*tb]
	f, err := os.Open(s.dataPath)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	off := s.dataOffset + c.start*tb
	if err := readFullAt(f, raw, off); err != nil {
		return 0, fmt.Errorf("%s: reading tokens [%d, %d): %w", s.Path, c.start, c.end, err)
	}
	if !s.dtype.signed && (tb == 2 || tb == 4) {
		return checkIDs(s, c, raw, int(tb), vocab)
	}
	// Other types are widened to uint32 first; a value that is no id at
	// all stops the widening, and is the chunk's problem unless an id
	// before it is already too large.
	ids := make([]uint32, c.end-c.start)
	bad, v := s.dtype.decode(ids, raw)
	if bad >= 0 {
		ids = ids[:bad]
	}
	wide := make([]byte, 4*len(ids))
	for i, id := range ids {
		binary.LittleEndian.PutUint32(wide[4*i:], id)
	}
	m, err := checkIDs(s, c, wide, 4, vocab)
	if te := (*TokenError)(nil); errors.As(err, &te) {
		te.ByteOffset = s.dataOffset + te.Position*tb
		return 0, err
	}
	if bad >= 0 {
		pos := c.start + int64(bad)
		return 0, fmt.Errorf("%s: token %d at position %d (byte offset %d) is not a token id", s.Path, v, pos, s.dataOffset+pos*tb)
	}
	return m, err
}

// checkIDs is the largest of the tokens of tokenBytes each in raw (chunk c
// of s), or a *TokenError for the first >= vocab when vocab > 0.
func checkIDs(s ShardSummary, c verifyChunk, raw []byte, tokenBytes, vocab int) (uint32, error) {
	m := maxToken(raw, tokenBytes)
	if vocab > 0 && int64(m) >= int64(vocab) {
		i := firstAtLeast(raw, tokenBytes, uint32(min(int64(vocab), int64(^uint32(0)))))
		pos := c.start + int64(i)
		return 0, &TokenError{Path: s.Path, Position: pos, ByteOffset: s.dataOffset + pos*int64(tokenBytes),
			ID: tokenAt(raw, tokenBytes, i), Vocab: vocab}
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
