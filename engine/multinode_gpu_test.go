package engine

// Multi-node runs on the CUDA backend (RunDistributed with NCCL between the
// processes), against the same layout trained by one process:
//
//   - one node on one GPU, in this process, through a real rendezvous of
//     one node (RendezvousBlob, launch.Join, ncclCommInitRank and the cut
//     groups), needs one GPU;
//   - two nodes as two child processes (this test binary re-executed as
//     TestNCCLNodeHelperProcess), each seeing one GPU of its own through
//     CUDA_VISIBLE_DEVICES, meeting at a rendezvous on loopback, needs two
//     GPUs: their losses follow the one-process run of the layout on two
//     GPUs, and killing node 1 stops node 0 with an error instead of a hang.
//
// Two processes cannot share a GPU in an NCCL communicator, so the
// two-node tests skip on a machine with one. They all skip, with one line,
// where there is no GPU.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend/cuda"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/launch"
)

// ncclNodeEnv holds a child node's nodeSpec, as JSON.
const ncclNodeEnv = "MKTRAIN_TEST_NCCL_NODE"

// nodeSpec is one node's part of a multi-node run of the tiny recipe on
// the CUDA backend.
type nodeSpec struct {
	Node, NNodes, Port      int
	DP, EP, Micro, Steps    int
	HeartbeatMS, TimeoutSec int
}

func (s nodeSpec) config() Config {
	cfg := tinyRecipeConfig()
	cfg.Train.Backend = "cuda"
	cfg.Parallel.DP, cfg.Parallel.EP, cfg.Train.MicroBatch, cfg.Train.Steps = s.DP, s.EP, s.Micro, s.Steps
	cfg.Train.WarmupSteps = min(cfg.Train.WarmupSteps, s.Steps/2) // a short run warms up within it
	return cfg
}

// runNode trains spec's node in this process, the engine opening its own
// GPUs: node 0's blob, the rendezvous, RunDistributed. onStep gets node 0's
// steps.
func runNode(ctx context.Context, spec nodeSpec, onStep func(StepEvent)) (Result, error) {
	eng, err := New(spec.config(), withCUDA(), WithHook(onStep))
	if err != nil {
		return Result{}, err
	}
	defer eng.Close()
	blob, err := eng.RendezvousBlob(spec.Node)
	if err != nil {
		return Result{}, err
	}
	rdv, err := launch.Join(ctx, launch.RendezvousConfig{
		Launch:     launch.Launch{NNodes: spec.NNodes, NodeRank: spec.Node, MasterAddr: "127.0.0.1", MasterPort: spec.Port, Secret: []byte("the tests' shared secret")},
		RecipeHash: "tiny-test", Version: "test", Blob: blob,
		Timeout:   time.Duration(spec.TimeoutSec) * time.Second,
		Heartbeat: time.Duration(spec.HeartbeatMS) * time.Millisecond, HeartbeatTimeout: 20 * time.Duration(spec.HeartbeatMS) * time.Millisecond,
	})
	if err != nil {
		return Result{}, err
	}
	defer rdv.Close()
	return eng.RunDistributed(ctx, Distributed{TCP: comm.TCPConfig{NodeRank: spec.Node}, Rendezvous: rdv})
}

// TestNCCLNodeHelperProcess is a child node: it runs the nodeSpec in
// ncclNodeEnv, prints "step N loss L" for each step it reports, then
// "done" or "error: ...", and exits with 0 or 1.
func TestNCCLNodeHelperProcess(t *testing.T) {
	raw := os.Getenv(ncclNodeEnv)
	if raw == "" {
		t.Skip("runs only as a child of the multi-node CUDA tests")
	}
	var spec nodeSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		fmt.Println("error: bad spec:", err)
		os.Exit(3)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	_, err := runNode(ctx, spec, func(ev StepEvent) { fmt.Printf("step %d loss %v\n", ev.Step, ev.Loss) })
	if err != nil {
		fmt.Printf("error: %v\n", err)
		os.Exit(1)
	}
	fmt.Println("done")
	os.Exit(0)
}

