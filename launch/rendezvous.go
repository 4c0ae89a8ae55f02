package launch

// The rendezvous: how the nodes of a multi-node run find each other, agree
// that they run the same thing, and learn when one of them dies.
//
// Node 0 listens on MasterPort (on Launch.Bind: the master address unless
// --bind says otherwise); every other node dials MasterAddr:MasterPort,
// retrying with backoff until the deadline, proves it knows the run's
// secret (trust.go; a connection that does not is closed before anything
// it sends is read, and the hub never hears of it) and sends a hello (its
// NodeInfo). When the expected number of hellos has arrived,
// node 0 checks them (same node count, mktrain version and recipe hash;
// distinct node ranks in range) and answers every node with the same
// message: a welcome holding node 0's blob (the run id and the NCCL unique
// id: comm.BlobSize) and the table of nodes, or a refusal holding the error
// every node returns.
// Node 0 gives up at the deadline with an error naming the missing ranks and
// sends it to the nodes that came.
//
// The connections then stay open as a star around node 0, for heartbeats
// and failures: each side sends a heartbeat every Heartbeat and counts a
// peer silent for HeartbeatTimeout as gone. A connection that breaks (a
// killed process closes its sockets at once) or goes silent fails the run;
// node 0 tells every other node why, so that all stop with the same error
// instead of waiting in a collective for a node that is gone. Abort sends a
// node's own error the same way; Close says goodbye, which ends the run for
// that node without failing it.
//
// The connections also carry the nodes' sums (AllReduceFloat64): each node
// sends node 0 its values for the round, and node 0, once it has every
// node's and its own, adds them in node order and sends every node the
// total. The engine's ranks vote to stop this way once a step, on the
// host, where a vote over the ranks' NCCL group would wait for the
// device's queue.
//
// Wire format: after the handshake, each message is a 4-byte big-endian
// length and a JSON object (message below), at most maxToNode0 bytes from
// a node to node 0 and maxFromNode0 from node 0 (which grows with the node
// table). The kinds are hello (node k to node 0), welcome and
// refuse (node 0 to node k), heartbeat and bye (both ways), sum (node k to
// node 0: a round's values) and sums (node 0 to node k: the round's
// total), and abort: from node k it carries the node's own error text,
// from node 0 the run's final error text, which the node returns as is.
//
// Goroutines: node 0 runs an accept loop until the rendezvous completes and
// a hub that owns every connection; each connection has a reader and a
// writer. The others run a hub and one connection. The hub is the only
// goroutine that changes the run's state; readers, Abort and Close send it
// events. Join returns with every goroutine ended when it fails, and Close
// ends them all.

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
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/internal/peernet"
)

// Rendezvous defaults. The heartbeats are the TCP transport's (package
// comm), so that a node's two kinds of connection judge silence alike.
const (
	DefaultRendezvousTimeout = 10 * time.Minute
	DefaultHeartbeat         = comm.DefaultHeartbeat
	DefaultHeartbeatTimeout  = comm.DefaultHeartbeatTimeout
)

// RendezvousConfig is one node's side of a rendezvous.
type RendezvousConfig struct {
	Launch     Launch
	RecipeHash string // the run's recipe hash; every node must have the same
	Version    string // the mktrain version; every node must have the same
	Hostname   string // this host's name in the node table and in errors; "" is os.Hostname
	// Blob is what node 0 hands to every node (the run id and, on the
	// CUDA backend, the NCCL unique id); the other nodes' Blob is ignored.
	Blob [comm.BlobSize]byte
	// DataPort is the port this node's data connections listen on (the TCP
	// communicator's, NewTCPRanks), published in the node table; 0 when
	// the node has none.
	DataPort int

	// Timeout bounds the wait: node 0 waits this long for every node, the
	// others this long for node 0 to answer their dial and then this long
	// (plus HeartbeatTimeout) for node 0's verdict. 0 is
	// DefaultRendezvousTimeout.
	Timeout time.Duration
	// Heartbeat is the interval between heartbeats; 0 is DefaultHeartbeat.
	Heartbeat time.Duration
	// HeartbeatTimeout is how long a silent peer counts as alive; at least
	// twice Heartbeat; 0 is DefaultHeartbeatTimeout.
	HeartbeatTimeout time.Duration
}

// NodeInfo is what a node tells node 0 about itself, and a row of the node
// table every node receives.
type NodeInfo struct {
	NodeRank   int    `json:"node_rank"`
	NNodes     int    `json:"nnodes"` // the node count it was launched with
	Hostname   string `json:"hostname"`
	Addr       string `json:"addr,omitempty"` // its IP as node 0 sees it (node 0: MasterAddr)
	LocalRanks int    `json:"local_ranks"`
	DataPort   int    `json:"data_port,omitempty"` // its data listener's port (RendezvousConfig.DataPort)
	RecipeHash string `json:"recipe_hash"`
	Version    string `json:"version"`
}

// String is "node 2 (host b)".
func (n NodeInfo) String() string {
	return fmt.Sprintf("node %d (host %s)", n.NodeRank, n.Hostname)
}

