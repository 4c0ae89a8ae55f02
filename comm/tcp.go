package comm

// The TCP communicator: the ranks of a run are spread over several
// processes (nodes), each hosting an equal, contiguous block of world ranks,
// and the groups' collectives move their data over TCP between the nodes.
// It serves the CPU backend across processes and is the model for the
// NCCL groups of the CUDA backend: the engine receives the same []*Ranks
// whichever implementation built them.
//
// # Connections and messages
//
// Every node listens on a port of its own (the data port, announced to the
// others through the rendezvous: NodeInfo.DataPort) and the nodes connect
// in a full mesh: node i dials every node j < i and both sides say hello
// with the run's id (so a stray or stale process is refused) and their node
// rank. All the groups' traffic between two nodes shares that one
// connection. A message is a frame tagged with its group, its source and
// destination world ranks and a class (collective, point-to-point,
// acknowledgement); one reader goroutine per connection files every frame
// in the inbox of its tag at once, so a sender never waits for its receiver
// to call Recv and two nodes cannot deadlock on full socket buffers. Ranks
// of the same node exchange their messages through the inboxes directly.
// Between one pair of ranks the messages of a tag arrive in the order sent,
// and every rank calls its group's collectives in the same order, so the
// k-th message a rank takes from an inbox is the k-th the peer put there.
//
// # Collectives
//
// Tensors travel as host bytes: the sender downloads them (Backend.Download)
// and the receiver uploads them (Backend.Upload). The collectives that
// combine data meet at the group's rank 0, the root: every other rank sends
// it its arguments and data, the root checks them all (the same operation,
// the same lengths, no rank's argument error), computes, and answers every
// rank with its result or with the one error all ranks return. Reductions
// are computed by the root in rank order with the backend's own ops (Copy
// from rank 0, then Axpy with alpha 1 from rank 1, 2, ...), exactly the
// order of the in-process implementation, so a layout split over processes
// gives bitwise the sums it gives as virtual ranks, and every rank gets the
// root's bits. AllToAllRows checks the plan at the root, then each rank
// sends its blocks straight to their destinations. Send and Recv go
// straight from one rank to the other; the receiver acknowledges with its
// verdict, so Send returns once the transfer is done, as the in-process
// Send does.
//
// The root does the whole group's work and carries all its traffic: simple
// and correct, made for the CPU backend and for tests of the multi-process
// paths; the GPU path uses NCCL's rings instead.
//
// AllReduceSumStart (comm.AsyncReducer) runs an AllReduceSum on a goroutine
// of its own, behind the reductions the rank started before it on the
// group, so that a rank's gradient buckets travel while it computes the
// rest of its backward.
//
// # Failures
//
// A rank never waits without a bound:
//
//   - A connection that breaks (a killed process's sockets close at once)
//     fails the whole run on this node with an error naming the node and
//     the world ranks that were lost; the node tells the others (an abort
//     frame), so every pending and future operation of every group ends
//     with that error.
//   - Each side sends a heartbeat every Heartbeat; a peer silent for
//     HeartbeatTimeout (a hung host, a cut network) counts as lost.
//   - A wait for one message longer than OpTimeout (a peer that is alive
//     but never reaches the collective) fails the run too.
//   - Abort on any group fails the whole run, here and on every other node:
//     a failed rank ends a multi-process run anyway, and its peers in other
//     groups must not wait for it.
//
// A node that finishes says goodbye before it closes its connections; a
// peer that is still waiting for a message from it then fails with "node N
// has left the run" rather than hanging, and one that is done is not
// disturbed. A message that arrived before a failure is still delivered: an
// inbox is drained before the failure is reported, so ranks that finished
// their last collective are not failed by a peer leaving right after it.

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/internal/peernet"
)

// TCP defaults.
const (
	DefaultTCPDialTimeout = 2 * time.Minute
	DefaultTCPOpTimeout   = 30 * time.Minute
	// A node sends a heartbeat every DefaultHeartbeat and counts a peer
	// silent for DefaultHeartbeatTimeout as lost.
	DefaultHeartbeat        = time.Second
	DefaultHeartbeatTimeout = 15 * time.Second
)

// TCPConfig is one node's part of a TCP world.
type TCPConfig struct {
	Mesh    Mesh
	Backend backend.Backend // holds this node's ranks' tensors
	// NodeRank is this node; Addrs holds every node's data address
	// (host:port), by node rank. The world's ranks are split evenly over
	// the nodes in rank order: node n hosts world ranks n*R .. n*R+R-1,
	// with R = Mesh.World()/len(Addrs).
	NodeRank int
	Addrs    []string
	// Listener is this node's data listener, which Addrs[NodeRank]
	// reaches; the world owns it from NewTCPRanks on and closes it.
	Listener net.Listener
	// RunID tags the connections: every node must give the same (the
	// rendezvous blob's first bytes: RunIDFromBlob).
	RunID [RunIDSize]byte

	// DialTimeout bounds the wait for every node to connect; 0 is
	// DefaultTCPDialTimeout.
	DialTimeout time.Duration
	// Heartbeat is the interval between heartbeats, HeartbeatTimeout how
	// long a silent peer counts as alive (at least twice Heartbeat); 0 is
	// DefaultHeartbeat and DefaultHeartbeatTimeout.
	Heartbeat, HeartbeatTimeout time.Duration
	// OpTimeout bounds one wait for one peer's message; 0 is
	// DefaultTCPOpTimeout. It must exceed the longest time one rank may
	// compute between two collectives while a peer waits.
	OpTimeout time.Duration
}

// TCPWorld is one node's membership in a TCP world: the ranks it hosts and
// the connections to the other nodes. Close it when the run ends.
type TCPWorld struct {
	cfg       TCPConfig
	perNode   int      // ranks per node
	local     []*Ranks // this node's ranks, by local index
	conns     []*tcpConn
	ln        net.Listener
	heartbeat time.Duration
	silence   time.Duration
	opTimeout time.Duration

	mu      sync.Mutex
	inboxes map[tcpKey]*inbox

	failOnce sync.Once
	failed   chan struct{} // closed on the first failure, after err is set
	err      error

	closeOnce sync.Once
	closing   chan struct{}
	wg        sync.WaitGroup
}

