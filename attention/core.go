package attention

// The context-attention core: the part of a context-parallel Layer between
// the rotated q, k, v and the attention output, with explicit tensors, so
// that it can be run and timed alone (mktrain bench attention) and so that
// its modes (how keys and values reach the queries of other ranks) share one
// place where they are chosen.

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
)

// CPMode is how a ContextCore brings every rank's keys and values to its
// queries (the recipe's parallel.cp_attention, auto settled).
type CPMode string

const (
	// CPAllGather all-gathers k and v over the group and reduce-scatters
	// their gradients (context.go): the reference, and on every rank
	// [B*S, KV*Dh] gathered keys and values per layer.
	CPAllGather CPMode = "allgather"
	// CPRing holds no rank's whole sequences: the fused ring reads the
	// peers' k and v in place where the group offers peer access
	// (ring_fused.go), the portable ring passes each rank's k and v chunks
	// around the ring of ranks while the rank computes on the chunk it
	// holds (ring.go).
	CPRing CPMode = "ring"
)

// ContextCore is causal attention over sequences split across the ranks of
// a comm.Group in zigzag order (see ZigzagPositions): each rank passes its
// own rows of q, k and v, already projected and rotated, and gets the
// attention output of its query rows. All ranks of the group call Forward
// and Backward together. A ContextCore is not safe for concurrent use.
//
// Layouts, with B = batch, C = seq/(2W) and local rows b*2C + l (chunk rank
// for l < C, chunk 2W-1-rank after it): q and a are [B*2C, H*Dh], k and v
// [B*2C, KV*Dh], lse [B, 2, H, C]. With a group of one rank it is plain
// causal attention over [B*seq] rows, lse [B, H, seq]. q, k and v are of
// the type QKVType names; every other tensor is of the float type.
type ContextCore struct {
	b                 backend.Backend
	s                 Shape
	g                 comm.Group
	mode              CPMode
	w, rank           int
	batch, seq, chunk int // B, the full S, and C = S/(2W) (W > 1)

	// Saved by Forward for Backward: the caller's tensors, by reference.
	// aTQ is nil before a Forward succeeds.
	qTQ, kTK, vTK, aTQ, lseBHS backend.Tensor

	// impl runs the mode when W > 1: allGather (context.go), the fused
	// ring (ring_fused.go) or the portable ring (ring.go), chosen by
	// newContextCore.
	impl contextImpl
	// qkvType is the type of q, k and v (QKVType).
	qkvType backend.DType
}

// NewContextCore allocates a core for micro-batches of batch sequences of
// seq positions split over group (seq a multiple of 2W) in mode. It
// fails, in a sentence, on a bad shape, group or mode.
func NewContextCore(b backend.Backend, s Shape, batch, seq int, group comm.Group, mode CPMode) (*ContextCore, error) {
	return newContextCore(b, s, batch, seq, group, mode, NewScratch(), false)
}

// newContextCore is NewContextCore with the mode's working memory in sc,
// shared with the other layers of the rank; sharedNat (RecomputeLayer)
// puts the all-gather core's natural-order keys and values there too.
func newContextCore(b backend.Backend, s Shape, batch, seq int, group comm.Group, mode CPMode, sc *Scratch, sharedNat bool) (*ContextCore, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	if group == nil {
		return nil, fmt.Errorf("attention: context-parallel layer needs a group, got nil")
	}
	if batch < 1 {
		return nil, fmt.Errorf("attention: batch %d must be positive", batch)
	}
	if mode != CPAllGather && mode != CPRing {
		return nil, fmt.Errorf("attention: context-parallel mode %q; want %q or %q (parallel.cp_attention auto is settled before the layers are built: tune.ResolveCPAttention)",
			mode, CPAllGather, CPRing)
	}
	w := group.Size()
	if _, err := ZigzagPositions(seq, w, group.Rank()); err != nil {
		return nil, err
	}
	c := &ContextCore{b: b, s: s, g: group, mode: mode, w: w, rank: group.Rank(), batch: batch, seq: seq, qkvType: b.FloatType()}
	if w == 1 {
		return c, nil
	}
	c.chunk = seq / (2 * w)
	var err error
	switch mode {
	case CPAllGather:
		if err := sc.fitCP(b, batch*seq, seq, s.KVHeads*s.HeadDim()); err != nil {
			return nil, err
		}
		c.impl = newAllGather(c, sc.cp, sharedNat)
	case CPRing:
		c.impl, err = c.ringImpl(sc)
	}
	if err != nil {
		return nil, err
	}
	if f, ok := c.impl.(*fusedRing); ok && f.onePass {
		c.qkvType = backend.BFloat16
	}
	return c, nil
}

