package cuda

// The profiler's clock on the GPU (package backend/profile): a mark is a
// CUDA event recorded on the device's stream, so the time between two marks
// is the GPU's time between reaching them, not the host's time queueing the
// work between them. Events are kept on a free list: a profiled step takes
// two marks per op, and creating an event costs a round trip to the device
// thread, recording one only a queued call; new events are made in batches,
// so that the first profiled step spends little host time making them.

import (
	"fmt"
	"sync"
	"time"

	"github.com/mktrain/mktrain/backend/profile"
)

var _ profile.ClockSource = (*Backend)(nil)

// ProfileClock is a profile.Clock that times work on b's stream with CUDA
// events. Its events are freed when the device closes.
func (b *Backend) ProfileClock() profile.Clock { return &eventClock{dev: b.dev} }

// PeakMemory is the largest number of bytes the allocator has had reserved
// for live tensors at once since the device was opened (AllocStats.Peak;
// cached blocks not counted).
func (b *Backend) PeakMemory() int64 { return b.dev.AllocStats().Peak }

// eventClock hands out marks that index its events.
type eventClock struct {
	dev *Device

	mu     sync.Mutex
	events []*Event       // by mark
	free   []profile.Mark // released marks, reusable
}

// Mark queues an event record after the work queued so far.
func (c *eventClock) Mark() (profile.Mark, error) {
	c.mu.Lock()
	if len(c.free) == 0 {
		if err := c.growLocked(); err != nil {
			c.mu.Unlock()
			return 0, err
		}
	}
	m := c.free[len(c.free)-1]
	c.free = c.free[:len(c.free)-1]
	ev := c.events[m]
	c.mu.Unlock()
	if err := ev.Record(); err != nil {
		c.Release(m)
		return 0, err
	}
	return m, nil
}

// growLocked makes a batch of events (as many as there are, at least 64)
// in one round trip to the device thread and puts them on the free list.
func (c *eventClock) growLocked() error {
	n := max(64, len(c.events))
	made := make([]*Event, 0, n)
	err := c.dev.Do(func() error {
		for range n {
			ev, err := c.dev.drv.EventCreate(0)
			if err != nil {
				return err
			}
			made = append(made, &Event{d: c.dev, ev: ev})
		}
		return nil
	})
	// Events made before a failure are kept: they are valid.
	for _, ev := range made {
		c.free = append(c.free, profile.Mark(len(c.events)))
		c.events = append(c.events, ev)
	}
	if len(made) == 0 {
		return fmt.Errorf("cuda: profile clock: %w", err)
	}
	return nil
}

// Elapsed waits for b's event and returns the GPU time from a to b.
func (c *eventClock) Elapsed(a, b profile.Mark) (time.Duration, error) {
	ea, eb, err := c.pair(a, b)
	if err != nil {
		return 0, err
	}
	ms, err := eb.Since(ea)
	if err != nil {
		return 0, err
	}
	return time.Duration(ms * float64(time.Millisecond)), nil
}

func (c *eventClock) pair(a, b profile.Mark) (*Event, *Event, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if int(a) >= len(c.events) || int(b) >= len(c.events) {
		return nil, nil, fmt.Errorf("cuda: profile marks %d, %d were not handed out by this clock", a, b)
	}
	return c.events[a], c.events[b], nil
}

var _ profile.Holder = (*eventClock)(nil)

// Hold queues clock_hold on the device's stream: the stream waits d
// (globaltimer's nanoseconds) before what is queued after.
func (c *eventClock) Hold(d time.Duration) error {
	k, err := sourceKernel(c.dev, "clock.cu", "clock_hold")
	if err != nil {
		return err
	}
	return c.dev.Launch(k, Grid1D(1, 32), uint64(d.Nanoseconds()))
}

// Release puts m's event back on the free list; its next Record overwrites
// it.
func (c *eventClock) Release(m profile.Mark) {
	c.mu.Lock()
	if int(m) < len(c.events) {
		c.free = append(c.free, m)
	}
	c.mu.Unlock()
}