// Rendezvous is a node's membership in a multi-node run after a successful
// Join: the blob and node table every node received, and the channel that
// reports a failed node. Call Close when the run ends.
type Rendezvous struct {
	cfg   RendezvousConfig
	addr  string // MasterAddr:MasterPort, for messages
	self  NodeInfo
	blob  [comm.BlobSize]byte
	nodes []NodeInfo

	events    chan event    // readers and the accept loop -> hub
	aborts    chan error    // Abort -> hub
	sums      chan *sumCall // AllReduceFloat64 -> hub
	closing   chan struct{} // closed by Close
	closeOnce sync.Once
	stopped   chan struct{} // closed when the hub returns (single node: by Close)
	failed    chan struct{} // closed on the run's first failure, after err is set
	failOnce  sync.Once
	err       error
	wg        sync.WaitGroup // every goroutine but Watch's
}

// Join meets the other nodes of cfg.Launch. It returns once every node has
// arrived and node 0 has accepted them all, or with the error every node
// returns (a missing node, a mismatch, a deadline). On a single node it
// returns at once. ctx bounds the wait; cancelling it after Join returns
// does not affect the Rendezvous.
func Join(ctx context.Context, cfg RendezvousConfig) (*Rendezvous, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	l := cfg.Launch
	r := &Rendezvous{
		cfg:  cfg,
		addr: l.Addr(),
		self: NodeInfo{
			NodeRank: l.NodeRank, NNodes: l.NNodes, Hostname: cfg.Hostname, Addr: l.MasterAddr,
			LocalRanks: l.LocalRanks, DataPort: cfg.DataPort, RecipeHash: cfg.RecipeHash, Version: cfg.Version,
		},
		events:  make(chan event),
		aborts:  make(chan error),
		sums:    make(chan *sumCall),
		closing: make(chan struct{}),
		stopped: make(chan struct{}),
		failed:  make(chan struct{}),
	}
	if !l.MultiNode() {
		r.blob, r.nodes = cfg.Blob, []NodeInfo{r.self}
		return r, nil
	}
	if l.NodeRank == 0 {
		err = r.serve(ctx)
	} else {
		r.self.Addr = ""
		err = r.follow(ctx)
	}
	if err != nil {
		r.wg.Wait()
		return nil, err
	}
	return r, nil
}

func (c RendezvousConfig) withDefaults() (RendezvousConfig, error) {
	if err := c.Launch.Validate(); err != nil {
		return c, err
	}
	var errs []error
	if c.RecipeHash == "" {
		errs = append(errs, errors.New("rendezvous: RecipeHash is empty; every node gives its recipe's hash so that node 0 can compare them"))
	}
	if c.Version == "" {
		errs = append(errs, errors.New("rendezvous: Version is empty; every node gives its mktrain version so that node 0 can compare them"))
	}
	if c.Hostname == "" {
		h, err := os.Hostname()
		if err != nil || h == "" {
			h = "unknown"
		}
		c.Hostname = h
	}
	for _, d := range []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{{"Timeout", &c.Timeout, DefaultRendezvousTimeout}, {"Heartbeat", &c.Heartbeat, DefaultHeartbeat}, {"HeartbeatTimeout", &c.HeartbeatTimeout, DefaultHeartbeatTimeout}} {
		if *d.v < 0 {
			errs = append(errs, fmt.Errorf("rendezvous: %s is %v; it must be positive (or 0 for the default, %v)", d.name, *d.v, d.def))
		}
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	if c.Launch.MultiNode() && len(c.Launch.Secret) == 0 {
		errs = append(errs, errors.New("rendezvous: Launch.Secret is empty; every node must be given the run's secret (launch.FromEnv reads it)"))
	}
	if c.HeartbeatTimeout < 2*c.Heartbeat {
		errs = append(errs, fmt.Errorf("rendezvous: HeartbeatTimeout %v is less than twice Heartbeat %v; one late heartbeat would end the run", c.HeartbeatTimeout, c.Heartbeat))
	}
	return c, errors.Join(errs...)
}

// Blob is the blob node 0 handed to every node.
func (r *Rendezvous) Blob() [comm.BlobSize]byte { return r.blob }

// Nodes is the node table, indexed by node rank.
func (r *Rendezvous) Nodes() []NodeInfo { return slices.Clone(r.nodes) }

// DataAddrs is every node's data address (host:port) from a rendezvous
// node table: the host as node 0 saw it (node 0's own: the master address)
// and the port the node published (RendezvousConfig.DataPort):
// the addresses comm.TCPConfig.Addrs takes.
func DataAddrs(nodes []NodeInfo) ([]string, error) {
	out := make([]string, len(nodes))
	for i, nd := range nodes {
		if nd.DataPort <= 0 || nd.Addr == "" {
			return nil, fmt.Errorf("launch: %s published no data address (host %q, port %d); every node must run an mktrain that opens one", nd, nd.Addr, nd.DataPort)
		}
		out[i] = net.JoinHostPort(nd.Addr, fmt.Sprint(nd.DataPort))
	}
	return out, nil
}

// Watch returns a channel that receives the run's failure, the same on
// every node ("node 3 (host d) left the run ..."), and is then closed. It
// is closed without a value when ctx ends or the rendezvous ends cleanly
// (Close, or node 0 said goodbye).
func (r *Rendezvous) Watch(ctx context.Context) <-chan error {
	ch := make(chan error, 1)
	go func() {
		defer close(ch)
		select {
		case <-r.failed:
			ch <- r.err
		case <-r.stopped:
			if err := r.Err(); err != nil {
				ch <- err
			}
		case <-ctx.Done():
		}
	}()
	return ch
}

// Err is the run's failure so far, or nil.
func (r *Rendezvous) Err() error {
	select {
	case <-r.failed:
		return r.err
	default:
		return nil
	}
}

// Abort fails the run on every node: this node's Watch reports err, the
// others' "node N (host h) aborted the run: err". It does nothing once the
// rendezvous has ended.
func (r *Rendezvous) Abort(err error) {
	if err == nil {
		err = errors.New("aborted")
	}
	if !r.self.isMulti() {
		select {
		case <-r.stopped:
		default:
			r.fail(err)
		}
		return
	}
	select {
	case r.aborts <- err:
	case <-r.stopped:
	}
}

// maxSumValues is the most values AllReduceFloat64 adds at once (a
// node's frame to node 0 holds them, within maxToNode0).
const maxSumValues = 256

// sumCall is one AllReduceFloat64 waiting for its round: the hub writes
// the total into vals and reports on done.
type sumCall struct {
	vals []float64
	done chan error // buffered: the hub never waits on it
}

// AllReduceFloat64 sets vals to their sum over every node of the run,
// added in node order by node 0, so every node gets the same bits. Every
// node calls it the same number of times with as many values (at most
// maxSumValues, finite: they travel as JSON); a node whose count differs
// fails the run. It returns the run's failure if the run fails or ends
// before the total arrives. On a single node vals are their own sum.
func (r *Rendezvous) AllReduceFloat64(vals []float64) error {
	if len(vals) > maxSumValues {
		return fmt.Errorf("rendezvous: AllReduceFloat64 of %d values; it adds at most %d", len(vals), maxSumValues)
	}
	for i, v := range vals {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return fmt.Errorf("rendezvous: AllReduceFloat64: value %d is %v; the nodes' sums carry finite values only", i, v)
		}
	}
	if !r.self.isMulti() {
		return r.Err()
	}
	c := &sumCall{vals: vals, done: make(chan error, 1)}
	select {
	case r.sums <- c:
	case <-r.stopped:
		return r.ended()
	}
	select {
	case err := <-c.done:
		return err
	case <-r.stopped:
		select {
		case err := <-c.done: // answered as the hub returned
			return err
		default:
			return r.ended()
		}
	}
}

