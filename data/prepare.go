package data

// This file turns text files into byte-level token shards (`mktrain
// prepare`).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
)

// Prepare byte-tokenizes text files into shards in outDir:
// train_000000.bin, train_000001.bin, ... and val_000000.bin, ..., each
// holding up to shardTokens uint16 tokens. inputs are file paths or globs;
// files are read in the order given (a glob's matches sorted by name), each
// once. The last valFraction of each file's bytes (rounded up, so every
// non-empty file gives at least one byte when valFraction > 0) goes to val,
// the rest to train; files are concatenated with nothing between them.
// valFraction is in [0, 1); 0 writes no val shards. progress, if not nil, is
// called with bytes read so far and in all. outDir must not already hold
// shards, since a stale train_000009.bin would otherwise join the new
// dataset. On error, or when ctx ends (checked every MiB read), the shards
// written so far are removed, and outDir too when Prepare created it; the
// error then wraps ctx's cause.
func Prepare(ctx context.Context, inputs []string, outDir string, valFraction float64, shardTokens int, progress func(done, total int64)) (PrepareStats, error) {
	var st PrepareStats
	switch {
	case len(inputs) == 0:
		return st, errors.New("prepare: no input files given")
	case !(valFraction >= 0 && valFraction < 1):
		return st, fmt.Errorf("prepare: val fraction %v must be in [0, 1)", valFraction)
	case shardTokens <= 0 || shardTokens > math.MaxInt32:
		return st, fmt.Errorf("prepare: shard size %d tokens must be between 1 and %d", shardTokens, math.MaxInt32)
	}
	files, sizes, err := expandInputs(inputs)
	if err != nil {
		return st, err
	}
	var total int64
	for _, n := range sizes {
		total += n
	}
	out, err := openShardOutput(outDir, shardTokens, headerForVocab(ByteVocab))
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
	var done int64
	buf := make([]byte, 1<<20)
	for i, path := range files {
		valBytes := int64(math.Ceil(float64(sizes[i]) * valFraction))
		if err := copyFile(ctx, path, sizes[i], sizes[i]-valBytes, train, val, buf, func(n int64) {
			done += n
			if progress != nil {
				progress(done, total)
			}
		}); err != nil {
			return st, err
		}
	}
	if err := train.close(); err != nil {
		return st, err
	}
	if err := val.close(); err != nil {
		return st, err
	}
	ok = true
	return PrepareStats{
		Files: len(files), Bytes: total,
		TrainTokens: train.tokens, ValTokens: val.tokens,
		TrainShards: train.written, ValShards: val.written,
	}, nil
}

// expandInputs resolves paths and globs to regular files, each once, with
// their sizes.
func expandInputs(inputs []string) (files []string, sizes []int64, err error) {
	seen := map[string]bool{}
	for _, in := range inputs {
		matches := []string{in}
		if hasGlobMeta(in) {
			matches, err = filepath.Glob(in)
			if err != nil {
				return nil, nil, fmt.Errorf("prepare: input %q: %w", in, err)
			}
			if len(matches) == 0 {
				return nil, nil, fmt.Errorf("prepare: input %q matches no files", in)
			}
			slices.Sort(matches)
		}
		for _, m := range matches {
			if seen[m] {
				continue
			}
			seen[m] = true
			fi, err := os.Stat(m)
			if err != nil {
				return nil, nil, fmt.Errorf("prepare: %w", err)
			}
			if !fi.Mode().IsRegular() {
				return nil, nil, fmt.Errorf("prepare: %s is not a regular file; name text files, or a glob such as %s", m, filepath.Join(m, "*.txt"))
			}
			files = append(files, m)
			sizes = append(sizes, fi.Size())
		}
	}
	return files, sizes, nil
}

func hasGlobMeta(p string) bool {
	for _, c := range p {
		switch c {
		case '*', '?', '[':
			return true
		}
	}
	return false
}

// copyFile sends the first trainBytes of the size bytes of path to train
// and the rest to val.
func copyFile(ctx context.Context, path string, size, trainBytes int64, train, val *splitWriter, buf []byte, read func(int64)) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("prepare: %w", err)
	}
	defer f.Close()
	r := io.LimitReader(f, size)
	var pos int64
	for pos < size {
		if ctx.Err() != nil {
			return fmt.Errorf("prepare: stopped at byte %d of %s: %w", pos, path, context.Cause(ctx))
		}
		n, err := r.Read(buf)
		if n > 0 {
			chunk := buf[:n]
			if k := min(int64(n), max(trainBytes-pos, 0)); k > 0 {
				if err := train.write(chunk[:k]); err != nil {
					return err
				}
				chunk = chunk[k:]
			}
			if err := val.write(chunk); err != nil {
				return err
			}
			pos += int64(n)
			read(int64(n))
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("prepare: %s: reading at byte %d: %w", path, pos, err)
		}
	}
	if pos < size {
		return fmt.Errorf("prepare: %s: file shrank while being read (%d bytes, was %d)", path, pos, size)
	}
	return nil
}

