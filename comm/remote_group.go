package comm

// The collectives of the multi-process groups (NewTCPRanks), on top of a
// node's links (world.go).
//
// Tensors travel as host bytes: the sender downloads them (Backend.Download)
// and the receiver uploads them (Backend.Upload). The collectives that
// combine data meet at the group's rank 0, the root: every other rank sends
// it its arguments and data, the root checks them all (the same operation,
// the same lengths, no rank's argument error), computes, and answers every
// rank with its result or with the one error all ranks return. Reductions
// are computed by the root in rank order with the backend's own ops (Copy
// from rank 0, then Axpy with alpha 1 from rank 1, 2, ...), exactly the
// order of the in-process implementation, so a layout split over processes
// gives bitwise the sums it gives as virtual ranks, and every rank gets the
// root's bits. AllToAllRows checks the plan at the root, then each rank
// sends its blocks straight to their destinations. Send and Recv go
// straight from one rank to the other; the receiver acknowledges with its
// verdict, so Send returns once the transfer is done, as the in-process
// Send does.
//
// The root does the whole group's work and carries all its traffic: simple
// and correct, made for the CPU backend and for tests of the multi-process
// paths; the GPU path uses NCCL's rings instead.
//
// AllReduceSumStart (comm.AsyncReducer) runs an AllReduceSum on a goroutine
// of its own, behind the reductions the rank started before it on the
// group, so that a rank's gradient buckets travel while it computes the
// rest of its backward.
//
// A message's payload is its meta's length (4 bytes, big-endian), the meta
// as JSON (msgMeta) and the data.

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"

	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/backend"
)

// buildRanks cuts this node's ranks' groups from the mesh (Mesh.Members).
// A group's id is its kind in the top byte and its lowest world rank in
// the rest, so every node numbers the groups alike.
func (w *TCPWorld) buildRanks() []*Ranks {
	m := w.cfg.Mesh
	group := func(k GroupKind, self int) *remoteGroup {
		members, place := m.Members(k, self)
		return &remoteGroup{
			w: w, b: w.cfg.Backend, name: k.String(),
			id:      uint32(k)<<24 | uint32(slices.Min(members)),
			members: members, rank: place, self: self,
		}
	}
	out := make([]*Ranks, w.perNode)
	for i := range out {
		r := w.cfg.NodeRank*w.perNode + i
		out[i] = &Ranks{
			Mesh: m, Coord: m.Coord(r), Rank: r,
			World: group(GroupWorld, r), Data: group(GroupData, r), Expert: group(GroupExpert, r),
			ExpertReplica: group(GroupExpertReplica, r), Context: group(GroupContext, r), DataContext: group(GroupDataContext, r),
			Tensor: group(GroupTensor, r),
		}
	}
	return out
}

// remoteGroup is one rank's handle on a group of a TCP world.
type remoteGroup struct {
	w       *TCPWorld
	b       backend.Backend
	name    string
	id      uint32
	members []int // world ranks, by group rank
	rank    int   // this rank's group rank
	self    int   // this rank's world rank

	// scratch holds the root's sums, and what it uploads before adding,
	// per dtype, grown to the largest seen.
	scratch [2]map[backend.DType]backend.Tensor

	// lastStart is closed when the last reduction AllReduceSumStart
	// started is done; nil before the first. Touched only by the rank's
	// goroutine.
	lastStart chan struct{}
}

var (
	_ Group        = (*remoteGroup)(nil)
	_ AsyncReducer = (*remoteGroup)(nil)
)

func (g *remoteGroup) Rank() int       { return g.rank }
func (g *remoteGroup) Size() int       { return len(g.members) }
func (g *remoteGroup) Abort(err error) { g.w.Abort(err) }

func (g *remoteGroup) keyTo(peer int, class byte) msgKey {
	return msgKey{group: g.id, src: uint32(g.self), dst: uint32(g.members[peer]), class: class}
}

func (g *remoteGroup) keyFrom(peer int, class byte) msgKey {
	return msgKey{group: g.id, src: uint32(g.members[peer]), dst: uint32(g.self), class: class}
}

// wrap names the group, the operation and the rank on an error of the
// transport.
func (g *remoteGroup) wrap(op string, err error) error {
	return fmt.Errorf("comm: %s group %s on rank %d: %w", g.name, op, g.self, err)
}

