package cuda

// The bf16 paths on the GPU: the SwiGLU and gather kernels with bf16
// inputs and/or outputs, and Gemm.MatMulTypes with every combination of
// stored types, against the CPU backend in float64 on the values the GPU
// reads (bf16 inputs are rounded on the host first). bf16 outputs are
// poisoned with bf16 NaNs.

import (
	"fmt"
	"math"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// bf16OutTol bounds the relative L2 error that rounding an output to bf16
// adds: bf16 keeps 8 significant bits, so rounding to nearest moves an
// element by at most 2^-8 of its value (the unit roundoff; values just
// above a power of two come close to it).
const bf16OutTol = 0x1p-8

// poisoned16 is a buffer of n bf16 NaNs.
func (k *kt) poisoned16(n int) *Buffer {
	nan := make([]uint16, n)
	for i := range nan {
		nan[i] = 0x7fc0
	}
	return upload(k, nan)
}

// values16 downloads n bf16 values of b as float32.
func (k *kt) values16(b *Buffer, n int) []float32 {
	out := make([]float32, n)
	for i, h := range k.bits16(b, n) {
		out[i] = bf16Value(h)
	}
	return out
}

// buf uploads xs as bf16 (rounded on the host) or float32.
func (k *kt) buf(xs []float32, bf16 bool) *Buffer {
	if bf16 {
		return upload(k, bf16Slice(xs))
	}
	return upload(k, xs)
}

// out makes a poisoned output of n bf16 or float32 elements.
func (k *kt) out(n int, bf16 bool) *Buffer {
	if bf16 {
		return k.poisoned16(n)
	}
	return k.poisoned(n)
}

// values downloads n bf16 or float32 values.
func (k *kt) values(b *Buffer, n int, bf16 bool) []float32 {
	if bf16 {
		return k.values16(b, n)
	}
	return k.download(b, n)
}

func typeName(bf16 bool) string {
	if bf16 {
		return "bf16"
	}
	return "f32"
}

func TestKernelSwiGLUBF16(t *testing.T) {
	k := newKT(t, 61)
	const N, F = 5, 777 // odd: the scalar tail runs after the groups of four
	a, b, g := roundBF16(k.randn(N*F, 3)), roundBF16(k.randn(N*F, 1)), k.randn(N*F, 1)
	ra, rb := k.cpuF(a, N, F), k.cpuF(b, N, F)
	rout, rda, rdb := k.ref.New(backend.Float64, N, F), k.ref.New(backend.Float64, N, F), k.ref.New(backend.Float64, N, F)
	k.ref.SwiGLUForward(rout, ra, rb)
	k.ref.SwiGLUBackward(rda, rdb, k.cpuF(g, N, F), ra, rb)
	dg := upload(k, g)
	grid := k.d.StrideGrid(N*F, 256, 4)
	for _, ty := range [][2]bool{{true, false}, {false, true}, {true, true}} {
		in16, out16 := ty[0], ty[1]
		tol := fp32Tol
		if out16 {
			tol = bf16OutTol
		}
		da, db := k.buf(a, in16), k.buf(b, in16)
		for _, vec := range []int32{0, 1} {
			suffix := fmt.Sprintf("_%s_%s vec=%d", typeName(in16), typeName(out16), vec)
			out, gda, gdb := k.out(N*F, out16), k.out(N*F, out16), k.out(N*F, out16)
			k.launch("swiglu.cu", "swiglu_forward_"+typeName(in16)+"_"+typeName(out16), grid, out, da, db, int64(N*F), vec)
			k.launch("swiglu.cu", "swiglu_backward_"+typeName(in16)+"_"+typeName(out16), grid, gda, gdb, dg, da, db, int64(N*F), vec)
			k.check("swiglu forward"+suffix, k.values(out, N*F, out16), k.get(rout), tol)
			k.check("swiglu da"+suffix, k.values(gda, N*F, out16), k.get(rda), tol)
			k.check("swiglu db"+suffix, k.values(gdb, N*F, out16), k.get(rdb), tol)
		}
	}
}

// TestKernelGatherRowsBF16 checks gather_rows_f32_bf16 bit for bit: s*x is
// one float32 product, so each output is bf16Nearest of it.
func TestKernelGatherRowsBF16(t *testing.T) {
	for _, c := range []struct {
		D   int
		vec int32
	}{{128, 1}, {128, 0}, {129, 0}} {
		k := newKT(t, 62)
		const T, N = 50, 80
		in, rows, scale := k.randn(T*c.D, 1), k.ids(N, T), k.randn(N, 1)
		din, drows, dscale := upload(k, in), upload(k, rows), upload(k, scale)
		for _, scaled := range []bool{true, false} {
			sc := dscale
			if !scaled {
				sc = nil
			}
			out := k.poisoned16(N * c.D)
			k.launch("rows.cu", "gather_rows_f32_bf16", Grid1D(N, 256), out, din, drows, sc, int32(N), int32(c.D), c.vec)
			got := k.bits16(out, N*c.D)
			for i := range N {
				s := float32(1)
				if scaled {
					s = scale[i]
				}
				for d := range c.D {
					want := bf16Nearest(s * in[int(rows[i])*c.D+d])
					if got[i*c.D+d] != want {
						t.Fatalf("D=%d vec=%d scaled=%v: out[%d, %d] = %#04x, want %#04x", c.D, c.vec, scaled, i, d, got[i*c.D+d], want)
					}
				}
			}
		}
	}
}

// TestGemmTypes runs MatMulTypes with every combination of stored types in
// both precisions. The reference multiplies the values cuBLASLt reads: bf16
// operands as stored, float32 ones rounded in GemmBF16 and raw in GemmFP32.
func TestGemmTypes(t *testing.T) {
	k := newKT(t, 63)
	shapes := [][3]int{{7, 13, 5}, {129, 67, 1031}, {64, 96, 80}}
	for _, p := range []GemmPrecision{GemmBF16, GemmFP32} {
		g := openGemm(t, k.d, p)
		w := worst{}
		for mask := range 8 {
			ty := GemmTypes{Out: backend.Float32, A: backend.Float32, B: backend.Float32}
			out16, a16, b16 := mask&1 != 0, mask&2 != 0, mask&4 != 0
			if out16 {
				ty.Out = backend.BFloat16
			}
			if a16 {
				ty.A = backend.BFloat16
			}
			if b16 {
				ty.B = backend.BFloat16
			}
			readsBF16 := p == GemmBF16 || (a16 && b16)
			for _, s := range shapes {
				for _, tr := range gemmLayouts {
					c := gemmCase{m: s[0], n: s[1], k: s[2], transA: tr[0], transB: tr[1], alpha: 0.75}
					ar, ac := c.aShape()
					br, bc := c.bShape()
					a, b := k.randn(ar*ac, 1), k.randn(br*bc, 1)
					// What cuBLASLt reads.
					ra, rb := a, b
					if a16 || readsBF16 {
						ra = roundBF16(a)
					}
					if b16 || readsBF16 {
						rb = roundBF16(b)
					}
					out := k.out(c.m*c.n, out16)
					what := fmt.Sprintf("%v, %v, %+v", c, p, ty)
					err := g.MatMulTypes(ty, out.Ptr(), k.buf(a, a16).Ptr(), k.buf(b, b16).Ptr(), c.m, c.n, c.k, c.transA, c.transB, c.alpha, 0)
					if out16 && !readsBF16 {
						if err == nil {
							t.Fatalf("%s: no error for a bf16 out of fp32 inputs", what)
						}
						continue
					}
					if err != nil {
						t.Fatalf("%s: %v", what, err)
					}
					tol := gemmTightTol(c.k)
					if out16 {
						tol += bf16OutTol
					}
					w.add(fmt.Sprintf("%+v", ty), relErr(t, what, k.values(out, c.m*c.n, out16), k.refMatMul(c, ra, rb, nil), tol))
				}
			}
		}
		w.log(t)
	}
}

// TestGemmBF16OutAligned runs a bf16 out at a 2-byte offset and k = 0
// (out cleared, nothing read).
func TestGemmBF16OutAligned(t *testing.T) {
	k := newKT(t, 64)
	g := openGemm(t, k.d, GemmBF16)
	c := gemmCase{m: 37, n: 29, k: 19, alpha: 1}
	a, b := k.randn(c.m*c.k, 1), k.randn(c.k*c.n, 1)
	ha, hb := k.buf(a, true), k.buf(b, true)
	out := k.poisoned16(c.m*c.n + 1)
	ty := GemmTypes{Out: backend.BFloat16, A: backend.BFloat16, B: backend.BFloat16}
	if err := g.MatMulTypes(ty, out.Ptr()+2, ha.Ptr(), hb.Ptr(), c.m, c.n, c.k, false, false, 1, 0); err != nil {
		t.Fatal(err)
	}
	got := k.values16(out, c.m*c.n+1)
	if !math.IsNaN(float64(got[0])) {
		t.Errorf("the element before out was written: %v", got[0])
	}
	relErr(t, "bf16 out at a 2-byte offset", got[1:], k.refMatMul(c, roundBF16(a), roundBF16(b), nil), gemmTightTol(c.k)+bf16OutTol)
	if err := g.MatMulTypes(ty, out.Ptr()+2, 0, 0, c.m, c.n, 0, false, false, 1, 0); err != nil {
		t.Fatal(err)
	}
	for i, v := range k.values16(out, c.m*c.n+1)[1:] {
		if v != 0 {
			t.Fatalf("k = 0: out[%d] = %v, want 0", i, v)
		}
	}
}
