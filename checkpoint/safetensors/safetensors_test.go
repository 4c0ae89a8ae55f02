package safetensors

import (
	"bytes"
	"encoding/binary"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// handMadeFile is a two-tensor file written out byte by byte from the
// format description: a = F32 [1, -2.5], b = BF16 [[1, 0.5, -inf]].
func handMadeFile() []byte {
	header := `{"__metadata__":{"format":"pt"},` +
		`"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},` +
		`"b":{"dtype":"BF16","shape":[1,3],"data_offsets":[8,14]}}` + "  " // 142 bytes + 2 spaces of padding
	var f []byte
	f = append(f, 0x90, 0, 0, 0, 0, 0, 0, 0) // N = 144
	f = append(f, header...)
	f = append(f, 0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x20, 0xc0) // 1.0f, -2.5f
	f = append(f, 0x80, 0x3f, 0x00, 0x3f, 0x80, 0xff)             // bf16 1.0, 0.5, -inf
	return f
}

func TestReadHandMadeFile(t *testing.T) {
	b := handMadeFile()
	f, err := NewFile("hand.safetensors", bytes.NewReader(b), int64(len(b)))
	if err != nil {
		t.Fatal(err)
	}
	h := f.Header()
	if h.DataStart != 152 || h.DataSize != 14 || h.Metadata["format"] != "pt" {
		t.Fatalf("header: start %d size %d metadata %v", h.DataStart, h.DataSize, h.Metadata)
	}
	if got := h.Names(); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("names %v", got)
	}
	info, _ := h.Lookup("b")
	if info.DType != BF16 || !slices.Equal(info.Shape, []int{1, 3}) || info.Begin != 8 || info.End != 14 {
		t.Fatalf("b: %+v", info)
	}
	a, err := f.Float32("a")
	if err != nil || !slices.Equal(a, []float32{1, -2.5}) {
		t.Fatalf("a = %v, %v", a, err)
	}
	bv, err := f.Float32("b")
	if err != nil || !slices.Equal(bv, []float32{1, 0.5, float32(math.Inf(-1))}) {
		t.Fatalf("b = %v, %v", bv, err)
	}
	if _, err := f.Float32("c"); err == nil || !strings.Contains(err.Error(), `"c"`) {
		t.Fatalf("missing tensor: %v", err)
	}
}

// TestReferenceExample parses the example file of the reference Rust
// implementation's documentation: an unpadded 60-byte header ('<') and a
// 2x2 I32 tensor.
func TestReferenceExample(t *testing.T) {
	b := []byte("<\x00\x00\x00\x00\x00\x00\x00" + `{"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}` + strings.Repeat("\x00", 16))
	f, err := NewFile("example", bytes.NewReader(b), int64(len(b)))
	if err != nil {
		t.Fatal(err)
	}
	info, ok := f.Header().Lookup("test")
	if !ok || info.DType != I32 || !slices.Equal(info.Shape, []int{2, 2}) || info.End != 16 || f.Header().DataStart != 68 {
		t.Fatalf("test: %+v", info)
	}
	if _, err := f.Float32("test"); err == nil || !strings.Contains(err.Error(), "cannot read dtype I32") {
		t.Fatalf("reading I32 as float32: %v", err)
	}
}

