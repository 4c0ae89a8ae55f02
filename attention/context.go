package attention

// Context parallelism, unfused: the sequence is split over the W ranks of a
// comm.Group in zigzag order, keys and values are all-gathered before the
// attention and their gradients reduce-scattered after it. The fused ring
// kernel will replace the two collectives; this file is its reference.
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
// of one rank gives exactly the Layer of New.
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
		return newLayer(b, s, batch, seq, opts)
	}
	c := seq / (2 * w)
	l, err := newLayer(b, s, batch, 2*c, opts)
	if err != nil {
		return nil, err
	}
	if err := l.sc.fitCP(b, batch*seq, seq, s.KVHeads*s.HeadDim()); err != nil {
		return nil, err
	}
	l.cp = newContextParallel(b, s, batch, seq, group, l.sc.cp)
	return l, nil
}

// contextParallel is a Layer's state for W > 1 ranks.
type contextParallel struct {
	g                 comm.Group
	w, rank           int
	batch, seq, chunk int // B, the full S, and C = S/(2W)

	// allOfNat[n] is the rank-order row (of the all-gathered [W*B*2C]) that
	// holds natural row n = b*S + p; natOfAll is its inverse. Int32 [B*S].
	allOfNat, natOfAll backend.Tensor

	kNatTK, vNatTK backend.Tensor // [B*S, KD] k, v in natural order, kept for Backward
	*cpScratch                    // shared with the other layers of the rank
}

// cpScratch is the part of a Scratch only context-parallel Layers use.
type cpScratch struct {
	kAllTK, vAllTK   backend.Tensor // [W*B*2C, KD] gathered k, v; dk, dv before the reduce-scatter
	dkNatTK, dvNatTK backend.Tensor // [B*S, KD] dk, dv summed over the local chunks
	dkOneTK, dvOneTK backend.Tensor // [S, KD] one attention call's dk, dv
}

// fitCP allocates the context-parallel scratch for rows = B*S natural rows
// of sequences of seq positions, kd columns, or checks that it has that size.
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

func newContextParallel(b backend.Backend, s Shape, batch, seq int, g comm.Group, sc *cpScratch) *contextParallel {
	w, ft, kd := g.Size(), b.FloatType(), s.KVHeads*s.HeadDim()
	cp := &contextParallel{g: g, w: w, rank: g.Rank(), batch: batch, seq: seq, chunk: seq / (2 * w), cpScratch: sc}
	local := batch * 2 * cp.chunk
	allOfNat, natOfAll := make([]int32, batch*seq), make([]int32, batch*seq)
	for r := range w {
		pos, _ := ZigzagPositions(seq, w, r) // checked by the caller
		for bi := range batch {
			for l, p := range pos {
				all, nat := r*local+bi*2*cp.chunk+l, bi*seq+int(p)
				allOfNat[nat], natOfAll[all] = int32(all), int32(nat)
			}
		}
	}
	cp.allOfNat, cp.natOfAll = b.New(backend.Int32, batch*seq), b.New(backend.Int32, batch*seq)
	backend.UploadSlice(b, cp.allOfNat, allOfNat)
	backend.UploadSlice(b, cp.natOfAll, natOfAll)
	cp.kNatTK, cp.vNatTK = b.New(ft, batch*seq, kd), b.New(ft, batch*seq, kd)
	return cp
}

// chunkCall is one local chunk of one sequence: its query rows' offset
// among the local rows, and the attention shape of its call.
type chunkCall struct {
	bi, row0 int // the sequence, and its first local row
	s        backend.AttnShape
}

// calls lists the 2B attention calls of a micro-batch, in the order their
// lse rows are laid out ([B, 2, H, C]).
func (cp *contextParallel) calls(s Shape) []chunkCall {
	var cs []chunkCall
	for bi := range cp.batch {
		for n, chunk := range []int{cp.rank, 2*cp.w - 1 - cp.rank} {
			off := chunk * cp.chunk
			cs = append(cs, chunkCall{bi: bi, row0: (bi*2 + n) * cp.chunk, s: backend.AttnShape{
				Batch: 1, Seq: cp.chunk, Heads: s.Heads, KVHeads: s.KVHeads, HeadDim: s.HeadDim(),
				KVSeq: off + cp.chunk, QOffset: off,
			}})
		}
	}
	return cs
}

