package cpu

import (
	"fmt"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// TestPeerOpsBadArguments checks that each bad call of the peer-row ops
// panics on the calling goroutine with a message naming the op and the
// problem: the checks of the lists, of the references (values included)
// and of the fused ops' arguments.
func TestPeerOpsBadArguments(t *testing.T) {
	b := New(backend.Float32)
	b.SetWorkers(4)
	f := func(shape ...int) backend.Tensor { return b.New(backend.Float32, shape...) }
	ids := func(shape []int, vals ...int32) backend.Tensor {
		x := b.New(backend.Int32, shape...)
		copy(ints(x), vals)
		return x
	}
	list := func(vals ...int32) backend.Tensor { return ids([]int{len(vals)}, vals...) }
	refs := func(pairs ...int32) backend.Tensor { return ids([]int{len(pairs) / 2, 2}, pairs...) }
	groups := func(rows ...int) backend.Groups { return backend.Groups{Rows: rows} }
	offsets := func(offs ...int32) backend.Groups { return backend.Groups{Offsets: list(offs...)} }
	ts := func(x ...backend.Tensor) []backend.Tensor { return x }
	// Two ranks: rank 0 sends 2 rows of a 3-row source, rank 1 sends 1 of 2.
	src, tok := ts(f(3, 4), f(2, 4)), ts(list(2, 0), list(1))
	const G, F = 2, 6
	w1, w3, w2 := f(G*F, 4), f(G*F, 4), f(G*4, F)
	for _, c := range []struct {
		name, want string
		call       func()
	}{
		{"lists", "cpu.GatherPeerRows: 2 sources, 1 token lists and 0 scale lists", func() { b.GatherPeerRows(f(1, 4), src, tok[:1], nil, refs(0, 0)) }},
		{"scale lists", "cpu.GatherPeerRows: 2 sources, 2 token lists and 1 scale lists", func() { b.GatherPeerRows(f(1, 4), src, tok, ts(f(2)), refs(0, 0)) }},
		{"nil tokens", "cpu.GatherPeerRows: token list of rank 1 is nil", func() { b.GatherPeerRows(f(1, 4), src, ts(tok[0], nil), nil, refs(0, 0)) }},
		{"source width", "cpu.GatherPeerRows: source has shape [2 5], want [2 4]", func() { b.GatherPeerRows(f(1, 4), ts(src[0], f(2, 5)), tok, nil, refs(0, 0)) }},
		{"source dtypes", "cpu.GatherPeerRows: source 1 is float32 and source 0 bfloat16; the sources must be of one dtype", func() {
			b.GatherPeerRows(f(1, 4), ts(b.New(backend.BFloat16, 3, 4), src[1]), tok, nil, refs(0, 0))
		}},
		{"bf16 sources into float32", "cpu.GatherPeerRows: the sources are bfloat16, which needs a bfloat16 out and no scales", func() {
			b.GatherPeerRows(f(1, 4), ts(b.New(backend.BFloat16, 3, 4), b.New(backend.BFloat16, 2, 4)), tok, nil, refs(0, 0))
		}},
		{"token value", "cpu.GatherPeerRows: tokens[0] = 3 is outside [0, 3)", func() { b.GatherPeerRows(f(1, 4), src, ts(list(3, 0), tok[1]), nil, refs(0, 0)) }},
		{"scale length", "cpu.GatherPeerRows: scale has shape [1] (1 elements), want 2 elements", func() { b.GatherPeerRows(f(1, 4), src, tok, ts(f(1), f(1)), refs(0, 0)) }},
		{"out dtype", "cpu.GatherPeerRows: out is int32", func() { b.GatherPeerRows(list(1, 2, 3, 4), src, tok, nil, refs(0, 0)) }},
		{"refs nil", "cpu.GatherPeerRows: refs is nil", func() { b.GatherPeerRows(f(1, 4), src, tok, nil, nil) }},
		{"refs shape", "cpu.GatherPeerRows: refs is int32 [2], want int32 [R 2]", func() { b.GatherPeerRows(f(1, 4), src, tok, nil, list(0, 0)) }},
		{"refs dtype", "cpu.GatherPeerRows: refs is float32 [1 2], want int32 [R 2]", func() { b.GatherPeerRows(f(1, 4), src, tok, nil, f(1, 2)) }},
		{"refs rank", "cpu.GatherPeerRows: refs[1] names rank 2 of 2", func() { b.GatherPeerRows(f(2, 4), src, tok, nil, refs(0, 0, 2, 0)) }},
		{"refs negative rank", "cpu.GatherPeerRows: refs[0] names rank -1 of 2", func() { b.GatherPeerRows(f(1, 4), src, tok, nil, refs(-1, 0)) }},
		{"refs position", "cpu.GatherPeerRows: refs[0] names position 1 of rank 1, which sends 1 rows", func() { b.GatherPeerRows(f(1, 4), src, tok, nil, refs(1, 1)) }},
		{"refs rows", "cpu.GatherPeerRows: refs has 1 rows, out 2", func() { b.GatherPeerRows(f(2, 4), src, tok, nil, refs(0, 1)) }},
		{"no ranks", "cpu.GatherPeerRows: refs[0] names rank 0 of 0", func() { b.GatherPeerRows(f(1, 4), nil, nil, nil, refs(0, 0)) }},
		{"scatter out width", "cpu.ScatterPeerRows: out has shape [1 3], want [1 4]", func() { b.ScatterPeerRows(ts(f(2, 4), f(1, 3)), f(1, 4), refs(0, 0)) }},
		{"scatter in", "cpu.ScatterPeerRows: in has shape [4], want a 2-D tensor", func() { b.ScatterPeerRows(ts(f(2, 4)), f(4), refs(0, 0)) }},
		{"scatter position", "cpu.ScatterPeerRows: refs[0] names position 2 of rank 0, which sends 2 rows", func() { b.ScatterPeerRows(ts(f(2, 4), f(1, 4)), f(1, 4), refs(0, 2)) }},
		{"scatter rows", "cpu.ScatterPeerRows: refs has 2 rows, in 1", func() { b.ScatterPeerRows(ts(f(2, 4), f(1, 4)), f(1, 4), refs(0, 0, 1, 0)) }},
		{"scatter duplicate", "cpu.ScatterPeerRows: refs[0] and refs[2] both name rank 0 position 1", func() {
			b.ScatterPeerRows(ts(f(2, 4), f(1, 4)), f(3, 4), refs(0, 1, 1, 0, 0, 1))
		}},
		{"dispatch refs", "cpu.GatherPeerRows: refs[0] names rank 3 of 2", func() {
			b.DispatchSwiGLU(f(1, 4), f(1, F), f(1, F), f(1, F), src, tok, refs(3, 0), w1, w3, groups(1, 0))
		}},
		{"dispatch groups", "cpu.GroupedMatMul", func() {
			b.DispatchSwiGLU(f(1, 4), f(1, F), f(1, F), f(1, F), src, tok, refs(0, 0), w1, w3, groups(1))
		}},
		{"dispatch offsets past the rows", "cpu.GroupedMatMul: group offsets [0 1 2]: want 2+1 offsets from 0 to the operands' 1 rows", func() {
			b.DispatchSwiGLU(f(1, 4), f(1, F), f(1, F), f(1, F), src, tok, refs(0, 0), w1, w3, offsets(0, 1, 2))
		}},
		{"dispatch offsets backwards", "cpu.GroupedMatMul: group offsets [0 2 1]: group 1 ends at row 1 before it starts (2)", func() {
			b.DispatchSwiGLU(f(1, 4), f(1, F), f(1, F), f(1, F), src, tok, refs(0, 0), w1, w3, offsets(0, 2, 1))
		}},
		{"dispatch rows and offsets differ", "cpu.GroupedMatMul: row counts [1 0] and offsets (counts [0 1]) describe different groups", func() {
			b.DispatchSwiGLU(f(1, 4), f(1, F), f(1, F), f(1, F), src, tok, refs(0, 0), w1, w3, backend.Groups{Rows: []int{1, 0}, Offsets: list(0, 0, 1)})
		}},
		{"dispatch offsets count", "cpu.GroupedMatMul: 2 row counts but 2 offsets, want 3", func() {
			b.DispatchSwiGLU(f(1, 4), f(1, F), f(1, F), f(1, F), src, tok, refs(0, 0), w1, w3, backend.Groups{Rows: []int{1, 0}, Offsets: list(0, 1)})
		}},
		{"down-combine no outs", "cpu.DownCombine: no output tensors", func() { b.DownCombine(nil, nil, refs(0, 0), f(1, F), w2, groups(1, 0)) }},
		{"down-combine act", "cpu.DownCombine: act is int32", func() { b.DownCombine(ts(f(2, 4)), nil, refs(0, 0), list(1), w2, groups(1, 0)) }},
		{"down-combine out width", "cpu.GroupedMatMul", func() { b.DownCombine(ts(f(2, 5)), nil, refs(0, 0), f(1, F), w2, groups(1, 0)) }},
		{"down-combine refs", "cpu.ScatterPeerRows: refs[0] names position 2 of rank 0, which sends 2 rows", func() {
			b.DownCombine(ts(f(2, 4)), nil, refs(0, 2), f(1, F), w2, groups(1, 0))
		}},
		{"dispatch-dgrad dh1", "cpu.DispatchDgradSwiGLU: dh1 is int32", func() {
			b.DispatchDgradSwiGLU(f(1, 4), list(1), f(1, F), src, tok, nil, refs(0, 0), f(1, F), f(1, F), w2, groups(1, 0))
		}},
		{"dispatch-dgrad scale lists", "cpu.GatherPeerRows: 2 sources, 2 token lists and 1 scale lists", func() {
			b.DispatchDgradSwiGLU(f(1, 4), f(1, F), f(1, F), src, tok, ts(f(2)), refs(0, 0), f(1, F), f(1, F), w2, groups(1, 0))
		}},
		{"dispatch-dgrad h1 shape", "cpu.SwiGLUBackward", func() {
			b.DispatchDgradSwiGLU(f(1, 4), f(1, F), f(1, F), src, tok, nil, refs(0, 0), f(2, F), f(1, F), w2, groups(1, 0))
		}},
		{"mark flags nil", "cpu.MarkPeerRows: flags of rank 1 are nil", func() { b.MarkPeerRows(ts(list(0, 0), nil), refs(0, 0)) }},
		{"mark position", "cpu.MarkPeerRows: refs[0] names position 2 of rank 0, which sends 2 rows", func() {
			b.MarkPeerRows(ts(list(0, 0), list(0)), refs(0, 2))
		}},
		{"combine flags length", "cpu.CombineRows: flags has shape [1] (1 elements), want 2 elements", func() {
			b.CombineRows(f(3, 4), f(2, 4), list(0, 1), nil, list(1), []int{2})
		}},
		{"combine flags nil", "cpu.CombineRows: in and flags are required", func() { b.CombineRows(f(3, 4), f(2, 4), list(0, 1), nil, nil, []int{2}) }},
		{"dgrad-combine no outs", "cpu.DgradCombine: no output tensors", func() { b.DgradCombine(nil, nil, refs(0, 0), f(1, F), f(1, F), w1, w3, groups(1, 0)) }},
		{"dgrad-combine dh1", "cpu.DgradCombine: dh1 is int32", func() { b.DgradCombine(ts(f(2, 4)), nil, refs(0, 0), list(1), f(1, F), w1, w3, groups(1, 0)) }},
		{"dgrad-combine refs", "cpu.ScatterPeerRows: refs[0] names position 2 of rank 0, which sends 2 rows", func() {
			b.DgradCombine(ts(f(2, 4)), nil, refs(0, 2), f(1, F), f(1, F), w1, w3, groups(1, 0))
		}},
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

// TestCombineRowsReportsMissingFlag checks the CPU combine of flagged
// rows: with every flag up it adds as ScatterAddRows and clears the flags;
// with one down it adds nothing and the next Sync names the row and the
// rank that owed it, once.
func TestCombineRowsReportsMissingFlag(t *testing.T) {
	b := New(backend.Float64)
	in, want, got := b.New(backend.Float64, 3, 2), b.New(backend.Float64, 2, 2), b.New(backend.Float64, 2, 2)
	copy(floats[float64](in), []float64{1, 2, 3, 4, 5, 6})
	rows, scale := b.New(backend.Int32, 3), b.New(backend.Float64, 3)
	copy(ints(rows), []int32{1, 0, 1})
	copy(floats[float64](scale), []float64{0.5, 2, 1})
	flags := b.New(backend.Int32, 3)
	copy(ints(flags), []int32{1, 1, 1})
	b.ScatterAddRows(want, in, rows, scale)
	b.CombineRows(got, in, rows, scale, flags, []int{1, 2})
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	if g, w := floats[float64](got), floats[float64](want); fmt.Sprint(g) != fmt.Sprint(w) {
		t.Errorf("combined %v, ScatterAddRows gives %v", g, w)
	}
	if f := ints(flags); fmt.Sprint(f) != "[0 0 0]" {
		t.Errorf("flags %v after the combine, want all clear", f)
	}
	copy(ints(flags), []int32{1, 0, 1})
	before := fmt.Sprint(floats[float64](got))
	b.CombineRows(got, in, rows, scale, flags, []int{1, 2})
	err := b.Sync()
	if err == nil || !strings.Contains(err.Error(), "send row 1 (to rank 1) was never flagged") {
		t.Fatalf("Sync after a missing flag: %v, want the report of send row 1 and rank 1", err)
	}
	if after := fmt.Sprint(floats[float64](got)); after != before {
		t.Errorf("the combine with a missing flag changed out: %s, was %s", after, before)
	}
	if err := b.Sync(); err != nil {
		t.Errorf("a second Sync: %v, want nil (the report is given once)", err)
	}
}
