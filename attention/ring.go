package attention

// Context parallelism, the portable ring (CPRing): every rank's keys and
// values travel around the ring of the W ranks of the group over its Send
// and Recv, while each rank computes its queries' attention on the chunk it
// holds. It runs wherever the group does: in-process virtual ranks, NCCL
// between GPUs and nodes, TCP on the CPU. It holds only the chunks in
// flight, where the all-gather mode (context.go) holds every rank's keys
// and values; it gives the all-gather path's results up to rounding (the
// partial results are merged in ring order, not summed in one pass).
//
// Zigzag, as in context.go: rank r holds chunks r and 2W-1-r of every
// sequence, C = S/(2W) positions each; call its query chunks the early one
// (r) and the late one (L = 2W-1-r). Rank j's k and v rows, the "pair" of
// chunks j and 2W-1-j, have the same layout on every rank, so a rank
// computes on a peer's pair exactly as on its own.
//
// Forward. At ring step s = 0..W-1 rank r holds the pair of rank
// j = (r - s) mod W and, per sequence:
//
//	s = 0 (j = r): the diagonal. The early chunk against key chunk r
//	  (causal, KVSeq C); the late chunk against [chunk r, chunk L]
//	  (KVSeq 2C, QOffset C: all of chunk r, and L causally).
//	j < r: both query chunks see key chunk j whole; chunk 2W-1-j lies
//	  after both.
//	j > r: only the late chunk sees anything: both of j's chunks, whole.
//
// Step 0 writes the output and lse; every later block is an unmasked
// attention call (backend.AttnShape.Full) into a partial output and lse,
// folded into the running ones with AttentionMerge (the log-sum-exp rule).
// Every step costs the same: two C x C blocks or one C x 2C block per
// sequence (the diagonal: half of that, twice).
//
// Backward. With the final output and lse, the attention backward of one
// block (P = exp(s - lse), D = rowsum(dout*out)) gives that block's exact
// share of dq, dk and dv. dq accumulates locally. dk and dv of a pair
// accumulate in a buffer that travels the ring one step behind the pair:
// at step s rank r receives from rank r-1 the sums the ranks before it made
// for the pair it now holds, adds its own blocks', and at step s+1 sends
// them on. After the last step each sum has visited all W ranks and one
// more hop brings it to its owner (rank r receives its own chunks' dk, dv
// from rank r-1). The sums add in ring order, the same on every run.
//
// Overlap, and what orders what. While a step computes on the pair it
// holds ("cur"), a goroutine sends cur to rank r+1 and receives the next
// pair from rank r-1 into another buffer ("next"); in the backward it also
// passes the previous step's dk, dv sums on. The step's compute only reads
// cur, the transfer only reads cur and the finished sums and only writes
// next and the incoming sums, so the two touch no common memory in
// conflicting ways; the step joins the goroutine before it swaps the
// buffers or reads the incoming sums. The backend must take ops from two
// goroutines at once, as every backend does for virtual ranks; on one CUDA
// stream the transfer's copy runs between the compute's kernels in queue
// order, and a Send returns only once the copy out of the buffer is queued,
// so the next write to it comes after. The group runs one Send or Recv at
// a time per rank in a fixed order: even ranks send before they receive,
// odd ranks receive before they send, so no cycle of blocked senders forms
// (NCCL's Send and Recv moreover share one device thread). Over NCCL the
// transfer waits on the compute stream, so the overlap there is partial; the
// fused ring (ring_fused.go) is the fast path on GPUs.

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
)

// ring is a ContextCore's state in mode ring.
type ring struct {
	c *ContextCore
	*ringScratch
}

// kvPair is one rank's k and v rows, [B*2C, KD] each: per sequence, its
// early chunk then its late chunk. The same type holds their gradients.
type kvPair struct{ k, v backend.Tensor }

// ringScratch is the part of a Scratch only ring cores use.
type ringScratch struct {
	kv               [2]kvPair      // the pair computed on, and the next one in flight
	sumOut, sumIn    kvPair         // dk, dv sums: passed on, and arriving
	sumStep          kvPair         // dk, dv of this step's blocks
	partTQ           backend.Tensor // [C, H*Dh] a block's output (forward) or dq (backward)
	partLseHS        backend.Tensor // [H, C] a block's lse
	dkOneTK, dvOneTK backend.Tensor // [2C, KD] a block's dk, dv
}

