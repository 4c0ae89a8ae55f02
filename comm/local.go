package comm

// The in-process communicator: virtual ranks are goroutines sharing memory,
// and each group is a hub where the members meet.
//
// Every collective is built from one primitive, hub.gather: each rank
// deposits a value for the current round and blocks until all members have
// deposited; then every member sees the whole round's values. Rounds are
// fresh objects, so a fast rank that enters the next collective never
// disturbs a slow one still reading the last round. A collective that must
// not let a rank move on while peers still read its buffers (AllToAllRows)
// ends with a second, empty gather.
//
// Reductions are computed in rank order, element by element: rank 0's value
// plus rank 1's plus ..., so every rank ends with bitwise the same sum and
// replicated weights never drift apart. AllReduceSum splits the elements
// into one contiguous chunk per rank, each reduced by one rank, so the work
// is spread rather than repeated.
//
// Argument errors are found by all ranks together: every rank deposits a
// description of its arguments (or its local error) and all ranks check all
// of them, so a bad call fails with the same error everywhere instead of
// leaving the well-behaved ranks waiting.

import (
	"errors"
	"fmt"
	"reflect"
	"sync"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
)

// NewLocal builds the in-process ranks of mesh: one *Ranks per world rank,
// indexed by world rank, with groups cut as described in mesh.go. The
// groups' tensors must be CPU tensors (Float32 or Float64; AllToAllRows
// also moves Int32 rows).
func NewLocal(mesh Mesh) ([]*Ranks, error) {
	if err := mesh.Validate(); err != nil {
		return nil, err
	}
	world := newHub("world", mesh.World())
	data := map[Coord]*hub{}    // keyed by cp, tp
	expert := map[Coord]*hub{}  // keyed by dp, cp, tp
	replica := map[Coord]*hub{} // keyed by ep, cp, tp
	find := func(m map[Coord]*hub, key Coord, name string, size int) *hub {
		if h, ok := m[key]; ok {
			return h
		}
		h := newHub(name, size)
		m[key] = h
		return h
	}
	ranks := make([]*Ranks, mesh.World())
	for r := range ranks {
		c := mesh.Coord(r)
		ranks[r] = &Ranks{
			Mesh: mesh, Coord: c, Rank: r,
			World:         &localGroup{hub: world, rank: r},
			Data:          &localGroup{hub: find(data, Coord{CP: c.CP, TP: c.TP}, "data", mesh.DP*mesh.EP), rank: c.DP*mesh.EP + c.EP},
			Expert:        &localGroup{hub: find(expert, Coord{DP: c.DP, CP: c.CP, TP: c.TP}, "expert", mesh.EP), rank: c.EP},
			ExpertReplica: &localGroup{hub: find(replica, Coord{EP: c.EP, CP: c.CP, TP: c.TP}, "expert-replica", mesh.DP), rank: c.DP},
		}
	}
	return ranks, nil
}

// hub is where the members of one group meet.
type hub struct {
	name string
	size int

	mu      sync.Mutex
	cur     *round
	err     error         // set once by the first Abort
	aborted chan struct{} // closed by the first Abort
}