// ended is why a call cannot be answered once the hub has returned: the
// run's failure, or that it ended.
func (r *Rendezvous) ended() error {
	if err := r.Err(); err != nil {
		return err
	}
	return fmt.Errorf("rendezvous at %s: the run's connections are closed", r.addr)
}

// Close leaves the run: the other nodes are told goodbye (which does not
// fail their run), and every connection and goroutine ends. It returns nil;
// a failure is in Err.
func (r *Rendezvous) Close() error {
	r.closeOnce.Do(func() {
		close(r.closing)
		if !r.self.isMulti() {
			close(r.stopped)
		}
	})
	r.wg.Wait()
	return nil
}

func (n NodeInfo) isMulti() bool { return n.NNodes > 1 }

func (r *Rendezvous) fail(err error) {
	r.failOnce.Do(func() {
		r.err = err
		close(r.failed)
	})
}

// post hands an event to the hub; false once the hub has returned.
func (r *Rendezvous) post(ev event) bool {
	select {
	case r.events <- ev:
		return true
	case <-r.stopped:
		return false
	}
}

// event is what the hub hears: a new connection (node 0), a message, or a
// broken connection.
type event struct {
	conn net.Conn // accepted connection; p is nil
	p    *peer
	msg  message
	err  error // the connection broke; msg is empty
}

// ---- node 0 -------------------------------------------------------------

// serve is node 0's Join: listen, run the hub until it has a verdict.
func (r *Rendezvous) serve(ctx context.Context) error {
	port := r.cfg.Launch.MasterPort
	var lc net.ListenConfig
	bind := r.cfg.Launch.Bind
	ln, err := lc.Listen(ctx, "tcp", net.JoinHostPort(bind, strconv.Itoa(port)))
	if err != nil {
		return fmt.Errorf("rendezvous at %s: node 0 cannot listen on port %d: %w (is another run or program using the port? choose another with --master-port or MASTER_PORT, or another address with --bind)", r.addr, port, err)
	}
	joined := make(chan error, 1)
	r.wg.Add(2)
	go r.acceptLoop(ln)
	go r.hub0(ctx, ln, joined)
	return <-joined
}

// acceptLoop takes connections until the hub closes the listener; each
// runs the handshake in its own goroutine (a bounded number at a time,
// within HeartbeatTimeout) and reaches the hub only once it has proved it
// knows the secret; the handshakes still running when the listener closes
// are cut short. A failed Accept (say, out of file descriptors) is retried
// with backoff.
func (r *Rendezvous) acceptLoop(ln net.Listener) {
	defer r.wg.Done()
	gate := peernet.NewGate(peernet.MaxHandshakes)
	var mu sync.Mutex
	shaking := map[net.Conn]bool{}
	var wait time.Duration
	for {
		conn, err := ln.Accept()
		if errors.Is(err, net.ErrClosed) { // the hub closed the listener
			mu.Lock()
			for c := range shaking {
				c.Close()
			}
			mu.Unlock()
			return
		}
		if err != nil {
			var ok bool
			if wait, ok = peernet.AcceptBackoff(r.stopped, wait); !ok {
				return
			}
			continue
		}
		wait = 0
		if !gate.Enter() {
			conn.Close()
			continue
		}
		mu.Lock()
		shaking[conn] = true
		mu.Unlock()
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			defer gate.Leave()
			err := peernet.Authenticate(conn, r.cfg.Launch.Secret, authRendezvous, false, r.cfg.HeartbeatTimeout)
			mu.Lock()
			delete(shaking, conn)
			mu.Unlock()
			if err != nil {
				conn.Close() // a stranger: not a word, and the run never hears of it
				return
			}
			if !r.post(event{conn: conn}) {
				conn.Close()
			}
		}()
	}
}

