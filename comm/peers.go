package comm

// Peer access: a rank reaching its peers' tensors directly. The MoE layer's
// fused dispatcher uses it to read the token rows its experts need from the
// source ranks' tensors and to write the experts' outputs straight into the
// source ranks' buffers, with no all-to-all in between.

import (
	"fmt"
	"time"

	"github.com/mktrain/mktrain/backend"
)

// PeerAccess is the optional interface of a Group whose ranks can address
// each other's tensors with the backend's ops: the in-process groups of
// NewLocal (one backend holds every rank's tensors), and the NCCL groups of
// one process with peer access between their GPUs (cuda.NCCLPeerGroup).
// Groups across processes (NCCL across nodes, TCP) do not offer it yet.
type PeerAccess interface {
	// PeerTensors is a collective: every rank of the group passes the same
	// number of tensors, and each gets back every rank's, indexed
	// [group rank][i] (its own included). Like every collective it is a
	// meeting: the backend ops a rank issued before the call come before
	// those any peer issues after it. It orders nothing afterwards: a rank
	// that writes a peer's tensor, or reads one a peer writes, must meet
	// the peers again (Barrier) before the owner uses it.
	PeerTensors(ts ...backend.Tensor) ([][]backend.Tensor, error)
}

// PeerTensors deposits ts and returns every member's, after checking that
// all ranks passed the same number. Each rank gets its own copies of the
// slices (the tensors are shared, of course). A nil tensor is an argument error that
// fails every rank.
func (g *localGroup) PeerTensors(ts ...backend.Tensor) ([][]backend.Tensor, error) {
	return exchangeTensors(g.hub, g.rank, ts, 0)
}

// exchangeTensors is PeerTensors' meeting on h: it deposits ts as rank's
// and returns every member's, [rank][i]. With within > 0 a member that has
// not arrived by then aborts the group (see hub.gatherWithin).
func exchangeTensors(h *hub, rank int, ts []backend.Tensor, within time.Duration) ([][]backend.Tensor, error) {
	const op = "PeerTensors"
	var argErr error
	for i, t := range ts {
		if t == nil {
			argErr = fmt.Errorf("tensor %d is nil", i)
			break
		}
	}
	all, err := h.gatherWithin(rank, deposit{op: op, err: argErr, val: append([]backend.Tensor(nil), ts...)}, within)
	if err != nil {
		return nil, err
	}
	// Every rank compares with rank 0, so all reach the same verdict.
	out := make([][]backend.Tensor, len(all))
	for j, d := range all {
		out[j] = append([]backend.Tensor(nil), d.val.([]backend.Tensor)...)
		if n0 := len(all[0].val.([]backend.Tensor)); len(out[j]) != n0 {
			return nil, fmt.Errorf("comm: %s group %s: rank %d passes %d tensors, rank 0 passes %d",
				h.name, op, j, len(out[j]), n0)
		}
	}
	return out, nil
}

// Exchange is the host half of PeerTensors for groups whose members are
// goroutines of one process but whose collectives are not the in-process
// ones: the NCCL groups of one process with one GPU per rank
// (cuda.NCCLOptions.PeerAccess). The members hand each other their
// tensors here; the group itself adds the meeting that orders the ranks'
// device work (its Barrier), and makes the tensors reachable (peer
// access between the GPUs).
type Exchange struct {
	hub    *hub
	within time.Duration
}

// NewExchange returns the exchange of a group of size members named name.
// A member that waits longer than within (0: no limit) for the others
// fails, and aborts the exchange for every member.
func NewExchange(name string, size int, within time.Duration) (*Exchange, error) {
	if size < 1 {
		return nil, fmt.Errorf("comm: NewExchange: a group of %d members", size)
	}
	return &Exchange{hub: newHub(name, size), within: within}, nil
}

// Tensors is PeerTensors for member rank: it deposits ts and returns every
// member's, [rank][i], once all have arrived. Every member passes the same
// number of tensors; a nil tensor or a different count fails every member.
func (x *Exchange) Tensors(rank int, ts []backend.Tensor) ([][]backend.Tensor, error) {
	if rank < 0 || rank >= x.hub.size {
		return nil, fmt.Errorf("comm: %s exchange: rank %d of a group of %d", x.hub.name, rank, x.hub.size)
	}
	return exchangeTensors(x.hub, rank, ts, x.within)
}

// Abort fails every waiting and later Tensors call with err.
func (x *Exchange) Abort(err error) { x.hub.abort(err) }

var _ PeerAccess = (*localGroup)(nil)
