package tensorpar

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
)

// Term is one product A·op(W) of a sum; op transposes W when TransW.
type Term struct {
	A, W   backend.Tensor
	TransW bool
}

// products writes out = Σ terms (out overwritten by the first).
func products(b backend.Backend, out backend.Tensor, terms []Term) {
	for i, t := range terms {
		beta := 1.0
		if i == 0 {
			beta = 0
		}
		b.MatMul(out, t.A, t.W, false, t.TransW, 1, beta)
	}
}

// AllGatherMatMul gathers every rank's rows shard into full (rank order:
// full holds Size() shards one after another) and writes outs[i] =
// full·op(ws[i]). full is left for the caller (the weight gradients read
// it). shard may be this rank's block of full.
func AllGatherMatMul(b backend.Backend, g comm.Group, full, shard backend.Tensor, outs, ws []backend.Tensor, transW bool) error {
	if err := g.AllGather(full, shard); err != nil {
		return fmt.Errorf("tensorpar: all-gather: %w", err)
	}
	for i := range outs {
		b.MatMul(outs[i], full, ws[i], false, transW, 1, 0)
	}
	return nil
}

// MatMulReduceScatter writes partial = Σ terms, sums it over the group and
// leaves this rank's block of rows of the sum in out (out has 1/Size() of
// partial's rows).
func MatMulReduceScatter(b backend.Backend, g comm.Group, out, partial backend.Tensor, terms []Term) error {
	products(b, partial, terms)
	if err := g.ReduceScatterSum(out, partial); err != nil {
		return fmt.Errorf("tensorpar: reduce-scatter: %w", err)
	}
	return nil
}

// MatMulAllReduce writes out = Σ terms summed over the group.
func MatMulAllReduce(b backend.Backend, g comm.Group, out backend.Tensor, terms []Term) error {
	products(b, out, terms)
	if err := g.AllReduceSum(out); err != nil {
		return fmt.Errorf("tensorpar: all-reduce: %w", err)
	}
	return nil
}

// Options are a Parallel's mode.
type Options struct {
	// SequenceParallel keeps activations between blocks on row shards.
	SequenceParallel bool
	// Fused runs the patterns as the backend's fused ops
	// (AllGatherMatMul, MatMulScatter: fused.go) where the group offers
	// comm.PeerAccess and the rows split evenly; else, and when false, the
	// collectives around the products (parallel.tp_overlap).
	Fused bool
	// Deterministic makes the fused reduce-scatter land every rank's rows
	// in a slot of its own and sum the slots in rank order, instead of
	// adding atomically; a backend without float atomics
	// (backend.Deterministic absent) always does.
	Deterministic bool
}

// Parallel is one rank's tensor-parallel group and mode (see the package
// doc). A nil *Parallel, or one of a group of one rank, is no tensor
// parallelism: Enabled is false and the layers take their usual path.
type Parallel struct {
	b  backend.Backend
	g  comm.Group
	sp bool
	// fused is the fused patterns' state, nil when they are not used.
	fused *fused
}

// New returns rank's Parallel over g; sequenceParallel keeps activations
// between blocks on row shards. The patterns run unfused.
func New(b backend.Backend, g comm.Group, sequenceParallel bool) *Parallel {
	return NewWith(b, g, Options{SequenceParallel: sequenceParallel})
}

// NewWith returns rank's Parallel over g in mode o.
func NewWith(b backend.Backend, g comm.Group, o Options) *Parallel {
	p := &Parallel{b: b, g: g, sp: o.SequenceParallel}
	if o.Fused {
		p.fused = newFused(b, g, o.Deterministic)
	}
	return p
}

// Fused says whether the patterns run as the backend's fused ops.
func (p *Parallel) Fused() bool { return p.Enabled() && p.fused != nil }

// Enabled says whether p splits anything: a group of more than one rank.
func (p *Parallel) Enabled() bool { return p != nil && p.g != nil && p.g.Size() > 1 }