func TestWriteMatchesHandMadeFile(t *testing.T) {
	var buf bytes.Buffer
	w, err := NewWriter(&buf, []TensorSpec{
		{Name: "a", DType: F32, Shape: []int{2}},
		{Name: "b", DType: BF16, Shape: []int{1, 3}},
	}, map[string]string{"format": "pt"})
	if err != nil {
		t.Fatal(err)
	}
	// b arrives in two chunks.
	for _, chunk := range [][]float32{{1, -2.5}, {1}, {0.5, float32(math.Inf(-1))}} {
		if err := w.WriteFloat32(chunk); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if want := handMadeFile(); !bytes.Equal(buf.Bytes(), want) {
		t.Fatalf("writer output differs from the hand-made file:\n got %q\nwant %q", buf.Bytes(), want)
	}
}

func TestRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	specs := []TensorSpec{
		{Name: "layers.0.attn.wq", DType: F32, Shape: []int{7, 13}},
		{Name: "layers.0.moe.experts.3.w1", DType: BF16, Shape: []int{5, 3, 11}},
		{Name: "scalar", DType: F32, Shape: []int{}},
		{Name: "empty", DType: BF16, Shape: []int{0, 4}},
		{Name: "big", DType: BF16, Shape: []int{chunkBytes/2 + 77}}, // spans conversion chunks
		{Name: `odd "name" <&>`, DType: F32, Shape: []int{3}},
	}
	data := make([][]float32, len(specs))
	for i, s := range specs {
		n := 1
		for _, d := range s.Shape {
			n *= d
		}
		data[i] = make([]float32, n)
		for j := range data[i] {
			data[i][j] = float32(rng.NormFloat64())
		}
	}
	var buf bytes.Buffer
	w, err := NewWriter(&buf, specs, map[string]string{"k": "v"})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range data {
		for len(d) > 0 { // uneven chunks
			n := min(len(d), 1+rng.IntN(5000))
			if err := w.WriteFloat32(d[:n]); err != nil {
				t.Fatal(err)
			}
			d = d[n:]
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if binary.LittleEndian.Uint64(buf.Bytes())%8 != 0 {
		t.Fatalf("data buffer is not 8-byte aligned")
	}
	f, err := NewFile("rt", bytes.NewReader(buf.Bytes()), int64(buf.Len()))
	if err != nil {
		t.Fatal(err)
	}
	if f.Header().FileSize() != int64(buf.Len()) {
		t.Fatalf("FileSize %d, file %d", f.Header().FileSize(), buf.Len())
	}
	for i, s := range specs {
		got, err := f.Float32(s.Name)
		if err != nil {
			t.Fatal(err)
		}
		info, _ := f.Header().Lookup(s.Name)
		if !slices.Equal(info.Shape, s.Shape) || info.DType != s.DType {
			t.Fatalf("%s: info %+v", s.Name, info)
		}
		for j, v := range data[i] {
			want := v
			if s.DType == BF16 {
				want = refBF16(v)
			}
			if math.Float32bits(got[j]) != math.Float32bits(want) {
				t.Fatalf("%s[%d] = %v, want %v", s.Name, j, got[j], want)
			}
		}
	}
	// The same bytes through the streaming header reader.
	h, err := ReadHeader("rt", bytes.NewReader(buf.Bytes()))
	if err != nil || h.DataSize != f.Header().DataSize || len(h.Tensors) != len(specs) {
		t.Fatalf("ReadHeader: %v", err)
	}
}

// refBF16 rounds to bfloat16 independently of BF16FromFloat32: it takes the
// two bfloat16 neighbours of v and picks the nearer in float64, the one with
// an even last mantissa bit on a tie.
func refBF16(v float32) float32 {
	if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
		return v
	}
	bits := math.Float32bits(v)
	lo := math.Float32frombits(bits &^ 0xffff)         // toward zero
	hi := math.Float32frombits(bits&^0xffff + 0x10000) // away from zero (may be inf)
	dlo := math.Abs(float64(v) - float64(lo))
	dhi := math.Abs(float64(hi) - float64(v))
	if math.IsInf(float64(hi), 0) {
		// Beyond the largest bfloat16 halfway point rounding goes to inf,
		// as the next step up would be 2^128.
		dhi = math.Abs(math.Ldexp(1, 128) - math.Abs(float64(v)))
	}
	switch {
	case dlo < dhi:
		return lo
	case dhi < dlo:
		return hi
	case (bits>>16)&1 == 0:
		return lo
	}
	return hi
}

func TestBF16Rounding(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	cases := []float32{0, float32(math.Copysign(0, -1)), 1, -1, math.MaxFloat32, -math.MaxFloat32,
		math.SmallestNonzeroFloat32, float32(math.Inf(1)), float32(math.Inf(-1)),
		math.Float32frombits(0x3f808000), // exact tie, even below: rounds down
		math.Float32frombits(0x3f818000), // exact tie, odd below: rounds up
		math.Float32frombits(0x3f808001), // just above a tie
		math.Float32frombits(0x7f7f8000), // tie at the top: rounds to inf
	}
	for range 200000 {
		cases = append(cases, math.Float32frombits(rng.Uint32()))
	}
	for _, v := range cases {
		got := Float32FromBF16(BF16FromFloat32(v))
		if math.IsNaN(float64(v)) {
			if !math.IsNaN(float64(got)) || math.Signbit(float64(got)) != math.Signbit(float64(v)) {
				t.Fatalf("NaN %#x became %#x", math.Float32bits(v), math.Float32bits(got))
			}
			continue
		}
		if want := refBF16(v); math.Float32bits(got) != math.Float32bits(want) {
			t.Fatalf("bf16(%#x) = %#x, want %#x", math.Float32bits(v), math.Float32bits(got), math.Float32bits(want))
		}
	}
	// NaNs whose payload lives only in the low 16 bits must survive.
	for _, b := range []uint32{0x7f800001, 0xff800001, 0x7fc00000} {
		if got := Float32FromBF16(BF16FromFloat32(math.Float32frombits(b))); !math.IsNaN(float64(got)) {
			t.Fatalf("NaN %#x became %v", b, got)
		}
	}
}

func TestDecodeF16AndF64(t *testing.T) {
	// IEEE half bit patterns and their values.
	halves := map[uint16]float64{
		0x3c00: 1, 0xc000: -2, 0x3555: 0.333251953125, 0x7bff: 65504, 0x0001: math.Ldexp(1, -24),
		0x03ff: 1023 * math.Ldexp(1, -24), 0x0400: math.Ldexp(1, -14), 0x8000: math.Copysign(0, -1),
		0x7c00: math.Inf(1), 0xfc00: math.Inf(-1),
	}
	for h, want := range halves {
		if got := float32FromF16(h); float64(got) != want || math.Signbit(float64(got)) != math.Signbit(want) {
			t.Errorf("f16 %#04x = %v, want %v", h, got, want)
		}
	}
	if got := float32FromF16(0x7e00); !math.IsNaN(float64(got)) {
		t.Errorf("f16 NaN = %v", got)
	}
	// A file of F16 and F64 tensors built by hand.
	header := `{"h":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},"d":{"dtype":"F64","shape":[1],"data_offsets":[4,12]}}`
	var b []byte
	b = binary.LittleEndian.AppendUint64(b, uint64(len(header)))
	b = append(b, header...)
	b = binary.LittleEndian.AppendUint16(b, 0x3c00)
	b = binary.LittleEndian.AppendUint16(b, 0xc000)
	b = binary.LittleEndian.AppendUint64(b, math.Float64bits(0.1))
	f, err := NewFile("f16", bytes.NewReader(b), int64(len(b)))
	if err != nil {
		t.Fatal(err)
	}
	if h, err := f.Float32("h"); err != nil || !slices.Equal(h, []float32{1, -2}) {
		t.Fatalf("h = %v, %v", h, err)
	}
	if d, err := f.Float32("d"); err != nil || d[0] != float32(0.1) {
		t.Fatalf("d = %v, %v", d, err)
	}
}

// fileWithHeader builds a file from a raw header and dataSize zero bytes.
func fileWithHeader(header string, dataSize int) []byte {
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	b = append(b, header...)
	return append(b, make([]byte, dataSize)...)
}

func TestMalformedHeaders(t *testing.T) {
	entry := func(name, dtype, shape string, begin, end int) string {
		return `"` + name + `":{"dtype":"` + dtype + `","shape":` + shape +
			`,"data_offsets":[` + strconv.Itoa(begin) + `,` + strconv.Itoa(end) + `]}`
	}
	cases := []struct {
		name, file, want string
	}{
		{"empty", "", "too short"},
		{"short length", "\x05\x00", "too short"},
		{"length past end", string(binary.LittleEndian.AppendUint64(nil, 1000)) + "{}", "runs past the end"},
		{"huge length", string(binary.LittleEndian.AppendUint64(nil, 1<<62)) + "{}", "exceeds"},
		{"not json", string(fileWithHeader("hello", 0)), "does not start with '{'"},
		{"truncated json", string(fileWithHeader(`{"a":{"dtype":"F32"`, 0)), "header"},
		{"trailing junk", string(fileWithHeader(`{} x`, 0)), "after the object"},
		{"unknown dtype", string(fileWithHeader(`{`+entry("w", "F33", "[1]", 0, 4)+`}`, 4)), `tensor "w": unknown dtype "F33"`},
		{"missing dtype", string(fileWithHeader(`{"w":{"shape":[1],"data_offsets":[0,4]}}`, 4)), `tensor "w": missing dtype`},
		{"missing shape", string(fileWithHeader(`{"w":{"dtype":"F32","data_offsets":[0,4]}}`, 4)), `tensor "w": missing shape`},
		{"negative dim", string(fileWithHeader(`{`+entry("w", "F32", "[-1]", 0, 4)+`}`, 4)), `tensor "w": bad dimension`},
		{"fractional dim", string(fileWithHeader(`{`+entry("w", "F32", "[1.5]", 0, 4)+`}`, 4)), `tensor "w"`},
		{"shape overflow", string(fileWithHeader(`{`+entry("w", "F32", "[4294967296,4294967296]", 0, 4)+`}`, 4)), `tensor "w": shape`},
		{"one offset", string(fileWithHeader(`{"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}}`, 4)), `tensor "w": data_offsets must be`},
		{"size mismatch", string(fileWithHeader(`{`+entry("w", "F32", "[2]", 0, 4)+`}`, 4)), `tensor "w": data_offsets [0, 4] hold 4 bytes but F32[2] needs 8`},
		{"reversed offsets", string(fileWithHeader(`{`+entry("w", "F32", "[0]", 4, 0)+`}`, 4)), `tensor "w": bad data_offsets`},
		{"out of range", string(fileWithHeader(`{`+entry("w", "F32", "[2]", 0, 8)+`}`, 4)), `tensor "w": data_offsets [0, 8] run past the end`},
		{"overlap", string(fileWithHeader(`{`+entry("a", "F32", "[2]", 0, 8)+`,`+entry("b", "F32", "[1]", 4, 8)+`}`, 8)), `tensor "b": data_offsets [4, 8] overlap tensor "a"`},
		{"hole", string(fileWithHeader(`{`+entry("a", "F32", "[1]", 0, 4)+`,`+entry("b", "F32", "[1]", 8, 12)+`}`, 12)), `tensor "b": data_offsets [8, 12] leave a hole of 4 bytes`},
		{"unindexed tail", string(fileWithHeader(`{`+entry("a", "F32", "[1]", 0, 4)+`}`, 8)), "tensors cover 4 bytes but the data buffer holds 8"},
		{"duplicate tensor", string(fileWithHeader(`{`+entry("a", "F32", "[1]", 0, 4)+`,`+entry("a", "F32", "[1]", 0, 4)+`}`, 4)), `tensor "a" appears twice`},
		{"metadata not strings", string(fileWithHeader(`{"__metadata__":{"k":1}}`, 0)), "__metadata__ must be an object of strings"},
		{"entry not object", string(fileWithHeader(`{"a":[1,2]}`, 0)), `tensor "a"`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := NewFile("bad.safetensors", bytes.NewReader([]byte(c.file)), int64(len(c.file)))
			if err == nil {
				t.Fatalf("no error")
			}
			if !strings.Contains(err.Error(), "bad.safetensors") || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %q should name the file and contain %q", err, c.want)
			}
		})
	}
}

