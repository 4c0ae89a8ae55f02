package moe

// Load balancing: the global routing statistics of a micro-step, the Switch
// aux loss and the router z-loss computed from them, and the aux-loss-free
// bias update.

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
)

// Stats are one micro-step's routing statistics, global over the data group
// and identical on every rank. The losses are unweighted: the engine adds
// AuxLossCoef*AuxLoss + ZLossCoef*ZLoss to the training loss it reports.
type Stats struct {
	TokensPerExpert []float64 // [E] token assignments per expert, as the router chose them (before capacity)
	Tokens          int       // tokens in the micro-step
	Dropped         int       // assignments dropped by capacity
	AuxLoss         float64   // E * Σ_e f_e P_e
	ZLoss           float64   // mean over tokens of logsumexp(logits)²
}

// balance sums this rank's routing statistics over the data group, derives
// the global losses, uploads the aux-loss gradient on probs (auxDProbE) and
// returns the z-loss gradient scale for RouterBackward.
func (l *Layer) balance(pl *plan, lossScale float64) (Stats, float64, error) {
	b, E, K := l.b, l.cfg.Experts, l.cfg.TopK
	probSumE := backend.DownloadFloat64(b, l.probSumE) // Σ_t probs[t,e], queued by Forward

	// One all-reduce carries everything: counts, prob sums, Σ lse²,
	// tokens, drops.
	v := make([]float64, 2*E+3)
	for e := range E {
		v[e], v[E+e] = float64(pl.countsE[e]), probSumE[e]
	}
	v[2*E], v[2*E+1], v[2*E+2] = b.SumSquares(l.lseT), float64(l.tokens), float64(pl.dropped)
	if err := l.g.Data.AllReduceFloat64(v); err != nil {
		return Stats{}, 0, fmt.Errorf("moe: load statistics: %w", err)
	}
	tokens := v[2*E+1]
	st := Stats{
		TokensPerExpert: v[:E:E],
		Tokens:          int(tokens),
		Dropped:         int(v[2*E+2]),
		ZLoss:           v[2*E] / tokens,
	}
	// f_e is the fraction of assignments routed to e, P_e the mean router
	// prob of e. f is piecewise constant in the weights, so the gradient
	// flows through P only: d aux / d probs[t,e] = E f_e / T.
	auxDProbE := make([]float64, E)
	for e := range E {
		f := v[e] / (tokens * float64(K))
		st.AuxLoss += float64(E) * f * v[E+e] / tokens
		auxDProbE[e] = lossScale * l.cfg.AuxLossCoef * float64(E) * f / tokens
	}
	backend.UploadSlice(b, l.auxDProbE, auxDProbE)
	// d(coef * mean lse²)/dlogits = coef * 2 lse probs / T.
	zScale := lossScale * l.cfg.ZLossCoef * 2 / tokens
	return st, zScale, nil
}

// UpdateBias is aux-loss-free load balancing (DeepSeek-V3): after each
// optimizer step, every expert's selection bias moves by rate towards the
// mean load, bias_e += rate * sign(mean - load_e). tokensPerExpert is the
// step's global load (Stats.TokensPerExpert summed over micro-steps), so
// every rank applies the same update. biasE is a float tensor [E].
func UpdateBias(b backend.Backend, biasE backend.Tensor, tokensPerExpert []float64, rate float64) {
	if biasE.Len() != len(tokensPerExpert) {
		panic(fmt.Sprintf("moe: bias has %d experts but the load has %d", biasE.Len(), len(tokensPerExpert)))
	}
	var mean float64
	for _, n := range tokensPerExpert {
		mean += n
	}
	mean /= float64(len(tokensPerExpert))
	bias := backend.DownloadFloat64(b, biasE)
	for e, load := range tokensPerExpert {
		switch {
		case load < mean:
			bias[e] += rate
		case load > mean:
			bias[e] -= rate
		}
	}
	backend.UploadSlice(b, biasE, bias)
}