// Size and Rank are the group's; 1 and 0 when not Enabled.
func (p *Parallel) Size() int {
	if !p.Enabled() {
		return 1
	}
	return p.g.Size()
}

func (p *Parallel) Rank() int {
	if !p.Enabled() {
		return 0
	}
	return p.g.Rank()
}

// Group is the tensor-parallel group (nil when not Enabled).
func (p *Parallel) Group() comm.Group {
	if !p.Enabled() {
		return nil
	}
	return p.g
}

// SequenceParallel says whether activations between blocks are row shards.
func (p *Parallel) SequenceParallel() bool { return p.Enabled() && p.sp }

// Rows is how many of a block's t rows a rank holds between blocks: t/Size
// under sequence parallelism, else t.
func (p *Parallel) Rows(t int) int {
	if p.SequenceParallel() {
		return t / p.g.Size()
	}
	return t
}

// ColumnForward feeds x to column-parallel products: outs[i] =
// xFull·op(ws[i]) where xFull is x gathered over the group under sequence
// parallelism (written into full, which the caller keeps for the weight
// gradients), or x itself. It returns the input the products read.
func (p *Parallel) ColumnForward(full, x backend.Tensor, outs, ws []backend.Tensor, transW bool) (backend.Tensor, error) {
	if p.SequenceParallel() {
		if p.Fused() {
			return full, p.fused.allGatherMatMul(full, x, outs, ws, transW)
		}
		return full, AllGatherMatMul(p.b, p.g, full, x, outs, ws, transW)
	}
	for i := range outs {
		p.b.MatMul(outs[i], x, ws[i], false, transW, 1, 0)
	}
	return x, nil
}

// ColumnProducts is ColumnForward for a caller that does not read the
// gathered rows afterwards (a forward whose backward gathers x again):
// under sequence parallelism the fused op keeps none of them, which
// spares it writing [T, K] floats, and the unfused one gathers into
// full as scratch. Without sequence parallelism the products read x.
func (p *Parallel) ColumnProducts(full, x backend.Tensor, outs, ws []backend.Tensor, transW bool) error {
	if p.SequenceParallel() && p.Fused() {
		return p.fused.allGatherMatMul(nil, x, outs, ws, transW)
	}
	_, err := p.ColumnForward(full, x, outs, ws, transW)
	return err
}

// RowForward writes out = the sum over the group of a row-parallel
// product's partial terms: this rank's rows of it under sequence
// parallelism (MatMulReduceScatter through partial), or all of them
// (MatMulAllReduce, partial unused and may be nil).
func (p *Parallel) RowForward(out, partial backend.Tensor, terms []Term) error {
	if p.Fused() && p.fused.takes(out, terms) {
		if p.SequenceParallel() {
			return p.fused.matMulReduceScatter(out, terms)
		}
		return p.fused.matMulAllReduce(out, terms)
	}
	if p.SequenceParallel() {
		return MatMulReduceScatter(p.b, p.g, out, partial, terms)
	}
	return MatMulAllReduce(p.b, p.g, out, terms)
}

// ColumnBackward writes dx, the input gradient of column-parallel
// products, from their terms dY_i·W_i: reduce-scattered to this rank's
// rows under sequence parallelism, all-reduced otherwise. It is RowForward
// by another name, the backward of the all-gather being a reduce-scatter.
func (p *Parallel) ColumnBackward(dx, partial backend.Tensor, terms []Term) error {
	return p.RowForward(dx, partial, terms)
}

// GatherRows returns the whole rows of a replicated-or-sharded activation:
// x gathered into full under sequence parallelism, else x itself (full
// untouched). The backward of a row-parallel product gathers its output
// gradient this way before the products (AllGatherMatMul's first half,
// kept apart because its products are of two kinds).
func (p *Parallel) GatherRows(full, x backend.Tensor) (backend.Tensor, error) {
	if !p.SequenceParallel() {
		return x, nil
	}
	if err := p.g.AllGather(full, x); err != nil {
		return nil, fmt.Errorf("tensorpar: all-gather: %w", err)
	}
	return full, nil
}
