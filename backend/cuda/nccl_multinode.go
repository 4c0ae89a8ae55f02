package cuda

// The NCCL world of a run spread over several processes (nodes): each
// process drives an equal, contiguous block of world ranks, one GPU each
// (NodeBlock, the TCP communicator's layout), and every group of the mesh
// (comm.NewRanks' layout) is an NCCL communicator that spans the processes.
// NCCLRanks (nccl_ranks.go) stays the path of one process that drives every
// rank.
//
// # How the communicators are made
//
// Node 0 makes the world communicator's unique id (ncclGetUniqueId) before
// the rendezvous and puts it in the rendezvous blob (PutNCCLID); the
// rendezvous hands node 0's blob to every node (launch.Rendezvous.Blob), which
// reads the id back (NCCLIDFromBlob). Then every local rank of every node,
// on a thread of its own with its GPU's context current:
//
//  1. joins the world communicator: ncclCommInitRank with its world rank;
//  2. cuts each other kind of group from it, in comm.GroupKinds' order:
//     ncclCommSplit (NCCL 2.18 and later) with color = the group's index
//     among the groups of its kind and key = the rank's place in its group
//     (splitPlan), so NCCL orders a group's ranks as comm.Mesh.Members does.
//
// An NCCL without ncclCommSplit gets one unique id per group instead: the
// group's first member makes it, the world communicator hands every id to
// every rank (an AllReduceFloat64 in which each id has its own slot and one
// writer, so the sum is the id), and each rank joins its groups with
// ncclCommInitRank. Every resulting group is an *NCCLGroup, so the
// collectives, Abort and the watchdog are those of nccl_group.go; the local
// members of one communicator share their abort, as NewNCCLGroups' do.
//
// The local ranks run these steps on separate threads because each call
// returns only once every rank of the communicator has made it: one thread
// calling for two ranks in turn would wait forever for the second.
//
// # Failures while they are made
//
// A blocking NCCL init waits for every rank without a bound: a node that
// fails before it joins (it has too few GPUs, say) leaves the others
// waiting, and NCCL offers no way to cancel that wait. So NCCLNodeRanks
// waits for the ranks' threads, for the first error among them, for ctx
// (the engine cancels it when the rendezvous reports a lost or failed
// node) and for NCCLOptions.Timeout, whichever comes first, and returns the
// error at once. A thread that is still inside NCCL is abandoned: when its
// call returns it aborts what it made; if the call never returns, the thread
// stays blocked until the process exits, which is what a failed run does
// next. The communicators of ranks that were done are aborted at once.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"sync"
	"unsafe"

	"github.com/mktrain/mktrain/comm"
)

// # The rendezvous blob

// The NCCL part of the rendezvous blob: after the run id, a header (magic
// and layout version) and the world's unique id.
const (
	ncclBlobOffset  = comm.RunIDSize
	ncclBlobHeader  = 8
	ncclBlobEnd     = ncclBlobOffset + ncclBlobHeader + NCCLUniqueIDBytes
	ncclBlobVersion = 1
)

// ncclBlobMagic opens the NCCL part of the blob.
var ncclBlobMagic = [6]byte{'m', 'k', 'N', 'C', 'C', 'L'}

// The NCCL part must fit in the blob (a negative constant does not compile).
const _ = uint(comm.BlobSize - ncclBlobEnd)

// PutNCCLID writes the NCCL world's unique id into blob (node 0's
// rendezvous blob), behind the run id, which it leaves as it is.
func PutNCCLID(blob *[comm.BlobSize]byte, id [NCCLUniqueIDBytes]byte) {
	h := blob[ncclBlobOffset : ncclBlobOffset+ncclBlobHeader]
	copy(h, ncclBlobMagic[:])
	binary.LittleEndian.PutUint16(h[len(ncclBlobMagic):], ncclBlobVersion)
	copy(blob[ncclBlobOffset+ncclBlobHeader:ncclBlobEnd], id[:])
}

