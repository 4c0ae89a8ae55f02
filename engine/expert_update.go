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
// Then each expert tensor is updated inside its layer's backward: the
// MoE layer hands the product that gives the tensor's gradient to the
// rank (moe.UpdateExpertsInBackward, layerExperts) as soon as nothing
// later in the backward reads the tensor's weights, and the rank computes
// the gradient into one tensor's buffer and runs AdamW on it. Every expert
// tensor takes that buffer in turn, so the gradient store holds the other
// tensors' gradients and one expert tensor's, instead of every layer's
// experts'. The product is the one the backward would have written and
// the update is elementwise and reads the same gradient, learning rate
// and step, so the weights are bit for bit those of the update after the
// backward; the global gradient norm (reported, not applied) is summed
// tensor by tensor. Because the product and its update are handed over
// together, a backend can fuse them, so the gradient is never written
// (kernels/adamw.md).
//
// What changes is when a bad step shows: the loss is checked after the
// backward, so a step whose loss is not finite has already updated the
// experts when Run returns its error. No checkpoint is written after that
// error; the run directory keeps the last good one.

import (
	"errors"
	"fmt"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/profile"
	"github.com/mktrain/mktrain/moe"
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

// expertTensors is, per layer, the spans of the flat store that hold the
// layer's expert tensors w1, w3 and w2 (indexed by moe.ExpertWeight),
// padding left out.
func (lay *flatLayout) expertTensors(m ModelConfig) [][3]span {
	out := make([][3]span, m.Layers)
	probe := newModelParams(m)
	for i, s := range lay.slots {
		if s.role != roleExpert {
			continue
		}
		l := slotFinal(m, s)
		p, w := s.pick(probe), moe.ExpertW2
		switch {
		case p == &probe.layers[l].moe.W1EFD:
			w = moe.ExpertW1
		case p == &probe.layers[l].moe.W3EFD:
			w = moe.ExpertW3
		}
		out[l][w] = span{lay.offset[i], lay.offset[i] + shapeLen(lay.shape[i])}
	}
	return out
}

// newLayerExpertGradStore is the gradient store when the experts are
// updated in the backward: flat holds the tensors before the experts'
// range, laid out as newParamStore's, and buf is the memory each expert
// tensor's gradient takes in turn while the backward updates it
// (rank.updateExperts): one tensor's worth, the largest. Every layer's
// expert gradient views are views of buf from its start, so they alias
// each other; nothing reads them (the layers hand their products to the
// update, moe.UpdateExpertsInBackward).
func newLayerExpertGradStore(b backend.Backend, m ModelConfig, lay *flatLayout) (store paramStore, buf backend.Tensor) {
	per := 0
	for i, s := range lay.slots {
		if s.role == roleExpert {
			per = max(per, lay.padded(i))
		}
	}
	flat := b.New(b.FloatType(), lay.experts.lo)
	buf = b.New(b.FloatType(), per)
	p := newModelParams(m)
	for i, s := range lay.slots {
		if s.role == roleExpert {
			*s.pick(p) = b.View(buf, 0, lay.shape[i]...)
			continue
		}
		*s.pick(p) = b.View(flat, lay.offset[i], lay.shape[i]...)
	}
	return paramStore{flat: flat, p: p}, buf
}

// expertUpdate is one step's AdamW of the experts, which the layers'
// backward applies tensor by tensor (rank.updateExperts).
type expertUpdate struct {
	h backend.AdamW
	// squares are the tensors' Σ g², queued on the device as each is
	// updated and read together after the backward (sumSquares): the
	// backward waits for none of them.
	squares []func() float64
}

func (r *rank) newExpertUpdate(step int, lr float64) *expertUpdate {
	t := r.cfg.Train
	return &expertUpdate{h: backend.AdamW{LR: lr, Beta1: t.Beta1, Beta2: t.Beta2, Eps: t.Eps, WeightDecay: t.WeightDecay, Step: step}}
}

// layerExperts is layer's moe.ExpertUpdater: the rank's update of its
// experts in the backward.
type layerExperts struct {
	r     *rank
	layer int
}

func (u layerExperts) UpdateExperts(w moe.ExpertWeight, dyRN, xRM backend.Tensor, groups backend.Groups) error {
	return u.r.updateExperts(u.layer, w, dyRN, xRM, groups)
}

// updateExperts applies the step's AdamW (r.experts) to expert tensor w
// of layer: its gradient, the product dyRNᵀ·xRM per expert (zero for none
// without dyRN), goes into the shared gradient buffer and from there into
// the update, whose squares are queued. Nothing clips this update (the
// experts are updated in the backward only without clipping), so the
// norm's squares come from its pass.
func (r *rank) updateExperts(layer int, w moe.ExpertWeight, dyRN, xRM backend.Tensor, groups backend.Groups) error {
	u := r.experts
	if u == nil {
		return errors.New("engine: a layer's backward updated its experts outside a training step")
	}
	b, sp := r.b, r.expertTensors[layer][w]
	shape := r.g.layers[layer].moe.W1EFD.Shape() // [E, F, D], as w3's
	if w == moe.ExpertW2 {
		shape = r.g.layers[layer].moe.W2EDF.Shape() // [E, D, F]
	}
	n := sp.hi - sp.lo
	g := b.View(r.expertGrads, 0, shape[0]*shape[1], shape[2]) // stacked, as the layer's products see it
	if dyRN == nil {
		b.Zero(g)
	} else {
		b.GroupedMatMulTN(g, dyRN, xRM, groups, 1, 0)
	}
	// The product is the MoE layer's work, the update the optimizer's;
	// the model runs the layer's backward in the MoE scope, which goes on
	// after this.
	profile.Scope(b, profile.ScopeOptimizer)
	at := r.expertMomentsAt + sp.lo - r.layout.experts.lo
	flatG := b.View(r.expertGrads, 0, n)
	u.squares = append(u.squares, r.adamWSquares(sp, flatG, b.View(r.m, at, n), b.View(r.v, at, n), u.h))
	profile.Scope(b, profile.ScopeMoE)
	return nil
}

// sumSquares is Σ g² over the expert tensors updated, added in the order
// of the backward.
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