// msgMeta is a message's description: the operation, the sender's argument
// error, and the arguments the root checks.
type msgMeta struct {
	Op     string        `json:"op"`
	Err    string        `json:"err,omitempty"`
	DT     backend.DType `json:"dt,omitempty"`
	N      int           `json:"n,omitempty"`
	Counts []int         `json:"counts,omitempty"`
	Recv   []int         `json:"recv,omitempty"`
}

// A message's payload: the meta's length (4 bytes), the meta as JSON, the
// data.
func encodeMsg(m msgMeta, data []byte) []byte {
	js, _ := json.Marshal(m) // plain fields: cannot fail
	p := make([]byte, 4, 4+len(js)+len(data))
	binary.BigEndian.PutUint32(p, uint32(len(js)))
	return append(append(p, js...), data...)
}

func decodeMsg(p []byte) (msgMeta, []byte, error) {
	var m msgMeta
	if len(p) < 4 {
		return m, nil, errors.New("malformed message: too short")
	}
	n := int(binary.BigEndian.Uint32(p))
	if n > len(p)-4 {
		return m, nil, errors.New("malformed message: bad meta length")
	}
	if err := json.Unmarshal(p[4:4+n], &m); err != nil {
		return m, nil, fmt.Errorf("malformed message: %w", err)
	}
	return m, p[4+n:], nil
}

// meet is the root's round trip: every rank brings its meta and data to the
// group's rank 0, which checks that all called op without an argument
// error, runs combine over everything (indexed by group rank) and answers
// each rank with its reply, or every rank with combine's error. It returns
// this rank's reply.
func (g *remoteGroup) meet(m msgMeta, data []byte, combine func(metas []msgMeta, datas [][]byte) ([][]byte, error)) ([]byte, error) {
	op := m.Op
	if g.rank != 0 {
		if err := g.w.send(g.keyTo(0, classColl), encodeMsg(m, data)); err != nil {
			return nil, g.wrap(op, err)
		}
		p, err := g.w.recv(g.keyFrom(0, classColl))
		if err != nil {
			return nil, g.wrap(op, err)
		}
		reply, out, err := decodeMsg(p)
		if err != nil {
			return nil, g.wrap(op, err)
		}
		if reply.Err != "" {
			return nil, errors.New(reply.Err)
		}
		return out, nil
	}
	size := len(g.members)
	metas, datas := make([]msgMeta, size), make([][]byte, size)
	metas[0], datas[0] = m, data
	for j := 1; j < size; j++ {
		p, err := g.w.recv(g.keyFrom(j, classColl))
		if err != nil {
			return nil, g.wrap(op, err)
		}
		if metas[j], datas[j], err = decodeMsg(p); err != nil {
			return nil, g.wrap(op, err)
		}
	}
	replies, err := g.verdict(metas, datas, combine)
	for j := 1; j < size; j++ {
		rm := msgMeta{Op: op}
		var rd []byte
		if err != nil {
			rm.Err = err.Error()
		} else {
			rd = replies[j]
		}
		if serr := g.w.send(g.keyTo(j, classColl), encodeMsg(rm, rd)); serr != nil && err == nil {
			err = g.wrap(op, serr)
		}
	}
	if err != nil {
		return nil, err
	}
	return replies[0], nil
}

func (g *remoteGroup) verdict(metas []msgMeta, datas [][]byte, combine func([]msgMeta, [][]byte) ([][]byte, error)) ([][]byte, error) {
	op := metas[0].Op
	for j, m := range metas {
		if m.Op != op {
			return nil, fmt.Errorf("comm: %s group: rank %d called %s while rank 0 called %s; every rank must call the same collectives in the same order",
				g.name, j, m.Op, op)
		}
	}
	for j, m := range metas {
		if m.Err != "" {
			return nil, fmt.Errorf("comm: %s group %s, rank %d: %s", g.name, op, j, m.Err)
		}
	}
	if combine == nil {
		return make([][]byte, len(metas)), nil
	}
	return combine(metas, datas)
}

// same replies every rank with p.
func same(size int, p []byte) [][]byte {
	out := make([][]byte, size)
	for i := range out {
		out[i] = p
	}
	return out
}

func (g *remoteGroup) Barrier() error {
	_, err := g.meet(msgMeta{Op: "Barrier"}, nil, nil)
	return err
}

