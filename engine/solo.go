package engine

// A communicator for a run of one rank on a backend whose tensors the
// in-process communicator (comm.NewLocal) cannot read, such as the CUDA
// backend's device tensors. With one rank every collective is the identity;
// AllToAllRows is a copy on the backend, so nothing leaves the device.

import (
	"fmt"
	"slices"
	"sync"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
)

// soloWorld returns the world of one rank r with every group replaced by a
// group of one that runs on b.
func soloWorld(b backend.Backend, r *comm.Ranks) []*comm.Ranks {
	g := &soloGroup{b: b}
	return []*comm.Ranks{{Mesh: r.Mesh, Coord: r.Coord, Rank: r.Rank, World: g, Data: g, Expert: g, ExpertReplica: g}}
}

// soloGroup is a group of one rank.
type soloGroup struct {
	b backend.Backend

	mu  sync.Mutex
	err error // set by Abort
}

var _ comm.Group = (*soloGroup)(nil)

func (g *soloGroup) Rank() int { return 0 }
func (g *soloGroup) Size() int { return 1 }

func (g *soloGroup) aborted() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.err
}

func (g *soloGroup) Abort(err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.err == nil {
		g.err = err
	}
}

func (g *soloGroup) Barrier() error                        { return g.aborted() }
func (g *soloGroup) AllReduceSum(t backend.Tensor) error   { return g.aborted() }
func (g *soloGroup) AllReduceFloat64(vals []float64) error { return g.aborted() }

func (g *soloGroup) AllToAllInts(send []int) ([]int, error) {
	if err := g.aborted(); err != nil {
		return nil, err
	}
	if len(send) != 1 {
		return nil, fmt.Errorf("comm: AllToAllInts in a group of 1 with %d values", len(send))
	}
	return slices.Clone(send), nil
}

// AllToAllRows copies the sendCounts[0] rows of send to the start of recv.
func (g *soloGroup) AllToAllRows(recv, send backend.Tensor, recvCounts, sendCounts []int) error {
	if err := g.aborted(); err != nil {
		return err
	}
	rs, ss := recv.Shape(), send.Shape()
	switch {
	case len(rs) != 2 || len(ss) != 2 || rs[1] != ss[1]:
		return fmt.Errorf("comm: AllToAllRows: recv %v and send %v must be 2-D with the same row length", rs, ss)
	case len(recvCounts) != 1 || len(sendCounts) != 1 || recvCounts[0] != sendCounts[0]:
		return fmt.Errorf("comm: AllToAllRows in a group of 1: recv counts %v, send counts %v", recvCounts, sendCounts)
	case sendCounts[0] < 0 || sendCounts[0] > ss[0] || sendCounts[0] > rs[0]:
		return fmt.Errorf("comm: AllToAllRows: %d rows between send %v and recv %v", sendCounts[0], ss, rs)
	}
	if n := sendCounts[0] * ss[1]; n > 0 {
		g.b.Copy(g.b.View(recv, 0, n), g.b.View(send, 0, n))
	}
	return nil
}
