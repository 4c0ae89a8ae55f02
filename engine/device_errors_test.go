package engine

import (
	"context"
	"errors"
	"path/filepath"
	"sync"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/checkpoint"
)

var errOptimizerFault = errors.New("device fault in the optimizer")

// failingOptimizer is a backend whose optimizer faults in one step, as a
// GPU does: the AdamW call returns at once (it only queues work), and from
// then on Sync returns the fault, which stays (a faulted CUDA context is
// unusable).
type failingOptimizer struct {
	backend.Backend
	mu            sync.Mutex
	armed, failed bool
}

// arm makes the next AdamW call fault.
func (f *failingOptimizer) arm() { f.mu.Lock(); f.armed = true; f.mu.Unlock() }

func (f *failingOptimizer) fault() {
	f.mu.Lock()
	f.failed = f.failed || f.armed
	f.mu.Unlock()
}

func (f *failingOptimizer) AdamWUpdate(param, grad, m, v backend.Tensor, h backend.AdamW) {
	f.fault()
	f.Backend.AdamWUpdate(param, grad, m, v, h)
}

func (f *failingOptimizer) AdamWUpdateSplit(hi, lo, grad, m, v backend.Tensor, h backend.AdamW) {
	f.fault()
	f.Backend.AdamWUpdateSplit(hi, lo, grad, m, v, h)
}

func (f *failingOptimizer) Sync() error {
	f.mu.Lock()
	failed := f.failed
	f.mu.Unlock()
	if failed {
		return errOptimizerFault
	}
	return f.Backend.Sync()
}

// runFaulting trains cfg (in runDir when not empty) with the optimizer
// faulting in step failStep, and returns Run's error and the steps the
// hooks heard of.
func runFaulting(t *testing.T, cfg Config, runDir string, failStep int) (error, []int) {
	t.Helper()
	f := &failingOptimizer{}
	var steps []int
	opts := []Option{
		WithBackendWrapper(func(b backend.Backend) backend.Backend { f.Backend = b; return f }),
		WithHook(func(ev StepEvent) {
			steps = append(steps, ev.Step)
			if ev.Step == failStep-1 {
				f.arm()
			}
		}),
	}
	if runDir != "" {
		opts = append(opts, WithRunDir(runDir))
	}
	eng, err := New(cfg, opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	_, err = eng.Run(context.Background())
	return err, steps
}

// TestOptimizerFaultIsReported: a step returns without waiting for its
// optimizer (the next batch is prepared while the device runs AdamW), so
// a fault there must still end the run with its error: at the last step,
// from the final evaluation, before the step is reported; before a
// checkpoint, from the checkpoint, which is then not written; and in
// mid-run, from the next step, before its loss is reported.
func TestOptimizerFaultIsReported(t *testing.T) {
	cfg := planConfig()
	cfg.Train.Steps = 3
	t.Run("last step", func(t *testing.T) {
		err, steps := runFaulting(t, cfg, "", 3)
		if !errors.Is(err, errOptimizerFault) {
			t.Fatalf("Run: %v, want the optimizer's fault", err)
		}
		if len(steps) != 2 {
			t.Errorf("steps reported %v, want 1 and 2: step 3's final evaluation follows the fault", steps)
		}
	})
	t.Run("mid-run", func(t *testing.T) {
		cfg := cfg
		cfg.Train.Steps = 5
		err, steps := runFaulting(t, cfg, "", 2)
		if !errors.Is(err, errOptimizerFault) {
			t.Fatalf("Run: %v, want the optimizer's fault", err)
		}
		if len(steps) != 2 {
			t.Errorf("steps reported %v, want 1 and 2: step 3's loss follows the fault", steps)
		}
	})
	t.Run("checkpoint", func(t *testing.T) {
		cfg := cfg
		cfg.Train.Steps = 5
		cfg.Checkpoint.Every = 1
		cfg.Checkpoint.Async = false
		dir := t.TempDir()
		err, _ := runFaulting(t, cfg, dir, 3)
		if !errors.Is(err, errOptimizerFault) {
			t.Fatalf("Run: %v, want the optimizer's fault", err)
		}
		latest, err := checkpoint.Latest(filepath.Join(dir, "checkpoints"))
		if err != nil {
			t.Fatal(err)
		}
		if want := "step_00000002"; filepath.Base(latest) != want {
			t.Errorf("newest checkpoint %s, want %s: step 3's optimizer faulted", filepath.Base(latest), want)
		}
	})
}