func (g *remoteGroup) AllReduceFloat64(vals []float64) error {
	const op = "AllReduceFloat64"
	out, err := g.meet(msgMeta{Op: op, N: len(vals)}, float64Bytes(vals), func(metas []msgMeta, datas [][]byte) ([][]byte, error) {
		for j, m := range metas {
			if m.N != metas[0].N || len(datas[j]) != 8*m.N {
				return nil, fmt.Errorf("comm: %s group %s: rank %d has %d values, rank 0 has %d", g.name, op, j, m.N, metas[0].N)
			}
		}
		sum := bytesFloat64(datas[0])
		for _, d := range datas[1:] {
			for i, v := range bytesFloat64(d) {
				sum[i] += v
			}
		}
		return same(len(metas), float64Bytes(sum)), nil
	})
	if err != nil {
		return err
	}
	copy(vals, bytesFloat64(out))
	return nil
}

func (g *remoteGroup) AllToAllInts(send []int) ([]int, error) {
	const op = "AllToAllInts"
	size := len(g.members)
	m := msgMeta{Op: op, Counts: send}
	if len(send) != size {
		m.Err = fmt.Sprintf("send has %d entries for a group of %d", len(send), size)
	}
	out, err := g.meet(m, nil, func(metas []msgMeta, _ [][]byte) ([][]byte, error) {
		replies := make([][]byte, size)
		for j := range replies {
			col := make([]int, size)
			for i, mi := range metas {
				col[i] = mi.Counts[j]
			}
			replies[j], _ = json.Marshal(col)
		}
		return replies, nil
	})
	if err != nil {
		return nil, err
	}
	var recv []int
	if err := json.Unmarshal(out, &recv); err != nil {
		return nil, g.wrap(op, err)
	}
	return recv, nil
}

// checkFloat checks a tensor that a reduction sums.
func (g *remoteGroup) checkFloat(name string, t backend.Tensor) string {
	switch {
	case t == nil:
		return name + " is nil"
	case t.DType() != g.b.FloatType():
		return fmt.Sprintf("cannot sum a %v tensor (%s) on the %s backend, which computes in %v", t.DType(), name, g.b.Name(), g.b.FloatType())
	}
	return ""
}

// scratchView is the first n elements of scratch tensor i of dt.
func (g *remoteGroup) scratchView(i int, dt backend.DType, n int) backend.Tensor {
	s := g.scratch[i][dt]
	if s == nil || s.Len() < n {
		if g.scratch[i] == nil {
			g.scratch[i] = map[backend.DType]backend.Tensor{}
		}
		s = g.b.New(dt, n)
		g.scratch[i][dt] = s
	}
	return g.b.View(s, 0, n)
}

// sumAtRoot is the root's reduction: own (rank 0's tensor, on the
// backend) plus every other rank's data, in rank order, into a scratch
// tensor of n elements, which it returns.
func (g *remoteGroup) sumAtRoot(own backend.Tensor, datas [][]byte, dt backend.DType, n int) (backend.Tensor, error) {
	acc := g.scratchView(0, dt, n)
	g.b.Copy(acc, own)
	if len(datas) > 1 {
		tmp := g.scratchView(1, dt, n)
		for _, d := range datas[1:] {
			if err := uploadBytes(g.b, tmp, d); err != nil {
				return nil, err
			}
			g.b.Axpy(acc, 1, tmp)
		}
	}
	return acc, nil
}

func (g *remoteGroup) AllReduceSum(t backend.Tensor) error {
	const op = "AllReduceSum"
	m := msgMeta{Op: op}
	switch {
	case t == nil:
		m.Err = "the tensor is nil"
	case t.DType() != g.b.FloatType():
		m.Err = fmt.Sprintf("cannot sum a %v tensor on the %s backend, which computes in %v", t.DType(), g.b.Name(), g.b.FloatType())
	default:
		m.DT, m.N = t.DType(), t.Len()
	}
	var data []byte
	if m.Err == "" && g.rank != 0 && m.N > 0 {
		data = tensorBytes(g.b, t)
	}
	out, err := g.meet(m, data, func(metas []msgMeta, datas [][]byte) ([][]byte, error) {
		for j, a := range metas {
			if a.DT != m.DT || a.N != m.N {
				return nil, fmt.Errorf("comm: %s group %s: rank %d has %d elements of %v, rank 0 has %d of %v",
					g.name, op, j, a.N, a.DT, m.N, m.DT)
			}
		}
		if m.N == 0 || len(metas) == 1 {
			return make([][]byte, len(metas)), nil
		}
		acc, err := g.sumAtRoot(t, datas, m.DT, m.N)
		if err != nil {
			return nil, fmt.Errorf("comm: %s group %s: %w", g.name, op, err)
		}
		g.b.Copy(t, acc)
		return same(len(metas), tensorBytes(g.b, acc)), nil
	})
	if err != nil || g.rank == 0 || m.N == 0 {
		return err
	}
	return g.upload(op, t, out)
}

