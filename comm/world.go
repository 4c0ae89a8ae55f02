package comm

// A node of a multi-process run (NewTCPRanks): the ranks of a run are
// spread over several processes (nodes), each hosting an equal, contiguous
// block of world ranks, and the groups' collectives (remote_group.go) move
// their data over a Link to every other node (transport.go; over TCP:
// tcp_transport.go). It serves the CPU backend across processes and is the
// model for the NCCL groups of the CUDA backend: the engine receives the
// same []*Ranks whichever implementation built them.
//
// # Messages
//
// All the groups' traffic between two nodes shares their one link. A
// message is a data frame keyed by its group, its source and destination
// world ranks and a class (collective, point-to-point, acknowledgement);
// one reader goroutine per link files every frame in the inbox of its key
// at once, so a sender never waits for its receiver to call Recv and two
// nodes cannot deadlock on full socket buffers. Ranks of the same node
// exchange their messages through the inboxes directly. Between one pair of
// ranks the messages of a key arrive in the order sent, and every rank
// calls its group's collectives in the same order, so the k-th message a
// rank takes from an inbox is the k-th the peer put there.
//
// # Failures
//
// A rank never waits without a bound:
//
//   - A link that breaks (a killed process's sockets close at once) fails
//     the whole run on this node with an error naming the node and the
//     world ranks that were lost; the node tells the others (an abort
//     frame), so every pending and future operation of every group ends
//     with that error.
//   - Each side sends a heartbeat every Heartbeat; a peer from which
//     nothing arrived for HeartbeatTimeout (a hung host, a cut network)
//     counts as lost. Each link's heartbeat loop checks at every beat, so
//     a silent peer is found between HeartbeatTimeout and HeartbeatTimeout
//     plus one Heartbeat after its last bytes.
//   - A wait for one message longer than OpTimeout (a peer that is alive
//     but never reaches the collective) fails the run too.
//   - Abort on any group fails the whole run, here and on every other node:
//     a failed rank ends a multi-process run anyway, and its peers in other
//     groups must not wait for it.
//
// A node that finishes says goodbye before it closes its links; a peer
// that is still waiting for a message from it then fails with "node N has
// left the run" rather than hanging, and one that is done is not
// disturbed. A message that arrived before a failure is still delivered: an
// inbox is drained before the failure is reported, so ranks that finished
// their last collective are not failed by a peer leaving right after it.
//
// Every wait reads the world's clock, so the protocol's tests run it over
// in-memory links with logical time.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

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
	// Secret is the run's shared secret (launch.Launch.Secret): every
	// connection proves it knows it before anything else is read.
	Secret []byte

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
	if len(c.Secret) == 0 {
		bad("no secret for the connections between the nodes (Secret is empty)")
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"DialTimeout", c.DialTimeout}, {"Heartbeat", c.Heartbeat}, {"HeartbeatTimeout", c.HeartbeatTimeout}, {"OpTimeout", c.OpTimeout}} {
		if d.v < 0 {
			bad("%s is %v; it must be positive (or 0 for the default)", d.name, d.v)
		}
	}
	if hb, silence := orDefault(c.Heartbeat, DefaultHeartbeat), orDefault(c.HeartbeatTimeout, DefaultHeartbeatTimeout); silence < 2*hb {
		bad("HeartbeatTimeout %v is less than twice Heartbeat %v; one late heartbeat would end the run", silence, hb)
	}
	return errors.Join(errs...)
}

func orDefault(d, def time.Duration) time.Duration {
	if d > 0 {
		return d
	}
	return def
}

// TCPWorld is one node's membership in a multi-process world: the ranks it
// hosts and the links to the other nodes. Close it when the run ends.
type TCPWorld struct {
	cfg       TCPConfig // Addrs gives the node count
	perNode   int       // ranks per node
	local     []*Ranks  // this node's ranks, by local index
	peers     []*peer   // by node rank; nil at this node's own
	clock     clock
	heartbeat time.Duration
	silence   time.Duration
	opTimeout time.Duration

	mu      sync.Mutex
	inboxes map[msgKey]*inbox

	failOnce sync.Once
	failed   chan struct{} // closed on the first failure, after err is set
	err      error

	closeOnce sync.Once
	closing   chan struct{}
	wg        sync.WaitGroup
}

