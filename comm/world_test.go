package comm_test

// Tests of the multi-process protocol (world.go, remote_group.go) over
// in-memory links on a logical clock: no sockets, no sleeps. Time passes
// only by FakeClock.Advance; after a step, BlockUntil says every goroutine
// that waits on the clock has got back to its wait (so the step's work is
// done), and Quiesce that every frame sent has been handled.

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
)

// Logical timings: a beat a second, a peer silent for three is lost.
func memTimings() comm.MemConfig {
	return comm.MemConfig{Heartbeat: time.Second, HeartbeatTimeout: 3 * time.Second, OpTimeout: time.Hour}
}

// memWorlds starts a world of nodes over in-memory links and closes it
// when the test ends.
func memWorlds(t *testing.T, m comm.Mesh, nodes int, b backend.Backend, c comm.MemConfig) ([]*comm.TCPWorld, *comm.FakeClock, *comm.MemNet) {
	t.Helper()
	worlds, clk, mn, err := comm.MemWorlds(m, nodes, b, c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		var wg sync.WaitGroup
		for _, w := range worlds {
			wg.Go(func() { w.Close() })
		}
		waitOrFail(t, &wg, 5*time.Second)
	})
	// Every node beats to every other node: one timer per ordered pair.
	if !clk.BlockUntil(nodes * (nodes - 1)) {
		t.Fatalf("the heartbeat loops did not start: %d timers pending, want %d", clk.Pending(), nodes*(nodes-1))
	}
	return worlds, clk, mn
}

// step advances the clock by d and waits until the nodes have done what
// falls due: want timers pending again, every frame handled.
func step(t *testing.T, clk *comm.FakeClock, mn *comm.MemNet, d time.Duration, want int) {
	t.Helper()
	clk.Advance(d)
	if !clk.BlockUntil(want) {
		t.Fatalf("after a step of %v, %d timers are pending, want %d", d, clk.Pending(), want)
	}
	if !mn.Quiesce() {
		t.Fatal("a frame sent was never handled")
	}
}

func allRanks(worlds []*comm.TCPWorld) []*comm.Ranks {
	var out []*comm.Ranks
	for _, w := range worlds {
		out = append(out, w.Ranks()...)
	}
	return out
}

// Every collective of every group gives every rank bitwise what the same
// layout gives as virtual ranks, for several world sizes and node counts.
func TestMemWorldMatchesLocal(t *testing.T) {
	b := cpu.New(backend.Float32)
	for _, tc := range []struct {
		m     comm.Mesh
		nodes int
	}{
		{comm.Mesh{DP: 2, EP: 1, CP: 1, TP: 1}, 2},
		{comm.Mesh{DP: 3, EP: 1, CP: 1, TP: 1}, 3},
		{comm.Mesh{DP: 2, EP: 2, CP: 1, TP: 1}, 4},
		{comm.Mesh{DP: 1, EP: 4, CP: 1, TP: 1}, 2},
		{comm.Mesh{DP: 2, EP: 2, CP: 2, TP: 1}, 4},
	} {
		t.Run(fmt.Sprintf("dp%d_ep%d_cp%d_nodes%d", tc.m.DP, tc.m.EP, tc.m.CP, tc.nodes), func(t *testing.T) {
			local := newLocal(t, tc.m, b)
			worlds, _, _ := memWorlds(t, tc.m, tc.nodes, b, memTimings())
			remote := allRanks(worlds)
			want := make([][]uint64, len(local))
			got := make([][]uint64, len(remote))
			for round := range 2 {
				seed := uint64(20 + round)
				runRanks(t, local, func(r *comm.Ranks) (err error) { want[r.Rank], err = script(b, r, seed); return })
				runRanks(t, remote, func(r *comm.Ranks) (err error) { got[r.Rank], err = script(b, r, seed); return })
				for r := range want {
					if fmt.Sprint(got[r]) != fmt.Sprint(want[r]) {
						t.Fatalf("round %d rank %d: in-memory links give\n%v\nvirtual ranks give\n%v", round, r, got[r], want[r])
					}
				}
			}
			for i, w := range worlds {
				if err := w.Err(); err != nil {
					t.Fatalf("node %d failed: %v", i, err)
				}
			}
		})
	}
}

