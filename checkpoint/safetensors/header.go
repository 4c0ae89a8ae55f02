package safetensors

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"slices"
	"sort"
	"strconv"
)

// MaxHeaderSize bounds the JSON header, as the reference implementation
// does, so that a corrupt length field cannot make a reader allocate
// gigabytes.
const MaxHeaderSize = 100_000_000

// metadataKey is the reserved header key of the string-to-string metadata.
const metadataKey = "__metadata__"

// TensorInfo describes one tensor of a file.
type TensorInfo struct {
	Name  string
	DType DType
	Shape []int
	// Begin and End are the tensor's byte range [Begin, End) in the data
	// buffer (not in the file: add Header.DataStart).
	Begin, End int64
}

// NumElements is the product of the shape (1 for a scalar).
func (t TensorInfo) NumElements() int64 {
	n := int64(1)
	for _, d := range t.Shape {
		n *= int64(d)
	}
	return n
}

// Header is a parsed, validated safetensors header.
type Header struct {
	// Tensors in data-buffer order.
	Tensors []TensorInfo
	// Metadata is the "__metadata__" object; nil when the file has none.
	Metadata map[string]string
	// DataStart is the file offset of the data buffer: 8 plus the header
	// length.
	DataStart int64
	// DataSize is the length of the data buffer.
	DataSize int64

	index map[string]int
}

// Lookup finds a tensor by name.
func (h *Header) Lookup(name string) (TensorInfo, bool) {
	i, ok := h.index[name]
	if !ok {
		return TensorInfo{}, false
	}
	return h.Tensors[i], true
}

// Names lists the tensor names in data-buffer order.
func (h *Header) Names() []string {
	names := make([]string, len(h.Tensors))
	for i, t := range h.Tensors {
		names[i] = t.Name
	}
	return names
}

// FileSize is the size of a complete file with this header.
func (h *Header) FileSize() int64 { return h.DataStart + h.DataSize }

// rawEntry is one tensor's header entry as JSON spells it.
type rawEntry struct {
	DType       string  `json:"dtype"`
	Shape       []int64 `json:"shape"`
	DataOffsets []int64 `json:"data_offsets"`
}

// ParseHeader parses and validates the JSON header of the file named file
// (the name is only used in error messages). dataSize is the length of the
// data buffer that follows the header, or -1 when unknown (a stream); when
// known, the tensors must tile it exactly.
func ParseHeader(file string, headerJSON []byte, dataSize int64) (*Header, error) {
	errf := func(format string, args ...any) error {
		return fmt.Errorf("safetensors %s: header: %s", file, fmt.Sprintf(format, args...))
	}
	if len(headerJSON) == 0 || headerJSON[0] != '{' {
		return nil, errf("does not start with '{'")
	}
	dec := json.NewDecoder(bytes.NewReader(headerJSON))
	if _, err := dec.Token(); err != nil {
		return nil, errf("%v", err)
	}
	h := &Header{DataStart: 8 + int64(len(headerJSON)), index: map[string]int{}}
	seenMetadata := false
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, errf("%v", err)
		}
		key, ok := tok.(string)
		if !ok {
			return nil, errf("unexpected %v where a key belongs", tok)
		}
		if key == metadataKey {
			if seenMetadata {
				return nil, errf("%s appears twice", metadataKey)
			}
			seenMetadata = true
			if err := dec.Decode(&h.Metadata); err != nil {
				return nil, errf("%s must be an object of strings: %v", metadataKey, err)
			}
			continue
		}
		if _, dup := h.index[key]; dup {
			return nil, errf("tensor %q appears twice", key)
		}
		var e rawEntry
		if err := dec.Decode(&e); err != nil {
			return nil, errf("tensor %q: %v", key, err)
		}
		t, err := checkEntry(key, e, dataSize)
		if err != nil {
			return nil, errf("%v", err)
		}
		h.index[key] = len(h.Tensors)
		h.Tensors = append(h.Tensors, t)
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return nil, errf("%v", err)
	}
	if tok, err := dec.Token(); err != io.EOF {
		if err != nil {
			return nil, errf("after the object: %v", err)
		}
		return nil, errf("unexpected %v after the object", tok)
	}
	if err := h.checkTiling(dataSize); err != nil {
		return nil, errf("%v", err)
	}
	return h, nil
}

// checkEntry validates one entry on its own and converts it.
func checkEntry(name string, e rawEntry, dataSize int64) (TensorInfo, error) {
	t := TensorInfo{Name: name, DType: DType(e.DType)}
	size := t.DType.Size()
	switch {
	case e.DType == "":
		return t, fmt.Errorf("tensor %q: missing dtype", name)
	case size == 0:
		return t, fmt.Errorf("tensor %q: unknown dtype %q", name, e.DType)
	case e.Shape == nil:
		return t, fmt.Errorf("tensor %q: missing shape", name)
	case len(e.DataOffsets) != 2:
		return t, fmt.Errorf("tensor %q: data_offsets must be [begin, end], got %v", name, e.DataOffsets)
	}
	nbytes := int64(size)
	for _, d := range e.Shape {
		if d < 0 || int64(int(d)) != d {
			return t, fmt.Errorf("tensor %q: bad dimension %d in shape %v", name, d, e.Shape)
		}
		if d != 0 && nbytes > math.MaxInt64/d {
			return t, fmt.Errorf("tensor %q: shape %v is too large", name, e.Shape)
		}
		nbytes *= d
		t.Shape = append(t.Shape, int(d))
	}
	if t.Shape == nil {
		t.Shape = []int{} // a scalar, distinct from a missing shape
	}
	t.Begin, t.End = e.DataOffsets[0], e.DataOffsets[1]
	switch {
	case t.Begin < 0 || t.End < t.Begin:
		return t, fmt.Errorf("tensor %q: bad data_offsets [%d, %d]", name, t.Begin, t.End)
	case t.End-t.Begin != nbytes:
		return t, fmt.Errorf("tensor %q: data_offsets [%d, %d] hold %d bytes but %s%v needs %d",
			name, t.Begin, t.End, t.End-t.Begin, t.DType, t.Shape, nbytes)
	case dataSize >= 0 && t.End > dataSize:
		return t, fmt.Errorf("tensor %q: data_offsets [%d, %d] run past the end of the %d-byte data buffer (truncated file?)",
			name, t.Begin, t.End, dataSize)
	}
	return t, nil
}

