package backendtest

// Cases of RouterForward and RouterBackward. Top-k selection is discrete, so
// the inputs keep clear gaps between scores: every row's logits are a
// shuffled ladder of distinct values and the bias lies on a coarse grid.
// Backends then agree on the selection whatever their rounding, and finite
// differences never cross a selection boundary. One case has exact ties
// instead, where every backend must pick the lower expert index.

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// routerShape is one router call: T tokens, E experts, top K. check adds
// the float64 check, whose finite differences cost O((T*E)²), so only small
// shapes have it.
type routerShape struct {
	T, E, K int
	bias    bool
	check   bool
}

func (s routerShape) name() string {
	n := fmt.Sprintf("Router/T%d_E%d_K%d", s.T, s.E, s.K)
	if s.bias {
		n += "/bias"
	}
	return n
}

// routerShapes include K = 1, K = E (every expert chosen), and 300 rows that
// pass the CPU backend's parallel split.
var routerShapes = []routerShape{
	{T: 13, E: 8, K: 2, check: true}, {T: 13, E: 8, K: 2, bias: true, check: true},
	{T: 5, E: 3, K: 3, check: true}, {T: 6, E: 16, K: 1, bias: true, check: true},
	{T: 130, E: 16, K: 1, bias: true}, {T: 300, E: 64, K: 6, bias: true},
}

func routerCases() []Case {
	var cs []Case
	for _, s := range routerShapes {
		c := Case{Name: s.name(), Compare: routerCompare(s, nil)}
		if s.check {
			c.Check = routerCheck(s)
		}
		cs = append(cs, c)
	}
	ties := routerShape{T: 40, E: 6, K: 3}
	cs = append(cs, Case{Name: "Router/ties", Compare: routerCompare(ties, routerTieLogits), Check: routerTieCheck(ties)})
	return cs
}

// routerTieCheck checks that exact ties select the lower expert index, as
// routerNaive's stable sort does.
func routerTieCheck(s routerShape) func(t *testing.T, b backend.Backend) {
	return func(t *testing.T, b backend.Backend) {
		logits := routerTieLogits(NewRand("Router/ties/check"), s.T, s.E)
		probs, lse, gates := b.New(backend.Float64, s.T, s.E), b.New(backend.Float64, s.T), b.New(backend.Float64, s.T, s.K)
		idx := b.New(backend.Int32, s.T, s.K)
		b.RouterForward(probs, lse, idx, gates, Upload(b, logits, s.T, s.E), nil)
		_, _, wantIdx, wantGates := routerNaive(logits, nil, s.T, s.E, s.K)
		if got := DownloadInts(b, idx); !slices.Equal(got, wantIdx) {
			t.Fatalf("idx %v, want %v (ties go to the lower expert index)", got, wantIdx)
		}
		CompareFloats(t, "gates against the naive router", Download(b, gates), wantGates, refTol)
	}
}

// routerLadder returns T rows of E logits, each a random permutation of E
// values 4/E apart (so neighbouring probs differ by a factor e^(4/E)), with
// a random offset per row.
func routerLadder(rng *rand.Rand, T, E int) []float64 {
	out := make([]float64, 0, T*E)
	for range T {
		off := 2*rng.Float64() - 1
		for _, r := range rng.Perm(E) {
			out = append(out, float64(float32(off+4*float64(r)/float64(E)-2)))
		}
	}
	return out
}

// routerTieLogits draws logits from {0, 0.5}, so most rows have ties that
// the lower expert index must win.
func routerTieLogits(rng *rand.Rand, T, E int) []float64 {
	out := make([]float64, T*E)
	for i := range out {
		out[i] = 0.5 * float64(rng.IntN(2))
	}
	return out
}

// routerBias draws a bias on a grid of 1/4 in [-1/2, 1/2].
func routerBias(rng *rand.Rand, E int) []float64 {
	out := make([]float64, E)
	for i := range out {
		out[i] = 0.25 * float64(rng.IntN(5)-2)
	}
	return out
}

