// Package comm holds the ranks of a training run and the collectives between
// them.
//
// A run's world is a mesh dp x ep x cp x tp (Mesh). Each rank belongs to
// several Groups cut from the mesh: the data group (every rank that holds a
// distinct part of the batch, used for non-expert gradients and for global
// load-balancing statistics), the expert group (the ranks that shard the
// experts between them, used for the token all-to-all) and the expert-replica
// group (the ranks that hold the same experts, used for expert gradients);
// with context parallelism, the context group (the ranks that split each
// sequence between them) and the data-context group (every rank with
// distinct tokens: losses and load statistics).
//
// The in-process implementation (NewLocal) runs virtual ranks as goroutines
// of one process sharing one backend (the CPU, or one GPU whose ranks read
// each other's buffers through plain device pointers); it moves data with
// the backend's own ops, and every rank reduces in rank order, so all ranks
// get bitwise identical results and replicated weights never drift. The
// NCCL implementation of the same interface is cuda.NCCLGroup (package
// backend/cuda, since it needs device pointers); package launch holds the
// multi-node launch configuration and the TCP rendezvous (launch.Join) that
// hands out its unique id (launch.Rendezvous.Blob).
//
// The TCP implementation (NewTCPRanks; world.go, remote_group.go,
// tcp_transport.go) spreads the ranks over
// several processes, one per node, each hosting an equal block of world
// ranks; the groups move host copies of the tensors over TCP and reduce in
// rank order at each group's rank 0, so a layout gives bitwise the same
// results across processes as in one. The nodes publish their data ports
// through the rendezvous (launch.RendezvousConfig.DataPort,
// launch.DataAddrs), which also gives the run id that tags the connections
// (RunIDFromBlob). A node
// that dies or goes silent fails every pending operation on every node
// with an error naming it and its ranks. The engine trains a multi-process
// run on the CPU backend through it (engine.RunDistributed, mktrain run
// --nnodes); on the CUDA backend the processes' ranks are NCCL
// communicators instead (cuda.NCCLNodeRanks), with the rendezvous handing
// out the NCCL unique id.
//
// The in-process groups offer PeerAccess (peers.go): a rank gets its
// peers' tensors and addresses them with the backend's ops, which the MoE
// layer's fused dispatcher needs. So do the NCCL groups of one process
// when asked (cuda.NCCLOptions.PeerAccess; their tensors meet in an
// Exchange). Groups across processes (NCCL across nodes, TCP) do not offer
// it yet.
package comm

import "github.com/mktrain/mktrain/backend"

// Group is a set of ranks that run collectives together. Every rank of the
// group must call the same collectives in the same order. A collective
// returns an error (and never hangs) once any rank of the group has called
// Abort.
type Group interface {
	// Rank is this rank's index within the group, Size the group's size.
	Rank() int
	Size() int

	// AllReduceSum sums t over the group, in place.
	AllReduceSum(t backend.Tensor) error
	// AllReduceFloat64 sums small host vectors (losses, counts, norms) in
	// place.
	AllReduceFloat64(vals []float64) error
	// AllToAllInts sends send[j] to rank j and returns what each rank sent
	// to this one, indexed by source rank (the count exchange before a
	// token all-to-all).
	AllToAllInts(send []int) ([]int, error)
	// AllToAllRows exchanges rows of 2-D tensors with uneven splits: send
	// holds sendCounts[0] rows for rank 0, then sendCounts[1] rows for rank
	// 1, ...; recv receives recvCounts[j] rows from rank j, in rank order.
	// Both tensors have the same row length.
	AllToAllRows(recv, send backend.Tensor, recvCounts, sendCounts []int) error
	// ReduceScatterSum sums send over the group and leaves block r of the
	// sum in rank r's recv: with n = recv.Len(), send holds Size()*n
	// elements and rank r receives the sum, in rank order, of every rank's
	// send[r*n:(r+1)*n]. recv may be this rank's own block of send (in
	// place).
	ReduceScatterSum(recv, send backend.Tensor) error
	// AllGather concatenates every rank's send into recv, in rank order:
	// recv holds Size()*send.Len() elements and block r is rank r's send.
	// send may be this rank's own block of recv (in place).
	AllGather(recv, send backend.Tensor) error
	// Send hands t to group rank dst, which takes it with a matching Recv;
	// Recv fills t from group rank src. Between one pair the k-th Send
	// matches the k-th Recv. Both block until the transfer is done (the
	// sender may overwrite t once Send returns); the two tensors must have
	// the same length and dtype, or both calls fail with the same error.
	// Unlike the collectives, they involve only the two ranks.
	Send(t backend.Tensor, dst int) error
	Recv(t backend.Tensor, src int) error
	// Barrier waits for every rank of the group.
	Barrier() error
	// Abort makes every pending and future collective of the group fail
	// with err (a rank that failed calls it so the others stop instead of
	// waiting for it).
	Abort(err error)
}

// Mesh is the parallel layout. Its product is the world size.
type Mesh struct {
	DP, EP, CP, TP int
}

// World is the number of ranks.
func (m Mesh) World() int { return m.DP * m.EP * m.CP * m.TP }
