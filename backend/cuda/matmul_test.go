package cuda

// MatMul's logic that needs no GPU: the row-major to cuBLASLt mapping
// (checked by running a column-major GEMM that reads the plan the way
// cuBLASLt does), argument checks, alignment, the algorithm cache and the
// C struct layouts.

import (
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"unsafe"

	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// rowMajorRef is out[m,n] = alpha*op(a)*op(b) + beta*out, naively.
func rowMajorRef(out, a, b []float64, m, n, k int, transA, transB bool, alpha, beta float64) {
	for i := range m {
		for j := range n {
			var s float64
			for l := range k {
				ail := a[i*k+l]
				if transA {
					ail = a[l*m+i]
				}
				blj := b[l*n+j]
				if transB {
					blj = b[j*k+l]
				}
				s += ail * blj
			}
			out[i*n+j] = alpha*s + beta*out[i*n+j]
		}
	}
}

// ltElem is element (r, c) of op(x) as cuBLASLt reads it from column-major
// memory.
func ltElem(t *testing.T, x ltMatrix, data []float64, r, c int) float64 {
	if x.trans {
		r, c = c, r
	}
	if r < 0 || r >= x.rows || c < 0 || c >= x.cols {
		t.Fatalf("element (%d, %d) outside a %dx%d matrix", r, c, x.rows, x.cols)
	}
	return data[r+c*x.ld]
}

// ltEmulate is cublasLtMatmul's definition on the plan: D = alpha*op(A)·
// op(B) + beta*C, column-major, with C = D.
func ltEmulate(t *testing.T, p ltPlan, A, B, C []float64, alpha, beta float64) {
	for j := range p.n {
		for i := range p.m {
			var s float64
			for l := range p.k {
				s += ltElem(t, p.a, A, i, l) * ltElem(t, p.b, B, l, j)
			}
			C[i+j*p.c.ld] = alpha*s + beta*C[i+j*p.c.ld]
		}
	}
}

// opShape is the shape of op(x).
func opShape(x ltMatrix) (int, int) {
	if x.trans {
		return x.cols, x.rows
	}
	return x.rows, x.cols
}

func TestPlanRowMajor(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	shapes := [][3]int{{1, 1, 1}, {7, 13, 5}, {13, 7, 5}, {5, 7, 13}, {1, 9, 4}, {9, 1, 4}, {6, 6, 1}}
	for range 8 {
		shapes = append(shapes, [3]int{1 + rng.IntN(12), 1 + rng.IntN(12), 1 + rng.IntN(12)})
	}
	for _, s := range shapes {
		m, n, k := s[0], s[1], s[2]
		for _, tr := range [][2]bool{{false, false}, {true, false}, {false, true}, {true, true}} {
			transA, transB := tr[0], tr[1]
			p := planRowMajor(m, n, k, transA, transB)
			// The problem and operand shapes agree, and each layout covers
			// its buffer exactly, with ld >= rows.
			if r, c := opShape(p.a); r != p.m || c != p.k {
				t.Fatalf("%v %v: op(A) is %dx%d, want %dx%d", s, tr, r, c, p.m, p.k)
			}
			if r, c := opShape(p.b); r != p.k || c != p.n {
				t.Fatalf("%v %v: op(B) is %dx%d, want %dx%d", s, tr, r, c, p.k, p.n)
			}
			if p.c.trans || p.c.rows != p.m || p.c.cols != p.n {
				t.Fatalf("%v %v: C is %+v for a %dx%d problem", s, tr, p.c, p.m, p.n)
			}
			for name, x := range map[string]ltMatrix{"A": p.a, "B": p.b, "C": p.c} {
				if x.ld < x.rows || x.ld*x.cols != map[string]int{"A": k * n, "B": m * k, "C": m * n}[name] {
					t.Fatalf("%v %v: %s is %+v", s, tr, name, x)
				}
			}
			a, b := randFloats(rng, m*k), randFloats(rng, k*n)
			want, got := randFloats(rng, m*n), make([]float64, m*n)
			copy(got, want)
			rowMajorRef(want, a, b, m, n, k, transA, transB, 1.5, -0.5)
			ltEmulate(t, p, b, a, got, 1.5, -0.5) // cuBLASLt's A is b
			for i := range want {
				if math.Abs(got[i]-want[i]) > 1e-12*(1+math.Abs(want[i])) {
					t.Fatalf("m=%d n=%d k=%d transA=%v transB=%v: out[%d] = %v, want %v", m, n, k, transA, transB, i, got[i], want[i])
				}
			}
		}
	}
}

func randFloats(rng *rand.Rand, n int) []float64 {
	x := make([]float64, n)
	for i := range x {
		x[i] = rng.NormFloat64()
	}
	return x
}

func TestGemmValidate(t *testing.T) {
	const base = driver.DevicePtr(0x7f0000000000)
	// Three separate 1 MiB regions.
	out, a, b := base, base+1<<20, base+2<<20
	ok := gemmCall{out: out, a: a, b: b, m: 7, n: 13, k: 5, alpha: 1}
	fp32 := func(f func(*gemmCall)) gemmCall { c := ok; f(&c); return c }
	bf16In := func(f func(*gemmCall)) gemmCall {
		c := ok
		c.bf16, c.aBF16, c.bBF16 = true, true, true
		f(&c)
		return c
	}
	converted := func(f func(*gemmCall)) gemmCall { c := ok; c.bf16 = true; f(&c); return c }
	// a stored bf16 and read as it is, b stored fp32 and rounded first.
	mixed := func(f func(*gemmCall)) gemmCall { c := ok; c.bf16, c.aBF16 = true, true; f(&c); return c }
	// GemmFP32 with a bf16 a: a is widened first, b read as it is.
	widened := func(f func(*gemmCall)) gemmCall { c := ok; c.aBF16 = true; f(&c); return c }
	good := []gemmCall{
		ok,
		fp32(func(c *gemmCall) { c.m, c.out, c.a = 0, 0, 0 }),                                          // empty product
		fp32(func(c *gemmCall) { c.n, c.out, c.b = 0, 0, 0 }),                                          // empty product
		fp32(func(c *gemmCall) { c.k, c.a, c.b = 0, 0, 0 }),                                            // out = beta*out
		fp32(func(c *gemmCall) { c.alpha, c.a, c.b = 0, 0, 0 }),                                        // out = beta*out
		fp32(func(c *gemmCall) { c.a = out + 7*13*4 }),                                                 // right after out
		converted(func(c *gemmCall) { c.a = out }),                                                     // copied before the product
		bf16In(func(c *gemmCall) { c.a = out - 7*5*2 }),                                                // right before out
		fp32(func(c *gemmCall) { c.m, c.n, c.k, c.a, c.b = maxGemmDim, 1, 1, base+1<<40, base+2<<40 }), // the largest dimension
		fp32(func(c *gemmCall) { c.transA, c.transB = true, true }),                                    // transposes change no size
		bf16In(func(c *gemmCall) { c.a, c.b = a+2, b+6 }),                                              // bf16 needs 2-byte alignment
		converted(func(c *gemmCall) { c.out, c.a = out, out+4*1000 }),                                  // fp32 view offsets
		mixed(func(c *gemmCall) { c.b = out }),                                                         // b is copied before the product
		widened(func(c *gemmCall) { c.a = out + 2 }),                                                   // a is copied; bf16 needs 2-byte alignment
		bf16In(func(c *gemmCall) { c.outBF16, c.out = true, out+2 }),                                   // a bf16 out needs 2-byte alignment
		bf16In(func(c *gemmCall) { c.outBF16, c.a = true, out+7*13*2 }),                                // right after a bf16 out
		converted(func(c *gemmCall) { c.outBF16, c.k, c.a, c.b = true, 0, 0, 0 }),                      // out = 0
	}
	for i, c := range good {
		if err := c.validate(); err != nil {
			t.Errorf("good call %d (%+v): %v", i, c, err)
		}
	}
	bad := []struct {
		c    gemmCall
		want string
	}{
		{fp32(func(c *gemmCall) { c.m = -1 }), "m = -1 is negative"},
		{fp32(func(c *gemmCall) { c.n = -2 }), "n = -2 is negative"},
		{fp32(func(c *gemmCall) { c.k = -3 }), "k = -3 is negative"},
		{fp32(func(c *gemmCall) { c.k = maxGemmDim + 1 }), "k = 2147483648 is over cuBLASLt's limit"},
		{fp32(func(c *gemmCall) { c.out = 0 }), "out is a null pointer but holds a 7x13 matrix"},
		{fp32(func(c *gemmCall) { c.a = 0 }), "a is a null pointer but holds a 7x5 matrix"},
		{fp32(func(c *gemmCall) { c.a, c.transA = 0, true }), "a is a null pointer but holds a 5x7 matrix"},
		{fp32(func(c *gemmCall) { c.b, c.transB = 0, true }), "b is a null pointer but holds a 13x5 matrix"},
		{fp32(func(c *gemmCall) { c.out += 2 }), "out = 0x7f0000000002 is not aligned to its 4-byte elements"},
		{fp32(func(c *gemmCall) { c.a += 2 }), "a = 0x7f0000100002 is not aligned to its 4-byte elements"},
		{bf16In(func(c *gemmCall) { c.b++ }), "b = 0x7f0000200001 is not aligned to its 2-byte elements"},
		{converted(func(c *gemmCall) { c.a += 2 }), "not aligned to its 4-byte elements"}, // the conversion reads fp32
		{fp32(func(c *gemmCall) { c.a = out + 7*13*4 - 4 }), "overlaps a"},
		{fp32(func(c *gemmCall) { c.b = out - 5*13*4 + 4 }), "overlaps b"},
		{bf16In(func(c *gemmCall) { c.b = out }), "overlaps b"},
		{mixed(func(c *gemmCall) { c.a = out + 8 }), "overlaps a"},
		{widened(func(c *gemmCall) { c.b = out + 8 }), "overlaps b"},
		{mixed(func(c *gemmCall) { c.b += 2 }), "b = 0x7f0000200002 is not aligned to its 4-byte elements"},
		{bf16In(func(c *gemmCall) { c.outBF16, c.out = true, out+1 }), "out = 0x7f0000000001 is not aligned to its 2-byte elements"},
		{bf16In(func(c *gemmCall) { c.outBF16, c.a = true, out+7*13*2-2 }), "overlaps a"},
		{bf16In(func(c *gemmCall) { c.outBF16, c.beta = true, 1 }), "a bf16 out needs beta = 0, not 1"},
		{widened(func(c *gemmCall) { c.outBF16 = true }), "a bf16 out needs bf16 inputs"},
	}
	for _, tc := range bad {
		err := tc.c.validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "cuda: MatMul: ") {
			t.Errorf("%+v: error %v, want one containing %q", tc.c, err, tc.want)
		}
	}
	// Messages carry the call's shape.
	if err := bad[5].c.validate(); !strings.Contains(err.Error(), "(m=7, n=13, k=5, transA=false, transB=false, fp32 inputs)") {
		t.Errorf("message lacks the call: %v", err)
	}
}

