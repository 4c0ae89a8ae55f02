package cpu

import (
	"math"
	"math/rand/v2"
	"sort"
	"testing"

	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/backend"
)

// routerIO holds one router call's device tensors.
type routerIO struct {
	probs, lse, idx, gates, logits, bias backend.Tensor
}

func routerUpload(b *Backend, data []float64, shape ...int) backend.Tensor {
	t := b.New(b.FloatType(), shape...)
	b.Upload(t, tensor.New(tensor.WithShape(len(data)), tensor.WithBacking(append([]float64(nil), data...))))
	return t
}

func routerHost(t backend.Tensor) []float64 {
	switch ct := t.(*Tensor); ct.DType() {
	case backend.Float32:
		out := make([]float64, ct.Len())
		for i, v := range ct.Float32s() {
			out[i] = float64(v)
		}
		return out
	case backend.Float64:
		return append([]float64(nil), ct.Float64s()...)
	default:
		out := make([]float64, ct.Len())
		for i, v := range ct.Int32s() {
			out[i] = float64(v)
		}
		return out
	}
}

func runRouterForward(b *Backend, logits, bias []float64, T, E, K int) routerIO {
	r := routerIO{
		probs: b.New(b.FloatType(), T, E), lse: b.New(b.FloatType(), T),
		idx: b.New(backend.Int32, T, K), gates: b.New(b.FloatType(), T, K),
		logits: routerUpload(b, logits, T, E),
	}
	if bias != nil {
		r.bias = routerUpload(b, bias, E)
	}
	b.RouterForward(r.probs, r.lse, r.idx, r.gates, r.logits, r.bias)
	return r
}

// naiveRouter is the textbook router: softmax with math.Exp of the raw
// logits, a stable sort of experts by probs+bias (so equal scores keep the
// lower index first), gates renormalised over the chosen k.
func naiveRouter(logits, bias []float64, T, E, K int) (probs, lse []float64, idx []int, gates []float64) {
	probs, lse = make([]float64, T*E), make([]float64, T)
	idx, gates = make([]int, T*K), make([]float64, T*K)
	for t := range T {
		var s float64
		for e := range E {
			s += math.Exp(logits[t*E+e])
		}
		lse[t] = math.Log(s)
		for e := range E {
			probs[t*E+e] = math.Exp(logits[t*E+e]) / s
		}
		order := make([]int, E)
		for e := range order {
			order[e] = e
		}
		score := func(e int) float64 {
			if bias == nil {
				return probs[t*E+e]
			}
			return probs[t*E+e] + bias[e]
		}
		sort.SliceStable(order, func(i, j int) bool { return score(order[i]) > score(order[j]) })
		var sum float64
		for k := range K {
			idx[t*K+k] = order[k]
			sum += probs[t*E+order[k]]
		}
		for k := range K {
			gates[t*K+k] = probs[t*E+idx[t*K+k]] / sum
		}
	}
	return probs, lse, idx, gates
}

func routerRand(rng *rand.Rand, n int, std float64) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = rng.NormFloat64() * std
	}
	return out
}

func routerMaxErr(t *testing.T, what string, got, want []float64, tol float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", what, len(got), len(want))
	}
	for i := range got {
		if d := math.Abs(got[i] - want[i]); d > tol*(1+math.Abs(want[i])) || math.IsNaN(got[i]) {
			t.Fatalf("%s[%d] = %.12g, want %.12g", what, i, got[i], want[i])
		}
	}
}

func TestRouterForwardMatchesNaive(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, c := range []struct {
		T, E, K int
		bias    bool
	}{{7, 4, 2, false}, {7, 4, 2, true}, {5, 8, 3, true}, {3, 5, 5, false}, {200, 6, 1, true}} {
		logits := routerRand(rng, c.T*c.E, 2)
		var bias []float64
		if c.bias {
			bias = routerRand(rng, c.E, 0.3)
		}
		for _, dt := range []backend.DType{backend.Float64, backend.Float32} {
			b := New(dt)
			tol := 1e-12
			if dt == backend.Float32 {
				tol = 1e-5
			}
			r := runRouterForward(b, logits, bias, c.T, c.E, c.K)
			probs, lse, idx, gates := naiveRouter(logits, bias, c.T, c.E, c.K)
			routerMaxErr(t, "probs", routerHost(r.probs), probs, tol)
			routerMaxErr(t, "lse", routerHost(r.lse), lse, tol)
			routerMaxErr(t, "gates", routerHost(r.gates), gates, tol)
			for i, e := range routerHost(r.idx) {
				if int(e) != idx[i] {
					t.Fatalf("%v %+v: idx[%d] = %v, want %d", dt, c, i, e, idx[i])
				}
			}
		}
	}
}