// QKVType is the type Forward takes q, k and v in: bf16 where the core is
// the fused ring in one pass (its kernels read bf16 tiles, and a Layer's
// RoPE writes them so, as it does for the attention of one rank), else the
// backend's float type, which the collectives and the other kernels move
// and read.
func (c *ContextCore) QKVType() backend.DType { return c.qkvType }

// contextImpl is one way of running a core of W > 1 ranks: Forward and
// Backward check the tensors, then call it.
type contextImpl interface {
	forward(aTQ, lseBHS, qTQ, kTK, vTK backend.Tensor) error
	backward(dqTQ, dkTK, dvTK, daTQ backend.Tensor) error
}

// ringImpl picks how mode ring runs: the fused ring (ring_fused.go:
// kernels that read the peers' k and v through comm.PeerAccess's
// PeerTensors) when the group offers peer access and the backend's zigzag
// ops take the shape; else the portable ring over the group's Send and
// Recv (ring.go), which serves every group.
func (c *ContextCore) ringImpl(sc *Scratch) (contextImpl, error) {
	f, err := newFusedRing(c, sc)
	if err != nil || f != nil {
		return f, err
	}
	return newRing(c, sc)
}

// Path names what runs the core: "attention" (one rank), "allgather",
// "fused ring in one pass", "fused ring" (in two passes) or "portable
// ring".
func (c *ContextCore) Path() string {
	switch impl := c.impl.(type) {
	case nil:
		return "attention"
	case *fusedRing:
		if impl.onePass {
			return "fused ring in one pass"
		}
		return "fused ring"
	case *ring:
		return "portable ring"
	}
	return string(CPAllGather)
}

// Mode is the mode the core runs in.
func (c *ContextCore) Mode() CPMode { return c.mode }

// Forward writes aTQ, the attention output of this rank's query rows, and
// lseBHS, their log-sum-exp, from this rank's rotated qTQ, kTK and vTK (see
// ContextCore for the layouts). It keeps all five by reference for
// Backward. It fails on tensors of the wrong size or type or a failed
// transfer (a peer aborted the group; the rank should then abort its
// groups too).
func (c *ContextCore) Forward(aTQ, lseBHS, qTQ, kTK, vTK backend.Tensor) error {
	c.aTQ = nil
	rows, q, kd := c.localRows(), c.s.Heads*c.s.HeadDim(), c.s.KVHeads*c.s.HeadDim()
	for _, a := range []struct {
		name string
		t    backend.Tensor
		n    int
	}{{"a", aTQ, rows * q}, {"lse", lseBHS, c.batch * c.s.Heads * c.seq / c.w}, {"q", qTQ, rows * q}, {"k", kTK, rows * kd}, {"v", vTK, rows * kd}} {
		if a.t == nil || a.t.Len() != a.n {
			return fmt.Errorf("attention: context core Forward: %s has %s, want %d elements", a.name, describe(a.t), a.n)
		}
	}
	for _, a := range []struct {
		name string
		t    backend.Tensor
	}{{"q", qTQ}, {"k", kTK}, {"v", vTK}} {
		if a.t.DType() != c.qkvType {
			return fmt.Errorf("attention: context core Forward: %s is %v, want %v (the core's QKVType)", a.name, a.t.DType(), c.qkvType)
		}
	}
	var err error
	if c.w == 1 {
		c.b.AttentionForward(aTQ, lseBHS, qTQ, kTK, vTK, c.attnShape())
	} else {
		err = c.impl.forward(aTQ, lseBHS, qTQ, kTK, vTK)
	}
	if err != nil {
		return err
	}
	c.qTQ, c.kTK, c.vTK, c.aTQ, c.lseBHS = qTQ, kTK, vTK, aTQ, lseBHS
	return nil
}

