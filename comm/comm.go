// Package comm holds the ranks of a training run and the collectives between
// them: every rank gets a Ranks, whose Groups (World, Data, Expert,
// ExpertReplica, Context, DataContext, Tensor) sum gradients, exchange tokens and
// meet, whether the ranks are goroutines of one process, processes on
// several nodes, or NCCL communicators.
//
// # Use
//
// A run's layout is a Mesh, dp x ep x cp x tp; its product is the world
// size. In one process, every rank is a goroutine:
//
//	ranks, err := comm.NewLocal(comm.Mesh{DP: 2, EP: 2, CP: 1, TP: 1}, b)
//	for _, r := range ranks {
//		go func() {
//			err := r.Data.AllReduceSum(grad) // every rank calls it, in the same order
//			if err != nil {
//				r.Abort(err) // so that the other ranks stop waiting for this one
//			}
//		}()
//	}
//
// Across processes (mktrain run --nnodes, engine.RunDistributed), each node
// first meets the others through package launch (launch.Join), which hands
// out a run id and every node's data address, then connects to them:
//
//	ln, _ := net.Listen("tcp", ":0") // its port goes to launch.RendezvousConfig.DataPort
//	w, err := comm.NewTCPRanks(ctx, comm.TCPConfig{
//		Mesh: mesh, Backend: b, NodeRank: node,
//		Addrs: addrs, Listener: ln, // addrs: launch.DataAddrs(rdv.Nodes())
//		RunID: comm.RunIDFromBlob(rdv.Blob()),
//	})
//	defer w.Close()
//	ranks := w.Ranks() // this node's block of world ranks
//
// A node that dies or goes silent, a peer that never reaches a collective
// (TCPConfig.OpTimeout) and an Abort on any node fail every pending and
// later operation on every node with an error naming the cause; w.Failed()
// and w.Err() report it. On the CUDA backend the same []*Ranks come from
// NCCL communicators instead (cuda.NCCLGroup, cuda.NCCLNodeRanks; package
// backend/cuda, since they need device pointers), with the rendezvous
// handing out NCCL's unique id (BlobSize, NewRunBlob).
//
// Optional capabilities are discovered by type assertion on a Group:
// AsyncReducer (start a reduction, wait later: gradient buckets overlap the
// backward) and PeerAccess (every rank's tensors, for the MoE layer's fused
// dispatcher: the in-process groups, and the NCCL groups of one process
// when asked, cuda.NCCLOptions.PeerAccess, their tensors meeting in an
// Exchange). Groups across processes do not offer PeerAccess.
//
// # Design
//
// The groups (groups.go, mesh.go): the data group holds every rank with a
// distinct part of the batch (non-expert gradients, global load-balancing
// statistics); the expert group the ranks that shard the experts between
// them (the token all-to-all); the expert-replica group the ranks that
// hold the same experts (expert gradients); with context parallelism, the
// context group splits each sequence and the data-context group holds
// every rank with distinct tokens (losses and load statistics); the tensor
// group the ranks that split one set of tokens' projections (tensor
// parallelism), over which the expert group is folded too.
//
// The in-process and multi-process implementations reduce in rank order,
// so all ranks get bitwise identical results, replicated weights never
// drift, and a layout split over processes gives bitwise the results it
// gives as virtual ranks of one process.
//
// The in-process implementation (local.go) moves data with the backend's
// own ops: the ranks share one backend (the CPU, or one GPU whose ranks
// read each other's buffers through plain device pointers).
//
// The multi-process implementation is a protocol on top of a transport:
//
//   - transport.go: a Link per pair of nodes carries whole frames in order;
//     the protocol reads time from a clock. tcp_transport.go is the TCP
//     transport: a full mesh of connections, the hello that checks the run
//     id, the framing.
//   - world.go: a node over its links: heartbeats and the silence that
//     makes a peer lost, inboxes per message key, failures, Abort, goodbye.
//   - remote_group.go: the collectives, met at each group's rank 0, which
//     checks every rank's arguments and reduces in rank order.
//
// The protocol sees only Links and the clock, so its tests run it over
// in-memory links on a logical clock (memlink_test.go, world_test.go):
// heartbeat timeouts and dead peers without sockets or sleeps. The
// loopback tests (tcp_test.go) check the TCP transport under it.
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