// AllReduceSumStart runs AllReduceSum(t) on a goroutine of its own, after
// the reductions started before it: the group's background queue, which
// keeps the group in use by one goroutine at a time as long as the rank
// calls no other collective of it before the last Wait (comm.AsyncReducer).
// The reduction never waits without a bound (see Failures), so neither does
// Wait.
func (g *remoteGroup) AllReduceSumStart(t backend.Tensor) (Pending, error) {
	if err := g.w.Err(); err != nil {
		return nil, g.wrap("AllReduceSum", err)
	}
	prev := g.lastStart
	p := &remotePending{done: make(chan struct{})}
	g.lastStart = p.done
	go func() {
		defer close(p.done)
		if prev != nil {
			<-prev
		}
		p.err = g.AllReduceSum(t)
	}()
	return p, nil
}

// remotePending is a reduction on a group's background queue.
type remotePending struct {
	done chan struct{}
	err  error // set before done is closed
}

func (p *remotePending) Wait() error {
	<-p.done
	return p.err
}

// upload fills t with a reply's data.
func (g *remoteGroup) upload(op string, t backend.Tensor, p []byte) error {
	if err := uploadBytes(g.b, t, p); err != nil {
		return g.wrap(op, err)
	}
	return nil
}

func (g *remoteGroup) ReduceScatterSum(recv, send backend.Tensor) error {
	const op = "ReduceScatterSum"
	size := len(g.members)
	m := msgMeta{Op: op, Err: g.checkFloat("recv", recv)}
	if m.Err == "" {
		m.Err = g.checkFloat("send", send)
	}
	if m.Err == "" {
		if send.DType() != recv.DType() || send.Len() != recv.Len()*size {
			m.Err = fmt.Sprintf("send has %d elements of %v but must hold %d (the group size %d times recv's %d) of %v",
				send.Len(), send.DType(), recv.Len()*size, size, recv.Len(), recv.DType())
		} else {
			m.DT, m.N = send.DType(), recv.Len()
		}
	}
	var data []byte
	if m.Err == "" && g.rank != 0 && m.N > 0 {
		data = tensorBytes(g.b, send)
	}
	out, err := g.meet(m, data, func(metas []msgMeta, datas [][]byte) ([][]byte, error) {
		if err := g.checkBlocks(op, metas); err != nil {
			return nil, err
		}
		n := m.N
		if n == 0 {
			return make([][]byte, size), nil
		}
		acc, err := g.sumAtRoot(send, datas, m.DT, size*n)
		if err != nil {
			return nil, fmt.Errorf("comm: %s group %s: %w", g.name, op, err)
		}
		replies := make([][]byte, size)
		for j := 1; j < size; j++ {
			replies[j] = tensorBytes(g.b, g.b.View(acc, j*n, n))
		}
		g.b.Copy(recv, g.b.View(acc, 0, n))
		return replies, nil
	})
	if err != nil || g.rank == 0 || m.N == 0 {
		return err
	}
	return g.upload(op, recv, out)
}

// checkBlocks checks that every rank has the same block length and dtype.
func (g *remoteGroup) checkBlocks(op string, metas []msgMeta) error {
	for j, a := range metas {
		if a.DT != metas[0].DT || a.N != metas[0].N {
			return fmt.Errorf("comm: %s group %s: rank %d has blocks of %d elements of %v, rank 0 of %d of %v",
				g.name, op, j, a.N, a.DT, metas[0].N, metas[0].DT)
		}
	}
	return nil
}

