package tensorpar

// The fused patterns (Options.Fused): each rank's backend op reads or
// writes its peers' tensors directly (comm.PeerAccess: the virtual ranks
// of one device, or peer GPUs of one process over NVLink), so the
// communication runs inside the product instead of around it.
//
// Who touches whose memory, per rank r of W:
//
//	AllGatherMatMul:     PeerTensors(x shard); r's op reads every rank's
//	                     shard (and keeps the gathered rows in full, unless
//	                     full is nil: ColumnProducts); Barrier, so no rank
//	                     writes its shard while a peer still reads it.
//	MatMulReduceScatter: r zeroes its out; PeerTensors(out), so every out
//	                     is zero before any rank adds; r's op adds row
//	                     block s of its product into rank s's out
//	                     (atomically: every rank adds into the same rows);
//	                     Barrier, so every add has landed before r reads
//	                     its out.
//	  deterministic:     the blocks land in slots instead, rank q's in
//	                     rows [q*B, (q+1)*B) of the owner's slot tensor
//	                     (stored by the first term, added by the others:
//	                     no other rank writes them); after the Barrier r
//	                     sums its slots in rank order.
//	MatMulAllReduce:     the reduce-scatter into each owner's own block of
//	                     out (the first point-to-point round; its exchange
//	                     hands over every rank's out too, and it ends at a
//	                     meeting once every block is whole), then r copies
//	                     every peer's block out of the peer's out (the
//	                     second); Barrier, so no rank writes its out while
//	                     a peer still reads it.
//
// The products are the backend's (on CUDA the grouped GEMM's wgmma/TMA
// pipeline, its epilogue sending rows to their owners, its gather feeding
// m-tiles as they land); on the CPU the ops are the unfused sequences, so
// the fused patterns give the collectives' results there, the
// deterministic reduce-scatter bit for bit.

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
)

// fused is a Parallel's state for the fused patterns.
type fused struct {
	b      backend.Backend
	g      comm.Group
	peers  comm.PeerAccess
	atomic bool
	// slots is the deterministic reduce-scatter's landing area, W blocks
	// of rows, grown to the largest call.
	slots backend.Tensor
}

// newFused returns the fused state over g, or nil when g offers no peer
// access.
func newFused(b backend.Backend, g comm.Group, deterministic bool) *fused {
	peers, ok := g.(comm.PeerAccess)
	if !ok || g == nil || g.Size() < 2 {
		return nil
	}
	_, atomics := b.(backend.Deterministic)
	return &fused{b: b, g: g, peers: peers, atomic: atomics && !deterministic}
}

// takes says whether the row-parallel products of terms can land in out
// fused: every term a float product of the same row count, split evenly
// over the group.
func (f *fused) takes(out backend.Tensor, terms []Term) bool {
	if len(terms) == 0 {
		return false
	}
	rows := terms[0].A.Shape()[0]
	for _, t := range terms {
		if t.A.Shape()[0] != rows {
			return false
		}
	}
	return rows%f.g.Size() == 0 && len(out.Shape()) == 2
}

func (f *fused) fail(what string, err error) error {
	return fmt.Errorf("tensorpar: fused %s (rank %d of %d): %w", what, f.g.Rank(), f.g.Size(), err)
}

// column is entry i of every rank's tensors from PeerTensors.
func column(all [][]backend.Tensor, i int) []backend.Tensor {
	ts := make([]backend.Tensor, len(all))
	for r, row := range all {
		ts[r] = row[i]
	}
	return ts
}

func (f *fused) allGatherMatMul(full, shard backend.Tensor, outs, ws []backend.Tensor, transW bool) error {
	all, err := f.peers.PeerTensors(shard)
	if err != nil {
		return f.fail("all-gather: exchange of the shards", err)
	}
	f.b.AllGatherMatMul(full, outs, column(all, 0), ws, transW, f.g.Rank())
	if err := f.g.Barrier(); err != nil {
		return f.fail("all-gather: end", err)
	}
	return nil
}

