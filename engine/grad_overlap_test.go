package engine

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
)

// The buckets tile each part of the store exactly, in order, none longer
// than the limit, and none starts before every tensor in it is final; the
// tensors other than the norms start exactly when they are final, so the
// reduction overlaps as much as the layer granularity allows.
func TestGradBucketsTileParts(t *testing.T) {
	m := equivalenceConfig().Model
	m.Layers, m.MoE.SharedExperts = 3, 1
	lay := newFlatLayout(m, 2)
	for _, tc := range []struct {
		name       string
		part       span
		maxElems   int
		wantFinals []int // with no cut by length
	}{
		// norms, embedding, layers 0..2, LM head.
		{"replicated", lay.replicated, gradBucket, []int{0, -1, 0, 1, 2, 3}},
		{"experts", lay.experts, gradBucket, []int{0, 1, 2}},
		{"replicated cut", lay.replicated, 1000, nil},
		{"experts cut", lay.experts, 1000, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bs := cutBuckets(m, lay, tc.part, tc.maxElems)
			at := tc.part.lo
			var finals []int
			for i, b := range bs {
				if b.r.lo != at || b.r.empty() || b.r.hi-b.r.lo > tc.maxElems {
					t.Fatalf("bucket %d is %v after %d; want a range from %d of 1 to %d elements", i, b.r, at, at, tc.maxElems)
				}
				at = b.r.hi
				finals = append(finals, b.final)
				for j, s := range lay.slots {
					off := lay.offset[j]
					if off >= b.r.hi || off+flatLen(lay.shape[j]) <= b.r.lo {
						continue
					}
					want := slotFinal(m, s)
					if b.final > want || (s.role != roleNorm && b.final != want) {
						t.Errorf("bucket %d %v (final after layer %d) holds %s, final after layer %d", i, b.r, b.final, s.name, want)
					}
				}
			}
			if at != tc.part.hi {
				t.Fatalf("the buckets end at %d, the part at %d", at, tc.part.hi)
			}
			if tc.wantFinals != nil && fmt.Sprint(finals) != fmt.Sprint(tc.wantFinals) {
				t.Errorf("buckets final after layers %v, want %v", finals, tc.wantFinals)
			}
		})
	}
}

func flatLen(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}

// overlapLayouts: data parallel with gradient accumulation (the overlap
// must wait for the last micro-batch), data x expert parallel with and
// without it, and context parallel (whose expert sums over the context
// group run after the backward).
var overlapLayouts = []struct{ dp, ep, cp, micro int }{
	{2, 1, 1, 2}, {2, 2, 1, 1}, {2, 2, 1, 2}, {2, 1, 2, 2}, {1, 2, 2, 4},
}

// The reduction overlapped with the backward gives bitwise the steps of
// the reduction after it (syncGrads), on virtual ranks, whose groups
// reduce at once (so a bucket started before its gradients were final
// would miss their last additions), and on two TCP nodes, whose groups
// reduce in the background while the backward goes on.
func TestGradOverlapMatchesSyncReduction(t *testing.T) {
	for _, l := range overlapLayouts {
		t.Run(fmt.Sprintf("dp%d_ep%d_cp%d_micro%d", l.dp, l.ep, l.cp, l.micro), func(t *testing.T) {
			cfg := equivalenceConfig()
			cfg.Parallel.DP, cfg.Parallel.EP, cfg.Parallel.CP, cfg.Train.MicroBatch = l.dp, l.ep, l.cp, l.micro
			cfg.Train.Steps = 3
			// The ranks are built here, not by Run, which settles "auto".
			cfg.Model.MoE.Dispatcher = moe.DispatcherUnfused
			cfg.Parallel.CPAttention = "allgather"
			b := cpu.New(backend.Float32)
			local := func() []*comm.Ranks {
				w, err := comm.NewLocal(cfg.mesh(), b)
				if err != nil {
					t.Fatal(err)
				}
				return w
			}
			want := stepResults(t, cfg, b, local(), true)
			for _, run := range []struct {
				name  string
				world []*comm.Ranks
			}{{"virtual ranks", local()}, {"tcp", tcpWorld(t, cfg.mesh(), 2, b)}} {
				got := stepResults(t, cfg, b, run.world, false)
				for i := range want {
					if got[i].loss != want[i].loss || got[i].gradNorm != want[i].gradNorm {
						t.Errorf("%s, step %d: loss %.9g, grad norm %.9g overlapped; %.9g, %.9g after the backward",
							run.name, i+1, got[i].loss, got[i].gradNorm, want[i].loss, want[i].gradNorm)
					}
				}
			}
		})
	}
}