// fitRing allocates the ring scratch for rows local rows of chunk
// positions per chunk, q and kd columns, or checks that it has that size.
func (sc *Scratch) fitRing(b backend.Backend, rows, chunk, heads, q, kd int) error {
	ft := b.FloatType()
	if sc.ring == nil {
		r := &ringScratch{}
		pair := func() kvPair { return kvPair{b.New(ft, rows, kd), b.New(ft, rows, kd)} }
		r.kv = [2]kvPair{pair(), pair()}
		r.sumOut, r.sumIn, r.sumStep = pair(), pair(), pair()
		r.partTQ, r.partLseHS = b.New(ft, chunk, q), b.New(ft, heads, chunk)
		r.dkOneTK, r.dvOneTK = b.New(ft, 2*chunk, kd), b.New(ft, 2*chunk, kd)
		sc.ring = r
		return nil
	}
	if r := sc.ring; r.kv[0].k.Len() != rows*kd || r.partTQ.Len() != chunk*q || r.partLseHS.Len() != heads*chunk || r.kv[0].k.DType() != ft {
		return fmt.Errorf("attention: the shared scratch is for ring layers of %d rows of chunks of %d, %d and %d columns; this layer has %d rows of chunks of %d, %d and %d columns",
			r.kv[0].k.Shape()[0], r.partTQ.Shape()[0], r.partTQ.Shape()[1], r.kv[0].k.Shape()[1], rows, chunk, q, kd)
	}
	return nil
}

func newRing(c *ContextCore, sc *Scratch) (*ring, error) {
	dh := c.s.HeadDim()
	if err := sc.fitRing(c.b, c.localRows(), c.chunk, c.s.Heads, c.s.Heads*dh, c.s.KVHeads*dh); err != nil {
		return nil, err
	}
	return &ring{c: c, ringScratch: sc.ring}, nil
}

// forward writes aTQ and lseBHS from the local, rotated q, k and v.
func (rg *ring) forward(aTQ, lseBHS, qTQ, kTK, vTK backend.Tensor) error {
	c := rg.c
	cur, next := kvPair{kTK, vTK}, rg.kv[0]
	for s := range c.w {
		var inFlight chan error
		if s < c.w-1 {
			inFlight = rg.start([]backend.Tensor{next.k, next.v}, []backend.Tensor{cur.k, cur.v})
		}
		rg.forwardStep(s, cur, aTQ, lseBHS, qTQ)
		if inFlight != nil {
			if err := <-inFlight; err != nil {
				return c.fail(fmt.Sprintf("ring step %d: passing k and v", s), err)
			}
		}
		// The caller's k and v are sent at step 0 but never written.
		if s == 0 {
			cur, next = next, rg.kv[1]
		} else {
			cur, next = next, cur
		}
	}
	return nil
}

// forwardStep computes ring step s's blocks on held, the pair of rank
// (rank - s) mod W, into the running output and lse.
func (rg *ring) forwardStep(s int, held kvPair, aTQ, lseBHS, qTQ backend.Tensor) {
	c, b := rg.c, rg.c.b
	j := (c.rank - s + c.w) % c.w
	for _, cc := range c.queryChunks() {
		late := cc.n%2 == 1
		keys := rg.blockKeys(s, j, late)
		if keys == 0 {
			continue
		}
		k, v := rg.pairRows(held.k, cc.bi, keys), rg.pairRows(held.v, cc.bi, keys)
		q, a, lse := c.qRows(qTQ, cc), c.qRows(aTQ, cc), c.lseRows(lseBHS, cc)
		shape := rg.blockShape(s, keys)
		if s == 0 {
			b.AttentionForward(a, lse, q, k, v, shape)
			continue
		}
		part, partLse := rg.partTQ, b.View(rg.partLseHS, 0, 1, c.s.Heads, c.chunk)
		b.AttentionForward(part, partLse, q, k, v, shape)
		b.AttentionMerge(a, lse, part, partLse, shape)
	}
}

// blockKeys is the number of the held pair's key rows (from its first)
// that a query chunk (the late one, or the early one) sees at ring step s,
// holding rank j's pair; 0 when it sees none. See the file comment.
func (rg *ring) blockKeys(s, j int, late bool) int {
	c := rg.c
	switch {
	case s == 0 && late:
		return 2 * c.chunk // chunk r whole, chunk L causally
	case s == 0, j < c.rank:
		return c.chunk // chunk r causally (s = 0), or chunk j whole
	case late: // j > r
		return 2 * c.chunk
	}
	return 0 // the early chunk and j > r: both of j's chunks lie after it
}

// blockShape is the attention call of one query chunk against keys rows
// of a pair at ring step s: causal on the diagonal (step 0), unmasked
// after it.
func (rg *ring) blockShape(s, keys int) backend.AttnShape {
	c := rg.c
	shape := backend.AttnShape{Batch: 1, Seq: c.chunk, Heads: c.s.Heads, KVHeads: c.s.KVHeads, HeadDim: c.s.HeadDim(), KVSeq: keys}
	if s == 0 {
		shape.QOffset = keys - c.chunk
	} else {
		shape.Full = true
	}
	return shape
}

