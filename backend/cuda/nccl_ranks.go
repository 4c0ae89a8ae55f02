package cuda

import (
	"errors"
	"fmt"
	"sync"

	"github.com/mktrain/mktrain/comm"
)

// NCCLRanks cuts mesh's groups (comm.NewRanks) as NCCL communicators over
// the GPUs of one process: backends[r] is world rank r's, each on its own
// GPU. Every group is its own communicator (NewNCCLGroups over its
// members' backends), named by its kind in errors. closeAll closes them
// all; call it once the ranks are done. On an error the communicators
// made so far are closed.
func NCCLRanks(mesh comm.Mesh, backends []*Backend, opts NCCLOptions) (ranks []*comm.Ranks, closeAll func() error, err error) {
	if err := mesh.Validate(); err != nil {
		return nil, nil, err
	}
	if len(backends) != mesh.World() {
		return nil, nil, fmt.Errorf("cuda: NCCLRanks: %d backends for a mesh of %d ranks", len(backends), mesh.World())
	}
	var made []*NCCLGroup
	// The members of a communicator close together (each on its own
	// device thread), as a communicator's teardown may wait for its peers.
	closeAll = func() error {
		errs := make([]error, len(made))
		var wg sync.WaitGroup
		for i, g := range made {
			wg.Go(func() { errs[i] = g.Close() })
		}
		wg.Wait()
		return errors.Join(errs...)
	}
	ranks, err = comm.NewRanks(mesh, func(k comm.GroupKind, members []int) ([]comm.Group, error) {
		bs := make([]*Backend, len(members))
		for i, r := range members {
			bs[i] = backends[r]
		}
		o := opts
		o.Name = k.String()
		gs, err := NewNCCLGroups(bs, o)
		if err != nil {
			return nil, err
		}
		out := make([]comm.Group, len(gs))
		for i, g := range gs {
			made = append(made, g)
			out[i] = g
			if o.PeerAccess {
				out[i] = NCCLPeerGroup{g}
			}
		}
		return out, nil
	})
	if err != nil {
		return nil, nil, errors.Join(err, closeAll())
	}
	return ranks, closeAll, nil
}
