package engine

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
)

// placeRanks decides where the ranks of one process train and builds their
// groups. On the CUDA backend that the engine opened itself, a layout of W
// > 1 ranks takes one GPU per rank when at least W GPUs are visible
// (CUDA_VISIBLE_DEVICES applies): rank r on GPU r, its groups NCCL
// communicators (cuda.NCCLRanks). Otherwise every rank is a virtual rank
// on the engine's one backend, with in-process groups (comm.NewLocal). The
// returned backends are the ranks' (nil for virtual ranks), and release
// closes what placeRanks opened. A run spread over several processes
// places its ranks with placeOnNodeGPUs (CUDA) or comm.NewTCPRanks
// (distributed.go).
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
// Under model.moe.dispatcher fused the groups also offer peer access
// (cuda.NCCLOptions.PeerAccess): the fused MoE kernels then read and write
// the peers' rows over NVLink. auto does not ask for it: its measured
// table is of virtual ranks on one GPU, which says nothing about the
// links between GPUs, so auto stays unfused there.
func (e *Engine) placeOnGPUs(mesh comm.Mesh, gpu0 *cuda.Backend) ([]*comm.Ranks, []backend.Backend, func() error, error) {
	n := mesh.World()
	gpus, backends, closeGPUs, err := e.openGPUs(n, gpu0)
	if err != nil {
		return nil, nil, nil, err
	}
	opts := cuda.NCCLOptions{PeerAccess: e.cfg.Model.MoE.Dispatcher == moe.DispatcherFused}
	world, closeGroups, err := cuda.NCCLRanks(mesh, gpus, opts)
	if err != nil {
		err = fmt.Errorf("parallel: NCCL groups over %d GPUs: %w", n, err)
		if opts.PeerAccess {
			err = fmt.Errorf("%w (model.moe.dispatcher: fused needs peer access between the GPUs; unfused does not)", err)
		}
		return nil, nil, nil, errors.Join(err, closeGPUs())
	}
	e.log.Info().Msgf("parallel: %d ranks on %d GPUs, one each, NCCL between them (peer access: %v)", n, n, opts.PeerAccess)
	timeNCCL(world, backends)
	return world, backends, func() error { return errors.Join(closeGroups(), closeGPUs()) }, nil
}

// openGPUs opens GPUs 1..n-1 beside gpu0 (GPU 0, the engine's), for the n
// ranks this process trains, one each. backends are the ranks' backends as
// the engine wraps them; closeGPUs closes what openGPUs opened.
func (e *Engine) openGPUs(n int, gpu0 *cuda.Backend) (gpus []*cuda.Backend, backends []backend.Backend, closeGPUs func() error, err error) {
	if gpus, closeGPUs, err = cuda.OpenBackendsBeside(cuda.Options{}, gpu0, n); err != nil {
		return nil, nil, nil, fmt.Errorf("parallel: one rank per GPU: %w", err)
	}
	backends = make([]backend.Backend, n)
	backends[0] = e.backend // GPU 0, as the engine wrapped it
	for r := 1; r < n; r++ {
		backends[r] = gpus[r]
		if e.wrap != nil {
			backends[r] = e.wrap(gpus[r])
		}
	}
	return gpus, backends, closeGPUs, nil
}

// placeOnNodeGPUs places this node's share of a CUDA run spread over
// nnodes processes: the node hosts the block of world ranks first ..
// first+R-1 (cuda.NodeBlock), local rank i on GPU i, which takes R visible
// GPUs; virtual ranks cannot share an NCCL world with other processes. Its
// groups are NCCL communicators that span the nodes, made from the world's
// unique id (cuda.NCCLNodeRanks; ctx ending abandons the making).
func (e *Engine) placeOnNodeGPUs(ctx context.Context, gpu0 *cuda.Backend, node, nnodes int, id [cuda.NCCLUniqueIDBytes]byte) (world []*comm.Ranks, backends []backend.Backend, release func() error, err error) {
	mesh := e.cfg.mesh()
	first, per, err := cuda.NodeBlock(mesh, nnodes, node)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("node %d: %w", node, err)
	}
	visible, err := cuda.VisibleGPUs(cuda.Options{})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("node %d: counting the GPUs: %w", node, err)
	}
	if err := checkNodeGPUs(node, first, per, mesh.World(), visible, os.Getenv("CUDA_VISIBLE_DEVICES")); err != nil {
		return nil, nil, nil, err
	}
	gpus, backends, closeGPUs, err := e.openGPUs(per, gpu0)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("node %d: %w", node, err)
	}
	world, closeGroups, err := cuda.NCCLNodeRanks(ctx, cuda.NCCLNode{
		Mesh: mesh, NodeRank: node, NNodes: nnodes, Backends: gpus, ID: id,
	})
	if err != nil {
		return nil, nil, nil, errors.Join(err, closeGPUs())
	}
	e.log.Info().Msgf("parallel: node %d of %d trains %s of %d on %d GPUs, one each, NCCL between every rank",
		node, nnodes, worldRanks(first, per), mesh.World(), per)
	timeNCCL(world, backends)
	return world, backends, func() error { return errors.Join(closeGroups(), closeGPUs()) }, nil
}

// timeNCCL has the profiler of each rank's backend, where
// WithBackendWrapper put one, time that rank's NCCL collectives
// (comm_timing.go).
func timeNCCL(world []*comm.Ranks, backends []backend.Backend) {
	for r, rk := range world {
		if t, ok := backends[r].(collectiveTimer); ok {
			timeCollectives(rk, t)
		}
	}
}

// checkNodeGPUs is the error when a node sees fewer GPUs than it hosts
// ranks.
func checkNodeGPUs(node, first, per, worldSize, visible int, cudaVisible string) error {
	if visible >= per {
		return nil
	}
	sees := fmt.Sprintf("sees %d", visible)
	if cudaVisible != "" {
		sees += fmt.Sprintf(" (CUDA_VISIBLE_DEVICES=%s)", cudaVisible)
	}
	needs := fmt.Sprintf("%d GPUs, one per rank", per)
	if per == 1 {
		needs = "1 GPU"
	}
	return fmt.Errorf("node %d hosts %s of %d and needs %s, but %s: a multi-node CUDA run trains one rank per GPU; give every node as many GPUs as parallel.dp*ep*cp*tp / nnodes, or launch more nodes",
		node, worldRanks(first, per), worldSize, needs, sees)
}

// worldRanks is "world rank 3" or "world ranks 2-3".
func worldRanks(first, n int) string {
	if n == 1 {
		return fmt.Sprintf("world rank %d", first)
	}
	return fmt.Sprintf("world ranks %d-%d", first, first+n-1)
}
