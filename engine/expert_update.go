package engine

// The experts' AdamW update inside the backward
// (train.optimizer_in_backward).
//
// The expert weights are most of an MoE model's parameters (4.43 of
// moe-fine's 4.65 billion), so their gradients are most of the gradient
// store: 16.5 of its 17.3 GiB there. Nothing needs a layer's expert
// gradients once that layer's backward is done, provided that
//
//   - no global-norm clipping waits for every gradient (train.grad_clip 0),
//   - no later micro-batch of the step adds to them (one per rank and step),
//   - no other rank holds the same experts, whose gradients would be summed
//     with these (dp 1 and cp 1: ExpertReplica and Context groups of one).
//
// Then AdamW updates the layer's experts right after its backward, and the
// next layer's backward writes its expert gradients into the same memory:
// the gradient store holds the other tensors' gradients and one layer's
// experts', instead of every layer's. The update is elementwise and reads
// the same gradient, learning rate and step, so the weights are bit for
// bit those of the update after the backward; the global gradient norm
// (reported, not applied) is summed layer by layer.
//
// What changes is when a bad step shows: the loss is checked after the
// backward, so a step whose loss is not finite has already updated the
// experts when Run returns its error. No checkpoint is written after that
// error; the run directory keeps the last good one.

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/profile"
)

// ExpertsUpdatedInBackward reports whether a run of c updates the experts
// in the backward: train.optimizer_in_backward on, or auto where nothing
// stands in the way (optimizerInBackwardBlocker).
func (c Config) ExpertsUpdatedInBackward() bool {
	switch c.Train.OptimizerInBackward {
	case OptimizerInBackwardOn:
		return true
	case OptimizerInBackwardOff:
		return false
	}
	return c.optimizerInBackwardBlocker() == ""
}

// expertsInBackwardUnclipped says the experts' update would run in the
// backward but for train.grad_clip (auto, and nothing else in the way).
func (c Config) expertsInBackwardUnclipped() bool {
	if c.Train.OptimizerInBackward == OptimizerInBackwardOff || c.Train.GradClip == 0 {
		return false
	}
	c.Train.GradClip = 0
	return c.optimizerInBackwardBlocker() == ""
}

// optimizerInBackwardBlocker says which field keeps the experts' update
// out of the backward, or "" when none does.
func (c Config) optimizerInBackwardBlocker() string {
	switch t, p := c.Train, c.Parallel; {
	case t.GradClip > 0:
		return fmt.Sprintf("train.grad_clip is %g, and clipping by the global norm needs every gradient before any update (0 turns it off)", t.GradClip)
	case c.AccumSteps() > 1:
		return fmt.Sprintf("each rank runs %d micro-batches per step (train.global_batch %d over train.micro_batch %d x %d data ranks), each adding to the gradients; one per step needs train.micro_batch = train.global_batch / (parallel.dp x parallel.ep)",
			c.AccumSteps(), t.GlobalBatch, t.MicroBatch, c.DataParallelRanks())
	case p.DP > 1:
		return fmt.Sprintf("parallel.dp is %d: every data replica holds the same experts, whose gradients are summed over the replicas before the update", p.DP)
	case p.CP > 1:
		return fmt.Sprintf("parallel.cp is %d: the experts' gradients are summed over the context-parallel ranks before the update", p.CP)
	}
	return ""
}

// layerExperts is, per layer, the span of the flat store that holds the
// layer's expert tensors (consecutive: slots lists a layer's w1, w2, w3
// together, and the layout keeps slot order within the experts' range).
func (lay *flatLayout) layerExperts(m ModelConfig) []span {
	out := make([]span, m.Layers)
	for l := range out {
		out[l] = span{lo: -1}
	}
	for i, s := range lay.slots {
		if s.role != roleExpert {
			continue
		}
		l := slotFinal(m, s)
		end := lay.offset[i] + lay.padded(i)
		if out[l].lo < 0 || lay.offset[i] < out[l].lo {
			out[l].lo = lay.offset[i]
		}
		out[l].hi = max(out[l].hi, end)
	}
	return out
}

// newLayerExpertGradStore is the gradient store when the experts are
// updated in the backward: flat holds the tensors before the experts'
// range, laid out as newParamStore's, and every layer's expert gradients
// are views of one buffer the size of a layer's experts (also returned).
func newLayerExpertGradStore(b backend.Backend, m ModelConfig, lay *flatLayout, layers []span) (paramStore, backend.Tensor) {
	per := 0
	for _, s := range layers {
		per = max(per, s.hi-s.lo)
	}
	flat, buf := b.New(b.FloatType(), lay.experts.lo), b.New(b.FloatType(), per)
	p := newModelParams(m)
	for i, s := range lay.slots {
		if s.role == roleExpert {
			*s.pick(p) = b.View(buf, lay.offset[i]-layers[slotFinal(m, s)].lo, lay.shape[i]...)
			continue
		}
		*s.pick(p) = b.View(flat, lay.offset[i], lay.shape[i]...)
	}
	return paramStore{flat: flat, p: p}, buf
}

// expertUpdate is one step's AdamW of the experts, run by the backward as
// each layer's gradients become final (model.backwardNotify).
type expertUpdate struct {
	r *rank
	h backend.AdamW
	// squares are the layers' Σ g², queued on the device as each layer
	// is updated and read together after the backward (sumSquares): the
	// backward waits for none of them.
	squares []func() float64
}

func (r *rank) newExpertUpdate(step int, lr float64) *expertUpdate {
	t := r.cfg.Train
	return &expertUpdate{r: r, h: backend.AdamW{LR: lr, Beta1: t.Beta1, Beta2: t.Beta2, Eps: t.Eps, WeightDecay: t.WeightDecay, Step: step}}
}

// ready updates layer's experts once its backward is done; the next
// layer's backward writes its gradients over them (a step of one
// micro-batch: rank.writesExpertGrads). The other points of the backward
// (the final norm's, the embedding's) hold no experts.
func (u *expertUpdate) ready(layer int) error {
	r := u.r
	if layer < 0 || layer >= len(r.expertSpans) {
		return nil
	}
	b, sp := r.b, r.expertSpans[layer]
	n := sp.hi - sp.lo
	g := b.View(r.expertGrads, 0, n)
	profile.Scope(b, profile.ScopeOptimizer)
	// Nothing clips this update (the experts are updated in the backward
	// only without clipping), so the norm's squares come from its pass.
	at := r.expertMomentsAt + sp.lo - r.layout.experts.lo
	u.squares = append(u.squares, r.adamWSquares(sp, g, b.View(r.m, at, n), b.View(r.v, at, n), u.h))
	profile.Scope(b, "")
	return nil
}

// sumSquares is Σ g² over the experts of every layer updated, added in
// the order of the backward.
func (u *expertUpdate) sumSquares() float64 {
	s := 0.0
	for _, f := range u.squares {
		s += f()
	}
	u.squares = nil
	return s
}

// drain reads the queued sums a failed step left unread, which frees
// their device buffers (a no-op after sumSquares).
func (u *expertUpdate) drain() {
	if u != nil {
		u.sumSquares()
	}
}

// chainNotify is a backward callback that calls each of fs (the nil ones
// left out) in order, stopping at the first error.
func chainNotify(fs ...func(layer int) error) func(layer int) error {
	var live []func(int) error
	for _, f := range fs {
		if f != nil {
			live = append(live, f)
		}
	}
	if len(live) == 0 {
		return nil
	}
	return func(layer int) error {
		for _, f := range live {
			if err := f(layer); err != nil {
				return err
			}
		}
		return nil
	}
}
