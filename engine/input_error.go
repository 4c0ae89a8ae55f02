package engine

import (
	"errors"

	"github.com/mktrain/mktrain/backend/registry"
)

// InputError is an error in what a run was given, found before it
// trained: its recipe (a *FieldError too), its data, its run directory or
// checkpoint, a backend the machine lacks, or a model and batch that the
// memory plan finds too large for the device (a *plan.Refusal inside).
// Every other error of Run is the run failing while it ran (a step, a
// NaN loss, a device, a lost peer). mktrain exits 2 for the first kind
// and 1 for the second.
type InputError struct{ Err error }

func (e *InputError) Error() string { return e.Err.Error() }
func (e *InputError) Unwrap() error { return e.Err }

// IsInputError reports whether err is bad input: an InputError or a
// *FieldError (a recipe value that fails validation) in its chain.
func IsInputError(err error) bool {
	var in *InputError
	var field *FieldError
	return errors.As(err, &in) || errors.As(err, &field)
}

// inputError marks err (if not nil, and not ErrStopped) as an InputError.
func inputError(err error) error {
	if err == nil || IsInputError(err) || errors.Is(err, ErrStopped) {
		return err
	}
	return &InputError{Err: err}
}

// backendInputError marks pickBackend's errors that are about the recipe
// and this machine (no such backend linked, no device of its kind, a
// model beyond its kernels' limits) as InputErrors; a device that is
// there and fails stays a failure.
func backendInputError(err error) error {
	var notLinked *registry.NotLinkedError
	var noDevice *registry.NoDeviceError
	var limits *limitError
	if errors.As(err, &notLinked) || errors.As(err, &noDevice) || errors.As(err, &limits) {
		return &InputError{Err: err}
	}
	return err
}

// limitError is unsupported's error: the model exceeds a driver's kernel
// limits (registry.Limits).
type limitError struct{ msg string }

func (e *limitError) Error() string { return e.msg }
