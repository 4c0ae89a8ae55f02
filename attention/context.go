package attention

// Context parallelism, the all-gather mode (CPAllGather): the sequence is
// split over the W ranks of a comm.Group in zigzag order, keys and values
// are all-gathered before the attention and their gradients
// reduce-scattered after it. It is the reference of the ring (ring.go).
//
// Zigzag order. A sequence of S positions is cut into 2W chunks of
// C = S/(2W); rank r holds chunks r and 2W-1-r. Causal attention costs a
// chunk work in proportion to its position, so pairing an early chunk with
// a late one gives every rank the same work. A rank's local rows are, per
// sequence b of its B, the C rows of chunk r and then the C rows of chunk
// 2W-1-r:
//
//	local row  b*2C + l,  l in [0, 2C)
//	position   r*C + l                 for l < C
//	           (2W-1-r)*C + (l-C)      for l >= C
//
// ZigzagPositions lists those positions; the caller shards its tokens and
// targets by them and passes them (per sequence) as posT, so RoPE rotates at
// the global positions.
//
// Forward. q, k and v are projected and rotated locally. k and v are
// all-gathered over the group (rank order: rank r's rows are block r) and
// permuted by one GatherRows into natural order, [B, S] rows. Each local
// chunk then attends with Seq = C queries at QOffset = chunk*C against the
// first QOffset+C keys of its sequence (the later ones are masked anyway).
// The calls run per sequence on Batch = 1 views: a chunk's rows are
// contiguous within a sequence but not across sequences, and views need no
// copies of q, the output or their gradients, at the price of 2B attention
// calls instead of 2.
//
// Backward. Each chunk's call gives dq for its rows and dk, dv for the
// keys it sees; they are summed into natural-order buffers, permuted back
// into rank order and reduce-scattered, so each rank receives the gradient
// of its own k and v rows from every rank's queries.

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
)

// ZigzagPositions returns the sequence positions of the 2C local rows one
// sequence has on rank rank of a context-parallel group of ranks ranks
// (C = seq/(2*ranks)), in local row order: chunk rank, then chunk
// 2*ranks-1-rank. With one rank it is 0..seq-1, for any seq.
func ZigzagPositions(seq, ranks, rank int) ([]int32, error) {
	if ranks < 1 || rank < 0 || rank >= ranks {
		return nil, fmt.Errorf("attention: context-parallel rank %d of %d is out of range", rank, ranks)
	}
	if ranks == 1 && seq >= 1 {
		pos := make([]int32, seq)
		for i := range pos {
			pos[i] = int32(i)
		}
		return pos, nil
	}
	if seq < 1 || seq%(2*ranks) != 0 {
		return nil, fmt.Errorf("attention: seq_len %d is not a positive multiple of 2*cp = %d (zigzag chunks)", seq, 2*ranks)
	}
	c := seq / (2 * ranks)
	pos := make([]int32, 0, 2*c)
	for _, chunk := range []int{rank, 2*ranks - 1 - rank} {
		for i := range c {
			pos = append(pos, int32(chunk*c+i))
		}
	}
	return pos, nil
}

// NewContextParallel allocates a Layer whose micro-batches are batch
// sequences of seq positions split over the ranks of group in zigzag
// order: each rank passes Forward and Backward its batch*seq/W local tokens
// (see ZigzagPositions for their order and positions). All ranks of group
// must call Forward and Backward together, as they run collectives. A group
// of one rank gives exactly the Layer of New. The attention between the
// ranks runs in the mode of WithContextMode (CPAllGather by default) on a
// ContextCore.
//
// A collective that fails (a peer aborted the group) makes Forward or
// Backward return its error; the rank should then abort its groups
// (comm.Ranks.Abort) so that its peers stop waiting for it.
func NewContextParallel(b backend.Backend, s Shape, batch, seq int, group comm.Group, opts ...Option) (*Layer, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	if group == nil {
		return nil, fmt.Errorf("attention: context-parallel layer needs a group, got nil")
	}
	if batch < 1 {
		return nil, fmt.Errorf("attention: batch %d must be positive", batch)
	}
	w := group.Size()
	if _, err := ZigzagPositions(seq, w, group.Rank()); err != nil {
		return nil, err
	}
	if w == 1 {
		return newLayer(b, s, batch, seq, opts, nil)
	}
	return newLayer(b, s, batch, seq/w, opts, &contextGroup{group: group, fullSeq: seq})
}