// authRendezvous is the rendezvous's purpose in the handshake.
const authRendezvous = "rendezvous"

// server is node 0's hub state. Only the hub goroutine touches it.
type server struct {
	r         *Rendezvous
	ln        net.Listener
	joined    chan<- error
	listening bool           // until the verdict
	peers     map[*peer]bool // every open connection
	arrived   []*peer        // connections that said hello, in arrival order
	dropped   map[int]string // node rank -> how it came and left before the verdict
	// graceC runs while two connections claim one node rank: one of them
	// may be a node that came, left and came back, whose old connection's
	// end the hub has not read yet. When it fires the claim is final.
	graceC <-chan time.Time
	// The AllReduceFloat64 round in progress: its number, node 0's own
	// call once made, and the values of the nodes that sent theirs.
	round    int
	ownSum   *sumCall
	nodeSums map[int][]float64
}

// hub0 is node 0's hub: it gathers hellos until every node has come or the
// deadline passes, sends the verdict to joined, then watches the run.
func (r *Rendezvous) hub0(ctx context.Context, ln net.Listener, joined chan<- error) {
	defer r.wg.Done()
	s := &server{r: r, ln: ln, joined: joined, listening: true, peers: map[*peer]bool{}, dropped: map[int]string{}}
	defer func() { // the cases that return have queued their last messages
		s.stopListening()
		for p := range s.peers {
			p.finish(nil)
		}
		close(r.stopped)
	}()
	deadline := time.NewTimer(r.cfg.Timeout)
	defer deadline.Stop()
	deadlineC, ctxDone := deadline.C, ctx.Done()
	for {
		select {
		case ev := <-r.events:
			if s.handle(ev) {
				return
			}
			if !s.listening { // the verdict is out: stop the join-time clocks
				deadlineC, ctxDone = nil, nil
			}

		case <-s.graceC:
			s.graceC = nil
			if len(s.arrived) == r.cfg.Launch.NNodes-1 && s.verdict(true) {
				return
			}
			if !s.listening {
				deadlineC, ctxDone = nil, nil
			}

		case <-deadlineC:
			s.refuse(r.missing(s.arrived, s.dropped))
			return

		case <-ctxDone:
			s.refuse(fmt.Errorf("rendezvous at %s: node 0 stopped waiting: %w", r.addr, context.Cause(ctx)))
			return

		case err := <-r.aborts:
			// This node reports its own error as is.
			s.abort(err, fmt.Sprintf("%s aborted the run: %v", r.self, err), nil)
			return

		case c := <-r.sums:
			if s.listening || s.ownSum != nil {
				c.done <- fmt.Errorf("rendezvous at %s: AllReduceFloat64 called before Join returned, or twice at once", r.addr)
				continue
			}
			s.ownSum = c
			if s.sumDone() {
				return
			}

		case <-r.closing:
			for p := range s.peers {
				if !p.left {
					p.finish(&message{Kind: kindBye})
				}
			}
			return
		}
	}
}

// sumDone completes the round when every node's values and node 0's own
// call are in: the total, added in node order, goes to every node and to
// node 0's caller. True when the hub is done: a node sent a different
// count of values, or said goodbye in the middle of a round, which it can
// then never finish; either fails the run.
func (s *server) sumDone() (done bool) {
	r := s.r
	if s.ownSum == nil && len(s.nodeSums) == 0 {
		return false
	}
	for p := range s.peers {
		if _, sent := s.nodeSums[p.node.NodeRank]; p.left && !sent {
			err := fmt.Errorf("rendezvous at %s: %s said goodbye in round %d of the nodes' sums, before sending its values", r.addr, p.node, s.round)
			if s.ownSum != nil {
				s.ownSum.done <- err
			}
			s.abort(err, err.Error(), nil)
			return true
		}
	}
	if s.ownSum == nil || len(s.nodeSums) < r.cfg.Launch.NNodes-1 {
		return false
	}
	total := slices.Clone(s.ownSum.vals)
	for k := 1; k < r.cfg.Launch.NNodes; k++ {
		vals := s.nodeSums[k]
		if len(vals) != len(total) {
			err := fmt.Errorf("rendezvous at %s: %s added %d values in round %d, node 0 %d: every node must add as many", r.addr, r.nodes[k], len(vals), s.round, len(total))
			s.ownSum.done <- err
			s.abort(err, err.Error(), nil)
			return true
		}
		for i, v := range vals {
			total[i] += v
		}
	}
	for p := range s.peers {
		if !p.left {
			p.send(message{Kind: kindSums, Round: s.round, Vals: total})
		}
	}
	copy(s.ownSum.vals, total)
	s.ownSum.done <- nil
	s.ownSum, s.nodeSums = nil, nil
	s.round++
	return false
}

