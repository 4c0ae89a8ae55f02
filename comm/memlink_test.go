package comm

// The protocol's test bench: in-memory links (MemNet) and a logical clock
// (FakeClock), so that the protocol of world.go and remote_group.go runs
// without sockets, and time passes only when a test advances it.

import (
	"errors"
	"io"
	"net"
	"sort"
	"sync"
	"time"

	"github.com/mktrain/mktrain/backend"
)

// MemConfig holds the timings of a world on in-memory links.
type MemConfig struct {
	Heartbeat, HeartbeatTimeout, OpTimeout time.Duration
}

// MemWorlds starts the nodes of a world in this process, over in-memory
// links, all on one logical clock (which starts at a fixed time and moves
// only by Advance).
func MemWorlds(m Mesh, nodes int, b backend.Backend, c MemConfig) ([]*TCPWorld, *FakeClock, *MemNet, error) {
	addrs := make([]string, nodes)
	for i := range addrs {
		addrs[i] = "mem"
	}
	cfgs := make([]TCPConfig, nodes)
	for i := range cfgs {
		cfgs[i] = TCPConfig{
			Mesh: m, Backend: b, NodeRank: i, Addrs: addrs, Listener: noListener{}, Secret: []byte("in-memory links"),
			Heartbeat: c.Heartbeat, HeartbeatTimeout: c.HeartbeatTimeout, OpTimeout: c.OpTimeout,
		}
		if err := cfgs[i].check(); err != nil {
			return nil, nil, nil, err
		}
	}
	clk := NewFakeClock()
	mn, links := newMemNet(nodes)
	worlds := make([]*TCPWorld, nodes)
	for i := range worlds {
		worlds[i] = newWorld(cfgs[i], links[i], clk)
	}
	return worlds, clk, mn, nil
}

// noListener stands in for the listener a TCP world's config must hold.
type noListener struct{ net.Listener }

// ---- links -------------------------------------------------------------------

// MemNet connects every pair of nodes with a pair of queues. It counts the
// frames sent and not yet handled, so that a test can wait until every
// node has taken in what it was sent (Quiesce).
type MemNet struct {
	mu       sync.Mutex
	cond     *sync.Cond
	inflight int          // frames sent and not yet handled by their reader
	cut      map[int]bool // nodes cut off the network: their frames vanish both ways
}

// memQueue is the frames for one end of a link.
type memQueue struct {
	frames  []Frame
	eof     bool // the sender closed its side
	closed  bool // this end was closed
	holding bool // the reader has a frame it has not finished handling
}

// memLink is one end of a link between two nodes.
type memLink struct {
	net      *MemNet
	from, to int
	in, out  *memQueue // in: frames for this end; out: the peer's in
}

// newMemNet is a network of n nodes; links[i][j] is node i's link to node
// j (nil for i == j).
func newMemNet(n int) (*MemNet, [][]Link) {
	mn := &MemNet{cut: map[int]bool{}}
	mn.cond = sync.NewCond(&mn.mu)
	links := make([][]Link, n)
	for i := range links {
		links[i] = make([]Link, n)
	}
	for i := range n {
		for j := i + 1; j < n; j++ {
			a, b := &memQueue{}, &memQueue{}
			links[i][j] = &memLink{net: mn, from: i, to: j, in: a, out: b}
			links[j][i] = &memLink{net: mn, from: j, to: i, in: b, out: a}
		}
	}
	return mn, links
}

// Cut takes node off the network, as a pulled cable or a hung host: the
// frames it sends and those sent to it vanish, and no link reports an end.
func (mn *MemNet) Cut(node int) {
	mn.mu.Lock()
	defer mn.mu.Unlock()
	mn.cut[node] = true
}

// Quiesce waits until every frame sent has been handled by its reader (the
// reader asked for the next one, or its link ended). It reports false if
// that takes longer than a real second (a frame nobody reads).
func (mn *MemNet) Quiesce() bool {
	expired := false
	stop := time.AfterFunc(time.Second, func() {
		mn.mu.Lock()
		expired = true
		mn.cond.Broadcast()
		mn.mu.Unlock()
	})
	defer stop.Stop()
	mn.mu.Lock()
	defer mn.mu.Unlock()
	for mn.inflight > 0 && !expired {
		mn.cond.Wait()
	}
	return mn.inflight == 0
}