func TestPtrAlign(t *testing.T) {
	for _, tc := range []struct {
		p    driver.DevicePtr
		want uint32
	}{{0, 256}, {0x7f0000000000, 256}, {0x7f0000000100, 256}, {0x7f0000000080, 128}, {0x7f0000000004, 4}, {0x7f0000000002, 2}, {0x7f0000000011, 1}, {0x7f0000000030, 16}} {
		if got := ptrAlign(tc.p); got != tc.want {
			t.Errorf("ptrAlign(%#x) = %d, want %d", uint64(tc.p), got, tc.want)
		}
	}
}

func TestAlgoCache(t *testing.T) {
	c := algoCache{limit: 3}
	for i := range 10 {
		c.put(gemmKey{m: int32(i)}, chosenAlgo{workspace: uint64(i)})
		if c.len() > 3 {
			t.Fatalf("cache holds %d entries, limit 3", c.len())
		}
		if a, ok := c.get(gemmKey{m: int32(i)}); !ok || a.workspace != uint64(i) {
			t.Fatalf("entry %d just put is %v, %v", i, a, ok)
		}
	}
	// Replacing a present key evicts nothing.
	var keys []gemmKey
	for k := range c.m {
		keys = append(keys, k)
	}
	c.put(keys[0], chosenAlgo{workspace: 99})
	for _, k := range keys {
		if _, ok := c.get(k); !ok {
			t.Fatalf("replacing %v evicted %v", keys[0], k)
		}
	}
	if a, _ := c.get(keys[0]); a.workspace != 99 {
		t.Fatalf("replaced entry is %v", a)
	}
	// The key tells alignments and input types apart.
	k1 := gemmCall{out: 0x1000, a: 0x2000, b: 0x3000, m: 4, n: 4, k: 4}.key()
	k2 := gemmCall{out: 0x1004, a: 0x2000, b: 0x3000, m: 4, n: 4, k: 4}.key()
	k3 := gemmCall{out: 0x1000, a: 0x2000, b: 0x3000, m: 4, n: 4, k: 4, bf16: true}.key()
	// ... and the stored types of out and of each operand.
	k4 := gemmCall{out: 0x1000, a: 0x2000, b: 0x3000, m: 4, n: 4, k: 4, bf16: true, outBF16: true}.key()
	k5 := gemmCall{out: 0x1000, a: 0x2000, b: 0x3000, m: 4, n: 4, k: 4, bf16: true, aBF16: true}.key()
	k6 := gemmCall{out: 0x1000, a: 0x2000, b: 0x3000, m: 4, n: 4, k: 4, bf16: true, bBF16: true}.key()
	keys3 := []gemmKey{k1, k2, k3, k4, k5, k6}
	for i := range keys3 {
		for j := range i {
			if keys3[i] == keys3[j] {
				t.Errorf("keys %d and %d collide: %+v", j, i, keys3[i])
			}
		}
	}
	// Expert row counts of one bucket share an entry; small sizes and
	// other buckets do not.
	rows := func(m, k int) gemmKey { return gemmCall{out: 0x1000, a: 0x2000, b: 0x3000, m: m, n: 2816, k: k}.key() }
	if rows(4073, 1024) != rows(4096, 1024) || rows(1024, 4001) != rows(1024, 4096) {
		t.Errorf("row counts 4073 and 4096 have different keys")
	}
	if rows(4097, 1024) == rows(4096, 1024) || rows(100, 1024) == rows(101, 1024) {
		t.Errorf("row counts of different buckets share a key")
	}
	// A grouped (ragged) product's rows take quarter-octave buckets.
	ragged := func(m int) gemmKey {
		return gemmCall{out: 0x1000, a: 0x2000, b: 0x3000, m: m, n: 2816, k: 1024, ragged: true}.key()
	}
	if ragged(3585) != ragged(4096) || ragged(3584) == ragged(3585) || ragged(4097) != ragged(5120) || ragged(4096) == ragged(4097) ||
		ragged(100) == ragged(101) || ragged(1000) != ragged(1024) || ragged(129) != ragged(256) {
		t.Errorf("ragged row buckets: 3585..4096, 4097..5120, 897..1024 and 129..256 share keys, 3584 and 3585 do not")
	}
	for v := 1; v < 1<<16; v++ {
		b := int(raggedBucketDim(v))
		if b < v || (v > gemmBucket && b-v >= max(gemmBucket, v/4)) {
			t.Fatalf("raggedBucketDim(%d) = %d", v, b)
		}
	}
	// An autotuned algorithm serves its exact sizes only.
	tuned := func(m int) gemmKey {
		return gemmCall{out: 0x1000, a: 0x2000, b: 0x3000, m: m, n: 2816, k: 1024}.tuneKey()
	}
	if tuned(4073) == tuned(4096) || tuned(4096) != tuned(4096) || tuned(4096) == rows(4096, 1024) {
		t.Errorf("autotuned keys: 4073 and 4096 must differ, and none be a heuristic key")
	}
}