// oneProcessLosses trains cfg with Run (the engine opens its GPUs: one per
// rank when there are enough) and returns every step's loss.
func oneProcessLosses(t *testing.T, cfg Config) []float64 {
	t.Helper()
	var losses []float64
	eng, err := New(cfg, withCUDA(), WithHook(func(ev StepEvent) { losses = append(losses, ev.Loss) }))
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	if _, err := eng.Run(context.Background()); err != nil {
		t.Fatalf("one process: %v", err)
	}
	return losses
}

// compareLosses holds got to want within virtualRanksTol (the GPU's own
// run-to-run drift: some kernels sum with atomics) and logs the worst
// difference.
func compareLosses(t *testing.T, what string, got, want []float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d losses, the one-process run has %d", what, len(got), len(want))
	}
	worst := 0.0
	for i := range want {
		rel := math.Abs(got[i]-want[i]) / math.Abs(want[i])
		worst = max(worst, rel)
		if !(rel <= virtualRanksTol) {
			t.Errorf("%s: step %d: loss %.6f, one process %.6f: relative difference %.3g > %g", what, i+1, got[i], want[i], rel, virtualRanksTol)
		}
	}
	t.Logf("figure: engine tiny %s loss max relative difference vs one process = %.3g ratio", what, worst)
}

// gpuList returns the ids of the first n GPUs this process sees, for the
// children's CUDA_VISIBLE_DEVICES, or skips the test.
func gpuList(t *testing.T, n int) []string {
	t.Helper()
	count, err := cuda.VisibleGPUs(cuda.Options{})
	if cuda.NoGPU(err) {
		reason, _, _ := strings.Cut(err.Error(), "\n")
		t.Skip("no GPU: " + strings.TrimSuffix(reason, "; looked in:"))
	}
	if err != nil {
		t.Fatal(err)
	}
	if count == 0 {
		t.Skip("no GPU: the driver sees none")
	}
	if count < n {
		t.Skipf("needs %d GPUs, one per node (two processes cannot share one in an NCCL communicator); %d visible", n, count)
	}
	ids := make([]string, count)
	for i := range ids {
		ids[i] = strconv.Itoa(i)
	}
	if v := os.Getenv("CUDA_VISIBLE_DEVICES"); v != "" {
		if list := strings.Split(v, ","); len(list) >= count {
			for i := range ids {
				ids[i] = strings.TrimSpace(list[i])
			}
		}
	}
	return ids[:n]
}

func freeLoopbackPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// TestNCCLOneNodeMatchesOneProcess: a run of one node on one GPU through
// the multi-node path gives the losses of the same run by Run.
func TestNCCLOneNodeMatchesOneProcess(t *testing.T) {
	gpuList(t, 1)
	spec := nodeSpec{NNodes: 1, Port: freeLoopbackPort(t), DP: 1, EP: 1, Micro: 16, Steps: 12, HeartbeatMS: 100, TimeoutSec: 60}
	want := oneProcessLosses(t, spec.config())
	var got []float64
	res, err := runNode(context.Background(), spec, func(ev StepEvent) { got = append(got, ev.Loss) })
	if err != nil {
		t.Fatal(err)
	}
	if res.Steps != spec.Steps {
		t.Errorf("%d steps, want %d", res.Steps, spec.Steps)
	}
	compareLosses(t, "one node", got, want)
}

// lockedBuffer is a child's output, read while it runs.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// childNode is one node in a child process.
type childNode struct {
	cmd  *exec.Cmd
	out  lockedBuffer
	done chan struct{}
}

func startChildNode(t *testing.T, spec nodeSpec, gpu string) *childNode {
	t.Helper()
	raw, _ := json.Marshal(spec)
	c := &childNode{done: make(chan struct{})}
	c.cmd = exec.Command(os.Args[0], "-test.run=^TestNCCLNodeHelperProcess$")
	c.cmd.Env = append(os.Environ(), ncclNodeEnv+"="+string(raw), "CUDA_VISIBLE_DEVICES="+gpu)
	c.cmd.Stdout, c.cmd.Stderr = &c.out, &c.out
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { c.cmd.Wait(); close(c.done) }()
	t.Cleanup(func() {
		c.cmd.Process.Kill()
		<-c.done
		if t.Failed() {
			t.Logf("node %d (GPU %s):\n%s", spec.Node, gpu, c.out.String())
		}
	})
	return c
}

