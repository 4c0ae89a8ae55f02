package comm

// The TCP transport: the links between the nodes of a multi-process run
// are TCP connections in a full mesh.
//
// Every node listens on a port of its own (the data port, announced to the
// others through the rendezvous: launch.NodeInfo.DataPort); node i dials
// every node j < i and accepts the nodes above it. A new connection first
// runs the handshake over the run's secret (internal/peernet.Authenticate):
// a connection that cannot prove it knows the secret is closed before any
// frame of it is read, without a word and without the run hearing of it.
// Then both sides send a hello frame holding the run's id (so a stale
// process of another run with the same secret is refused) and their node
// rank. At most peernet.MaxHandshakes handshakes run at once, each within
// the heartbeat timeout, and a failed Accept is retried with backoff.
//
// Wire format: a frame is a 22-byte header (kind: 1 byte; group, source
// and destination world ranks: 4 bytes each, big-endian; class: 1 byte;
// payload length: 8 bytes, big-endian) and the payload, whose length is
// capped by the kind (maxPayload) and which is read as it arrives, so a
// header alone allocates at most payloadStep bytes.

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/mktrain/mktrain/internal/peernet"
)

// frameHeader: kind, group, src, dst, class, payload length.
const frameHeader = 1 + 4 + 4 + 4 + 1 + 8

// maxTCPFrame bounds a data frame's payload (a gradient bucket is 64
// MiB; a whole tensor of a large model may be more).
const maxTCPFrame = 1 << 32

// maxAbortText bounds an abort frame's text.
const maxAbortText = 1 << 20

// payloadStep is the most a frame's payload buffer grows by before the
// bytes to fill it have come.
const payloadStep = 64 << 20

// authData is the data connections' purpose in the handshake.
const authData = "data"

// maxPayload is what each kind of frame needs.
func maxPayload(kind byte) (uint64, bool) {
	switch kind {
	case frameHello:
		return RunIDSize + 4, true
	case frameData:
		return maxTCPFrame, true
	case frameHeartbeat, frameBye:
		return 0, true
	case frameAbort:
		return maxAbortText, true
	}
	return 0, false
}

// writeChunk is the most bytes one write deadline covers.
const writeChunk = 1 << 20

// tcpLink is a Link over one TCP connection.
type tcpLink struct {
	conn net.Conn
	wmu  sync.Mutex // one frame at a time
	br   *bufio.Reader
	// progress is the current Recv's callback, for progressReader.
	progress func()
}

func newTCPLink(c net.Conn) *tcpLink {
	l := &tcpLink{conn: c}
	l.br = bufio.NewReaderSize(progressReader{l}, 1<<16)
	return l
}

// progressReader reads from the connection and tells the pending Recv
// that bytes came.
type progressReader struct{ l *tcpLink }

func (p progressReader) Read(b []byte) (int, error) {
	n, err := p.l.conn.Read(b)
	if n > 0 && p.l.progress != nil {
		p.l.progress()
	}
	return n, err
}

func (l *tcpLink) Send(f Frame, timeout time.Duration) error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	return writeTCPFrame(l.conn, f, timeout)
}

func (l *tcpLink) Recv(progress func()) (Frame, error) {
	l.progress = progress
	return readTCPFrame(l.br)
}

func (l *tcpLink) CloseWrite() error {
	if tc, ok := l.conn.(*net.TCPConn); ok {
		return tc.CloseWrite()
	}
	return nil
}

func (l *tcpLink) Close() error { return l.conn.Close() }

// writeTCPFrame sends one frame, giving up when a chunk makes no progress
// for timeout.
func writeTCPFrame(c net.Conn, f Frame, timeout time.Duration) error {
	var hdr [frameHeader]byte
	hdr[0] = f.Kind
	binary.BigEndian.PutUint32(hdr[1:], f.Key.group)
	binary.BigEndian.PutUint32(hdr[5:], f.Key.src)
	binary.BigEndian.PutUint32(hdr[9:], f.Key.dst)
	hdr[13] = f.Key.class
	binary.BigEndian.PutUint64(hdr[14:], uint64(len(f.Payload)))
	c.SetWriteDeadline(time.Now().Add(timeout))
	if _, err := c.Write(hdr[:]); err != nil {
		return err
	}
	// The deadline bounds each chunk, not the whole payload: a large
	// bucket on a slow network is progress, not silence.
	payload := f.Payload
	for len(payload) > 0 {
		chunk := payload[:min(len(payload), writeChunk)]
		c.SetWriteDeadline(time.Now().Add(timeout))
		if _, err := c.Write(chunk); err != nil {
			return err
		}
		payload = payload[len(chunk):]
	}
	return nil
}

