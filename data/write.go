package data

// This file writes llm.c token shards. A shard appears under its final name
// only when it is complete (internal/atomicfile: a temporary file in the
// same directory, fsynced, renamed, the directory fsynced).

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/mktrain/mktrain/internal/atomicfile"
)

// WriteShard writes tokens to path as an llm.c shard: uint16 tokens (magic
// 20240520) when vocab <= 65536, uint32 tokens (magic 20240801) otherwise.
// Every token must be < vocab. The file is replaced atomically.
func WriteShard(path string, tokens []uint32, vocab int) error {
	if vocab <= 0 || int64(vocab) > math.MaxUint32+1 {
		return fmt.Errorf("%s: vocab %d is out of range (1 to %d)", path, vocab, int64(math.MaxUint32)+1)
	}
	if len(tokens) > math.MaxInt32 {
		return fmt.Errorf("%s: %d tokens do not fit one shard (at most %d)", path, len(tokens), math.MaxInt32)
	}
	for i, t := range tokens {
		if int64(t) >= int64(vocab) {
			return fmt.Errorf("%s: token %d at position %d is >= vocab %d", path, t, i, vocab)
		}
	}
	w, err := createShard(path, headerForVocab(vocab))
	if err != nil {
		return err
	}
	w.writeTokens(tokens)
	return w.commit()
}

// headerForVocab picks the narrowest format that holds every token < vocab.
func headerForVocab(vocab int) ShardHeader {
	if vocab <= 1<<16 {
		return ShardHeader{Magic: MagicUint16, Version: VersionUint16}
	}
	return ShardHeader{Magic: MagicUint32, Version: VersionUint32}
}

// shardWriter streams tokens into a temporary file and, on commit, writes
// the header with the final count and renames the file into place. Write
// errors are sticky and reported by commit.
type shardWriter struct {
	path    string
	header  ShardHeader
	file    *atomicfile.File
	bw      *bufio.Writer
	scratch []byte
	err     error
}

func createShard(path string, h ShardHeader) (*shardWriter, error) {
	file, err := atomicfile.Create(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	w := &shardWriter{path: path, header: h, file: file, bw: bufio.NewWriterSize(file, 1<<20)}
	// A zero header holds the place; commit writes the real one.
	_, w.err = w.bw.Write(make([]byte, HeaderBytes))
	return w, nil
}

// tokens is the number written so far.
func (w *shardWriter) tokens() int64 { return w.header.Tokens }

func (w *shardWriter) writeTokens(ts []uint32) {
	const chunk = 4096
	tb := w.header.TokenBytes()
	for len(ts) > 0 && w.err == nil {
		n := min(len(ts), chunk)
		b := w.scratch[:0]
		for _, t := range ts[:n] {
			if tb == 2 {
				b = binary.LittleEndian.AppendUint16(b, uint16(t))
			} else {
				b = binary.LittleEndian.AppendUint32(b, t)
			}
		}
		w.scratch = b
		_, w.err = w.bw.Write(b)
		w.header.Tokens += int64(n)
		ts = ts[n:]
	}
}

// writeBytes writes each byte of p as one token (the byte-level tokenizer).
func (w *shardWriter) writeBytes(p []byte) {
	const chunk = 4096
	tb := w.header.TokenBytes()
	for len(p) > 0 && w.err == nil {
		n := min(len(p), chunk)
		b := w.scratch[:0]
		for _, c := range p[:n] {
			if tb == 2 {
				b = append(b, c, 0)
			} else {
				b = append(b, c, 0, 0, 0)
			}
		}
		w.scratch = b
		_, w.err = w.bw.Write(b)
		w.header.Tokens += int64(n)
		p = p[n:]
	}
}

// writeEncoded writes tokens already in the shard's width.
func (w *shardWriter) writeEncoded(raw []byte) {
	if w.err != nil {
		return
	}
	_, w.err = w.bw.Write(raw)
	w.header.Tokens += int64(len(raw) / w.header.TokenBytes())
}

// commit finishes the shard and moves it to its path; on failure the
// temporary file is removed. A failed fsync of the directory is an error
// too, though the complete shard is then already at its path.
func (w *shardWriter) commit() error {
	err := w.err
	if err == nil && w.header.Tokens > math.MaxInt32 {
		err = fmt.Errorf("%d tokens do not fit one shard (at most %d)", w.header.Tokens, math.MaxInt32)
	}
	if err == nil {
		err = w.bw.Flush()
	}
	if err == nil {
		_, err = w.file.WriteAt(w.header.encode(), 0)
	}
	if err != nil {
		w.file.Abort()
	} else {
		err = w.file.Commit()
	}
	if err != nil {
		return fmt.Errorf("%s: writing shard: %w", w.path, err)
	}
	return nil
}

// abort drops the shard.
func (w *shardWriter) abort() { w.file.Abort() }
