package data

// This file reads llm.c token shards and defines TokenSource, the one thing
// the loaders need from a shard: its length and random access to its tokens.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
)

// The llm.c shard format: HeaderInts little-endian int32 values, then the
// tokens, little-endian, two or four bytes each as the magic says.
const (
	HeaderInts  = 256
	HeaderBytes = HeaderInts * 4

	MagicUint16   = 20240520 // header[0] of shards with uint16 tokens
	VersionUint16 = 1        // header[1] that goes with MagicUint16
	MagicUint32   = 20240801 // header[0] of shards with uint32 tokens
	VersionUint32 = 7        // header[1] that goes with MagicUint32

	// MaxMemoryShardBytes is the largest token payload OpenShard reads into
	// memory. Larger shards stay on disk and each window is read with one
	// ReadAt; the operating system's page cache then does the caching, so a
	// dataset of many 200 MB llm.c shards costs no resident memory of ours.
	MaxMemoryShardBytes = 64 << 20
)

// ShardHeader is the part of a shard header that means something: the first
// three int32 values. The other 253 are written as zeros and ignored on read.
type ShardHeader struct {
	Magic   int32 // MagicUint16 or MagicUint32
	Version int32 // VersionUint16 or VersionUint32
	Tokens  int64 // tokens that follow the header (an int32 on disk)
}

// TokenBytes is the size of one token on disk: 2 or 4.
func (h ShardHeader) TokenBytes() int {
	if h.Magic == MagicUint32 {
		return 4
	}
	return 2
}

// FileSize is the exact size of a valid shard with this header.
func (h ShardHeader) FileSize() int64 {
	return HeaderBytes + h.Tokens*int64(h.TokenBytes())
}

// ReadShardHeader reads and validates a HeaderBytes header from r. Its errors
// do not name a file; OpenShard adds the path.
func ReadShardHeader(r io.Reader) (ShardHeader, error) {
	var buf [HeaderBytes]byte
	n, err := io.ReadFull(r, buf[:])
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return ShardHeader{}, fmt.Errorf("header is %d bytes, want %d", n, HeaderBytes)
	}
	if err != nil {
		return ShardHeader{}, fmt.Errorf("reading header: %w", err)
	}
	return parseHeader(buf[:])
}

func parseHeader(b []byte) (ShardHeader, error) {
	le := binary.LittleEndian
	h := ShardHeader{
		Magic:   int32(le.Uint32(b[0:])),
		Version: int32(le.Uint32(b[4:])),
		Tokens:  int64(int32(le.Uint32(b[8:]))),
	}
	switch h.Magic {
	case MagicUint16:
		if h.Version != VersionUint16 {
			return ShardHeader{}, fmt.Errorf("magic %d (uint16 tokens) comes with version %d, found version %d",
				h.Magic, VersionUint16, h.Version)
		}
	case MagicUint32:
		if h.Version != VersionUint32 {
			return ShardHeader{}, fmt.Errorf("magic %d (uint32 tokens) comes with version %d, found version %d",
				h.Magic, VersionUint32, h.Version)
		}
	default:
		return ShardHeader{}, fmt.Errorf("bad magic %d: not an llm.c token shard (want %d for uint16 tokens or %d for uint32 tokens)",
			h.Magic, MagicUint16, MagicUint32)
	}
	if h.Tokens < 0 {
		return ShardHeader{}, fmt.Errorf("header gives a negative token count %d", h.Tokens)
	}
	return h, nil
}

// encode is the on-disk form of h.
func (h ShardHeader) encode() []byte {
	b := make([]byte, HeaderBytes)
	le := binary.LittleEndian
	le.PutUint32(b[0:], uint32(h.Magic))
	le.PutUint32(b[4:], uint32(h.Version))
	le.PutUint32(b[8:], uint32(int32(h.Tokens)))
	return b
}

// TokenSource is a sequence of tokens the loaders sample windows from: an
// on-disk Shard or an in-memory MemorySource. Implementations need not be
// safe for concurrent use unless they say so.
type TokenSource interface {
	// Name identifies the source in error messages (a file path for shards).
	Name() string
	// Len is the number of tokens.
	Len() int64
	// ReadTokens fills dst with the tokens at positions off, off+1, ...
	ReadTokens(dst []uint32, off int64) error
}

// Shard is an open llm.c token shard. Its token payload is in memory when it
// is at most MaxMemoryShardBytes, and read window by window otherwise.
// ReadTokens is safe for concurrent use.
type Shard struct {
	path     string
	header   ShardHeader
	file     *os.File    // open while the payload stays on disk
	ra       io.ReaderAt // the whole file, when the payload stays on disk
	inMemory bool
	payload  []byte // the token bytes, when inMemory
}

