package main

// Ctrl-C and SIGTERM, the same way in every command: the first signal
// cancels the command's context, whose cause records the signal, and the
// command stops cleanly (a run saves a checkpoint after its current step;
// data prepare and export remove their partial output); a second signal
// exits at once. The exit status is 128 + the signal number: 130 for
// SIGINT, 143 for SIGTERM.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// interruptedBy is the cause of a context cancelled by a signal.
type interruptedBy struct{ sig os.Signal }

func (i interruptedBy) Error() string { return "interrupted by " + signalName(i.sig) }

// exitCode is the shell's status for a process ended by the signal.
func (i interruptedBy) exitCode() int { return signalExitCode(i.sig) }

func signalExitCode(sig os.Signal) int {
	if sig == syscall.SIGTERM {
		return exitTerminated
	}
	return exitInterrupted
}

func signalName(sig os.Signal) string {
	if sig == syscall.SIGTERM {
		return "SIGTERM"
	}
	return "SIGINT"
}

// notifySignals returns a context that the first SIGINT or SIGTERM
// cancels with an interruptedBy cause, after one line on stderr; a second
// signal prints one line and calls exit with its status. stop ends the
// watch and releases the signals.
func notifySignals(stderr io.Writer, exit func(code int)) (ctx context.Context, stop func()) {
	ctx, cancel := context.WithCancelCause(context.Background())
	signals := make(chan os.Signal, 2)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		first := true
		for {
			select {
			case <-done:
				return
			case sig := <-signals:
				if first {
					first = false
					fmt.Fprintf(stderr, "\nmktrain: %s: stopping cleanly (a run saves after its current step); press Ctrl-C again to exit now\n", signalName(sig))
					cancel(interruptedBy{sig})
					continue
				}
				fmt.Fprintf(stderr, "\nmktrain: %s again: exiting now\n", signalName(sig))
				exit(signalExitCode(sig))
				return
			}
		}
	}()
	return ctx, func() {
		signal.Stop(signals)
		close(done)
		<-finished
		cancel(nil)
	}
}

// interruption returns the signal that cancelled ctx, if one did.
func interruption(ctx context.Context) (interruptedBy, bool) {
	var cause interruptedBy
	ok := errors.As(context.Cause(ctx), &cause)
	return cause, ok
}

// stoppedError is the error of a command that stopped because ctx ended:
// "interrupted by SIGINT: what".
func stoppedError(ctx context.Context, what string) error {
	if cause, ok := interruption(ctx); ok {
		return fmt.Errorf("%w: %s", cause, what)
	}
	return fmt.Errorf("%w: %s", errInterrupted, what)
}
