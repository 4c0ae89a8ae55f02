package data

// This file turns a corpus into token shards with a real tokenizer
// (`mktrain data prepare --tokenizer FILE`), in two passes:
//
//  1. Tokenize. One goroutine reads the files in order and cuts them into
//     documents (documents.go), in batches of about a MiB of text; a worker
//     per core parses and encodes each batch; the batches are put back in
//     reading order and their tokens appended to a spill file in the output
//     directory, each document followed by the end-of-document token, with
//     each document's start kept in memory (8 bytes per document).
//  2. Shuffle and write. The documents are visited in a seeded permutation
//     (rng.go: no table) and their tokens copied from the spill file into
//     the shards, train first, then val.
//
// The spill file and the shards are the same width, so pass 2 copies
// bytes. Batches are cut by the reader alone and written in reading order,
// so the output is the same whatever the number of workers.

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"time"
	"unicode/utf8"
)

// Encoder is what PrepareTokenized needs of a tokenizer; package
// tokenizer's Tokenizer is one. Encode must be safe for concurrent use.
type Encoder interface {
	Encode(text string) []int
	VocabSize() int
}

// NoEOS as PrepareOptions.EOS puts nothing between documents.
const NoEOS = -1

// DefaultTextKey is the JSON field and Parquet column a document's text is
// read from unless PrepareOptions.TextKey says otherwise.
const DefaultTextKey = "text"

// Batches of documents handed to a worker: about this much text, or this
// many documents, whichever comes first.
const (
	batchTextBytes = 1 << 20
	batchDocs      = 4096
)

// PrepareOptions configures PrepareTokenized.
type PrepareOptions struct {
	Inputs      []string // files and globs (a glob's matches in name order), each file once
	OutDir      string   // where train_*.bin and val_*.bin go; must hold no shards yet
	ValFraction float64  // in [0, 1): the last share of the shuffled tokens that go to val
	ShardTokens int      // tokens per shard, at most 2^31-1
	Tokenizer   Encoder
	// EOS is the token id written after every document (the
	// end-of-document token), or NoEOS.
	EOS int
	// TextKey is the JSON field or Parquet column holding a document's
	// text; "" means DefaultTextKey.
	TextKey string
	Seed    uint64 // orders the documents
	// Workers is the number of goroutines that tokenize; 0 means one per
	// core (GOMAXPROCS). The output does not depend on it.
	Workers int
	// Progress, when not nil, is called from one goroutine at a time as
	// the work advances.
	Progress func(PrepareProgress)
}

// PrepareProgress is where PrepareTokenized is: in the tokenize phase, Done
// and Total count bytes of the input files (as stored: compressed bytes for
// compressed files); in the write phase, tokens written.
type PrepareProgress struct {
	Phase       string // "tokenizing" or "writing"
	Done, Total int64
}

// PrepareStats reports what Prepare or PrepareTokenized read and wrote.
type PrepareStats struct {
	Files       int      // input files read
	Bytes       int64    // bytes of the input files, as stored (compressed, for compressed files)
	TrainTokens int64    // tokens in the train shards
	ValTokens   int64    // tokens in the val shards
	TrainShards []string // paths of the train shards, in order
	ValShards   []string // paths of the val shards, in order

	// PrepareTokenized only.
	Documents      int64         // documents tokenized
	EmptyDocuments int64         // documents with no text, skipped
	TextBytes      int64         // bytes of text tokenized (UTF-8, uncompressed)
	EOSTokens      int64         // end-of-document tokens PrepareTokenized added (not those the encoding gave)
	Vocab          int           // the tokenizer's vocabulary
	TokenBytes     int           // 2 (uint16 shards) or 4 (uint32)
	TokenizeTime   time.Duration // pass 1: reading, parsing, tokenizing
	WriteTime      time.Duration // pass 2: shuffling and writing the shards
}

// BytesPerToken is the text's bytes per token, end-of-document tokens not
// counted: how much the tokenizer compresses the text.
func (s PrepareStats) BytesPerToken() float64 {
	n := s.TrainTokens + s.ValTokens - s.EOSTokens
	if n <= 0 {
		return 0
	}
	return float64(s.TextBytes) / float64(n)
}

// TokenizeMBPerSecond is the tokenize pass's speed in MB (10^6 bytes) of
// text per second.
func (s PrepareStats) TokenizeMBPerSecond() float64 {
	if s.TokenizeTime <= 0 {
		return 0
	}
	return float64(s.TextBytes) / 1e6 / s.TokenizeTime.Seconds()
}