// routerCompare runs the forward and then the backward on the forward's own
// outputs, on both backends.
func routerCompare(s routerShape, logitsOf func(*rand.Rand, int, int) []float64) func(e *Env) {
	if logitsOf == nil {
		logitsOf = routerLadder
	}
	return func(e *Env) {
		logits := e.Floats("logits", logitsOf(e.Rng, s.T, s.E), s.T, s.E)
		var bias *Pair
		if s.bias {
			bias = e.Floats("bias", routerBias(e.Rng, s.E), s.E)
		}
		dgates, aux := e.Rand("dgates", s.T, s.K), e.Rand("auxDProb", s.E)
		probs, lse, gates := e.Out("probs", s.T, s.E), e.Out("lse", s.T), e.Out("gates", s.T, s.K)
		idx, dlogits := e.IntOut("idx", s.T, s.K), e.Out("dlogits", s.T, s.E)
		e.Run(func(b backend.Backend, x Pick) {
			b.RouterForward(x(probs), x(lse), x(idx), x(gates), x(logits), x(bias))
			b.RouterBackward(x(dlogits), x(dgates), x(probs), x(lse), x(idx), x(gates), x(aux), 0.3)
		})
	}
}

// routerCheck compares the forward with routerNaive and the backward with
// central differences of
//
//	L = Σ dg ⊙ gates + Σ_t Σ_e aux[e] probs[t,e] + zScale/2 Σ_t lse[t]²
//
// whose gradient is what RouterBackward computes, the selection held fixed.
func routerCheck(s routerShape) func(t *testing.T, b backend.Backend) {
	return func(t *testing.T, b backend.Backend) {
		rng := NewRand(s.name() + "/check")
		T, E, K := s.T, s.E, s.K
		logits := routerLadder(rng, T, E)
		var bias []float64
		var biasT backend.Tensor
		if s.bias {
			bias = routerBias(rng, E)
			biasT = Upload(b, bias, E)
		}
		dg, aux := RandFloats(rng, T*K, -1, 1), RandFloats(rng, E, -1, 1)
		const zScale = 0.7

		logitsT := Upload(b, logits, T, E)
		probs, lse, gates := b.New(backend.Float64, T, E), b.New(backend.Float64, T), b.New(backend.Float64, T, K)
		idx := b.New(backend.Int32, T, K)
		b.RouterForward(probs, lse, idx, gates, logitsT, biasT)
		wantProbs, wantLSE, wantIdx, wantGates := routerNaive(logits, bias, T, E, K)
		CompareFloats(t, "probs against the naive router", Download(b, probs), wantProbs, refTol)
		CompareFloats(t, "lse against the naive router", Download(b, lse), wantLSE, refTol)
		CompareFloats(t, "gates against the naive router", Download(b, gates), wantGates, refTol)
		idx0 := DownloadInts(b, idx)
		if !slices.Equal(idx0, wantIdx) {
			t.Fatalf("idx %v, want %v", idx0, wantIdx)
		}

		dlogits := b.New(backend.Float64, T, E)
		b.RouterBackward(dlogits, Upload(b, dg, T, K), probs, lse, idx, gates, Upload(b, aux, E), zScale)
		analytic := Download(b, dlogits)

		loss := func() float64 {
			Set(b, logitsT, logits)
			b.RouterForward(probs, lse, idx, gates, logitsT, biasT)
			if !slices.Equal(DownloadInts(b, idx), idx0) {
				t.Fatal("the selection changed under a finite-difference step")
			}
			l := Dot(dg, Download(b, gates))
			for i, p := range Download(b, probs) {
				l += aux[i%E] * p
			}
			for _, v := range Download(b, lse) {
				l += zScale / 2 * v * v
			}
			return l
		}
		CheckGrad(t, "dlogits", loss, logits, analytic, gradTol)
	}
}

// routerNaive is the textbook router in float64: softmax of the raw logits,
// experts ordered by probs+bias with a stable sort (lower index first on
// ties), the first K renormalised.
func routerNaive(logits, bias []float64, T, E, K int) (probs, lse []float64, idx []int32, gates []float64) {
	probs, lse = make([]float64, T*E), make([]float64, T)
	gates = make([]float64, T*K)
	for t := range T {
		row := logits[t*E : (t+1)*E]
		var z float64
		for _, v := range row {
			z += math.Exp(v)
		}
		lse[t] = math.Log(z)
		score := make([]float64, E)
		order := make([]int, E)
		for e, v := range row {
			probs[t*E+e] = math.Exp(v) / z
			score[e] = probs[t*E+e]
			if bias != nil {
				score[e] += bias[e]
			}
			order[e] = e
		}
		slices.SortStableFunc(order, func(a, b int) int {
			switch {
			case score[a] > score[b]:
				return -1
			case score[a] < score[b]:
				return 1
			}
			return 0
		})
		var sum float64
		for _, e := range order[:K] {
			idx = append(idx, int32(e))
			sum += probs[t*E+e]
		}
		for k, e := range order[:K] {
			gates[t*K+k] = probs[t*E+e] / sum
		}
	}
	return probs, lse, idx, gates
}

