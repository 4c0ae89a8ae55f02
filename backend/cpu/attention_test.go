package cpu

// The attention ops' forward is checked against a naive reference, and their
// backward against finite differences, by the conformance suite
// (backend/backendtest/attention_cases.go). These tests cover what is
// particular to this backend: the split over workers and the shape checks.

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// attnUpload makes a tensor of b's float type holding data.
func attnUpload(b *Backend, data []float64, shape ...int) backend.Tensor {
	t := b.New(b.FloatType(), shape...).(*Tensor)
	for i, x := range data {
		if t.dt == backend.Float32 {
			t.f32[i] = float32(x)
		} else {
			t.f64[i] = x
		}
	}
	return t
}

func attnHost(t backend.Tensor) []float64 {
	ct := t.(*Tensor)
	if ct.dt == backend.Float64 {
		return append([]float64(nil), ct.f64...)
	}
	out := make([]float64, len(ct.f32))
	for i, x := range ct.f32 {
		out[i] = float64(x)
	}
	return out
}

// runAttn runs the forward and the backward on b and returns out, lse, dq,
// dk and dv, in that order.
func runAttn(b *Backend, s backend.AttnShape, q, k, v, dout []float64) [5][]float64 {
	T, TK, Q, K := s.Batch*s.Seq, s.Batch*s.Keys(), s.Heads*s.HeadDim, s.KVHeads*s.HeadDim
	qT, kT, vT := attnUpload(b, q, T, Q), attnUpload(b, k, TK, K), attnUpload(b, v, TK, K)
	out, lse := b.New(b.FloatType(), T, Q), b.New(b.FloatType(), s.Batch, s.Heads, s.Seq)
	dq, dk, dv := b.New(b.FloatType(), T, Q), b.New(b.FloatType(), TK, K), b.New(b.FloatType(), TK, K)
	b.AttentionForward(out, lse, qT, kT, vT, s)
	b.AttentionBackward(dq, dk, dv, attnUpload(b, dout, T, Q), qT, kT, vT, out, lse, s)
	return [5][]float64{attnHost(out), attnHost(lse), attnHost(dq), attnHost(dk), attnHost(dv)}
}

// TestAttentionWorkersAgree checks that the split over workers changes
// nothing: each (batch, head) item is computed the same way whoever runs it,
// so results must be bit-identical. Run under -race it also checks the dk/dv
// accumulation across a GQA group for data races. The second shape has
// more keys than queries and a query offset.
func TestAttentionWorkersAgree(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	randn := func(n int) []float64 {
		x := make([]float64, n)
		for i := range x {
			x[i] = rng.NormFloat64()
		}
		return x
	}
	for _, s := range []backend.AttnShape{
		{Batch: 3, Seq: 9, Heads: 8, KVHeads: 2, HeadDim: 8},
		{Batch: 2, Seq: 4, Heads: 4, KVHeads: 2, HeadDim: 8, KVSeq: 11, QOffset: 5},
	} {
		T, TK := s.Batch*s.Seq, s.Batch*s.Keys()
		q, k, v := randn(T*s.Heads*s.HeadDim), randn(TK*s.KVHeads*s.HeadDim), randn(TK*s.KVHeads*s.HeadDim)
		dout := randn(T * s.Heads * s.HeadDim)

		serial, parallel := New(backend.Float32), New(backend.Float32)
		serial.SetWorkers(1)
		parallel.SetWorkers(5)
		want := runAttn(serial, s, q, k, v, dout)
		got := runAttn(parallel, s, q, k, v, dout)
		for n, name := range []string{"out", "lse", "dq", "dk", "dv"} {
			for i := range want[n] {
				if got[n][i] != want[n][i] {
					t.Fatalf("%+v: %s[%d]: 5 workers give %v, 1 worker gives %v", s, name, i, got[n][i], want[n][i])
				}
			}
		}
	}
}

func TestAttentionRejectsBadShapes(t *testing.T) {
	b := New(backend.Float32)
	s := backend.AttnShape{Batch: 1, Seq: 4, Heads: 4, KVHeads: 2, HeadDim: 2}
	q, kv := b.New(backend.Float32, 4, 8), b.New(backend.Float32, 4, 4)
	lse := b.New(backend.Float32, 1, 4, 4)
	for name, call := range map[string]func(){
		"kv heads do not divide heads": func() {
			bad := s
			bad.KVHeads = 3
			b.AttentionForward(q, lse, q, kv, kv, bad)
		},
		"k too short":   func() { b.AttentionForward(q, lse, q, b.New(backend.Float32, 3, 4), kv, s) },
		"lse too short": func() { b.AttentionForward(q, b.New(backend.Float32, 4, 3), q, kv, kv, s) },
		"dk too long":   func() { b.AttentionBackward(q, q, kv, q, q, kv, kv, q, lse, s) },
		"negative offset": func() {
			bad := s
			bad.QOffset = -1
			b.AttentionForward(q, lse, q, kv, kv, bad)
		},
		"queries past the keys": func() {
			bad := s
			bad.QOffset = 1
			b.AttentionForward(q, lse, q, kv, kv, bad)
		},
		"k sized for Seq, not KVSeq": func() {
			bad := s
			bad.KVSeq = 6
			b.AttentionForward(q, lse, q, kv, kv, bad)
		},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", name)
				}
			}()
			call()
		}()
	}
}

// TestAttentionMergeEmptyRows: rows where neither side saw a key (both
// lse -inf) come out as zeros with lse -inf; a row where one side is -inf
// keeps the other side exactly.
func TestAttentionMergeEmptyRows(t *testing.T) {
	b := New(backend.Float64)
	s := backend.AttnShape{Batch: 1, Seq: 3, Heads: 1, KVHeads: 1, HeadDim: 2}
	inf := math.Inf(-1)
	out, part := attnUpload(b, []float64{1, 2, 3, 4, 5, 6}, 3, 2), attnUpload(b, []float64{7, 8, 9, 10, 11, 12}, 3, 2)
	lse, plse := attnUpload(b, []float64{inf, inf, 0.5}, 1, 1, 3), attnUpload(b, []float64{inf, 0.25, inf}, 1, 1, 3)
	b.AttentionMerge(out, lse, part, plse, s)
	gotOut, gotLse := backend.DownloadFloat64(b, out), backend.DownloadFloat64(b, lse)
	wantOut, wantLse := []float64{0, 0, 9, 10, 5, 6}, []float64{inf, 0.25, 0.5}
	for i := range wantOut {
		if gotOut[i] != wantOut[i] {
			t.Errorf("out = %v, want %v", gotOut, wantOut)
			break
		}
	}
	for i := range wantLse {
		if gotLse[i] != wantLse[i] {
			t.Errorf("lse = %v, want %v", gotLse, wantLse)
			break
		}
	}
}