// AllToAllRows with uneven splits between ranks of one node and of
// different nodes.
func TestMemWorldAllToAllRows(t *testing.T) {
	b := cpu.New(backend.Float64)
	worlds, _, _ := memWorlds(t, comm.Mesh{DP: 1, EP: 6, CP: 1, TP: 1}, 3, b, memTimings())
	testAllToAllRows(t, rand.New(rand.NewPCG(6, 6)), b, allRanks(worlds), 2)
}

// Nodes that hear each other's heartbeats stay alive however long they
// wait: a world idle for many heartbeat timeouts does not fail.
func TestMemWorldHeartbeatsKeepPeersAlive(t *testing.T) {
	b := cpu.New(backend.Float32)
	worlds, clk, mn := memWorlds(t, comm.Mesh{DP: 3, EP: 1, CP: 1, TP: 1}, 3, b, memTimings())
	for range 20 {
		step(t, clk, mn, time.Second, 6)
	}
	for i, w := range worlds {
		if err := w.Err(); err != nil {
			t.Fatalf("node %d failed while every node beats: %v", i, err)
		}
	}
	runRanks(t, allRanks(worlds), func(r *comm.Ranks) error { return r.World.Barrier() })
}

// A node that goes silent (cut off the network: no frame, no closed link)
// is found lost at the first beat HeartbeatTimeout after the last frame
// heard from it, and not before; the ranks that wait for it are released
// with an error naming it and its ranks.
func TestMemWorldSilentPeerIsLost(t *testing.T) {
	b := cpu.New(backend.Float32)
	worlds, clk, mn := memWorlds(t, comm.Mesh{DP: 3, EP: 1, CP: 1, TP: 1}, 3, b, memTimings())
	step(t, clk, mn, time.Second, 6) // a beat heard from everyone at t=1

	// Ranks 0 and 2 wait in the world group for rank 1: two more timers
	// (their waits' OpTimeout).
	var wg sync.WaitGroup
	waitErrs := make([]error, 3)
	for _, r := range []int{0, 2} {
		wg.Go(func() { waitErrs[r] = worlds[r].Ranks()[0].World.Barrier() })
	}
	if !clk.BlockUntil(8) {
		t.Fatalf("ranks 0 and 2 are not waiting: %d timers pending, want 8", clk.Pending())
	}
	mn.Cut(1)

	// t=2, 3: silent for 1s and 2s, under the 3s timeout.
	for silence := 1; silence <= 2; silence++ {
		step(t, clk, mn, time.Second, 8)
		for i, w := range worlds {
			if err := w.Err(); err != nil {
				t.Fatalf("node %d failed after %ds of silence, before the 3s timeout: %v", i, silence, err)
			}
		}
	}
	// t=4: 3s since node 1's last beat.
	clk.Advance(time.Second)
	for _, i := range []int{0, 2} {
		select {
		case <-worlds[i].Failed():
		case <-time.After(5 * time.Second):
			t.Fatalf("node %d did not find node 1 lost after 3s of silence", i)
		}
		if err := worlds[i].Err(); !strings.Contains(err.Error(), "lost node 1 (rank 1)") || !strings.Contains(err.Error(), "silent for 3s") {
			t.Fatalf("node %d: got %v, want node 1 lost for its silence", i, err)
		}
	}
	waitOrFail(t, &wg, 5*time.Second)
	for _, r := range []int{0, 2} {
		if err := waitErrs[r]; err == nil || !strings.Contains(err.Error(), "lost node 1 (rank 1)") {
			t.Fatalf("rank %d: got %v, want an error naming node 1", r, err)
		}
	}
}

// A node whose links drop (its process died) fails the ranks that wait
// for it at once, without any time passing.
func TestMemWorldDeadPeerIsNamed(t *testing.T) {
	b := cpu.New(backend.Float32)
	worlds, clk, _ := memWorlds(t, comm.Mesh{DP: 3, EP: 2, CP: 1, TP: 1}, 3, b, memTimings())
	var wg sync.WaitGroup
	waitErrs := make([]error, 4)
	for n := range 2 {
		for _, r := range worlds[n].Ranks() {
			wg.Go(func() { waitErrs[r.Rank] = r.World.Barrier() })
		}
	}
	// Six heartbeat loops and the waits: the root (rank 0) waits for one
	// message at a time, ranks 1-3 for the root's answer.
	if !clk.BlockUntil(6 + 4) {
		t.Fatalf("ranks 0-3 are not waiting: %d timers pending", clk.Pending())
	}
	worlds[2].Cut()
	waitOrFail(t, &wg, 5*time.Second)
	for r, err := range waitErrs {
		if err == nil || !strings.Contains(err.Error(), "lost node 2 (ranks 4-5): connection closed") {
			t.Fatalf("rank %d: got %v, want an error naming node 2 and ranks 4-5", r, err)
		}
	}
}

