package engine

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/data"
)

// nodeRun is one node's outcome in runNodes.
type nodeRun struct {
	losses []float64 // from the node's hook
	res    Result
	err    error
}

// runNodes trains cfg as a distributed run of len(runDirs) nodes in this
// process, each node an engine of its own with its own backend, talking
// over loopback TCP. runDirs[i] is node i's run directory ("" for none).
func runNodes(t *testing.T, cfg Config, runDirs []string, opts ...func(node int) []Option) []nodeRun {
	t.Helper()
	n := len(runDirs)
	lns := make([]net.Listener, n)
	addrs := make([]string, n)
	for i := range lns {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns[i], addrs[i] = ln, ln.Addr().String()
	}
	id := comm.RunIDFromBlob(comm.NewRunBlob())
	out := make([]nodeRun, n)
	var wg sync.WaitGroup
	for i := range n {
		o := []Option{WithBackend(cpu.New(backend.Float32)), WithHook(func(ev StepEvent) { out[i].losses = append(out[i].losses, ev.Loss) })}
		if runDirs[i] != "" {
			o = append(o, WithRunDir(runDirs[i]))
		}
		for _, f := range opts {
			o = append(o, f(i)...)
		}
		eng, err := New(cfg, o...)
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			out[i].res, out[i].err = eng.RunDistributed(context.Background(), Distributed{TCP: comm.TCPConfig{
				NodeRank: i, Addrs: addrs, Listener: lns[i], RunID: id, Secret: []byte("the tests' shared secret"),
				DialTimeout: 10 * time.Second, Heartbeat: 100 * time.Millisecond, HeartbeatTimeout: 2 * time.Second,
			}})
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("the nodes did not finish")
	}
	return out
}

// A layout trained by two nodes, each hosting some of its ranks, gives
// bitwise the losses of the same layout as virtual ranks; only the node of
// world rank 0 reports steps. The one exception is cp_attention ring: the
// TCP groups run the portable ring (attention/ring.go), virtual ranks the
// fused ring (their groups offer peer access), which gives the all-gather
// path's bits; the portable ring merges its partial softmaxes in ring
// order, so the two agree to rounding (measured 7e-10 relative after 3
// steps), not bitwise.
func TestDistributedMatchesVirtualRanks(t *testing.T) {
	for _, l := range []struct {
		dp, ep, cp, micro int
		cpAttention       string  // the ring over the TCP group's Send and Recv, or auto (allgather across nodes)
		tol               float64 // relative; 0: bitwise
	}{{2, 2, 1, 2, "auto", 0}, {1, 1, 2, 8, "auto", 0}, {2, 1, 1, 4, "auto", 0}, {1, 1, 2, 8, "ring", 1e-7}} {
		t.Run(fmt.Sprintf("dp%d_ep%d_cp%d_%s", l.dp, l.ep, l.cp, l.cpAttention), func(t *testing.T) {
			cfg := equivalenceConfig()
			cfg.Parallel.DP, cfg.Parallel.EP, cfg.Parallel.CP, cfg.Train.MicroBatch = l.dp, l.ep, l.cp, l.micro
			cfg.Parallel.CPAttention = l.cpAttention
			cfg.Train.Steps = 3
			want := trainLosses(t, cfg)
			runs := runNodes(t, cfg, []string{"", ""})
			for i, r := range runs {
				if r.err != nil {
					t.Fatalf("node %d: %v", i, r.err)
				}
				if r.res.Steps != cfg.Train.Steps || !lossesWithin([]float64{r.res.Loss}, want[len(want)-1:], l.tol) {
					t.Errorf("node %d: result %+v, want %d steps and loss %v", i, r.res, cfg.Train.Steps, want[len(want)-1])
				}
			}
			if !lossesWithin(runs[0].losses, want, l.tol) {
				t.Errorf("two nodes: losses %v, virtual ranks %v (relative tolerance %g)", runs[0].losses, want, l.tol)
			}
			if len(runs[1].losses) != 0 {
				t.Errorf("node 1 reported %d steps; only world rank 0 reports", len(runs[1].losses))
			}
		})
	}
}

