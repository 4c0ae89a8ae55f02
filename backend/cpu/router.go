package cpu

// The MoE router: softmax over expert logits, top-k selection and the
// Mixtral gate renormalisation, with the backward that also carries the
// load-balancing and z-loss gradients. Every row (token) is independent, so
// both ops split the rows over workers. Sums are taken in float64 whatever
// the storage type.

import (
	"fmt"
	"math"

	"github.com/mktrain/mktrain/backend"
)

func (b *Backend) RouterForward(probsTE, lseT, idxTK, gatesTK, logitsTE, biasE backend.Tensor) {
	T, E, K := checkRouter(probsTE, lseT, idxTK, gatesTK, biasE)
	routerCheckLen("router logits", logitsTE, T*E)
	if b.dt == backend.Float32 {
		routerForward[float32](b, probsTE, lseT, idxTK, gatesTK, logitsTE, biasE, T, E, K)
	} else {
		routerForward[float64](b, probsTE, lseT, idxTK, gatesTK, logitsTE, biasE, T, E, K)
	}
}

func (b *Backend) RouterBackward(dlogitsTE, dgatesTK, probsTE, lseT, idxTK, gatesTK, auxDProbE backend.Tensor, zScale float64) {
	T, E, K := checkRouter(probsTE, lseT, idxTK, gatesTK, auxDProbE)
	routerCheckLen("router dlogits", dlogitsTE, T*E)
	routerCheckLen("router dgates", dgatesTK, T*K)
	if b.dt == backend.Float32 {
		routerBackward[float32](b, dlogitsTE, dgatesTK, probsTE, lseT, idxTK, gatesTK, auxDProbE, zScale, T, E, K)
	} else {
		routerBackward[float64](b, dlogitsTE, dgatesTK, probsTE, lseT, idxTK, gatesTK, auxDProbE, zScale, T, E, K)
	}
}

// checkRouter reads T, E and K from probsTE [T, E] and idxTK [T, K] and
// panics unless the other tensors agree. vecE is the optional per-expert
// vector (bias or aux gradient).
func checkRouter(probsTE, lseT, idxTK, gatesTK, vecE backend.Tensor) (T, E, K int) {
	ps, is := probsTE.Shape(), idxTK.Shape()
	if len(ps) != 2 || len(is) != 2 || ps[0] != is[0] {
		panic(fmt.Sprintf("cpu: router probs %v and idx %v must be [T, E] and [T, K]", ps, is))
	}
	T, E, K = ps[0], ps[1], is[1]
	if K < 1 || K > E {
		panic(fmt.Sprintf("cpu: router top-k %d must be in [1, %d experts]", K, E))
	}
	if idxTK.DType() != backend.Int32 {
		panic(fmt.Sprintf("cpu: router idx is %v, want int32", idxTK.DType()))
	}
	routerCheckLen("router lse", lseT, T)
	routerCheckLen("router gates", gatesTK, T*K)
	if vecE != nil {
		routerCheckLen("router per-expert vector", vecE, E)
	}
	return T, E, K
}

func routerCheckLen(what string, t backend.Tensor, n int) {
	if t.Len() != n {
		panic(fmt.Sprintf("cpu: %s has %d elements, want %d", what, t.Len(), n))
	}
}

func routerForward[T Float](b *Backend, probsTE, lseT, idxTK, gatesTK, logitsTE, biasE backend.Tensor, nT, E, K int) {
	probs, lse, idx, gates, logits := floats[T](probsTE), floats[T](lseT), ints(idxTK), floats[T](gatesTK), floats[T](logitsTE)
	bias := floats[T](biasE)
	b.parallelFor(nT, 64, func(lo, hi int) {
		taken := make([]bool, E)
		for t := lo; t < hi; t++ {
			z, p := logits[t*E:(t+1)*E], probs[t*E:(t+1)*E]
			// Stable softmax: shift by the row max before exponentiating.
			m := math.Inf(-1)
			for _, v := range z {
				m = max(m, float64(v))
			}
			var s float64
			for e, v := range z {
				ex := math.Exp(float64(v) - m)
				p[e] = T(ex)
				s += ex
			}
			for e := range p {
				p[e] = T(float64(p[e]) / s)
			}
			lse[t] = T(m + math.Log(s))

			// Top-k by probs+bias, best first; strict > keeps the lower
			// expert index on ties. K is small, so K passes over E beat a
			// sort.
			clear(taken)
			sel, g := idx[t*K:(t+1)*K], gates[t*K:(t+1)*K]
			var sum float64
			for k := range K {
				best, bestScore := -1, math.Inf(-1)
				for e := range E {
					score := float64(p[e])
					if bias != nil {
						score += float64(bias[e])
					}
					if !taken[e] && (best < 0 || score > bestScore) {
						best, bestScore = e, score
					}
				}
				taken[best] = true
				sel[k] = int32(best)
				sum += float64(p[best])
			}
			// Gates are the selected probs (never the bias) renormalised
			// to sum 1, as Mixtral does.
			for k := range K {
				g[k] = T(float64(p[sel[k]]) / sum)
			}
		}
	})
}

// routerBackward, per row t with S = Σ_sel p:
//
//	dprobs[e]  = auxDProb[e] + [e selected] (dg_e - Σ_j dg_j g_j) / S
//	dlogits[e] = p_e (dprobs[e] - Σ_f p_f dprobs[f]) + zScale * lse * p_e
//
// The first line is the gradient through g_i = p_i / S; the second the
// softmax backward plus the z-loss gradient d(lse²)/dlogits = 2 lse p.
func routerBackward[T Float](b *Backend, dlogitsTE, dgatesTK, probsTE, lseT, idxTK, gatesTK, auxDProbE backend.Tensor, zScale float64, nT, E, K int) {
	dlogits, dgates, probs, lse, idx, gates := floats[T](dlogitsTE), floats[T](dgatesTK), floats[T](probsTE), floats[T](lseT), ints(idxTK), floats[T](gatesTK)
	aux := floats[T](auxDProbE)
	b.parallelFor(nT, 64, func(lo, hi int) {
		dp := make([]float64, E)
		for t := lo; t < hi; t++ {
			p, dz := probs[t*E:(t+1)*E], dlogits[t*E:(t+1)*E]
			sel, g, dg := idx[t*K:(t+1)*K], gates[t*K:(t+1)*K], dgates[t*K:(t+1)*K]
			for e := range dp {
				dp[e] = 0
				if aux != nil {
					dp[e] = float64(aux[e])
				}
			}
			var sum, dgDotG float64
			for k := range K {
				sum += float64(p[sel[k]])
				dgDotG += float64(dg[k]) * float64(g[k])
			}
			for k := range K {
				dp[sel[k]] += (float64(dg[k]) - dgDotG) / sum
			}
			var pDotDp float64
			for e := range E {
				pDotDp += float64(p[e]) * dp[e]
			}
			z := zScale * float64(lse[t])
			for e := range E {
				pe := float64(p[e])
				dz[e] = T(pe*(dp[e]-pDotDp) + z*pe)
			}
		}
	})
}