// checkTiling sorts the tensors into data order and checks that their byte
// ranges cover the data buffer with no overlap and no hole, as the format
// requires (a hole could hide a second file inside the first).
func (h *Header) checkTiling(dataSize int64) error {
	sort.SliceStable(h.Tensors, func(i, j int) bool {
		a, b := h.Tensors[i], h.Tensors[j]
		return a.Begin < b.Begin || (a.Begin == b.Begin && a.End < b.End)
	})
	for i, t := range h.Tensors {
		h.index[t.Name] = i
	}
	end, last := int64(0), ""
	for _, t := range h.Tensors {
		switch {
		case t.Begin < end:
			return fmt.Errorf("tensor %q: data_offsets [%d, %d] overlap tensor %q (ends at %d)",
				t.Name, t.Begin, t.End, last, end)
		case t.Begin > end:
			return fmt.Errorf("tensor %q: data_offsets [%d, %d] leave a hole of %d bytes before them",
				t.Name, t.Begin, t.End, t.Begin-end)
		}
		if t.End > t.Begin {
			end, last = t.End, t.Name
		}
	}
	if dataSize >= 0 && end != dataSize {
		return fmt.Errorf("tensors cover %d bytes but the data buffer holds %d", end, dataSize)
	}
	h.DataSize = end
	return nil
}

// ReadHeader reads the length field and the header from the start of r and
// leaves r at the first byte of the data buffer. The data buffer's length
// is unknown to it, so it cannot check that the tensors cover all of it.
func ReadHeader(file string, r io.Reader) (*Header, error) {
	var lenBuf [8]byte
	if _, err := io.ReadFull(r, lenBuf[:]); err != nil {
		return nil, fmt.Errorf("safetensors %s: reading the header length: %w", file, err)
	}
	n, err := headerLen(file, lenBuf[:], -1)
	if err != nil {
		return nil, err
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(r, buf); err != nil {
		return nil, fmt.Errorf("safetensors %s: reading the %d-byte header: %w", file, n, err)
	}
	return ParseHeader(file, buf, -1)
}

// headerLen decodes and bounds the header length; fileSize is -1 if unknown.
func headerLen(file string, b []byte, fileSize int64) (int64, error) {
	n := binaryLE64(b)
	switch {
	case n > MaxHeaderSize:
		return 0, fmt.Errorf("safetensors %s: header length %d exceeds the %d-byte limit (not a safetensors file?)",
			file, n, MaxHeaderSize)
	case fileSize >= 0 && n > uint64(fileSize-8):
		return 0, fmt.Errorf("safetensors %s: header length %d runs past the end of the %d-byte file (truncated?)",
			file, n, fileSize)
	}
	return int64(n), nil
}

func binaryLE64(b []byte) uint64 {
	var n uint64
	for i := 7; i >= 0; i-- {
		n = n<<8 | uint64(b[i])
	}
	return n
}

// encodeHeader renders the header JSON for tensors (in the given order,
// with their offsets already assigned) and metadata (keys sorted), padded
// with spaces to a multiple of 8 bytes.
func encodeHeader(tensors []TensorInfo, metadata map[string]string) []byte {
	var b bytes.Buffer
	b.WriteByte('{')
	if len(metadata) > 0 {
		writeJSONString(&b, metadataKey)
		b.WriteString(":{")
		keys := make([]string, 0, len(metadata))
		for k := range metadata {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for i, k := range keys {
			if i > 0 {
				b.WriteByte(',')
			}
			writeJSONString(&b, k)
			b.WriteByte(':')
			writeJSONString(&b, metadata[k])
		}
		b.WriteByte('}')
	}
	for i, t := range tensors {
		if i > 0 || len(metadata) > 0 {
			b.WriteByte(',')
		}
		writeJSONString(&b, t.Name)
		b.WriteString(`:{"dtype":`)
		writeJSONString(&b, string(t.DType))
		b.WriteString(`,"shape":[`)
		for j, d := range t.Shape {
			if j > 0 {
				b.WriteByte(',')
			}
			b.WriteString(strconv.Itoa(d))
		}
		fmt.Fprintf(&b, `],"data_offsets":[%d,%d]}`, t.Begin, t.End)
	}
	b.WriteByte('}')
	for b.Len()%8 != 0 {
		b.WriteByte(' ')
	}
	return b.Bytes()
}

// writeJSONString writes s, which must be valid UTF-8, as a JSON string.
// Unlike encoding/json it leaves '<', '>' and '&' alone, so names stay
// readable in the header.
func writeJSONString(b *bytes.Buffer, s string) {
	const hex = "0123456789abcdef"
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"' || c == '\\':
			b.WriteByte('\\')
			b.WriteByte(c)
		case c < 0x20:
			b.WriteString(`\u00`)
			b.WriteByte(hex[c>>4])
			b.WriteByte(hex[c&0xf])
		default:
			b.WriteByte(c)
		}
	}
	b.WriteByte('"')
}
