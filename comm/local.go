package comm

// The in-process communicator: virtual ranks are goroutines of one process,
// and each group is a hub where the members meet. The ranks' tensors live
// on one backend (the host for the CPU backend, one GPU for the CUDA
// backend), so a rank can read a peer's tensor directly: data moves with the
// backend's own ops (Copy, Axpy on views), never through the host, and on a
// GPU the collectives are device-to-device copies and kernels queued on its
// stream.
//
// Every collective is built from one primitive, hub.gather: each rank
// deposits a value for the current round and blocks until all members have
// deposited; then every member sees the whole round's values. Rounds are
// fresh objects, so a fast rank that enters the next collective never
// disturbs a slow one still reading the last round.
//
// # Ordering of the data
//
// A meeting orders the ranks' backend ops: every op a rank issued before it
// deposits comes before every op a peer issues after the meeting. On the CPU
// ops run when called; on the CUDA backend they are queued, from whichever
// goroutine, on the device's one stream in the order they were issued, so
// the order of issue is the order of execution. The collectives rely on
// nothing else: a rank reads a peer's buffer only between two meetings in
// which that peer does not write it (see AllReduceSum and AllToAllRows).
//
// Reductions are computed in rank order, element by element: rank 0's value
// plus rank 1's plus ..., so every rank ends with bitwise the same sum and
// replicated weights never drift apart. AllReduceSum splits the elements
// into one contiguous chunk per rank, each reduced by one rank, so the work
// is spread rather than repeated.
//
// Send and Recv do not use the hub's rounds: each ordered pair of ranks has
// a mailbox, an unbuffered channel on which the sender hands its tensor to
// the receiver, which copies it and then releases the sender (see Send).
//
// Argument errors are found by all ranks together: every rank deposits a
// description of its arguments (or its local error) and all ranks check all
// of them, so a bad call fails with the same error everywhere instead of
// leaving the well-behaved ranks waiting.

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/mktrain/mktrain/backend"
)

// NewLocal builds the in-process ranks of mesh on b: one *Ranks per world
// rank, indexed by world rank, with groups cut as described in mesh.go.
// Every tensor handed to the groups must be one of b's. AllReduceSum sums
// and ReduceScatterSum sum tensors of b's float type (b.FloatType());
// AllGather, AllToAllRows and Send/Recv move any dtype b holds (Int32
// included). A rank's groups must be called from one
// goroutine at a time, as every rank calls its collectives in order anyway.
func NewLocal(mesh Mesh, b backend.Backend) ([]*Ranks, error) {
	if err := mesh.Validate(); err != nil {
		return nil, err
	}
	if b == nil {
		return nil, errors.New("comm: NewLocal needs the backend that holds the ranks' tensors, got nil")
	}
	// One hub per group, its members' handles in group-rank order.
	return NewRanks(mesh, func(k GroupKind, members []int) ([]Group, error) {
		h := newHub(k.String(), len(members))
		gs := make([]Group, len(members))
		for i := range members {
			gs[i] = &localGroup{hub: h, rank: i, b: b}
		}
		return gs, nil
	})
}

// hub is where the members of one group meet.
type hub struct {
	name string
	size int

	mu      sync.Mutex
	cur     *round
	boxes   map[[2]int]chan *p2pMessage // keyed by (src, dst), made on first use
	err     error                       // set once by the first Abort
	aborted chan struct{}               // closed by the first Abort
}

// round is one collective's meeting: the values deposited so far, and a
// channel closed when the last member arrives.
type round struct {
	vals    []deposit
	arrived int
	full    chan struct{}
}

// missing lists the ranks that have not deposited in r (mu is the hub's
// lock, which guards the round's values).
func (r *round) missing(mu *sync.Mutex) []int {
	mu.Lock()
	defer mu.Unlock()
	var m []int
	for j, v := range r.vals {
		if v.op == "" {
			m = append(m, j)
		}
	}
	return m
}

// deposit is what one rank brings to a round: the collective it is in (so
// mismatched call orders are caught), its local argument error if any, and
// its payload.
type deposit struct {
	op  string
	err error
	val any
}

func newHub(name string, size int) *hub {
	return &hub{name: name, size: size, cur: newRound(size), aborted: make(chan struct{})}
}