// NewTCPRanks connects this node to the others of cfg and returns the
// world, whose Ranks are the ranks this node hosts. It returns once every
// node has connected, or with an error naming the nodes that did not
// within DialTimeout (or when ctx ends).
func NewTCPRanks(ctx context.Context, cfg TCPConfig) (*TCPWorld, error) {
	if err := cfg.check(); err != nil {
		if cfg.Listener != nil {
			cfg.Listener.Close()
		}
		return nil, err
	}
	dur := func(d, def time.Duration) time.Duration {
		if d > 0 {
			return d
		}
		return def
	}
	n := len(cfg.Addrs)
	w := &TCPWorld{
		cfg: cfg, perNode: cfg.Mesh.World() / n,
		conns: make([]*tcpConn, n), ln: cfg.Listener,
		heartbeat: dur(cfg.Heartbeat, DefaultHeartbeat),
		silence:   dur(cfg.HeartbeatTimeout, DefaultHeartbeatTimeout),
		opTimeout: dur(cfg.OpTimeout, DefaultTCPOpTimeout),
		inboxes:   map[tcpKey]*inbox{},
		failed:    make(chan struct{}),
		closing:   make(chan struct{}),
	}
	if w.silence < 2*w.heartbeat {
		cfg.Listener.Close()
		return nil, fmt.Errorf("comm: tcp: HeartbeatTimeout %v is less than twice Heartbeat %v; one late heartbeat would end the run", w.silence, w.heartbeat)
	}
	if err := w.connect(ctx, dur(cfg.DialTimeout, DefaultTCPDialTimeout)); err != nil {
		w.ln.Close()
		for _, c := range w.conns {
			if c != nil {
				c.conn.Close()
			}
		}
		return nil, err
	}
	w.ln.Close() // every node has connected
	for _, c := range w.conns {
		if c != nil {
			w.wg.Add(2)
			go w.readLoop(c)
			go w.heartbeatLoop(c)
		}
	}
	w.local = w.buildRanks()
	return w, nil
}

func (c TCPConfig) check() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf("comm: tcp: "+format, args...)) }
	if err := c.Mesh.Validate(); err != nil {
		errs = append(errs, err)
	}
	n := len(c.Addrs)
	switch {
	case n < 1:
		bad("no node addresses (Addrs is empty)")
	case c.NodeRank < 0 || c.NodeRank >= n:
		bad("node rank %d is not one of the %d nodes", c.NodeRank, n)
	case c.Mesh.Validate() == nil && c.Mesh.World()%n != 0:
		bad("the world of %d ranks (dp %d x ep %d x cp %d x tp %d) does not split evenly over %d nodes",
			c.Mesh.World(), c.Mesh.DP, c.Mesh.EP, c.Mesh.CP, c.Mesh.TP, n)
	}
	if c.Backend == nil {
		bad("no backend for the ranks' tensors")
	}
	if c.Listener == nil {
		bad("no listener for the other nodes' connections")
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"DialTimeout", c.DialTimeout}, {"Heartbeat", c.Heartbeat}, {"HeartbeatTimeout", c.HeartbeatTimeout}, {"OpTimeout", c.OpTimeout}} {
		if d.v < 0 {
			bad("%s is %v; it must be positive (or 0 for the default)", d.name, d.v)
		}
	}
	return errors.Join(errs...)
}

// Ranks is this node's ranks, by local index (world rank NodeRank*R + i).
func (w *TCPWorld) Ranks() []*Ranks { return w.local }

// NodeOf is the node that hosts a world rank.
func (w *TCPWorld) NodeOf(worldRank int) int { return worldRank / w.perNode }

// Err is the world's failure so far, or nil.
func (w *TCPWorld) Err() error {
	select {
	case <-w.failed:
		return w.err
	default:
		return nil
	}
}

// Failed is closed when the world fails (Err then says why).
func (w *TCPWorld) Failed() <-chan struct{} { return w.failed }

// Abort fails the world here and on every other node: every pending and
// future operation of every group returns an error wrapping err.
func (w *TCPWorld) Abort(err error) {
	if err == nil {
		err = errors.New("aborted without a reason")
	}
	w.fail(err, true)
}

// Close leaves the world: the other nodes are told goodbye, and every
// connection and goroutine ends. It waits briefly for the peers to close
// their side, so that the last messages are read before the sockets go.
func (w *TCPWorld) Close() error {
	w.closeOnce.Do(func() {
		close(w.closing)
		var wg sync.WaitGroup
		for _, c := range w.conns {
			if c == nil {
				continue
			}
			wg.Go(func() {
				c.write(tcpBye, tcpKey{}, nil, w.silence)
				if tc, ok := c.conn.(*net.TCPConn); ok {
					tc.CloseWrite()
				}
				t := time.NewTimer(tcpLinger)
				defer t.Stop()
				select {
				case <-c.readerDone:
				case <-t.C:
				}
				c.conn.Close()
			})
		}
		wg.Wait()
	})
	w.wg.Wait()
	return nil
}

// tcpLinger bounds how long Close waits for a peer to close its side.
const tcpLinger = 2 * time.Second

// fail records the world's first failure and wakes every waiting rank;
// with tell, the other nodes are sent the error too.
func (w *TCPWorld) fail(err error, tell bool) {
	first := false
	w.failOnce.Do(func() {
		w.err = err
		close(w.failed)
		first = true
	})
	if !first || !tell {
		return
	}
	msg := []byte(fmt.Sprintf("node %d: %v", w.cfg.NodeRank, err))
	for _, c := range w.conns {
		if c != nil && !c.isGone() {
			go c.write(tcpAbort, tcpKey{}, msg, time.Second) // best effort; never blocks the failing rank
		}
	}
}

// ranksOf describes the world ranks a node hosts: "rank 3" or "ranks 2-3".
func (w *TCPWorld) ranksOf(node int) string {
	lo := node * w.perNode
	if w.perNode == 1 {
		return fmt.Sprintf("rank %d", lo)
	}
	return fmt.Sprintf("ranks %d-%d", lo, lo+w.perNode-1)
}

// ---- connections ---------------------------------------------------------

// Frame kinds.
const (
	tcpHello byte = iota + 1
	tcpData
	tcpHeartbeat
	tcpAbort
	tcpBye
)

// Message classes: a tag's last field, so that a pair's collective traffic,
// point-to-point messages and acknowledgements never mix.
const (
	classColl byte = iota
	classRows
	classP2P
	classAck
)

