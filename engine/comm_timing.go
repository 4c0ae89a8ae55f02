package engine

// Timing the collectives of the NCCL groups (one rank per GPU) in a
// profiled step. Those collectives queue their kernels on the rank's
// stream without going through the backend's ops, so a profiler under the
// engine sees their time only as a gap; wrapped here, each call is timed
// by the profiler's own clock as kind "communication" (profile.Collective),
// which is how `mktrain bench train` reports the share of a step spent in
// communication. The in-process groups of virtual ranks are not wrapped:
// their collectives are backend ops already (copies and adds), timed as
// such.

import (
	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
)

// collectiveTimer times a collective that bypasses the backend's ops
// (profile.Backend.Collective); the engine finds it on a rank's backend
// as wrapped by WithBackendWrapper.
type collectiveTimer interface {
	Collective(op string, fn func() error) error
}

// timeCollectives replaces every group of rk with one whose collectives t
// times.
func timeCollectives(rk *comm.Ranks, t collectiveTimer) {
	for _, g := range []*comm.Group{&rk.World, &rk.Data, &rk.Expert, &rk.ExpertReplica, &rk.Context, &rk.DataContext, &rk.Tensor} {
		*g = timedGroup(*g, t)
	}
}

// timedGroup wraps g, keeping the optional interfaces it offers
// (comm.PeerAccess, comm.AsyncReducer): the layers choose their paths by
// them.
func timedGroup(g comm.Group, t collectiveTimer) comm.Group {
	base := timed{g: g, t: t}
	pa, peer := g.(comm.PeerAccess)
	ar, async := g.(comm.AsyncReducer)
	switch {
	case peer && async:
		return timedPeerAsync{timedPeer{base, pa}, ar}
	case peer:
		return timedPeer{base, pa}
	case async:
		return timedAsync{base, ar}
	}
	return base
}

// timed is a comm.Group whose collectives t times, each as its method's
// name; Rank, Size and Abort are not collectives.
type timed struct {
	g comm.Group
	t collectiveTimer
}

func (w timed) Rank() int       { return w.g.Rank() }
func (w timed) Size() int       { return w.g.Size() }
func (w timed) Abort(err error) { w.g.Abort(err) }

func (w timed) AllReduceSum(t backend.Tensor) error {
	return w.t.Collective("AllReduceSum", func() error { return w.g.AllReduceSum(t) })
}

func (w timed) AllReduceFloat64(vals []float64) error {
	return w.t.Collective("AllReduceFloat64", func() error { return w.g.AllReduceFloat64(vals) })
}

func (w timed) AllToAllInts(send []int) (recv []int, err error) {
	err = w.t.Collective("AllToAllInts", func() error {
		recv, err = w.g.AllToAllInts(send)
		return err
	})
	return recv, err
}

func (w timed) AllToAllRows(recv, send backend.Tensor, recvCounts, sendCounts []int) error {
	return w.t.Collective("AllToAllRows", func() error { return w.g.AllToAllRows(recv, send, recvCounts, sendCounts) })
}

func (w timed) ReduceScatterSum(recv, send backend.Tensor) error {
	return w.t.Collective("ReduceScatterSum", func() error { return w.g.ReduceScatterSum(recv, send) })
}

func (w timed) AllGather(recv, send backend.Tensor) error {
	return w.t.Collective("AllGather", func() error { return w.g.AllGather(recv, send) })
}

func (w timed) Send(t backend.Tensor, dst int) error {
	return w.t.Collective("Send", func() error { return w.g.Send(t, dst) })
}

func (w timed) Recv(t backend.Tensor, src int) error {
	return w.t.Collective("Recv", func() error { return w.g.Recv(t, src) })
}

func (w timed) Barrier() error {
	return w.t.Collective("Barrier", func() error { return w.g.Barrier() })
}

// timedPeer adds a timed PeerTensors.
type timedPeer struct {
	timed
	pa comm.PeerAccess
}

func (w timedPeer) PeerTensors(ts ...backend.Tensor) (all [][]backend.Tensor, err error) {
	err = w.t.Collective("PeerTensors", func() error {
		all, err = w.pa.PeerTensors(ts...)
		return err
	})
	return all, err
}

// timedAsync adds AllReduceSumStart: the start is timed, and so is the
// wait of what it returns (the reduction itself runs beside the step's
// work, on a stream of its own, and is seen only where a wait stalls).
type timedAsync struct {
	timed
	ar comm.AsyncReducer
}

func (w timedAsync) AllReduceSumStart(t backend.Tensor) (comm.Pending, error) {
	return startTimed(w.t, w.ar, t)
}

// timedPeerAsync is both.
type timedPeerAsync struct {
	timedPeer
	ar comm.AsyncReducer
}

func (w timedPeerAsync) AllReduceSumStart(t backend.Tensor) (comm.Pending, error) {
	return startTimed(w.t, w.ar, t)
}

func startTimed(t collectiveTimer, ar comm.AsyncReducer, x backend.Tensor) (p comm.Pending, err error) {
	err = t.Collective("AllReduceSumStart", func() error {
		p, err = ar.AllReduceSumStart(x)
		return err
	})
	if err != nil {
		return nil, err
	}
	return timedPending{p: p, t: t}, nil
}

// timedPending times Wait.
type timedPending struct {
	p comm.Pending
	t collectiveTimer
}

func (w timedPending) Wait() error {
	return w.t.Collective("AllReduceSumWait", w.p.Wait)
}

var (
	_ comm.PeerAccess   = timedPeer{}
	_ comm.AsyncReducer = timedAsync{}
	_ comm.PeerAccess   = timedPeerAsync{}
	_ comm.AsyncReducer = timedPeerAsync{}
)
