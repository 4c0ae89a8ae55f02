package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The multi-node tests run `mktrain run` in child processes: the test
// binary re-executes itself as TestMultiNodeHelperProcess, which runs the
// command line it finds in multiNodeEnv and exits with its status.

const multiNodeEnv = "MKTRAIN_TEST_MULTINODE_ARGS"

func TestMultiNodeHelperProcess(t *testing.T) {
	spec := os.Getenv(multiNodeEnv)
	if spec == "" {
		t.Skip("runs only as a child of the multi-node tests")
	}
	var args []string
	if err := json.Unmarshal([]byte(spec), &args); err != nil {
		fmt.Fprintln(os.Stderr, "bad helper spec:", err)
		os.Exit(3)
	}
	os.Exit(run(args, os.Stdout, os.Stderr))
}

// node is one `mktrain run` in a child process.
type node struct {
	cmd    *exec.Cmd
	out    bytes.Buffer // stdout and stderr
	done   chan struct{}
	err    error // Wait's, once done is closed
	runDir string
}

// testSecret is the run secret the test nodes are given (MKTRAIN_SECRET).
const testSecret = "the tests' shared secret"

// startNode starts a node given the tests' secret.
func startNode(t *testing.T, args ...string) *node {
	t.Helper()
	return startNodeEnv(t, []string{"MKTRAIN_SECRET=" + testSecret}, args...)
}

// startNodeEnv starts a node with env added to the environment (and no
// secret of the tests' own).
func startNodeEnv(t *testing.T, env []string, args ...string) *node {
	t.Helper()
	spec, _ := json.Marshal(args)
	n := &node{done: make(chan struct{})}
	n.cmd = exec.Command(os.Args[0], "-test.run=^TestMultiNodeHelperProcess$")
	var base []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "MKTRAIN_SECRET") {
			base = append(base, kv)
		}
	}
	n.cmd.Env = append(append(base, env...), multiNodeEnv+"="+string(spec))
	n.cmd.Stdout, n.cmd.Stderr = &n.out, &n.out
	if err := n.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { n.err = n.cmd.Wait(); close(n.done) }()
	t.Cleanup(func() {
		n.cmd.Process.Kill()
		<-n.done
		if t.Failed() {
			t.Logf("%v:\n%s", args, n.out.String())
		}
	})
	return n
}

// wait waits for the node to exit, at most d, and returns its exit status.
func (n *node) wait(t *testing.T, d time.Duration) int {
	t.Helper()
	select {
	case <-n.done:
	case <-time.After(d):
		t.Fatalf("the node did not exit within %v:\n%s", d, n.out.String())
	}
	return n.cmd.ProcessState.ExitCode()
}

// freePort is a loopback port nobody listens on (a moment ago).
func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return fmt.Sprint(ln.Addr().(*net.TCPAddr).Port)
}

// tinyArgs is a short tiny run on the CPU that logs every step.
func tinyArgs(runDir string, steps int, sets ...string) []string {
	args := []string{"run", "tiny", "--run-dir", runDir,
		"--set", fmt.Sprintf("train.steps=%d", steps), "--set", "train.warmup_steps=1",
		"--set", "train.seq=32", "--set", "train.global_batch=4", "--set", "train.micro_batch=2",
		"--set", "train.eval_every=0", "--set", "train.eval_batches=1", "--set", "train.backend=cpu",
		"--set", "log.every=1", "--set", "log.progress=off"}
	for _, s := range sets {
		args = append(args, "--set", s)
	}
	return args
}

func nodeArgs(base []string, rank int, port string, timeout string) []string {
	return append(append([]string(nil), base...), "--nnodes", "2", "--node-rank", fmt.Sprint(rank),
		"--master-addr", "127.0.0.1", "--master-port", port, "--rendezvous-timeout", timeout)
}

