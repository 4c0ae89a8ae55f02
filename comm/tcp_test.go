package comm_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
)

// tcpOpts adjusts the configs of a test's TCP worlds.
type tcpOpts struct {
	opTimeout time.Duration
	dial      time.Duration
}

// testSecret is the tests' run secret.
var testSecret = []byte("the tests' shared secret")

// startTCP starts the nodes of a TCP world in this process, each with its
// own loopback listener, and returns each node's world (nil for the nodes
// in skip, which never start) and the errors of NewTCPRanks.

func startTCP(t *testing.T, m comm.Mesh, nodes int, b backend.Backend, o tcpOpts, skip ...int) ([]*comm.TCPWorld, []error) {
	t.Helper()
	lns := make([]net.Listener, nodes)
	addrs := make([]string, nodes)
	for i := range lns {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns[i], addrs[i] = ln, ln.Addr().String()
	}
	id := comm.RunIDFromBlob(comm.NewRunBlob())
	worlds := make([]*comm.TCPWorld, nodes)
	errs := make([]error, nodes)
	var wg sync.WaitGroup
	for i := range nodes {
		skipped := false
		for _, s := range skip {
			skipped = skipped || s == i
		}
		if skipped {
			lns[i].Close()
			continue
		}
		wg.Go(func() {
			worlds[i], errs[i] = comm.NewTCPRanks(context.Background(), comm.TCPConfig{
				Mesh: m, Backend: b, NodeRank: i, Addrs: addrs, Listener: lns[i], RunID: id, Secret: testSecret,
				DialTimeout: o.dial, Heartbeat: 50 * time.Millisecond, HeartbeatTimeout: time.Second, OpTimeout: o.opTimeout,
			})
		})
	}
	wg.Wait()
	t.Cleanup(func() {
		var cw sync.WaitGroup
		for _, w := range worlds {
			if w != nil {
				cw.Go(func() { w.Close() })
			}
		}
		cw.Wait()
	})
	return worlds, errs
}

// tcpRanks is a TCP world's ranks, all nodes in this process, by world rank.
func tcpRanks(t *testing.T, m comm.Mesh, nodes int, b backend.Backend) []*comm.Ranks {
	t.Helper()
	worlds, errs := startTCP(t, m, nodes, b, tcpOpts{})
	var out []*comm.Ranks
	for i, w := range worlds {
		if errs[i] != nil {
			t.Fatalf("node %d: %v", i, errs[i])
		}
		out = append(out, w.Ranks()...)
	}
	for r, rk := range out {
		if rk.Rank != r {
			t.Fatalf("rank %d of the TCP world is at index %d", rk.Rank, r)
		}
	}
	return out
}

// script runs every collective on every group of r with inputs drawn from
// seed and r's rank, and returns everything it received, as bit patterns.
func script(b backend.Backend, r *comm.Ranks, seed uint64) ([]uint64, error) {
	rng := rand.New(rand.NewPCG(seed, uint64(r.Rank)))
	var log []uint64
	logT := func(t backend.Tensor) {
		for _, v := range get(b, t) {
			log = append(log, math.Float64bits(v))
		}
	}
	groups := []comm.Group{r.World, r.Data, r.Expert, r.ExpertReplica, r.Context, r.DataContext}
	for gi, g := range groups {
		n := 5 + gi
		// AllReduceSum on a view, as a gradient bucket is.
		base := b.New(backend.Float32, n+2)
		set(b, base, randVals(rng, n+2))
		v := b.View(base, 1, n)
		if err := g.AllReduceSum(v); err != nil {
			return nil, err
		}
		logT(base)
		f := randVals(rng, 3)
		if err := g.AllReduceFloat64(f); err != nil {
			return nil, err
		}
		for _, x := range f {
			log = append(log, math.Float64bits(x))
		}
		send := make([]int, g.Size())
		for j := range send {
			send[j] = rng.IntN(100)
		}
		got, err := g.AllToAllInts(send)
		if err != nil {
			return nil, err
		}
		for _, x := range got {
			log = append(log, uint64(x))
		}
		// ReduceScatterSum in place, then AllGather back in place.
		whole := b.New(backend.Float32, 3*g.Size())
		set(b, whole, randVals(rng, 3*g.Size()))
		mine := b.View(whole, 3*g.Rank(), 3)
		if err := g.ReduceScatterSum(mine, whole); err != nil {
			return nil, err
		}
		logT(mine)
		if err := g.AllGather(whole, mine); err != nil {
			return nil, err
		}
		logT(whole)
		if err := g.Barrier(); err != nil {
			return nil, err
		}
		// Send/Recv between pairs (0,1), (2,3), ...
		if peer := g.Rank() ^ 1; peer < g.Size() {
			out, in := b.New(backend.Int32, 4), b.New(backend.Int32, 4)
			set(b, out, []float64{float64(r.Rank), float64(gi), 7, -3})
			first, second := func() error { return g.Send(out, peer) }, func() error { return g.Recv(in, peer) }
			if g.Rank()%2 == 1 {
				first, second = second, first
			}
			if err := first(); err != nil {
				return nil, err
			}
			if err := second(); err != nil {
				return nil, err
			}
			logT(in)
		}
	}
	return log, nil
}

