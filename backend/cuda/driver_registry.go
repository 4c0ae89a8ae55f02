package cuda

// The CUDA backend as a registry.Driver: what lets a program hand it to
// the engine (engine.WithDrivers, usually through package backend/all)
// without the engine importing this package. Everything here delegates to
// the package's own API (OpenBackend, VisibleGPUs, OpenBackendsBeside,
// NCCLRanks, NodeBlock, NCCLNodeRanks, the NCCL id in the rendezvous
// blob).

import (
	"context"
	"fmt"
	"strings"

	"github.com/mktrain/mktrain/backend/registry"
	"github.com/mktrain/mktrain/comm"
)

// Driver opens CUDA backends with its Options. It implements
// registry.MultiProcess: one rank per GPU with NCCL between them, in one
// process or over several.
type Driver struct{ opts Options }

var (
	_ registry.MultiProcess = (*Driver)(nil)
	_ registry.Device       = (*Backend)(nil)
)

// NewDriver is the driver of CUDA backends loaded with opts.
func NewDriver(opts Options) *Driver { return &Driver{opts: opts} }

// Name is "cuda".
func (d *Driver) Name() string { return "cuda" }

// Capabilities are the CUDA kernels' limits; NCCL groups of one process
// offer peer access between the GPUs (NCCLOptions.PeerAccess).
func (d *Driver) Capabilities() registry.Capabilities {
	return registry.Capabilities{
		Device: "GPU", Collectives: "NCCL", VisibleEnv: "CUDA_VISIBLE_DEVICES", PeerAccess: true,
		Limits: registry.Limits{RouterMaxExperts: RouterMaxExperts, RouterMaxTopK: RouterMaxTopK, AttnMaxHeadDim: MaxAttnHeadDim},
	}
}

// Open opens GPU 0 (OpenBackend). Where the machine has no usable GPU
// (NoGPU) the error is a *registry.NoDeviceError whose Reason is the
// error's first line: the list of folders searched is for an explicit
// train.backend: cuda to print.
func (d *Driver) Open() (registry.Device, error) {
	b, err := OpenBackend(d.opts)
	if err != nil {
		if NoGPU(err) {
			reason, _, _ := strings.Cut(err.Error(), "\n")
			return nil, &registry.NoDeviceError{Reason: strings.TrimSuffix(reason, "; looked in:"), Err: err}
		}
		return nil, err
	}
	return b, nil
}

// Describe names the GPU in log lines: "NVIDIA H200 (GPU 0)".
func (b *Backend) Describe() string {
	i := b.dev.Info()
	return fmt.Sprintf("%s (GPU %d)", i.Name, i.Ordinal)
}

// Devices is VisibleGPUs.
func (d *Driver) Devices() (int, error) { return VisibleGPUs(d.opts) }

// OpenBeside is OpenBackendsBeside; first must be a *Backend.
func (d *Driver) OpenBeside(first registry.Device, n int) ([]registry.Device, func() error, error) {
	gpu0, err := asBackends([]registry.Device{first})
	if err != nil {
		return nil, nil, err
	}
	gpus, closeRest, err := OpenBackendsBeside(d.opts, gpu0[0], n)
	if err != nil {
		return nil, nil, err
	}
	devs := make([]registry.Device, len(gpus))
	for i, g := range gpus {
		devs[i] = g
	}
	return devs, closeRest, nil
}

// MeshRanks is NCCLRanks over the devices, which must be *Backends.
func (d *Driver) MeshRanks(mesh comm.Mesh, devices []registry.Device, opts registry.MeshOptions) ([]*comm.Ranks, func() error, error) {
	gpus, err := asBackends(devices)
	if err != nil {
		return nil, nil, err
	}
	return NCCLRanks(mesh, gpus, NCCLOptions{PeerAccess: opts.PeerAccess})
}

// NodeBlock is the package's NodeBlock.
func (d *Driver) NodeBlock(mesh comm.Mesh, nnodes, node int) (first, n int, err error) {
	return NodeBlock(mesh, nnodes, node)
}

// NewWorldID makes an NCCL unique id (NCCLUniqueID). Making it starts
// NCCL's bootstrap listener in this process, which the other nodes reach
// on the interface NCCL picks (NCCL_SOCKET_IFNAME chooses).
func (d *Driver) NewWorldID() (registry.WorldID, error) {
	id, err := NCCLUniqueID()
	if err != nil {
		return nil, fmt.Errorf("making the NCCL unique id: %w", err)
	}
	return id[:], nil
}

// PutWorldID is PutNCCLID on a blob of comm.BlobSize bytes.
func (d *Driver) PutWorldID(blob []byte, id registry.WorldID) error {
	if len(blob) != comm.BlobSize || len(id) != NCCLUniqueIDBytes {
		return fmt.Errorf("cuda: a %d-byte NCCL id for a %d-byte rendezvous blob; want %d and %d", len(id), len(blob), NCCLUniqueIDBytes, comm.BlobSize)
	}
	PutNCCLID((*[comm.BlobSize]byte)(blob), [NCCLUniqueIDBytes]byte(id))
	return nil
}

// WorldIDFromBlob is NCCLIDFromBlob on a blob of comm.BlobSize bytes.
func (d *Driver) WorldIDFromBlob(blob []byte) (registry.WorldID, error) {
	if len(blob) != comm.BlobSize {
		return nil, fmt.Errorf("cuda: a %d-byte rendezvous blob; want %d", len(blob), comm.BlobSize)
	}
	id, err := NCCLIDFromBlob([comm.BlobSize]byte(blob))
	if err != nil {
		return nil, err
	}
	return id[:], nil
}

// NodeRanks is NCCLNodeRanks with the node's devices (*Backends) and
// world id (an NCCL unique id).
func (d *Driver) NodeRanks(ctx context.Context, node registry.Node) ([]*comm.Ranks, func() error, error) {
	gpus, err := asBackends(node.Devices)
	if err != nil {
		return nil, nil, err
	}
	if len(node.World) != NCCLUniqueIDBytes {
		return nil, nil, fmt.Errorf("cuda: a world id of %d bytes; an NCCL unique id has %d", len(node.World), NCCLUniqueIDBytes)
	}
	return NCCLNodeRanks(ctx, NCCLNode{
		Mesh: node.Mesh, NodeRank: node.NodeRank, NNodes: node.NNodes,
		Backends: gpus, ID: [NCCLUniqueIDBytes]byte(node.World),
	})
}

// asBackends unwraps devices this driver opened.
func asBackends(devices []registry.Device) ([]*Backend, error) {
	gpus := make([]*Backend, len(devices))
	for i, dev := range devices {
		b, ok := dev.(*Backend)
		if !ok || b == nil {
			return nil, fmt.Errorf("cuda: device %d is %T, not a GPU the cuda driver opened", i, dev)
		}
		gpus[i] = b
	}
	return gpus, nil
}