// PrepareTokenized tokenizes the documents of a corpus into shards in
// o.OutDir: train_000000.bin, ... and val_000000.bin, ..., each of up to
// o.ShardTokens tokens, uint16 when the tokenizer's vocabulary has at most
// 65536 ids, else uint32.
//
// A text file is one document; a JSON Lines file has one per non-blank
// line, a Parquet file one per row (InputKind tells them apart by name; gzip
// and zstd compression too). Each document becomes the tokenizer's Encode
// of its text, then o.EOS (unless the encoding already ends with it, as
// when a post-processor appends it); a document with no text is skipped. The
// documents are shuffled by a permutation drawn from o.Seed, and the
// shuffled token stream is cut once: its last ceil(ValFraction * tokens)
// tokens go to val (so one document, at the cut, may be split between the
// two), the rest to train. The same inputs, tokenizer and seed give the same
// shards, whatever the number of workers.
//
// Memory: 8 bytes per document, plus a few MiB per worker, plus the largest
// document (a text file is read whole). The tokens wait in a spill file in
// o.OutDir, as large as the shards together, which is removed at the end.
//
// Bad input (a malformed JSON line, a missing field, a Parquet column that
// is not strings, a truncated compressed file, a text file that is not
// UTF-8) is an error naming the file and the line or row. On error, or when
// ctx ends, the shards written so far are removed, and o.OutDir too when
// PrepareTokenized created it.
func PrepareTokenized(ctx context.Context, o PrepareOptions) (PrepareStats, error) {
	var st PrepareStats
	if o.TextKey == "" {
		o.TextKey = DefaultTextKey
	}
	if err := checkPrepareOptions(o); err != nil {
		return st, err
	}
	vocab := o.Tokenizer.VocabSize()
	files, sizes, err := expandInputs(o.Inputs)
	if err != nil {
		return st, err
	}
	for _, n := range sizes {
		st.Bytes += n
	}
	st.Files, st.Vocab = len(files), vocab
	header := headerForVocab(vocab)
	st.TokenBytes = header.TokenBytes()

	out, err := openShardOutput(o.OutDir, o.ShardTokens, header)
	if err != nil {
		return st, err
	}
	ok := false
	defer func() {
		if !ok {
			out.abort()
		}
	}()
	train, val := out.train, out.val

	spill, err := createSpill(o.OutDir)
	if err != nil {
		return st, err
	}
	defer func() {
		spill.Close()
		os.Remove(spill.Name())
	}()

	start := time.Now()
	starts, err := tokenizePass(ctx, o, files, sizes, st.Bytes, header, spill, &st)
	if err != nil {
		return st, err
	}
	st.TokenizeTime = time.Since(start)

	start = time.Now()
	if err := shufflePass(ctx, o, starts, header, spill, train, val); err != nil {
		return st, err
	}
	if err := train.close(); err != nil {
		return st, err
	}
	if err := val.close(); err != nil {
		return st, err
	}
	st.WriteTime = time.Since(start)
	st.TrainTokens, st.ValTokens = train.tokens, val.tokens
	st.TrainShards, st.ValShards = train.written, val.written
	ok = true
	return st, nil
}

func checkPrepareOptions(o PrepareOptions) error {
	switch {
	case len(o.Inputs) == 0:
		return errors.New("prepare: no input files given")
	case !(o.ValFraction >= 0 && o.ValFraction < 1):
		return fmt.Errorf("prepare: val fraction %v must be in [0, 1)", o.ValFraction)
	case o.ShardTokens <= 0 || o.ShardTokens > math.MaxInt32:
		return fmt.Errorf("prepare: shard size %d tokens must be between 1 and %d", o.ShardTokens, math.MaxInt32)
	case o.Tokenizer == nil:
		return errors.New("prepare: no tokenizer given")
	case o.Workers < 0:
		return fmt.Errorf("prepare: %d workers; want 0 (one per core) or more", o.Workers)
	}
	vocab := o.Tokenizer.VocabSize()
	switch {
	case vocab <= 0 || int64(vocab) > math.MaxUint32+1:
		return fmt.Errorf("prepare: the tokenizer's vocabulary has %d ids; want 1 to 2^32", vocab)
	case o.EOS != NoEOS && (o.EOS < 0 || o.EOS >= vocab):
		return fmt.Errorf("prepare: the end-of-document token %d is not an id of the tokenizer's vocabulary (0 to %d)", o.EOS, vocab-1)
	}
	return nil
}

// createSpill creates the pass-1 token file in dir under a name no shard
// glob matches.
func createSpill(dir string) (*os.File, error) {
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	f, err := os.OpenFile(filepath.Join(dir, ".prepare-"+hex.EncodeToString(rnd[:])+".tokens"), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return nil, fmt.Errorf("prepare: %w", err)
	}
	return f, nil
}

// docBatch is a run of documents in reading order; err, when set, is the
// reading error that follows them and ends the stream.
type docBatch struct {
	seq  int
	docs []rawDoc
	err  error
}