// NCCLIDFromBlob reads the NCCL world's unique id that node 0 put in the
// rendezvous blob (PutNCCLID).
func NCCLIDFromBlob(blob [comm.BlobSize]byte) ([NCCLUniqueIDBytes]byte, error) {
	var id [NCCLUniqueIDBytes]byte
	h := blob[ncclBlobOffset : ncclBlobOffset+ncclBlobHeader]
	if [6]byte(h[:len(ncclBlobMagic)]) != ncclBlobMagic {
		return id, errors.New("cuda: the rendezvous blob holds no NCCL unique id: node 0 made none, so it does not train on the cuda backend (train.backend: auto may have found no GPU there); every node of a CUDA run must train on the cuda backend")
	}
	if v := binary.LittleEndian.Uint16(h[len(ncclBlobMagic):]); v != ncclBlobVersion {
		return id, fmt.Errorf("cuda: the NCCL part of the rendezvous blob has layout version %d; this mktrain reads version %d", v, ncclBlobVersion)
	}
	copy(id[:], blob[ncclBlobOffset+ncclBlobHeader:ncclBlobEnd])
	if id == [NCCLUniqueIDBytes]byte{} {
		return id, errors.New("cuda: the NCCL unique id in the rendezvous blob is all zeros")
	}
	return id, nil
}

// # The plan

// NodeBlock is the block of world ranks that node hosts in a world of mesh
// spread over nnodes nodes: first, first+1, ..., first+n-1, with n the same
// on every node (the TCP communicator's layout).
func NodeBlock(mesh comm.Mesh, nnodes, node int) (first, n int, err error) {
	if err := mesh.Validate(); err != nil {
		return 0, 0, err
	}
	w := mesh.World()
	switch {
	case nnodes < 1:
		return 0, 0, fmt.Errorf("cuda: a world over %d nodes; it needs at least 1", nnodes)
	case node < 0 || node >= nnodes:
		return 0, 0, fmt.Errorf("cuda: node %d of a world over %d nodes; nodes count from 0", node, nnodes)
	case w%nnodes != 0:
		return 0, 0, fmt.Errorf("cuda: %d ranks do not split evenly over %d nodes", w, nnodes)
	}
	n = w / nnodes
	return node * n, n, nil
}

// ncclSplit is how one world rank joins its group of one kind: the group's
// index among the groups of its kind (the split's color), the rank's place
// in it (the key), the group's size, and its first member (place 0), who
// makes its unique id when NCCL cannot split.
type ncclSplit struct {
	color, key, size, leader int
}

// splitPlan is every world rank's split for every kind of group,
// plan[kind][world rank]. Groups are numbered in the order of their first
// members.
func splitPlan(mesh comm.Mesh) [][]ncclSplit {
	w := mesh.World()
	plan := make([][]ncclSplit, len(comm.GroupKinds()))
	for _, k := range comm.GroupKinds() {
		plan[k] = make([]ncclSplit, w)
		color := map[int]int{} // first member -> group index
		for r := range w {
			members, place := mesh.Members(k, r)
			c, ok := color[members[0]]
			if !ok {
				c = len(color)
				color[members[0]] = c
			}
			plan[k][r] = ncclSplit{color: c, key: place, size: len(members), leader: members[0]}
		}
	}
	return plan
}

// Without ncclCommSplit the ids travel as float64 values in an
// AllReduceFloat64 of the world: one 32-bit word per value (exact in a
// float64), idWords values per id, one slot per (world rank, kind).
const idWords = NCCLUniqueIDBytes / 4

// idSlot is where the id that world rank leader makes for its group of
// kind k lies in the exchanged vector.
func idSlot(leader int, k comm.GroupKind) int {
	return (leader*len(comm.GroupKinds()) + int(k)) * idWords
}

func packID(vals []float64, at int, id [NCCLUniqueIDBytes]byte) {
	for j := range idWords {
		vals[at+j] = float64(binary.LittleEndian.Uint32(id[4*j:]))
	}
}

// unpackID reads an id back; a value that is not a 32-bit word (two
// writers, or none that agree) is an error.
func unpackID(vals []float64, at int) ([NCCLUniqueIDBytes]byte, error) {
	var id [NCCLUniqueIDBytes]byte
	for j := range idWords {
		v := vals[at+j]
		if v < 0 || v > math.MaxUint32 || v != math.Trunc(v) {
			return id, fmt.Errorf("word %d of the exchanged id is %v, not a 32-bit word", j, v)
		}
		binary.LittleEndian.PutUint32(id[4*j:], uint32(v))
	}
	if id == [NCCLUniqueIDBytes]byte{} {
		return id, errors.New("the exchanged id is all zeros: its group's first member made none")
	}
	return id, nil
}