func readTCPFrame(r io.Reader) (Frame, error) {
	var hdr [frameHeader]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return Frame{}, err
	}
	f := Frame{Kind: hdr[0], Key: msgKey{
		group: binary.BigEndian.Uint32(hdr[1:]), src: binary.BigEndian.Uint32(hdr[5:]),
		dst: binary.BigEndian.Uint32(hdr[9:]), class: hdr[13],
	}}
	n := binary.BigEndian.Uint64(hdr[14:])
	limit, ok := maxPayload(f.Kind)
	if !ok {
		return Frame{}, fmt.Errorf("frame of unknown kind %d (not an mktrain node?)", f.Kind)
	}
	if n > limit {
		return Frame{}, fmt.Errorf("frame of kind %d with %d bytes exceeds its %d-byte limit (not an mktrain node?)", f.Kind, n, limit)
	}
	var err error
	f.Payload, err = readPayload(r, int(n))
	return f, err
}

// readPayload reads n bytes, growing the buffer by at most payloadStep
// ahead of the bytes that came.
func readPayload(r io.Reader, n int) ([]byte, error) {
	buf := make([]byte, min(n, payloadStep))
	if _, err := io.ReadFull(r, buf); err != nil {
		return nil, err
	}
	for len(buf) < n {
		have := len(buf)
		buf = slices.Grow(buf, min(n-have, payloadStep))[:min(n, have+payloadStep)]
		if _, err := io.ReadFull(r, buf[have:]); err != nil {
			return nil, err
		}
	}
	return buf, nil
}

// tcpMesh is what connecting needs: this node, every node's address, the
// listener the nodes above this one dial, and the run id.
type tcpMesh struct {
	node    int
	addrs   []string
	ln      net.Listener
	runID   [RunIDSize]byte
	secret  []byte
	silence time.Duration // bounds the handshake and the hello exchange
}

// helloPayload is what each side of a new connection sends first: the run
// id and its node rank.
func helloPayload(id [RunIDSize]byte, node int) []byte {
	p := append([]byte(nil), id[:]...)
	return binary.BigEndian.AppendUint32(p, uint32(node))
}

func parseHello(f Frame, id [RunIDSize]byte) (int, error) {
	if f.Kind != frameHello || len(f.Payload) != RunIDSize+4 {
		return 0, errors.New("it did not say hello (not an mktrain node?)")
	}
	if string(f.Payload[:RunIDSize]) != string(id[:]) {
		return 0, errors.New("it belongs to another run (a different run id)")
	}
	return int(binary.BigEndian.Uint32(f.Payload[RunIDSize:])), nil
}

// connResult is one finished dial or accept.
type connResult struct {
	node int // -1 for a stray connection
	c    net.Conn
	err  error
}

// connect builds the full mesh: this node dials the nodes below it and
// accepts the nodes above it. It returns a link per other node, by node
// rank (nil at this node's own), or an error naming the nodes that did not
// connect within timeout. The listener is closed when it returns.
func (m tcpMesh) connect(ctx context.Context, timeout time.Duration) ([]Link, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	self, n := m.node, len(m.addrs)
	conns := make([]net.Conn, n)
	results := make(chan connResult, n)
	var pending sync.WaitGroup
	for j := range self {
		pending.Go(func() {
			c, err := m.dial(ctx, j)
			select {
			case results <- connResult{j, c, err}:
			case <-ctx.Done():
				if c != nil {
					c.Close()
				}
			}
		})
	}
	if self < n-1 {
		pending.Go(func() { m.acceptLoop(ctx, results) })
	}
	// The accept loop ends when the listener closes, and the dials when
	// ctx ends: both before connect returns.
	defer func() {
		cancel()
		m.ln.Close()
		pending.Wait()
	}()
	fail := func(notes []string) ([]Link, error) {
		for _, c := range conns {
			if c != nil {
				c.Close()
			}
		}
		return nil, m.connectErr(ctx, conns, timeout, notes)
	}
	connected := 0
	var notes []string
	for connected < n-1 {
		select {
		case r := <-results:
			switch {
			case r.err != nil && r.node >= 0 && r.node < self: // a dial gave up
				return fail(append(notes, r.err.Error()))
			case r.err != nil: // a stray or stale connection: keep waiting
				notes = append(notes, r.err.Error())
			case conns[r.node] != nil:
				r.c.Close()
				notes = append(notes, fmt.Sprintf("node %d connected twice; kept the first", r.node))
			default:
				conns[r.node] = r.c
				connected++
			}
		case <-ctx.Done():
			return fail(notes)
		}
	}
	links := make([]Link, n)
	for j, c := range conns {
		if c != nil {
			links[j] = newTCPLink(c)
		}
	}
	return links, nil
}