// Backward writes dqTQ, dkTK and dvTK, the gradients of this rank's q, k
// and v rows, from daTQ, the gradient of the last Forward's output. The
// tensors Forward kept must hold the same values. It fails without a
// successful Forward, on tensors of the wrong size or a failed transfer.
func (c *ContextCore) Backward(dqTQ, dkTK, dvTK, daTQ backend.Tensor) error {
	if c.aTQ == nil {
		return fmt.Errorf("attention: context core Backward called without a successful Forward")
	}
	rows, q, kd := c.localRows(), c.s.Heads*c.s.HeadDim(), c.s.KVHeads*c.s.HeadDim()
	for _, a := range []struct {
		name string
		t    backend.Tensor
		n    int
	}{{"dq", dqTQ, rows * q}, {"dk", dkTK, rows * kd}, {"dv", dvTK, rows * kd}, {"da", daTQ, rows * q}} {
		if a.t == nil || a.t.Len() != a.n {
			return fmt.Errorf("attention: context core Backward: %s has %s, want %d elements", a.name, describe(a.t), a.n)
		}
	}
	if c.w == 1 {
		c.b.AttentionBackward(dqTQ, dkTK, dvTK, daTQ, c.qTQ, c.kTK, c.vTK, c.aTQ, c.lseBHS, c.attnShape())
		return nil
	}
	return c.impl.backward(dqTQ, dkTK, dvTK, daTQ)
}

// localRows is the number of this rank's rows, B*S/W.
func (c *ContextCore) localRows() int { return c.batch * c.seq / c.w }

// attnShape is the one-rank call over whole sequences.
func (c *ContextCore) attnShape() backend.AttnShape {
	return backend.AttnShape{Batch: c.batch, Seq: c.seq, Heads: c.s.Heads, KVHeads: c.s.KVHeads, HeadDim: c.s.HeadDim()}
}

// chunkCall is one local chunk of one sequence: its query rows' offset
// among the local rows, and the attention shape of its call.
type chunkCall struct {
	n        int // the call's index: its lse rows are block n of [B*2, H, C]
	bi, row0 int // the sequence, and its first local row
	s        backend.AttnShape
}

// queryChunks lists the 2B local query chunks of a micro-batch, in the
// order their lse rows are laid out ([B, 2, H, C]), each with the shape of
// its call against every key up to its own (the all-gather path's call).
func (c *ContextCore) queryChunks() []chunkCall {
	var cs []chunkCall
	for bi := range c.batch {
		for n, chunk := range []int{c.rank, 2*c.w - 1 - c.rank} {
			off := chunk * c.chunk
			cs = append(cs, chunkCall{n: bi*2 + n, bi: bi, row0: (bi*2 + n) * c.chunk, s: backend.AttnShape{
				Batch: 1, Seq: c.chunk, Heads: c.s.Heads, KVHeads: c.s.KVHeads, HeadDim: c.s.HeadDim(),
				KVSeq: off + c.chunk, QOffset: off,
			}})
		}
	}
	return cs
}

// qRows is the view of a chunk call's rows in t, a [B*2C, H*Dh] tensor
// (q, a and their gradients).
func (c *ContextCore) qRows(t backend.Tensor, cc chunkCall) backend.Tensor {
	q := c.s.Heads * c.s.HeadDim()
	return c.b.View(t, cc.row0*q, cc.s.Seq, q)
}

// lseRows is the view of a chunk call's rows of the lse ([B, 2, H, C]).
func (c *ContextCore) lseRows(lseBHS backend.Tensor, cc chunkCall) backend.Tensor {
	return c.b.View(lseBHS, cc.n*c.s.Heads*c.chunk, 1, c.s.Heads, c.chunk)
}

func (c *ContextCore) fail(what string, err error) error {
	return fmt.Errorf("attention: context-parallel %s (rank %d of %d): %w", what, c.rank, c.w, err)
}

// describe names a tensor's size for an error.
func describe(t backend.Tensor) string {
	if t == nil {
		return "no tensor"
	}
	return fmt.Sprintf("shape %v (%d elements)", t.Shape(), t.Len())
}