// # Making the world

// NCCLNode is one process's part of an NCCL world spread over processes.
type NCCLNode struct {
	Mesh             comm.Mesh
	NodeRank, NNodes int
	// Backends are this node's GPUs, one per local rank: Backends[i] hosts
	// world rank first+i of the node's block (NodeBlock); each on its own
	// GPU.
	Backends []*Backend
	// ID is the world communicator's unique id, made by node 0
	// (NCCLIDFromBlob of the rendezvous blob).
	ID [NCCLUniqueIDBytes]byte
	// Options are every group's, as for NewNCCLGroups, except Name: each
	// group is named by its kind ("world", "expert", ...). Timeout also
	// bounds the making of the communicators.
	Options NCCLOptions

	noSplit bool // tests: take the path of an NCCL without ncclCommSplit
}

// NCCLNodeRanks makes this node's part of the NCCL world of node and
// returns the Ranks of the world ranks it hosts, in order (ranks[i] is
// world rank first+i, on Backends[i]). Every node calls it at the same
// time with the same Mesh, NNodes and ID. It returns once every group's
// communicator is made, or with the first error, or when ctx ends (then
// with context.Cause(ctx)); see the file comment for what is left behind
// then, and why. closeAll closes every group; call it once the ranks are
// done.
func NCCLNodeRanks(ctx context.Context, node NCCLNode) (ranks []*comm.Ranks, closeAll func() error, err error) {
	first, per, err := node.check()
	if err != nil {
		return nil, nil, err
	}
	opts := node.Options.withDefaults()
	lib, err := LoadNCCL(opts.Search)
	if err != nil {
		return nil, nil, err
	}
	s := &nodeSetup{
		node: node, lib: lib, opts: opts, first: first,
		plan:       splitPlan(node.Mesh),
		comms:      make([][]ncclComm, per),
		worlds:     make([]*NCCLGroup, per),
		worldState: &ncclState{name: comm.GroupWorld.String()},
	}
	if !node.noSplit {
		s.split, _ = lib.lib.Symbol("ncclCommSplit") // NCCL 2.18
	}
	ctx, cancel := context.WithTimeoutCause(ctx, opts.Timeout,
		fmt.Errorf("not done after %v (NCCLOptions.Timeout): a rank of another node may never have joined", opts.Timeout))
	defer cancel()
	if err := runLocalRanks(ctx, per, s.join); err != nil {
		held := fmt.Sprintf("world ranks %d-%d", first, first+per-1)
		if per == 1 {
			held = fmt.Sprintf("world rank %d", first)
		}
		return nil, nil, fmt.Errorf("comm: making node %d's NCCL communicators (%s of %d): %w", node.NodeRank, held, node.Mesh.World(), err)
	}
	ranks, closeAll = s.ranks()
	return ranks, closeAll, nil
}

// check checks node and returns its block of world ranks.
func (node NCCLNode) check() (first, per int, err error) {
	first, per, err = NodeBlock(node.Mesh, node.NNodes, node.NodeRank)
	if err != nil {
		return 0, 0, err
	}
	if len(node.Backends) != per {
		return 0, 0, fmt.Errorf("cuda: NCCLNodeRanks: %d backends for the %d ranks node %d hosts", len(node.Backends), per, node.NodeRank)
	}
	seen := map[int]int{}
	for i, b := range node.Backends {
		if b == nil || b.dev == nil {
			return 0, 0, fmt.Errorf("cuda: NCCLNodeRanks: backend %d is nil", i)
		}
		o := b.dev.info.Ordinal
		if j, dup := seen[o]; dup {
			return 0, 0, fmt.Errorf("cuda: NCCLNodeRanks: backends %d and %d are both on GPU %d; NCCL runs one rank per GPU", j, i, o)
		}
		seen[o] = i
	}
	if node.ID == [NCCLUniqueIDBytes]byte{} {
		return 0, 0, errors.New("cuda: NCCLNodeRanks: the NCCL unique id is all zeros; node 0 makes it (NCCLUniqueID) and the rendezvous hands it to every node (PutNCCLID, NCCLIDFromBlob)")
	}
	return first, per, nil
}