// A layout split over processes gives every rank bitwise what the same
// layout gives as virtual ranks, for every collective of every group.
func TestTCPMatchesLocal(t *testing.T) {
	b := cpu.New(backend.Float32)
	for _, tc := range []struct {
		m     comm.Mesh
		nodes int
	}{
		{comm.Mesh{DP: 2, EP: 1, CP: 1, TP: 1}, 2},
		{comm.Mesh{DP: 2, EP: 2, CP: 1, TP: 1}, 2},
		{comm.Mesh{DP: 1, EP: 4, CP: 1, TP: 1}, 4},
		{comm.Mesh{DP: 2, EP: 1, CP: 2, TP: 1}, 2},
	} {
		name := fmt.Sprintf("dp%d_ep%d_cp%d_nodes%d", tc.m.DP, tc.m.EP, tc.m.CP, tc.nodes)
		t.Run(name, func(t *testing.T) {
			local := newLocal(t, tc.m, b)
			remote := tcpRanks(t, tc.m, tc.nodes, b)
			want := make([][]uint64, len(local))
			got := make([][]uint64, len(remote))
			for round := range 3 {
				seed := uint64(10 + round)
				runRanks(t, local, func(r *comm.Ranks) (err error) { want[r.Rank], err = script(b, r, seed); return })
				runRanks(t, remote, func(r *comm.Ranks) (err error) { got[r.Rank], err = script(b, r, seed); return })
				for r := range want {
					if fmt.Sprint(got[r]) != fmt.Sprint(want[r]) {
						t.Fatalf("round %d rank %d: TCP gives\n%v\nvirtual ranks give\n%v", round, r, got[r], want[r])
					}
				}
			}
		})
	}
}

// AllToAllRows with uneven splits (zero rows included), between ranks of
// one node and of different nodes, for every dtype.
func TestTCPAllToAllRows(t *testing.T) {
	b := cpu.New(backend.Float64)
	ranks := tcpRanks(t, comm.Mesh{DP: 1, EP: 4, CP: 1, TP: 1}, 2, b)
	testAllToAllRows(t, rand.New(rand.NewPCG(5, 5)), b, ranks, 3)
}

