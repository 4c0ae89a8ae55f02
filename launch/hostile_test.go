package launch

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/mktrain/mktrain/internal/peernet"
)

// TestRendezvousHostileClients: while node 0 waits for the others,
// strangers send garbage and a huge length prefix, a wrong secret, a
// replayed handshake and a hundred idle connections, and a node with the
// secret declares a 4 GiB message. The real nodes still meet, no stranger
// is told anything but a nonce, and memory stays bounded.
func TestRendezvousHostileClients(t *testing.T) {
	port := freePort(t)
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	cfg0 := testConfig(3, 0, port)
	cfg0.Timeout = 20 * time.Second
	cfg0.HeartbeatTimeout = 300 * time.Millisecond // also bounds a handshake
	joined := make(chan joinResult, 1)
	go func() {
		r, err := Join(context.Background(), cfg0)
		joined <- joinResult{r, err}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dial := func() net.Conn {
		t.Helper()
		c, err := peernet.DialRetry(ctx, addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	var strangers []net.Conn
	garbage := dial()
	garbage.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
	huge := dial()
	huge.Write([]byte{0xff, 0xff, 0xff, 0xff, '{'})
	strangers = append(strangers, garbage, huge)

	if _, err := peernet.DialAuth(ctx, addr, []byte("not the run's secret"), authRendezvous, 2*time.Second); !errors.Is(err, peernet.ErrSecretRefused) {
		t.Errorf("a wrong secret: %v, want it refused", err)
	}

	// A handshake recorded against another listener of the same secret,
	// replayed to node 0.
	rec, _ := net.Listen("tcp", "127.0.0.1:0")
	go func() {
		c, err := rec.Accept()
		if err == nil {
			peernet.Authenticate(c, testSecret, authRendezvous, false, 2*time.Second)
			c.Close()
		}
	}()
	rc, err := net.Dial("tcp", rec.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	tap := &tapConn{Conn: rc}
	if err := peernet.Authenticate(tap, testSecret, authRendezvous, true, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	rc.Close()
	rec.Close()
	replay := dial()
	replay.Write(tap.written)
	strangers = append(strangers, replay)

	liar, err := peernet.DialAuth(ctx, addr, testSecret, authRendezvous, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer liar.Close()
	var hdr [4]byte
	binary.BigEndian.PutUint32(hdr[:], 1<<32-1)
	liar.Write(hdr[:])

	for range 100 {
		strangers = append(strangers, dial())
	}

	res := joinAll(testConfig(3, 1, port), testConfig(3, 2, port))
	r0 := <-joined
	for i, r := range append(res, r0) {
		if r.err != nil {
			t.Fatalf("join %d: %v", i, r.err)
		}
		defer r.r.Close()
		if got := r.r.Nodes(); len(got) != 3 || got[1].Hostname != "b" || got[2].Hostname != "c" {
			t.Errorf("join %d: node table %+v", i, got)
		}
		if err := r.r.Err(); err != nil {
			t.Errorf("join %d: a stranger failed the run: %v", i, err)
		}
	}
	for i, c := range append(strangers, liar) {
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		n, err := io.Copy(io.Discard, c)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Errorf("stranger %d: its connection is still open", i)
		}
		if c != liar && n > 40 { // the magic and a nonce
			t.Errorf("stranger %d was sent %d bytes", i, n)
		}
	}
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 64<<20 {
		t.Errorf("the hostile clients made node 0 allocate %d MiB", grew>>20)
	}
	for _, r := range append(res, r0) {
		r.r.Close()
	}
	checkNoLeaks(t)
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
