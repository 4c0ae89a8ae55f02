package attention

// Context parallelism, the fused ring (CPRing where the group offers
// comm.PeerAccess and the backend's zigzag ops take the shape): no k or v
// chunk travels. Each rank's kernels read the peers' tensors in place,
// through device pointers or tensor maps (the virtual ranks of one GPU, or
// peer GPUs of one process over NVLink), tile by tile in position order,
// the online softmax of a query tile staying in registers across every
// chunk it sees (backend.ZigzagShape). The tiles are the whole-sequence
// call's, visited in its order, so a rank's outputs round as that call's
// do. It runs in one of two ways.
//
// One pass (backend.ZigzagAttentionOnePass takes the shape: the Hopper
// core's attn_h_zz_* on CUDA, not under train.deterministic). q, k and v
// come in bf16 (ContextCore.QKVType: a Layer's RoPE writes them so).
//
//	forward:  after PeerTensors(k, v), r's forward reads every rank's k
//	          and v; Barrier, so no rank overwrites its k or v (the next
//	          layer's) while a peer still reads them.
//	backward: r's ZigzagAttentionPrepare writes its delta (D_i =
//	          rowsum(da*a)), rounds its da to bf16 in the Scratch and
//	          zeroes its dq, in one pass;
//	          PeerTensors(dq, q, da, lse, delta); r's one kernel walks
//	          every query that sees r's keys, writes r's dk and dv and adds
//	          their share of each rank's dq into that rank's dq; Barrier,
//	          so every share has landed before any rank reads its dq.
//
// dq's shares land in the order the blocks run, so dq's last bits vary
// from run to run.
//
// Two passes (attention_tc.cu's attn_zz_* on CUDA; the CPU, whose results
// are bitwise the all-gather path's):
//
//	forward:  after PeerTensors(k, v), r's forward reads every rank's k
//	          and v; Barrier.
//	backward: r's dq pass reads every rank's k and v and writes its own
//	          dq and delta; Barrier, so every delta is written; r's dk/dv
//	          pass reads every rank's q, da, lse and delta and writes its
//	          own dk and dv; Barrier.
//
// There dq, dk and dv are each written by their owner alone, in a fixed
// order, so the results are the same on every run. Against the portable
// ring neither way moves a chunk on virtual ranks; over NVLink the dk/dv
// pass (or the one-pass backward) reads H/KV times more bytes of queries
// than k and v would be, for GQA, in exchange for no buffers in flight.
//
// The delta and the bf16 copy of da are the Scratch's, one set for the
// rank's layers: each layer's use ends at its closing Barrier.

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
)

// fusedRing is a ContextCore's state in mode ring on the fused ops.
type fusedRing struct {
	c     *ContextCore
	peers comm.PeerAccess
	shape backend.ZigzagShape
	// onePass: the backend's one-pass ops take shape.
	onePass bool
	*zzScratch
	// peerT is every rank's tensors from the last PeerTensors, [rank][i].
	peerT [][]backend.Tensor
}

// zzScratch is the part of a Scratch only fused rings use.
type zzScratch struct {
	// deltaBHS is this rank's D_i of the backward under way, [B, 2, H, C]:
	// the peers' dk/dv passes read it.
	deltaBHS backend.Tensor
	// daTQ is da rounded to bf16 [B*2C, H*Dh] for the one-pass backward;
	// nil on the two-pass ops.
	daTQ backend.Tensor
}

// fitZZ allocates the fused ring's scratch for rows local rows of q
// columns and lse elements of delta (with onePass da's bf16 copy too), or
// checks that it has that size.
func (sc *Scratch) fitZZ(b backend.Backend, rows, q, lse int, onePass bool) error {
	if sc.zz == nil {
		sc.zz = &zzScratch{deltaBHS: b.New(b.FloatType(), lse)}
	}
	z := sc.zz
	if z.deltaBHS.Len() != lse {
		return fmt.Errorf("attention: the shared scratch is for fused rings of %d lse elements; this layer has %d", z.deltaBHS.Len(), lse)
	}
	if !onePass {
		return nil
	}
	if z.daTQ == nil {
		z.daTQ = b.New(backend.BFloat16, rows, q)
		return nil
	}
	if z.daTQ.Len() != rows*q {
		return fmt.Errorf("attention: the shared scratch is for fused rings of %d rows of %d columns; this layer has %d rows of %d columns",
			z.daTQ.Shape()[0], z.daTQ.Shape()[1], rows, q)
	}
	return nil
}

// newFusedRing returns the fused ring of c, or nil when c's group offers
// no peer access or the backend's zigzag ops do not take its shape.
func newFusedRing(c *ContextCore, sc *Scratch) (*fusedRing, error) {
	peers, ok := c.g.(comm.PeerAccess)
	if !ok {
		return nil, nil
	}
	s := backend.ZigzagShape{Ranks: c.w, Rank: c.rank, Batch: c.batch, Chunk: c.chunk,
		Heads: c.s.Heads, KVHeads: c.s.KVHeads, HeadDim: c.s.HeadDim()}
	if c.b.ZigzagAttentionSupports(s) != nil {
		return nil, nil
	}
	f := &fusedRing{c: c, peers: peers, shape: s, onePass: c.b.ZigzagAttentionOnePass(s) == nil}
	dh := c.s.HeadDim()
	if err := sc.fitZZ(c.b, c.localRows(), c.s.Heads*dh, c.batch*2*c.s.Heads*c.chunk, f.onePass); err != nil {
		return nil, err
	}
	f.zzScratch = sc.zz
	return f, nil
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
	b := f.c.b
	if err := f.meet("fused ring: exchange of k and v", kTK, vTK); err != nil {
		return err
	}
	b.ZigzagAttentionForward(aTQ, lseBHS, qTQ, f.column(0), f.column(1), f.shape)
	return f.barrier("fused ring: end of the forward")
}

func (f *fusedRing) backward(dqTQ, dkTK, dvTK, daTQ backend.Tensor) error {
	if f.onePass {
		return f.backwardOnePass(dqTQ, dkTK, dvTK, daTQ)
	}
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

func (f *fusedRing) backwardOnePass(dqTQ, dkTK, dvTK, daTQ backend.Tensor) error {
	c, b, z := f.c, f.c.b, f.zzScratch
	b.ZigzagAttentionPrepare(z.deltaBHS, z.daTQ, dqTQ, daTQ, c.aTQ, f.shape)
	if err := f.meet("fused ring: exchange of the backward's inputs", dqTQ, c.qTQ, z.daTQ, c.lseBHS, z.deltaBHS); err != nil {
		return err
	}
	b.ZigzagAttentionBackward(f.column(0), dkTK, dvTK, c.kTK, c.vTK, f.column(1), f.column(2), f.column(3), f.column(4), f.shape)
	return f.barrier("fused ring: end of the backward")
}