// Arguments that disagree between ranks fail on every rank with the same
// error, whichever rank is wrong, and the group stays usable.
func TestTCPArgumentErrorsFailEverywhere(t *testing.T) {
	b := cpu.New(backend.Float32)
	ranks := tcpRanks(t, comm.Mesh{DP: 1, EP: 3, CP: 1, TP: 1}, 3, b)
	cases := []struct {
		name string
		call func(r *comm.Ranks) error
		want string
	}{
		{"lengths", func(r *comm.Ranks) error {
			return r.World.AllReduceSum(b.New(backend.Float32, 4+boolInt(r.Rank == 2)))
		}, "rank 2 has 5 elements"},
		{"dtype", func(r *comm.Ranks) error {
			dt := backend.Float32
			if r.Rank == 1 {
				dt = backend.Int32
			}
			return r.World.AllReduceSum(b.New(dt, 4))
		}, "rank 1: cannot sum a int32 tensor"},
		{"order", func(r *comm.Ranks) error {
			if r.Rank == 1 {
				return r.World.Barrier()
			}
			_, err := r.World.AllToAllInts([]int{1, 2, 3})
			return err
		}, "rank 1 called Barrier while rank 0 called AllToAllInts"},
		{"plan", func(r *comm.Ranks) error {
			send := []int{1, 1, 1}
			recv := []int{1, 1, 1}
			if r.Rank == 0 {
				send = []int{1, 2, 1}
			}
			rows := 0
			for _, c := range send {
				rows += c
			}
			return r.World.AllToAllRows(b.New(backend.Float32, 3, 2), b.New(backend.Float32, rows, 2), recv, send)
		}, "rank 0 sends 2 rows to rank 1, which expects 1"},
	}
	for _, tc := range cases {
		errs := make([]error, len(ranks))
		var wg sync.WaitGroup
		for i, r := range ranks {
			wg.Go(func() { errs[i] = tc.call(r) })
		}
		waitOrFail(t, &wg, 5*time.Second)
		for i, err := range errs {
			if err == nil || !strings.Contains(err.Error(), tc.want) || err.Error() != errs[0].Error() {
				t.Fatalf("%s: rank %d: got %v, want the same error on every rank, containing %q (rank 0: %v)", tc.name, i, err, tc.want, errs[0])
			}
		}
		// The group goes on.
		runRanks(t, ranks, func(r *comm.Ranks) error { return r.World.Barrier() })
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func waitOrFail(t *testing.T, wg *sync.WaitGroup, d time.Duration) {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("ranks did not return within %v: a wait is unbounded", d)
	}
}

// Abort on one node releases the ranks of another node that wait in any
// group, with the abort's reason.
func TestTCPAbortReleasesOtherNodes(t *testing.T) {
	b := cpu.New(backend.Float32)
	ranks := tcpRanks(t, comm.Mesh{DP: 2, EP: 2, CP: 1, TP: 1}, 2, b)
	errs := make([]error, 3)
	var wg sync.WaitGroup
	wg.Go(func() { errs[0] = ranks[0].World.Barrier() })
	wg.Go(func() { errs[1] = ranks[1].Expert.AllReduceSum(b.New(backend.Float32, 3)) })
	wg.Go(func() { errs[2] = ranks[2].ExpertReplica.Recv(b.New(backend.Float32, 3), 0) })
	time.Sleep(50 * time.Millisecond)
	ranks[3].Abort(errors.New("rank 3 ran out of memory"))
	waitOrFail(t, &wg, 5*time.Second)
	for i, err := range errs {
		if err == nil || !strings.Contains(err.Error(), "rank 3 ran out of memory") {
			t.Fatalf("rank %d: got %v, want the abort's reason", i, err)
		}
	}
	if err := ranks[0].Data.Barrier(); err == nil {
		t.Fatal("a collective after the abort succeeded")
	}
}

// A node that dies (its connections drop without a goodbye) fails every
// pending operation of the other nodes, naming the lost node and its
// ranks, at once.
func TestTCPLostNodeIsNamed(t *testing.T) {
	b := cpu.New(backend.Float32)
	worlds, errs := startTCP(t, comm.Mesh{DP: 3, EP: 2, CP: 1, TP: 1}, 3, b, tcpOpts{})
	for i, err := range errs {
		if err != nil {
			t.Fatalf("node %d: %v", i, err)
		}
	}
	// Ranks 0-3 (nodes 0 and 1) wait for ranks 4 and 5 in the world group.
	var wg sync.WaitGroup
	waitErrs := make([]error, 4)
	for n := range 2 {
		for _, r := range worlds[n].Ranks() {
			wg.Go(func() { waitErrs[r.Rank] = r.World.Barrier() })
		}
	}
	time.Sleep(50 * time.Millisecond)
	start := time.Now()
	worlds[2].Cut()
	waitOrFail(t, &wg, 5*time.Second)
	for r, err := range waitErrs {
		if err == nil || !strings.Contains(err.Error(), "lost node 2 (ranks 4-5)") {
			t.Fatalf("rank %d: got %v, want an error naming node 2 and ranks 4-5", r, err)
		}
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("the loss took %v to notice", d)
	}
}

// A peer that is alive but never reaches the collective fails the wait
// after OpTimeout, naming it.
func TestTCPOpTimeout(t *testing.T) {
	b := cpu.New(backend.Float32)
	worlds, errs := startTCP(t, comm.Mesh{DP: 2, EP: 1, CP: 1, TP: 1}, 2, b, tcpOpts{opTimeout: 300 * time.Millisecond})
	for i, err := range errs {
		if err != nil {
			t.Fatalf("node %d: %v", i, err)
		}
	}
	err := worlds[0].Ranks()[0].World.Barrier()
	if err == nil || !strings.Contains(err.Error(), "from rank 1 (node 1)") {
		t.Fatalf("got %v, want a timeout naming rank 1", err)
	}
	// The other node hears of it.
	select {
	case <-worlds[1].Failed():
	case <-time.After(2 * time.Second):
		t.Fatal("node 1 was not told of the failure")
	}
}

// A node that never comes makes the others fail at the dial deadline,
// naming it.
func TestTCPMissingNodeIsNamed(t *testing.T) {
	b := cpu.New(backend.Float32)
	start := time.Now()
	_, errs := startTCP(t, comm.Mesh{DP: 3, EP: 1, CP: 1, TP: 1}, 3, b, tcpOpts{dial: 500 * time.Millisecond}, 1)
	for _, i := range []int{0, 2} {
		if errs[i] == nil || !strings.Contains(errs[i].Error(), "node 1") {
			t.Fatalf("node %d: got %v, want an error naming node 1", i, errs[i])
		}
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("took %v", d)
	}
}

// A process of another run (a different run id) is refused.
func TestTCPRefusesAnotherRun(t *testing.T) {
	b := cpu.New(backend.Float32)
	ln0, _ := net.Listen("tcp", "127.0.0.1:0")
	ln1, _ := net.Listen("tcp", "127.0.0.1:0")
	addrs := []string{ln0.Addr().String(), ln1.Addr().String()}
	m := comm.Mesh{DP: 2, EP: 1, CP: 1, TP: 1}
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for i, ln := range []net.Listener{ln0, ln1} {
		wg.Go(func() {
			var w *comm.TCPWorld
			w, errs[i] = comm.NewTCPRanks(context.Background(), comm.TCPConfig{
				Mesh: m, Backend: b, NodeRank: i, Addrs: addrs, Listener: ln,
				RunID: comm.RunIDFromBlob(comm.NewRunBlob()), Secret: testSecret, DialTimeout: 500 * time.Millisecond,
			})
			if w != nil {
				w.Close()
			}
		})
	}
	wg.Wait()
	if errs[1] == nil || !strings.Contains(errs[1].Error(), "another run") {
		t.Fatalf("node 1: got %v, want a refusal naming another run", errs[1])
	}
	if errs[0] == nil || !strings.Contains(errs[0].Error(), "node 1 did not connect") {
		t.Fatalf("node 0: got %v", errs[0])
	}
}

// Bad configurations are refused with the field named.
func TestTCPConfigErrors(t *testing.T) {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	_, err := comm.NewTCPRanks(context.Background(), comm.TCPConfig{
		Mesh: comm.Mesh{DP: 3, EP: 1, CP: 1, TP: 1}, Backend: cpu.New(backend.Float32),
		Addrs: []string{"a:1", "b:2"}, Listener: ln,
	})
	if err == nil || !strings.Contains(err.Error(), "does not split evenly over 2 nodes") {
		t.Fatalf("got %v", err)
	}
}

// A finished node's goodbye does not fail the others; a rank that still
// waits for it is told it left.
func TestTCPGoodbye(t *testing.T) {
	b := cpu.New(backend.Float32)
	worlds, errs := startTCP(t, comm.Mesh{DP: 2, EP: 1, CP: 1, TP: 1}, 2, b, tcpOpts{})
	for i, err := range errs {
		if err != nil {
			t.Fatalf("node %d: %v", i, err)
		}
	}
	runRanks(t, []*comm.Ranks{worlds[0].Ranks()[0], worlds[1].Ranks()[0]}, func(r *comm.Ranks) error { return r.World.Barrier() })
	worlds[1].Close()
	err := worlds[0].Ranks()[0].World.Barrier()
	if err == nil || !strings.Contains(err.Error(), "node 1 (rank 1) has left the run") {
		t.Fatalf("got %v", err)
	}
	if err := worlds[0].Err(); err != nil {
		t.Fatalf("a goodbye failed the world: %v", err)
	}
}
