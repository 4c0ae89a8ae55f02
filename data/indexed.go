package data

// This file reads Megatron-LM's indexed datasets (the MMIDIDX format that
// Megatron's preprocess_data.py writes): a .bin file of raw tokens and an
// .idx file that cuts it into sequences and documents. The loaders train on
// one as on an llm.c shard: its sequences concatenated in order (they
// already end with the end-of-document token when Megatron appended one).
//
// The .idx layout, all little-endian:
//
//	magic          9 bytes  "MMIDIDX\x00\x00"
//	version        uint64   1
//	dtype          uint8    the .bin's token type: 1 uint8, 2 int8, 3 int16,
//	                        4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
//	sequences S    uint64
//	doc entries D  uint64   documents + 1
//	lengths        int32[S]  tokens in each sequence
//	pointers       int64[S]  byte offset of each sequence in the .bin
//	doc indices    int64[D]  the sequence each document starts at, then S
//	(modes         int8[S]   only in multimodal datasets, refused here)
//
// Megatron writes the sequences back to back, so the pointers are the
// running sums of the lengths times the token size; OpenIndexed checks that,
// and that the .bin holds exactly the tokens the lengths add up to.

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"os"
	"strings"

	"github.com/mktrain/mktrain/internal/atomicfile"
)

// indexedMagic starts every Megatron .idx file.
const indexedMagic = "MMIDIDX\x00\x00"

// indexedHeaderBytes is the fixed part of an .idx file: magic, version,
// dtype, sequence count and document-index count.
const indexedHeaderBytes = 9 + 8 + 1 + 8 + 8

// tokenType is how tokens are stored on disk: little-endian integers of
// size bytes, signed or not.
type tokenType struct {
	name   string
	size   int
	signed bool
}

// megatronDTypes are the .idx dtype codes of integer token types, from
// Megatron's DType enum; 6 (float64) and 7 (float32) hold no token ids.
var megatronDTypes = map[byte]tokenType{
	1: {"uint8", 1, false}, 2: {"int8", 1, true}, 3: {"int16", 2, true},
	4: {"int32", 4, true}, 5: {"int64", 8, true}, 8: {"uint16", 2, false},
}

// decode reads raw (whole tokens of t) into dst. A value that is not a
// token id (negative, or above 2^32-1) stops it: the result is its index,
// and its value; -1 when every value is an id.
func (t tokenType) decode(dst []uint32, raw []byte) (bad int, value int64) {
	le := binary.LittleEndian
	for i := range dst {
		var v int64
		switch {
		case t.size == 1 && !t.signed:
			v = int64(raw[i])
		case t.size == 1:
			v = int64(int8(raw[i]))
		case t.size == 2 && !t.signed:
			v = int64(le.Uint16(raw[2*i:]))
		case t.size == 2:
			v = int64(int16(le.Uint16(raw[2*i:])))
		case t.size == 4 && !t.signed:
			v = int64(le.Uint32(raw[4*i:]))
		case t.size == 4:
			v = int64(int32(le.Uint32(raw[4*i:])))
		default:
			v = int64(le.Uint64(raw[8*i:]))
		}
		if v < 0 || v > math.MaxUint32 {
			return i, v
		}
		dst[i] = uint32(v)
	}
	return -1, 0
}

// IndexedDataset is an open Megatron indexed dataset: a TokenSource over
// its sequences, concatenated. ReadTokens is safe for concurrent use.
type IndexedDataset struct {
	binPath, idxPath string
	dtype            tokenType
	tokens           int64
	sequences        int64
	documents        int64
	binBytes         int64
	idxBytes         int64
	file             *os.File // the .bin
}

// IndexedPaths returns the .bin and .idx of the Megatron dataset path
// names: its prefix ("corpus_text_document"), its .bin or its .idx. ok is
// false when path is not one: no such pair, or an .idx that does not start
// with Megatron's magic (a .bin beside it is then taken for an llm.c
// shard).
func IndexedPaths(path string) (bin, idx string, ok bool) {
	prefix := path
	switch {
	case strings.HasSuffix(path, ".bin"), strings.HasSuffix(path, ".idx"):
		prefix = path[:len(path)-4]
	}
	bin, idx = prefix+".bin", prefix+".idx"
	if st, err := os.Stat(bin); err != nil || !st.Mode().IsRegular() {
		return "", "", false
	}
	f, err := os.Open(idx)
	if err != nil {
		return "", "", false
	}
	defer f.Close()
	magic := make([]byte, len(indexedMagic))
	if _, err := io.ReadFull(f, magic); err != nil || string(magic) != indexedMagic {
		return "", "", false
	}
	return bin, idx, true
}