func newRound(size int) *round {
	return &round{vals: make([]deposit, size), full: make(chan struct{})}
}

// gather deposits d as rank's value for the current round, waits for every
// member and returns all values, indexed by group rank. It fails if the group
// is aborted, if any rank deposited an error, or if the ranks are not all in
// the same collective.
func (h *hub) gather(rank int, d deposit) ([]deposit, error) {
	return h.gatherWithin(rank, d, 0)
}

// gatherWithin is gather with a bound on the wait: with within > 0, a rank
// that has waited that long aborts the group with an error that names the
// ranks that never arrived, so every member fails instead of hanging.
func (h *hub) gatherWithin(rank int, d deposit, within time.Duration) ([]deposit, error) {
	h.mu.Lock()
	if h.err != nil {
		h.mu.Unlock()
		return nil, h.abortErr()
	}
	r := h.cur
	r.vals[rank] = d
	r.arrived++
	if r.arrived == h.size {
		h.cur = newRound(h.size)
		close(r.full)
	}
	h.mu.Unlock()

	var late <-chan time.Time
	if within > 0 {
		t := time.NewTimer(within)
		defer t.Stop()
		late = t.C
	}
	select {
	case <-r.full:
	case <-h.aborted:
		return nil, h.abortErr()
	case <-late:
		select {
		case <-r.full: // the last member came as the timer fired
		default:
			h.abort(fmt.Errorf("%s: rank %d waited %v for ranks %v, which never arrived", d.op, rank, within, r.missing(&h.mu)))
			return nil, h.abortErr()
		}
	}
	for j, v := range r.vals {
		if v.op != d.op {
			return nil, fmt.Errorf("comm: %s group: rank %d called %s while rank %d called %s; every rank must call the same collectives in the same order",
				h.name, rank, d.op, j, v.op)
		}
	}
	for j, v := range r.vals {
		if v.err != nil {
			return nil, fmt.Errorf("comm: %s group %s, rank %d: %w", h.name, d.op, j, v.err)
		}
	}
	return r.vals, nil
}

func (h *hub) abort(err error) {
	if err == nil {
		err = errors.New("aborted without a reason")
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.err == nil {
		h.err = err
		close(h.aborted)
	}
}

func (h *hub) abortErr() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return fmt.Errorf("comm: %s group aborted: %w", h.name, h.err)
}

// localGroup is one rank's handle on a hub.
type localGroup struct {
	hub  *hub
	rank int
	b    backend.Backend

	// scratch holds this rank's reduced chunk during AllReduceSum, one
	// tensor per dtype, grown to the largest chunk seen.
	scratch map[backend.DType]backend.Tensor
}

func (g *localGroup) Rank() int       { return g.rank }
func (g *localGroup) Size() int       { return g.hub.size }
func (g *localGroup) Abort(err error) { g.hub.abort(err) }

func (g *localGroup) Barrier() error {
	_, err := g.hub.gather(g.rank, deposit{op: "Barrier"})
	return err
}

func (g *localGroup) AllReduceFloat64(vals []float64) error {
	all, err := g.hub.gather(g.rank, deposit{op: "AllReduceFloat64", val: append([]float64(nil), vals...)})
	if err != nil {
		return err
	}
	n0 := len(all[0].val.([]float64))
	for j, d := range all {
		if n := len(d.val.([]float64)); n != n0 {
			return fmt.Errorf("comm: %s group AllReduceFloat64: rank %d has %d values, rank 0 has %d", g.hub.name, j, n, n0)
		}
	}
	for i := range vals {
		s := all[0].val.([]float64)[i]
		for _, d := range all[1:] {
			s += d.val.([]float64)[i]
		}
		vals[i] = s
	}
	return nil
}

func (g *localGroup) AllToAllInts(send []int) ([]int, error) {
	var argErr error
	if len(send) != g.hub.size {
		argErr = fmt.Errorf("send has %d entries for a group of %d", len(send), g.hub.size)
	}
	all, err := g.hub.gather(g.rank, deposit{op: "AllToAllInts", err: argErr, val: append([]int(nil), send...)})
	if err != nil {
		return nil, err
	}
	recv := make([]int, len(all))
	for j, d := range all {
		recv[j] = d.val.([]int)[g.rank]
	}
	return recv, nil
}