func (g *remoteGroup) AllGather(recv, send backend.Tensor) error {
	const op = "AllGather"
	size := len(g.members)
	m := msgMeta{Op: op}
	switch {
	case recv == nil || send == nil:
		m.Err = "recv or send is nil"
	case recv.DType() != send.DType() || recv.Len() != send.Len()*size:
		m.Err = fmt.Sprintf("recv has %d elements of %v but must hold %d (the group size %d times send's %d) of %v",
			recv.Len(), recv.DType(), send.Len()*size, size, send.Len(), send.DType())
	default:
		m.DT, m.N = send.DType(), send.Len()
	}
	var data []byte
	if m.Err == "" && m.N > 0 {
		data = tensorBytes(g.b, send)
	}
	out, err := g.meet(m, data, func(metas []msgMeta, datas [][]byte) ([][]byte, error) {
		if err := g.checkBlocks(op, metas); err != nil {
			return nil, err
		}
		var all []byte
		for _, d := range datas {
			all = append(all, d...)
		}
		return same(size, all), nil
	})
	if err != nil || m.N == 0 {
		return err
	}
	return g.upload(op, recv, out)
}

func (g *remoteGroup) AllToAllRows(recv, send backend.Tensor, recvCounts, sendCounts []int) error {
	const op = "AllToAllRows"
	size := len(g.members)
	m := msgMeta{Op: op, Counts: sendCounts, Recv: recvCounts}
	cols, argErr := CheckRows(recv, send, recvCounts, sendCounts, size)
	if argErr != nil {
		m.Err = argErr.Error()
	} else {
		m.DT, m.N = send.DType(), cols
	}
	// The root checks the plan (what i sends to j is what j expects from
	// i), so that a bad plan fails on every rank alike; then every rank
	// sends its blocks to their destinations and takes its own.
	if _, err := g.meet(m, nil, func(metas []msgMeta, _ [][]byte) ([][]byte, error) {
		for i, a := range metas {
			if a.N != metas[0].N || a.DT != metas[0].DT {
				return nil, fmt.Errorf("comm: %s group %s: rank %d has rows of %d %v, rank 0 of %d %v",
					g.name, op, i, a.N, a.DT, metas[0].N, metas[0].DT)
			}
			for j, b := range metas {
				if sent, want := a.Counts[j], b.Recv[i]; sent != want {
					return nil, fmt.Errorf("comm: %s group %s: rank %d sends %d rows to rank %d, which expects %d",
						g.name, op, i, sent, j, want)
				}
			}
		}
		return make([][]byte, size), nil
	}); err != nil {
		return err
	}
	offsets := func(counts []int) []int {
		off := make([]int, size+1)
		for j, c := range counts {
			off[j+1] = off[j] + c
		}
		return off
	}
	from, at := offsets(sendCounts), offsets(recvCounts)
	if from[size] > 0 {
		host := tensorBytes(g.b, send)
		es := len(host) / (from[size] * cols)
		for j := range size {
			if j == g.rank || sendCounts[j] == 0 {
				continue
			}
			if err := g.w.send(g.keyTo(j, classRows), host[from[j]*cols*es:from[j+1]*cols*es]); err != nil {
				return g.wrap(op, err)
			}
		}
	}
	if rows := sendCounts[g.rank]; rows > 0 {
		g.b.Copy(g.b.View(recv, at[g.rank]*cols, rows, cols), g.b.View(send, from[g.rank]*cols, rows, cols))
	}
	for i := range size {
		rows := recvCounts[i]
		if i == g.rank || rows == 0 {
			continue
		}
		p, err := g.w.recv(g.keyFrom(i, classRows))
		if err != nil {
			return g.wrap(op, err)
		}
		if err := g.upload(op, g.b.View(recv, at[i]*cols, rows, cols), p); err != nil {
			return err
		}
	}
	return nil
}

// checkPeer checks the peer rank of a Send or Recv.
func (g *remoteGroup) checkPeer(op string, peer int) error {
	if peer < 0 || peer >= len(g.members) || peer == g.rank {
		return fmt.Errorf("comm: %s group %s on rank %d: peer rank %d is not another rank of this group of %d",
			g.name, op, g.rank, peer, len(g.members))
	}
	return nil
}

