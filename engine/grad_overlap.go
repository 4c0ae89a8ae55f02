package engine

// The data-parallel gradient reduction, overlapped with the backward.
//
// The backward of a step's last micro-batch makes the gradients final
// layer by layer, the last layer first: the LM head's once the forward is
// done, the final norm's first in the backward, then layer Layers-1's, ...,
// layer 0's, and the embedding's last of all (model.backwardNotify numbers
// these points Layers, Layers-1, ..., 0, -1). A gradient bucket whose
// tensors are all final is summed across the ranks at once
// (comm.StartAllReduce) while the backward goes on: on a TCP group's
// background goroutine, on an NCCL group's communication stream. The
// in-process groups of virtual ranks reduce at once, which changes only
// when their sums are made. Before anything reads the sums, finish waits
// for them all: right after the backward, as the load statistics that
// finishStats sums next travel over the data group itself (a group takes no
// other collective while its reductions are in flight; comm.AsyncReducer).
//
// # Buckets
//
// Each part of the flat store (flatLayout's replicated and expert ranges,
// params.go) is cut into buckets of consecutive tensors that become
// final at the same point, of at most gradBucket elements each (a longer
// run is cut into gradBucket pieces). The norms, a few vectors per layer
// at the front of the store, form one bucket, final with layer 0. With
// Layers layers that makes about one bucket per layer and part, plus the
// norms, the embedding and the LM head; the padding between tensors goes
// with the tensor before it. With ZeRO-1 (parallel.zero: 1) the replicated
// range is left out: it is reduce-scattered after the backward (zero.go),
// and only the expert buckets overlap.
//
// Every bucket is summed element by element, in rank order, by the
// in-process and TCP groups, so where the buckets are cut changes no bit:
// the losses are bitwise those of one reduction after the backward
// (reduceGradients, kept for rank.syncGrads, which the tests compare
// against). NCCL sums in the order of its rings, which may depend on the
// lengths, so there the bits may differ from the old cut in the last
// place, as they may between NCCL versions.
//
// # What overlaps
//
// The replicated tensors (over the data-context group) and the experts
// (over their replicas) overlap. Under context parallelism the experts are
// summed over the context group too, after their replicas; that group is
// busy in the attention's own backward (its all-gathers and
// reduce-scatters), so that part runs in finish, after the backward, as
// before.

import (
	"cmp"
	"fmt"
	"slices"

	"github.com/mktrain/mktrain/comm"
)

// bucket is one all-reduce: a span of the flat gradient store and the
// point of the backward after which it is final (model.backwardNotify's
// layer: Layers for the LM head and the final norm, -1 for the embedding).
type bucket struct {
	r     span
	final int
}

// gradPart is a span of the store cut into buckets, and the group that
// sums it.
type gradPart struct {
	g       comm.Group
	buckets []bucket
}

// gradPlan is a rank's reduction of its gradients: the parts summed during
// the backward and those summed after it. Groups of one rank have nothing
// to sum and are left out.
type gradPlan struct {
	overlap, after []gradPart
}

func newGradPlan(m ModelConfig, lay *flatLayout, groups *comm.Ranks) gradPlan {
	var p gradPlan
	add := func(list *[]gradPart, r span, g comm.Group) {
		if g.Size() > 1 && !r.empty() {
			*list = append(*list, gradPart{g: g, buckets: cutBuckets(m, lay, r, gradBucket)})
		}
	}
	add(&p.overlap, lay.replicated, groups.DataContext)
	add(&p.overlap, lay.experts, groups.ExpertReplica)
	add(&p.after, lay.experts, groups.Context)
	return p
}

func (p gradPlan) empty() bool { return len(p.overlap) == 0 && len(p.after) == 0 }