// Two processes train the layout the one process trains as virtual ranks,
// with bitwise the same losses, and node 0's checkpoint holds every rank's
// shard.
func TestMultiNodeMatchesVirtualRanks(t *testing.T) {
	const steps = 3
	for _, layout := range []string{"parallel.dp=2", "parallel.ep=2"} {
		t.Run(layout, func(t *testing.T) {
			dir := t.TempDir()
			single := filepath.Join(dir, "single")
			var out bytes.Buffer
			if code := run(tinyArgs(single, steps, layout), &out, &out); code != 0 {
				t.Fatalf("single-process run: status %d\n%s", code, out.String())
			}
			port := freePort(t)
			var nodes []*node
			for rank := range 2 {
				runDir := filepath.Join(dir, fmt.Sprintf("node%d", rank))
				nodes = append(nodes, startNode(t, nodeArgs(tinyArgs(runDir, steps, layout), rank, port, "20s")...))
				nodes[rank].runDir = runDir
			}
			for rank, n := range nodes {
				if code := n.wait(t, 30*time.Second); code != 0 {
					t.Fatalf("node %d: status %d\n%s", rank, code, n.out.String())
				}
			}
			want, got := metricLosses(t, single), metricLosses(t, nodes[0].runDir)
			for step := 1; step <= steps; step++ {
				if len(got[step]) != 1 || len(want[step]) != 1 || got[step][0] != want[step][0] {
					t.Fatalf("step %d: two processes logged loss %v, one process %v", step, got[step], want[step])
				}
			}
			if _, err := os.Stat(filepath.Join(nodes[1].runDir, "metrics.jsonl")); err == nil {
				t.Error("node 1 wrote metrics.jsonl; only node 0 reports steps")
			}
			ck := filepath.Join(nodes[0].runDir, "checkpoints", fmt.Sprintf("step_%08d", steps))
			for _, f := range []string{"model-rank00000.safetensors", "MANIFEST.json"} {
				if _, err := os.Stat(filepath.Join(ck, f)); err != nil {
					t.Errorf("node 0's checkpoint: %v", err)
				}
			}
			if layout == "parallel.ep=2" { // rank 1 holds experts of its own, saved by node 0
				w, err := os.ReadFile(filepath.Join(single, "checkpoints", fmt.Sprintf("step_%08d", steps), "optim-rank00001.safetensors"))
				if err != nil {
					t.Fatal(err)
				}
				g, err := os.ReadFile(filepath.Join(ck, "optim-rank00001.safetensors"))
				if err != nil || !bytes.Equal(g, w) {
					t.Errorf("rank 1's optimizer shard differs from the single-process run's (err %v)", err)
				}
			}
		})
	}
}

// A node that never comes: node 0 ends at the rendezvous deadline with an
// error naming it.
func TestMultiNodeMissingNode(t *testing.T) {
	n := startNode(t, nodeArgs(tinyArgs(t.TempDir(), 3, "parallel.dp=2"), 0, freePort(t), "1s")...)
	start := time.Now()
	if code := n.wait(t, 15*time.Second); code == 0 {
		t.Fatal("node 0 succeeded without node 1")
	}
	if msg := n.out.String(); !strings.Contains(msg, "node 1 of 2 did not arrive") {
		t.Fatalf("want an error naming node 1, got:\n%s", msg)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("took %v", d)
	}
}

// A node killed mid-run: the survivor exits with an error naming the lost
// rank, within seconds.
func TestMultiNodeKilledNode(t *testing.T) {
	dir := t.TempDir()
	port := freePort(t)
	nodes := startTrainingNodes(t, dir, port, 20*time.Second)
	if err := nodes[1].cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if code := nodes[0].wait(t, 30*time.Second); code == 0 {
		t.Fatal("node 0 succeeded after losing node 1")
	}
	msg := nodes[0].out.String()
	if !strings.Contains(msg, "node 1") || !strings.Contains(msg, "rank 1") {
		t.Fatalf("want an error naming node 1 and rank 1, got:\n%s", msg)
	}
	lines := strings.Split(strings.TrimSpace(msg), "\n")
	t.Logf("node 0 stopped %v after the kill: %s", time.Since(start).Round(time.Millisecond), lines[len(lines)-1])
}

// Nodes launched with different recipes are refused at the rendezvous,
// both with the same clear error.
func TestMultiNodeMismatchedRecipes(t *testing.T) {
	dir := t.TempDir()
	port := freePort(t)
	lrs := []string{"train.lr=1e-3", "train.lr=2e-3"}
	var nodes []*node
	for rank := range 2 {
		nodes = append(nodes, startNode(t, nodeArgs(tinyArgs(filepath.Join(dir, fmt.Sprint(rank)), 3, "parallel.dp=2", lrs[rank]), rank, port, "20s")...))
	}
	for rank, n := range nodes {
		if code := n.wait(t, 30*time.Second); code == 0 {
			t.Fatalf("node %d succeeded with a different recipe", rank)
		}
		if msg := n.out.String(); !strings.Contains(msg, "every node must run the same recipe") {
			t.Fatalf("node %d: want the recipe mismatch named, got:\n%s", rank, msg)
		}
	}
}