// tcpKey tags a message: its group, source and destination world ranks,
// and class.
type tcpKey struct {
	group    uint32
	src, dst uint32
	class    byte
}

// frameHeader: kind, group, src, dst, class, payload length.
const frameHeader = 1 + 4 + 4 + 4 + 1 + 8

// maxTCPFrame bounds a frame's payload (a gradient bucket is 64 MiB).
const maxTCPFrame = 1 << 32

// tcpConn is the connection to one other node.
type tcpConn struct {
	node       int
	conn       net.Conn
	wmu        sync.Mutex // one frame at a time
	readerDone chan struct{}

	gmu     sync.Mutex
	gone    chan struct{} // closed when the peer said goodbye or the connection ended
	goneErr error
}

func newTCPConn(node int, c net.Conn) *tcpConn {
	return &tcpConn{node: node, conn: c, readerDone: make(chan struct{}), gone: make(chan struct{})}
}

func (c *tcpConn) isGone() bool { return isClosed(c.gone) }

func (c *tcpConn) markGone(err error) {
	c.gmu.Lock()
	defer c.gmu.Unlock()
	if c.goneErr == nil {
		c.goneErr = err
		close(c.gone)
	}
}

func (c *tcpConn) whyGone() error {
	c.gmu.Lock()
	defer c.gmu.Unlock()
	return c.goneErr
}

// write sends one frame, giving up after timeout.
func (c *tcpConn) write(kind byte, k tcpKey, payload []byte, timeout time.Duration) error {
	var hdr [frameHeader]byte
	hdr[0] = kind
	binary.BigEndian.PutUint32(hdr[1:], k.group)
	binary.BigEndian.PutUint32(hdr[5:], k.src)
	binary.BigEndian.PutUint32(hdr[9:], k.dst)
	hdr[13] = k.class
	binary.BigEndian.PutUint64(hdr[14:], uint64(len(payload)))
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.conn.SetWriteDeadline(time.Now().Add(timeout))
	if _, err := c.conn.Write(hdr[:]); err != nil {
		return err
	}
	// The deadline bounds each chunk, not the whole payload: a large
	// bucket on a slow network is progress, not silence.
	for len(payload) > 0 {
		chunk := payload[:min(len(payload), writeChunk)]
		c.conn.SetWriteDeadline(time.Now().Add(timeout))
		if _, err := c.conn.Write(chunk); err != nil {
			return err
		}
		payload = payload[len(chunk):]
	}
	return nil
}

// writeChunk is the most bytes one write deadline covers.
const writeChunk = 1 << 20

// deadlineReader reads from a connection, moving the read deadline before
// every read: the peer counts as silent after a span without any bytes,
// however long a frame takes to arrive.
type deadlineReader struct {
	conn    net.Conn
	silence time.Duration
}

func (d deadlineReader) Read(p []byte) (int, error) {
	d.conn.SetReadDeadline(time.Now().Add(d.silence))
	return d.conn.Read(p)
}

func readTCPFrame(r io.Reader) (kind byte, k tcpKey, payload []byte, err error) {
	var hdr [frameHeader]byte
	if _, err = io.ReadFull(r, hdr[:]); err != nil {
		return
	}
	kind = hdr[0]
	k = tcpKey{group: binary.BigEndian.Uint32(hdr[1:]), src: binary.BigEndian.Uint32(hdr[5:]), dst: binary.BigEndian.Uint32(hdr[9:]), class: hdr[13]}
	n := binary.BigEndian.Uint64(hdr[14:])
	if n > maxTCPFrame {
		return 0, k, nil, fmt.Errorf("frame of %d bytes exceeds the %d-byte limit (not an mktrain node?)", n, uint64(maxTCPFrame))
	}
	payload = make([]byte, n)
	_, err = io.ReadFull(r, payload)
	return
}

// hello is what each side of a new connection sends first: the run id and
// its node rank.
func helloPayload(id [RunIDSize]byte, node int) []byte {
	p := append([]byte(nil), id[:]...)
	return binary.BigEndian.AppendUint32(p, uint32(node))
}

func parseHello(kind byte, p []byte, id [RunIDSize]byte) (int, error) {
	if kind != tcpHello || len(p) != RunIDSize+4 {
		return 0, errors.New("it did not say hello (not an mktrain node?)")
	}
	if string(p[:RunIDSize]) != string(id[:]) {
		return 0, errors.New("it belongs to another run (a different run id)")
	}
	return int(binary.BigEndian.Uint32(p[RunIDSize:])), nil
}

// connResult is one finished dial or accept.
type connResult struct {
	node int // -1 for a stray connection
	c    net.Conn
	err  error
}