// cutBuckets cuts r, a range of whole tensors of lay, into buckets (see the
// file comment) of at most maxElems elements.
func cutBuckets(m ModelConfig, lay *flatLayout, r span, maxElems int) []bucket {
	// One piece per tensor, from its offset to the next tensor's.
	var pieces []bucket
	for i, s := range lay.slots {
		if off := lay.offset[i]; off >= r.lo && off < r.hi {
			final := slotFinal(m, s)
			if s.role == roleNorm {
				final = 0 // the norms travel together, with layer 0
			}
			pieces = append(pieces, bucket{r: span{off, off}, final: final})
		}
	}
	slices.SortFunc(pieces, func(a, b bucket) int { return cmp.Compare(a.r.lo, b.r.lo) })
	for i := range pieces {
		pieces[i].r.hi = r.hi
		if i+1 < len(pieces) {
			pieces[i].r.hi = pieces[i+1].r.lo
		}
	}
	// Runs of pieces final together, cut to at most maxElems elements.
	var out []bucket
	for i := 0; i < len(pieces); {
		j := i + 1
		for j < len(pieces) && pieces[j].final == pieces[i].final {
			j++
		}
		run := span{pieces[i].r.lo, pieces[j-1].r.hi}
		for lo := run.lo; lo < run.hi; lo += maxElems {
			out = append(out, bucket{r: span{lo, min(lo+maxElems, run.hi)}, final: pieces[i].final})
		}
		i = j
	}
	return out
}

// slotFinal is the point of the backward after which s's gradient is final
// (model.backwardNotify's numbering).
func slotFinal(m ModelConfig, s paramSlot) int {
	switch s.name {
	case nameEmbed:
		return -1
	case nameFinalNorm, nameLMHead:
		return m.Layers
	}
	var l int
	if _, err := fmt.Sscanf(s.name, "model.layers.%d.", &l); err == nil {
		return l
	}
	return -1 // unknown: final only at the very end
}

// gradReduction is one step's reduction in flight.
type gradReduction struct {
	r       *rank
	jobs    []gradJob // every bucket of the overlapped parts, part by part
	pending []comm.Pending
}

// gradJob is one bucket of an overlapped part.
type gradJob struct {
	g       comm.Group
	b       bucket
	started bool
}

// newGradReduction prepares the reduction of this step's gradients, to be
// told by the last micro-batch's backward which are final (notify); nil
// when the rank has nothing to reduce.
func (r *rank) newGradReduction() *gradReduction {
	if r.grads.empty() {
		return nil
	}
	red := &gradReduction{r: r}
	for _, part := range r.grads.overlap {
		for _, b := range part.buckets {
			red.jobs = append(red.jobs, gradJob{g: part.g, b: b})
		}
	}
	return red
}

// notify is the callback for model.backwardNotify (nil for a nil
// reduction).
func (red *gradReduction) notify() func(layer int) error {
	if red == nil {
		return nil
	}
	return red.ready
}

// ready starts the reductions of the buckets that are final once layer's
// backward is done. Every rank starts the same ones in the same order:
// plan order.
func (red *gradReduction) ready(layer int) error {
	for i := range red.jobs {
		if j := &red.jobs[i]; !j.started && j.b.final == layer {
			if err := red.start(j); err != nil {
				return err
			}
		}
	}
	return nil
}

func (red *gradReduction) start(j *gradJob) error {
	j.started = true
	p, err := comm.StartAllReduce(j.g, red.r.gStore.view(red.r.b, j.b.r))
	if err != nil {
		return err
	}
	red.pending = append(red.pending, p)
	return nil
}

// finish starts what the backward did not (nothing, when it reported every
// layer), waits for every reduction in start order, then sums the parts
// that do not overlap. It is called once the backward has succeeded; after
// an error the rank returns without it, and the run's abort ends the
// reductions in flight. A nil reduction has nothing to finish.
func (red *gradReduction) finish() error {
	if red == nil {
		return nil
	}
	for i := range red.jobs {
		if j := &red.jobs[i]; !j.started {
			if err := red.start(j); err != nil {
				return err
			}
		}
	}
	if err := comm.WaitAll(red.pending); err != nil {
		return err
	}
	r := red.r
	for _, part := range r.grads.after {
		for _, b := range part.buckets {
			if err := part.g.AllReduceSum(r.gStore.view(r.b, b.r)); err != nil {
				return err
			}
		}
	}
	return nil
}
