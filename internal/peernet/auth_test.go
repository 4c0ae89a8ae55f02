package peernet

import (
	"bytes"
	"errors"
	"net"
	"sync"
	"testing"
	"time"
)

// recorder keeps what is written through a connection.
type recorder struct {
	net.Conn
	mu      sync.Mutex
	written bytes.Buffer
}

func (r *recorder) Write(b []byte) (int, error) {
	r.mu.Lock()
	r.written.Write(b)
	r.mu.Unlock()
	return r.Conn.Write(b)
}

// pair runs the handshake over a loopback TCP connection and returns both
// sides' errors.
func pair(t *testing.T, dialSecret, acceptSecret []byte, dialPurpose, acceptPurpose string, wrap func(net.Conn) net.Conn) (dialErr, acceptErr error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- err
			return
		}
		err = Authenticate(c, acceptSecret, acceptPurpose, false, 2*time.Second)
		c.Close() // as the listeners do on a failed handshake
		done <- err
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	dc := c
	if wrap != nil {
		dc = wrap(c)
	}
	dialErr = Authenticate(dc, dialSecret, dialPurpose, true, 2*time.Second)
	return dialErr, <-done
}

func TestAuthenticate(t *testing.T) {
	secret := []byte("0123456789abcdef")
	if d, a := pair(t, secret, secret, "data", "data", nil); d != nil || a != nil {
		t.Fatalf("the same secret: dialer %v, acceptor %v", d, a)
	}
	// A wrong secret: the acceptor judges first and closes; the dialer
	// learns only that it was refused.
	d, a := pair(t, []byte("another secret!!"), secret, "data", "data", nil)
	if !errors.Is(d, ErrSecretRefused) || !errors.Is(a, errBadProof) {
		t.Errorf("a wrong secret: dialer %v, acceptor %v", d, a)
	}
	// A proof for one purpose is none for the other.
	d, a = pair(t, secret, secret, "rendezvous", "data", nil)
	if !errors.Is(d, ErrSecretRefused) || !errors.Is(a, errBadProof) {
		t.Errorf("another purpose: dialer %v, acceptor %v", d, a)
	}
	if err := Authenticate(nil, nil, "data", true, time.Second); err == nil {
		t.Error("an empty secret was accepted")
	}
}

// A recorded handshake replayed on a new connection fails: the acceptor's
// fresh nonce makes the old proof worthless.
func TestAuthenticateReplay(t *testing.T) {
	secret := []byte("0123456789abcdef")
	var rec *recorder
	if d, a := pair(t, secret, secret, "data", "data", func(c net.Conn) net.Conn { rec = &recorder{Conn: c}; return rec }); d != nil || a != nil {
		t.Fatalf("the recorded handshake failed: %v, %v", d, a)
	}
	transcript := rec.written.Bytes()
	if len(transcript) != len(authMagic)+nonceSize+32 {
		t.Fatalf("the dialer wrote %d bytes", len(transcript))
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- err
			return
		}
		defer c.Close()
		done <- Authenticate(c, secret, "data", false, 2*time.Second)
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write(transcript)
	if err := <-done; !errors.Is(err, errBadProof) {
		t.Errorf("a replayed handshake: acceptor %v, want it refused", err)
	}
}

// Garbage, and a silent connection, fail the acceptor's handshake within
// its timeout; nothing is allocated from what they send.
func TestAuthenticateStrangers(t *testing.T) {
	secret := []byte("0123456789abcdef")
	for _, c := range []struct {
		name string
		send []byte
	}{
		{"HTTP", []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n" + string(make([]byte, 64)))},
		{"a huge length prefix", append([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, make([]byte, 64)...)},
		{"silence", nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, b := net.Pipe()
			defer a.Close()
			defer b.Close()
			go func() {
				buf := make([]byte, 64)
				for {
					if _, err := b.Read(buf); err != nil {
						return
					}
				}
			}()
			if c.send != nil {
				go b.Write(c.send)
			}
			start := time.Now()
			err := Authenticate(a, secret, "data", false, 200*time.Millisecond)
			if err == nil {
				t.Fatal("accepted")
			}
			if took := time.Since(start); took > time.Second {
				t.Errorf("took %v with a 200ms timeout", took)
			}
		})
	}
}
