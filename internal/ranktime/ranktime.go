// Package ranktime times variants of one piece of work spread over the
// virtual ranks of one device, the measurement behind the auto settings
// (attention.MeasureContext, tune.MeasureTPOverlap): every rank runs its
// part from its own goroutine, the variants alternate pass by pass so
// that the device's clock and temperature drift hits them alike, and a
// pass is timed on rank 0 from a barrier before any rank starts to one
// after every rank has finished and the device is idle.
package ranktime

import (
	"errors"
	"slices"
	"time"

	"github.com/mktrain/mktrain/comm"
)

// Medians runs warmup+iters passes of each of variants alternating: in
// pass p every rank r calls pass(r, p % variants) between two barriers
// of group(ranks[r]), then sync (the device's Sync), and rank 0 times it.
// It returns each variant's median over its timed passes. A rank whose
// pass fails aborts its groups, so that the others stop waiting; the
// error joins every rank's.
func Medians(ranks []*comm.Ranks, group func(*comm.Ranks) comm.Group, variants, warmup, iters int,
	sync func() error, pass func(rank, variant int) error) ([]time.Duration, error) {
	passes := (warmup + iters) * variants
	times := make([]time.Duration, passes)
	errs := make([]error, len(ranks))
	done := make(chan struct{})
	for r, rk := range ranks {
		go func() {
			defer func() { done <- struct{}{} }()
			g := group(rk)
			for p := range passes {
				if err := g.Barrier(); err != nil {
					errs[r] = err
					return
				}
				start := time.Now()
				err := pass(r, p%variants)
				if err == nil {
					err = sync()
				}
				if err == nil {
					err = g.Barrier()
				}
				if err != nil {
					errs[r] = err
					rk.Abort(err)
					return
				}
				if r == 0 {
					times[p] = time.Since(start)
				}
			}
		}()
	}
	for range ranks {
		<-done
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	medians := make([]time.Duration, variants)
	for v := range medians {
		var ts []time.Duration
		for p := warmup * variants; p < passes; p++ {
			if p%variants == v {
				ts = append(ts, times[p])
			}
		}
		slices.Sort(ts)
		medians[v] = ts[len(ts)/2]
	}
	return medians, nil
}