// nodeSetup is NCCLNodeRanks' work in progress. Each local rank's thread
// fills its own row of comms and its own world group; the rest is
// read-only.
type nodeSetup struct {
	node  NCCLNode
	lib   *NCCL
	opts  NCCLOptions
	first int
	plan  [][]ncclSplit
	split uintptr // ncclCommSplit; 0 without it

	comms      [][]ncclComm // [local rank][kind], World's included; 0 where not made
	worlds     []*NCCLGroup // [local rank]: the world group
	worldState *ncclState   // the world groups' shared abort
}

// join makes local rank i's communicators (see the file comment), on a
// thread of its own, where cleanup also runs.
func (s *nodeSetup) join(i int) (cleanup func(error), err error) {
	// Never unlocked: the thread ends with the goroutine, and the context
	// binding with it.
	runtime.LockOSThread()
	b := s.node.Backends[i]
	q, w := s.first+i, s.node.Mesh.World()
	s.comms[i] = make([]ncclComm, len(comm.GroupKinds()))
	// cleanup aborts this rank's communicators only, each exactly once
	// (take): a sibling rank may still be inside NCCL with its own.
	cleanup = func(error) {
		if g := s.worlds[i]; g != nil {
			if c := g.take(); c != 0 {
				s.lib.abort(c)
			}
			g.Close()
		}
		for k, c := range s.comms[i] {
			if c != 0 && comm.GroupKind(k) != comm.GroupWorld {
				s.lib.abort(c)
			}
		}
	}
	fail := func(err error) (func(error), error) {
		return cleanup, fmt.Errorf("world rank %d (GPU %d): %w", q, b.dev.info.Ordinal, err)
	}
	if err := b.dev.drv.CtxSetCurrent(b.dev.ctx); err != nil {
		return fail(err)
	}
	c, err := s.lib.initRank(w, q, s.node.ID)
	if err != nil {
		return fail(fmt.Errorf("joining the world: %w", err))
	}
	s.comms[i][comm.GroupWorld] = c
	o := s.opts
	o.Name = comm.GroupWorld.String()
	s.worlds[i] = newNCCLGroup(s.lib, b, c, q, w, o, s.worldState)
	s.worldState.add(s.worlds[i])

	kinds := comm.GroupKinds()[1:]
	if s.split != 0 {
		for _, k := range kinds {
			sp := s.plan[k][q]
			if s.comms[i][k], err = s.lib.splitComm(s.split, c, sp.color, sp.key); err != nil {
				return fail(fmt.Errorf("cutting its %v group from the world: %w", k, err))
			}
		}
		return cleanup, nil
	}
	ids, err := s.exchangeIDs(s.worlds[i], q)
	if err != nil {
		return fail(fmt.Errorf("handing out the groups' NCCL unique ids: %w", err))
	}
	for _, k := range kinds {
		sp := s.plan[k][q]
		if s.comms[i][k], err = s.lib.initRank(sp.size, sp.key, ids[k]); err != nil {
			return fail(fmt.Errorf("joining its %v group: %w", k, err))
		}
	}
	return cleanup, nil
}

// exchangeIDs is the path without ncclCommSplit: world rank q makes the ids
// of the groups it leads, the world hands every id to every rank, and q
// takes those of its own groups, indexed by kind.
func (s *nodeSetup) exchangeIDs(world *NCCLGroup, q int) ([][NCCLUniqueIDBytes]byte, error) {
	kinds := comm.GroupKinds()
	vals := make([]float64, s.node.Mesh.World()*len(kinds)*idWords)
	for _, k := range kinds[1:] {
		if s.plan[k][q].leader == q {
			id, err := s.lib.UniqueID()
			if err != nil {
				return nil, err
			}
			packID(vals, idSlot(q, k), id)
		}
	}
	if err := world.AllReduceFloat64(vals); err != nil {
		return nil, err
	}
	ids := make([][NCCLUniqueIDBytes]byte, len(kinds))
	for _, k := range kinds[1:] {
		leader := s.plan[k][q].leader
		id, err := unpackID(vals, idSlot(leader, k))
		if err != nil {
			return nil, fmt.Errorf("the %v group led by world rank %d: %w", k, leader, err)
		}
		ids[k] = id
	}
	return ids, nil
}

