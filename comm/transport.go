package comm

// The transport under the multi-process groups: a Link per pair of nodes
// carries whole frames, in order, both ways. The protocol (world.go, the
// node's liveness, inboxes and failures; remote_group.go, the collectives)
// sees only Links and a clock, so it runs the same over TCP (tcp_transport.go)
// and, in the tests, over an in-memory transport with a logical clock.

import (
	"time"
)

// Frame kinds. A frame of kind frameData carries a message of the protocol
// under its key; the other kinds carry the transport's and the node's own
// signals.
const (
	frameHello     byte = iota + 1 // a new connection's first frame (tcp_transport.go)
	frameData                      // a message for an inbox (key, payload)
	frameHeartbeat                 // "still here"
	frameAbort                     // the run failed; the payload is why
	frameBye                       // the sender finished; not a failure
)

// Message classes: a key's last field, so that a pair's collective
// traffic, point-to-point messages and acknowledgements never mix.
const (
	classColl byte = iota
	classRows
	classP2P
	classAck
)

// msgKey tags a message: its group, source and destination world ranks,
// and class.
type msgKey struct {
	group    uint32
	src, dst uint32
	class    byte
}

// Frame is one unit a Link carries.
type Frame struct {
	Kind    byte
	Key     msgKey // frameData only
	Payload []byte
}

// Link is a node's connection to one other node: whole frames, in the
// order sent, both ways. Send may be called from several goroutines at
// once (frames do not interleave); Recv from one.
type Link interface {
	// Send writes f. It fails when the link is broken, or when the frame
	// makes no progress for timeout (the peer does not read).
	Send(f Frame, timeout time.Duration) error
	// Recv returns the next frame. progress is called whenever any of a
	// frame arrives (over TCP, every read), so that a long frame counts as
	// a live peer. It fails once the link ends: io.EOF when the peer
	// closed its side after its last frame.
	Recv(progress func()) (Frame, error)
	// CloseWrite tells the peer that no more frames come; its Recv returns
	// io.EOF once it has read them.
	CloseWrite() error
	// Close ends the link at once; a pending Send or Recv fails.
	Close() error
}

// clock is the time the protocol reads: the heartbeats, the silence of a
// peer, the bound on a wait. Production uses the real one (realClock);
// the protocol's tests use a logical one they advance by hand.
type clock interface {
	Now() time.Time
	NewTimer(d time.Duration) timer
}

// timer is a one-shot timer of a clock.
type timer interface {
	C() <-chan time.Time
	Stop() bool
}

// realClock is the wall clock.
type realClock struct{}

func (realClock) Now() time.Time                 { return time.Now() }
func (realClock) NewTimer(d time.Duration) timer { return realTimer{time.NewTimer(d)} }

type realTimer struct{ t *time.Timer }

func (t realTimer) C() <-chan time.Time { return t.t.C }
func (t realTimer) Stop() bool          { return t.t.Stop() }
