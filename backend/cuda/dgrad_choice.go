package cuda

import (
	"errors"
	"math/bits"
	"slices"

	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// The fused backward's first kernel comes in two builds with the same
// arguments and the same results bit for bit: moe_dispatch_dgrad, whose
// producer warps 1-3 gather the output-gradient rows beside the products,
// and moe_dispatch_dgrad_first, where every warp but the TMA thread's
// gathers them first. Neither wins everywhere (kernels/grouped_gemm.md:
// gathering first is 10-12% faster at the fine-grained shape and up to
// 10% slower at moe-small's), so each shape is settled by measurement on
// the machine at hand: its first calls alternate the two builds with
// timing events around each launch, and once both have dgradTrialRuns
// timings the faster one (the least of its times) runs that shape from
// then on. No call waits for a timing: the events are read at later calls,
// and a shape whose timings are not all in yet runs the beside build.

// dgradTrialRuns is how many timed launches of each build settle a shape.
const dgradTrialRuns = 3

// Which build of the dispatch+dgrad kernel a call runs.
const (
	dgradBeside = iota // moe_dispatch_dgrad
	dgradFirst         // moe_dispatch_dgrad_first
)

// dgradShape is a call's shape as far as the choice goes: the gathered
// rows by power of two (they change with the routing from step to step),
// the product's width n (F), depth k (D) and the experts.
type dgradShape struct {
	rowsLog2, n, k, experts int
}

func newDgradShape(rows, n, k, experts int) dgradShape {
	return dgradShape{rowsLog2: bits.Len(uint(rows)), n: n, k: k, experts: experts}
}

// dgradTrials is one shape's measurement.
type dgradTrials struct {
	launched int          // timed launches so far
	ms       [2][]float32 // each build's timings, in milliseconds
	choice   int          // the build chosen, or -1 while measuring
}

func newDgradTrials() *dgradTrials { return &dgradTrials{choice: -1} }

// next is the build the shape's next call runs and whether that launch is
// timed: the choice once made; else the builds in turn until each has
// dgradTrialRuns timed launches, then the beside build until the timings
// are in.
func (t *dgradTrials) next() (build int, timed bool) {
	if t.choice >= 0 {
		return t.choice, false
	}
	if t.launched < 2*dgradTrialRuns {
		build = t.launched % 2
		t.launched++
		return build, true
	}
	return dgradBeside, false
}

// add records a timed launch of build; the last one makes the choice (a
// tie keeps the beside build).
func (t *dgradTrials) add(build int, ms float32) {
	t.ms[build] = append(t.ms[build], ms)
	if t.choice < 0 && len(t.ms[dgradBeside]) == dgradTrialRuns && len(t.ms[dgradFirst]) == dgradTrialRuns {
		t.choice = dgradBeside
		if slices.Min(t.ms[dgradFirst]) < slices.Min(t.ms[dgradBeside]) {
			t.choice = dgradFirst
		}
	}
}

// dgradTimedLaunch is a timed launch whose events are not read yet.
type dgradTimedLaunch struct {
	shape      dgradShape
	build      int
	start, end driver.Event
}

// dgradChooser is a GroupedGemm's choice between the two builds. Only the
// device thread touches it (inside Submit), so it needs no lock.
type dgradChooser struct {
	// force runs one build for every call (tests and figures): -1 chooses
	// by measurement, else dgradBeside or dgradFirst.
	force   int
	shapes  map[dgradShape]*dgradTrials
	pending []dgradTimedLaunch
}

func newDgradChooser() *dgradChooser {
	return &dgradChooser{force: -1, shapes: map[dgradShape]*dgradTrials{}}
}

// launch runs one call of shape on the device thread: launchBuild queues
// the chosen build on stream; a timed launch is bracketed by two events.
// Timings of earlier launches that have finished are read first.
func (c *dgradChooser) launch(drv *driver.Driver, stream driver.Stream, shape dgradShape, launchBuild func(build int) error) error {
	if err := c.collect(drv); err != nil {
		return err
	}
	if c.force >= 0 {
		return launchBuild(c.force)
	}
	t := c.shapes[shape]
	if t == nil {
		t = newDgradTrials()
		c.shapes[shape] = t
	}
	build, timed := t.next()
	if !timed {
		return launchBuild(build)
	}
	start, err := drv.EventCreate(0)
	if err != nil {
		return err
	}
	end, err := drv.EventCreate(0)
	if err != nil {
		return errors.Join(err, drv.EventDestroy(start))
	}
	err = drv.EventRecord(start, stream)
	if err == nil {
		err = launchBuild(build)
	}
	if err == nil {
		err = drv.EventRecord(end, stream)
	}
	if err != nil {
		return errors.Join(err, drv.EventDestroy(start), drv.EventDestroy(end))
	}
	c.pending = append(c.pending, dgradTimedLaunch{shape: shape, build: build, start: start, end: end})
	return nil
}

// close frees the events of launches whose timings were never read (the
// stream is idle by then: Backend.Close syncs first).
func (c *dgradChooser) close(drv *driver.Driver) error {
	var errs []error
	for _, p := range c.pending {
		errs = append(errs, drv.EventDestroy(p.start), drv.EventDestroy(p.end))
	}
	c.pending = nil
	return errors.Join(errs...)
}

// collect reads the timings of the launches that have finished and frees
// their events; the others stay pending.
func (c *dgradChooser) collect(drv *driver.Driver) error {
	kept := c.pending[:0]
	var errs []error
	for _, p := range c.pending {
		ms, err := drv.EventElapsed(p.start, p.end)
		var de *driver.Error
		if errors.As(err, &de) && de.Code == driver.ErrorNotReady {
			kept = append(kept, p)
			continue
		}
		if err == nil {
			c.shapes[p.shape].add(p.build, ms)
		}
		errs = append(errs, err, drv.EventDestroy(p.start), drv.EventDestroy(p.end))
	}
	clear(c.pending[len(kept):])
	c.pending = kept
	return errors.Join(errs...)
}