// TestCublasLtABI pins the Go copies of cuBLASLt's structs to the layout
// of cublasLt.h (x86-64 and arm64 Linux).
func TestCublasLtABI(t *testing.T) {
	var r ltHeuristicResult
	for _, c := range []struct {
		what      string
		got, want uintptr
	}{
		{"sizeof(cublasLtMatmulAlgo_t)", unsafe.Sizeof(ltAlgo{}), 64},
		{"sizeof(cublasLtMatmulHeuristicResult_t)", unsafe.Sizeof(r), 96},
		{"offsetof(workspaceSize)", unsafe.Offsetof(r.workspaceSize), 64},
		{"offsetof(state)", unsafe.Offsetof(r.state), 72},
		{"offsetof(wavesCount)", unsafe.Offsetof(r.wavesCount), 76},
		{"offsetof(reserved)", unsafe.Offsetof(r.reserved), 80},
	} {
		if c.got != c.want {
			t.Errorf("%s = %d, want %d", c.what, c.got, c.want)
		}
	}
}

func TestCublasErrorText(t *testing.T) {
	c := gemmCall{m: 7, n: 13, k: 5, transB: true, bf16: true}
	err := ltCheck(CublasNotSupported, "cublasLtMatmul", c.String)
	want := "cublasLtMatmul: CUBLAS_STATUS_NOT_SUPPORTED (m=7, n=13, k=5, transA=false, transB=true, bf16 inputs)"
	if err == nil || err.Error() != want {
		t.Errorf("error %q, want %q", err, want)
	}
	var ce *CublasError
	if !errors.As(err, &ce) || ce.Status != CublasNotSupported {
		t.Errorf("not a *CublasError with the status: %#v", err)
	}
	mixed := gemmCall{m: 7, n: 13, k: 5, bf16: true, bBF16: true, outBF16: true}
	if got, want := mixed.String(), "m=7, n=13, k=5, transA=false, transB=false, bf16 inputs, b stored bf16, bf16 out"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	if err := ltCheck(CublasSuccess, "cublasLtMatmul", func() string { t.Error("detail formatted on success"); return "" }); err != nil {
		t.Errorf("success gave %v", err)
	}
	if got := (&CublasError{Call: "cublasLtCreate", Status: 99}).Error(); got != "cublasLtCreate: cublasStatus_t 99" {
		t.Errorf("unknown status: %q", got)
	}
	for s := range CublasStatus(20) {
		if name := s.String(); !strings.HasPrefix(name, "CUBLAS_STATUS_") && !strings.HasPrefix(name, "cublasStatus_t ") {
			t.Errorf("status %d: %q", int(s), name)
		}
	}
}