// OpenIndexed opens the Megatron dataset path names (its prefix, .bin or
// .idx) and checks its index: magic, version, an integer token type, that
// the document indices run from 0 to the sequence count, that the sequences
// lie back to back, and that the .bin is exactly as long as they are. Token
// values are checked as they are read (and in full by Verify). Errors name
// the file.
func OpenIndexed(path string) (*IndexedDataset, error) {
	bin, idx, ok := IndexedPaths(path)
	if !ok {
		return nil, fmt.Errorf("%s: not a Megatron indexed dataset (no .bin with an .idx that starts with %q beside it)", path, strings.TrimRight(indexedMagic, "\x00"))
	}
	d, err := readIndex(idx)
	if err != nil {
		return nil, err
	}
	d.binPath = bin
	f, err := os.Open(bin)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	d.binBytes = st.Size()
	if want := d.tokens * int64(d.dtype.size); d.binBytes != want {
		f.Close()
		return nil, fmt.Errorf("%s: %d bytes, but %s gives %d sequences of %d %s tokens in all, %d bytes",
			bin, d.binBytes, idx, d.sequences, d.tokens, d.dtype.name, want)
	}
	d.file = f
	return d, nil
}

// readIndex reads and checks an .idx file.
func readIndex(idx string) (*IndexedDataset, error) {
	raw, err := os.ReadFile(idx)
	if err != nil {
		return nil, err
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%s: %s", idx, fmt.Sprintf(format, args...))
	}
	if len(raw) < indexedHeaderBytes || !bytes.HasPrefix(raw, []byte(indexedMagic)) {
		return nil, bad("not a Megatron index (it does not start with %q and a %d-byte header)", strings.TrimRight(indexedMagic, "\x00"), indexedHeaderBytes)
	}
	le := binary.LittleEndian
	if v := le.Uint64(raw[9:]); v != 1 {
		return nil, bad("index version %d; Megatron's MMIDIDX format is version 1", v)
	}
	code := raw[17]
	dtype, ok := megatronDTypes[code]
	if !ok {
		return nil, bad("token dtype code %d is not an integer type (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)", code)
	}
	seqs, docEntries := le.Uint64(raw[18:]), le.Uint64(raw[26:])
	const maxEntries = 1 << 40 // far beyond any dataset; keeps the sizes below from overflowing
	if seqs > maxEntries || docEntries > maxEntries {
		return nil, bad("%d sequences and %d document indices: corrupt header", seqs, docEntries)
	}
	want := int64(indexedHeaderBytes) + int64(seqs)*(4+8) + int64(docEntries)*8
	switch int64(len(raw)) {
	case want:
	case want + int64(seqs):
		return nil, bad("a multimodal index (sequence modes follow the document indices); only text datasets are read")
	default:
		return nil, bad("%d bytes, but its header gives %d sequences and %d document indices, %d bytes", len(raw), seqs, docEntries, want)
	}
	d := &IndexedDataset{idxPath: idx, dtype: dtype, sequences: int64(seqs), idxBytes: int64(len(raw))}
	lengths := raw[indexedHeaderBytes:]
	pointers := lengths[4*seqs:]
	docIndex := pointers[8*seqs:]
	var at int64
	for i := range int64(seqs) {
		n := int64(int32(le.Uint32(lengths[4*i:])))
		p := int64(le.Uint64(pointers[8*i:]))
		if n < 0 {
			return nil, bad("sequence %d has a negative length %d", i, n)
		}
		if p != at*int64(dtype.size) {
			return nil, bad("sequence %d starts at byte %d, not right after the one before (byte %d): the sequences must lie back to back, as Megatron writes them",
				i, p, at*int64(dtype.size))
		}
		at += n
	}
	d.tokens = at
	if docEntries == 0 {
		return nil, bad("no document indices (a Megatron index has at least the final one)")
	}
	prev := int64(-1)
	for i := range int64(docEntries) {
		s := int64(le.Uint64(docIndex[8*i:]))
		switch {
		case i == 0 && s != 0:
			return nil, bad("the first document starts at sequence %d, not 0", s)
		case s < prev || s > int64(seqs):
			return nil, bad("document index %d is %d: the indices must rise from 0 to the sequence count %d", i, s, seqs)
		}
		prev = s
	}
	if prev != int64(seqs) {
		return nil, bad("the last document index is %d, not the sequence count %d", prev, seqs)
	}
	d.documents = int64(docEntries) - 1
	return d, nil
}

// Name is the .bin's path.
func (d *IndexedDataset) Name() string { return d.binPath }

// Len is the number of tokens in all the sequences.
func (d *IndexedDataset) Len() int64 { return d.tokens }