// sumArgs is what a rank deposits for AllReduceSum.
type sumArgs struct {
	t  backend.Tensor
	dt backend.DType
	n  int
}

// AllReduceSum reduces in two meetings:
//
//  1. Every rank deposits its tensor. After the meeting, rank r sums, in
//     rank order, chunk r of every member's tensor into its own scratch
//     tensor (Copy from rank 0, then Axpy with alpha 1 from rank 1, 2, ...).
//  2. Every rank deposits its scratch. After the meeting, each rank copies
//     every member's scratch into the matching chunk of its own tensor.
//
// Why no rank reads a buffer while another writes it: in step 1 the
// tensors are only read and each scratch is written by its owner alone; a
// rank overwrites its tensor only in step 2, after the second meeting, which
// every peer reaches once its step-1 reads are issued. A scratch is read in
// step 2 and written next in step 1 of the group's next AllReduceSum, after
// that call's first meeting, which every peer reaches only once it has
// finished (issued the reads of) this call. So one scratch per rank
// suffices, with no third meeting. Every rank copies the same scratch bits,
// so the results agree bitwise.
func (g *localGroup) AllReduceSum(t backend.Tensor) error {
	args, argErr := sumArgs{}, error(nil)
	switch {
	case t == nil:
		argErr = errors.New("the tensor is nil")
	case t.DType() != g.b.FloatType():
		argErr = fmt.Errorf("cannot sum a %v tensor on the %s backend, which computes in %v", t.DType(), g.b.Name(), g.b.FloatType())
	default:
		args = sumArgs{t: t, dt: t.DType(), n: t.Len()}
	}
	all, err := g.hub.gather(g.rank, deposit{op: "AllReduceSum", err: argErr, val: args})
	if err != nil {
		return err
	}
	a0 := all[0].val.(sumArgs)
	for j, d := range all {
		if a := d.val.(sumArgs); a.dt != a0.dt || a.n != a0.n {
			return fmt.Errorf("comm: %s group AllReduceSum: rank %d has %d elements of %v, rank 0 has %d of %v",
				g.hub.name, j, a.n, a.dt, a0.n, a0.dt)
		}
	}
	size, n := g.hub.size, args.n
	if size == 1 {
		return nil
	}
	chunk := func(r int) (lo, hi int) { return r * n / size, (r + 1) * n / size }

	lo, hi := chunk(g.rank)
	var mine backend.Tensor // this rank's reduced chunk; nil when empty
	if hi > lo {
		mine = g.scratchView(args.dt, hi-lo)
		g.b.Copy(mine, g.b.View(all[0].val.(sumArgs).t, lo, hi-lo))
		for _, d := range all[1:] {
			g.b.Axpy(mine, 1, g.b.View(d.val.(sumArgs).t, lo, hi-lo))
		}
	}
	chunks, err := g.hub.gather(g.rank, deposit{op: "AllReduceSum chunks", val: mine})
	if err != nil {
		return err
	}
	for j, c := range chunks {
		if lo, hi := chunk(j); hi > lo {
			g.b.Copy(g.b.View(t, lo, hi-lo), c.val.(backend.Tensor))
		}
	}
	return nil
}

// scratchView returns the first n elements of this rank's scratch tensor
// of dt, replacing it with a larger one when it is too small.
func (g *localGroup) scratchView(dt backend.DType, n int) backend.Tensor {
	s := g.scratch[dt]
	if s == nil || s.Len() < n {
		if g.scratch == nil {
			g.scratch = map[backend.DType]backend.Tensor{}
		}
		s = g.b.New(dt, n)
		g.scratch[dt] = s
	}
	return g.b.View(s, 0, n)
}

// rowsArgs is what a rank deposits for AllToAllRows.
type rowsArgs struct {
	send                   backend.Tensor
	dt                     backend.DType
	cols                   int
	sendCounts, recvCounts []int
}