// A layout that does not split over the nodes is refused before anything
// starts, naming the fields.
func TestMultiNodeLayoutMustSplit(t *testing.T) {
	var out bytes.Buffer
	code := run(nodeArgs(tinyArgs(t.TempDir(), 3, "parallel.dp=3", "train.global_batch=6"), 0, freePort(t), "1s"), &out, &out)
	if code == 0 || !strings.Contains(out.String(), "dp 3 x ep 1 x cp 1 x tp 1 = 3 ranks do not split evenly over 2 nodes") {
		t.Fatalf("status %d:\n%s", code, out.String())
	}
}

// Without a secret node 0 generates one and prints how to pass it; a node
// given another secret is refused, saying so, as bad input (exit 2).
func TestMultiNodeSecret(t *testing.T) {
	port := freePort(t)
	base := tinyArgs(t.TempDir(), 3, "parallel.dp=2")
	n0 := startNodeEnv(t, nil, nodeArgs(base, 0, port, "2s")...)
	n1 := startNodeEnv(t, []string{"MKTRAIN_SECRET=not-the-secret-node-0-made"}, nodeArgs(tinyArgs(t.TempDir(), 3, "parallel.dp=2"), 1, port, "5s")...)
	if code := n1.wait(t, 15*time.Second); code != exitFailure || !strings.Contains(n1.out.String(), "node 0 refused this node's secret") {
		t.Errorf("node 1 with another secret: status %d\n%s", code, n1.out.String())
	}
	n0.wait(t, 15*time.Second)
	if msg := n0.out.String(); !strings.Contains(msg, "node 0 generated one: start the other nodes with MKTRAIN_SECRET=") {
		t.Errorf("node 0 did not print the secret it generated:\n%s", msg)
	}
	// Node 1 without a secret refuses to start.
	var out bytes.Buffer
	t.Setenv("MKTRAIN_SECRET", "")
	t.Setenv("MKTRAIN_SECRET_FILE", "")
	if code := run(nodeArgs(tinyArgs(t.TempDir(), 3, "parallel.dp=2"), 1, freePort(t), "1s"), &out, &out); code != 2 || !strings.Contains(out.String(), "node 1 has no secret for the run") {
		t.Errorf("node 1 without a secret: status %d\n%s", code, out.String())
	}
}

// Strangers at node 0's rendezvous port (garbage and idle connections)
// while it waits do not stop the real nodes from training.
func TestMultiNodeStrangers(t *testing.T) {
	port := freePort(t)
	dir := t.TempDir()
	n0 := startNode(t, nodeArgs(tinyArgs(filepath.Join(dir, "0"), 3, "parallel.dp=2"), 0, port, "20s")...)
	var conns []net.Conn
	deadline := time.Now().Add(10 * time.Second)
	for len(conns) < 20 && time.Now().Before(deadline) {
		c, err := net.Dial("tcp", "127.0.0.1:"+port)
		if err != nil {
			time.Sleep(20 * time.Millisecond) // node 0 is starting
			continue
		}
		defer c.Close()
		if len(conns)%2 == 0 {
			c.Write([]byte("GET / HTTP/1.1\r\n\r\n\xff\xff\xff\xff"))
		}
		conns = append(conns, c)
	}
	n1 := startNode(t, nodeArgs(tinyArgs(filepath.Join(dir, "1"), 3, "parallel.dp=2"), 1, port, "20s")...)
	for rank, n := range []*node{n0, n1} {
		if code := n.wait(t, 60*time.Second); code != 0 {
			t.Fatalf("node %d: status %d\n%s", rank, code, n.out.String())
		}
	}
}

// startTrainingNodes starts two nodes of a long dp=2 tiny run, each with its
// own run directory under dir, and waits (up to within) until node 0 has
// logged a step: both train.
func startTrainingNodes(t *testing.T, dir, port string, within time.Duration) []*node {
	t.Helper()
	var nodes []*node
	for rank := range 2 {
		runDir := filepath.Join(dir, fmt.Sprintf("node%d", rank))
		nodes = append(nodes, startNode(t, nodeArgs(tinyArgs(runDir, 100000, "parallel.dp=2"), rank, port, "20s")...))
		nodes[rank].runDir = runDir
	}
	deadline := time.Now().Add(within)
	for {
		if b, _ := os.ReadFile(filepath.Join(nodes[0].runDir, "metrics.jsonl")); bytes.Count(b, []byte("\n")) >= 2 {
			return nodes
		}
		if time.Now().After(deadline) {
			t.Fatalf("node 0 logged no step within %v:\n%s", within, nodes[0].out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}
