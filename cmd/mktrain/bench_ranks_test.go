package main

import (
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/profile"
	"github.com/mktrain/mktrain/comm"
)

// holdingClock is a profile.Holder whose time is what the holds and the
// ranks' work add; it logs holds and marks in order.
type holdingClock struct {
	mu    sync.Mutex
	now   time.Duration
	marks map[profile.Mark]time.Duration
	log   []string
}

func (c *holdingClock) Hold(d time.Duration) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now += d
	c.log = append(c.log, "hold "+d.String())
	return nil
}

func (c *holdingClock) Mark() (profile.Mark, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := profile.Mark(len(c.marks) + 1)
	c.marks[m] = c.now
	c.log = append(c.log, "mark")
	return m, nil
}

func (c *holdingClock) Elapsed(a, b profile.Mark) (time.Duration, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.marks[b] - c.marks[a], nil
}

func (c *holdingClock) Release(profile.Mark) {}

func (c *holdingClock) add(d time.Duration) {
	c.mu.Lock()
	c.now += d
	c.mu.Unlock()
}

// oneRankStep on ranks that share the clock's device: rank 0 holds it
// once, before the start mark, and the step's time is the ranks' work
// alone; on ranks with devices of their own there is no hold; a rank
// whose work fails is named and the others do not wait for it.
func TestOneRankStepHolds(t *testing.T) {
	b := cpu.New(backend.Float32)
	steps := func(c *holdingClock, own bool, fail int) []rankStep {
		world, err := comm.NewLocal(contextMesh(3), b)
		if err != nil {
			t.Fatal(err)
		}
		s := make([]rankStep, 3)
		for r := range s {
			s[r] = rankStep{group: world[r].Context, ranks: world[r], work: func() error {
				if r == fail {
					return errors.New("no memory")
				}
				c.add(7)
				return nil
			}}
			if own {
				s[r].device = b
			}
		}
		return s
	}

	c := &holdingClock{marks: map[profile.Mark]time.Duration{}}
	d, _, err := oneRankStep(b, c, steps(c, false, -1), stepHold)
	if err != nil || d != 21 {
		t.Errorf("step %v (%v), want 21ns: the three ranks' work without the hold", d, err)
	}
	if got := strings.Join(c.log, ", "); got != "hold "+stepHold.String()+", mark, mark" {
		t.Errorf("log %q, want the hold before the start mark", got)
	}

	c = &holdingClock{marks: map[profile.Mark]time.Duration{}}
	if _, _, err := oneRankStep(b, c, steps(c, true, -1), stepHold); err != nil || strings.Contains(strings.Join(c.log, " "), "hold") {
		t.Errorf("ranks with their own devices: log %q (%v), want no hold", c.log, err)
	}

	c = &holdingClock{marks: map[profile.Mark]time.Duration{}}
	done := make(chan error, 1)
	go func() {
		_, _, err := oneRankStep(b, c, steps(c, false, 1), stepHold)
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "rank 1: no memory") {
			t.Errorf("error %v, want rank 1's", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("oneRankStep hung after a rank's work failed")
	}
}
