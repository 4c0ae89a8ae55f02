package launch

// Tests of the rendezvous. The in-process tests run the nodes as goroutines
// (and speak the wire format directly to fake a silent or stray peer); each
// ends with a check that no goroutine of the rendezvous is left. The
// multi-process tests run every node as a child process (this test binary,
// re-executed with helperEnv set), so that a node can be killed for real.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/internal/peernet"
)

// Short timings keep the package's tests fast; the heartbeat timeout still
// leaves room for a loaded 2-core machine.
const (
	testHeartbeat        = 50 * time.Millisecond
	testHeartbeatTimeout = time.Second
)

func freePort(t *testing.T) int {
	t.Helper()
	return freePorts(t, 1)[0]
}

// freePorts returns n distinct free ports: it holds all n open at once, as
// the kernel may hand a port just closed to the next listener, and two
// tests running in parallel on one port would meet each other's nodes.
func freePorts(t *testing.T, n int) []int {
	t.Helper()
	ports := make([]int, n)
	for i := range ports {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		ports[i] = ln.Addr().(*net.TCPAddr).Port
	}
	return ports
}

func testBlob(seed uint64) [comm.BlobSize]byte {
	rng := rand.New(rand.NewPCG(seed, 7))
	var b [comm.BlobSize]byte
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

var hostNames = []string{"a", "b", "c", "d", "e"}

// testSecret is the tests' run secret.
var testSecret = []byte("the tests' shared secret")

// testConfig is node rank's config in a run of nnodes on port.
func testConfig(nnodes, rank, port int) RendezvousConfig {
	return RendezvousConfig{
		Launch:     Launch{NNodes: nnodes, NodeRank: rank, MasterAddr: "127.0.0.1", MasterPort: port, LocalRanks: 2 + rank, Secret: testSecret},
		RecipeHash: "0123456789abcdef", Version: "0.1.0", Hostname: hostNames[rank],
		Blob:    testBlob(uint64(rank + 1)),
		Timeout: 3 * time.Second, Heartbeat: testHeartbeat, HeartbeatTimeout: testHeartbeatTimeout,
	}
}

type joinResult struct {
	r   *Rendezvous
	err error
}

// joinAll joins every config concurrently and returns the results in order.
func joinAll(cfgs ...RendezvousConfig) []joinResult {
	res := make([]joinResult, len(cfgs))
	done := make(chan int)
	for i, c := range cfgs {
		go func() {
			res[i].r, res[i].err = Join(context.Background(), c)
			done <- i
		}()
	}
	for range cfgs {
		<-done
	}
	return res
}

// checkNoLeaks waits for every goroutine of the rendezvous code to end.
func checkNoLeaks(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for {
		buf := make([]byte, 1<<20)
		var leaked []string
		for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
			if strings.Contains(g, "launch.(*Rendezvous)") || strings.Contains(g, "peernet.DialRetry") {
				leaked = append(leaked, g)
			}
		}
		if len(leaked) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines of the rendezvous still run:\n%s", len(leaked), strings.Join(leaked, "\n\n"))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// watchWithin waits for w to report, failing if it takes longer than d; ok
// is false when w closed without a failure.
func watchWithin(t *testing.T, w <-chan error, d time.Duration) (err error, ok bool) {
	t.Helper()
	select {
	case err, ok = <-w:
		return err, ok
	case <-time.After(d):
		t.Fatalf("Watch reported nothing within %v", d)
		return nil, false
	}
}

func TestRendezvousInProcess(t *testing.T) {
	for _, aborter := range []int{0, 2} {
		t.Run(fmt.Sprintf("node %d aborts", aborter), func(t *testing.T) {
			port := freePort(t)
			cfgs := []RendezvousConfig{testConfig(3, 0, port), testConfig(3, 1, port), testConfig(3, 2, port)}
			for i := range cfgs {
				// A long timeout makes a connection left to linger show in
				// the time Close takes.
				cfgs[i].HeartbeatTimeout = 10 * time.Second
			}
			res := joinAll(cfgs...)
			for i, r := range res {
				if r.err != nil {
					t.Fatalf("node %d: %v", i, r.err)
				}
				defer r.r.Close()
			}
			for i, r := range res {
				if r.r.Blob() != cfgs[0].Blob {
					t.Errorf("node %d got a different blob from node 0's", i)
				}
				nodes := r.r.Nodes()
				if len(nodes) != 3 {
					t.Fatalf("node %d: %d nodes in the table", i, len(nodes))
				}
				for rank, nd := range nodes {
					if nd.NodeRank != rank || nd.Hostname != hostNames[rank] || nd.LocalRanks != 2+rank ||
						nd.RecipeHash != cfgs[0].RecipeHash || nd.Version != "0.1.0" || nd.NNodes != 3 || nd.Addr != "127.0.0.1" {
						t.Errorf("node %d: row %d is %+v", i, rank, nd)
					}
				}
			}
			watches := make([]<-chan error, 3)
			for i, r := range res {
				watches[i] = r.r.Watch(context.Background())
			}
			cause := errors.New("step 40: loss is NaN")
			res[aborter].r.Abort(cause)
			want := fmt.Sprintf("node %d (host %s) aborted the run: step 40: loss is NaN", aborter, hostNames[aborter])
			for i, w := range watches {
				err, ok := watchWithin(t, w, 2*time.Second)
				switch {
				case !ok:
					t.Errorf("node %d: Watch closed without an error", i)
				case i == aborter && err != cause:
					t.Errorf("node %d (the aborter): Watch = %v, want its own error", i, err)
				case i != aborter && err.Error() != want:
					t.Errorf("node %d: Watch = %q, want %q", i, err, want)
				}
				if i != aborter && res[i].r.Err() == nil {
					t.Errorf("node %d: Err() is nil after Watch reported", i)
				}
			}
			start := time.Now()
			for _, r := range res {
				r.r.Close()
			}
			if took := time.Since(start); took > lingerTimeout/2 {
				t.Errorf("Close took %v: a connection waited for its peer to close", took)
			}
			checkNoLeaks(t)
		})
	}
}

func TestRendezvousCloseIsClean(t *testing.T) {
	port := freePort(t)
	res := joinAll(testConfig(3, 0, port), testConfig(3, 1, port), testConfig(3, 2, port))
	for i, r := range res {
		if r.err != nil {
			t.Fatalf("node %d: %v", i, r.err)
		}
	}
	w0, w1 := res[0].r.Watch(context.Background()), res[1].r.Watch(context.Background())
	ctx, cancel := context.WithCancel(context.Background())
	w2 := res[2].r.Watch(ctx)
	cancel()
	if _, ok := watchWithin(t, w2, time.Second); ok {
		t.Error("Watch reported after its context ended")
	}

	// Node 2 leaves cleanly: nobody fails, over several heartbeats.
	res[2].r.Close()
	select {
	case err := <-w0:
		t.Fatalf("node 0's Watch reported %v after node 2 said goodbye", err)
	case err := <-w1:
		t.Fatalf("node 1's Watch reported %v after node 2 said goodbye", err)
	case <-time.After(6 * testHeartbeat):
	}
	// Node 0 leaves: node 1's Watch ends without an error.
	res[0].r.Close()
	if err, ok := watchWithin(t, w1, 2*time.Second); ok {
		t.Errorf("node 1's Watch reported %v after node 0 said goodbye", err)
	}
	if _, ok := watchWithin(t, w0, time.Second); ok {
		t.Error("node 0's Watch reported after its own Close")
	}
	res[1].r.Close()
	for i, r := range res {
		if err := r.r.Err(); err != nil {
			t.Errorf("node %d: Err() = %v after a clean end", i, err)
		}
	}
	checkNoLeaks(t)
}

func TestRendezvousSingleNode(t *testing.T) {
	cfg := testConfig(1, 0, 0)
	r, err := Join(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if r.Blob() != cfg.Blob || len(r.Nodes()) != 1 || r.Nodes()[0].Hostname != "a" {
		t.Errorf("single node: blob or table wrong: %+v", r.Nodes())
	}
	w := r.Watch(context.Background())
	r.Abort(errors.New("disk full"))
	if err, ok := watchWithin(t, w, time.Second); !ok || err.Error() != "disk full" {
		t.Errorf("Watch = %v, %v; want disk full", err, ok)
	}
	r.Close()
	r.Close() // twice is fine
	checkNoLeaks(t)
}

func TestRendezvousConfigErrors(t *testing.T) {
	for _, c := range []struct {
		edit func(*RendezvousConfig)
		want string
	}{
		{func(c *RendezvousConfig) { c.RecipeHash = "" }, "RecipeHash is empty"},
		{func(c *RendezvousConfig) { c.Version = "" }, "Version is empty"},
		{func(c *RendezvousConfig) { c.Timeout = -time.Second }, "Timeout is -1s; it must be positive"},
		{func(c *RendezvousConfig) { c.HeartbeatTimeout = testHeartbeat }, "HeartbeatTimeout 50ms is less than twice Heartbeat 50ms"},
		{func(c *RendezvousConfig) { c.Launch.NodeRank = 2 }, "node rank 2 but node count 2: the node rank must be below the node count"},
		{func(c *RendezvousConfig) { c.Launch.MasterAddr = "" }, "no master address"},
	} {
		cfg := testConfig(2, 1, 1)
		c.edit(&cfg)
		if _, err := Join(context.Background(), cfg); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Join error = %v, want it to say %q", err, c.want)
		}
	}
}

// TestRendezvousRefusals: problems among the nodes that came are the same
// error on every node.
func TestRendezvousRefusals(t *testing.T) {
	port := freePort(t)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	for _, c := range []struct {
		name string
		edit func([]RendezvousConfig)
		want *regexp.Regexp
	}{
		{"duplicate rank", func(cfgs []RendezvousConfig) { cfgs[2].Launch.NodeRank = 1 },
			regexp.MustCompile(`^rendezvous at ` + addr + `: node rank 1 is claimed by hosts [bc] \(127\.0\.0\.1\) and [bc] \(127\.0\.0\.1\): every node needs its own rank; no node claimed rank 2$`)},
		{"node count", func(cfgs []RendezvousConfig) { cfgs[1].Launch.NNodes = 4 },
			regexp.MustCompile(`^rendezvous at ` + addr + `: node 1 \(host b\) was launched for 4 nodes, node 0 \(host a\) for 3: every node must be launched with the same node count$`)},
		{"version and recipe", func(cfgs []RendezvousConfig) { cfgs[1].Version = "0.2.0"; cfgs[2].RecipeHash = "fedcba9876543210" },
			regexp.MustCompile(`^rendezvous at ` + addr + `: node 1 \(host b\) runs mktrain 0\.2\.0, node 0 \(host a\) runs 0\.1\.0: every node must run the same mktrain version; ` +
				`node 2 \(host c\) runs recipe hash fedcba9876543210, node 0 \(host a\) runs 0123456789abcdef: every node must run the same recipe$`)},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfgs := []RendezvousConfig{testConfig(3, 0, port), testConfig(3, 1, port), testConfig(3, 2, port)}
			c.edit(cfgs)
			res := joinAll(cfgs...)
			for i, r := range res {
				if r.err == nil {
					r.r.Close()
					t.Errorf("node %d joined", i)
				} else if !c.want.MatchString(r.err.Error()) {
					t.Errorf("node %d: %v\nwant to match %s", i, r.err, c.want)
				}
			}
			if res[0].err != nil && res[1].err != nil && res[0].err.Error() != res[1].err.Error() {
				t.Errorf("nodes 0 and 1 report different errors:\n%v\n%v", res[0].err, res[1].err)
			}
			checkNoLeaks(t)
		})
	}
}