// handle acts on one event; true when the hub is done.
func (s *server) handle(ev event) (done bool) {
	p := ev.p
	switch {
	case ev.conn != nil:
		if !s.listening { // accepted just before the verdict
			ev.conn.Close()
			return false
		}
		p = newPeer(ev.conn)
		s.peers[p] = true
		s.r.startPeer(p)

	case !s.peers[p]: // a connection already finished

	case ev.err != nil:
		return s.lost(p, ev.err)

	case ev.msg.Kind == kindHello && s.listening && p.node == nil && ev.msg.Node != nil:
		info := *ev.msg.Node
		info.Addr = remoteIP(p.conn)
		p.node = &info
		s.arrived = append(s.arrived, p)
		delete(s.dropped, info.NodeRank)
		if len(s.arrived) == s.r.cfg.Launch.NNodes-1 {
			return s.verdict(false)
		}

	case ev.msg.Kind == kindAbort && !s.listening && p.node != nil:
		err := fmt.Errorf("%s aborted the run: %s", p.node, ev.msg.Error)
		s.abort(err, err.Error(), p)
		return true

	case ev.msg.Kind == kindBye && p.node != nil:
		p.left = true
		if !s.listening {
			return s.sumDone() // a round in progress cannot finish without it
		}

	case ev.msg.Kind == kindSum && !s.listening && p.node != nil && !p.left:
		rank := p.node.NodeRank
		if _, twice := s.nodeSums[rank]; twice || ev.msg.Round != s.round {
			err := fmt.Errorf("%s sent its values for round %d while node 0 is at round %d", p.node, ev.msg.Round, s.round)
			if s.ownSum != nil {
				s.ownSum.done <- err
			}
			s.abort(err, err.Error(), nil)
			return true
		}
		if s.nodeSums == nil {
			s.nodeSums = map[int][]float64{}
		}
		s.nodeSums[rank] = ev.msg.Vals
		return s.sumDone()

	case !s.listening && p.node != nil && !p.left:
		err := fmt.Errorf("%s sent an unexpected %q message", p.node, ev.msg.Kind)
		s.abort(err, err.Error(), nil)
		return true

	default: // a stray client, or a node that broke the protocol before the verdict
		s.drop(p)
	}
	return false
}

// lost handles a broken connection.
func (s *server) lost(p *peer, err error) (done bool) {
	s.drop(p)
	switch {
	case p.node == nil || p.left:
	case s.listening: // it may still come back before the deadline
		s.dropped[p.node.NodeRank] = fmt.Sprintf("%s came, then left (%s)", p.node, peernet.DescribeDrop(err, s.r.cfg.HeartbeatTimeout))
	default:
		err := fmt.Errorf("%s left the run (%s)", p.node, peernet.DescribeDrop(err, s.r.cfg.HeartbeatTimeout))
		s.abort(err, err.Error(), p)
		return true
	}
	return false
}

// verdict checks the nodes once all have come, and welcomes or refuses
// them. A node rank claimed twice is refused only when final, or once the
// grace period (two heartbeats) has passed without one claimant leaving.
func (s *server) verdict(final bool) (done bool) {
	r := s.r
	if problems := r.check(s.arrived, true); len(problems) > 0 {
		if !final && s.rankClaimedTwice() {
			if s.graceC == nil {
				s.graceC = time.After(2 * r.cfg.Heartbeat)
			}
			return false
		}
		s.refuse(fmt.Errorf("rendezvous at %s: %s", r.addr, strings.Join(problems, "; ")))
		return true
	}
	s.graceC = nil
	r.blob, r.nodes = r.cfg.Blob, r.table(s.arrived)
	s.stopListening()
	welcome := message{Kind: kindWelcome, Blob: r.blob[:], Nodes: r.nodes}
	for p := range s.peers {
		if p.node == nil { // a stray client
			s.drop(p)
			continue
		}
		p.send(welcome)
	}
	s.joined <- nil
	return false
}

// rankClaimedTwice reports whether two arrived nodes, or one and node 0,
// claim the same node rank.
func (s *server) rankClaimedTwice() bool {
	seen := map[int]bool{s.r.self.NodeRank: true}
	for _, p := range s.arrived {
		if seen[p.node.NodeRank] {
			return true
		}
		seen[p.node.NodeRank] = true
	}
	return false
}

func (s *server) stopListening() {
	if s.listening {
		s.ln.Close()
		s.listening = false
	}
}

// drop closes a connection and forgets it.
func (s *server) drop(p *peer) {
	delete(s.peers, p)
	p.finish(nil)
	s.arrived = slices.DeleteFunc(s.arrived, func(q *peer) bool { return q == p })
}

// refuse ends the rendezvous with err on every node that came.
func (s *server) refuse(err error) {
	for p := range s.peers {
		p.finish(&message{Kind: kindRefuse, Error: err.Error()})
	}
	s.r.fail(err)
	s.joined <- err
}

// abort fails the run here with local and on every other node (but except,
// and those that left) with remote.
func (s *server) abort(local error, remote string, except *peer) {
	for p := range s.peers {
		if p != except && !p.left {
			p.finish(&message{Kind: kindAbort, Error: remote})
		}
	}
	s.r.fail(local)
}

