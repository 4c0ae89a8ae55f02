package comm

// Peer access: a rank reaching its peers' tensors directly. The MoE layer's
// fused dispatcher uses it to read the token rows its experts need from the
// source ranks' tensors and to write the experts' outputs straight into the
// source ranks' buffers, with no all-to-all in between.

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
)

// PeerAccess is the optional interface of a Group whose ranks can address
// each other's tensors with the backend's ops: the in-process groups of
// NewLocal (one backend holds every rank's tensors). The NCCL and TCP groups
// do not offer it yet.
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
	const op = "PeerTensors"
	var argErr error
	for i, t := range ts {
		if t == nil {
			argErr = fmt.Errorf("tensor %d is nil", i)
			break
		}
	}
	all, err := g.hub.gather(g.rank, deposit{op: op, err: argErr, val: append([]backend.Tensor(nil), ts...)})
	if err != nil {
		return nil, err
	}
	// Every rank compares with rank 0, so all reach the same verdict.
	out := make([][]backend.Tensor, len(all))
	for j, d := range all {
		out[j] = append([]backend.Tensor(nil), d.val.([]backend.Tensor)...)
		if n0 := len(all[0].val.([]backend.Tensor)); len(out[j]) != n0 {
			return nil, fmt.Errorf("comm: %s group %s: rank %d passes %d tensors, rank 0 passes %d",
				g.hub.name, op, j, len(out[j]), n0)
		}
	}
	return out, nil
}

var _ PeerAccess = (*localGroup)(nil)