func TestGemmOptionsChecked(t *testing.T) {
	// Checked before any library or device is touched.
	if _, err := NewGemmWith(nil, GemmOptions{Precision: 7}); err == nil || !strings.Contains(err.Error(), "GemmOptions.Precision is GemmPrecision(7)") {
		t.Errorf("bad precision: %v", err)
	}
	if _, err := NewGemmWith(nil, GemmOptions{WorkspaceBytes: -1}); err == nil || !strings.Contains(err.Error(), "GemmOptions.WorkspaceBytes is -1") {
		t.Errorf("negative workspace: %v", err)
	}
	// A cuBLASLt that is not there is reported by the search.
	s := driver.Search{Root: t.TempDir(), Getenv: func(string) string { return "" }}
	_, err := NewGemmWith(nil, GemmOptions{Search: s})
	var nf *driver.NotFoundError
	if !errors.As(err, &nf) || nf.Lib != driver.LibCublasLt {
		t.Errorf("no library: %v", err)
	}
}

// TestAutotunePolicy checks which products are timed: large ones whose
// sizes are multiples of 128 (the model's dimensions), not an expert's
// changing row count, not small ones, and none with NoAutotune.
func TestAutotunePolicy(t *testing.T) {
	on, off := &Gemm{}, &Gemm{opts: GemmOptions{NoAutotune: true}}
	for _, c := range []struct {
		m, n, k int
		want    bool
	}{
		{16384, 1024, 1024, true},
		{2048, 32768, 1024, true},
		{4073, 2816, 1024, false},
		{1024, 2816, 4073, false},
		{128, 128, 128, false},
	} {
		call := gemmCall{m: c.m, n: c.n, k: c.k}
		if got := on.autotunes(call); got != c.want {
			t.Errorf("autotunes(%dx%dx%d) = %v, want %v", c.m, c.n, c.k, got, c.want)
		}
		if off.autotunes(call) {
			t.Errorf("NoAutotune: autotunes(%dx%dx%d) = true", c.m, c.n, c.k)
		}
	}
}