// shardOutput is a prepare's output folder and its train and val writers.
type shardOutput struct {
	dir        string
	created    bool // the folder did not exist before
	train, val *splitWriter
}

// openShardOutput makes dir (when missing) for train_*.bin and val_*.bin
// shards of shardTokens tokens in header's format, and refuses a folder
// that holds such shards already.
func openShardOutput(dir string, shardTokens int, header ShardHeader) (*shardOutput, error) {
	_, statErr := os.Stat(dir)
	o := &shardOutput{dir: dir, created: errors.Is(statErr, os.ErrNotExist)}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("prepare: %w", err)
	}
	for _, prefix := range []string{"train", "val"} {
		if old, _ := filepath.Glob(filepath.Join(dir, prefix+"_*.bin")); len(old) > 0 {
			return nil, fmt.Errorf("prepare: %s already holds shards (%s); remove them or choose another output directory", dir, old[0])
		}
	}
	o.train = &splitWriter{dir: dir, prefix: "train", shardTokens: shardTokens, header: header}
	o.val = &splitWriter{dir: dir, prefix: "val", shardTokens: shardTokens, header: header}
	return o, nil
}

// abort removes the shards written so far, and the folder when this
// prepare made it.
func (o *shardOutput) abort() {
	o.train.abort()
	o.val.abort()
	if o.created {
		os.Remove(o.dir) // only when empty: never what another wrote there
	}
}

// splitWriter writes a stream of tokens into numbered shards of
// shardTokens each, in header's format.
type splitWriter struct {
	dir, prefix string
	shardTokens int
	header      ShardHeader // Magic and Version of every shard
	cur         *shardWriter
	written     []string
	tokens      int64
}

// write writes each byte of p as one token (the byte-level tokenizer).
func (s *splitWriter) write(p []byte) error {
	return s.put(len(p), func(w *shardWriter, from, to int) { w.writeBytes(p[from:to]) })
}

// writeEncoded writes tokens already encoded in the shards' width
// (header.TokenBytes() little-endian bytes each).
func (s *splitWriter) writeEncoded(raw []byte) error {
	tb := s.header.TokenBytes()
	return s.put(len(raw)/tb, func(w *shardWriter, from, to int) { w.writeEncoded(raw[from*tb : to*tb]) })
}

// put writes n tokens, those [from, to) at a time with write, starting a
// new shard whenever one fills.
func (s *splitWriter) put(n int, write func(w *shardWriter, from, to int)) error {
	for done := 0; done < n; {
		if s.cur == nil {
			path := filepath.Join(s.dir, fmt.Sprintf("%s_%06d.bin", s.prefix, len(s.written)))
			w, err := createShard(path, s.header)
			if err != nil {
				return fmt.Errorf("prepare: %w", err)
			}
			s.cur = w
		}
		k := min(n-done, s.shardTokens-int(s.cur.tokens()))
		write(s.cur, done, done+k)
		s.tokens += int64(k)
		done += k
		if s.cur.tokens() == int64(s.shardTokens) {
			if err := s.flush(); err != nil {
				return err
			}
		}
	}
	return nil
}

func (s *splitWriter) flush() error {
	w := s.cur
	s.cur = nil
	if err := w.commit(); err != nil {
		// The shard may be in place with only its directory's fsync failed;
		// Prepare started with no shards here, so whatever is at the path is
		// ours for abort to remove.
		s.written = append(s.written, w.path)
		return fmt.Errorf("prepare: %w", err)
	}
	s.written = append(s.written, w.path)
	return nil
}

// close writes the last, partial shard.
func (s *splitWriter) close() error {
	if s.cur == nil {
		return nil
	}
	return s.flush()
}

// abort removes everything this writer produced.
func (s *splitWriter) abort() {
	if s.cur != nil {
		s.cur.abort()
		s.cur = nil
	}
	for _, p := range s.written {
		os.Remove(p)
	}
	s.written = nil
}
