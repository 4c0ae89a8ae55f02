package comm

// Reductions that run while the caller goes on: the data-parallel gradient
// all-reduce overlapped with the backward. A group that can overlap
// implements AsyncReducer (an optional capability, found by a type
// assertion as database/sql/driver finds its optional interfaces);
// StartAllReduce falls back to a plain AllReduceSum for the others.
//
// Which groups overlap:
//
//   - TCP groups (remote_group.go): the reductions run on a background goroutine of
//     the group, one after another in start order, while the rank's own
//     goroutine computes.
//   - cuda.NCCLGroup: the all-reduce is queued on a communication stream of
//     its own, behind an event recorded on the compute stream; Wait makes
//     the compute stream wait for it, without blocking the host.
//   - In-process groups (NewLocal) do not: their ranks share one backend
//     (one CPU, or one GPU stream), so there is nothing to overlap with, and
//     StartAllReduce reduces at once.

import "github.com/mktrain/mktrain/backend"

// AsyncReducer is a Group whose AllReduceSum can run in the background.
//
// AllReduceSumStart starts summing t over the group, in place, and returns
// at once; the sum is in t once the Pending's Wait has returned nil (for a
// device backend: for the ops queued after Wait). Between the start and
// the Wait the caller neither reads nor writes t. The rules of the group's
// collectives hold: every rank starts the same reductions in the same
// order, with the same lengths. In addition:
//
//   - the rank waits for its reductions in the order it started them;
//   - until it has waited for the last one it started, the rank calls no
//     other collective of the group (it may start more reductions): the
//     reductions in flight still use the group.
//
// A start may fail at once (a bad tensor, an aborted group); Wait returns
// the reduction's own error, and after an Abort of the group it returns an
// error rather than waiting for the peers.
type AsyncReducer interface {
	AllReduceSumStart(t backend.Tensor) (Pending, error)
}

// Pending is a reduction in flight. Wait blocks (or, on a device backend,
// orders the work queued after it) until the reduction is done and returns
// its error; a second Wait returns the same.
type Pending interface {
	Wait() error
}

// StartAllReduce starts summing t over g: in the background when g is an
// AsyncReducer, else with g.AllReduceSum, done when StartAllReduce returns
// (its Pending's Wait then returns nil). The rules are AsyncReducer's.
func StartAllReduce(g Group, t backend.Tensor) (Pending, error) {
	if a, ok := g.(AsyncReducer); ok {
		return a.AllReduceSumStart(t)
	}
	if err := g.AllReduceSum(t); err != nil {
		return nil, err
	}
	return Done(nil), nil
}

// Done is a Pending that has finished with err.
func Done(err error) Pending { return done{err} }

type done struct{ err error }

func (d done) Wait() error { return d.err }

// WaitAll waits for ps in order and returns the first error; it waits for
// every one, so that no reduction is left running after it returns.
func WaitAll(ps []Pending) error {
	var first error
	for _, p := range ps {
		if err := p.Wait(); err != nil && first == nil {
			first = err
		}
	}
	return first
}