// round is one collective's meeting: the values deposited so far, and a
// channel closed when the last member arrives.
type round struct {
	vals    []deposit
	arrived int
	full    chan struct{}
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

	select {
	case <-r.full:
	case <-h.aborted:
		return nil, h.abortErr()
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
	for j, d := range all {
		if n := len(d.val.([]float64)); n != len(vals) {
			return fmt.Errorf("comm: %s group AllReduceFloat64: rank %d has %d values, rank %d has %d", g.hub.name, j, n, g.rank, len(vals))
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

// AllReduceSum: deposit the tensor, reduce this rank's chunk of every
// member's tensor in rank order, deposit the chunk, copy every chunk back.
// The second gather also guarantees that nobody still reads the inputs when
// they are overwritten.
func (g *localGroup) AllReduceSum(t backend.Tensor) error {
	data, argErr := hostSlice(t, false)
	all, err := g.hub.gather(g.rank, deposit{op: "AllReduceSum", err: argErr, val: data})
	if err != nil {
		return err
	}
	n := sliceLen(data)
	for j, d := range all {
		if reflect.TypeOf(d.val) != reflect.TypeOf(data) || sliceLen(d.val) != n {
			return fmt.Errorf("comm: %s group AllReduceSum: rank %d has %d elements of %T, rank %d has %d of %T",
				g.hub.name, j, sliceLen(d.val), d.val, g.rank, n, data)
		}
	}
	lo, hi := g.rank*n/g.hub.size, (g.rank+1)*n/g.hub.size
	var chunk any
	switch data.(type) {
	case []float32:
		chunk = reduceChunk[float32](all, lo, hi)
	case []float64:
		chunk = reduceChunk[float64](all, lo, hi)
	}
	chunks, err := g.hub.gather(g.rank, deposit{op: "AllReduceSum chunks", val: chunk})
	if err != nil {
		return err
	}
	switch dst := data.(type) {
	case []float32:
		copyChunks(dst, chunks, g.hub.size)
	case []float64:
		copyChunks(dst, chunks, g.hub.size)
	}
	return nil
}

func reduceChunk[T float32 | float64](all []deposit, lo, hi int) []T {
	out := append([]T(nil), all[0].val.([]T)[lo:hi]...)
	for _, d := range all[1:] {
		src := d.val.([]T)[lo:hi]
		for i := range out {
			out[i] += src[i]
		}
	}
	return out
}

func copyChunks[T float32 | float64](dst []T, chunks []deposit, size int) {
	n := len(dst)
	for j, c := range chunks {
		copy(dst[j*n/size:(j+1)*n/size], c.val.([]T))
	}
}

// rowsArgs is what a rank deposits for AllToAllRows.
type rowsArgs struct {
	send                   any // []float32, []float64 or []int32
	cols                   int
	sendCounts, recvCounts []int
}

func (g *localGroup) AllToAllRows(recv, send backend.Tensor, recvCounts, sendCounts []int) error {
	recvData, argErr := hostSlice(recv, true)
	sendData, sendErr := hostSlice(send, true)
	args := rowsArgs{send: sendData, sendCounts: append([]int(nil), sendCounts...), recvCounts: append([]int(nil), recvCounts...)}
	if argErr == nil {
		argErr = sendErr
	}
	if argErr == nil {
		args.cols, argErr = checkRows(recv, send, recvCounts, sendCounts, g.hub.size)
	}
	all, err := g.hub.gather(g.rank, deposit{op: "AllToAllRows", err: argErr, val: args})
	if err != nil {
		return err
	}
	if err := g.checkRowsPlan(all, sendData); err != nil {
		return err
	}
	switch dst := recvData.(type) {
	case []float32:
		copyRows(dst, all, g.rank)
	case []float64:
		copyRows(dst, all, g.rank)
	case []int32:
		copyRows(dst, all, g.rank)
	}
	_, err = g.hub.gather(g.rank, deposit{op: "AllToAllRows done"})
	return err
}

// checkRows checks one rank's AllToAllRows arguments and returns the row
// length.
func checkRows(recv, send backend.Tensor, recvCounts, sendCounts []int, size int) (int, error) {
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
func (g *localGroup) checkRowsPlan(all []deposit, sendData any) error {
	a0 := all[0].val.(rowsArgs)
	for i, d := range all {
		a := d.val.(rowsArgs)
		if a.cols != a0.cols || reflect.TypeOf(a.send) != reflect.TypeOf(a0.send) {
			return fmt.Errorf("comm: %s group AllToAllRows: rank %d has rows of %d %T, rank 0 of %d %T",
				g.hub.name, i, a.cols, a.send, a0.cols, a0.send)
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

// copyRows copies into dst, in source-rank order, the block each source
// addressed to rank me.
func copyRows[T float32 | float64 | int32](dst []T, all []deposit, me int) {
	at := 0
	for _, d := range all {
		a := d.val.(rowsArgs)
		from := 0
		for r := range me {
			from += a.sendCounts[r]
		}
		n := a.sendCounts[me] * a.cols
		at += copy(dst[at:at+n], a.send.([]T)[from*a.cols:from*a.cols+n])
	}
}

// hostSlice returns a CPU tensor's backing slice. Int32 is allowed only
// where rows are moved, never summed.
func hostSlice(t backend.Tensor, allowInt bool) (any, error) {
	ct, ok := t.(*cpu.Tensor)
	if !ok {
		return nil, fmt.Errorf("the in-process communicator needs CPU tensors, got %T", t)
	}
	switch ct.DType() {
	case backend.Float32:
		return ct.Float32s(), nil
	case backend.Float64:
		return ct.Float64s(), nil
	case backend.Int32:
		if allowInt {
			return ct.Int32s(), nil
		}
	}
	return nil, fmt.Errorf("cannot reduce %v tensors", ct.DType())
}

func sliceLen(s any) int {
	switch v := s.(type) {
	case []float32:
		return len(v)
	case []float64:
		return len(v)
	case []int32:
		return len(v)
	}
	return 0
}

var _ Group = (*localGroup)(nil)
