package main

// Which failures exit 1 rather than 2. Bad input (flags, a recipe, its
// data, the run directory, a memory plan that does not fit: anything
// found before a run starts) exits 2; a run that fails after it started
// (a step's error, a NaN loss, a device, a lost peer) exits 1.

import (
	"errors"

	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/launch"
)

// runFailure is an error of a run that failed after it started.
type runFailure struct{ err error }

func (f *runFailure) Error() string { return f.err.Error() }
func (f *runFailure) Unwrap() error { return f.err }

// failedRun classifies an error of the engine's Run or RunDistributed
// (with what leads up to it: the rendezvous): what the engine found wrong
// with its input before training (engine.IsInputError: the memory plan,
// the data, the checkpoint to resume from, the run directory's lock)
// stays bad input, and so do a secret another node refused
// (launch.ErrSecretRefused) and a stop (engine.ErrStopped); any other
// error is the run failing.
func failedRun(err error) error {
	if err == nil || engine.IsInputError(err) || errors.Is(err, engine.ErrStopped) || errors.Is(err, launch.ErrSecretRefused) {
		return err
	}
	return &runFailure{err: err}
}

// isRunFailure reports whether err is a run's failure (exit 1).
func isRunFailure(err error) bool {
	var f *runFailure
	return errors.As(err, &f)
}