// check is node 0's verdict on the nodes that came: every problem, in
// sentences. With unclaimed, the ranks no node claimed are a problem when
// there is another (a duplicate rank leaves one free).
func (r *Rendezvous) check(arrived []*peer, unclaimed bool) []string {
	var problems []string
	self := r.self
	claims := map[int][]NodeInfo{self.NodeRank: {self}}
	byRank := make([]NodeInfo, len(arrived)) // sorted, so every run words the same problem alike
	for i, p := range arrived {
		byRank[i] = *p.node
	}
	slices.SortStableFunc(byRank, func(a, b NodeInfo) int { return a.NodeRank - b.NodeRank })
	for _, nd := range byRank {
		if nd.NNodes != self.NNodes {
			problems = append(problems, fmt.Sprintf("%s was launched for %d nodes, %s for %d: every node must be launched with the same node count", nd, nd.NNodes, self, self.NNodes))
		}
		if nd.Version != self.Version {
			problems = append(problems, fmt.Sprintf("%s runs mktrain %s, %s runs %s: every node must run the same mktrain version", nd, nd.Version, self, self.Version))
		}
		if nd.RecipeHash != self.RecipeHash {
			problems = append(problems, fmt.Sprintf("%s runs recipe hash %s, %s runs %s: every node must run the same recipe", nd, nd.RecipeHash, self, self.RecipeHash))
		}
		if nd.NodeRank < 0 || nd.NodeRank >= self.NNodes {
			problems = append(problems, fmt.Sprintf("host %s claims node rank %d, but the run has %d nodes", nd.Hostname, nd.NodeRank, self.NNodes))
			continue
		}
		claims[nd.NodeRank] = append(claims[nd.NodeRank], nd)
	}
	var free []int
	for rank := range self.NNodes {
		c := claims[rank]
		switch {
		case len(c) == 0:
			free = append(free, rank)
		case len(c) > 1:
			hosts := make([]string, len(c))
			for i, nd := range c {
				hosts[i] = nd.Hostname
				if nd.Addr != "" && nd.Addr != nd.Hostname {
					hosts[i] += " (" + nd.Addr + ")"
				}
			}
			problems = append(problems, fmt.Sprintf("node rank %d is claimed by hosts %s: every node needs its own rank", rank, strings.Join(hosts, " and ")))
		}
	}
	if unclaimed && len(free) > 0 && len(problems) > 0 {
		problems = append(problems, fmt.Sprintf("no node claimed %s", peernet.RankList("rank", free)))
	}
	return problems
}

// missing is the error at the deadline: the ranks that did not come, why a
// node that came dropped, and any problem among those that came.
func (r *Rendezvous) missing(arrived []*peer, dropped map[int]string) error {
	came := map[int]bool{0: true}
	for _, p := range arrived {
		came[p.node.NodeRank] = true
	}
	var absent []int
	for rank := range r.self.NNodes {
		if !came[rank] {
			absent = append(absent, rank)
		}
	}
	msg := fmt.Sprintf("rendezvous at %s: %s of %d did not arrive within %s", r.addr, peernet.RankList("node", absent), r.self.NNodes, peernet.Duration(r.cfg.Timeout))
	for _, rank := range absent {
		if why, ok := dropped[rank]; ok {
			msg += "; " + why
		}
	}
	if problems := r.check(arrived, false); len(problems) > 0 {
		msg += "; " + strings.Join(problems, "; ")
	}
	return errors.New(msg)
}

// table is the node table: node 0 and the nodes that came, by rank.
func (r *Rendezvous) table(arrived []*peer) []NodeInfo {
	nodes := []NodeInfo{r.self}
	for _, p := range arrived {
		nodes = append(nodes, *p.node)
	}
	slices.SortFunc(nodes, func(a, b NodeInfo) int { return a.NodeRank - b.NodeRank })
	return nodes
}

// ---- nodes 1.. ----------------------------------------------------------

// follow is the Join of every node but node 0: dial node 0, say hello,
// wait for the verdict.
func (r *Rendezvous) follow(ctx context.Context) error {
	dialCtx, cancel := context.WithTimeout(ctx, r.cfg.Timeout)
	conn, err := peernet.DialAuth(dialCtx, r.addr, r.cfg.Launch.Secret, authRendezvous, r.cfg.HeartbeatTimeout)
	cancel()
	if errors.Is(err, peernet.ErrSecretRefused) {
		return refusedSecret(fmt.Sprintf("rendezvous at %s: node 0 refused this node's secret: every node must be given the same one (%s, %s or --secret-file; this node's came from %s)", r.addr, SecretEnv, SecretFileEnv, r.cfg.Launch.SecretFrom))
	}
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("rendezvous at %s: stopped waiting for node 0: %w", r.addr, context.Cause(ctx))
		}
		return fmt.Errorf("rendezvous at %s: node 0 did not answer within %s (last attempt: %v)", r.addr, peernet.Duration(r.cfg.Timeout), err)
	}
	p := newPeer(conn)
	hello := r.self
	p.send(message{Kind: kindHello, Node: &hello})
	joined := make(chan error, 1)
	r.wg.Add(1)
	r.startPeer(p)
	go r.hubK(ctx, p, joined)
	return <-joined
}