func (l *memLink) Send(f Frame, _ time.Duration) error {
	mn := l.net
	mn.mu.Lock()
	defer mn.mu.Unlock()
	switch {
	case l.in.closed:
		return net.ErrClosed
	case l.out.eof:
		return errors.New("send after CloseWrite")
	case mn.cut[l.from] || mn.cut[l.to]:
		return nil // vanishes on the way
	case l.out.closed:
		return errors.New("connection reset by peer")
	}
	f.Payload = append([]byte(nil), f.Payload...) // the wire copies
	l.out.frames = append(l.out.frames, f)
	mn.inflight++
	mn.cond.Broadcast()
	return nil
}

func (l *memLink) Recv(progress func()) (Frame, error) {
	mn := l.net
	mn.mu.Lock()
	defer mn.mu.Unlock()
	q := l.in
	if q.holding { // the reader is done with the last frame
		q.holding = false
		mn.inflight--
		mn.cond.Broadcast()
	}
	for {
		switch {
		case q.closed:
			return Frame{}, net.ErrClosed
		case len(q.frames) > 0:
			f := q.frames[0]
			q.frames = q.frames[1:]
			q.holding = true
			progress()
			return f, nil
		case q.eof:
			return Frame{}, io.EOF
		}
		mn.cond.Wait()
	}
}

func (l *memLink) CloseWrite() error {
	mn := l.net
	mn.mu.Lock()
	defer mn.mu.Unlock()
	if !mn.cut[l.from] && !mn.cut[l.to] {
		l.out.eof = true
		mn.cond.Broadcast()
	}
	return nil
}

// Close ends this end: its reader fails, the frames it did not read are
// dropped, and the peer reads to the end of what was sent, then io.EOF (a
// process's sockets close when it dies), unless the network is cut.
func (l *memLink) Close() error {
	mn := l.net
	mn.mu.Lock()
	defer mn.mu.Unlock()
	q := l.in
	if q.closed {
		return nil
	}
	q.closed = true
	mn.inflight -= len(q.frames)
	if q.holding {
		q.holding = false
		mn.inflight--
	}
	q.frames = nil
	if !mn.cut[l.from] && !mn.cut[l.to] {
		l.out.eof = true
	}
	mn.cond.Broadcast()
	return nil
}

// ---- clock ---------------------------------------------------------------------

// FakeClock is a logical clock: time moves only by Advance, which fires
// the timers that fall due, in order.
type FakeClock struct {
	mu     sync.Mutex
	cond   *sync.Cond
	now    time.Time
	timers map[*fakeTimer]bool // pending timers
}

type fakeTimer struct {
	clk *FakeClock
	at  time.Time
	c   chan time.Time
}

// NewFakeClock is a clock at a fixed time.
func NewFakeClock() *FakeClock {
	c := &FakeClock{now: time.Unix(1_000_000, 0), timers: map[*fakeTimer]bool{}}
	c.cond = sync.NewCond(&c.mu)
	return c
}

func (c *FakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *FakeClock) NewTimer(d time.Duration) timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{clk: c, at: c.now.Add(d), c: make(chan time.Time, 1)}
	if d <= 0 {
		t.c <- c.now
		return t
	}
	c.timers[t] = true
	c.cond.Broadcast()
	return t
}

func (t *fakeTimer) C() <-chan time.Time { return t.c }

func (t *fakeTimer) Stop() bool {
	c := t.clk
	c.mu.Lock()
	defer c.mu.Unlock()
	pending := c.timers[t]
	delete(c.timers, t)
	c.cond.Broadcast()
	return pending
}

// Advance moves the clock by d and fires every timer due by then.
func (c *FakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	var due []*fakeTimer
	for t := range c.timers {
		if !t.at.After(c.now) {
			due = append(due, t)
		}
	}
	sort.Slice(due, func(i, j int) bool { return due[i].at.Before(due[j].at) })
	for _, t := range due {
		delete(c.timers, t)
		t.c <- t.at
	}
	c.cond.Broadcast()
}

// Pending is the number of timers not yet fired nor stopped.
func (c *FakeClock) Pending() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.timers)
}

// BlockUntil waits until exactly n timers are pending: every goroutine
// that waits on the clock has got to its wait. It reports false if that
// takes longer than a real second.
func (c *FakeClock) BlockUntil(n int) bool {
	expired := false
	stop := time.AfterFunc(time.Second, func() {
		c.mu.Lock()
		expired = true
		c.cond.Broadcast()
		c.mu.Unlock()
	})
	defer stop.Stop()
	c.mu.Lock()
	defer c.mu.Unlock()
	for len(c.timers) != n && !expired {
		c.cond.Wait()
	}
	return len(c.timers) == n
}
