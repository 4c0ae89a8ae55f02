package safetensors

import (
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"unicode/utf8"
)

// TensorSpec declares one tensor to a Writer.
type TensorSpec struct {
	Name  string
	DType DType // F32 or BF16
	Shape []int
}

// chunkBytes is the size of the Writer's conversion buffer: large enough
// that writes are efficient, small enough to be free next to a model.
const chunkBytes = 1 << 20

// Writer streams a safetensors file: the header goes out in NewWriter, then
// each declared tensor's elements in declaration order through WriteFloat32.
// A Writer is not safe for concurrent use; use one per file.
type Writer struct {
	w       io.Writer
	tensors []TensorInfo
	cur     int   // index of the tensor being written
	done    int64 // elements of tensors[cur] written so far
	buf     []byte
	err     error // sticky: the first failure
}

// NewWriter validates the declarations, lays out the data buffer in
// declaration order and writes the header to w. metadata may be nil.
func NewWriter(w io.Writer, tensors []TensorSpec, metadata map[string]string) (*Writer, error) {
	sw := &Writer{w: w, tensors: make([]TensorInfo, len(tensors))}
	seen := make(map[string]bool, len(tensors))
	offset := int64(0)
	for i, spec := range tensors {
		switch {
		case spec.Name == "" || spec.Name == metadataKey:
			return nil, fmt.Errorf("safetensors: tensor %d: bad name %q", i, spec.Name)
		case !utf8.ValidString(spec.Name):
			return nil, fmt.Errorf("safetensors: tensor %q: name is not valid UTF-8", spec.Name)
		case seen[spec.Name]:
			return nil, fmt.Errorf("safetensors: tensor %q declared twice", spec.Name)
		case !spec.DType.writable():
			return nil, fmt.Errorf("safetensors: tensor %q: cannot write dtype %q (only F32 and BF16)", spec.Name, spec.DType)
		}
		seen[spec.Name] = true
		nbytes := int64(spec.DType.Size())
		for _, d := range spec.Shape {
			if d < 0 || (d != 0 && nbytes > math.MaxInt64/int64(d)) {
				return nil, fmt.Errorf("safetensors: tensor %q: bad shape %v", spec.Name, spec.Shape)
			}
			nbytes *= int64(d)
		}
		shape := append([]int{}, spec.Shape...)
		sw.tensors[i] = TensorInfo{Name: spec.Name, DType: spec.DType, Shape: shape, Begin: offset, End: offset + nbytes}
		offset += nbytes
	}
	for k, v := range metadata {
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			return nil, fmt.Errorf("safetensors: metadata %q: not valid UTF-8", k)
		}
	}
	header := encodeHeader(sw.tensors, metadata)
	var lenBuf [8]byte
	binary.LittleEndian.PutUint64(lenBuf[:], uint64(len(header)))
	if _, err := w.Write(lenBuf[:]); err != nil {
		return nil, err
	}
	if _, err := w.Write(header); err != nil {
		return nil, err
	}
	return sw, nil
}

// WriteFloat32 continues the current tensor with data, converting to its
// dtype. A tensor may arrive in any number of calls, but one call may not
// run into the next tensor. Empty tensors need no call.
func (w *Writer) WriteFloat32(data []float32) error {
	if w.err != nil {
		return w.err
	}
	w.skipFinished()
	if w.cur == len(w.tensors) {
		if len(data) == 0 {
			return nil
		}
		w.err = fmt.Errorf("safetensors: %d elements written after the last declared tensor", len(data))
		return w.err
	}
	t := w.tensors[w.cur]
	if left := t.NumElements() - w.done; int64(len(data)) > left {
		w.err = fmt.Errorf("safetensors: tensor %q %v: %d elements written where %d remain",
			t.Name, t.Shape, len(data), left)
		return w.err
	}
	if t.DType == F32 && hostIsLittleEndian() {
		// The bytes are already in file order: write them as they are.
		if _, err := w.w.Write(float32Bytes(data)); err != nil {
			w.err = err
			return err
		}
		w.done += int64(len(data))
		return nil
	}
	size := t.DType.Size()
	if w.buf == nil {
		w.buf = make([]byte, chunkBytes)
	}
	for len(data) > 0 {
		n := min(len(data), len(w.buf)/size)
		encodeFloat32(t.DType, w.buf[:n*size], data[:n])
		if _, err := w.w.Write(w.buf[:n*size]); err != nil {
			w.err = err
			return err
		}
		data = data[n:]
		w.done += int64(n)
	}
	return nil
}

// skipFinished moves past the tensors that are fully written.
func (w *Writer) skipFinished() {
	for w.cur < len(w.tensors) && w.done == w.tensors[w.cur].NumElements() {
		w.cur++
		w.done = 0
	}
}

// Close checks that every declared element was written. It does not close
// the underlying writer.
func (w *Writer) Close() error {
	if w.err != nil {
		return w.err
	}
	w.skipFinished()
	if w.cur < len(w.tensors) {
		t := w.tensors[w.cur]
		w.err = fmt.Errorf("safetensors: tensor %q %v: only %d of %d elements written",
			t.Name, t.Shape, w.done, t.NumElements())
		return w.err
	}
	return nil
}
