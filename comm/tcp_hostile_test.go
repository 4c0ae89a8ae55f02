package comm_test

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/internal/peernet"
)

// flakyListener fails its first Accepts as a process out of file
// descriptors does.
type flakyListener struct {
	net.Listener
	mu    sync.Mutex
	fails int
}

func (l *flakyListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	fail := l.fails > 0
	l.fails--
	l.mu.Unlock()
	if fail {
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept", syscall.EMFILE)}
	}
	return l.Listener.Accept()
}

// closedWithin reports whether the peer closes c within d (reading and
// dropping whatever it sends first), and how many bytes it sent.
func closedWithin(c net.Conn, d time.Duration) (bool, int) {
	c.SetReadDeadline(time.Now().Add(d))
	n, err := io.Copy(io.Discard, c)
	var ne net.Error
	return err == nil || !(errors.As(err, &ne) && ne.Timeout()), int(n)
}

// TestTCPHostileClients: while node 0 waits for node 1 on its data port,
// strangers send garbage and huge length prefixes, a wrong secret, a
// replayed handshake and a hundred idle connections, a node with the
// secret sends a hello declaring 4 GiB, and Accept fails with EMFILE.
// Node 1 still connects, the world works, the strangers learn nothing but
// a nonce, and memory stays bounded.
func TestTCPHostileClients(t *testing.T) {
	b := cpu.New(backend.Float32)
	m := comm.Mesh{DP: 2, EP: 1, CP: 1, TP: 1}
	real0, _ := net.Listen("tcp", "127.0.0.1:0")
	ln1, _ := net.Listen("tcp", "127.0.0.1:0")
	ln0 := &flakyListener{Listener: real0, fails: 5}
	addrs := []string{real0.Addr().String(), ln1.Addr().String()}
	id := comm.RunIDFromBlob(comm.NewRunBlob())
	cfg := func(node int, ln net.Listener) comm.TCPConfig {
		return comm.TCPConfig{
			Mesh: m, Backend: b, NodeRank: node, Addrs: addrs, Listener: ln, RunID: id, Secret: testSecret,
			DialTimeout: 20 * time.Second, Heartbeat: 50 * time.Millisecond, HeartbeatTimeout: 300 * time.Millisecond,
		}
	}
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)

	worlds := make([]*comm.TCPWorld, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	wg.Go(func() { worlds[0], errs[0] = comm.NewTCPRanks(context.Background(), cfg(0, ln0)) })

	// The strangers give up after a while, so that a node that stopped
	// accepting fails the test instead of hanging it.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dial := func() net.Conn {
		t.Helper()
		c, err := peernet.DialRetry(ctx, addrs[0])
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	var strangers []net.Conn
	garbage := dial()
	garbage.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
	strangers = append(strangers, garbage)
	huge := dial()
	var hdr [22]byte
	hdr[0] = 2 // a data frame
	binary.BigEndian.PutUint64(hdr[14:], 1<<32-1)
	huge.Write(hdr[:])
	strangers = append(strangers, huge)

	// A wrong secret is refused, and the refusal is the handshake's end.
	if _, err := peernet.DialAuth(ctx, addrs[0], []byte("not the run's secret"), "data", 2*time.Second); !errors.Is(err, peernet.ErrSecretRefused) {
		t.Errorf("a wrong secret: %v, want it refused", err)
	}

	// A handshake recorded against another listener of the same secret,
	// replayed to node 0.
	rec, _ := net.Listen("tcp", "127.0.0.1:0")
	go func() {
		c, err := rec.Accept()
		if err == nil {
			peernet.Authenticate(c, testSecret, "data", false, 2*time.Second)
			c.Close()
		}
	}()
	rc, err := net.Dial("tcp", rec.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	tap := &tapConn{Conn: rc}
	if err := peernet.Authenticate(tap, testSecret, "data", true, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	rc.Close()
	rec.Close()
	replay := dial()
	replay.Write(tap.written)
	strangers = append(strangers, replay)

	// A node with the secret whose hello declares 4 GiB.
	liar, err := peernet.DialAuth(ctx, addrs[0], testSecret, "data", 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer liar.Close()
	hdr[0] = 1 // a hello
	liar.Write(hdr[:])

	var idle []net.Conn
	for range 100 {
		idle = append(idle, dial())
	}

	wg.Go(func() { worlds[1], errs[1] = comm.NewTCPRanks(context.Background(), cfg(1, ln1)) })
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("node %d: %v", i, err)
		}
	}
	defer worlds[0].Close()
	defer worlds[1].Close()
	runRanks(t, []*comm.Ranks{worlds[0].Ranks()[0], worlds[1].Ranks()[0]}, func(r *comm.Ranks) error { return r.World.Barrier() })

	for i, c := range append(strangers, idle[0], idle[99]) {
		closed, n := closedWithin(c, 5*time.Second)
		if !closed {
			t.Errorf("stranger %d: its connection is still open", i)
		}
		if n > 40 { // the magic and a nonce
			t.Errorf("stranger %d was sent %d bytes", i, n)
		}
	}
	if closed, _ := closedWithin(liar, 5*time.Second); !closed {
		t.Error("the node that declared a 4 GiB hello is still connected")
	}
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 256<<20 {
		t.Errorf("the hostile clients made the nodes allocate %d MiB", grew>>20)
	}
}

// tapConn keeps what is written through it.
type tapConn struct {
	net.Conn
	written []byte
}

func (c *tapConn) Write(b []byte) (int, error) {
	c.written = append(c.written, b...)
	return c.Conn.Write(b)
}