// A peer that is alive but never reaches the collective fails the wait
// after OpTimeout exactly, naming it, and the other node hears of it.
func TestMemWorldOpTimeout(t *testing.T) {
	b := cpu.New(backend.Float32)
	c := memTimings()
	c.OpTimeout = 10 * time.Second
	worlds, clk, mn := memWorlds(t, comm.Mesh{DP: 2, EP: 1, CP: 1, TP: 1}, 2, b, c)
	done := make(chan error, 1)
	go func() { done <- worlds[0].Ranks()[0].World.Barrier() }()
	if !clk.BlockUntil(3) {
		t.Fatalf("rank 0 is not waiting: %d timers pending", clk.Pending())
	}
	for range 9 {
		step(t, clk, mn, time.Second, 3)
		select {
		case err := <-done:
			t.Fatalf("the wait ended before OpTimeout: %v", err)
		default:
		}
	}
	clk.Advance(time.Second)
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "waited 10s for a message from rank 1 (node 1)") {
			t.Fatalf("got %v, want a timeout naming rank 1", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the wait did not end at OpTimeout")
	}
	select {
	case <-worlds[1].Failed():
	case <-time.After(5 * time.Second):
		t.Fatal("node 1 was not told of the failure")
	}
}

// Abort on one node releases the ranks of another node that wait in any
// group, with the abort's reason; later collectives fail too.
func TestMemWorldAbortPropagates(t *testing.T) {
	b := cpu.New(backend.Float32)
	worlds, clk, _ := memWorlds(t, comm.Mesh{DP: 2, EP: 2, CP: 1, TP: 1}, 2, b, memTimings())
	ranks := allRanks(worlds)
	errs := make([]error, 3)
	var wg sync.WaitGroup
	wg.Go(func() { errs[0] = ranks[0].World.Barrier() })
	wg.Go(func() { errs[1] = ranks[1].Expert.AllReduceSum(b.New(backend.Float32, 3)) })
	wg.Go(func() { errs[2] = ranks[2].ExpertReplica.Recv(b.New(backend.Float32, 3), 0) })
	if !clk.BlockUntil(2 + 3) {
		t.Fatalf("ranks 0-2 are not waiting: %d timers pending", clk.Pending())
	}
	ranks[3].Abort(errors.New("rank 3 ran out of memory"))
	waitOrFail(t, &wg, 5*time.Second)
	for i, err := range errs {
		if err == nil || !strings.Contains(err.Error(), "rank 3 ran out of memory") {
			t.Fatalf("rank %d: got %v, want the abort's reason", i, err)
		}
	}
	if err := ranks[0].Data.Barrier(); err == nil || !strings.Contains(err.Error(), "rank 3 ran out of memory") {
		t.Fatalf("a collective after the abort: got %v", err)
	}
}

// A finished node's goodbye does not fail the others; a rank that still
// waits for it is told it left.
func TestMemWorldGoodbye(t *testing.T) {
	b := cpu.New(backend.Float32)
	worlds, _, _ := memWorlds(t, comm.Mesh{DP: 2, EP: 1, CP: 1, TP: 1}, 2, b, memTimings())
	runRanks(t, allRanks(worlds), func(r *comm.Ranks) error { return r.World.Barrier() })
	closed := make(chan struct{})
	go func() { worlds[1].Close(); close(closed) }() // lingers until node 0 closes too
	err := worlds[0].Ranks()[0].World.Barrier()
	if err == nil || !strings.Contains(err.Error(), "node 1 (rank 1) has left the run") {
		t.Fatalf("got %v", err)
	}
	if err := worlds[0].Err(); err != nil {
		t.Fatalf("a goodbye failed the world: %v", err)
	}
	worlds[0].Close()
	<-closed
}
