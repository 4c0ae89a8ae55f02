package safetensors

import (
	"fmt"
	"io"
	"os"
)

// File is a safetensors file open for random access. Its methods are safe
// for concurrent use when the underlying io.ReaderAt is (an *os.File is).
type File struct {
	name   string
	r      io.ReaderAt
	header *Header
	closer io.Closer
}

// Open opens and validates the safetensors file at path.
func Open(path string) (*File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	sf, err := NewFile(path, f, st.Size())
	if err != nil {
		f.Close()
		return nil, err
	}
	sf.closer = f
	return sf, nil
}

// NewFile validates the safetensors file of the given size that r reads;
// name appears in error messages.
func NewFile(name string, r io.ReaderAt, size int64) (*File, error) {
	if size < 8 {
		return nil, fmt.Errorf("safetensors %s: file is %d bytes, too short for the 8-byte header length", name, size)
	}
	var lenBuf [8]byte
	if err := readFullAt(r, lenBuf[:], 0); err != nil {
		return nil, fmt.Errorf("safetensors %s: reading the header length: %w", name, err)
	}
	n, err := headerLen(name, lenBuf[:], size)
	if err != nil {
		return nil, err
	}
	buf := make([]byte, n)
	if err := readFullAt(r, buf, 8); err != nil {
		return nil, fmt.Errorf("safetensors %s: reading the %d-byte header: %w", name, n, err)
	}
	h, err := ParseHeader(name, buf, size-8-n)
	if err != nil {
		return nil, err
	}
	return &File{name: name, r: r, header: h}, nil
}

// Header is the file's parsed header; callers must not modify it.
func (f *File) Header() *Header { return f.header }

// Close closes the file if Open opened it.
func (f *File) Close() error {
	if f.closer == nil {
		return nil
	}
	return f.closer.Close()
}

// Float32 reads the named tensor, converting it to float32.
func (f *File) Float32(name string) ([]float32, error) {
	t, ok := f.header.Lookup(name)
	if !ok {
		return nil, fmt.Errorf("safetensors %s: no tensor %q", f.name, name)
	}
	dst := make([]float32, t.NumElements())
	if err := f.ReadFloat32(t, dst); err != nil {
		return nil, err
	}
	return dst, nil
}

// ReadFloat32 reads tensor t of this file into dst, which must hold exactly
// t.NumElements() values.
func (f *File) ReadFloat32(t TensorInfo, dst []float32) error {
	return ReadFloat32At(f.name, f.r, f.header.DataStart, t, dst)
}

// ReadFloat32At reads tensor t from r, whose data buffer starts at
// dataStart, into dst. It is File.ReadFloat32 for callers that keep the
// header and the bytes apart (a decompressed copy of a file, say).
func ReadFloat32At(file string, r io.ReaderAt, dataStart int64, t TensorInfo, dst []float32) error {
	if !t.DType.readable() {
		return fmt.Errorf("safetensors %s: tensor %q: cannot read dtype %s as float32", file, t.Name, t.DType)
	}
	if int64(len(dst)) != t.NumElements() {
		return fmt.Errorf("safetensors %s: tensor %q %v: destination holds %d values, want %d",
			file, t.Name, t.Shape, len(dst), t.NumElements())
	}
	pos := dataStart + t.Begin
	if t.DType == F32 && hostIsLittleEndian() {
		// Read straight into dst: no conversion, no second buffer.
		if err := readFullAt(r, float32Bytes(dst), pos); err != nil {
			return fmt.Errorf("safetensors %s: tensor %q: %w", file, t.Name, err)
		}
		return nil
	}
	size := t.DType.Size()
	buf := make([]byte, min(int64(chunkBytes), t.End-t.Begin))
	for len(dst) > 0 {
		n := min(len(dst), len(buf)/size)
		if err := readFullAt(r, buf[:n*size], pos); err != nil {
			return fmt.Errorf("safetensors %s: tensor %q: %w", file, t.Name, err)
		}
		decodeFloat32(t.DType, dst[:n], buf[:n*size])
		dst = dst[n:]
		pos += int64(n * size)
	}
	return nil
}

// readFullAt fills p from r at off. io.ReaderAt may report io.EOF along
// with a full read at the end of the input; only a short read is an error.
func readFullAt(r io.ReaderAt, p []byte, off int64) error {
	n, err := r.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil || err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return err
}