// connect builds the full mesh: this node dials the nodes below it and
// accepts the nodes above it.
func (w *TCPWorld) connect(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	self, n := w.cfg.NodeRank, len(w.cfg.Addrs)
	results := make(chan connResult, n)
	var pending sync.WaitGroup
	for j := range self {
		pending.Go(func() {
			c, err := w.dial(ctx, j)
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
		pending.Go(func() { w.acceptLoop(ctx, results) })
	}
	// The accept loop ends when the listener closes, and the dials when
	// ctx ends: both before connect returns.
	defer func() {
		cancel()
		w.ln.Close()
		pending.Wait()
	}()
	connected := 0
	var notes []string
	for connected < n-1 {
		select {
		case r := <-results:
			switch {
			case r.err != nil && r.node >= 0 && r.node < self: // a dial gave up
				notes = append(notes, r.err.Error())
				return w.connectErr(ctx, timeout, notes)
			case r.err != nil: // a stray or stale connection: keep waiting
				notes = append(notes, r.err.Error())
			case w.conns[r.node] != nil:
				r.c.Close()
				notes = append(notes, fmt.Sprintf("node %d connected twice; kept the first", r.node))
			default:
				w.conns[r.node] = newTCPConn(r.node, r.c)
				connected++
			}
		case <-ctx.Done():
			return w.connectErr(ctx, timeout, notes)
		}
	}
	return nil
}

func (w *TCPWorld) connectErr(ctx context.Context, timeout time.Duration, notes []string) error {
	var missing []int
	for j := range w.cfg.Addrs {
		if j != w.cfg.NodeRank && w.conns[j] == nil {
			missing = append(missing, j)
		}
	}
	msg := fmt.Sprintf("comm: tcp: node %d: %s did not connect within %s", w.cfg.NodeRank, peernet.RankList("node", missing), peernet.Duration(timeout))
	if err := context.Cause(ctx); err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
		msg = fmt.Sprintf("comm: tcp: node %d: stopped waiting for %s: %v", w.cfg.NodeRank, peernet.RankList("node", missing), err)
	}
	if len(notes) > 0 {
		msg += " (" + strings.Join(notes, "; ") + ")"
	}
	return errors.New(msg)
}

// dial connects to node j, retrying until ctx ends, and exchanges hellos.
func (w *TCPWorld) dial(ctx context.Context, j int) (net.Conn, error) {
	addr := w.cfg.Addrs[j]
	c, err := peernet.DialRetry(ctx, addr)
	if err != nil {
		return nil, fmt.Errorf("node %d at %s did not answer (last attempt: %v)", j, addr, err)
	}
	if _, err := w.handshake(c, j); err != nil {
		c.Close()
		return nil, fmt.Errorf("node %d at %s: %v", j, addr, err)
	}
	return c, nil
}

// handshake sends this node's hello on c and checks the peer's, which must
// come from node want (or, with want < 0, from a node above this one that
// dials it); it returns the peer's node rank.
func (w *TCPWorld) handshake(c net.Conn, want int) (int, error) {
	c.SetDeadline(time.Now().Add(w.silence))
	defer c.SetDeadline(time.Time{})
	tc := newTCPConn(-1, c)
	if err := tc.write(tcpHello, tcpKey{}, helloPayload(w.cfg.RunID, w.cfg.NodeRank), w.silence); err != nil {
		return 0, err
	}
	kind, _, p, err := readTCPFrame(c) // unbuffered: the frames after the hello are the read loop's
	if err != nil {
		return 0, err
	}
	node, err := parseHello(kind, p, w.cfg.RunID)
	if err != nil {
		return 0, err
	}
	switch {
	case want >= 0 && node != want:
		return 0, fmt.Errorf("it says it is node %d", node)
	case want < 0 && (node <= w.cfg.NodeRank || node >= len(w.cfg.Addrs)):
		return 0, fmt.Errorf("a connection says it is node %d, which does not dial node %d", node, w.cfg.NodeRank)
	}
	return node, nil
}

// acceptLoop takes the connections of the nodes above this one until the
// listener closes. A stray connection is reported and dropped.
func (w *TCPWorld) acceptLoop(ctx context.Context, results chan<- connResult) {
	var hs sync.WaitGroup
	defer hs.Wait()
	for {
		c, err := w.ln.Accept()
		if err != nil {
			return // connect closed the listener
		}
		hs.Go(func() {
			node, err := w.handshake(c, -1)
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

// readLoop files the frames from one node until its connection ends.
func (w *TCPWorld) readLoop(c *tcpConn) {
	defer w.wg.Done()
	defer close(c.readerDone)
	br := bufio.NewReaderSize(deadlineReader{c.conn, w.silence}, 1<<16)
	for {
		kind, k, p, err := readTCPFrame(br)
		if err != nil {
			w.lost(c, err)
			return
		}
		switch kind {
		case tcpHeartbeat:
		case tcpData:
			w.inbox(k).put(p)
		case tcpAbort:
			w.fail(errors.New(string(p)), false)
		case tcpBye:
			c.markGone(fmt.Errorf("node %d (%s) has left the run", c.node, w.ranksOf(c.node)))
		default:
			w.lost(c, fmt.Errorf("unexpected frame kind %d", kind))
			return
		}
	}
}

// lost handles the end of a connection: after a goodbye, or while this
// node closes, it is the normal end; otherwise the node is lost and the run
// fails.
func (w *TCPWorld) lost(c *tcpConn, err error) {
	if c.isGone() || isClosed(w.closing) {
		c.markGone(fmt.Errorf("node %d (%s) has left the run", c.node, w.ranksOf(c.node)))
		return
	}
	lostErr := fmt.Errorf("lost node %d (%s): %s", c.node, w.ranksOf(c.node), peernet.DescribeDrop(err, w.silence))
	c.markGone(lostErr)
	w.fail(lostErr, true)
}

// heartbeatLoop keeps the connection from looking silent.
func (w *TCPWorld) heartbeatLoop(c *tcpConn) {
	defer w.wg.Done()
	t := time.NewTicker(w.heartbeat)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			if c.isGone() {
				return
			}
			if err := c.write(tcpHeartbeat, tcpKey{}, nil, w.silence); err != nil {
				return // the reader reports the connection
			}
		case <-c.readerDone:
			return
		case <-w.closing:
			return
		}
	}
}

// ---- inboxes ---------------------------------------------------------------

// inbox holds the messages of one tag that arrived and were not yet taken.
// One goroutine takes from an inbox at a time (the destination rank's).
type inbox struct {
	mu   sync.Mutex
	msgs [][]byte
	wake chan struct{} // holds a token when msgs may have grown
}

func (w *TCPWorld) inbox(k tcpKey) *inbox {
	w.mu.Lock()
	defer w.mu.Unlock()
	b, ok := w.inboxes[k]
	if !ok {
		b = &inbox{wake: make(chan struct{}, 1)}
		w.inboxes[k] = b
	}
	return b
}

func (b *inbox) put(p []byte) {
	b.mu.Lock()
	b.msgs = append(b.msgs, p)
	b.mu.Unlock()
	select {
	case b.wake <- struct{}{}:
	default:
	}
}

func (b *inbox) take() ([]byte, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.msgs) == 0 {
		return nil, false
	}
	p := b.msgs[0]
	b.msgs[0] = nil
	b.msgs = b.msgs[1:]
	return p, true
}

// send delivers p under k: to the inbox directly when the destination rank
// is on this node, else over the destination node's connection.
func (w *TCPWorld) send(k tcpKey, p []byte) error {
	if err := w.Err(); err != nil {
		return err
	}
	node := w.NodeOf(int(k.dst))
	if node == w.cfg.NodeRank {
		w.inbox(k).put(p)
		return nil
	}
	c := w.conns[node]
	if c.isGone() {
		return c.whyGone()
	}
	if err := c.write(tcpData, k, p, w.silence); err != nil {
		err = fmt.Errorf("lost node %d (%s): sending failed: %v", node, w.ranksOf(node), err)
		w.fail(err, true)
		return err
	}
	return nil
}

// recv takes the next message under k. Messages that arrived are delivered
// even after a failure; otherwise it waits for one until the world fails,
// the source node leaves, or OpTimeout passes.
func (w *TCPWorld) recv(k tcpKey) ([]byte, error) {
	b := w.inbox(k)
	var gone chan struct{}
	var src *tcpConn
	if node := w.NodeOf(int(k.src)); node != w.cfg.NodeRank {
		src = w.conns[node]
		gone = src.gone
	}
	var timeout <-chan time.Time
	for {
		if p, ok := b.take(); ok {
			return p, nil
		}
		if err := w.Err(); err != nil {
			return nil, err
		}
		if timeout == nil {
			t := time.NewTimer(w.opTimeout)
			defer t.Stop()
			timeout = t.C
		}
		select {
		case <-b.wake:
		case <-w.failed:
		case <-gone:
			if p, ok := b.take(); ok { // sent just before it left
				return p, nil
			}
			return nil, src.whyGone()
		case <-timeout:
			err := fmt.Errorf("rank %d waited %s for a message from rank %d (node %d), which is alive but did not send it: do all ranks call the same collectives in the same order?",
				k.dst, peernet.Duration(w.opTimeout), k.src, w.NodeOf(int(k.src)))
			w.fail(err, true)
			return nil, err
		}
	}
}

// ---- groups ----------------------------------------------------------------

// buildRanks cuts this node's ranks' groups from the mesh (Mesh.Members).
// A group's id is its kind in the top byte and its lowest world rank in
// the rest, so every node numbers the groups alike.
func (w *TCPWorld) buildRanks() []*Ranks {
	m := w.cfg.Mesh
	group := func(k GroupKind, self int) *tcpGroup {
		members, place := m.Members(k, self)
		return &tcpGroup{
			w: w, b: w.cfg.Backend, name: k.String(),
			id:      uint32(k)<<24 | uint32(slices.Min(members)),
			members: members, rank: place, self: self,
		}
	}
	out := make([]*Ranks, w.perNode)
	for i := range out {
		r := w.cfg.NodeRank*w.perNode + i
		out[i] = &Ranks{
			Mesh: m, Coord: m.Coord(r), Rank: r,
			World: group(GroupWorld, r), Data: group(GroupData, r), Expert: group(GroupExpert, r),
			ExpertReplica: group(GroupExpertReplica, r), Context: group(GroupContext, r), DataContext: group(GroupDataContext, r),
		}
	}
	return out
}

// tcpGroup is one rank's handle on a group of a TCP world.
type tcpGroup struct {
	w       *TCPWorld
	b       backend.Backend
	name    string
	id      uint32
	members []int // world ranks, by group rank
	rank    int   // this rank's group rank
	self    int   // this rank's world rank

	// scratch holds the root's sums, and what it uploads before adding,
	// per dtype, grown to the largest seen.
	scratch [2]map[backend.DType]backend.Tensor

	// lastStart is closed when the last reduction AllReduceSumStart
	// started is done; nil before the first. Touched only by the rank's
	// goroutine.
	lastStart chan struct{}
}

var (
	_ Group        = (*tcpGroup)(nil)
	_ AsyncReducer = (*tcpGroup)(nil)
)

func (g *tcpGroup) Rank() int       { return g.rank }
func (g *tcpGroup) Size() int       { return len(g.members) }
func (g *tcpGroup) Abort(err error) { g.w.Abort(err) }

func (g *tcpGroup) keyTo(peer int, class byte) tcpKey {
	return tcpKey{group: g.id, src: uint32(g.self), dst: uint32(g.members[peer]), class: class}
}

func (g *tcpGroup) keyFrom(peer int, class byte) tcpKey {
	return tcpKey{group: g.id, src: uint32(g.members[peer]), dst: uint32(g.self), class: class}
}

// wrap names the group, the operation and the rank on an error of the
// transport.
func (g *tcpGroup) wrap(op string, err error) error {
	return fmt.Errorf("comm: %s group %s on rank %d: %w", g.name, op, g.self, err)
}

// tcpMeta is a message's description: the operation, the sender's argument
// error, and the arguments the root checks.
type tcpMeta struct {
	Op     string        `json:"op"`
	Err    string        `json:"err,omitempty"`
	DT     backend.DType `json:"dt,omitempty"`
	N      int           `json:"n,omitempty"`
	Counts []int         `json:"counts,omitempty"`
	Recv   []int         `json:"recv,omitempty"`
}

// A message's payload: the meta's length (4 bytes), the meta as JSON, the
// data.
func encodeMsg(m tcpMeta, data []byte) []byte {
	js, _ := json.Marshal(m) // plain fields: cannot fail
	p := make([]byte, 4, 4+len(js)+len(data))
	binary.BigEndian.PutUint32(p, uint32(len(js)))
	return append(append(p, js...), data...)
}

func decodeMsg(p []byte) (tcpMeta, []byte, error) {
	var m tcpMeta
	if len(p) < 4 {
		return m, nil, errors.New("malformed message: too short")
	}
	n := int(binary.BigEndian.Uint32(p))
	if n > len(p)-4 {
		return m, nil, errors.New("malformed message: bad meta length")
	}
	if err := json.Unmarshal(p[4:4+n], &m); err != nil {
		return m, nil, fmt.Errorf("malformed message: %w", err)
	}
	return m, p[4+n:], nil
}

// meet is the root's round trip: every rank brings its meta and data to the
// group's rank 0, which checks that all called op without an argument
// error, runs combine over everything (indexed by group rank) and answers
// each rank with its reply, or every rank with combine's error. It returns
// this rank's reply.
func (g *tcpGroup) meet(m tcpMeta, data []byte, combine func(metas []tcpMeta, datas [][]byte) ([][]byte, error)) ([]byte, error) {
	op := m.Op
	if g.rank != 0 {
		if err := g.w.send(g.keyTo(0, classColl), encodeMsg(m, data)); err != nil {
			return nil, g.wrap(op, err)
		}
		p, err := g.w.recv(g.keyFrom(0, classColl))
		if err != nil {
			return nil, g.wrap(op, err)
		}
		reply, out, err := decodeMsg(p)
		if err != nil {
			return nil, g.wrap(op, err)
		}
		if reply.Err != "" {
			return nil, errors.New(reply.Err)
		}
		return out, nil
	}
	size := len(g.members)
	metas, datas := make([]tcpMeta, size), make([][]byte, size)
	metas[0], datas[0] = m, data
	for j := 1; j < size; j++ {
		p, err := g.w.recv(g.keyFrom(j, classColl))
		if err != nil {
			return nil, g.wrap(op, err)
		}
		if metas[j], datas[j], err = decodeMsg(p); err != nil {
			return nil, g.wrap(op, err)
		}
	}
	replies, err := g.verdict(metas, datas, combine)
	for j := 1; j < size; j++ {
		rm := tcpMeta{Op: op}
		var rd []byte
		if err != nil {
			rm.Err = err.Error()
		} else {
			rd = replies[j]
		}
		if serr := g.w.send(g.keyTo(j, classColl), encodeMsg(rm, rd)); serr != nil && err == nil {
			err = g.wrap(op, serr)
		}
	}
	if err != nil {
		return nil, err
	}
	return replies[0], nil
}

func (g *tcpGroup) verdict(metas []tcpMeta, datas [][]byte, combine func([]tcpMeta, [][]byte) ([][]byte, error)) ([][]byte, error) {
	op := metas[0].Op
	for j, m := range metas {
		if m.Op != op {
			return nil, fmt.Errorf("comm: %s group: rank %d called %s while rank 0 called %s; every rank must call the same collectives in the same order",
				g.name, j, m.Op, op)
		}
	}
	for j, m := range metas {
		if m.Err != "" {
			return nil, fmt.Errorf("comm: %s group %s, rank %d: %s", g.name, op, j, m.Err)
		}
	}
	if combine == nil {
		return make([][]byte, len(metas)), nil
	}
	return combine(metas, datas)
}

// same replies every rank with p.
func same(size int, p []byte) [][]byte {
	out := make([][]byte, size)
	for i := range out {
		out[i] = p
	}
	return out
}

func (g *tcpGroup) Barrier() error {
	_, err := g.meet(tcpMeta{Op: "Barrier"}, nil, nil)
	return err
}

func (g *tcpGroup) AllReduceFloat64(vals []float64) error {
	const op = "AllReduceFloat64"
	out, err := g.meet(tcpMeta{Op: op, N: len(vals)}, float64Bytes(vals), func(metas []tcpMeta, datas [][]byte) ([][]byte, error) {
		for j, m := range metas {
			if m.N != metas[0].N || len(datas[j]) != 8*m.N {
				return nil, fmt.Errorf("comm: %s group %s: rank %d has %d values, rank 0 has %d", g.name, op, j, m.N, metas[0].N)
			}
		}
		sum := bytesFloat64(datas[0])
		for _, d := range datas[1:] {
			for i, v := range bytesFloat64(d) {
				sum[i] += v
			}
		}
		return same(len(metas), float64Bytes(sum)), nil
	})
	if err != nil {
		return err
	}
	copy(vals, bytesFloat64(out))
	return nil
}

func (g *tcpGroup) AllToAllInts(send []int) ([]int, error) {
	const op = "AllToAllInts"
	size := len(g.members)
	m := tcpMeta{Op: op, Counts: send}
	if len(send) != size {
		m.Err = fmt.Sprintf("send has %d entries for a group of %d", len(send), size)
	}
	out, err := g.meet(m, nil, func(metas []tcpMeta, _ [][]byte) ([][]byte, error) {
		replies := make([][]byte, size)
		for j := range replies {
			col := make([]int, size)
			for i, mi := range metas {
				col[i] = mi.Counts[j]
			}
			replies[j], _ = json.Marshal(col)
		}
		return replies, nil
	})
	if err != nil {
		return nil, err
	}
	var recv []int
	if err := json.Unmarshal(out, &recv); err != nil {
		return nil, g.wrap(op, err)
	}
	return recv, nil
}

// checkFloat checks a tensor that a reduction sums.
func (g *tcpGroup) checkFloat(name string, t backend.Tensor) string {
	switch {
	case t == nil:
		return name + " is nil"
	case t.DType() != g.b.FloatType():
		return fmt.Sprintf("cannot sum a %v tensor (%s) on the %s backend, which computes in %v", t.DType(), name, g.b.Name(), g.b.FloatType())
	}
	return ""
}

// scratchView is the first n elements of scratch tensor i of dt.
func (g *tcpGroup) scratchView(i int, dt backend.DType, n int) backend.Tensor {
	s := g.scratch[i][dt]
	if s == nil || s.Len() < n {
		if g.scratch[i] == nil {
			g.scratch[i] = map[backend.DType]backend.Tensor{}
		}
		s = g.b.New(dt, n)
		g.scratch[i][dt] = s
	}
	return g.b.View(s, 0, n)
}

// sumAtRoot is the root's reduction: own (rank 0's tensor, on the
// backend) plus every other rank's data, in rank order, into a scratch
// tensor of n elements, which it returns.
func (g *tcpGroup) sumAtRoot(own backend.Tensor, datas [][]byte, dt backend.DType, n int) (backend.Tensor, error) {
	acc := g.scratchView(0, dt, n)
	g.b.Copy(acc, own)
	if len(datas) > 1 {
		tmp := g.scratchView(1, dt, n)
		for _, d := range datas[1:] {
			if err := uploadBytes(g.b, tmp, d); err != nil {
				return nil, err
			}
			g.b.Axpy(acc, 1, tmp)
		}
	}
	return acc, nil
}

func (g *tcpGroup) AllReduceSum(t backend.Tensor) error {
	const op = "AllReduceSum"
	m := tcpMeta{Op: op}
	switch {
	case t == nil:
		m.Err = "the tensor is nil"
	case t.DType() != g.b.FloatType():
		m.Err = fmt.Sprintf("cannot sum a %v tensor on the %s backend, which computes in %v", t.DType(), g.b.Name(), g.b.FloatType())
	default:
		m.DT, m.N = t.DType(), t.Len()
	}
	var data []byte
	if m.Err == "" && g.rank != 0 && m.N > 0 {
		data = tensorBytes(g.b, t)
	}
	out, err := g.meet(m, data, func(metas []tcpMeta, datas [][]byte) ([][]byte, error) {
		for j, a := range metas {
			if a.DT != m.DT || a.N != m.N {
				return nil, fmt.Errorf("comm: %s group %s: rank %d has %d elements of %v, rank 0 has %d of %v",
					g.name, op, j, a.N, a.DT, m.N, m.DT)
			}
		}
		if m.N == 0 || len(metas) == 1 {
			return make([][]byte, len(metas)), nil
		}
		acc, err := g.sumAtRoot(t, datas, m.DT, m.N)
		if err != nil {
			return nil, fmt.Errorf("comm: %s group %s: %w", g.name, op, err)
		}
		g.b.Copy(t, acc)
		return same(len(metas), tensorBytes(g.b, acc)), nil
	})
	if err != nil || g.rank == 0 || m.N == 0 {
		return err
	}
	return g.upload(op, t, out)
}

// AllReduceSumStart runs AllReduceSum(t) on a goroutine of its own, after
// the reductions started before it: the group's background queue, which
// keeps the group in use by one goroutine at a time as long as the rank
// calls no other collective of it before the last Wait (comm.AsyncReducer).
// The reduction never waits without a bound (see Failures), so neither does
// Wait.
func (g *tcpGroup) AllReduceSumStart(t backend.Tensor) (Pending, error) {
	if err := g.w.Err(); err != nil {
		return nil, g.wrap("AllReduceSum", err)
	}
	prev := g.lastStart
	p := &tcpPending{done: make(chan struct{})}
	g.lastStart = p.done
	go func() {
		defer close(p.done)
		if prev != nil {
			<-prev
		}
		p.err = g.AllReduceSum(t)
	}()
	return p, nil
}

// tcpPending is a reduction on a group's background queue.
type tcpPending struct {
	done chan struct{}
	err  error // set before done is closed
}

func (p *tcpPending) Wait() error {
	<-p.done
	return p.err
}

// upload fills t with a reply's data.
func (g *tcpGroup) upload(op string, t backend.Tensor, p []byte) error {
	if err := uploadBytes(g.b, t, p); err != nil {
		return g.wrap(op, err)
	}
	return nil
}

func (g *tcpGroup) ReduceScatterSum(recv, send backend.Tensor) error {
	const op = "ReduceScatterSum"
	size := len(g.members)
	m := tcpMeta{Op: op, Err: g.checkFloat("recv", recv)}
	if m.Err == "" {
		m.Err = g.checkFloat("send", send)
	}
	if m.Err == "" {
		if send.DType() != recv.DType() || send.Len() != recv.Len()*size {
			m.Err = fmt.Sprintf("send has %d elements of %v but must hold %d (the group size %d times recv's %d) of %v",
				send.Len(), send.DType(), recv.Len()*size, size, recv.Len(), recv.DType())
		} else {
			m.DT, m.N = send.DType(), recv.Len()
		}
	}
	var data []byte
	if m.Err == "" && g.rank != 0 && m.N > 0 {
		data = tensorBytes(g.b, send)
	}
	out, err := g.meet(m, data, func(metas []tcpMeta, datas [][]byte) ([][]byte, error) {
		if err := g.checkBlocks(op, metas); err != nil {
			return nil, err
		}
		n := m.N
		if n == 0 {
			return make([][]byte, size), nil
		}
		acc, err := g.sumAtRoot(send, datas, m.DT, size*n)
		if err != nil {
			return nil, fmt.Errorf("comm: %s group %s: %w", g.name, op, err)
		}
		replies := make([][]byte, size)
		for j := 1; j < size; j++ {
			replies[j] = tensorBytes(g.b, g.b.View(acc, j*n, n))
		}
		g.b.Copy(recv, g.b.View(acc, 0, n))
		return replies, nil
	})
	if err != nil || g.rank == 0 || m.N == 0 {
		return err
	}
	return g.upload(op, recv, out)
}

// checkBlocks checks that every rank has the same block length and dtype.
func (g *tcpGroup) checkBlocks(op string, metas []tcpMeta) error {
	for j, a := range metas {
		if a.DT != metas[0].DT || a.N != metas[0].N {
			return fmt.Errorf("comm: %s group %s: rank %d has blocks of %d elements of %v, rank 0 of %d of %v",
				g.name, op, j, a.N, a.DT, metas[0].N, metas[0].DT)
		}
	}
	return nil
}

func (g *tcpGroup) AllGather(recv, send backend.Tensor) error {
	const op = "AllGather"
	size := len(g.members)
	m := tcpMeta{Op: op}
	switch {
	case recv == nil || send == nil:
		m.Err = "recv or send is nil"
	case recv.DType() != send.DType() || recv.Len() != send.Len()*size:
		m.Err = fmt.Sprintf("recv has %d elements of %v but must hold %d (the group size %d times send's %d) of %v",
			recv.Len(), recv.DType(), send.Len()*size, size, send.Len(), send.DType())
	default:
		m.DT, m.N = send.DType(), send.Len()
	}
	var data []byte
	if m.Err == "" && m.N > 0 {
		data = tensorBytes(g.b, send)
	}
	out, err := g.meet(m, data, func(metas []tcpMeta, datas [][]byte) ([][]byte, error) {
		if err := g.checkBlocks(op, metas); err != nil {
			return nil, err
		}
		var all []byte
		for _, d := range datas {
			all = append(all, d...)
		}
		return same(size, all), nil
	})
	if err != nil || m.N == 0 {
		return err
	}
	return g.upload(op, recv, out)
}

func (g *tcpGroup) AllToAllRows(recv, send backend.Tensor, recvCounts, sendCounts []int) error {
	const op = "AllToAllRows"
	size := len(g.members)
	m := tcpMeta{Op: op, Counts: sendCounts, Recv: recvCounts}
	cols, argErr := CheckRows(recv, send, recvCounts, sendCounts, size)
	if argErr != nil {
		m.Err = argErr.Error()
	} else {
		m.DT, m.N = send.DType(), cols
	}
	// The root checks the plan (what i sends to j is what j expects from
	// i), so that a bad plan fails on every rank alike; then every rank
	// sends its blocks to their destinations and takes its own.
	if _, err := g.meet(m, nil, func(metas []tcpMeta, _ [][]byte) ([][]byte, error) {
		for i, a := range metas {
			if a.N != metas[0].N || a.DT != metas[0].DT {
				return nil, fmt.Errorf("comm: %s group %s: rank %d has rows of %d %v, rank 0 of %d %v",
					g.name, op, i, a.N, a.DT, metas[0].N, metas[0].DT)
			}
			for j, b := range metas {
				if sent, want := a.Counts[j], b.Recv[i]; sent != want {
					return nil, fmt.Errorf("comm: %s group %s: rank %d sends %d rows to rank %d, which expects %d",
						g.name, op, i, sent, j, want)
				}
			}
		}
		return make([][]byte, size), nil
	}); err != nil {
		return err
	}
	offsets := func(counts []int) []int {
		off := make([]int, size+1)
		for j, c := range counts {
			off[j+1] = off[j] + c
		}
		return off
	}
	from, at := offsets(sendCounts), offsets(recvCounts)
	if from[size] > 0 {
		host := tensorBytes(g.b, send)
		es := len(host) / (from[size] * cols)
		for j := range size {
			if j == g.rank || sendCounts[j] == 0 {
				continue
			}
			if err := g.w.send(g.keyTo(j, classRows), host[from[j]*cols*es:from[j+1]*cols*es]); err != nil {
				return g.wrap(op, err)
			}
		}
	}
	if rows := sendCounts[g.rank]; rows > 0 {
		g.b.Copy(g.b.View(recv, at[g.rank]*cols, rows, cols), g.b.View(send, from[g.rank]*cols, rows, cols))
	}
	for i := range size {
		rows := recvCounts[i]
		if i == g.rank || rows == 0 {
			continue
		}
		p, err := g.w.recv(g.keyFrom(i, classRows))
		if err != nil {
			return g.wrap(op, err)
		}
		if err := g.upload(op, g.b.View(recv, at[i]*cols, rows, cols), p); err != nil {
			return err
		}
	}
	return nil
}

// checkPeer checks the peer rank of a Send or Recv.
func (g *tcpGroup) checkPeer(op string, peer int) error {
	if peer < 0 || peer >= len(g.members) || peer == g.rank {
		return fmt.Errorf("comm: %s group %s on rank %d: peer rank %d is not another rank of this group of %d",
			g.name, op, g.rank, peer, len(g.members))
	}
	return nil
}

// Send hands t to dst, whose Recv answers with its verdict; Send returns
// it, so both calls fail alike on a mismatch.
func (g *tcpGroup) Send(t backend.Tensor, dst int) error {
	const op = "Send"
	if err := g.checkPeer(op, dst); err != nil {
		return err
	}
	m := tcpMeta{Op: op}
	var data []byte
	if t == nil {
		m.Err = "nil"
	} else {
		m.DT, m.N = t.DType(), t.Len()
		if m.N > 0 {
			data = tensorBytes(g.b, t)
		}
	}
	if err := g.w.send(g.keyTo(dst, classP2P), encodeMsg(m, data)); err != nil {
		return g.wrap(op, err)
	}
	p, err := g.w.recv(g.keyFrom(dst, classAck))
	if err != nil {
		return g.wrap(op, err)
	}
	ack, _, err := decodeMsg(p)
	if err != nil {
		return g.wrap(op, err)
	}
	if ack.Err != "" {
		return errors.New(ack.Err)
	}
	return nil
}

// Recv takes the next message from src, checks that it fits t, fills t and
// answers the sender with its verdict.
func (g *tcpGroup) Recv(t backend.Tensor, src int) error {
	const op = "Recv"
	if err := g.checkPeer(op, src); err != nil {
		return err
	}
	p, err := g.w.recv(g.keyFrom(src, classP2P))
	if err != nil {
		return g.wrap(op, err)
	}
	m, data, err := decodeMsg(p)
	if err == nil {
		prefix := fmt.Sprintf("comm: %s group Send from rank %d to rank %d", g.name, src, g.rank)
		switch {
		case m.Err != "":
			err = fmt.Errorf("%s: the sent tensor is nil", prefix)
		case t == nil:
			err = fmt.Errorf("%s: the receive buffer is nil", prefix)
		case m.DT != t.DType() || m.N != t.Len():
			err = fmt.Errorf("%s: sent %d elements of %v, but the receive buffer holds %d of %v", prefix, m.N, m.DT, t.Len(), t.DType())
		case m.N > 0:
			err = uploadBytes(g.b, t, data)
		}
	}
	ack := tcpMeta{Op: "Ack"}
	if err != nil {
		ack.Err = err.Error()
	}
	if serr := g.w.send(g.keyTo(src, classAck), encodeMsg(ack, nil)); serr != nil && err == nil {
		err = g.wrap(op, serr)
	}
	return err
}

// ---- tensors as bytes --------------------------------------------------------

// tensorBytes downloads t as little-endian bytes of its host type (float32
// for BFloat16, which holds its values exactly).
func tensorBytes(b backend.Backend, t backend.Tensor) []byte {
	switch d := b.Download(t).Data().(type) {
	case []float32:
		out := make([]byte, 4*len(d))
		for i, v := range d {
			binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(v))
		}
		return out
	case []float64:
		return float64Bytes(d)
	case []int32:
		out := make([]byte, 4*len(d))
		for i, v := range d {
			binary.LittleEndian.PutUint32(out[4*i:], uint32(v))
		}
		return out
	default:
		panic(fmt.Sprintf("comm: tcp: cannot move a %v tensor", t.DType()))
	}
}

// uploadBytes fills t with p, bytes as tensorBytes writes them.
func uploadBytes(b backend.Backend, t backend.Tensor, p []byte) error {
	n := t.Len()
	var host any
	switch t.DType() {
	case backend.Float32, backend.BFloat16:
		if len(p) != 4*n {
			break
		}
		h := make([]float32, n)
		for i := range h {
			h[i] = math.Float32frombits(binary.LittleEndian.Uint32(p[4*i:]))
		}
		host = h
	case backend.Float64:
		if len(p) != 8*n {
			break
		}
		host = bytesFloat64(p)
	case backend.Int32:
		if len(p) != 4*n {
			break
		}
		h := make([]int32, n)
		for i := range h {
			h[i] = int32(binary.LittleEndian.Uint32(p[4*i:]))
		}
		host = h
	}
	if host == nil {
		return fmt.Errorf("received %d bytes for a tensor of %d elements of %v", len(p), n, t.DType())
	}
	b.Upload(t, tensor.New(tensor.WithShape(n), tensor.WithBacking(host)))
	return nil
}

func float64Bytes(v []float64) []byte {
	out := make([]byte, 8*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint64(out[8*i:], math.Float64bits(x))
	}
	return out
}

func bytesFloat64(p []byte) []float64 {
	out := make([]float64, len(p)/8)
	for i := range out {
		out[i] = math.Float64frombits(binary.LittleEndian.Uint64(p[8*i:]))
	}
	return out
}
