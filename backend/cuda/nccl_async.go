package cuda

// NCCLGroup's all-reduce in the background (comm.AsyncReducer): the
// data-parallel gradient buckets are summed on a communication stream while
// the device's own stream (the compute stream) runs the rest of the
// backward.
//
// AllReduceSumStart, on the device thread like every NCCL call of the
// group, records an event on the compute stream and makes the group's
// communication stream wait for it, so that the all-reduce reads what the
// ops queued before the start wrote; queues the all-reduce on the
// communication stream; and records a second event there. Wait makes the
// compute stream wait for that second event: the ops queued after Wait
// (the gradient norm, AdamW) run after the all-reduce, and the host never
// blocks. Meanwhile the caller must leave the tensor alone (comm's rule),
// which the engine does: a bucket's gradients are final when it starts.
//
// The communication stream, made on the first start, is the group's own, and
// every group is its own communicator (NCCLRanks): the only NCCL work on
// this communicator between a start and its Wait is the reductions started
// in between, all in one stream, so one communicator never runs on two
// streams at once (comm.AsyncReducer forbids the group's other collectives
// until the last Wait). Other groups' collectives on the compute stream (the
// MoE all-to-all of the backward) run beside it, on other communicators;
// every rank queues both in the same order, as NCCL requires of concurrent
// communicators.
//
// Events are reused: cuStreamWaitEvent waits for the record the event had
// when it was called, so an event goes back to the free list as soon as
// its wait is queued.
//
// With NCCLOptions.CheckArgs the ranks agree on the arguments first, which
// uses the communicator on the compute stream and waits; a start is then a
// plain AllReduceSum, done when it returns.
//
// Failures: a dead peer shows as it does for any tensor collective, at the
// next wait for the compute stream, which now includes the all-reduce (the
// watchdog of the waiting group or its timeout aborts the communicators,
// which also stops the all-reduce). Wait after an Abort returns the abort's
// error.

import (
	"errors"
	"fmt"
	"runtime"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/comm"
)

var _ comm.AsyncReducer = (*NCCLGroup)(nil)

// ncclAsync is a group's communication stream and its events. Touched only
// on the device thread.
type ncclAsync struct {
	stream driver.Stream
	ready  driver.Event   // recorded on the compute stream at each start
	free   []driver.Event // done events whose waits are queued
	all    []driver.Event // every event made, for Close
}

// asyncState returns the group's communication stream and events, made on
// first use. It runs on the device thread.
func (g *NCCLGroup) asyncState() (*ncclAsync, error) {
	if g.async != nil {
		return g.async, nil
	}
	drv := g.dev.drv
	s, err := drv.StreamCreate(driver.StreamNonBlocking)
	if err != nil {
		return nil, err
	}
	ready, err := drv.EventCreate(eventDisableTiming)
	if err != nil {
		return nil, errors.Join(err, drv.StreamDestroy(s))
	}
	g.async = &ncclAsync{stream: s, ready: ready, all: []driver.Event{ready}}
	return g.async, nil
}

// event takes a done event from the free list, or makes one.
func (a *ncclAsync) event(drv *driver.Driver) (driver.Event, error) {
	if n := len(a.free); n > 0 {
		e := a.free[n-1]
		a.free = a.free[:n-1]
		return e, nil
	}
	e, err := drv.EventCreate(eventDisableTiming)
	if err != nil {
		return 0, err
	}
	a.all = append(a.all, e)
	return e, nil
}

// closeAsync destroys the communication stream and its events (the driver
// releases them once the work queued on them is done). It runs on the
// device thread, from Close.
func (g *NCCLGroup) closeAsync() error {
	a := g.async
	if a == nil {
		return nil
	}
	g.async = nil
	drv := g.dev.drv
	var errs []error
	for _, e := range a.all {
		errs = append(errs, drv.EventDestroy(e))
	}
	errs = append(errs, drv.StreamDestroy(a.stream))
	return errors.Join(errs...)
}

// sumArgErr is AllReduceSum's check of its tensor.
func (g *NCCLGroup) sumArgErr(t backend.Tensor) error {
	switch {
	case t == nil:
		return errors.New("the tensor is nil")
	case t.DType() != g.b.FloatType():
		return fmt.Errorf("cannot sum a %v tensor on the %s backend, which computes in %v", t.DType(), g.b.Name(), g.b.FloatType())
	}
	_, err := devTensor("the tensor", t)
	return err
}

// AllReduceSumStart queues the sum of t over the group, in place, on the
// group's communication stream, after the ops queued on the compute stream
// so far, and returns; see the file comment.
func (g *NCCLGroup) AllReduceSumStart(t backend.Tensor) (comm.Pending, error) {
	if g.checkArgs {
		if err := g.AllReduceSum(t); err != nil {
			return nil, err
		}
		return comm.Done(nil), nil
	}
	const op = "AllReduceSum"
	p := &ncclPending{g: g, t: t}
	err := g.call(op, g.sumArgErr(t), nil, false, 0, nil, func(c ncclComm) error {
		a, _ := devTensor("the tensor", t)
		as, err := g.asyncState()
		if err != nil {
			return err
		}
		done, err := as.event(g.dev.drv)
		if err != nil {
			return err
		}
		if err := g.queueAllReduce(c, as, a, done); err != nil {
			as.free = append(as.free, done)
			return err
		}
		p.done = done
		return nil
	})
	if err != nil {
		return nil, err
	}
	return p, nil
}

// queueAllReduce queues, on the device thread: the communication stream's
// wait for the compute stream, the all-reduce of a and the record of done.
func (g *NCCLGroup) queueAllReduce(c ncclComm, as *ncclAsync, a devArg, done driver.Event) error {
	drv := g.dev.drv
	if err := drv.EventRecord(as.ready, g.dev.stream); err != nil {
		return err
	}
	if err := drv.StreamWaitEvent(as.stream, as.ready); err != nil {
		return err
	}
	if a.n > 0 {
		if err := g.lib.allReduce(a.p, a.p, a.n, a.dt, ncclSum, c, as.stream); err != nil {
			return err
		}
	}
	return drv.EventRecord(done, as.stream)
}

// ncclPending is an all-reduce queued on a group's communication stream.
// Touched only by the rank's goroutine.
type ncclPending struct {
	g      *NCCLGroup
	t      backend.Tensor // kept alive (and its memory with it) until Wait
	done   driver.Event
	waited bool
	err    error
}

// Wait makes the compute stream wait for the all-reduce. It queues that
// wait even after an Abort (the tensor's memory must not be reused before
// the stopped all-reduce lets go of it), then returns the abort's error.
func (p *ncclPending) Wait() error {
	if p.waited {
		return p.err
	}
	p.waited = true
	g := p.g
	err := g.dev.Do(func() error {
		if g.async == nil {
			return fmt.Errorf("comm: %s group, rank %d: a reduction waited for after Close", g.name, g.rank)
		}
		err := g.dev.drv.StreamWaitEvent(g.dev.stream, p.done)
		g.async.free = append(g.async.free, p.done)
		return err
	})
	runtime.KeepAlive(p.t)
	p.t = nil
	if err == nil && g.state.aborted.Load() {
		err = g.state.abortErr()
	}
	p.err = err
	return err
}