func (m tcpMesh) connectErr(ctx context.Context, conns []net.Conn, timeout time.Duration, notes []string) error {
	var missing []int
	for j := range m.addrs {
		if j != m.node && conns[j] == nil {
			missing = append(missing, j)
		}
	}
	msg := fmt.Sprintf("comm: tcp: node %d: %s did not connect within %s", m.node, peernet.RankList("node", missing), peernet.Duration(timeout))
	if err := context.Cause(ctx); err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
		msg = fmt.Sprintf("comm: tcp: node %d: stopped waiting for %s: %v", m.node, peernet.RankList("node", missing), err)
	}
	if len(notes) > 0 {
		msg += " (" + strings.Join(notes, "; ") + ")"
	}
	return errors.New(msg)
}

// dial connects to node j, retrying until ctx ends, and exchanges hellos.
func (m tcpMesh) dial(ctx context.Context, j int) (net.Conn, error) {
	addr := m.addrs[j]
	c, err := peernet.DialAuth(ctx, addr, m.secret, authData, m.silence)
	if errors.Is(err, peernet.ErrSecretRefused) {
		return nil, fmt.Errorf("node %d at %s refused this node's secret (every node must be given the same)", j, addr)
	}
	if err != nil {
		return nil, fmt.Errorf("node %d at %s did not answer (last attempt: %v)", j, addr, err)
	}
	if _, err := m.handshake(c, j); err != nil {
		c.Close()
		return nil, fmt.Errorf("node %d at %s: %v", j, addr, err)
	}
	return c, nil
}

// handshake sends this node's hello on c and checks the peer's, which must
// come from node want (or, with want < 0, from a node above this one that
// dials it); it returns the peer's node rank.
func (m tcpMesh) handshake(c net.Conn, want int) (int, error) {
	c.SetDeadline(time.Now().Add(m.silence))
	defer c.SetDeadline(time.Time{})
	if err := writeTCPFrame(c, Frame{Kind: frameHello, Payload: helloPayload(m.runID, m.node)}, m.silence); err != nil {
		return 0, err
	}
	f, err := readTCPFrame(c) // unbuffered: the frames after the hello are the link's
	if err != nil {
		return 0, err
	}
	node, err := parseHello(f, m.runID)
	if err != nil {
		return 0, err
	}
	switch {
	case want >= 0 && node != want:
		return 0, fmt.Errorf("it says it is node %d", node)
	case want < 0 && (node <= m.node || node >= len(m.addrs)):
		return 0, fmt.Errorf("a connection says it is node %d, which does not dial node %d", node, m.node)
	}
	return node, nil
}

// acceptLoop takes the connections of the nodes above this one until the
// listener closes. A connection without the secret is dropped unheard; one
// with it but of another run (or a bad hello) is reported and dropped.
func (m tcpMesh) acceptLoop(ctx context.Context, results chan<- connResult) {
	var hs sync.WaitGroup
	defer hs.Wait()
	gate := peernet.NewGate(peernet.MaxHandshakes)
	var mu sync.Mutex
	shaking := map[net.Conn]bool{} // cut short when the listener closes
	var wait time.Duration
	for {
		c, err := m.ln.Accept()
		if errors.Is(err, net.ErrClosed) { // connect closed the listener
			mu.Lock()
			for c := range shaking {
				c.Close()
			}
			mu.Unlock()
			return
		}
		if err != nil { // say, out of file descriptors: try again
			var ok bool
			if wait, ok = peernet.AcceptBackoff(ctx.Done(), wait); !ok {
				return
			}
			continue
		}
		wait = 0
		if !gate.Enter() {
			c.Close()
			continue
		}
		mu.Lock()
		shaking[c] = true
		mu.Unlock()
		hs.Go(func() {
			defer gate.Leave()
			err := peernet.Authenticate(c, m.secret, authData, false, m.silence)
			mu.Lock()
			delete(shaking, c)
			mu.Unlock()
			if err != nil {
				c.Close()
				return
			}
			node, err := m.handshake(c, -1)
			if err != nil {
				from := c.RemoteAddr()
				c.Close()
				node, c, err = -1, nil, fmt.Errorf("refused a connection from %s: %v", from, err)
			}
			select {
			case results <- connResult{node, c, err}:
			case <-ctx.Done():
				if c != nil {
					c.Close()
				}
			}
		})
	}
}