// allGather is a ContextCore's state in mode allgather.
type allGather struct {
	c *ContextCore

	// allOfNat[n] is the rank-order row (of the all-gathered [W*B*2C]) that
	// holds natural row n = b*S + p; natOfAll is its inverse. Int32 [B*S].
	allOfNat, natOfAll backend.Tensor

	kNatTK, vNatTK backend.Tensor // [B*S, KD] k, v in natural order, kept for Backward (the cpScratch's under RecomputeLayer)
	*cpScratch                    // shared with the other layers of the rank
}

// cpScratch is the part of a Scratch only all-gather cores use.
type cpScratch struct {
	kAllTK, vAllTK   backend.Tensor // [W*B*2C, KD] gathered k, v; dk, dv before the reduce-scatter
	dkNatTK, dvNatTK backend.Tensor // [B*S, KD] dk, dv summed over the local chunks
	dkOneTK, dvOneTK backend.Tensor // [S, KD] one attention call's dk, dv
	// kNatTK and vNatTK are the natural-order k and v of the cores of
	// the layers built with RecomputeLayer, one pair for all of them;
	// nil until such a core is built.
	kNatTK, vNatTK backend.Tensor
}

// fitCP allocates the all-gather scratch for rows = B*S natural rows of
// sequences of seq positions, kd columns, or checks that it has that size.
func (sc *Scratch) fitCP(b backend.Backend, rows, seq, kd int) error {
	ft := b.FloatType()
	if sc.cp == nil {
		c := &cpScratch{}
		for _, t := range []*backend.Tensor{&c.kAllTK, &c.vAllTK, &c.dkNatTK, &c.dvNatTK} {
			*t = b.New(ft, rows, kd)
		}
		c.dkOneTK, c.dvOneTK = b.New(ft, seq, kd), b.New(ft, seq, kd)
		sc.cp = c
		return nil
	}
	if c := sc.cp; c.kAllTK.Len() != rows*kd || c.dkOneTK.Len() != seq*kd || c.kAllTK.DType() != ft {
		return fmt.Errorf("attention: the shared scratch is for context-parallel layers of %d rows of sequences of %d, %d columns; this layer has %d rows of sequences of %d, %d columns",
			c.kAllTK.Shape()[0], c.dkOneTK.Shape()[0], c.kAllTK.Shape()[1], rows, seq, kd)
	}
	return nil
}

func newAllGather(c *ContextCore, sc *cpScratch, sharedNat bool) *allGather {
	b, batch, seq, chunk := c.b, c.batch, c.seq, c.chunk
	w, ft, kd := c.w, b.FloatType(), c.s.KVHeads*c.s.HeadDim()
	ag := &allGather{c: c, cpScratch: sc}
	local := batch * 2 * chunk
	allOfNat, natOfAll := make([]int32, batch*seq), make([]int32, batch*seq)
	for r := range w {
		pos, _ := ZigzagPositions(seq, w, r) // checked by the caller
		for bi := range batch {
			for l, p := range pos {
				all, nat := r*local+bi*2*chunk+l, bi*seq+int(p)
				allOfNat[nat], natOfAll[all] = int32(all), int32(nat)
			}
		}
	}
	ag.allOfNat, ag.natOfAll = b.New(backend.Int32, batch*seq), b.New(backend.Int32, batch*seq)
	backend.UploadSlice(b, ag.allOfNat, allOfNat)
	backend.UploadSlice(b, ag.natOfAll, natOfAll)
	if !sharedNat {
		ag.kNatTK, ag.vNatTK = b.New(ft, batch*seq, kd), b.New(ft, batch*seq, kd)
		return ag
	}
	if sc.kNatTK == nil { // fitCP checked the size of the rest
		sc.kNatTK, sc.vNatTK = b.New(ft, batch*seq, kd), b.New(ft, batch*seq, kd)
	}
	ag.kNatTK, ag.vNatTK = sc.kNatTK, sc.vNatTK
	return ag
}