func TestWriterMisuse(t *testing.T) {
	var buf bytes.Buffer
	for _, specs := range [][]TensorSpec{
		{{Name: "", DType: F32}},
		{{Name: "__metadata__", DType: F32}},
		{{Name: "a", DType: F32}, {Name: "a", DType: F32}},
		{{Name: "a", DType: F16}},
		{{Name: "a", DType: F32, Shape: []int{-1}}},
		{{Name: "\xff", DType: F32}},
	} {
		if _, err := NewWriter(&buf, specs, nil); err == nil {
			t.Errorf("NewWriter(%+v) accepted", specs)
		}
	}
	specs := []TensorSpec{{Name: "a", DType: F32, Shape: []int{2}}, {Name: "b", DType: BF16, Shape: []int{1}}}
	w, _ := NewWriter(&buf, specs, nil)
	if err := w.WriteFloat32([]float32{1, 2, 3}); err == nil || !strings.Contains(err.Error(), `"a"`) {
		t.Errorf("spanning write: %v", err)
	}
	w, _ = NewWriter(&buf, specs, nil)
	_ = w.WriteFloat32([]float32{1, 2})
	if err := w.Close(); err == nil || !strings.Contains(err.Error(), `"b"`) {
		t.Errorf("short write: %v", err)
	}
	w, _ = NewWriter(&buf, specs, nil)
	_ = w.WriteFloat32([]float32{1, 2})
	_ = w.WriteFloat32([]float32{3})
	if err := w.WriteFloat32([]float32{4}); err == nil {
		t.Errorf("write past the end accepted")
	}
}

