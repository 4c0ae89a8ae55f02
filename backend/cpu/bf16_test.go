package cpu

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/backend"
)

// bf16Ref rounds x to bfloat16 independently of roundBF16: among the two
// bf16 neighbours of x (x truncated to 8 significant bits, and the next
// value up in magnitude) it picks the nearer, the one with an even last
// bit on a tie, in float64 arithmetic.
func bf16Ref(x float32) float32 {
	if x != x {
		return x
	}
	if math.IsInf(float64(x), 0) || x == 0 {
		return x
	}
	lo := math.Float32frombits(math.Float32bits(x) &^ 0xffff)  // toward zero
	hi := math.Float32frombits(math.Float32bits(lo) + 0x10000) // away from zero
	// Past the largest bf16 the next value up is 2^128 (infinity), and a
	// value nearer to it than to the largest rounds to it.
	hiVal := float64(hi)
	if math.IsInf(hiVal, 0) {
		hiVal = math.Copysign(0x1p128, hiVal)
	}
	dlo := math.Abs(float64(x) - float64(lo))
	dhi := math.Abs(hiVal - float64(x))
	switch {
	case dlo < dhi:
		return lo
	case dhi < dlo:
		return hi
	case math.Float32bits(lo)&0x10000 == 0:
		return lo
	}
	return hi
}

func TestRoundBF16(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	var xs []float32
	for range 200000 {
		xs = append(xs, math.Float32frombits(rng.Uint32()))
	}
	// Ties (low half exactly 0x8000) with even and odd kept parts, values
	// next to ties, subnormals, the largest finite float32, and 0.
	for _, u := range []uint32{0x3f808000, 0x3f818000, 0x3f807fff, 0x3f808001, 0xbf818000, 0x00008000, 0x00018000, 0x00000001, 0x7f7fffff, 0xff7fffff, 0x7f7f8000, 0, 0x80000000} {
		xs = append(xs, math.Float32frombits(u))
	}
	for _, x := range xs {
		got, want := roundBF16(x), bf16Ref(x)
		if x != x {
			if got == got || math.Float32bits(got)&0xffff != 0 || math.Signbit(float64(got)) != math.Signbit(float64(x)) {
				t.Fatalf("roundBF16(NaN %#08x) = %#08x, want a NaN of the same sign with empty low bits", math.Float32bits(x), math.Float32bits(got))
			}
			continue
		}
		if math.Float32bits(got) != math.Float32bits(want) {
			t.Fatalf("roundBF16(%#08x = %g) = %#08x, want %#08x", math.Float32bits(x), x, math.Float32bits(got), math.Float32bits(want))
		}
	}
	// A NaN whose payload lies only in the dropped bits stays NaN.
	if got := roundBF16(math.Float32frombits(0x7f800001)); got == got {
		t.Errorf("NaN 0x7f800001 rounds to %v", got)
	}
	if got := roundBF16(float32(math.Inf(-1))); !math.IsInf(float64(got), -1) {
		t.Errorf("-Inf rounds to %v", got)
	}
}