// forward writes aTQ and lseBHS from the local, rotated q, k and v.
func (ag *allGather) forward(aTQ, lseBHS, qTQ, kTK, vTK backend.Tensor) error {
	c, b := ag.c, ag.c.b
	if err := c.g.AllGather(ag.kAllTK, kTK); err != nil {
		return c.fail("all-gather k", err)
	}
	if err := c.g.AllGather(ag.vAllTK, vTK); err != nil {
		return c.fail("all-gather v", err)
	}
	b.GatherRows(ag.kNatTK, ag.kAllTK, ag.allOfNat, nil)
	b.GatherRows(ag.vNatTK, ag.vAllTK, ag.allOfNat, nil)
	for _, cc := range c.queryChunks() {
		q, a, lse := c.qRows(qTQ, cc), c.qRows(aTQ, cc), c.lseRows(lseBHS, cc)
		k, v := ag.keys(ag.kNatTK, cc), ag.keys(ag.vNatTK, cc)
		b.AttentionForward(a, lse, q, k, v, cc.s)
	}
	return nil
}

// backward writes dqTQ, dkTK and dvTK (this rank's rows) from daTQ.
func (ag *allGather) backward(dqTQ, dkTK, dvTK, daTQ backend.Tensor) error {
	c, b, kd := ag.c, ag.c.b, ag.c.s.KVHeads*ag.c.s.HeadDim()
	b.Zero(ag.dkNatTK)
	b.Zero(ag.dvNatTK)
	for _, cc := range c.queryChunks() {
		q, a, lse := c.qRows(c.qTQ, cc), c.qRows(c.aTQ, cc), c.lseRows(c.lseBHS, cc)
		k, v := ag.keys(ag.kNatTK, cc), ag.keys(ag.vNatTK, cc)
		dq, da := c.qRows(dqTQ, cc), c.qRows(daTQ, cc)
		dk, dv := b.View(ag.dkOneTK, 0, cc.s.KVSeq, kd), b.View(ag.dvOneTK, 0, cc.s.KVSeq, kd)
		b.AttentionBackward(dq, dk, dv, da, q, k, v, a, lse, cc.s)
		b.Axpy(ag.keys(ag.dkNatTK, cc), 1, dk)
		b.Axpy(ag.keys(ag.dvNatTK, cc), 1, dv)
	}
	// Rank order, then each rank keeps the sum of its own block.
	b.GatherRows(ag.kAllTK, ag.dkNatTK, ag.natOfAll, nil)
	b.GatherRows(ag.vAllTK, ag.dvNatTK, ag.natOfAll, nil)
	if err := c.g.ReduceScatterSum(dkTK, ag.kAllTK); err != nil {
		return c.fail("reduce-scatter dk", err)
	}
	if err := c.g.ReduceScatterSum(dvTK, ag.vAllTK); err != nil {
		return c.fail("reduce-scatter dv", err)
	}
	return nil
}

// keys is the view of the first cc.s.KVSeq natural-order rows of sequence
// cc.bi in t ([B*S, KD]).
func (ag *allGather) keys(t backend.Tensor, cc chunkCall) backend.Tensor {
	c, kd := ag.c, ag.c.s.KVHeads*ag.c.s.HeadDim()
	return c.b.View(t, cc.bi*c.seq*kd, cc.s.KVSeq, kd)
}