// FuzzSafetensorsHeader feeds arbitrary bytes to the reader: it must return
// an error or a header whose tensors tile the data and read back, never
// panic or allocate beyond the input's size.
func FuzzSafetensorsHeader(f *testing.F) {
	f.Add(handMadeFile())
	f.Add(fileWithHeader(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, 4))
	f.Add(fileWithHeader(`{"__metadata__":null,"a":{"dtype":"I64","shape":[],"data_offsets":[0,8]}}`, 8))
	f.Add(fileWithHeader(`{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"BF16","shape":[0],"data_offsets":[0,0]}}`, 0))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		file, err := NewFile("fuzz", bytes.NewReader(b), int64(len(b)))
		if err != nil {
			return
		}
		h := file.Header()
		if h.FileSize() != int64(len(b)) {
			t.Fatalf("accepted header covers %d bytes of a %d-byte file", h.FileSize(), len(b))
		}
		end := int64(0)
		for _, ti := range h.Tensors {
			if ti.Begin != end || ti.End-ti.Begin != ti.NumElements()*int64(ti.DType.Size()) {
				t.Fatalf("tensor %+v does not follow offset %d", ti, end)
			}
			end = ti.End
			if ti.DType.readable() {
				if _, err := file.Float32(ti.Name); err != nil {
					t.Fatalf("reading accepted tensor %q: %v", ti.Name, err)
				}
			}
		}
		// Whatever parses from a stream parses the same way.
		if _, err := ReadHeader("fuzz", bytes.NewReader(b)); err != nil {
			t.Fatalf("NewFile accepted what ReadHeader rejects: %v", err)
		}
	})
}