// hubK is the hub of a node other than 0: it waits for node 0's verdict,
// sends it to joined, then watches the run.
func (r *Rendezvous) hubK(ctx context.Context, p *peer, joined chan<- error) {
	defer r.wg.Done()
	defer func() {
		p.finish(nil)
		close(r.stopped)
	}()
	node0 := NodeInfo{NodeRank: 0, Hostname: r.cfg.Launch.MasterAddr}
	// Node 0 started no later than we connected, so its verdict comes
	// within Timeout; HeartbeatTimeout is the margin for a stuck node 0.
	verdict := time.NewTimer(r.cfg.Timeout + r.cfg.HeartbeatTimeout)
	defer verdict.Stop()
	verdictC, ctxDone := verdict.C, ctx.Done()
	joining := true
	failJoin := func(err error) {
		r.fail(err)
		joined <- err
	}
	// The AllReduceFloat64 call waiting for node 0's total, and its round.
	var pending *sumCall
	round := 0
	defer func() {
		if pending != nil {
			pending.done <- r.ended()
		}
	}()
	for {
		select {
		case ev := <-r.events:
			switch {
			case ev.err != nil && joining:
				failJoin(fmt.Errorf("rendezvous at %s: the connection to node 0 ended before the rendezvous completed (%s)", r.addr, peernet.DescribeDrop(ev.err, r.cfg.HeartbeatTimeout)))
				return
			case ev.err != nil:
				if !p.left {
					r.fail(fmt.Errorf("%s left the run (%s)", node0, peernet.DescribeDrop(ev.err, r.cfg.HeartbeatTimeout)))
				}
				return
			case ev.msg.Kind == kindWelcome && joining:
				if err := r.acceptWelcome(ev.msg); err != nil {
					failJoin(err)
					return
				}
				node0 = r.nodes[0]
				joining, verdictC, ctxDone = false, nil, nil
				joined <- nil
			case ev.msg.Kind == kindRefuse && joining:
				failJoin(errors.New(ev.msg.Error))
				return
			case ev.msg.Kind == kindAbort && !joining:
				r.fail(errors.New(ev.msg.Error))
				return
			case ev.msg.Kind == kindBye:
				p.left = true
				return
			case ev.msg.Kind == kindSums && !joining && pending != nil && ev.msg.Round == round && len(ev.msg.Vals) == len(pending.vals):
				copy(pending.vals, ev.msg.Vals)
				pending.done <- nil
				pending = nil
				round++
			default:
				err := fmt.Errorf("rendezvous at %s: node 0 sent an unexpected %q message", r.addr, ev.msg.Kind)
				if joining {
					failJoin(err)
				} else {
					r.fail(err)
				}
				return
			}

		case <-verdictC:
			failJoin(fmt.Errorf("rendezvous at %s: node 0 accepted the connection but gave no verdict within %s", r.addr, peernet.Duration(r.cfg.Timeout+r.cfg.HeartbeatTimeout)))
			return

		case <-ctxDone:
			failJoin(fmt.Errorf("rendezvous at %s: stopped waiting for node 0: %w", r.addr, context.Cause(ctx)))
			return

		case err := <-r.aborts:
			p.finish(&message{Kind: kindAbort, Error: err.Error()})
			r.fail(err)
			return

		case c := <-r.sums:
			if joining || pending != nil {
				c.done <- fmt.Errorf("rendezvous at %s: AllReduceFloat64 called before Join returned, or twice at once", r.addr)
				continue
			}
			pending = c
			p.send(message{Kind: kindSum, Round: round, Vals: c.vals})

		case <-r.closing:
			p.finish(&message{Kind: kindBye})
			return
		}
	}
}

// acceptWelcome checks node 0's welcome and keeps its blob and table.
func (r *Rendezvous) acceptWelcome(m message) error {
	n := r.cfg.Launch.NNodes
	if len(m.Blob) != comm.BlobSize || len(m.Nodes) != n {
		return fmt.Errorf("rendezvous at %s: node 0's answer holds a %d-byte blob and %d nodes, want %d bytes and %d nodes", r.addr, len(m.Blob), len(m.Nodes), comm.BlobSize, n)
	}
	for i, nd := range m.Nodes {
		if nd.NodeRank != i {
			return fmt.Errorf("rendezvous at %s: node 0's node table has node %d in row %d", r.addr, nd.NodeRank, i)
		}
	}
	copy(r.blob[:], m.Blob)
	r.nodes = m.Nodes
	return nil
}

// ---- connections --------------------------------------------------------

// peer is one connection between node 0 and another node.
type peer struct {
	conn       net.Conn
	out        chan message  // messages for the writer, in order; closed by finish
	readerDone chan struct{} // closed when the reader returns

	// Owned by the hub.
	node     *NodeInfo // node 0's side: the node, once it said hello
	left     bool      // it said goodbye
	finished bool      // out is closed
}

func newPeer(conn net.Conn) *peer {
	// A peer is sent at most a hello or verdict, a round's values or
	// total (a node starts no round before the last one's total), and an
	// abort or bye.
	return &peer{conn: conn, out: make(chan message, 4), readerDone: make(chan struct{})}
}

// send queues m for the writer without blocking.
func (p *peer) send(m message) {
	if p.finished {
		return
	}
	select {
	case p.out <- m:
	default: // the writer is gone or stuck; its reader reports the connection
	}
}

