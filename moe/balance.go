package moe

// Load balancing: the global routing statistics of a micro-step, the Switch
// aux loss and the router z-loss computed from them, and the aux-loss-free
// bias update.

import (
	"fmt"
	"slices"

	"github.com/mktrain/mktrain/backend"
)

// Stats are one micro-step's routing statistics, global over the data group
// and identical on every rank. The losses are unweighted: the engine adds
// AuxLossCoef*AuxLoss + ZLossCoef*ZLoss to the training loss it reports.
// Forward fills Tokens; the rest comes once the step's work is done, from
// FinishStats or Layer.ReadStats, since the host reading the device's
// counts and sums in the middle of a layer would stall the GPU.
type Stats struct {
	TokensPerExpert []float64 // [E] token assignments per expert, as the router chose them (before capacity)
	Tokens          int       // tokens in the micro-step
	Dropped         int       // assignments dropped by capacity
	AuxLoss         float64   // E * Σ_e f_e P_e
	ZLoss           float64   // mean over tokens of logsumexp(logits)²
}

// StatsLen is the length of a Layer's statistics tensor (WithStats) for
// experts experts: Σ_t probs[t,e] (E values), Σ_t lse[t]², the
// assignments to each expert (E values, before capacity) and the
// assignments capacity dropped. A Forward writes them on the device and
// FinishStats sums them over the data group.
func StatsLen(experts int) int { return 2*experts + 2 }

// pendingStats is what a Forward knows of its losses before the device's
// sums are read: the global tokens.
type pendingStats struct {
	tokens float64
}

// balance makes the aux-loss gradient on probs (auxDProbE) on the device
// from this rank's routing counts (countsE, in the statistics: written by
// RouteByExpert, or uploaded with a capacity) summed over the data group,
// and returns the z-loss gradient scale for RouterBackward. The global
// tokens are this rank's times the data group's size: every rank of it
// runs micro-steps of the same tokens (checkTokens).
func (l *Layer) balance(lossScale float64) (float64, error) {
	b, E, K := l.b, l.cfg.Experts, l.cfg.TopK
	tokens := float64(l.tokens * l.g.Data.Size())
	// f_e is the fraction of assignments routed to e, P_e the mean router
	// prob of e. f is piecewise constant in the weights, so the gradient
	// flows through P only: d aux / d probs[t,e] = E f_e / T, with f_e =
	// counts_e / (T K). The counts are whole numbers, summed exactly in
	// the float type.
	b.Copy(l.auxDProbE, l.countsE)
	if err := l.g.Data.AllReduceSum(l.auxDProbE); err != nil {
		return 0, fmt.Errorf("moe: load statistics: %w", err)
	}
	b.Scale(l.auxDProbE, lossScale*l.cfg.AuxLossCoef*float64(E)/(tokens*tokens*float64(K)))
	l.pending = &pendingStats{tokens: tokens}
	// d(coef * mean lse²)/dlogits = coef * 2 lse probs / T.
	return lossScale * l.cfg.ZLossCoef * 2 / tokens, nil
}

// FinishStats completes stats[i], the Stats the last Forward of layers[i]
// returned, from sums: the layers' statistics tensors read back to back
// (StatsLen values a layer, in layers' order; see WithStats). The layers
// must share their data group, and every rank of it must call FinishStats
// with them together: one all-reduce sums every layer's.
func FinishStats(layers []*Layer, stats []Stats, sums []float64) error {
	if len(layers) == 0 {
		return nil
	}
	if len(stats) != len(layers) {
		return fmt.Errorf("moe: FinishStats: %d layers but %d stats", len(layers), len(stats))
	}
	E := layers[0].cfg.Experts
	n := StatsLen(E)
	if len(sums) != len(layers)*n {
		return fmt.Errorf("moe: FinishStats: %d sums for %d layers of %d experts, want %d", len(sums), len(layers), E, len(layers)*n)
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
		v := all[i*n : (i+1)*n]
		probSumE, lseSq, countsE, dropped := v[:E], v[E], v[E+1:2*E+1], v[2*E+1]
		tokens := l.pending.tokens
		st := &stats[i]
		st.TokensPerExpert, st.Tokens, st.Dropped = slices.Clone(countsE), int(tokens), int(dropped)
		st.AuxLoss, st.ZLoss = 0, lseSq/tokens
		for e := range E {
			f := countsE[e] / (tokens * float64(l.cfg.TopK))
			st.AuxLoss += float64(E) * f * probSumE[e] / tokens
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
//
// hostE is biasE's values as the last update left them, which spares the
// step a download of biasE (a wait for the device's whole queue, the
// optimizer's included): nil reads them from biasE first. UpdateBias
// returns the new values, as biasE holds them (rounded to its dtype), for
// the next call; after anything else writes biasE (a restore), pass nil.
func UpdateBias(b backend.Backend, biasE backend.Tensor, hostE, tokensPerExpert []float64, rate float64) []float64 {
	if biasE.Len() != len(tokensPerExpert) || (hostE != nil && len(hostE) != len(tokensPerExpert)) {
		panic(fmt.Sprintf("moe: bias has %d experts (%d on the host) but the load has %d", biasE.Len(), len(hostE), len(tokensPerExpert)))
	}
	var mean float64
	for _, n := range tokensPerExpert {
		mean += n
	}
	mean /= float64(len(tokensPerExpert))
	bias := hostE
	if bias == nil {
		bias = backend.DownloadFloat64(b, biasE)
	}
	for e, load := range tokensPerExpert {
		switch {
		case load < mean:
			bias[e] += rate
		case load > mean:
			bias[e] -= rate
		}
		if biasE.DType() == backend.Float32 {
			bias[e] = float64(float32(bias[e])) // what the upload leaves in biasE
		}
	}
	backend.UploadSlice(b, biasE, bias)
	if dt := biasE.DType(); dt != backend.Float32 && dt != backend.Float64 {
		return nil // rounded otherwise: read again next time
	}
	return bias
}