// OpenShard opens and validates the shard at path: its header, and that the
// file is exactly as long as the header's token count says.
func OpenShard(path string) (*Shard, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err // *PathError names the file
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if st.IsDir() {
		f.Close()
		return nil, fmt.Errorf("%s: is a directory, not a token shard", path)
	}
	s, err := newShard(path, f, st.Size(), MaxMemoryShardBytes)
	if err != nil {
		f.Close()
		return nil, err
	}
	if s.inMemory {
		if err := f.Close(); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
	} else {
		s.file = f
	}
	return s, nil
}

// newShard validates a shard of size bytes readable through r and reads its
// payload into memory when it is at most memLimit bytes.
func newShard(name string, r io.ReaderAt, size int64, memLimit int64) (*Shard, error) {
	h, err := ReadShardHeader(io.NewSectionReader(r, 0, HeaderBytes))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	want := h.FileSize()
	if size < want {
		return nil, fmt.Errorf("%s: truncated: the header says %d tokens of %d bytes, so the file should be %d bytes, but it is %d bytes",
			name, h.Tokens, h.TokenBytes(), want, size)
	}
	if size > want {
		return nil, fmt.Errorf("%s: %d trailing bytes: the header says %d tokens of %d bytes, so the file should be %d bytes, but it is %d bytes",
			name, size-want, h.Tokens, h.TokenBytes(), want, size)
	}
	s := &Shard{path: name, header: h}
	n := size - HeaderBytes
	if n > memLimit {
		s.ra = r
		return s, nil
	}
	s.inMemory = true
	s.payload = make([]byte, n)
	if err := readFullAt(r, s.payload, HeaderBytes); err != nil {
		return nil, fmt.Errorf("%s: reading tokens: %w", name, err)
	}
	return s, nil
}

// Name is the shard's path.
func (s *Shard) Name() string { return s.path }

// Header is the shard's validated header.
func (s *Shard) Header() ShardHeader { return s.header }

// Len is the number of tokens in the shard.
func (s *Shard) Len() int64 { return s.header.Tokens }

// ReadTokens fills dst with the tokens at positions off, off+1, ...
func (s *Shard) ReadTokens(dst []uint32, off int64) error {
	n := int64(len(dst))
	if off < 0 || off+n > s.header.Tokens {
		return fmt.Errorf("%s: tokens [%d, %d) are out of range: the shard has %d tokens", s.path, off, off+n, s.header.Tokens)
	}
	tb := int64(s.header.TokenBytes())
	var raw []byte
	if s.inMemory {
		raw = s.payload[off*tb : (off+n)*tb]
	} else {
		raw = make([]byte, n*tb)
		if err := readFullAt(s.ra, raw, HeaderBytes+off*tb); err != nil {
			return fmt.Errorf("%s: reading %d tokens at position %d: %w", s.path, n, off, err)
		}
	}
	decodeTokens(dst, raw, int(tb))
	return nil
}

// Close releases the file of a shard whose payload stays on disk.
func (s *Shard) Close() error {
	if s.file == nil {
		return nil
	}
	err := s.file.Close()
	s.file = nil
	return err
}

// readFullAt fills p from r at off. A ReaderAt may report io.EOF along with
// a full read that ends at the end of its input; that is success.
func readFullAt(r io.ReaderAt, p []byte, off int64) error {
	n, err := r.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil || errors.Is(err, io.EOF) {
		err = io.ErrUnexpectedEOF
	}
	return err
}

func decodeTokens(dst []uint32, raw []byte, tokenBytes int) {
	le := binary.LittleEndian
	if tokenBytes == 2 {
		for i := range dst {
			dst[i] = uint32(le.Uint16(raw[2*i:]))
		}
		return
	}
	for i := range dst {
		dst[i] = le.Uint32(raw[4*i:])
	}
}

// MemorySource is a TokenSource over a slice held in memory; it is how the
// embedded corpus feeds the loaders without touching disk.
type MemorySource struct {
	name   string
	tokens []uint32
}

// NewMemorySource wraps tokens (not copied) under name, which error messages
// use in place of a file path.
func NewMemorySource(name string, tokens []uint32) *MemorySource {
	return &MemorySource{name: name, tokens: tokens}
}

func (m *MemorySource) Name() string { return m.name }
func (m *MemorySource) Len() int64   { return int64(len(m.tokens)) }

func (m *MemorySource) ReadTokens(dst []uint32, off int64) error {
	n := int64(len(dst))
	if off < 0 || off+n > int64(len(m.tokens)) {
		return fmt.Errorf("%s: tokens [%d, %d) are out of range: the source has %d tokens", m.name, off, off+n, len(m.tokens))
	}
	copy(dst, m.tokens[off:off+n])
	return nil
}