// finish queues a last message (or none); the writer sends it and closes
// the connection.
func (p *peer) finish(last *message) {
	if p.finished {
		return
	}
	if last != nil {
		p.send(*last)
	}
	p.finished = true
	close(p.out)
}

func (r *Rendezvous) startPeer(p *peer) {
	r.wg.Add(2)
	go r.readLoop(p)
	go r.writeLoop(p)
}

// readLoop passes the peer's messages to the hub. Every frame, heartbeats
// included, must come within HeartbeatTimeout.
func (r *Rendezvous) readLoop(p *peer) {
	defer r.wg.Done()
	defer close(p.readerDone)
	br := bufio.NewReader(p.conn)
	limit := maxToNode0
	if r.self.NodeRank != 0 {
		limit = maxFromNode0(r.cfg.Launch.NNodes)
	}
	for {
		p.conn.SetReadDeadline(time.Now().Add(r.cfg.HeartbeatTimeout))
		m, err := readFrame(br, limit)
		if err != nil {
			r.post(event{p: p, err: err})
			return
		}
		if m.Kind == kindHeartbeat {
			continue
		}
		if !r.post(event{p: p, msg: m}) {
			return
		}
	}
}

// lingerTimeout bounds how long a closing connection waits for the peer to
// read its last message and close its side.
const lingerTimeout = 2 * time.Second

// writeLoop sends the queued messages and a heartbeat every Heartbeat.
// When the queue is closed it half-closes the connection and waits for the
// peer to close its side (or lingerTimeout), so the last message is read
// before the connection goes: closing a socket with unread input resets it.
func (r *Rendezvous) writeLoop(p *peer) {
	defer r.wg.Done()
	defer p.conn.Close()
	tick := time.NewTicker(r.cfg.Heartbeat)
	defer tick.Stop()
	for {
		var m message
		select {
		case queued, ok := <-p.out:
			if !ok {
				if tc, ok := p.conn.(*net.TCPConn); ok {
					tc.CloseWrite()
				}
				linger := time.NewTimer(min(lingerTimeout, r.cfg.HeartbeatTimeout))
				defer linger.Stop()
				select {
				case <-p.readerDone:
				case <-linger.C:
				}
				return
			}
			m = queued
		case <-tick.C:
			m = message{Kind: kindHeartbeat}
		}
		p.conn.SetWriteDeadline(time.Now().Add(r.cfg.HeartbeatTimeout))
		if err := writeFrame(p.conn, m); err != nil {
			return // the reader sees the closed connection and reports it
		}
	}
}

// Message kinds.
const (
	kindHello     = "hello"
	kindWelcome   = "welcome"
	kindRefuse    = "refuse"
	kindHeartbeat = "heartbeat"
	kindAbort     = "abort"
	kindBye       = "bye"
	kindSum       = "sum"
	kindSums      = "sums"
)

// message is one frame's JSON.
type message struct {
	Kind  string     `json:"kind"`
	Node  *NodeInfo  `json:"node,omitempty"`  // hello
	Blob  []byte     `json:"blob,omitempty"`  // welcome
	Nodes []NodeInfo `json:"nodes,omitempty"` // welcome
	Error string     `json:"error,omitempty"` // refuse, abort
	Round int        `json:"round,omitempty"` // sum, sums
	Vals  []float64  `json:"vals,omitempty"`  // sum, sums
}

// Frame limits: what the protocol needs. A node sends node 0 a hello
// (a NodeInfo: a host name, a hash, a version), heartbeats, a bye, or an
// abort whose text is cut to maxErrorText; node 0 sends a welcome (the
// blob and a NodeInfo per node) or an error text.
const (
	maxErrorText   = 16 << 10
	maxToNode0     = maxErrorText + 4<<10
	maxNodeInfoLen = 1 << 10
)

func maxFromNode0(nnodes int) int { return maxToNode0 + nnodes*maxNodeInfoLen }

func writeFrame(w io.Writer, m message) error {
	if len(m.Error) > maxErrorText {
		m.Error = m.Error[:maxErrorText-len(" (cut)")] + " (cut)"
	}
	body, err := json.Marshal(m)
	if err != nil {
		return err
	}
	buf := make([]byte, 4, 4+len(body))
	binary.BigEndian.PutUint32(buf, uint32(len(body)))
	_, err = w.Write(append(buf, body...))
	return err
}

// readFrame reads one message of at most limit bytes. The body is read as
// it comes, so a length that no bytes follow allocates nothing.
func readFrame(r io.Reader, limit int) (message, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return message{}, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if uint64(n) > uint64(limit) {
		return message{}, fmt.Errorf("frame of %d bytes exceeds the %d-byte limit (not an mktrain node?)", n, limit)
	}
	body, err := io.ReadAll(io.LimitReader(r, int64(n)))
	if err != nil {
		return message{}, err
	}
	if len(body) < int(n) {
		return message{}, io.ErrUnexpectedEOF
	}
	var m message
	if err := json.Unmarshal(body, &m); err != nil {
		return message{}, fmt.Errorf("malformed message: %w", err)
	}
	return m, nil
}

func remoteIP(c net.Conn) string {
	host, _, err := net.SplitHostPort(c.RemoteAddr().String())
	if err != nil {
		return c.RemoteAddr().String()
	}
	return host
}