// NewTCPRanks connects this node to the others of cfg over TCP and returns
// the world, whose Ranks are the ranks this node hosts. It returns once
// every node has connected, or with an error naming the nodes that did not
// within DialTimeout (or when ctx ends).
func NewTCPRanks(ctx context.Context, cfg TCPConfig) (*TCPWorld, error) {
	if err := cfg.check(); err != nil {
		if cfg.Listener != nil {
			cfg.Listener.Close()
		}
		return nil, err
	}
	mesh := tcpMesh{
		node: cfg.NodeRank, addrs: cfg.Addrs, ln: cfg.Listener, runID: cfg.RunID, secret: cfg.Secret,
		silence: orDefault(cfg.HeartbeatTimeout, DefaultHeartbeatTimeout),
	}
	links, err := mesh.connect(ctx, orDefault(cfg.DialTimeout, DefaultTCPDialTimeout))
	if err != nil {
		return nil, err
	}
	return newWorld(cfg, links, realClock{}), nil
}

// newWorld starts a node over its links (by node rank, nil at its own);
// cfg has been checked, and its transport fields (Listener, RunID,
// DialTimeout) are not used.
func newWorld(cfg TCPConfig, links []Link, clk clock) *TCPWorld {
	n := len(cfg.Addrs)
	w := &TCPWorld{
		cfg: cfg, perNode: cfg.Mesh.World() / n,
		peers:     make([]*peer, n),
		clock:     clk,
		heartbeat: orDefault(cfg.Heartbeat, DefaultHeartbeat),
		silence:   orDefault(cfg.HeartbeatTimeout, DefaultHeartbeatTimeout),
		opTimeout: orDefault(cfg.OpTimeout, DefaultTCPOpTimeout),
		inboxes:   map[msgKey]*inbox{},
		failed:    make(chan struct{}),
		closing:   make(chan struct{}),
	}
	for j, l := range links {
		if l != nil {
			w.peers[j] = newPeer(j, l, clk.Now())
		}
	}
	for _, p := range w.peers {
		if p != nil {
			w.wg.Add(2)
			go w.readLoop(p)
			go w.heartbeatLoop(p)
		}
	}
	w.local = w.buildRanks()
	return w
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

// lingerTimeout bounds how long Close waits for a peer to close its side.
const lingerTimeout = 2 * time.Second

// Close leaves the world: the other nodes are told goodbye, and every link
// and goroutine ends. It waits briefly for the peers to close their side,
// so that the last messages are read before the links go.
func (w *TCPWorld) Close() error {
	w.closeOnce.Do(func() {
		close(w.closing)
		var wg sync.WaitGroup
		for _, p := range w.peers {
			if p == nil {
				continue
			}
			wg.Go(func() {
				p.link.Send(Frame{Kind: frameBye}, w.silence)
				p.link.CloseWrite()
				t := w.clock.NewTimer(lingerTimeout)
				defer t.Stop()
				select {
				case <-p.readerDone:
				case <-t.C():
				}
				p.link.Close()
			})
		}
		wg.Wait()
	})
	w.wg.Wait()
	return nil
}

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
	for _, p := range w.peers {
		if p != nil && !p.isGone() {
			// Best effort; never blocks the failing rank.
			go p.link.Send(Frame{Kind: frameAbort, Payload: msg}, time.Second)
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

// ---- peers -----------------------------------------------------------------

// peer is this node's side of the link to one other node.
type peer struct {
	node       int
	link       Link
	readerDone chan struct{}
	heard      atomic.Int64 // the clock's UnixNano when bytes last came

	gmu     sync.Mutex
	gone    chan struct{} // closed when the peer said goodbye or the link ended
	goneErr error
}

func newPeer(node int, l Link, now time.Time) *peer {
	p := &peer{node: node, link: l, readerDone: make(chan struct{}), gone: make(chan struct{})}
	p.heard.Store(now.UnixNano())
	return p
}

func (p *peer) isGone() bool { return isClosed(p.gone) }

func (p *peer) markGone(err error) {
	p.gmu.Lock()
	defer p.gmu.Unlock()
	if p.goneErr == nil {
		p.goneErr = err
		close(p.gone)
	}
}

func (p *peer) whyGone() error {
	p.gmu.Lock()
	defer p.gmu.Unlock()
	return p.goneErr
}

// readLoop files the frames from one node until its link ends.
func (w *TCPWorld) readLoop(p *peer) {
	defer w.wg.Done()
	defer close(p.readerDone)
	touch := func() { p.heard.Store(w.clock.Now().UnixNano()) }
	for {
		f, err := p.link.Recv(touch)
		if err != nil {
			w.lost(p, peernet.DescribeDrop(err, w.silence))
			return
		}
		switch f.Kind {
		case frameHeartbeat:
		case frameData:
			w.inbox(f.Key).put(f.Payload)
		case frameAbort:
			w.fail(errors.New(string(f.Payload)), false)
		case frameBye:
			p.markGone(w.leftErr(p))
		default:
			w.lost(p, fmt.Sprintf("unexpected frame kind %d", f.Kind))
			return
		}
	}
}

func (w *TCPWorld) leftErr(p *peer) error {
	return fmt.Errorf("node %d (%s) has left the run", p.node, w.ranksOf(p.node))
}

// lost handles the end of a link: after a goodbye, or while this node
// closes, it is the normal end; otherwise the node is lost (why says how)
// and the run fails.
func (w *TCPWorld) lost(p *peer, why string) {
	if p.isGone() || isClosed(w.closing) {
		p.markGone(w.leftErr(p))
		return
	}
	lostErr := fmt.Errorf("lost node %d (%s): %s", p.node, w.ranksOf(p.node), why)
	p.markGone(lostErr)
	w.fail(lostErr, true)
}

// heartbeatLoop beats every Heartbeat: it first checks that something came
// from the peer within HeartbeatTimeout (else the peer is lost and the
// link closed, which ends its reader), then sends a heartbeat, which keeps
// this node from looking silent.
func (w *TCPWorld) heartbeatLoop(p *peer) {
	defer w.wg.Done()
	for {
		t := w.clock.NewTimer(w.heartbeat)
		select {
		case <-t.C():
		case <-p.readerDone:
			t.Stop()
			return
		case <-w.closing:
			t.Stop()
			return
		}
		if p.isGone() {
			return
		}
		if silent := w.clock.Now().Sub(time.Unix(0, p.heard.Load())); silent >= w.silence {
			w.lost(p, peernet.Silent(w.silence))
			p.link.Close()
			return
		}
		if err := p.link.Send(Frame{Kind: frameHeartbeat}, w.silence); err != nil {
			return // the reader reports the link
		}
	}
}

// ---- inboxes ---------------------------------------------------------------

// inbox holds the messages of one key that arrived and were not yet taken.
// One goroutine takes from an inbox at a time (the destination rank's).
type inbox struct {
	mu   sync.Mutex
	msgs [][]byte
	wake chan struct{} // holds a token when msgs may have grown
}

func (w *TCPWorld) inbox(k msgKey) *inbox {
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
// is on this node, else over the destination node's link.
func (w *TCPWorld) send(k msgKey, p []byte) error {
	if err := w.Err(); err != nil {
		return err
	}
	node := w.NodeOf(int(k.dst))
	if node == w.cfg.NodeRank {
		w.inbox(k).put(p)
		return nil
	}
	peer := w.peers[node]
	if peer.isGone() {
		return peer.whyGone()
	}
	if err := peer.link.Send(Frame{Kind: frameData, Key: k, Payload: p}, w.silence); err != nil {
		err = fmt.Errorf("lost node %d (%s): sending failed: %v", node, w.ranksOf(node), err)
		w.fail(err, true)
		return err
	}
	return nil
}

// recv takes the next message under k. Messages that arrived are delivered
// even after a failure; otherwise it waits for one until the world fails,
// the source node leaves, or OpTimeout passes.
func (w *TCPWorld) recv(k msgKey) ([]byte, error) {
	b := w.inbox(k)
	var gone chan struct{}
	var src *peer
	if node := w.NodeOf(int(k.src)); node != w.cfg.NodeRank {
		src = w.peers[node]
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
			t := w.clock.NewTimer(w.opTimeout)
			defer t.Stop()
			timeout = t.C()
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
