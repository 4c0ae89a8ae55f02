package engine

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/mktrain/mktrain/attention"
	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/registry"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
	"github.com/mktrain/mktrain/tune"
)

// placeRanks decides where the ranks of one process train and builds their
// groups. On a backend the engine opened itself from a driver that places
// one rank per device (registry.RankPerDevice: the CUDA backend), a layout
// of W > 1 ranks takes one device per rank when at least W are visible
// (CUDA_VISIBLE_DEVICES applies): rank r on GPU r, its groups the driver's
// (NCCL communicators). Otherwise every rank is a virtual rank on the
// engine's one backend, with in-process groups (comm.NewLocal). The
// returned backends are the ranks' (nil for virtual ranks), and release
// closes what placeRanks opened. A run spread over several processes
// places its ranks with placeOnNodeDevices (a registry.MultiProcess
// driver) or comm.NewTCPRanks (distributed.go).
func (e *Engine) placeRanks() (world []*comm.Ranks, backends []backend.Backend, release func() error, err error) {
	mesh := e.cfg.mesh()
	none := func() error { return nil }
	placer, ok := e.driver.(registry.RankPerDevice)
	if n := mesh.World(); ok && e.device != nil && n > 1 {
		dev := placer.Capabilities().Device
		visible, err := placer.Devices()
		if err != nil {
			return nil, nil, nil, fmt.Errorf("counting the %ss: %w", dev, err)
		}
		if visible >= n {
			return e.placeOnDevices(mesh, placer)
		}
		e.log.Info().Msgf("parallel: %d ranks as virtual ranks on %s 0 (%d %ss visible; one rank per %s needs %d)", n, dev, visible, dev, dev, n)
	}
	// Every rank allocates its own tensors on the one backend; the
	// in-process communicator moves data between them with backend ops.
	world, err = comm.NewLocal(mesh, e.backend)
	return world, nil, none, err
}

// placeOnDevices opens devices 1..W-1 beside the engine's (device 0), one
// rank each, and cuts the mesh's groups over them with the driver's
// collectives (NCCL). Under model.moe.dispatcher fused the groups also
// offer peer access (registry.MeshOptions.PeerAccess), where the driver
// has it: the fused MoE kernels then read and write the peers' rows over
// NVLink. auto does not ask for it: its measured table is of virtual ranks
// on one GPU, which says nothing about the links between GPUs, so auto
// stays unfused there. parallel.cp_attention: ring asks for it too, for
// the fused ring attention (attention/ring_fused.go), which reads the
// peers' keys and queries over NVLink; the portable ring serves where the
// driver has no peer access. So does parallel.tp_overlap: fused with tp
// above 1, for tensorpar's fused ops (auto stays unfused there, as the
// dispatcher does); without peer access they run the collectives.
func (e *Engine) placeOnDevices(mesh comm.Mesh, placer registry.RankPerDevice) ([]*comm.Ranks, []backend.Backend, func() error, error) {
	n := mesh.World()
	caps := placer.Capabilities()
	devices, backends, closeDevices, err := e.openDevices(placer, n)
	if err != nil {
		return nil, nil, nil, err
	}
	ring := e.cfg.Parallel.CP > 1 && e.cfg.Parallel.CPAttention == string(attention.CPRing)
	tpFused := e.cfg.Parallel.TP > 1 && e.cfg.Parallel.TPOverlap == tune.TPOverlapFused
	opts := registry.MeshOptions{PeerAccess: caps.PeerAccess && (e.cfg.Model.MoE.Dispatcher == moe.DispatcherFused || ring || tpFused)}
	world, closeGroups, err := placer.MeshRanks(mesh, devices, opts)
	if err != nil {
		err = fmt.Errorf("parallel: %s groups over %d %ss: %w", caps.Collectives, n, caps.Device, err)
		if opts.PeerAccess {
			err = fmt.Errorf("%w (model.moe.dispatcher: fused, parallel.cp_attention: ring and parallel.tp_overlap: fused ask for peer access between the %ss; unfused and allgather do not)", err, caps.Device)
		}
		return nil, nil, nil, errors.Join(err, closeDevices())
	}
	e.log.Info().Msgf("parallel: %d ranks on %d %ss, one each, %s between them (peer access: %v)", n, n, caps.Device, caps.Collectives, opts.PeerAccess)
	timeNCCL(world, backends)
	return world, backends, func() error { return errors.Join(closeGroups(), closeDevices()) }, nil
}

