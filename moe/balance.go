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
// Forward fills the counts; the losses come once the step's work is done,
// from FinishStats or Layer.ReadStats, since the host reading them in the
// middle of a layer would stall the GPU.
type Stats struct {
	TokensPerExpert []float64 // [E] token assignments per expert, as the router chose them (before capacity)
	Tokens          int       // tokens in the micro-step
	Dropped         int       // assignments dropped by capacity
	AuxLoss         float64   // E * Σ_e f_e P_e
	ZLoss           float64   // mean over tokens of logsumexp(logits)²
}

// pendingStats is what a Forward knows of its losses before the device's
// sums are read: the global assignment counts and tokens.
type pendingStats struct {
	countsE []float64
	tokens  float64
}

// balance sums this rank's routing counts over the data group, uploads the
// aux-loss gradient on probs (auxDProbE), which needs only the counts, and
// returns the statistics so far and the z-loss gradient scale for
// RouterBackward.
func (l *Layer) balance(pl *plan, lossScale float64) (Stats, float64, error) {
	b, E, K := l.b, l.cfg.Experts, l.cfg.TopK
	// One all-reduce carries counts, tokens and drops.
	v := make([]float64, E+2)
	for e := range E {
		v[e] = float64(pl.countsE[e])
	}
	v[E], v[E+1] = float64(l.tokens), float64(pl.dropped)
	if err := l.g.Data.AllReduceFloat64(v); err != nil {
		return Stats{}, 0, fmt.Errorf("moe: load statistics: %w", err)
	}
	tokens := v[E]
	st := Stats{TokensPerExpert: v[:E:E], Tokens: int(tokens), Dropped: int(v[E+1])}
	l.pending = &pendingStats{countsE: st.TokensPerExpert, tokens: tokens}
	// f_e is the fraction of assignments routed to e, P_e the mean router
	// prob of e. f is piecewise constant in the weights, so the gradient
	// flows through P only: d aux / d probs[t,e] = E f_e / T.
	auxDProbE := make([]float64, E)
	for e := range E {
		f := v[e] / (tokens * float64(K))
		auxDProbE[e] = lossScale * l.cfg.AuxLossCoef * float64(E) * f / tokens
	}
	backend.UploadSlice(b, l.auxDProbE, auxDProbE)
	// d(coef * mean lse²)/dlogits = coef * 2 lse probs / T.
	zScale := lossScale * l.cfg.ZLossCoef * 2 / tokens
	return st, zScale, nil
}

// FinishStats completes the losses of stats[i], the Stats the last Forward
// of layers[i] returned, from sums: the layers' statistics tensors read
// back to back (E+1 values a layer, in layers' order; see WithStats). The
// layers must share their data group, and every rank of it must call
// FinishStats with them together: one all-reduce sums every layer's.
func FinishStats(layers []*Layer, stats []Stats, sums []float64) error {
	if len(layers) == 0 {
		return nil
	}
	if len(stats) != len(layers) {
		return fmt.Errorf("moe: FinishStats: %d layers but %d stats", len(layers), len(stats))
	}
	E := layers[0].cfg.Experts
	if len(sums) != len(layers)*(E+1) {
		return fmt.Errorf("moe: FinishStats: %d sums for %d layers of %d experts, want %d", len(sums), len(layers), E, len(layers)*(E+1))
	}
	for i, l := range layers {
		if l.pending == nil || l.cfg.Experts != E {
			return fmt.Errorf("moe: FinishStats: layer %d has no Forward to finish (or %d experts, not %d)", i, l.cfg.Experts, E)
		}
	}
	all := append([]float64(nil), sums...)
	if err := layers[0].g.Data.AllReduceFloat64(all); err != nil {
		return fmt.Errorf("moe: load statistics: %w", err)
	}
	for i, l := range layers {
		probSumE, lseSq := all[i*(E+1):i*(E+1)+E], all[i*(E+1)+E]
		p := l.pending
		st := &stats[i]
		st.AuxLoss, st.ZLoss = 0, lseSq/p.tokens
		for e := range E {
			f := p.countsE[e] / (p.tokens * float64(l.cfg.TopK))
			st.AuxLoss += float64(E) * f * probSumE[e] / p.tokens
		}
	}
	return nil
}

// ReadStats completes st, the Stats of l's last Forward, reading l's own
// statistics tensor (FinishStats does it for many layers with one read).
// Like FinishStats it is a collective over the data group.
func (l *Layer) ReadStats(st *Stats) error {
	stats := []Stats{*st}
	if err := FinishStats([]*Layer{l}, stats, backend.DownloadFloat64(l.b, l.statsE1)); err != nil {
		return err
	}
	*st = stats[0]
	return nil
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