// Documents is the number of documents the index marks.
func (d *IndexedDataset) Documents() int64 { return d.documents }

// Sequences is the number of sequences.
func (d *IndexedDataset) Sequences() int64 { return d.sequences }

// TokenType names the .bin's token type ("uint16", "int32", ...).
func (d *IndexedDataset) TokenType() string { return d.dtype.name }

// ReadTokens fills dst with the tokens at positions off, off+1, ... of the
// concatenated sequences. A negative value (a token type with a sign) is an
// error naming its position.
func (d *IndexedDataset) ReadTokens(dst []uint32, off int64) error {
	n := int64(len(dst))
	if off < 0 || off+n > d.tokens {
		return fmt.Errorf("%s: tokens [%d, %d) are out of range: the dataset has %d tokens", d.binPath, off, off+n, d.tokens)
	}
	size := int64(d.dtype.size)
	raw := make([]byte, n*size)
	if err := readFullAt(d.file, raw, off*size); err != nil {
		return fmt.Errorf("%s: reading %d tokens at position %d: %w", d.binPath, n, off, err)
	}
	if i, v := d.dtype.decode(dst, raw); i >= 0 {
		return fmt.Errorf("%s: token %d at position %d is not a token id", d.binPath, v, off+int64(i))
	}
	return nil
}

// Close closes the .bin.
func (d *IndexedDataset) Close() error {
	if d.file == nil {
		return nil
	}
	err := d.file.Close()
	d.file = nil
	return err
}

// openSource opens the data file at path, as Glob names it: a Megatron
// dataset's .bin (its .idx beside it) or an llm.c shard.
func openSource(path string) (TokenSource, io.Closer, error) {
	if _, _, ok := IndexedPaths(path); ok {
		d, err := OpenIndexed(path)
		if err != nil {
			return nil, nil, err
		}
		return d, d, nil
	}
	s, err := OpenShard(path)
	if err != nil {
		return nil, nil, err
	}
	return s, s, nil
}

// WriteIndexed writes docs as the Megatron indexed dataset prefix.bin and
// prefix.idx, one sequence per document, with the token type Megatron picks
// for vocab (uint16 below 65500 ids, else int32). Every token must be below
// vocab. Both files are replaced atomically, the .bin first.
func WriteIndexed(prefix string, docs [][]uint32, vocab int) error {
	code, dtype := byte(8), megatronDTypes[8]
	if vocab >= 65500 {
		code, dtype = 4, megatronDTypes[4]
	}
	if vocab <= 0 || int64(vocab) > math.MaxInt32 {
		return fmt.Errorf("%s: vocab %d is out of range (1 to %d)", prefix, vocab, math.MaxInt32)
	}
	le := binary.LittleEndian
	lengths := make([]byte, 0, 4*len(docs))
	pointers := make([]byte, 0, 8*len(docs))
	docIndex := make([]byte, 0, 8*(len(docs)+1))
	docIndex = le.AppendUint64(docIndex, 0)
	var at int64
	for i, d := range docs {
		if len(d) > math.MaxInt32 {
			return fmt.Errorf("%s: document %d has %d tokens, more than a sequence holds (2^31-1)", prefix, i, len(d))
		}
		lengths = le.AppendUint32(lengths, uint32(len(d)))
		pointers = le.AppendUint64(pointers, uint64(at*int64(dtype.size)))
		docIndex = le.AppendUint64(docIndex, uint64(i+1))
		at += int64(len(d))
	}
	err := atomicfile.WriteFile(prefix+".bin", func(w io.Writer) error {
		bw := bufio.NewWriterSize(w, 1<<20)
		var scratch [4]byte
		for i, d := range docs {
			for j, t := range d {
				if int64(t) >= int64(vocab) {
					return fmt.Errorf("token %d at position %d of document %d is >= vocab %d", t, j, i, vocab)
				}
				le.PutUint32(scratch[:], t)    // little-endian: a uint16 is the first two bytes
				bw.Write(scratch[:dtype.size]) // errors stick in bw; Flush reports them
			}
		}
		return bw.Flush()
	})
	if err != nil {
		return fmt.Errorf("%s.bin: %w", prefix, err)
	}
	err = atomicfile.WriteFile(prefix+".idx", func(w io.Writer) error {
		head := []byte(indexedMagic)
		head = le.AppendUint64(head, 1)
		head = append(head, code)
		head = le.AppendUint64(head, uint64(len(docs)))
		head = le.AppendUint64(head, uint64(len(docs)+1))
		for _, part := range [][]byte{head, lengths, pointers, docIndex} {
			if _, err := w.Write(part); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("%s.idx: %w", prefix, err)
	}
	return nil
}