func TestRendezvousPortInUse(t *testing.T) {
	ln, err := net.Listen("tcp", ":0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	_, err = Join(context.Background(), testConfig(2, 0, port))
	want := fmt.Sprintf("rendezvous at 127.0.0.1:%d: node 0 cannot listen on port %d: ", port, port)
	if err == nil || !strings.HasPrefix(err.Error(), want) || !strings.Contains(err.Error(), "address already in use") ||
		!strings.Contains(err.Error(), "choose another with --master-port or MASTER_PORT") {
		t.Errorf("Join error = %v, want %q... address already in use ...", err, want)
	}
	checkNoLeaks(t)
}

func TestRendezvousUnreachableMaster(t *testing.T) {
	port := freePort(t)
	cfg := testConfig(2, 1, port)
	cfg.Timeout = 600 * time.Millisecond
	start := time.Now()
	_, err := Join(context.Background(), cfg)
	took := time.Since(start)
	want := regexp.MustCompile(fmt.Sprintf(`^rendezvous at 127\.0\.0\.1:%d: node 0 did not answer within 600ms \(last attempt: dial tcp 127\.0\.0\.1:%d: .*connection refused\)$`, port, port))
	if err == nil || !want.MatchString(err.Error()) {
		t.Errorf("Join error = %v, want to match %s", err, want)
	}
	if took < cfg.Timeout || took > cfg.Timeout+time.Second {
		t.Errorf("Join gave up after %v; the timeout is %v", took, cfg.Timeout)
	}
	// A cancelled context stops the dialling at once.
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	cfg.Timeout = time.Minute
	start = time.Now()
	if _, err := Join(ctx, cfg); err == nil || !strings.Contains(err.Error(), "stopped waiting for node 0: context deadline exceeded") {
		t.Errorf("Join with a cancelled context: %v", err)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("Join took %v after its context ended", took)
	}
	checkNoLeaks(t)
}

// rawNode speaks the wire format by hand, to play a node that misbehaves.
type rawNode struct {
	t    *testing.T
	conn net.Conn
	br   *bufio.Reader
}

func (n *rawNode) send(m message) {
	n.t.Helper()
	if err := writeFrame(n.conn, m); err != nil {
		n.t.Fatal(err)
	}
}

// recv returns the next message that is not a heartbeat.
func (n *rawNode) recv() message {
	n.t.Helper()
	for {
		n.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		m, err := readFrame(n.br, maxFromNode0(8))
		if err != nil {
			n.t.Fatal(err)
		}
		if m.Kind != kindHeartbeat {
			return m
		}
	}
}

// dialRaw connects as a node that knows the secret.
func dialRaw(t *testing.T, port int) *rawNode {
	t.Helper()
	conn, err := peernet.DialAuth(context.Background(), fmt.Sprintf("127.0.0.1:%d", port), testSecret, authRendezvous, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &rawNode{t: t, conn: conn, br: bufio.NewReader(conn)}
}

// dialStranger connects without the handshake.
func dialStranger(t *testing.T, port int) *rawNode {
	t.Helper()
	conn, err := peernet.DialRetry(context.Background(), fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &rawNode{t: t, conn: conn, br: bufio.NewReader(conn)}
}

// TestRendezvousSilentNode: a node whose process lives but sends nothing
// (a hung host) is reported after HeartbeatTimeout, in both directions.
func TestRendezvousSilentNode(t *testing.T) {
	t.Run("node 1 goes silent", func(t *testing.T) {
		port := freePort(t)
		cfg := testConfig(2, 0, port)
		cfg.HeartbeatTimeout = 300 * time.Millisecond
		joined := make(chan joinResult, 1)
		go func() {
			r, err := Join(context.Background(), cfg)
			joined <- joinResult{r, err}
		}()
		n1 := dialRaw(t, port)
		hello := testConfig(2, 1, port)
		n1.send(message{Kind: kindHello, Node: &NodeInfo{NodeRank: 1, NNodes: 2, Hostname: "x", RecipeHash: hello.RecipeHash, Version: hello.Version}})
		if m := n1.recv(); m.Kind != kindWelcome || len(m.Blob) != comm.BlobSize || !bytes.Equal(m.Blob, cfg.Blob[:]) || len(m.Nodes) != 2 {
			t.Fatalf("node 0 answered %+v", m)
		}
		res := <-joined
		if res.err != nil {
			t.Fatal(res.err)
		}
		defer res.r.Close()
		start := time.Now()
		err, _ := watchWithin(t, res.r.Watch(context.Background()), 2*time.Second)
		if want := "node 1 (host x) left the run (silent for 300ms: its host or the network may be down)"; err == nil || err.Error() != want {
			t.Errorf("Watch = %v, want %q", err, want)
		}
		if took := time.Since(start); took < 200*time.Millisecond {
			t.Errorf("the silent node was reported after %v, before the %v timeout", took, cfg.HeartbeatTimeout)
		}
		res.r.Close()
		checkNoLeaks(t)
	})

	t.Run("node 0 goes silent", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		cfg := testConfig(2, 1, ln.Addr().(*net.TCPAddr).Port)
		cfg.HeartbeatTimeout = 300 * time.Millisecond
		joined := make(chan joinResult, 1)
		go func() {
			r, err := Join(context.Background(), cfg)
			joined <- joinResult{r, err}
		}()
		conn, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if err := peernet.Authenticate(conn, testSecret, authRendezvous, false, 5*time.Second); err != nil {
			t.Fatal(err)
		}
		n0 := &rawNode{t: t, conn: conn, br: bufio.NewReader(conn)}
		if m := n0.recv(); m.Kind != kindHello || m.Node == nil || m.Node.NodeRank != 1 || m.Node.Hostname != "b" || m.Node.LocalRanks != 3 {
			t.Fatalf("node 1 said %+v", m)
		}
		blob := testBlob(99)
		n0.send(message{Kind: kindWelcome, Blob: blob[:], Nodes: []NodeInfo{{NodeRank: 0, Hostname: "z"}, {NodeRank: 1, Hostname: "b"}}})
		res := <-joined
		if res.err != nil {
			t.Fatal(res.err)
		}
		defer res.r.Close()
		if res.r.Blob() != blob {
			t.Error("node 1 kept a blob other than node 0's")
		}
		err, _ = watchWithin(t, res.r.Watch(context.Background()), 2*time.Second)
		if want := "node 0 (host z) left the run (silent for 300ms: its host or the network may be down)"; err == nil || err.Error() != want {
			t.Errorf("Watch = %v, want %q", err, want)
		}
		res.r.Close()
		checkNoLeaks(t)
	})
}

// TestRendezvousStrayClients: connections that do not speak the protocol,
// or come and go before the verdict, do not disturb the run.
func TestRendezvousStrayClients(t *testing.T) {
	port := freePort(t)
	joined := make(chan joinResult, 1)
	go func() {
		r, err := Join(context.Background(), testConfig(3, 0, port))
		joined <- joinResult{r, err}
	}()
	http := dialStranger(t, port)
	fmt.Fprintf(http.conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	garbage := dialStranger(t, port)
	garbage.conn.Write([]byte{0, 0, 0, 3, '{', '{', '{'})
	// Node 2 comes and goes, then comes back.
	early := dialRaw(t, port)
	hello2 := testConfig(3, 2, port)
	info2 := NodeInfo{NodeRank: 2, NNodes: 3, Hostname: "c", RecipeHash: hello2.RecipeHash, Version: hello2.Version}
	early.send(message{Kind: kindHello, Node: &info2})
	time.Sleep(20 * time.Millisecond)
	early.conn.Close()

	res := joinAll(testConfig(3, 1, port), testConfig(3, 2, port))
	r0 := <-joined
	for i, r := range append(res, r0) {
		if r.err != nil {
			t.Fatalf("join %d: %v", i, r.err)
		}
		if got := r.r.Nodes(); len(got) != 3 || got[2].Hostname != "c" {
			t.Errorf("join %d: node table %+v", i, got)
		}
		defer r.r.Close()
	}
	for _, r := range append(res, r0) {
		if err := r.r.Err(); err != nil {
			t.Errorf("a stray client failed the run: %v", err)
		}
		r.r.Close()
	}
	checkNoLeaks(t)
}

// TestRendezvousDeadline: at the deadline node 0 names the missing ranks,
// with how a node that came and went left, and tells the nodes that came.
func TestRendezvousDeadline(t *testing.T) {
	port := freePort(t)
	cfg := testConfig(4, 0, port)
	cfg.Timeout = 500 * time.Millisecond
	joined := make(chan joinResult, 1)
	go func() {
		r, err := Join(context.Background(), cfg)
		joined <- joinResult{r, err}
	}()
	info := func(rank int) *NodeInfo {
		return &NodeInfo{NodeRank: rank, NNodes: 4, Hostname: hostNames[rank], RecipeHash: cfg.RecipeHash, Version: cfg.Version}
	}
	n1 := dialRaw(t, port)
	n1.send(message{Kind: kindHello, Node: info(1)})
	n2 := dialRaw(t, port)
	n2.send(message{Kind: kindHello, Node: info(2)})
	time.Sleep(50 * time.Millisecond)
	n2.conn.Close()

	// Closed with heartbeats unread, node 2's socket may send a reset.
	want := regexp.MustCompile(fmt.Sprintf(`^rendezvous at 127\.0\.0\.1:%d: nodes 2, 3 of 4 did not arrive within 500ms; node 2 \(host c\) came, then left \(connection (closed|reset)\)$`, port))
	// Node 1 hears the verdict first: Join returns once the refused nodes
	// have closed their side.
	m := n1.recv()
	if m.Kind != kindRefuse || !want.MatchString(m.Error) {
		t.Errorf("node 1 was told %+v\nwant a refusal matching %s", m, want)
	}
	n1.conn.Close()
	if res := <-joined; res.err == nil || res.err.Error() != m.Error {
		t.Errorf("node 0: %v\nwant what node 1 was told: %s", res.err, m.Error)
	}
	checkNoLeaks(t)

	// Node 0's context ending stops the wait too, and is named.
	cfg.Timeout = time.Minute
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	go func() {
		r, err := Join(ctx, cfg)
		joined <- joinResult{r, err}
	}()
	n1 = dialRaw(t, port)
	n1.send(message{Kind: kindHello, Node: info(1)})
	want2 := fmt.Sprintf("rendezvous at 127.0.0.1:%d: node 0 stopped waiting: context deadline exceeded", port)
	if m := n1.recv(); m.Kind != kindRefuse || m.Error != want2 {
		t.Errorf("node 1 was told %+v\nwant a refusal: %s", m, want2)
	}
	n1.conn.Close()
	if res := <-joined; res.err == nil || res.err.Error() != want2 {
		t.Errorf("node 0 with an ended context: %v\nwant %s", res.err, want2)
	}
	checkNoLeaks(t)
}

func TestFrames(t *testing.T) {
	var buf bytes.Buffer
	blob := testBlob(3)
	in := message{Kind: kindWelcome, Blob: blob[:], Nodes: []NodeInfo{{NodeRank: 0, Hostname: "a", LocalRanks: 8}}}
	if err := writeFrame(&buf, in); err != nil {
		t.Fatal(err)
	}
	out, err := readFrame(&buf, maxFromNode0(1))
	if err != nil || out.Kind != in.Kind || !bytes.Equal(out.Blob, in.Blob) || len(out.Nodes) != 1 || out.Nodes[0] != in.Nodes[0] {
		t.Errorf("round trip: %+v, %v", out, err)
	}
	if _, err := readFrame(strings.NewReader("GET / HTTP/1.1\r\n"), maxToNode0); err == nil || !strings.Contains(err.Error(), "exceeds the 20480-byte limit") {
		t.Errorf("an HTTP request read as a frame: %v", err)
	}
	if _, err := readFrame(bytes.NewReader([]byte{0, 0, 0, 2, '{'}), maxToNode0); err == nil {
		t.Error("a truncated frame read without error")
	}
}

// ---- multi-process tests ------------------------------------------------

// helperEnv, set in a child's environment, makes the test binary a node.
const helperEnv = "MKTRAIN_TEST_RENDEZVOUS_NODE"

// helperSpec tells a child which node to be.
type helperSpec struct {
	NNodes, NodeRank, Port int
	Recipe, Version        string
	Timeout, Delay         time.Duration
	Watch                  bool // after joining, report what Watch says
}

// helperReport is a line a child prints.
type helperReport struct {
	Event   string // "joined", "error", "watch" (a failure), "watch-closed"
	Error   string
	Blob    []byte
	Nodes   []NodeInfo
	Elapsed time.Duration // from the start of Join
}

// TestRendezvousHelperProcess is a node when run as a child of the tests
// below, and does nothing otherwise.
func TestRendezvousHelperProcess(t *testing.T) {
	spec := os.Getenv(helperEnv)
	if spec == "" {
		return
	}
	os.Exit(helperMain(spec))
}

func helperMain(spec string) int {
	var s helperSpec
	if err := json.Unmarshal([]byte(spec), &s); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	out := json.NewEncoder(os.Stdout)
	cfg := testConfig(s.NNodes, s.NodeRank, s.Port)
	cfg.Timeout = s.Timeout
	if s.Recipe != "" {
		cfg.RecipeHash = s.Recipe
	}
	if s.Version != "" {
		cfg.Version = s.Version
	}
	time.Sleep(s.Delay)
	start := time.Now()
	r, err := Join(context.Background(), cfg)
	if err != nil {
		out.Encode(helperReport{Event: "error", Error: err.Error(), Elapsed: time.Since(start)})
		return 0
	}
	defer r.Close()
	blob := r.Blob()
	out.Encode(helperReport{Event: "joined", Blob: blob[:], Nodes: r.Nodes(), Elapsed: time.Since(start)})
	if s.Watch {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err, ok := <-r.Watch(ctx); ok {
			out.Encode(helperReport{Event: "watch", Error: err.Error()})
		} else {
			out.Encode(helperReport{Event: "watch-closed"})
		}
	}
	return 0
}

// child is a node running in a child process.
type child struct {
	cmd     *exec.Cmd
	reports chan helperReport
	stderr  bytes.Buffer
}

func startChild(t *testing.T, s helperSpec) *child {
	t.Helper()
	spec, _ := json.Marshal(s)
	c := &child{reports: make(chan helperReport, 8)}
	c.cmd = exec.Command(os.Args[0], "-test.run=^TestRendezvousHelperProcess$")
	c.cmd.Env = append(os.Environ(), helperEnv+"="+string(spec))
	c.cmd.Stderr = &c.stderr
	stdout, err := c.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		defer close(c.reports)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			var rep helperReport
			if json.Unmarshal(sc.Bytes(), &rep) == nil && rep.Event != "" {
				c.reports <- rep
			}
		}
	}()
	t.Cleanup(func() {
		c.cmd.Process.Kill()
		<-readDone
		c.cmd.Wait()
		if t.Failed() && c.stderr.Len() > 0 {
			t.Logf("node %d's stderr:\n%s", s.NodeRank, c.stderr.String())
		}
	})
	return c
}

// next is the child's next report, within d.
func (c *child) next(t *testing.T, d time.Duration) helperReport {
	t.Helper()
	select {
	case rep, ok := <-c.reports:
		if !ok {
			t.Fatalf("the child ended without a report")
		}
		return rep
	case <-time.After(d):
		t.Fatalf("no report from the child within %v", d)
		return helperReport{}
	}
}

// nextAll is every child's next report, within d.
func nextAll(t *testing.T, nodes []*child, d time.Duration) []helperReport {
	t.Helper()
	reps := make([]helperReport, len(nodes))
	for i, c := range nodes {
		reps[i] = c.next(t, d)
	}
	return reps
}

func TestRendezvousProcesses(t *testing.T) {
	ports := freePorts(t, 6)
	t.Run("three nodes agree on the blob", func(t *testing.T) {
		t.Parallel()
		port := ports[0]
		var nodes []*child
		for rank := range 3 {
			nodes = append(nodes, startChild(t, helperSpec{NNodes: 3, NodeRank: rank, Port: port, Timeout: 5 * time.Second}))
		}
		blob0 := testBlob(1)
		reps := nextAll(t, nodes, 10*time.Second)
		for rank, rep := range reps {
			if rep.Event != "joined" {
				t.Fatalf("node %d: %+v\nall reports: %+v", rank, rep, reps)
			}
			if !bytes.Equal(rep.Blob, blob0[:]) {
				t.Errorf("node %d got a blob other than node 0's", rank)
			}
			for i, nd := range rep.Nodes {
				if nd.NodeRank != i || nd.Hostname != hostNames[i] || nd.LocalRanks != 2+i {
					t.Errorf("node %d: row %d is %+v", rank, i, nd)
				}
			}
		}
	})

	t.Run("a node that never comes", func(t *testing.T) {
		t.Parallel()
		port := ports[1]
		timeout := 1500 * time.Millisecond
		nodes := []*child{
			startChild(t, helperSpec{NNodes: 4, NodeRank: 0, Port: port, Timeout: timeout}),
			startChild(t, helperSpec{NNodes: 4, NodeRank: 1, Port: port, Timeout: timeout}),
		}
		want := fmt.Sprintf("rendezvous at 127.0.0.1:%d: nodes 2, 3 of 4 did not arrive within 1.5s", port)
		for rank, c := range nodes {
			rep := c.next(t, 10*time.Second)
			if rep.Event != "error" || rep.Error != want {
				t.Errorf("node %d: %+v\nwant the error %q", rank, rep, want)
			}
			if rep.Elapsed < timeout-100*time.Millisecond || rep.Elapsed > timeout+2*time.Second {
				t.Errorf("node %d gave up after %v; the deadline is %v", rank, rep.Elapsed, timeout)
			}
		}
	})

	t.Run("late nodes inside the deadline", func(t *testing.T) {
		t.Parallel()
		port := ports[2]
		// Node 1 dials before node 0 listens; node 2 comes a second late.
		var nodes []*child
		for rank, delay := range []time.Duration{500 * time.Millisecond, 0, time.Second} {
			nodes = append(nodes, startChild(t, helperSpec{NNodes: 3, NodeRank: rank, Port: port, Timeout: 5 * time.Second, Delay: delay}))
		}
		for rank, c := range nodes {
			if rep := c.next(t, 10*time.Second); rep.Event != "joined" {
				t.Errorf("node %d: %+v", rank, rep)
			} else if rank == 1 && rep.Elapsed < 500*time.Millisecond {
				// Node 2 dials a second after its own start; the children's
				// clocks start apart on a loaded machine, so half of it is
				// the bound that still shows node 1 waited for node 2.
				t.Errorf("node 1 joined after %v, before node 2 came", rep.Elapsed)
			}
		}
	})

	for _, killed := range []int{2, 0} {
		t.Run(fmt.Sprintf("node %d killed after the rendezvous", killed), func(t *testing.T) {
			t.Parallel()
			port := ports[3+killed/2]
			var nodes []*child
			for rank := range 3 {
				nodes = append(nodes, startChild(t, helperSpec{NNodes: 3, NodeRank: rank, Port: port, Timeout: 5 * time.Second, Watch: true}))
			}
			for rank, c := range nodes {
				if rep := c.next(t, 10*time.Second); rep.Event != "joined" {
					t.Fatalf("node %d: %+v", rank, rep)
				}
			}
			if err := nodes[killed].cmd.Process.Kill(); err != nil { // SIGKILL: no chance to say goodbye
				t.Fatal(err)
			}
			want := regexp.MustCompile(fmt.Sprintf(`^node %d \(host %s\) left the run \(connection (closed|reset)\)$`, killed, hostNames[killed]))
			for rank, c := range nodes {
				if rank == killed {
					continue
				}
				// A closed socket is seen at once; the bound leaves room for a loaded machine.
				rep := c.next(t, 3*time.Second)
				if rep.Event != "watch" || !want.MatchString(rep.Error) {
					t.Errorf("node %d: %+v\nwant an error matching %s", rank, rep, want)
				}
			}
		})
	}

	t.Run("mismatched recipes", func(t *testing.T) {
		t.Parallel()
		port := ports[5]
		recipes := []string{"9f8e7d6c5b4a3210", "9f8e7d6c5b4a3210", "1a2b3c4d5e6f7788"}
		var nodes []*child
		for rank, recipe := range recipes {
			nodes = append(nodes, startChild(t, helperSpec{NNodes: 3, NodeRank: rank, Port: port, Timeout: 5 * time.Second, Recipe: recipe}))
		}
		want := fmt.Sprintf("rendezvous at 127.0.0.1:%d: node 2 (host c) runs recipe hash 1a2b3c4d5e6f7788, node 0 (host a) runs 9f8e7d6c5b4a3210: every node must run the same recipe", port)
		for rank, c := range nodes {
			if rep := c.next(t, 10*time.Second); rep.Event != "error" || rep.Error != want {
				t.Errorf("node %d: %+v\nwant the error %q", rank, rep, want)
			}
		}
	})
}

// joinThree joins three nodes on a free port, failing the test on an
// error; they are closed when the test ends.
func joinThree(t *testing.T) []joinResult {
	t.Helper()
	port := freePort(t)
	res := joinAll(testConfig(3, 0, port), testConfig(3, 1, port), testConfig(3, 2, port))
	for i, r := range res {
		if r.err != nil {
			t.Fatalf("node %d: %v", i, r.err)
		}
		t.Cleanup(func() { r.r.Close() })
	}
	return res
}

// sumsAll runs AllReduceFloat64 on every node at once, node i with
// vals[i], node 0 after delay0, and returns each node's error.
func sumsAll(res []joinResult, vals [][]float64, delay0 time.Duration) []error {
	errs := make([]error, len(res))
	done := make(chan int)
	for i, r := range res {
		go func() {
			if i == 0 {
				time.Sleep(delay0)
			}
			errs[i] = r.r.AllReduceFloat64(vals[i])
			done <- i
		}()
	}
	for range res {
		<-done
	}
	return errs
}

// TestRendezvousSums: the nodes' AllReduceFloat64 gives every node the
// same total, added in node order (node 0's values first), round after
// round, whichever node calls first; a single node's values are their own
// sum; a node that adds another count of values, or says goodbye in the
// middle of a round, fails the run on every node instead of leaving the
// others waiting; bad arguments are refused before anything is sent.
func TestRendezvousSums(t *testing.T) {
	t.Run("rounds", func(t *testing.T) {
		res := joinThree(t)
		for round := range 20 {
			vals := make([][]float64, 3)
			want := make([]float64, 3)
			for i := range vals {
				// Values whose sum depends on the order of the adds.
				vals[i] = []float64{float64(i + round), 0.1 * float64(i+1), math.Ldexp(1, 60*(1-i)) + float64(round)}
			}
			for j := range want {
				want[j] = vals[0][j]
				for i := 1; i < 3; i++ {
					want[j] += vals[i][j]
				}
			}
			var delay0 time.Duration
			if round%2 == 1 { // node 0's own call after the others' values
				delay0 = 5 * time.Millisecond
			}
			for i, err := range sumsAll(res, vals, delay0) {
				if err != nil {
					t.Fatalf("round %d, node %d: %v", round, i, err)
				}
				for j := range want {
					if math.Float64bits(vals[i][j]) != math.Float64bits(want[j]) {
						t.Fatalf("round %d, node %d: value %d is %v, want %v", round, i, j, vals[i][j], want[j])
					}
				}
			}
		}
		// No values at all is a round too (every node must still call).
		if errs := sumsAll(res, make([][]float64, 3), 0); errors.Join(errs...) != nil {
			t.Fatal(errs)
		}
		for _, r := range res {
			r.r.Close()
		}
		checkNoLeaks(t)
	})

	t.Run("single node", func(t *testing.T) {
		r, err := Join(context.Background(), testConfig(1, 0, freePort(t)))
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		vals := []float64{1.5, -2}
		if err := r.AllReduceFloat64(vals); err != nil || vals[0] != 1.5 || vals[1] != -2 {
			t.Fatalf("AllReduceFloat64 = %v, values %v", err, vals)
		}
	})

	t.Run("counts differ", func(t *testing.T) {
		res := joinThree(t)
		errs := sumsAll(res, [][]float64{{1, 2}, {1, 2}, {1}}, 0)
		for i, err := range errs {
			if err == nil || !strings.Contains(err.Error(), "node 2 (host c) added 1 values in round 0, node 0 2: every node must add as many") {
				t.Errorf("node %d: %v", i, err)
			}
		}
		for _, r := range res {
			r.r.Close()
		}
		checkNoLeaks(t)
	})

	t.Run("goodbye mid-round", func(t *testing.T) {
		res := joinThree(t)
		errs := make(chan error, 2)
		for _, i := range []int{0, 1} {
			go func() { errs <- res[i].r.AllReduceFloat64([]float64{1}) }()
		}
		time.Sleep(50 * time.Millisecond) // both wait in round 0
		res[2].r.Close()
		for range 2 {
			select {
			case err := <-errs:
				if err == nil || !strings.Contains(err.Error(), "node 2 (host c) said goodbye in round 0 of the nodes' sums") {
					t.Errorf("a waiting node got %v", err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("the nodes still wait for a node that said goodbye")
			}
		}
		for _, r := range res {
			r.r.Close()
		}
		checkNoLeaks(t)
	})

	t.Run("arguments", func(t *testing.T) {
		r, err := Join(context.Background(), testConfig(1, 0, freePort(t)))
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		for _, c := range []struct {
			vals []float64
			want string
		}{
			{make([]float64, maxSumValues+1), "adds at most 256"},
			{[]float64{1, math.NaN()}, "value 1 is NaN"},
			{[]float64{math.Inf(-1)}, "value 0 is -Inf"},
		} {
			if err := r.AllReduceFloat64(c.vals); err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("AllReduceFloat64(%d values) = %v, want %q", len(c.vals), err, c.want)
			}
		}
	})
}