// openDevices opens devices 1..n-1 beside the engine's (device 0), for the
// n ranks this process trains, one each. backends are the ranks' backends
// as the engine wraps them; closeDevices closes what openDevices opened.
func (e *Engine) openDevices(placer registry.RankPerDevice, n int) (devices []registry.Device, backends []backend.Backend, closeDevices func() error, err error) {
	if devices, closeDevices, err = placer.OpenBeside(e.device, n); err != nil {
		return nil, nil, nil, fmt.Errorf("parallel: one rank per %s: %w", placer.Capabilities().Device, err)
	}
	backends = make([]backend.Backend, n)
	backends[0] = e.backend // device 0, as the engine wrapped it
	for r := 1; r < n; r++ {
		backends[r] = devices[r]
		e.setDeterministic(devices[r])
		if e.wrap != nil {
			backends[r] = e.wrap(devices[r])
		}
	}
	return devices, backends, closeDevices, nil
}

// placeOnNodeDevices places this node's share of a run spread over nnodes
// processes on a registry.MultiProcess driver (CUDA): the node hosts the
// block of world ranks first .. first+R-1 (NodeBlock), local rank i on
// GPU i, which takes R visible GPUs; virtual ranks cannot share an NCCL
// world with other processes. Its groups are the driver's (NCCL
// communicators) that span the nodes, made from the world's id (NodeRanks;
// ctx ending abandons the making).
func (e *Engine) placeOnNodeDevices(ctx context.Context, mp registry.MultiProcess, node, nnodes int, id registry.WorldID) (world []*comm.Ranks, backends []backend.Backend, release func() error, err error) {
	mesh := e.cfg.mesh()
	caps := mp.Capabilities()
	first, per, err := mp.NodeBlock(mesh, nnodes, node)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("node %d: %w", node, err)
	}
	visible, err := mp.Devices()
	if err != nil {
		return nil, nil, nil, fmt.Errorf("node %d: counting the %ss: %w", node, caps.Device, err)
	}
	visibility := ""
	if caps.VisibleEnv != "" {
		if v := os.Getenv(caps.VisibleEnv); v != "" {
			visibility = caps.VisibleEnv + "=" + v
		}
	}
	if err := checkNodeGPUs(node, first, per, mesh.World(), visible, visibility); err != nil {
		return nil, nil, nil, inputError(err) // the launch asks for more GPUs than the node has
	}
	devices, backends, closeDevices, err := e.openDevices(mp, per)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("node %d: %w", node, err)
	}
	world, closeGroups, err := mp.NodeRanks(ctx, registry.Node{
		Mesh: mesh, NodeRank: node, NNodes: nnodes, Devices: devices, World: id,
	})
	if err != nil {
		return nil, nil, nil, errors.Join(err, closeDevices())
	}
	e.log.Info().Msgf("parallel: node %d of %d trains %s of %d on %d %ss, one each, %s between every rank",
		node, nnodes, worldRanks(first, per), mesh.World(), per, caps.Device, caps.Collectives)
	timeNCCL(world, backends)
	return world, backends, func() error { return errors.Join(closeGroups(), closeDevices()) }, nil
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
// ranks; visibility is the setting that limits what it sees
// ("CUDA_VISIBLE_DEVICES=3"), or "".
func checkNodeGPUs(node, first, per, worldSize, visible int, visibility string) error {
	if visible >= per {
		return nil
	}
	sees := fmt.Sprintf("sees %d", visible)
	if visibility != "" {
		sees += fmt.Sprintf(" (%s)", visibility)
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