// ranks wraps the communicators, once every local rank has made them, in
// NCCLGroups and cuts the local ranks' Ranks. The other nodes' ranks have
// nil groups in comm.NewRanks' result, which is dropped.
func (s *nodeSetup) ranks() ([]*comm.Ranks, func() error) {
	per := len(s.comms)
	groups := make([][]*NCCLGroup, len(comm.GroupKinds())) // [kind][local rank]
	groups[comm.GroupWorld] = s.worlds
	made := slices.Clone(s.worlds)
	for _, k := range comm.GroupKinds()[1:] {
		groups[k] = make([]*NCCLGroup, per)
		states := map[int]*ncclState{} // by color: one per communicator
		o := s.opts
		o.Name = k.String()
		for i := range per {
			sp := s.plan[k][s.first+i]
			st := states[sp.color]
			if st == nil {
				st = &ncclState{name: o.Name}
				states[sp.color] = st
			}
			g := newNCCLGroup(s.lib, s.node.Backends[i], s.comms[i][k], sp.key, sp.size, o, st)
			st.add(g)
			groups[k][i] = g
			made = append(made, g)
		}
	}
	all, err := comm.NewRanks(s.node.Mesh, func(k comm.GroupKind, members []int) ([]comm.Group, error) {
		out := make([]comm.Group, len(members))
		for j, q := range members {
			if i := q - s.first; i >= 0 && i < per {
				out[j] = groups[k][i]
			}
		}
		return out, nil
	})
	if err != nil { // the mesh was validated; NewRanks cannot fail here
		panic(err)
	}
	return all[s.first : s.first+per], closeGroups(made)
}

// closeGroups closes groups together, each on its own device thread, as a
// communicator's teardown may wait for its peers.
func closeGroups(groups []*NCCLGroup) func() error {
	return func() error {
		errs := make([]error, len(groups))
		var wg sync.WaitGroup
		for i, g := range groups {
			wg.Go(func() { errs[i] = g.Close() })
		}
		wg.Wait()
		return errors.Join(errs...)
	}
}

// add makes g a member of the communicator whose abort s is.
func (s *ncclState) add(g *NCCLGroup) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.members = append(s.members, g)
}

// splitComm is ncclCommSplit with the library's default config (NULL: the
// child inherits the parent's).
func (l *NCCL) splitComm(fn uintptr, parent ncclComm, color, key int) (ncclComm, error) {
	var c ncclComm
	r := ncclCall(fn, uintptr(parent), uintptr(color), uintptr(key), uintptr(unsafe.Pointer(&c)), 0)
	if err := l.check(r, parent, "ncclCommSplit(color %d, key %d)", color, key); err != nil {
		return 0, err
	}
	if c == 0 {
		return 0, fmt.Errorf("ncclCommSplit(color %d, key %d) returned no communicator", color, key)
	}
	return c, nil
}

// runLocalRanks runs join(i) for every local rank i, each on its own
// goroutine, and waits for all of them, for the first error, or for ctx to
// end (then context.Cause(ctx)). When the whole fails, every join's
// cleanup runs with the error, on the join's goroutine: at once for the
// joins that returned, and when it returns for a join still blocked in a
// call that cannot be cancelled (see the file comment). On success no
// cleanup runs.
func runLocalRanks(ctx context.Context, n int, join func(i int) (cleanup func(error), err error)) error {
	results := make(chan error, n)
	settled := make(chan struct{})
	var failure error // written before settled closes
	for i := range n {
		go func() {
			cleanup, err := join(i)
			results <- err
			<-settled
			if failure != nil && cleanup != nil {
				cleanup(failure)
			}
		}()
	}
	var err error
	for got := 0; got < n && err == nil; {
		select {
		case err = <-results:
			got++
		case <-ctx.Done():
			err = context.Cause(ctx)
		}
	}
	failure = err
	close(settled)
	return err
}