// TestBF16Tensors checks storage, upload rounding, download, views, Zero
// and Copy on both float types.
func TestBF16Tensors(t *testing.T) {
	for _, dt := range []backend.DType{backend.Float32, backend.Float64} {
		t.Run(dt.String(), func(t *testing.T) {
			b := New(dt)
			x := b.New(backend.BFloat16, 2, 3)
			if x.DType() != backend.BFloat16 || b.OperandType() != dt {
				t.Fatalf("dtype %v, operand type %v", x.DType(), b.OperandType())
			}
			if got := backend.HostData(b.Download(x)).([]float32); len(got) != 6 || got[0] != 0 || got[5] != 0 {
				t.Fatalf("new tensor downloads as %v", got)
			}
			// 1 + 2^-8 is a tie (rounds to 1), 1 + 3*2^-8 rounds up to even, 3.4e38
			// is past the largest bf16 by more than half an ulp.
			src := []float64{1 + 0x1p-8, 1 + 3*0x1p-8, -2.7, 1e-3, 3.4e38, math.Inf(-1)}
			b.Upload(x, tensor.New(tensor.WithShape(6), tensor.WithBacking(src)))
			want := []float32{1, 1 + 0x1p-6, roundBF16(-2.7), roundBF16(1e-3), float32(math.Inf(1)), float32(math.Inf(-1))}
			got := backend.HostData(b.Download(x)).([]float32)
			for i := range want {
				if got[i] != want[i] {
					t.Errorf("element %d: uploaded %v, downloaded %v, want %v", i, src[i], got[i], want[i])
				}
			}
			v := b.View(x, 2, 2)
			if d := backend.HostData(b.Download(v)).([]float32); d[0] != want[2] || d[1] != want[3] {
				t.Errorf("view holds %v", d)
			}
			y := b.New(backend.BFloat16, 6)
			b.Copy(y, x)
			b.Zero(v)
			gx, gy := backend.HostData(b.Download(x)).([]float32), backend.HostData(b.Download(y)).([]float32)
			for i := range want {
				zeroed := i == 2 || i == 3
				if gy[i] != want[i] || (gx[i] == 0) != zeroed {
					t.Errorf("element %d: copy %v, after Zero of the view %v", i, gy[i], gx[i])
				}
			}
		})
	}
}

// TestBF16Misuse checks that ops refuse bf16 where backend.Backend does
// not allow it, with a message naming the problem.
func TestBF16Misuse(t *testing.T) {
	b := New(backend.Float32)
	f := func(shape ...int) backend.Tensor { return b.New(backend.Float32, shape...) }
	h := func(shape ...int) backend.Tensor { return b.New(backend.BFloat16, shape...) }
	rows := b.New(backend.Int32, 2)
	for _, c := range []struct {
		name, want string
		call       func()
	}{
		{"matmul beta", "cpu.MatMul: out is bfloat16, which needs beta = 0 (got 1)", func() { b.MatMul(h(2, 2), h(2, 2), f(2, 2), false, false, 1, 1) }},
		{"axpy", "cpu.Axpy: x is bfloat16, but this backend computes in float32", func() { b.Axpy(f(3), 1, h(3)) }},
		{"scale", "cpu.Scale: t is bfloat16", func() { b.Scale(h(3), 2) }},
		{"copy", "cpu.Copy: dst is float32 but src is bfloat16", func() { b.Copy(f(3), h(3)) }},
		{"gather scale", "cpu.GatherRows: scale is bfloat16", func() { b.GatherRows(h(2, 3), f(4, 3), rows, h(2)) }},
		{"scatter", "cpu.ScatterAddRows: out is bfloat16", func() { b.ScatterAddRows(h(4, 3), f(2, 3), rows, nil) }},
		{"swiglu mixed", "cpu.SwiGLUForward: a is bfloat16 but b is float32", func() { b.SwiGLUForward(f(2, 3), h(2, 3), f(2, 3)) }},
		{"swiglu dout", "cpu.SwiGLUBackward: dout is bfloat16", func() { b.SwiGLUBackward(f(2, 3), f(2, 3), h(2, 3), f(2, 3), f(2, 3)) }},
		{"swiglu da db", "cpu.SwiGLUBackward: da is float32 but db is bfloat16", func() { b.SwiGLUBackward(f(2, 3), h(2, 3), f(2, 3), h(2, 3), h(2, 3)) }},
		{"rmsnorm", "cpu.RMSNormForward: x is bfloat16", func() { b.RMSNormForward(f(2, 3), f(2), nil, h(2, 3), f(3), 1e-5) }},
		{"upload ints", "cpu: cannot upload []int32 into a bfloat16 tensor", func() {
			b.Upload(h(2), tensor.New(tensor.WithShape(2), tensor.WithBacking([]int32{1, 2})))
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			defer func() {
				if msg := fmt.Sprint(recover()); !strings.Contains(msg, c.want) {
					t.Fatalf("panic %q, want it to contain %q", msg, c.want)
				}
			}()
			c.call()
		})
	}
}
