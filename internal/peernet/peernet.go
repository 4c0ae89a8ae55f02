// Package peernet holds what the two kinds of node-to-node TCP connection
// share: the TCP transport of comm (the collectives' data) and the
// rendezvous of launch (how nodes meet and watch each other). It dials
// with backoff (DialRetry), says why a connection ended (DescribeDrop) and
// words durations and rank lists for the errors that name them (Duration,
// RankList).
package peernet

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// DialRetry dials addr until it answers or ctx ends, backing off from 20ms
// to 1s between attempts. The error is the last attempt's.
func DialRetry(ctx context.Context, addr string) (net.Conn, error) {
	var d net.Dialer
	wait := 20 * time.Millisecond
	for {
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			return conn, nil
		}
		if !pause(ctx.Done(), wait) {
			return nil, err
		}
		wait = min(2*wait, time.Second)
	}
}

// pause waits for wait, or until done closes first (then false).
func pause(done <-chan struct{}, wait time.Duration) bool {
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-done:
		return false
	case <-t.C:
		return true
	}
}

// DescribeDrop says why a connection ended, for "node 3 (host d) left the
// run (...)"; silence is the timeout after which a quiet peer counts as
// gone, named when err is a timeout.
func DescribeDrop(err error, silence time.Duration) string {
	var ne net.Error
	switch {
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "connection closed"
	case errors.Is(err, syscall.ECONNRESET):
		return "connection reset"
	case errors.As(err, &ne) && ne.Timeout():
		return Silent(silence)
	default:
		return "connection broken: " + err.Error()
	}
}

// Silent is the reason given for a peer that sent nothing for d.
func Silent(d time.Duration) string {
	return fmt.Sprintf("silent for %s: its host or the network may be down", Duration(d))
}

// RankList is "node 2" or "nodes 2, 3" (what = "node").
func RankList(what string, ranks []int) string {
	s := make([]string, len(ranks))
	for i, r := range ranks {
		s[i] = strconv.Itoa(r)
	}
	if len(ranks) == 1 {
		return what + " " + s[0]
	}
	return what + "s " + strings.Join(s, ", ")
}

// Duration prints a duration for people: "30s", "1.5s", "10m", "200ms".
func Duration(d time.Duration) string {
	if d >= time.Second {
		d = d.Round(100 * time.Millisecond)
	}
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}