// encodedBatch is a docBatch tokenized: its tokens in the shards' width,
// and each document's token count (its end-of-document token included).
type encodedBatch struct {
	seq       int
	tokens    []byte
	docTokens []int64
	textBytes int64
	empty     int64
	eos       int64 // end-of-document tokens among tokens
	err       error
}

// tokenizePass runs pass 1 and returns the start of each document in the
// spill file, in tokens, followed by the total.
func tokenizePass(ctx context.Context, o PrepareOptions, files []string, sizes []int64, totalBytes int64, h ShardHeader, spill *os.File, st *PrepareStats) ([]int64, error) {
	workers := o.Workers
	if workers == 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	// At most inFlight batches exist at once (read, being tokenized, or
	// waiting for their turn), which bounds the memory.
	inFlight := 2*workers + 2
	parent := ctx
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	slots := make(chan struct{}, inFlight)
	jobs := make(chan docBatch, inFlight)
	results := make(chan encodedBatch, inFlight)

	go func() {
		defer close(jobs)
		readAll(ctx, o, files, sizes, totalBytes, slots, jobs)
	}()
	done := make(chan struct{})
	for range workers {
		go func() {
			defer func() { done <- struct{}{} }()
			for b := range jobs {
				results <- encodeBatch(ctx, b, files, o, h)
			}
		}()
	}
	go func() {
		for range workers {
			<-done
		}
		close(results)
	}()

	starts := []int64{0}
	err := collectInOrder(results, slots, func(r encodedBatch) error {
		if r.err != nil {
			return r.err
		}
		if _, err := spill.Write(r.tokens); err != nil {
			return fmt.Errorf("prepare: %w", err)
		}
		at := starts[len(starts)-1]
		for _, n := range r.docTokens {
			at += n
			starts = append(starts, at)
		}
		st.Documents += int64(len(r.docTokens))
		st.EmptyDocuments += r.empty
		st.TextBytes += r.textBytes
		st.EOSTokens += r.eos
		return nil
	})
	if err != nil {
		cancel(err)
		for range results { // let the reader and the workers finish
		}
	}
	if parent.Err() != nil {
		return nil, fmt.Errorf("prepare: stopped while tokenizing: %w", context.Cause(parent))
	}
	if err != nil {
		return nil, err
	}
	if starts[len(starts)-1] == 0 {
		return nil, fmt.Errorf("prepare: the inputs hold no text (%d files, %d empty documents)", len(files), st.EmptyDocuments)
	}
	return starts, nil
}

// collectInOrder hands the results to use in their seq order, freeing a slot
// for each, and stops at use's first error.
func collectInOrder(results <-chan encodedBatch, slots <-chan struct{}, use func(encodedBatch) error) error {
	waiting := map[int]encodedBatch{}
	next := 0
	for r := range results {
		waiting[r.seq] = r
		for {
			r, ok := waiting[next]
			if !ok {
				break
			}
			delete(waiting, next)
			next++
			<-slots
			if err := use(r); err != nil {
				return err
			}
		}
	}
	return nil
}

// readAll reads the documents of every file, in order, into batches, taking
// a slot for each batch; it stops when ctx ends. A reading error travels as
// the last batch's err.
func readAll(ctx context.Context, o PrepareOptions, files []string, sizes []int64, totalBytes int64, slots chan<- struct{}, jobs chan<- docBatch) {
	seq := 0
	var cur docBatch
	var curText int
	send := func() bool {
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			return false
		}
		cur.seq = seq
		seq++
		jobs <- cur
		cur, curText = docBatch{}, 0
		return true
	}
	// finished counts the files read in full; inFile the current file's
	// bytes read, at most its size (a Parquet reader may read some twice).
	var finished, inFile, reported int64
	report := func() {
		if done := finished + inFile; o.Progress != nil && (done-reported >= 1<<20 || done == totalBytes) {
			reported = done
			o.Progress(PrepareProgress{Phase: "tokenizing", Done: done, Total: totalBytes})
		}
	}
	stopped := errors.New("stopped")
	for i, path := range files {
		inFile = 0
		read := func(n int64) {
			inFile = min(inFile+n, sizes[i])
			report()
		}
		err := readDocuments(ctx, path, i, o.TextKey, read, func(d rawDoc) error {
			cur.docs = append(cur.docs, d)
			curText += len(d.data)
			if curText >= batchTextBytes || len(cur.docs) >= batchDocs {
				if !send() {
					return stopped
				}
			}
			return nil
		})
		if errors.Is(err, stopped) || ctx.Err() != nil {
			return
		}
		if err != nil {
			cur.err = fmt.Errorf("prepare: %w", err)
			send()
			return
		}
		finished, inFile = finished+sizes[i], 0
		report()
	}
	if len(cur.docs) > 0 {
		send()
	}
}