// AllToAllRows: every rank deposits its send tensor and counts; after the
// meeting each rank copies, in source-rank order, the block every source
// addressed to it from the source's send tensor into its own recv tensor.
// A rank writes only its recv tensor and reads only send tensors; the
// closing meeting keeps every rank from overwriting its send tensor (which
// it may do as soon as it returns) before all peers have issued their reads
// of it.
func (g *localGroup) AllToAllRows(recv, send backend.Tensor, recvCounts, sendCounts []int) error {
	args := rowsArgs{send: send, sendCounts: append([]int(nil), sendCounts...), recvCounts: append([]int(nil), recvCounts...)}
	var argErr error
	args.cols, argErr = CheckRows(recv, send, recvCounts, sendCounts, g.hub.size)
	if argErr == nil {
		args.dt = send.DType()
	}
	all, err := g.hub.gather(g.rank, deposit{op: "AllToAllRows", err: argErr, val: args})
	if err != nil {
		return err
	}
	if err := g.checkRowsPlan(all); err != nil {
		return err
	}
	at := 0 // rows of recv filled so far
	for _, d := range all {
		a := d.val.(rowsArgs)
		from := 0
		for r := range g.rank {
			from += a.sendCounts[r]
		}
		if rows := a.sendCounts[g.rank]; rows > 0 {
			g.b.Copy(g.b.View(recv, at*a.cols, rows, a.cols), g.b.View(a.send, from*a.cols, rows, a.cols))
			at += rows
		}
	}
	_, err = g.hub.gather(g.rank, deposit{op: "AllToAllRows done"})
	return err
}

// CheckRows checks one rank's AllToAllRows arguments for a group of size
// ranks and returns the row length; every Group implementation words its
// errors the same way with it.
func CheckRows(recv, send backend.Tensor, recvCounts, sendCounts []int, size int) (int, error) {
	if recv == nil || send == nil {
		return 0, errors.New("recv or send is nil")
	}
	rs, ss := recv.Shape(), send.Shape()
	if len(rs) != 2 || len(ss) != 2 || rs[1] != ss[1] {
		return 0, fmt.Errorf("recv %v and send %v must be 2-D with the same row length", rs, ss)
	}
	if recv.DType() != send.DType() {
		return 0, fmt.Errorf("recv is %v but send is %v", recv.DType(), send.DType())
	}
	if len(recvCounts) != size || len(sendCounts) != size {
		return 0, fmt.Errorf("%d recv and %d send counts for a group of %d", len(recvCounts), len(sendCounts), size)
	}
	var nr, ns int
	for j := range size {
		if recvCounts[j] < 0 || sendCounts[j] < 0 {
			return 0, fmt.Errorf("negative count for rank %d (recv %d, send %d)", j, recvCounts[j], sendCounts[j])
		}
		nr += recvCounts[j]
		ns += sendCounts[j]
	}
	if nr != rs[0] || ns != ss[0] {
		return 0, fmt.Errorf("counts add up to %d recv and %d send rows, but the tensors have %d and %d", nr, ns, rs[0], ss[0])
	}
	return ss[1], nil
}

// checkRowsPlan checks that the ranks agree: what i sends to j is what j
// expects from i, and all rows have one length and dtype. Every rank runs it
// over the same deposits, so they all reach the same verdict.
func (g *localGroup) checkRowsPlan(all []deposit) error {
	a0 := all[0].val.(rowsArgs)
	for i, d := range all {
		a := d.val.(rowsArgs)
		if a.cols != a0.cols || a.dt != a0.dt {
			return fmt.Errorf("comm: %s group AllToAllRows: rank %d has rows of %d %v, rank 0 of %d %v",
				g.hub.name, i, a.cols, a.dt, a0.cols, a0.dt)
		}
		for j, b := range all {
			if sent, want := a.sendCounts[j], b.val.(rowsArgs).recvCounts[i]; sent != want {
				return fmt.Errorf("comm: %s group AllToAllRows: rank %d sends %d rows to rank %d, which expects %d",
					g.hub.name, i, sent, j, want)
			}
		}
	}
	return nil
}

var _ Group = (*localGroup)(nil)

// checkFloat checks a tensor that a reduction sums.
func (g *localGroup) checkFloat(name string, t backend.Tensor) error {
	switch {
	case t == nil:
		return fmt.Errorf("%s is nil", name)
	case t.DType() != g.b.FloatType():
		return fmt.Errorf("cannot sum a %v tensor (%s) on the %s backend, which computes in %v", t.DType(), name, g.b.Name(), g.b.FloatType())
	}
	return nil
}

