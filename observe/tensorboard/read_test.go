package tensorboard_test

// An event-file reader written apart from the writer: its own bit-by-bit
// CRC-32C and its own protobuf decoding (protowire.Consume*), so that the
// tests check the files against the format, not the writer against itself.

import (
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
)

// crc32c computes CRC-32C (Castagnoli, reflected polynomial 0x82f63b78)
// one bit at a time.
func crc32c(b []byte) uint32 {
	crc := ^uint32(0)
	for _, c := range b {
		crc ^= uint32(c)
		for range 8 {
			if crc&1 != 0 {
				crc = crc>>1 ^ 0x82f63b78
			} else {
				crc >>= 1
			}
		}
	}
	return ^crc
}

func masked(b []byte) uint32 {
	c := crc32c(b)
	return (c>>15 | c<<17) + 0xa282ead8
}

// event is what the tests look at in one decoded Event.
type event struct {
	wallTime     float64
	step         int64
	fileVersion  string
	sessionStart bool
	scalars      map[string]float32
	histos       map[string]histo
}

type histo struct {
	min, max, num, sum, sumSquares float64
	limits, counts                 []float64
}

// readEvents reads every record of the file at path, checking both
// checksums of each, and decodes its Event.
func readEvents(t *testing.T, path string) []event {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var events []event
	for off := 0; off < len(b); {
		if len(b)-off < 12 {
			t.Fatalf("%s: %d bytes left at offset %d, less than a record header", path, len(b)-off, off)
		}
		n := binary.LittleEndian.Uint64(b[off:])
		if got, want := binary.LittleEndian.Uint32(b[off+8:]), masked(b[off:off+8]); got != want {
			t.Fatalf("%s: record at %d: length checksum %#x, want %#x", path, off, got, want)
		}
		start := off + 12
		end := start + int(n)
		if end+4 > len(b) {
			t.Fatalf("%s: record at %d: %d data bytes run past the end", path, off, n)
		}
		data := b[start:end]
		if got, want := binary.LittleEndian.Uint32(b[end:]), masked(data); got != want {
			t.Fatalf("%s: record at %d: data checksum %#x, want %#x", path, off, got, want)
		}
		ev, err := decodeEvent(data)
		if err != nil {
			t.Fatalf("%s: record at %d: %v", path, off, err)
		}
		events = append(events, ev)
		off = end + 4
	}
	return events
}

// fields calls f for each field of message b.
func fields(b []byte, f func(num protowire.Number, typ protowire.Type, v []byte) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		m := protowire.ConsumeFieldValue(num, typ, b)
		if m < 0 {
			return protowire.ParseError(m)
		}
		if err := f(num, typ, b[:m]); err != nil {
			return err
		}
		b = b[m:]
	}
	return nil
}

func wantType(num protowire.Number, got, want protowire.Type) error {
	if got != want {
		return fmt.Errorf("field %d has wire type %d, want %d", num, got, want)
	}
	return nil
}

func fixed64(v []byte) float64 {
	x, _ := protowire.ConsumeFixed64(v)
	return math.Float64frombits(x)
}

func bytesOf(v []byte) []byte {
	x, _ := protowire.ConsumeBytes(v)
	return x
}

func decodeEvent(b []byte) (event, error) {
	ev := event{scalars: map[string]float32{}, histos: map[string]histo{}}
	err := fields(b, func(num protowire.Number, typ protowire.Type, v []byte) error {
		switch num {
		case 1: // wall_time
			if err := wantType(num, typ, protowire.Fixed64Type); err != nil {
				return err
			}
			ev.wallTime = fixed64(v)
		case 2: // step
			if err := wantType(num, typ, protowire.VarintType); err != nil {
				return err
			}
			x, _ := protowire.ConsumeVarint(v)
			ev.step = int64(x)
		case 3: // file_version
			if err := wantType(num, typ, protowire.BytesType); err != nil {
				return err
			}
			ev.fileVersion = string(bytesOf(v))
		case 5: // summary
			if err := wantType(num, typ, protowire.BytesType); err != nil {
				return err
			}
			return decodeSummary(bytesOf(v), &ev)
		case 7: // session_log
			return fields(bytesOf(v), func(num protowire.Number, typ protowire.Type, v []byte) error {
				if num == 1 {
					x, _ := protowire.ConsumeVarint(v)
					ev.sessionStart = x == 1
				}
				return nil
			})
		default:
			return fmt.Errorf("unexpected Event field %d", num)
		}
		return nil
	})
	return ev, err
}

func decodeSummary(b []byte, ev *event) error {
	return fields(b, func(num protowire.Number, typ protowire.Type, v []byte) error {
		if num != 1 {
			return fmt.Errorf("unexpected Summary field %d", num)
		}
		var tag string
		var scalar *float32
		var h *histo
		err := fields(bytesOf(v), func(num protowire.Number, typ protowire.Type, v []byte) error {
			switch num {
			case 1:
				tag = string(bytesOf(v))
			case 2:
				if err := wantType(num, typ, protowire.Fixed32Type); err != nil {
					return err
				}
				x, _ := protowire.ConsumeFixed32(v)
				f := math.Float32frombits(x)
				scalar = &f
			case 5:
				d, err := decodeHisto(bytesOf(v))
				if err != nil {
					return err
				}
				h = &d
			default:
				return fmt.Errorf("unexpected Value field %d", num)
			}
			return nil
		})
		switch {
		case err != nil:
			return err
		case tag == "":
			return fmt.Errorf("a Value without a tag")
		case scalar != nil:
			ev.scalars[tag] = *scalar
		case h != nil:
			ev.histos[tag] = *h
		default:
			return fmt.Errorf("Value %q holds neither simple_value nor histo", tag)
		}
		return nil
	})
}

func decodeHisto(b []byte) (histo, error) {
	var h histo
	packed := func(v []byte) []float64 {
		p := bytesOf(v)
		out := make([]float64, 0, len(p)/8)
		for len(p) >= 8 {
			out = append(out, math.Float64frombits(binary.LittleEndian.Uint64(p)))
			p = p[8:]
		}
		return out
	}
	err := fields(b, func(num protowire.Number, typ protowire.Type, v []byte) error {
		switch num {
		case 1, 2, 3, 4, 5:
			if err := wantType(num, typ, protowire.Fixed64Type); err != nil {
				return err
			}
			*[]*float64{&h.min, &h.max, &h.num, &h.sum, &h.sumSquares}[num-1] = fixed64(v)
		case 6:
			h.limits = packed(v)
		case 7:
			h.counts = packed(v)
		default:
			return fmt.Errorf("unexpected HistogramProto field %d", num)
		}
		return nil
	})
	if err == nil && len(h.limits) != len(h.counts) {
		err = fmt.Errorf("histogram with %d limits and %d counts", len(h.limits), len(h.counts))
	}
	return h, err
}