// forward writes aTQ and lseBHS from the local, rotated q, k and v.
func (cp *contextParallel) forward(l *Layer) error {
	b := l.b
	if err := cp.g.AllGather(cp.kAllTK, l.kTK); err != nil {
		return cp.fail("all-gather k", err)
	}
	if err := cp.g.AllGather(cp.vAllTK, l.vTK); err != nil {
		return cp.fail("all-gather v", err)
	}
	b.GatherRows(cp.kNatTK, cp.kAllTK, cp.allOfNat, nil)
	b.GatherRows(cp.vNatTK, cp.vAllTK, cp.allOfNat, nil)
	for n, c := range cp.calls(l.s) {
		q, a, lse := l.qRows(c), l.aRows(c), l.lseRows(n, c)
		k, v := cp.keys(l, cp.kNatTK, c), cp.keys(l, cp.vNatTK, c)
		b.AttentionForward(a, lse, q, k, v, c.s)
	}
	return nil
}

// backward writes l.dqTQ, l.dkTK and l.dvTK (this rank's rows) from l.daTQ.
func (cp *contextParallel) backward(l *Layer) error {
	b := l.b
	b.Zero(cp.dkNatTK)
	b.Zero(cp.dvNatTK)
	for n, c := range cp.calls(l.s) {
		q, a, lse := l.qRows(c), l.aRows(c), l.lseRows(n, c)
		k, v := cp.keys(l, cp.kNatTK, c), cp.keys(l, cp.vNatTK, c)
		dq, da := b.View(l.dqTQ, c.row0*l.qWidth(), c.s.Seq, l.qWidth()), b.View(l.daTQ, c.row0*l.qWidth(), c.s.Seq, l.qWidth())
		dk, dv := b.View(cp.dkOneTK, 0, c.s.KVSeq, l.kdWidth()), b.View(cp.dvOneTK, 0, c.s.KVSeq, l.kdWidth())
		b.AttentionBackward(dq, dk, dv, da, q, k, v, a, lse, c.s)
		b.Axpy(cp.keys(l, cp.dkNatTK, c), 1, dk)
		b.Axpy(cp.keys(l, cp.dvNatTK, c), 1, dv)
	}
	// Rank order, then each rank keeps the sum of its own block.
	b.GatherRows(cp.kAllTK, cp.dkNatTK, cp.natOfAll, nil)
	b.GatherRows(cp.vAllTK, cp.dvNatTK, cp.natOfAll, nil)
	if err := cp.g.ReduceScatterSum(l.dkTK, cp.kAllTK); err != nil {
		return cp.fail("reduce-scatter dk", err)
	}
	if err := cp.g.ReduceScatterSum(l.dvTK, cp.vAllTK); err != nil {
		return cp.fail("reduce-scatter dv", err)
	}
	return nil
}

// keys is the view of the first c.s.KVSeq natural-order rows of sequence
// c.bi in t ([B*S, KD]).
func (cp *contextParallel) keys(l *Layer, t backend.Tensor, c chunkCall) backend.Tensor {
	return l.b.View(t, c.bi*cp.seq*l.kdWidth(), c.s.KVSeq, l.kdWidth())
}

func (cp *contextParallel) fail(what string, err error) error {
	return fmt.Errorf("attention: context-parallel %s (rank %d of %d): %w", what, cp.rank, cp.w, err)
}

// qRows, aRows and lseRows are a chunk call's views of q, a and the lse
// (laid out [B, 2, H, C] on a context-parallel Layer).
func (l *Layer) qRows(c chunkCall) backend.Tensor {
	return l.b.View(l.qTQ, c.row0*l.qWidth(), c.s.Seq, l.qWidth())
}

func (l *Layer) aRows(c chunkCall) backend.Tensor {
	return l.b.View(l.aTQ, c.row0*l.qWidth(), c.s.Seq, l.qWidth())
}

func (l *Layer) lseRows(n int, c chunkCall) backend.Tensor {
	return l.b.View(l.lseBHS, n*c.s.Heads*c.s.Seq, 1, c.s.Heads, c.s.Seq)
}

func (l *Layer) qWidth() int  { return l.s.Heads * l.s.HeadDim() }
func (l *Layer) kdWidth() int { return l.s.KVHeads * l.s.HeadDim() }