// blockArgs is what a rank deposits for ReduceScatterSum and AllGather: its
// send tensor, the dtype, and the block length (the length of one rank's
// share).
type blockArgs struct {
	send backend.Tensor
	dt   backend.DType
	n    int
}

// checkBlocks checks that every rank has the same block length and dtype.
// Every rank runs it over the same deposits, so they all reach the same
// verdict.
func (g *localGroup) checkBlocks(op string, all []deposit) error {
	a0 := all[0].val.(blockArgs)
	for j, d := range all {
		if a := d.val.(blockArgs); a.dt != a0.dt || a.n != a0.n {
			return fmt.Errorf("comm: %s group %s: rank %d has blocks of %d elements of %v, rank 0 of %d of %v",
				g.hub.name, op, j, a.n, a.dt, a0.n, a0.dt)
		}
	}
	return nil
}

// ReduceScatterSum reduces in two meetings:
//
//  1. Every rank deposits its send tensor. After the meeting, rank r sums,
//     in rank order, block r of every member's send into its scratch
//     (Copy from rank 0, then Axpy with alpha 1 from rank 1, 2, ...).
//  2. A closing meeting, which every peer reaches once its reads of the
//     send tensors are issued; then rank r copies its scratch into recv.
//
// Summing into the scratch rather than into recv lets recv be a block of
// the rank's own send (in place): recv is written only after the closing
// meeting, when no peer reads send any more. The scratch is the one
// AllReduceSum uses; peers read it only in AllReduceSum's second step, which
// they have finished issuing before they reach this call's first meeting.
// Every rank adds the same bits in the same order, so a block's sum is the
// same whichever rank computes it.
func (g *localGroup) ReduceScatterSum(recv, send backend.Tensor) error {
	const op = "ReduceScatterSum"
	args, argErr := blockArgs{}, g.checkFloat("recv", recv)
	if argErr == nil {
		argErr = g.checkFloat("send", send)
	}
	if argErr == nil {
		if send.DType() != recv.DType() || send.Len() != recv.Len()*g.hub.size {
			argErr = fmt.Errorf("send has %d elements of %v but must hold %d (the group size %d times recv's %d) of %v",
				send.Len(), send.DType(), recv.Len()*g.hub.size, g.hub.size, recv.Len(), recv.DType())
		} else {
			args = blockArgs{send: send, dt: send.DType(), n: recv.Len()}
		}
	}
	all, err := g.hub.gather(g.rank, deposit{op: op, err: argErr, val: args})
	if err != nil {
		return err
	}
	if err := g.checkBlocks(op, all); err != nil {
		return err
	}
	n := args.n
	if n == 0 {
		return nil // every rank has n == 0, so every rank returns here
	}
	mine := g.scratchView(args.dt, n)
	lo := g.rank * n
	g.b.Copy(mine, g.b.View(all[0].val.(blockArgs).send, lo, n))
	for _, d := range all[1:] {
		g.b.Axpy(mine, 1, g.b.View(d.val.(blockArgs).send, lo, n))
	}
	if _, err := g.hub.gather(g.rank, deposit{op: op + " done"}); err != nil {
		return err
	}
	g.b.Copy(recv, mine)
	return nil
}

// AllGather: each rank first copies its own send into its block of recv,
// then deposits send; after the meeting it copies every peer's send into
// the peer's block of its recv. A closing meeting keeps every rank from
// overwriting its send (which it may do as soon as it returns) before all
// peers have issued their reads of it.
//
// The own block is copied before the meeting so that, when send is that
// very block of recv (in place), the rank never writes it while peers read
// it: after the meeting the rank writes only the peers' blocks, which are
// not its send. (The copy is then of a tensor onto itself, which must leave
// it unchanged.)
func (g *localGroup) AllGather(recv, send backend.Tensor) error {
	const op = "AllGather"
	var args blockArgs
	var argErr error
	switch {
	case recv == nil || send == nil:
		argErr = errors.New("recv or send is nil")
	case recv.DType() != send.DType() || recv.Len() != send.Len()*g.hub.size:
		argErr = fmt.Errorf("recv has %d elements of %v but must hold %d (the group size %d times send's %d) of %v",
			recv.Len(), recv.DType(), send.Len()*g.hub.size, g.hub.size, send.Len(), send.DType())
	default:
		args = blockArgs{send: send, dt: send.DType(), n: send.Len()}
		if args.n > 0 {
			g.b.Copy(g.b.View(recv, g.rank*args.n, args.n), send)
		}
	}
	all, err := g.hub.gather(g.rank, deposit{op: op, err: argErr, val: args})
	if err != nil {
		return err
	}
	if err := g.checkBlocks(op, all); err != nil {
		return err
	}
	n := args.n
	if n == 0 || g.hub.size == 1 {
		return nil // every rank agrees on n and size, so all return here
	}
	for j, d := range all {
		if j != g.rank {
			g.b.Copy(g.b.View(recv, j*n, n), d.val.(blockArgs).send)
		}
	}
	_, err = g.hub.gather(g.rank, deposit{op: op + " done"})
	return err
}

