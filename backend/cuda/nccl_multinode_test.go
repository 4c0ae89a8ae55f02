package cuda

// Tests of the multi-node NCCL world that need no GPU: which ranks a node
// hosts, the split plan against comm.Mesh.Members, the rendezvous blob's
// NCCL part (through a real loopback rendezvous), the id exchange of the
// path without ncclCommSplit, how the groups are cut and share their abort,
// and how the making of the communicators gives up.

import (
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/launch"
)

// testMeshes cover every axis, alone and together, and a world of one.
var testMeshes = []comm.Mesh{
	{DP: 1, EP: 1, CP: 1, TP: 1},
	{DP: 2, EP: 1, CP: 1, TP: 1},
	{DP: 1, EP: 4, CP: 1, TP: 1},
	{DP: 2, EP: 2, CP: 1, TP: 1},
	{DP: 3, EP: 2, CP: 2, TP: 1},
	{DP: 2, EP: 2, CP: 2, TP: 2},
}

func TestNodeBlock(t *testing.T) {
	m := comm.Mesh{DP: 2, EP: 4, CP: 1, TP: 1}
	for _, c := range []struct{ nnodes, node, first, n int }{
		{1, 0, 0, 8}, {2, 0, 0, 4}, {2, 1, 4, 4}, {4, 3, 6, 2}, {8, 5, 5, 1},
	} {
		first, n, err := NodeBlock(m, c.nnodes, c.node)
		if err != nil || first != c.first || n != c.n {
			t.Errorf("node %d of %d: ranks %d+%d (%v), want %d+%d", c.node, c.nnodes, first, n, err, c.first, c.n)
		}
	}
	for _, c := range []struct {
		m            comm.Mesh
		nnodes, node int
		want         string
	}{
		{m, 3, 0, "8 ranks do not split evenly over 3 nodes"},
		{m, 16, 0, "8 ranks do not split evenly over 16 nodes"},
		{m, 2, 2, "node 2 of a world over 2 nodes"},
		{m, 2, -1, "node -1 of a world over 2 nodes"},
		{m, 0, 0, "a world over 0 nodes"},
		{comm.Mesh{DP: 0, EP: 1, CP: 1, TP: 1}, 1, 0, "mesh dp is 0"},
	} {
		if _, _, err := NodeBlock(c.m, c.nnodes, c.node); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("node %d of %d: got %v, want %q", c.node, c.nnodes, err, c.want)
		}
	}
}

// TestSplitPlanMatchesMembers: the ranks that share a color are exactly a
// group of comm.Mesh.Members, ordered by key as Members orders them, the
// colors of a kind number its groups from 0, and the leader is place 0.
func TestSplitPlanMatchesMembers(t *testing.T) {
	for _, m := range testMeshes {
		plan := splitPlan(m)
		for _, k := range comm.GroupKinds() {
			byColor := map[int][]int{} // color -> world ranks by key
			for r, sp := range plan[k] {
				members, place := m.Members(k, r)
				if sp.key != place || sp.size != len(members) || sp.leader != members[0] {
					t.Errorf("mesh %+v %v rank %d: %+v, want key %d size %d leader %d", m, k, r, sp, place, len(members), members[0])
				}
				g := byColor[sp.color]
				if len(g) < sp.size {
					g = append(g, make([]int, sp.size-len(g))...)
				}
				g[sp.key] = r
				byColor[sp.color] = g
			}
			for c := range len(byColor) {
				g, ok := byColor[c]
				if !ok {
					t.Errorf("mesh %+v %v: colors are not 0..%d", m, k, len(byColor)-1)
					continue
				}
				if want, _ := m.Members(k, g[0]); !slices.Equal(g, want) {
					t.Errorf("mesh %+v %v color %d: ranks %v by key, Members says %v", m, k, c, g, want)
				}
			}
		}
	}
}

func randomID(seed uint64) [NCCLUniqueIDBytes]byte {
	rng := rand.New(rand.NewPCG(seed, 3))
	var id [NCCLUniqueIDBytes]byte
	for i := range id {
		id[i] = byte(rng.Uint32())
	}
	return id
}

