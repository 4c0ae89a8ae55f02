package engine

import (
	"errors"
	"fmt"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda"
	"github.com/mktrain/mktrain/comm"
)

// placeRanks decides where the ranks of one process train and builds their
// groups. On the CUDA backend that the engine opened itself, a layout of W
// > 1 ranks takes one GPU per rank when at least W GPUs are visible
// (CUDA_VISIBLE_DEVICES applies): rank r on GPU r, its groups NCCL
// communicators (cuda.NCCLRanks). Otherwise every rank is a virtual rank
// on the engine's one backend, with in-process groups (comm.NewLocal). The
// returned backends are the ranks' (nil for virtual ranks), and release
// closes what placeRanks opened.
func (e *Engine) placeRanks() (world []*comm.Ranks, backends []backend.Backend, release func() error, err error) {
	mesh := e.cfg.mesh()
	none := func() error { return nil }
	gpu0, ok := e.closer.(*cuda.Backend)
	if n := mesh.World(); ok && n > 1 {
		visible, err := cuda.VisibleGPUs(cuda.Options{})
		if err != nil {
			return nil, nil, nil, fmt.Errorf("counting the GPUs: %w", err)
		}
		if visible >= n {
			return e.placeOnGPUs(mesh, gpu0)
		}
		e.log.Info().Msgf("parallel: %d ranks as virtual ranks on GPU 0 (%d GPUs visible; one rank per GPU needs %d)", n, visible, n)
	}
	// Every rank allocates its own tensors on the one backend; the
	// in-process communicator moves data between them with backend ops.
	world, err = comm.NewLocal(mesh, e.backend)
	return world, nil, none, err
}

// placeOnGPUs opens GPUs 1..W-1 beside gpu0 (GPU 0, the engine's), one
// rank each, and cuts the mesh's groups as NCCL communicators over them.
func (e *Engine) placeOnGPUs(mesh comm.Mesh, gpu0 *cuda.Backend) ([]*comm.Ranks, []backend.Backend, func() error, error) {
	n := mesh.World()
	gpus := []*cuda.Backend{gpu0}
	closeGPUs := func() error {
		var errs []error
		for _, b := range gpus[1:] {
			errs = append(errs, b.Close())
		}
		return errors.Join(errs...)
	}
	for r := 1; r < n; r++ {
		b, err := cuda.OpenBackendOn(cuda.Options{}, r)
		if err != nil {
			return nil, nil, nil, errors.Join(fmt.Errorf("rank %d: opening GPU %d: %w", r, r, err), closeGPUs())
		}
		gpus = append(gpus, b)
	}
	world, closeGroups, err := cuda.NCCLRanks(mesh, gpus, cuda.NCCLOptions{})
	if err != nil {
		return nil, nil, nil, errors.Join(fmt.Errorf("parallel: NCCL groups over %d GPUs: %w", n, err), closeGPUs())
	}
	backends := make([]backend.Backend, n)
	backends[0] = e.backend // GPU 0, as the engine wrapped it
	for r := 1; r < n; r++ {
		backends[r] = gpus[r]
		if e.wrap != nil {
			backends[r] = e.wrap(gpus[r])
		}
	}
	e.log.Info().Msgf("parallel: %d ranks on %d GPUs, one each, NCCL between them", n, n)
	return world, backends, func() error { return errors.Join(closeGroups(), closeGPUs()) }, nil
}
