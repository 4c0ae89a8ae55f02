package peernet

// The handshake every node-to-node connection opens with: a mutual HMAC
// challenge-response over the run's shared secret, before either side
// reads anything else from the other. A stranger who can reach a port
// learns nothing (the acceptor proves itself only after the dialer has),
// and a recorded handshake cannot be replayed (each side's MAC covers a
// fresh random nonce from the other).
//
// Wire: each side sends authMagic and a 32-byte nonce; the dialer then
// sends HMAC-SHA256(secret, label(purpose, "dialer", nonces)); the
// acceptor checks it and only then answers with its own MAC under the
// "acceptor" label. Every read has a fixed size, so nothing is allocated
// from what a stranger sends.

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"io"
	"net"
	"syscall"
	"time"
)

// authMagic opens the handshake: the protocol and its version.
const authMagic = "MKTAUTH1"

const nonceSize = 32

// ErrSecretRefused is the dialer's error when the acceptor closed the
// connection after reading the dialer's proof: the two were given
// different secrets.
var ErrSecretRefused = errors.New("the other node refused this node's secret")

// errBadProof is the acceptor's error for a wrong MAC or magic.
var errBadProof = errors.New("the connection did not prove it knows the run's secret")

// Authenticate runs the handshake on c as the dialer (dialer true) or the
// acceptor, within timeout. purpose separates the kinds of connection
// ("rendezvous", "data"), so that a proof for one is no proof for the
// other. On the acceptor's side any error means "drop the connection
// without a word".
func Authenticate(c net.Conn, secret []byte, purpose string, dialer bool, timeout time.Duration) error {
	if len(secret) == 0 {
		return errors.New("no secret for the connection's handshake")
	}
	c.SetDeadline(time.Now().Add(timeout))
	defer c.SetDeadline(time.Time{})
	var mine [len(authMagic) + nonceSize]byte
	copy(mine[:], authMagic)
	rand.Read(mine[len(authMagic):])
	if _, err := c.Write(mine[:]); err != nil {
		return err
	}
	var theirs [len(authMagic) + nonceSize]byte
	if _, err := io.ReadFull(c, theirs[:]); err != nil {
		return err
	}
	if string(theirs[:len(authMagic)]) != authMagic {
		return errBadProof
	}
	dialerNonce, acceptorNonce := mine[len(authMagic):], theirs[len(authMagic):]
	if !dialer {
		dialerNonce, acceptorNonce = acceptorNonce, dialerNonce
	}
	dialerMAC := proof(secret, purpose, "dialer", dialerNonce, acceptorNonce)
	acceptorMAC := proof(secret, purpose, "acceptor", dialerNonce, acceptorNonce)
	var got [sha256.Size]byte
	if dialer {
		if _, err := c.Write(dialerMAC); err != nil {
			return err
		}
		if _, err := io.ReadFull(c, got[:]); err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) {
				return ErrSecretRefused
			}
			return err
		}
		if !hmac.Equal(got[:], acceptorMAC) {
			return errors.New("the other node does not know the run's secret")
		}
		return nil
	}
	if _, err := io.ReadFull(c, got[:]); err != nil {
		return err
	}
	if !hmac.Equal(got[:], dialerMAC) {
		return errBadProof
	}
	_, err := c.Write(acceptorMAC)
	return err
}

// proof is one side's MAC over the two nonces.
func proof(secret []byte, purpose, role string, dialerNonce, acceptorNonce []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(authMagic + "\x00" + purpose + "\x00" + role + "\x00"))
	m.Write(dialerNonce)
	m.Write(acceptorNonce)
	return m.Sum(nil)
}

// Gate bounds the handshakes in progress on one listener, so that idle or
// hostile connections cannot pile up: a connection beyond the bound is
// closed at once (a real node retries).
type Gate chan struct{}

// NewGate allows n handshakes at a time.
func NewGate(n int) Gate { return make(Gate, n) }

// Enter takes a place; false when every place is taken.
func (g Gate) Enter() bool {
	select {
	case g <- struct{}{}:
		return true
	default:
		return false
	}
}

// Leave gives a place back.
func (g Gate) Leave() { <-g }

// MaxHandshakes is how many handshakes a listener runs at once.
const MaxHandshakes = 32

// AcceptBackoff waits before the next Accept after a failed one (say,
// EMFILE when idle connections hold every file): from 5ms, doubling to 1s.
// It returns the next wait, or false when done closes first.
func AcceptBackoff(done <-chan struct{}, wait time.Duration) (time.Duration, bool) {
	if wait == 0 {
		wait = 5 * time.Millisecond
	}
	if !pause(done, wait) {
		return 0, false
	}
	return min(2*wait, time.Second), true
}

// DialAuth dials addr and runs the handshake as the dialer, retrying
// (with DialRetry's backoff) while the peer does not answer or drops the
// connection before judging this node's proof (busy, or not listening
// yet), until ctx ends. A refused secret is returned at once
// (ErrSecretRefused).
func DialAuth(ctx context.Context, addr string, secret []byte, purpose string, timeout time.Duration) (net.Conn, error) {
	wait := 20 * time.Millisecond
	for {
		c, err := DialRetry(ctx, addr)
		if err != nil {
			return nil, err
		}
		err = Authenticate(c, secret, purpose, true, timeout)
		if err == nil {
			return c, nil
		}
		c.Close()
		if errors.Is(err, ErrSecretRefused) || !pause(ctx.Done(), wait) {
			return nil, err
		}
		wait = min(2*wait, time.Second)
	}
}