// routeShape is one RouteByExpert case: T tokens choosing K of E experts,
// drawn by pick (nil: uniformly).
type routeShape struct {
	name    string
	T, K, E int
	pick    func(rng *rand.Rand, t, k, E int) int32
}

var routeShapes = []routeShape{
	{"uniform", 37, 3, 7, nil},
	{"one expert takes all", 50, 2, 5, func(_ *rand.Rand, _, _, _ int) int32 { return 3 }},
	{"empty experts", 64, 2, 12, func(rng *rand.Rand, _, _, _ int) int32 { return int32(4 * rng.IntN(3)) }},
	{"top-1", 33, 1, 4, nil},
	{"more than a tile", 1500, 2, 3, nil},
}

// routeCases compares RouteByExpert with the oracle and checks it against
// routeNaive.
func routeCases() []Case {
	var cs []Case
	for _, s := range routeShapes {
		name := "RouteByExpert/" + strings.ReplaceAll(s.name, " ", "_")
		cs = append(cs, Case{
			Name: name,
			Compare: func(e *Env) {
				idx := e.IntsOf("idx", routeIdx(e.Rng, s), s.T, s.K)
				counts, offsets := e.Out("counts", s.E), e.IntOut("offsets", s.E+1)
				tok, slot, pos := e.IntOut("sendTok", s.T*s.K), e.IntOut("sendSlot", s.T*s.K), e.IntOut("sendPos", s.T, s.K)
				e.Run(func(b backend.Backend, x Pick) {
					b.RouteByExpert(x(counts), x(offsets), x(tok), x(slot), x(pos), x(idx))
				})
			},
			Check: func(t *testing.T, b backend.Backend) {
				idx := routeIdx(NewRand(name), s)
				counts, offsets := b.New(b.FloatType(), s.E), b.New(backend.Int32, s.E+1)
				tok, slot, pos := b.New(backend.Int32, s.T*s.K), b.New(backend.Int32, s.T*s.K), b.New(backend.Int32, s.T, s.K)
				b.RouteByExpert(counts, offsets, tok, slot, pos, UploadInts(b, idx, s.T, s.K))
				wantCounts, wantTok, wantSlot := routeNaive(idx, s.K, s.E)
				wantPos := make([]int32, len(wantSlot))
				for i, a := range wantSlot {
					wantPos[a] = int32(i)
				}
				wantOffsets := make([]int32, s.E+1)
				gotCounts := make([]int32, s.E)
				for e, c := range wantCounts {
					wantOffsets[e+1] = wantOffsets[e] + c
				}
				for e, c := range backend.DownloadFloat64(b, counts) {
					gotCounts[e] = int32(c)
					if float64(gotCounts[e]) != c {
						t.Errorf("counts[%d] = %v, not a whole number", e, c)
					}
				}
				for _, c := range []struct {
					what      string
					got, want []int32
				}{{"counts", gotCounts, wantCounts}, {"offsets", DownloadInts(b, offsets), wantOffsets},
					{"sendTok", DownloadInts(b, tok), wantTok}, {"sendSlot", DownloadInts(b, slot), wantSlot},
					{"sendPos", DownloadInts(b, pos), wantPos}} {
					if !slices.Equal(c.got, c.want) {
						t.Errorf("%s = %v, want %v", c.what, c.got, c.want)
					}
				}
			},
		})
	}
	return cs
}

func routeIdx(rng *rand.Rand, s routeShape) []int32 {
	idx := make([]int32, s.T*s.K)
	for a := range idx {
		if s.pick != nil {
			idx[a] = s.pick(rng, a/s.K, a%s.K, s.E)
		} else {
			idx[a] = int32(rng.IntN(s.E))
		}
	}
	return idx
}

// routeNaive lists, expert by expert, the assignments that chose it.
func routeNaive(idx []int32, K, E int) (counts, tok, slot []int32) {
	counts = make([]int32, E)
	for e := range E {
		for a, x := range idx {
			if int(x) == e {
				counts[e]++
				tok, slot = append(tok, int32(a/K)), append(slot, int32(a))
			}
		}
	}
	return counts, tok, slot
}
