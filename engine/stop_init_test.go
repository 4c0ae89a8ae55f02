package engine

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
)

// allocCounter counts the tensors a backend allocates and cancels a
// context once it has allocated cancelAt of them.
type allocCounter struct {
	backend.Backend
	n        atomic.Int64
	cancelAt int64
	cancel   context.CancelFunc
}

func (a *allocCounter) New(dt backend.DType, shape ...int) backend.Tensor {
	if a.n.Add(1) == a.cancelAt && a.cancel != nil {
		a.cancel()
	}
	return a.Backend.New(dt, shape...)
}

// TestRunStopsDuringInitialisation cancels a run while its model is being
// built: Run must return ErrStopped before training (Elapsed 0), within a
// layer's worth of allocations of the cancel, not after building the
// whole model.
func TestRunStopsDuringInitialisation(t *testing.T) {
	cfg := equivalenceConfig()
	cfg.Model.Layers = 40
	cfg.Train.Steps, cfg.Train.WarmupSteps = 1, 0
	allocs := func(ctx context.Context, cancel context.CancelFunc, cancelAt int64) (int64, Result, error) {
		counter := &allocCounter{cancelAt: cancelAt, cancel: cancel}
		eng, err := New(cfg, WithBackendWrapper(func(b backend.Backend) backend.Backend {
			counter.Backend = b
			return counter
		}))
		if err != nil {
			t.Fatal(err)
		}
		defer eng.Close()
		res, err := eng.Run(ctx)
		return counter.n.Load(), res, err
	}
	// The tensors a whole run of one step allocates, the model's included.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	full, _, err := allocs(ctx, cancel, 1<<40) // never cancels
	if err != nil {
		t.Fatal(err)
	}
	cancelAt := full / 4
	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	n, res, err := allocs(ctx, cancel, cancelAt)
	if !errors.Is(err, ErrStopped) {
		t.Fatalf("run cancelled during initialisation: %v, want ErrStopped", err)
	}
	if res.Elapsed != 0 || res.Steps != 0 {
		t.Errorf("run cancelled during initialisation trained: %+v", res)
	}
	perLayer := full / int64(cfg.Model.Layers)
	if n > cancelAt+perLayer {
		t.Errorf("cancelled after %d of %d allocations, the run went on to %d (a layer is about %d)", cancelAt, full, n, perLayer)
	}
}

// TestResumeStopsWhileVerifying: a stop while the checkpoints are rehashed
// before a resume ends the search with the context's error, which Run
// turns into ErrStopped, instead of skipping the checkpoint as corrupt.
func TestResumeStopsWhileVerifying(t *testing.T) {
	cfg := equivalenceConfig()
	cfg.Train.Steps, cfg.Train.WarmupSteps = 2, 0
	dir := t.TempDir()
	first, err := New(cfg, WithRunDir(dir))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := first.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	first.Close()
	second, err := New(cfg, WithRunDir(dir))
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if ckpt, _, err := second.resumePoint(ctx, filepath.Join(dir, "checkpoints")); !errors.Is(err, context.Canceled) || ckpt != "" {
		t.Fatalf("resumePoint after a stop = %q, %v; want no checkpoint and an error wrapping context.Canceled", ckpt, err)
	}
	// Verified, the run resumes from its step 2.
	ckpt, st, err := second.resumePoint(context.Background(), filepath.Join(dir, "checkpoints"))
	if err != nil || ckpt == "" || st.Step != 2 {
		t.Fatalf("resumePoint = %q, %+v, %v; want the step-2 checkpoint", ckpt, st, err)
	}
}

// TestRunStopsDuringValidation: a stop while a long validation runs ends
// it between two batches; the step it followed is saved, and Run returns
// ErrStopped within moments, not after the validation.
func TestRunStopsDuringValidation(t *testing.T) {
	cfg := equivalenceConfig()
	cfg.Train.Steps, cfg.Train.WarmupSteps, cfg.Train.EvalEvery, cfg.Train.EvalBatches = 5, 0, 1, 1_000_000
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	eng, err := New(cfg, WithRunDir(dir), WithStartHook(func(StartEvent) {
		time.AfterFunc(300*time.Millisecond, cancel) // step 1 is quick; its validation is not
	}))
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	start := time.Now()
	res, err := eng.Run(ctx)
	if !errors.Is(err, ErrStopped) || res.Steps != 1 {
		t.Fatalf("Run = %d steps, %v; want ErrStopped after step 1", res.Steps, err)
	}
	if took := time.Since(start); took > 20*time.Second {
		t.Fatalf("the stop took %v", took)
	}
	if res.Checkpoint == "" || !strings.HasSuffix(res.Checkpoint, "step_00000001") {
		t.Fatalf("Result.Checkpoint = %q, want step 1's", res.Checkpoint)
	}
}