// TestNCCLBlob: the id survives PutNCCLID, the rendezvous between two
// nodes on loopback, and NCCLIDFromBlob; the run id is untouched; a blob
// without an id, of another layout or with a zero id is refused.
func TestNCCLBlob(t *testing.T) {
	id := randomID(1)
	blob := comm.NewRunBlob()
	runID := comm.RunIDFromBlob(blob)
	PutNCCLID(&blob, id)
	if comm.RunIDFromBlob(blob) != runID {
		t.Fatal("PutNCCLID changed the run id")
	}

	port := freeTestPort(t)
	cfg := func(node int, b [comm.BlobSize]byte) launch.RendezvousConfig {
		return launch.RendezvousConfig{
			Launch:     launch.Launch{NNodes: 2, NodeRank: node, MasterAddr: "127.0.0.1", MasterPort: port, Secret: []byte("the tests' shared secret")},
			RecipeHash: "h", Version: "v", Blob: b, Timeout: 5 * time.Second,
			Heartbeat: 50 * time.Millisecond, HeartbeatTimeout: time.Second,
		}
	}
	rdvs := make([]*launch.Rendezvous, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for node, b := range [][comm.BlobSize]byte{blob, comm.NewRunBlob()} { // node 1's blob is ignored
		wg.Go(func() { rdvs[node], errs[node] = launch.Join(context.Background(), cfg(node, b)) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for node, r := range rdvs {
		defer r.Close()
		got, err := NCCLIDFromBlob(r.Blob())
		if err != nil || got != id || comm.RunIDFromBlob(r.Blob()) != runID {
			t.Errorf("node %d: id %x (%v), run id %x; want %x and %x", node, got[:8], err, comm.RunIDFromBlob(r.Blob()), id[:8], runID)
		}
	}

	if _, err := NCCLIDFromBlob(comm.NewRunBlob()); err == nil || !strings.Contains(err.Error(), "holds no NCCL unique id: node 0 made none") {
		t.Errorf("a blob without an id: %v", err)
	}
	other := blob
	other[ncclBlobOffset+len(ncclBlobMagic)] = 2
	if _, err := NCCLIDFromBlob(other); err == nil || !strings.Contains(err.Error(), "layout version 2; this mktrain reads version 1") {
		t.Errorf("another layout: %v", err)
	}
	zero := blob
	PutNCCLID(&zero, [NCCLUniqueIDBytes]byte{})
	if _, err := NCCLIDFromBlob(zero); err == nil || !strings.Contains(err.Error(), "all zeros") {
		t.Errorf("a zero id: %v", err)
	}
}

func freeTestPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// TestIDExchange: every rank writes the ids of the groups it leads into
// its slots, the sum over ranks (what the world's AllReduceFloat64 gives)
// holds every id, and each rank reads its groups' ids from their leaders'
// slots.
func TestIDExchange(t *testing.T) {
	m := comm.Mesh{DP: 2, EP: 2, CP: 2, TP: 1}
	w := m.World()
	plan := splitPlan(m)
	kinds := comm.GroupKinds()
	made := map[[2]int][NCCLUniqueIDBytes]byte{} // (leader, kind) -> id
	sum := make([]float64, w*len(kinds)*idWords)
	for q := range w {
		vals := make([]float64, len(sum))
		for _, k := range kinds[1:] {
			if plan[k][q].leader == q {
				id := randomID(uint64(100*q + int(k)))
				made[[2]int{q, int(k)}] = id
				packID(vals, idSlot(q, k), id)
			}
		}
		for i, v := range vals {
			sum[i] += v
		}
	}
	for q := range w {
		for _, k := range kinds[1:] {
			leader := plan[k][q].leader
			got, err := unpackID(sum, idSlot(leader, k))
			if err != nil || got != made[[2]int{leader, int(k)}] {
				t.Errorf("rank %d %v group (leader %d): %x (%v)", q, k, leader, got[:8], err)
			}
		}
	}
	if _, err := unpackID(make([]float64, idWords), 0); err == nil || !strings.Contains(err.Error(), "made none") {
		t.Errorf("an empty slot: %v", err)
	}
	bad := make([]float64, idWords)
	bad[3] = 1.5
	if _, err := unpackID(bad, 0); err == nil || !strings.Contains(err.Error(), "word 3") {
		t.Errorf("a broken word: %v", err)
	}
	bad[3] = 1 << 33 // two writers can overflow a word
	if _, err := unpackID(bad, 0); err == nil || !strings.Contains(err.Error(), "not a 32-bit word") {
		t.Errorf("an overflowing word: %v", err)
	}
}

// closedBackend is a backend on GPU ordinal whose device is closed, so
// that an abort reaches no GPU.
func closedBackend(ordinal int) *Backend {
	return &Backend{dev: &Device{info: Info{Ordinal: ordinal}, closed: true}}
}

// TestNodeRanksCut: node 1 of a world of 8 over 2 nodes (dp 2 x ep 2 x cp
// 2) cuts its four ranks' groups from made communicators: each group's rank
// and size are Members', the local members of one communicator share their
// abort, and those of different communicators do not.
func TestNodeRanksCut(t *testing.T) {
	m := comm.Mesh{DP: 2, EP: 2, CP: 2, TP: 1}
	const node, nnodes = 1, 2
	first, per, err := NodeBlock(m, nnodes, node)
	if err != nil {
		t.Fatal(err)
	}
	s := &nodeSetup{
		node:  NCCLNode{Mesh: m, NodeRank: node, NNodes: nnodes},
		opts:  NCCLOptions{}.withDefaults(),
		first: first, plan: splitPlan(m),
		comms: make([][]ncclComm, per), worlds: make([]*NCCLGroup, per),
		worldState: &ncclState{name: "world"},
	}
	for i := range per {
		b := closedBackend(i)
		s.node.Backends = append(s.node.Backends, b)
		s.comms[i] = make([]ncclComm, len(comm.GroupKinds()))
		for k := range s.comms[i] {
			s.comms[i][k] = ncclComm(1000*i + k + 1) // never used: made-up handles
		}
		o := s.opts
		o.Name = "world"
		s.worlds[i] = newNCCLGroup(nil, b, s.comms[i][comm.GroupWorld], first+i, m.World(), o, s.worldState)
		s.worldState.add(s.worlds[i])
	}
	ranks, _ := s.ranks()
	if len(ranks) != per {
		t.Fatalf("%d ranks, want %d", len(ranks), per)
	}
	for i, rk := range ranks {
		if rk.Rank != first+i || rk.Coord != m.Coord(first+i) {
			t.Errorf("local rank %d: world rank %d at %+v, want %d", i, rk.Rank, rk.Coord, first+i)
		}
		for j, g := range []comm.Group{rk.World, rk.Data, rk.Expert, rk.ExpertReplica, rk.Context, rk.DataContext, rk.Tensor} {
			k := comm.GroupKinds()[j]
			members, place := m.Members(k, rk.Rank)
			ng, ok := g.(*NCCLGroup)
			if !ok {
				t.Fatalf("rank %d %v group is a %T, want *NCCLGroup", rk.Rank, k, g)
			}
			if ng.Rank() != place || ng.Size() != len(members) || ng.name != k.String() || ng.comm != s.comms[i][k] {
				t.Errorf("rank %d %v group: rank %d of %d named %q, want %d of %d", rk.Rank, k, ng.Rank(), ng.Size(), ng.name, place, len(members))
			}
		}
	}
	// Ranks 4 and 6 (dp 1, cp 0, ep 0 and 1) are one expert communicator
	// and share an abort; ranks 5 and 7 (cp 1) are another.
	reason := errors.New("rank 4 failed")
	ranks[0].Expert.Abort(reason)
	for i, want := range []bool{true, false, true, false} {
		if got := ranks[i].Expert.(*NCCLGroup).state.aborted.Load(); got != want {
			t.Errorf("rank %d's expert group aborted: %v, want %v", first+i, got, want)
		}
		if !ranks[i].World.(*NCCLGroup).state.is(nil) {
			t.Errorf("rank %d's world group was aborted with the expert group", first+i)
		}
	}
	ranks[3].World.Abort(reason)
	for i := range per {
		if err := ranks[i].World.Barrier(); !errors.Is(err, reason) {
			t.Errorf("rank %d's world Barrier after a local member's Abort: %v", first+i, err)
		}
	}
}

// TestNodeRanksChecks: bad arguments fail before libnccl is loaded.
func TestNodeRanksChecks(t *testing.T) {
	m := comm.Mesh{DP: 2, EP: 2, CP: 1, TP: 1}
	id := randomID(9)
	two := []*Backend{closedBackend(0), closedBackend(1)}
	for _, c := range []struct {
		node NCCLNode
		want string
	}{
		{NCCLNode{Mesh: m, NodeRank: 0, NNodes: 3, Backends: two, ID: id}, "4 ranks do not split evenly over 3 nodes"},
		{NCCLNode{Mesh: m, NodeRank: 1, NNodes: 2, Backends: two[:1], ID: id}, "1 backends for the 2 ranks node 1 hosts"},
		{NCCLNode{Mesh: m, NodeRank: 1, NNodes: 2, Backends: []*Backend{two[0], nil}, ID: id}, "backend 1 is nil"},
		{NCCLNode{Mesh: m, NodeRank: 0, NNodes: 2, Backends: []*Backend{two[1], two[1]}, ID: id}, "backends 0 and 1 are both on GPU 1"},
		{NCCLNode{Mesh: m, NodeRank: 0, NNodes: 2, Backends: two}, "the NCCL unique id is all zeros"},
	} {
		if _, _, err := NCCLNodeRanks(context.Background(), c.node); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("node %d of %d: got %v, want %q", c.node.NodeRank, c.node.NNodes, err, c.want)
		}
	}
}

// TestRunLocalRanks: the joins run together; the first error or the end of
// ctx returns at once, without waiting for a join that blocks; on failure
// every join's cleanup runs on its goroutine (the blocked one's once it
// returns), and on success none does.
func TestRunLocalRanks(t *testing.T) {
	var mu sync.Mutex
	var cleaned []int
	cleanup := func(i int) func(error) {
		return func(error) {
			mu.Lock()
			defer mu.Unlock()
			cleaned = append(cleaned, i)
		}
	}
	cleanedSorted := func() []int {
		mu.Lock()
		defer mu.Unlock()
		return slices.Sorted(slices.Values(cleaned))
	}
	waitCleaned := func(want []int) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for !slices.Equal(cleanedSorted(), want) {
			if time.Now().After(deadline) {
				t.Fatalf("cleaned up %v, want %v", cleanedSorted(), want)
			}
			time.Sleep(time.Millisecond)
		}
	}

	// Every join waits for all to start, as NCCL's inits do.
	var started sync.WaitGroup
	started.Add(3)
	err := runLocalRanks(context.Background(), 3, func(i int) (func(error), error) {
		started.Done()
		started.Wait()
		return cleanup(i), nil
	})
	time.Sleep(20 * time.Millisecond)
	if err != nil || len(cleanedSorted()) != 0 {
		t.Fatalf("success: %v, cleaned up %v", err, cleanedSorted())
	}

	// Rank 1 fails while rank 2 is blocked and rank 0 is done.
	release := make(chan struct{})
	zeroDone := make(chan struct{})
	boom := errors.New("rank 1: ncclCommInitRank failed")
	start := time.Now()
	err = runLocalRanks(context.Background(), 3, func(i int) (func(error), error) {
		switch i {
		case 0:
			defer close(zeroDone)
			return cleanup(i), nil
		case 1:
			<-zeroDone
			return cleanup(i), boom
		}
		<-release
		return cleanup(i), nil
	})
	if err != boom || time.Since(start) > 2*time.Second {
		t.Fatalf("got %v after %v, want rank 1's error at once", err, time.Since(start))
	}
	waitCleaned([]int{0, 1})
	close(release)
	waitCleaned([]int{0, 1, 2})

	// The context ends while every join blocks.
	cleaned = nil
	ctx, cancel := context.WithCancelCause(context.Background())
	lost := errors.New("node 1 (host b) left the run")
	time.AfterFunc(20*time.Millisecond, func() { cancel(lost) })
	release = make(chan struct{})
	err = runLocalRanks(ctx, 2, func(i int) (func(error), error) {
		<-release
		return cleanup(i), nil
	})
	if err != lost {
		t.Fatalf("got %v, want the context's cause", err)
	}
	close(release)
	waitCleaned([]int{0, 1})
}
