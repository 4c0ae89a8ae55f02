package profile

import (
	"time"

	"github.com/mktrain/mktrain/backend"
)

// Mark is a handle to a timestamp, handed out by a Clock and read back by
// the same Clock: WallClock keeps the time in it, a device clock an index of
// its events.
type Mark uint64

// Clock takes timestamps in the order of the work a backend queues.
type Clock interface {
	// Mark takes (or queues) a timestamp after all work queued so far.
	Mark() (Mark, error)
	// Elapsed is the time from a to b; it may wait for b to be reached.
	Elapsed(a, b Mark) (time.Duration, error)
	// Release tells the clock that m will not be read again, so it may
	// reuse what m holds.
	Release(m Mark)
}

// Holder is the optional capability of a Clock on a device that runs
// queued work while the host goes on (the CUDA backend's): Hold queues a
// wait of d on the device, so that what the host queues meanwhile runs
// back to back after it. A benchmark holds, takes its start mark and then
// queues its step: the interval from that mark is the device's work, not
// the host's queueing, as long as the host queues the step within d.
type Holder interface {
	Hold(d time.Duration) error
}

// ClockSource is the optional capability of a backend that has its own
// Clock; the CUDA backend's ProfileClock times ops on the GPU's stream.
type ClockSource interface {
	ProfileClock() Clock
}

// ClockFor is b's own clock when b implements ClockSource, else WallClock,
// which suits backends whose ops are done when they return (the CPU).
func ClockFor(b backend.Backend) Clock {
	if s, ok := b.(ClockSource); ok {
		return s.ProfileClock()
	}
	return WallClock()
}

// WallClock is a Clock that reads the host's monotonic clock, for backends
// whose ops run synchronously.
func WallClock() Clock { return wallClock{origin: time.Now()} }

// wallClock's marks are nanoseconds since origin (monotonic: time.Since
// uses the monotonic reading).
type wallClock struct{ origin time.Time }

func (c wallClock) Mark() (Mark, error) { return Mark(time.Since(c.origin)), nil }

func (wallClock) Elapsed(a, b Mark) (time.Duration, error) {
	return time.Duration(int64(b) - int64(a)), nil
}

func (wallClock) Release(Mark) {}
