package main

// Timing work spread over virtual ranks of one device (bench attention's
// ring rows, bench tp): every rank runs its part of a step from its own
// goroutine, and a step is timed on the device's clock from before any
// rank starts to after every rank has finished.

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/profile"
	"github.com/mktrain/mktrain/comm"
)

// rankStep is one rank's part of a timed step: the group whose barriers
// bracket the step (every rank's in it), the rank's groups (aborted when
// its work fails, so that the others stop waiting) and the work.
// afterFirstTimed, when set, runs once after the first timed step has
// ended on every rank and before the next begins, outside the timed
// interval (bench tp reads the outputs that step left).
type rankStep struct {
	group           comm.Group
	ranks           *comm.Ranks
	work            func() error
	afterFirstTimed func() error
}

// medianRankStep runs 2 warm-up and iters timed steps of every rank's
// work, each rank from its goroutine, and returns the median of the
// steps' times, taken on rank 0 between a mark before any rank starts
// (all ranks wait at a barrier until it is taken) and one after every
// rank has returned (a barrier first). On a device whose ranks share one
// stream, that is the device's time from the first rank's first op to the
// last rank's last one.
func medianRankStep(b backend.Backend, clock profile.Clock, ranks []rankStep, iters int) (time.Duration, error) {
	times := make([]time.Duration, 0, iters)
	errs := make([]error, len(ranks))
	done := make(chan struct{})
	for r, rk := range ranks {
		go func() {
			defer func() { done <- struct{}{} }()
			if err := rk.steps(clock, r == 0, iters, &times); err != nil {
				errs[r] = fmt.Errorf("rank %d: %w", r, err)
				rk.ranks.Abort(errs[r])
			}
		}()
	}
	for range ranks {
		<-done
	}
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	if err := b.Sync(); err != nil {
		return 0, err
	}
	slices.Sort(times)
	return times[len(times)/2], nil
}

// steps is one rank's loop of medianRankStep; the first rank takes the
// marks and appends the timed steps' durations to times.
func (rk rankStep) steps(clock profile.Clock, first bool, iters int, times *[]time.Duration) error {
	for i := -2; i < iters; i++ {
		var start profile.Mark
		if err := rk.group.Barrier(); err != nil {
			return err
		}
		if first {
			m, err := clock.Mark()
			if err != nil {
				return err
			}
			start = m
		}
		if err := rk.group.Barrier(); err != nil {
			return err
		}
		if err := rk.work(); err != nil {
			return err
		}
		if err := rk.group.Barrier(); err != nil {
			return err
		}
		if first {
			d, err := elapsedSince(clock, start)
			if err != nil {
				return err
			}
			if i >= 0 {
				*times = append(*times, d)
			}
		}
		// Every rank has ended the step; the next one starts after the
		// barrier this rank reaches only once the hook returns.
		if i == 0 && rk.afterFirstTimed != nil {
			if err := rk.afterFirstTimed(); err != nil {
				return err
			}
		}
	}
	return nil
}

// elapsedSince takes an end mark and returns the time from start to it,
// releasing both marks.
func elapsedSince(clock profile.Clock, start profile.Mark) (time.Duration, error) {
	end, err := clock.Mark()
	if err != nil {
		clock.Release(start)
		return 0, err
	}
	d, err := clock.Elapsed(start, end)
	clock.Release(start)
	clock.Release(end)
	return d, err
}