// wait waits at most d for the child to exit and returns its status.
func (c *childNode) wait(t *testing.T, d time.Duration) int {
	t.Helper()
	select {
	case <-c.done:
	case <-time.After(d):
		t.Fatalf("the node did not exit within %v:\n%s", d, c.out.String())
	}
	return c.cmd.ProcessState.ExitCode()
}

// losses reads the "step N loss L" lines of the child's output.
func (c *childNode) losses(t *testing.T) []float64 {
	t.Helper()
	var out []float64
	sc := bufio.NewScanner(strings.NewReader(c.out.String()))
	for sc.Scan() {
		var step int
		var loss float64
		if n, _ := fmt.Sscanf(sc.Text(), "step %d loss %g", &step, &loss); n == 2 {
			if step != len(out)+1 {
				t.Fatalf("step %d reported after %d steps", step, len(out))
			}
			out = append(out, loss)
		}
	}
	return out
}

// TestNCCLTwoNodesMatchOneProcess: layouts of two ranks trained by two
// processes of one GPU each follow the one-process run of the layout on
// two GPUs; only node 0 reports steps.
func TestNCCLTwoNodesMatchOneProcess(t *testing.T) {
	gpus := gpuList(t, 2)
	for _, l := range []struct{ dp, ep int }{{2, 1}, {1, 2}} {
		t.Run(fmt.Sprintf("dp%d_ep%d", l.dp, l.ep), func(t *testing.T) {
			spec := nodeSpec{NNodes: 2, Port: freeLoopbackPort(t), DP: l.dp, EP: l.ep, Micro: 8, Steps: 12, HeartbeatMS: 200, TimeoutSec: 120}
			want := oneProcessLosses(t, spec.config())
			nodes := make([]*childNode, 2)
			for i := range nodes {
				s := spec
				s.Node = i
				nodes[i] = startChildNode(t, s, gpus[i])
			}
			for i, n := range nodes {
				if code := n.wait(t, 4*time.Minute); code != 0 {
					t.Fatalf("node %d exited with %d:\n%s", i, code, n.out.String())
				}
			}
			if got := nodes[1].losses(t); len(got) != 0 {
				t.Errorf("node 1 reported %d steps; only world rank 0's node reports", len(got))
			}
			compareLosses(t, fmt.Sprintf("two nodes dp%d ep%d", l.dp, l.ep), nodes[0].losses(t), want)
		})
	}
}

// TestNCCLNodeKilled: node 1 killed in the middle of a run makes node 0
// stop with an error, within a minute (the rendezvous sees the closed
// connection at once and aborts node 0's NCCL groups).
func TestNCCLNodeKilled(t *testing.T) {
	gpus := gpuList(t, 2)
	spec := nodeSpec{NNodes: 2, Port: freeLoopbackPort(t), DP: 2, EP: 1, Micro: 8, Steps: 100000, HeartbeatMS: 200, TimeoutSec: 120}
	nodes := make([]*childNode, 2)
	for i := range nodes {
		s := spec
		s.Node = i
		nodes[i] = startChildNode(t, s, gpus[i])
	}
	deadline := time.Now().Add(3 * time.Minute)
	for !strings.Contains(nodes[0].out.String(), "step 5 loss") {
		select {
		case <-nodes[0].done:
			t.Fatalf("node 0 exited before step 5:\n%s", nodes[0].out.String())
		case <-nodes[1].done:
			t.Fatalf("node 1 exited before step 5:\n%s", nodes[1].out.String())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("node 0 did not reach step 5:\n%s", nodes[0].out.String())
		}
	}
	if err := nodes[1].cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	if code := nodes[0].wait(t, time.Minute); code == 0 {
		t.Fatalf("node 0 exited with 0 after node 1 was killed:\n%s", nodes[0].out.String())
	}
	out := nodes[0].out.String()
	i := strings.LastIndex(out, "error: ")
	if i < 0 {
		t.Fatalf("node 0 failed without an error line:\n%s", out)
	}
	line, _, _ := strings.Cut(out[i:], "\n")
	if !strings.Contains(line, "node 1") && !strings.Contains(line, "NCCL") {
		t.Errorf("node 0's error names neither node 1 nor NCCL: %s", line)
	}
	took := time.Since(killed)
	t.Logf("node 0 stopped %v after node 1 was killed: %s", took.Round(time.Millisecond), line)
	t.Logf("figure: engine multi-node CUDA stop after a node is killed = %.3g s", took.Seconds())
}