// p2pMessage is one Send waiting in a mailbox: the sender's tensor (nil when
// the sender passed nil, so the receiver fails too) and the channel on which
// the receiver reports the outcome to the sender.
type p2pMessage struct {
	t    backend.Tensor
	done chan error
}

// box returns the mailbox from src to dst.
func (h *hub) box(src, dst int) chan *p2pMessage {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.boxes == nil {
		h.boxes = map[[2]int]chan *p2pMessage{}
	}
	key := [2]int{src, dst}
	b, ok := h.boxes[key]
	if !ok {
		b = make(chan *p2pMessage)
		h.boxes[key] = b
	}
	return b
}

// checkPeer checks the peer rank of a Send or Recv. Send to oneself would
// wait forever for a Recv that the same goroutine cannot make.
func (g *localGroup) checkPeer(op string, peer int) error {
	if peer < 0 || peer >= g.hub.size || peer == g.rank {
		return fmt.Errorf("comm: %s group %s on rank %d: peer rank %d is not another rank of this group of %d",
			g.hub.name, op, g.rank, peer, g.hub.size)
	}
	return nil
}

// Send hands t to dst's matching Recv over their mailbox and waits for the
// receiver's verdict. Once the receiver has taken the message it always
// answers, after its copy is issued, so the sender waits for that answer
// even if the group is aborted meanwhile: t is never read after Send
// returns. Until then, an Abort releases the sender. Each rank sends from
// one goroutine at a time, so messages between a pair arrive in call order.
func (g *localGroup) Send(t backend.Tensor, dst int) error {
	if err := g.checkPeer("Send", dst); err != nil {
		return err
	}
	h := g.hub
	if isClosed(h.aborted) {
		return h.abortErr()
	}
	m := &p2pMessage{t: t, done: make(chan error, 1)}
	select {
	case h.box(g.rank, dst) <- m:
	case <-h.aborted:
		return h.abortErr()
	}
	return <-m.done
}

// Recv takes the next message from src, checks that it fits t, copies it
// and releases the sender with the same verdict it returns.
func (g *localGroup) Recv(t backend.Tensor, src int) error {
	if err := g.checkPeer("Recv", src); err != nil {
		return err
	}
	h := g.hub
	if isClosed(h.aborted) {
		return h.abortErr()
	}
	var m *p2pMessage
	select {
	case m = <-h.box(src, g.rank):
	case <-h.aborted:
		return h.abortErr()
	}
	var err error
	switch {
	case m.t == nil:
		err = fmt.Errorf("comm: %s group Send from rank %d to rank %d: the sent tensor is nil", h.name, src, g.rank)
	case t == nil:
		err = fmt.Errorf("comm: %s group Send from rank %d to rank %d: the receive buffer is nil", h.name, src, g.rank)
	case m.t.DType() != t.DType() || m.t.Len() != t.Len():
		err = fmt.Errorf("comm: %s group Send from rank %d to rank %d: sent %d elements of %v, but the receive buffer holds %d of %v",
			h.name, src, g.rank, m.t.Len(), m.t.DType(), t.Len(), t.DType())
	case t.Len() > 0:
		g.b.Copy(t, m.t)
	}
	m.done <- err
	return err
}

// isClosed reports whether ch is closed, without blocking.
func isClosed(ch chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
