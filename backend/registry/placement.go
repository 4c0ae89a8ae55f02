package registry

import (
	"context"

	"github.com/mktrain/mktrain/comm"
)

// RankPerDevice is an optional capability of a Driver: the ranks of one
// process each take a device of their own, with groups of the driver's
// collectives library between them, instead of sharing one device as
// virtual ranks.
type RankPerDevice interface {
	Driver
	// Devices counts the devices this process sees (for cuda,
	// CUDA_VISIBLE_DEVICES applies).
	Devices() (int, error)
	// OpenBeside opens devices 1..n-1 beside first (device 0, which Open
	// returned), one Device each; devices[0] is first. closeRest closes
	// the devices OpenBeside opened, not first. On an error it closes them
	// itself, and the error names the device that failed.
	OpenBeside(first Device, n int) (devices []Device, closeRest func() error, err error)
	// MeshRanks cuts mesh's groups over devices, devices[r] being world
	// rank r's, each of them from this driver. closeAll closes the groups;
	// call it once the ranks are done.
	MeshRanks(mesh comm.Mesh, devices []Device, opts MeshOptions) (ranks []*comm.Ranks, closeAll func() error, err error)
}

// MeshOptions configures RankPerDevice.MeshRanks.
type MeshOptions struct {
	// PeerAccess asks for groups that offer comm.PeerAccess (what the
	// fused MoE dispatcher needs); only for a driver whose Capabilities
	// say PeerAccess.
	PeerAccess bool
}

// MultiProcess is an optional capability of a Driver: one world of
// devices spread over several processes (nodes), one rank per device,
// the driver's groups spanning the nodes. Node 0 makes the world's id and
// puts it in the rendezvous blob; every node reads it from there and
// makes its part of the world with NodeRanks.
type MultiProcess interface {
	RankPerDevice
	// NodeBlock is the block of world ranks that node hosts in a world of
	// mesh over nnodes nodes: first, first+1, ..., first+n-1, with n the
	// same on every node.
	NodeBlock(mesh comm.Mesh, nnodes, node int) (first, n int, err error)
	// NewWorldID makes the id of a new world (node 0 does).
	NewWorldID() (WorldID, error)
	// PutWorldID writes id into blob, node 0's rendezvous blob, leaving
	// the run id at its start as it is.
	PutWorldID(blob []byte, id WorldID) error
	// WorldIDFromBlob reads the id node 0 put in the rendezvous blob; the
	// error says so when there is none.
	WorldIDFromBlob(blob []byte) (WorldID, error)
	// NodeRanks makes this node's part of the world and returns the Ranks
	// of the world ranks it hosts, in order (ranks[i] is world rank
	// first+i of its NodeBlock, on node.Devices[i]). Every node calls it
	// at the same time with the same Mesh, NNodes and World. It returns
	// once every group is made, or with the first error, or when ctx ends.
	// closeAll closes every group; call it once the ranks are done.
	NodeRanks(ctx context.Context, node Node) (ranks []*comm.Ranks, closeAll func() error, err error)
}

// WorldID identifies one world of a MultiProcess driver (for cuda, the
// NCCL unique id).
type WorldID []byte

// Node is one process's part of a world spread over processes.
type Node struct {
	Mesh             comm.Mesh
	NodeRank, NNodes int
	// Devices are this node's devices, one per local rank.
	Devices []Device
	// World is the world's id, made by node 0 (WorldIDFromBlob).
	World WorldID
}