// pairRows is the view of the first keys rows of sequence bi's pair in t
// ([B*2C, KD]).
func (rg *ring) pairRows(t backend.Tensor, bi, keys int) backend.Tensor {
	c, kd := rg.c, rg.c.s.KVHeads*rg.c.s.HeadDim()
	return c.b.View(t, bi*2*c.chunk*kd, keys, kd)
}

// backward writes dqTQ, dkTK and dvTK (this rank's rows) from daTQ.
func (rg *ring) backward(dqTQ, dkTK, dvTK, daTQ backend.Tensor) error {
	c, b := rg.c, rg.c.b
	cur, next := kvPair{c.kTK, c.vTK}, rg.kv[0]
	for s := range c.w {
		var send, recv []backend.Tensor
		if s < c.w-1 {
			send, recv = append(send, cur.k, cur.v), append(recv, next.k, next.v)
		}
		if s > 0 {
			send, recv = append(send, rg.sumOut.k, rg.sumOut.v), append(recv, rg.sumIn.k, rg.sumIn.v)
		}
		var inFlight chan error
		if len(send) > 0 {
			inFlight = rg.start(recv, send)
		}
		rg.backwardStep(s, cur, dqTQ, daTQ)
		if inFlight != nil {
			if err := <-inFlight; err != nil {
				return c.fail(fmt.Sprintf("ring step %d: passing k, v and their gradients", s), err)
			}
		}
		if s > 0 {
			b.Axpy(rg.sumStep.k, 1, rg.sumIn.k)
			b.Axpy(rg.sumStep.v, 1, rg.sumIn.v)
		}
		// This step's sums go out next; the ones sent are free.
		rg.sumOut, rg.sumStep = rg.sumStep, rg.sumOut
		if s == 0 {
			cur, next = next, rg.kv[1]
		} else {
			cur, next = next, cur
		}
	}
	// The sums now held are complete: those of rank r+1's chunks.
	if err := rg.exchange([]backend.Tensor{dkTK, dvTK}, []backend.Tensor{rg.sumOut.k, rg.sumOut.v}); err != nil {
		return c.fail("ring: returning dk and dv to their owner", err)
	}
	return nil
}

// backwardStep adds ring step s's blocks' dq into dqTQ (step 0 writes
// it) and writes their dk, dv for held's rows into sumStep.
func (rg *ring) backwardStep(s int, held kvPair, dqTQ, daTQ backend.Tensor) {
	c, b := rg.c, rg.c.b
	j := (c.rank - s + c.w) % c.w
	b.Zero(rg.sumStep.k)
	b.Zero(rg.sumStep.v)
	kd := c.s.KVHeads * c.s.HeadDim()
	for _, cc := range c.queryChunks() {
		keys := rg.blockKeys(s, j, cc.n%2 == 1)
		if keys == 0 {
			continue
		}
		k, v := rg.pairRows(held.k, cc.bi, keys), rg.pairRows(held.v, cc.bi, keys)
		q, a, lse := c.qRows(c.qTQ, cc), c.qRows(c.aTQ, cc), c.lseRows(c.lseBHS, cc)
		dq, da := c.qRows(dqTQ, cc), c.qRows(daTQ, cc)
		dk, dv := b.View(rg.dkOneTK, 0, keys, kd), b.View(rg.dvOneTK, 0, keys, kd)
		if s == 0 {
			b.AttentionBackward(dq, dk, dv, da, q, k, v, a, lse, rg.blockShape(s, keys))
		} else {
			b.AttentionBackward(rg.partTQ, dk, dv, da, q, k, v, a, lse, rg.blockShape(s, keys))
			b.Axpy(dq, 1, rg.partTQ)
		}
		b.Axpy(rg.pairRows(rg.sumStep.k, cc.bi, keys), 1, dk)
		b.Axpy(rg.pairRows(rg.sumStep.v, cc.bi, keys), 1, dv)
	}
}

// start runs exchange(recv, send) on a goroutine and returns the channel
// that receives its result.
func (rg *ring) start(recv, send []backend.Tensor) chan error {
	done := make(chan error, 1)
	go func() { done <- rg.exchange(recv, send) }()
	return done
}

// exchange sends each send[i] to rank r+1 and receives each recv[i] from
// rank r-1, in order: even ranks send first, odd ranks receive first (see
// the file comment).
func (rg *ring) exchange(recv, send []backend.Tensor) error {
	c := rg.c
	to, from := (c.rank+1)%c.w, (c.rank+c.w-1)%c.w
	for i := range send {
		steps := []func() error{
			func() error { return c.g.Send(send[i], to) },
			func() error { return c.g.Recv(recv[i], from) },
		}
		if c.rank%2 == 1 {
			steps[0], steps[1] = steps[1], steps[0]
		}
		for _, step := range steps {
			if err := step(); err != nil {
				return err
			}
		}
	}
	return nil
}