// stepResults trains cfg.Train.Steps steps on the ranks of world (all of
// the mesh, in this process), calling trainStep directly with syncGrads
// set as asked, and returns world rank 0's results.
func stepResults(t *testing.T, cfg Config, b backend.Backend, world []*comm.Ranks, syncGrads bool) []stepResult {
	t.Helper()
	e, err := New(cfg, WithBackend(b))
	if err != nil {
		t.Fatal(err)
	}
	ranks := make([]*rank, len(world))
	for i, g := range world {
		train, val, err := e.openData(g.Data.Rank(), g.Data.Size())
		if err != nil {
			t.Fatal(err)
		}
		if ranks[i], err = newRank(context.Background(), cfg, b, g, train, val); err != nil {
			t.Fatal(err)
		}
		ranks[i].syncGrads = syncGrads
	}
	results := trainRanks(t, ranks, cfg.Train.Steps)
	for i, rs := range results {
		if world[i].Rank == 0 {
			return rs
		}
	}
	t.Fatal("no world rank 0")
	return nil
}

// tcpWorld is the mesh's ranks spread over nodes TCP nodes in this process,
// by world rank; the nodes close when the test ends.
func tcpWorld(t *testing.T, m comm.Mesh, nodes int, b backend.Backend) []*comm.Ranks {
	t.Helper()
	lns, addrs := make([]net.Listener, nodes), make([]string, nodes)
	for i := range lns {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns[i], addrs[i] = ln, ln.Addr().String()
	}
	id := comm.RunIDFromBlob(comm.NewRunBlob())
	worlds, errs := make([]*comm.TCPWorld, nodes), make([]error, nodes)
	var wg sync.WaitGroup
	for i := range nodes {
		wg.Go(func() {
			worlds[i], errs[i] = comm.NewTCPRanks(context.Background(), comm.TCPConfig{
				Mesh: m, Backend: b, NodeRank: i, Addrs: addrs, Listener: lns[i], RunID: id, Secret: []byte("the tests' shared secret"),
				DialTimeout: 10 * time.Second, Heartbeat: 100 * time.Millisecond, HeartbeatTimeout: 2 * time.Second,
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
	var out []*comm.Ranks
	for i, w := range worlds {
		if errs[i] != nil {
			t.Fatalf("node %d: %v", i, errs[i])
		}
		out = append(out, w.Ranks()...)
	}
	return out
}

// trainRanks runs steps training steps on every rank, each in its own
// goroutine as in a run, and returns every rank's results, indexed like
// ranks. A failing rank aborts the world so the others stop; a hang fails
// the test after a minute.
func trainRanks(t *testing.T, ranks []*rank, steps int) [][]stepResult {
	t.Helper()
	results := make([][]stepResult, len(ranks))
	errs := make([]error, len(ranks))
	var wg sync.WaitGroup
	for i, r := range ranks {
		wg.Go(func() {
			for step := 1; step <= steps; step++ {
				res, err := r.trainStep(step)
				if err != nil {
					errs[i] = err
					r.groups.World.Abort(err)
					return
				}
				results[i] = append(results[i], res)
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("the ranks did not finish their steps within a minute: a collective hangs")
	}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", i, err)
		}
	}
	return results
}