// Equal scores select the lower expert index, and the bias steers the
// selection without entering the gate values.
func TestRouterTiesAndBias(t *testing.T) {
	b := New(backend.Float64)
	// Row 0: all equal; row 1: experts 1 and 3 tie for first.
	logits := []float64{0, 0, 0, 0, 0, 1, 0, 1}
	r := runRouterForward(b, logits, nil, 2, 4, 2)
	if got := routerHost(r.idx); got[0] != 0 || got[1] != 1 || got[2] != 1 || got[3] != 3 {
		t.Fatalf("tie-break idx = %v, want [0 1 1 3]", got)
	}
	// A bias on expert 2 makes it win row 1 while its gate stays its
	// renormalised prob.
	rb := runRouterForward(b, logits, []float64{0, 0, 1, 0}, 2, 4, 2)
	idx, gates, probs := routerHost(rb.idx), routerHost(rb.gates), routerHost(rb.probs)
	if idx[2] != 2 || idx[3] != 1 {
		t.Fatalf("biased idx row 1 = %v, want [2 1]", idx[2:])
	}
	want := probs[4+2] / (probs[4+2] + probs[4+1])
	if math.Abs(gates[2]-want) > 1e-15 {
		t.Fatalf("biased gate = %v, want %v", gates[2], want)
	}
}

// The backward is the gradient of
//
//	L = Σ dg ⊙ gates + Σ_t Σ_e aux[e] probs[t,e] + zScale/2 Σ_t lse[t]²
//
// with the selection held fixed; check it with central differences.
func TestRouterBackwardFiniteDifferences(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	b := New(backend.Float64)
	for _, c := range []struct{ T, E, K int }{{4, 4, 2}, {3, 6, 3}, {2, 5, 1}, {2, 3, 3}} {
		logits := routerRand(rng, c.T*c.E, 1.5)
		bias := routerRand(rng, c.E, 0.1)
		dg := routerRand(rng, c.T*c.K, 1)
		aux := routerRand(rng, c.E, 1)
		const zScale = 0.7
		base := runRouterForward(b, logits, bias, c.T, c.E, c.K)
		idx0 := routerHost(base.idx)

		loss := func(z []float64) float64 {
			r := runRouterForward(b, z, bias, c.T, c.E, c.K)
			for i, e := range routerHost(r.idx) {
				if e != idx0[i] {
					t.Fatalf("%+v: selection changed under perturbation", c)
				}
			}
			var l float64
			for i, g := range routerHost(r.gates) {
				l += dg[i] * g
			}
			for i, p := range routerHost(r.probs) {
				l += aux[i%c.E] * p
			}
			for _, v := range routerHost(r.lse) {
				l += zScale / 2 * v * v
			}
			return l
		}

		dlogits := b.New(backend.Float64, c.T, c.E)
		b.RouterBackward(dlogits, routerUpload(b, dg, c.T, c.K), base.probs, base.lse, base.idx, base.gates,
			routerUpload(b, aux, c.E), zScale)
		got := routerHost(dlogits)

		const h = 1e-6
		want := make([]float64, len(logits))
		for i := range logits {
			z := append([]float64(nil), logits...)
			z[i] += h
			lp := loss(z)
			z[i] -= 2 * h
			want[i] = (lp - loss(z)) / (2 * h)
		}
		routerMaxErr(t, "dlogits", got, want, 1e-7)
	}
}

// Float32 storage gives the float64 result to float32 precision, including
// the backward with a nil aux vector.
func TestRouterFloat32AgreesWithFloat64(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	const T, E, K = 300, 8, 2
	logits := routerRand(rng, T*E, 1)
	dg := routerRand(rng, T*K, 1)
	var got [2][]float64
	for i, dt := range []backend.DType{backend.Float64, backend.Float32} {
		b := New(dt)
		r := runRouterForward(b, logits, nil, T, E, K)
		d := b.New(dt, T, E)
		b.RouterBackward(d, routerUpload(b, dg, T, K), r.probs, r.lse, r.idx, r.gates, nil, 0.1)
		got[i] = routerHost(d)
	}
	routerMaxErr(t, "dlogits float32", got[1], got[0], 1e-5)
}