// Send hands t to dst, whose Recv answers with its verdict; Send returns
// it, so both calls fail alike on a mismatch.
func (g *remoteGroup) Send(t backend.Tensor, dst int) error {
	const op = "Send"
	if err := g.checkPeer(op, dst); err != nil {
		return err
	}
	m := msgMeta{Op: op}
	var data []byte
	if t == nil {
		m.Err = "nil"
	} else {
		m.DT, m.N = t.DType(), t.Len()
		if m.N > 0 {
			data = tensorBytes(g.b, t)
		}
	}
	if err := g.w.send(g.keyTo(dst, classP2P), encodeMsg(m, data)); err != nil {
		return g.wrap(op, err)
	}
	p, err := g.w.recv(g.keyFrom(dst, classAck))
	if err != nil {
		return g.wrap(op, err)
	}
	ack, _, err := decodeMsg(p)
	if err != nil {
		return g.wrap(op, err)
	}
	if ack.Err != "" {
		return errors.New(ack.Err)
	}
	return nil
}

// Recv takes the next message from src, checks that it fits t, fills t and
// answers the sender with its verdict.
func (g *remoteGroup) Recv(t backend.Tensor, src int) error {
	const op = "Recv"
	if err := g.checkPeer(op, src); err != nil {
		return err
	}
	p, err := g.w.recv(g.keyFrom(src, classP2P))
	if err != nil {
		return g.wrap(op, err)
	}
	m, data, err := decodeMsg(p)
	if err == nil {
		prefix := fmt.Sprintf("comm: %s group Send from rank %d to rank %d", g.name, src, g.rank)
		switch {
		case m.Err != "":
			err = fmt.Errorf("%s: the sent tensor is nil", prefix)
		case t == nil:
			err = fmt.Errorf("%s: the receive buffer is nil", prefix)
		case m.DT != t.DType() || m.N != t.Len():
			err = fmt.Errorf("%s: sent %d elements of %v, but the receive buffer holds %d of %v", prefix, m.N, m.DT, t.Len(), t.DType())
		case m.N > 0:
			err = uploadBytes(g.b, t, data)
		}
	}
	ack := msgMeta{Op: "Ack"}
	if err != nil {
		ack.Err = err.Error()
	}
	if serr := g.w.send(g.keyTo(src, classAck), encodeMsg(ack, nil)); serr != nil && err == nil {
		err = g.wrap(op, serr)
	}
	return err
}

// ---- tensors as bytes --------------------------------------------------------

// tensorBytes downloads t as little-endian bytes of its host type (float32
// for BFloat16, which holds its values exactly).
func tensorBytes(b backend.Backend, t backend.Tensor) []byte {
	switch d := backend.HostData(b.Download(t)).(type) {
	case []float32:
		out := make([]byte, 4*len(d))
		for i, v := range d {
			binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(v))
		}
		return out
	case []float64:
		return float64Bytes(d)
	case []int32:
		out := make([]byte, 4*len(d))
		for i, v := range d {
			binary.LittleEndian.PutUint32(out[4*i:], uint32(v))
		}
		return out
	default:
		panic(fmt.Sprintf("comm: tcp: cannot move a %v tensor", t.DType()))
	}
}

// uploadBytes fills t with p, bytes as tensorBytes writes them.
func uploadBytes(b backend.Backend, t backend.Tensor, p []byte) error {
	n := t.Len()
	var host any
	switch t.DType() {
	case backend.Float32, backend.BFloat16:
		if len(p) != 4*n {
			break
		}
		h := make([]float32, n)
		for i := range h {
			h[i] = math.Float32frombits(binary.LittleEndian.Uint32(p[4*i:]))
		}
		host = h
	case backend.Float64:
		if len(p) != 8*n {
			break
		}
		host = bytesFloat64(p)
	case backend.Int32:
		if len(p) != 4*n {
			break
		}
		h := make([]int32, n)
		for i := range h {
			h[i] = int32(binary.LittleEndian.Uint32(p[4*i:]))
		}
		host = h
	}
	if host == nil {
		return fmt.Errorf("received %d bytes for a tensor of %d elements of %v", len(p), n, t.DType())
	}
	b.Upload(t, tensor.New(tensor.WithShape(n), tensor.WithBacking(host)))
	return nil
}

func float64Bytes(v []float64) []byte {
	out := make([]byte, 8*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint64(out[8*i:], math.Float64bits(x))
	}
	return out
}

func bytesFloat64(p []byte) []float64 {
	out := make([]float64, len(p)/8)
	for i := range out {
		out[i] = math.Float64frombits(binary.LittleEndian.Uint64(p[8*i:]))
	}
	return out
}