// encodeBatch parses and tokenizes the documents of b.
func encodeBatch(ctx context.Context, b docBatch, files []string, o PrepareOptions, h ShardHeader) encodedBatch {
	out := encodedBatch{seq: b.seq, docTokens: make([]int64, 0, len(b.docs))}
	tb := h.TokenBytes()
	vocab := o.Tokenizer.VocabSize()
	for _, d := range b.docs {
		if ctx.Err() != nil {
			out.err = context.Cause(ctx)
			return out
		}
		text, err := documentText(d, files[d.file], o.TextKey)
		if err != nil {
			out.err = fmt.Errorf("prepare: %w", err)
			return out
		}
		if text == "" {
			out.empty++
			continue
		}
		ids := o.Tokenizer.Encode(text)
		n := int64(len(ids))
		out.tokens = slices.Grow(out.tokens, (len(ids)+1)*tb)
		for _, id := range ids {
			if id < 0 || id >= vocab {
				out.err = fmt.Errorf("prepare: %s: the tokenizer gave id %d, outside its vocabulary of %d", where(d, files[d.file]), id, vocab)
				return out
			}
			out.tokens = appendToken(out.tokens, uint32(id), tb)
		}
		// A post-processor may already end the document with the token
		// (or the text, with the token written out).
		if o.EOS != NoEOS && (len(ids) == 0 || ids[len(ids)-1] != o.EOS) {
			out.tokens = appendToken(out.tokens, uint32(o.EOS), tb)
			n++
			out.eos++
		}
		out.docTokens = append(out.docTokens, n)
		out.textBytes += int64(len(text))
	}
	if b.err != nil {
		out.err = b.err
	}
	return out
}

func appendToken(b []byte, t uint32, tokenBytes int) []byte {
	if tokenBytes == 2 {
		return binary.LittleEndian.AppendUint16(b, uint16(t))
	}
	return binary.LittleEndian.AppendUint32(b, t)
}

// documentText is d's text: the field of a JSON line, or the bytes of a text
// file or Parquet value, which must be UTF-8.
func documentText(d rawDoc, path, textKey string) (string, error) {
	if format, _ := InputKind(path); format == FormatJSONL {
		s, err := jsonText(d.data, textKey)
		if err != nil {
			return "", fmt.Errorf("%s: %w", where(d, path), err)
		}
		return s, nil
	}
	if !utf8.Valid(d.data) {
		bad := 0
		for bad < len(d.data) {
			r, size := utf8.DecodeRune(d.data[bad:])
			if r == utf8.RuneError && size <= 1 {
				break
			}
			bad += size
		}
		return "", fmt.Errorf("%s: not UTF-8 text (byte %d of the document is not part of a UTF-8 character)", where(d, path), bad)
	}
	return string(d.data), nil
}

// where names a document's place: file:line for JSON Lines, file: row N
// for Parquet, the file for text.
func where(d rawDoc, path string) string {
	switch format, _ := InputKind(path); format {
	case FormatJSONL:
		return fmt.Sprintf("%s:%d", path, d.where)
	case FormatParquet:
		return fmt.Sprintf("%s: row %d", path, d.where)
	}
	return path
}

// shufflePass is pass 2: the documents in a permutation drawn from o.Seed,
// their tokens copied from the spill file to train, then, past the cut, to
// val.
func shufflePass(ctx context.Context, o PrepareOptions, starts []int64, h ShardHeader, spill *os.File, train, val *splitWriter) error {
	docs := int64(len(starts) - 1)
	total := starts[docs]
	valTokens := int64(math.Ceil(float64(total) * o.ValFraction))
	trainTokens := total - valTokens
	tb := int64(h.TokenBytes())
	perm := newPermutation(uint64(max(docs, 1)), o.Seed, 0)
	var buf []byte
	var written int64
	for i := int64(0); i < docs; i++ {
		if i%4096 == 0 {
			if ctx.Err() != nil {
				return fmt.Errorf("prepare: stopped while writing the shards: %w", context.Cause(ctx))
			}
			if o.Progress != nil {
				o.Progress(PrepareProgress{Phase: "writing", Done: written, Total: total})
			}
		}
		d := int64(perm.at(uint64(i)))
		n := starts[d+1] - starts[d]
		if int64(cap(buf)) < n*tb {
			buf = make([]byte, n*tb)
		}
		raw := buf[:n*tb]
		if err := readFullAt(spill, raw, starts[d]*tb); err != nil {
			return fmt.Errorf("prepare: reading back the tokenized documents from %s: %w", spill.Name(), err)
		}
		if k := min(n, max(trainTokens-written, 0)); k > 0 {
			if err := train.writeEncoded(raw[:k*tb]); err != nil {
				return err
			}
			raw = raw[k*tb:]
		}
		if err := val.writeEncoded(raw); err != nil {
			return err
		}
		written += n
	}
	if o.Progress != nil {
		o.Progress(PrepareProgress{Phase: "writing", Done: written, Total: total})
	}
	return nil
}
