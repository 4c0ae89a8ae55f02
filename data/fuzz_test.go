package data

import (
	"bytes"
	"encoding/binary"
	"testing"
)

// FuzzShardHeader feeds arbitrary bytes to the header parser and to the
// whole-shard validator. Neither may panic; whatever they accept must be a
// well-formed shard whose tokens read back as the bytes say.
func FuzzShardHeader(f *testing.F) {
	f.Add(rawShard(MagicUint16, VersionUint16, 3, []byte{1, 0, 2, 0, 255, 255}))
	f.Add(rawShard(MagicUint32, VersionUint32, 2, []byte{1, 0, 0, 0, 0, 0, 1, 0}))
	f.Add(rawShard(MagicUint16, VersionUint16, 0, nil))
	f.Add(rawShard(MagicUint16, VersionUint32, 0, nil))              // version of the other format
	f.Add(rawShard(12345, 1, 0, nil))                                // bad magic
	f.Add(rawShard(MagicUint16, VersionUint16, 5, []byte{1}))        // truncated
	f.Add(rawShard(MagicUint32, VersionUint32, -1, nil))             // negative count
	f.Add(rawShard(MagicUint16, VersionUint16, 1, []byte{0})[:1023]) // short header
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := ReadShardHeader(bytes.NewReader(data))
		if err == nil {
			if len(data) < HeaderBytes {
				t.Fatalf("accepted a %d-byte header", len(data))
			}
			ok := (h.Magic == MagicUint16 && h.Version == VersionUint16) || (h.Magic == MagicUint32 && h.Version == VersionUint32)
			if !ok || h.Tokens < 0 {
				t.Fatalf("accepted header %+v", h)
			}
			if !bytes.Equal(h.encode()[:12], data[:12]) {
				t.Fatalf("header %+v does not encode back to its bytes", h)
			}
		}
		for _, memLimit := range []int64{0, 1 << 20} {
			s, err := newShard("fuzz.bin", bytes.NewReader(data), int64(len(data)), memLimit)
			if err != nil {
				continue
			}
			if s.Header().FileSize() != int64(len(data)) {
				t.Fatalf("accepted %d bytes for header %+v", len(data), s.Header())
			}
			got := make([]uint32, s.Len())
			if err := s.ReadTokens(got, 0); err != nil {
				t.Fatal(err)
			}
			tb := s.Header().TokenBytes()
			for i, tok := range got {
				var want uint32
				if tb == 2 {
					want = uint32(binary.LittleEndian.Uint16(data[HeaderBytes+2*i:]))
				} else {
					want = binary.LittleEndian.Uint32(data[HeaderBytes+4*i:])
				}
				if tok != want {
					t.Fatalf("token %d = %d, want %d", i, tok, want)
				}
			}
		}
	})
}