// Node 0 writes a complete checkpoint, every rank's shard included, equal
// byte for byte to the virtual ranks' one; a shared run directory resumes
// on both nodes and continues the straight run's losses; a node that does
// not see the checkpoint is refused.
func TestDistributedCheckpoints(t *testing.T) {
	cfg := equivalenceConfig()
	cfg.Parallel.DP, cfg.Parallel.EP, cfg.Train.MicroBatch = 1, 2, 4
	// A schedule that does not depend on train.steps, which the resume raises.
	cfg.Train.Steps, cfg.Train.WarmupSteps, cfg.Train.Schedule = 4, 1, "constant"
	straight := t.TempDir()
	var want []float64
	eng, err := New(cfg, WithRunDir(straight), WithHook(func(ev StepEvent) { want = append(want, ev.Loss) }))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Run(context.Background()); err != nil {
		t.Fatal(err)
	}

	short := cfg
	short.Train.Steps = 2
	shared := t.TempDir()
	straight2 := t.TempDir()
	if eng, err = New(short, WithRunDir(straight2)); err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	runs := runNodes(t, short, []string{shared, shared})
	for i, r := range runs {
		if r.err != nil {
			t.Fatalf("node %d: %v", i, r.err)
		}
	}
	step2 := checkpoint.StepDirName(2)
	for _, f := range []string{checkpoint.ModelFile(0), checkpoint.ModelFile(1), checkpoint.OptimFile(0), checkpoint.OptimFile(1)} {
		w, err := os.ReadFile(filepath.Join(straight2, "checkpoints", step2, f))
		if err != nil {
			t.Fatal(err)
		}
		g, err := os.ReadFile(filepath.Join(shared, "checkpoints", step2, f))
		if err != nil || !bytes.Equal(g, w) {
			t.Fatalf("%s: the two nodes' checkpoint differs from the virtual ranks' (err %v)", f, err)
		}
	}
	if err := checkpoint.Verify(filepath.Join(shared, "checkpoints", step2)); err != nil {
		t.Fatal(err)
	}

	// Resume on both nodes from the shared directory.
	runs = runNodes(t, cfg, []string{shared, shared})
	for i, r := range runs {
		if r.err != nil {
			t.Fatalf("resumed node %d: %v", i, r.err)
		}
	}
	if !reflect.DeepEqual(runs[0].losses, want[2:]) {
		t.Errorf("resumed losses %v, straight run's %v", runs[0].losses, want[2:])
	}

	// Node 1 sees no checkpoint: both refuse.
	longer := cfg
	longer.Train.Steps = 6
	runs = runNodes(t, longer, []string{shared, t.TempDir()})
	for i, r := range runs {
		if r.err == nil || !strings.Contains(r.err.Error(), "disagree on the checkpoint") {
			t.Errorf("node %d: got %v, want the disagreement named", i, r.err)
		}
	}
}

// cudaNamed is the CPU backend under the CUDA backend's name.
type cudaNamed struct{ *cpu.Backend }

func (cudaNamed) Name() string { return "cuda" }

// A distributed run on the CUDA backend needs the NCCL unique id in the
// rendezvous blob: without a rendezvous it is refused, naming NCCL.
func TestDistributedCUDANeedsNCCLID(t *testing.T) {
	cfg := equivalenceConfig()
	cfg.Parallel.DP, cfg.Train.MicroBatch = 2, 4
	eng, err := New(cfg, WithBackend(cudaNamed{cpu.New(backend.Float32)}), withCUDA())
	if err != nil {
		t.Fatal(err)
	}
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	defer ln.Close()
	_, err = eng.RunDistributed(context.Background(), Distributed{TCP: comm.TCPConfig{Addrs: []string{"a:1", "b:2"}, Listener: ln}})
	if err == nil || !strings.Contains(err.Error(), "NCCL") {
		t.Fatalf("got %v", err)
	}
}

// A snapshot survives its trip as int32 words.
func TestSnapshotWire(t *testing.T) {
	for n := range 10 {
		p := make([]byte, n)
		for i := range p {
			p[i] = byte(250 - 7*i)
		}
		if got := wordsToBytes(bytesToWords(p), n%4); !bytes.Equal(got, p) {
			t.Fatalf("%d bytes: %v, want %v", n, got, p)
		}
	}
	s := rankSnapshot{worldRank: 3, dataRank: 1, cursor: data.Cursor{Epoch: 2, Index: 9},
		model: []checkpoint.NamedTensor{{Name: "w", Shape: []int{2}, Data: []float32{1, -2}}}}
	p, err := encodeSnapshot(s)
	if err != nil {
		t.Fatal(err)
	}
	got, err := decodeSnapshot(wordsToBytes(bytesToWords(p), len(p)%4))
	if err != nil || !reflect.DeepEqual(got, s) {
		t.Fatalf("got %+v (%v), want %+v", got, err, s)
	}
}

// lossesWithin says whether got and want have the same length and every
// loss agrees within tol relative (tol 0: bitwise).
func lossesWithin(got, want []float64, tol float64) bool {
	if tol == 0 {
		return reflect.DeepEqual(got, want)
	}
	if len(got) != len(want) {
		return false
	}
	for i := range got {
		if !(math.Abs(got[i]-want[i]) <= tol*math.Abs(want[i])) {
			return false
		}
	}
	return true
}