// slotTensor returns the slots for blocks of rows x cols: [W*rows, cols].
func (f *fused) slotTensor(rows, cols int) backend.Tensor {
	n := f.g.Size() * rows * cols
	if f.slots == nil || f.slots.Len() < n {
		f.slots = f.b.New(f.b.FloatType(), n)
	}
	return f.b.View(f.slots, 0, f.g.Size()*rows, cols)
}

// scatter lands every term's product blocks in dsts: atomically, or in
// this rank's slot of each owner's slots (row0), stored then added.
func (f *fused) scatter(dsts []backend.Tensor, row0 int, terms []Term) {
	for i, t := range terms {
		landing := backend.ScatterAtomic
		if !f.atomic {
			landing = backend.ScatterAdd
			if i == 0 {
				landing = backend.ScatterStore
			}
		}
		f.b.MatMulScatter(dsts, row0, t.A, t.W, t.TransW, landing, f.g.Rank())
	}
}

// reduceScatter lands the row blocks of Σ terms in their owners: block r
// summed into mine (this rank's [B, N]) when the call returns. The
// exchange that gives the peers' landing tensors also gives every rank's
// extra (nil: none), returned by rank; with an extra the call ends at a
// meeting after this rank's block is complete, so a peer may read it.
func (f *fused) reduceScatter(mine backend.Tensor, terms []Term, what string, extra backend.Tensor) ([]backend.Tensor, error) {
	w, rank := f.g.Size(), f.g.Rank()
	ms := mine.Shape()
	exchange := func(land backend.Tensor) ([]backend.Tensor, []backend.Tensor, error) {
		ts := []backend.Tensor{land}
		if extra != nil {
			ts = append(ts, extra)
		}
		all, err := f.peers.PeerTensors(ts...)
		if err != nil {
			return nil, nil, f.fail(what+": exchange of the outputs", err)
		}
		if extra == nil {
			return column(all, 0), nil, nil
		}
		return column(all, 0), column(all, 1), nil
	}
	if f.atomic {
		f.b.Zero(mine)
		dsts, extras, err := exchange(mine)
		if err != nil {
			return nil, err
		}
		f.scatter(dsts, 0, terms)
		if err := f.g.Barrier(); err != nil {
			return nil, f.fail(what+": every block landed", err)
		}
		return extras, nil
	}
	slots := f.slotTensor(ms[0], ms[1])
	dsts, extras, err := exchange(slots)
	if err != nil {
		return nil, err
	}
	f.scatter(dsts, rank*ms[0], terms)
	if err := f.g.Barrier(); err != nil {
		return nil, f.fail(what+": every block landed", err)
	}
	n := ms[0] * ms[1]
	f.b.Copy(mine, f.b.View(slots, 0, ms...))
	for q := 1; q < w; q++ {
		f.b.Axpy(mine, 1, f.b.View(slots, q*n, ms...))
	}
	// The slots are written again by the peers' next call only after the
	// next PeerTensors, which this rank reaches after its sums are queued.
	if extra != nil {
		if err := f.g.Barrier(); err != nil {
			return nil, f.fail(what+": every block summed", err)
		}
	}
	return extras, nil
}

// matMulReduceScatter is MatMulReduceScatter fused: out is this rank's
// block of rows of Σ terms.
func (f *fused) matMulReduceScatter(out backend.Tensor, terms []Term) error {
	_, err := f.reduceScatter(out, terms, "reduce-scatter", nil)
	return err
}

// matMulAllReduce is MatMulAllReduce fused: the reduce-scatter into this
// rank's block of out, then every peer's block copied out of its out.
func (f *fused) matMulAllReduce(out backend.Tensor, terms []Term) error {
	w, rank := f.g.Size(), f.g.Rank()
	os := out.Shape()
	block := os[0] / w
	n := block * os[1]
	outs, err := f.reduceScatter(f.b.View(out, rank*n, block, os[1]), terms, "all-reduce", out)
	if err != nil {
		return err
	}
	for q, peer := range outs {
		if q != rank {
			f.b.Copy(f.b.View(out, q*n, block, os[1]), f.b.View(peer, q*n, block, os[1]))
		}
	}
	if err := f.g.Barrier(); err != nil {
		return f.fail("all-reduce: end", err)
	}
	return nil
}
