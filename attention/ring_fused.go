package attention

// Context parallelism, the fused ring (CPRing where the group offers
// comm.PeerAccess and the backend's zigzag ops take the shape): no k or v
// chunk travels. Each rank's kernels read the peers' tensors in place,
// through device pointers (the virtual ranks of one GPU, or peer GPUs of
// one process over NVLink), tile by tile in position order, the online
// softmax of a query tile staying in registers across every chunk it sees
// (backend.ZigzagShape; the kernels are attn_zz_* in kernels/attention_tc.cu).
// The tiles are the whole-sequence call's, visited in its order, so a
// rank's outputs and dq round as that call's do.
//
// Who reads whose memory, per rank r:
//
//	forward:  after PeerTensors(k, v, q, lse, delta), r's forward reads
//	          every rank's k and v; Barrier, so no rank moves on to write
//	          its k or v while a peer still reads them.
//	backward: r's dq pass reads every rank's k and v and writes its own
//	          dq and delta (D_i = rowsum(da*a)); Barrier, so every delta is
//	          written; r's dk/dv pass reads every rank's q, da, lse and
//	          delta and writes its own dk and dv; Barrier.
//
// dq, dk and dv are each written by their owner alone, in a fixed order,
// so nothing is reduced across ranks and the results are the same on
// every run. Against the portable ring this moves no chunk at all on
// virtual ranks; over NVLink the dk/dv pass reads H/KV times more bytes of
// queries than k and v would be, for GQA (the portable ring sends k, v and
// their float32 gradients instead), in exchange for no reduction and no
// buffers in flight. On the CPU the ops compute in the all-gather path's
// order and give its bits.

import (
	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
)

// fusedRing is a ContextCore's state in mode ring on the fused ops.
type fusedRing struct {
	c     *ContextCore
	peers comm.PeerAccess
	shape backend.ZigzagShape
	// deltaBHS is this rank's D_i of the last backward, [B, 2, H, C]: the
	// peers' dk/dv passes read it.
	deltaBHS backend.Tensor
	// peerT is every rank's tensors from the last PeerTensors, [rank][i]:
	// k, v in the forward; k, v, q, da, lse, delta in the backward.
	peerT [][]backend.Tensor
}

// newFusedRing returns the fused ring of c, or nil when c's group offers
// no peer access or the backend's zigzag ops do not take its shape.
func newFusedRing(c *ContextCore) *fusedRing {
	peers, ok := c.g.(comm.PeerAccess)
	if !ok {
		return nil
	}
	s := backend.ZigzagShape{Ranks: c.w, Rank: c.rank, Batch: c.batch, Chunk: c.chunk,
		Heads: c.s.Heads, KVHeads: c.s.KVHeads, HeadDim: c.s.HeadDim()}
	if c.b.ZigzagAttentionSupports(s) != nil {
		return nil
	}
	return &fusedRing{c: c, peers: peers, shape: s, deltaBHS: c.b.New(c.b.FloatType(), c.batch, 2, c.s.Heads, c.chunk)}
}

// column is rank list i of f.peerT.
func (f *fusedRing) column(i int) []backend.Tensor {
	ts := make([]backend.Tensor, len(f.peerT))
	for r, row := range f.peerT {
		ts[r] = row[i]
	}
	return ts
}

func (f *fusedRing) meet(what string, ts ...backend.Tensor) error {
	var err error
	if f.peerT, err = f.peers.PeerTensors(ts...); err != nil {
		return f.c.fail(what, err)
	}
	return nil
}

func (f *fusedRing) barrier(what string) error {
	if err := f.c.g.Barrier(); err != nil {
		return f.c.fail(what, err)
	}
	return nil
}

func (f *fusedRing) forward(aTQ, lseBHS, qTQ, kTK, vTK backend.Tensor) error {
	if err := f.meet("fused ring: exchange of k and v", kTK, vTK); err != nil {
		return err
	}
	f.c.b.ZigzagAttentionForward(aTQ, lseBHS, qTQ, f.column(0), f.column(1), f.shape)
	return f.barrier("fused ring: end of the forward")
}

func (f *fusedRing) backward(dqTQ, dkTK, dvTK, daTQ backend.Tensor) error {
	c, b := f.c, f.c.b
	if err := f.meet("fused ring: exchange of the backward's inputs", c.kTK, c.vTK, c.qTQ, daTQ, c.lseBHS, f.deltaBHS); err != nil {
		return err
	}
	b.ZigzagAttentionBackwardDQ(dqTQ, f.deltaBHS, daTQ, c.qTQ, c.aTQ, c.lseBHS, f.column(0), f.column(1), f.shape)
	if err := f.barrier("fused ring: every rank's delta"); err != nil {
		return err
	}
	b.ZigzagAttentionBackwardDKDV(dkTK, dvTK, c.kTK, c.vTK, f.column(2), f.column(3), f.column(4), f.column(5), f.shape)
	return f.barrier("fused ring: end of the backward")
}
