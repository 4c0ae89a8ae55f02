package cpu

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// TestBadArgumentsPanicOnCaller checks that each bad call panics with a
// message naming the op and the problem, and that it does so on the calling
// goroutine (a panic in a worker could not be recovered here, and would
// crash the test binary). The tensors are large enough that the ops would
// run on several workers.
func TestBadArgumentsPanicOnCaller(t *testing.T) {
	b := New(backend.Float32)
	b.SetWorkers(4)
	f := func(shape ...int) backend.Tensor { return b.New(backend.Float32, shape...) }
	ids := func(vals ...int32) backend.Tensor {
		x := b.New(backend.Int32, len(vals))
		copy(ints(x), vals)
		return x
	}
	many := func(n int, v int32) backend.Tensor {
		x := b.New(backend.Int32, n)
		for i := range ints(x) {
			ints(x)[i] = v % 7
		}
		ints(x)[n-1] = v
		return x
	}
	for _, c := range []struct {
		name, want string
		call       func()
	}{
		{"matmul inner", "cpu.MatMul: inner dimensions differ", func() { b.MatMul(f(4, 5), f(4, 3), f(4, 5), false, false, 1, 0) }},
		{"matmul out", "cpu.MatMul: out has shape [5 4], want [4 5]", func() { b.MatMul(f(5, 4), f(4, 3), f(5, 3), false, true, 1, 0) }},
		{"matmul 1-D", "cpu.MatMul: a has shape [12], want a 2-D tensor", func() { b.MatMul(f(4, 5), f(12), f(3, 5), false, false, 1, 0) }},
		{"dtype", "cpu.Axpy: x is float64, but this backend computes in float32", func() { b.Axpy(f(3), 1, b.New(backend.Float64, 3)) }},
		{"axpy length", "cpu.Axpy: x has shape [4] (4 elements), want 3 elements", func() { b.Axpy(f(3), 1, f(4)) }},
		{"copy dtype", "cpu.Copy: dst is float32 but src is int32", func() { b.Copy(f(3), ids(1, 2, 3)) }},
		{"embedding id", "cpu.EmbeddingForward: ids[4999] = 50 is outside [0, 50)", func() { b.EmbeddingForward(f(5000, 64), f(50, 64), many(5000, 50)) }},
		{"embedding negative", "cpu.EmbeddingBackward: ids[1] = -1 is outside [0, 50)", func() { b.EmbeddingBackward(f(50, 4), f(2, 4), ids(0, -1)) }},
		{"target", "cpu.CrossEntropy: targets[2999] = 10 is outside [0, 10)", func() { b.CrossEntropy(f(3000), f(3000, 10), f(3000, 10), many(3000, 10), 1) }},
		{"rows", "cpu.GatherRows: rows[0] = 9 is outside [0, 9)", func() { b.GatherRows(f(1, 3), f(9, 3), ids(9), nil) }},
		{"scale length", "cpu.ScatterAddRows: scale has shape [2]", func() { b.ScatterAddRows(f(9, 3), f(1, 3), ids(0), f(2)) }},
		{"rope head dim", "cpu.RoPE: head dim 5 must be even", func() { x := f(2, 10); b.RoPE(x, x, ids(0, 1), 5, 1e4, false) }},
		{"rope positions", "cpu.RoPE: pos has shape [1] (1 elements), want 2 elements", func() { x := f(2, 8); b.RoPE(x, x, ids(0), 4, 1e4, false) }},
		{"rope out overlaps x", "cpu.RoPE: out overlaps x without being x itself", func() {
			x := f(3, 8)
			b.RoPE(b.View(x, 8, 2, 8), b.View(x, 0, 2, 8), ids(0, 1), 4, 1e4, false)
		}},
		{"rmsnorm w", "cpu.RMSNormForward: w has shape [7] (7 elements), want 8 elements", func() { b.RMSNormForward(f(2, 8), f(2), nil, f(2, 8), f(7), 1e-5) }},
		{"swiglu", "cpu.SwiGLUBackward: db has shape [3 3], want [3 4]", func() { b.SwiGLUBackward(f(3, 4), f(3, 3), f(3, 4), f(3, 4), f(3, 4)) }},
		{"adamw step", "cpu.AdamWUpdate: step 0 must count from 1", func() { b.AdamWUpdate(f(3), f(3), f(3), f(3), backend.AdamW{LR: 1}) }},
		{"nil", "cpu.RowDots: rows is nil", func() { b.RowDots(f(2), f(3, 4), nil, f(2, 4)) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			defer func() {
				r := recover()
				if r == nil {
					t.Fatalf("no panic, want %q", c.want)
				}
				if msg := fmt.Sprint(r); !strings.Contains(msg, c.want) {
					t.Fatalf("panic %q, want it to contain %q", msg, c.want)
				}
			}()
			c.call()
		})
	}
}

// TestResultsIndependentOfWorkers checks that the ops that reduce or
// scatter give the same bits on 1 and on 7 workers, so a CPU run is
// reproducible on any machine.
func TestResultsIndependentOfWorkers(t *testing.T) {
	run := func(workers int) [][]float32 {
		b := New(backend.Float32)
		b.SetWorkers(workers)
		rng := rand.New(rand.NewPCG(3, 4))
		rnd := func(shape ...int) backend.Tensor {
			x := b.New(backend.Float32, shape...)
			for i := range floats[float32](x) {
				floats[float32](x)[i] = rng.Float32()*2 - 1
			}
			return x
		}
		idx := func(n, limit int) backend.Tensor {
			x := b.New(backend.Int32, n)
			for i := range ints(x) {
				ints(x)[i] = int32(rng.IntN(limit))
			}
			return x
		}
		const tok, d, v = 300, 200, 40
		var outs [][]float32
		keep := func(ts ...backend.Tensor) {
			for _, x := range ts {
				outs = append(outs, slices.Clone(floats[float32](x)))
			}
		}

		x, w, dy := rnd(tok, d), rnd(v, d), rnd(tok, v)
		y, dx, dw := rnd(tok, v), rnd(tok, d), rnd(v, d)
		b.MatMul(y, x, w, false, true, 1, 0)
		b.MatMul(dx, dy, w, false, false, 1, 0)
		b.MatMul(dw, dy, x, true, false, 1, 1)
		keep(y, dx, dw)

		big := rnd(100003)
		for _, s := range []float64{b.Sum(big), b.SumSquares(big)} {
			outs = append(outs, []float32{float32(s), float32(s - float64(float32(s)))})
		}

		out, rstd, gx, gw := rnd(tok, d), rnd(tok), rnd(tok, d), rnd(d)
		b.RMSNormForward(out, rstd, nil, x, rnd(d), 1e-5)
		b.RMSNormBackward(gx, gw, dx, x, rnd(d), rstd, 0)
		keep(out, rstd, gx, gw)

		table := rnd(v, d)
		b.EmbeddingBackward(table, dx, idx(tok, v))
		scat := rnd(v, d)
		b.ScatterAddRows(scat, dx, idx(tok, v), rnd(tok))
		loss := rnd(tok)
		b.CrossEntropy(loss, y, y, idx(tok, v), 0.5)
		keep(table, scat, loss, y)
		return outs
	}
	one, many := run(1), run(7)
	for i := range one {
		if !slices.Equal(one[i], many[i]) {
			t.Errorf("result %d differs between 1 and 7 workers", i)
		}
	}
}
