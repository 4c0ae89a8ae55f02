package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rs/zerolog"
)

// What a program embedding the engine relies on: its own bugs in a hook
// come back as Run's error, and a run that saves nothing says so.

// TestPanickingHookIsRunError: a hook that panics stops the run at that
// step; Run returns a *HookPanicError naming the hook, the step and the
// panic value, and the process goes on (this test would crash otherwise).
// Hooks after it are not called for that step.
func TestPanickingHookIsRunError(t *testing.T) {
	cfg := checkpointConfig()
	cfg.Train.Steps = 5
	laterCalls := 0
	eng, err := New(cfg,
		WithHook(func(StepEvent) {}),
		WithHook(func(ev StepEvent) {
			if ev.Step == 2 {
				var m map[string]int
				m["boom"]++ // a nil-map write: a runtime panic, as a real bug would be
			}
		}),
		WithHook(func(StepEvent) { laterCalls++ }))
	if err != nil {
		t.Fatal(err)
	}
	res, err := eng.Run(context.Background())
	var hp *HookPanicError
	if !errors.As(err, &hp) {
		t.Fatalf("Run with a panicking hook: want a *HookPanicError, got %v", err)
	}
	if hp.Hook != 1 || hp.Step != 2 {
		t.Errorf("HookPanicError names hook %d at step %d; want hook 1 at step 2", hp.Hook, hp.Step)
	}
	if !strings.Contains(err.Error(), "assignment to entry in nil map") || !strings.Contains(err.Error(), "step 2") {
		t.Errorf("error %q does not carry the panic value and the step", err)
	}
	if !bytes.Contains(hp.Stack, []byte("TestPanickingHookIsRunError")) {
		t.Errorf("HookPanicError.Stack does not show the hook:\n%s", hp.Stack)
	}
	if res.Steps != 2 || laterCalls != 1 {
		t.Errorf("run went on to step %d and called the next hook %d times; want it stopped at step 2 after 1 call", res.Steps, laterCalls)
	}
}

// TestHookPanicWithRunDirKeepsResuming: after a hook's panic the run
// directory is unlocked and the run resumes from its last checkpoint when
// started again.
func TestHookPanicWithRunDirKeepsResuming(t *testing.T) {
	cfg := checkpointConfig() // checkpoint every 3 steps
	dir := t.TempDir()
	panicky, err := New(cfg, WithRunDir(dir), WithHook(func(ev StepEvent) {
		if ev.Step == 4 {
			panic("hook bug")
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	res, err := panicky.Run(context.Background())
	if hp := (*HookPanicError)(nil); !errors.As(err, &hp) || hp.Value != "hook bug" {
		t.Fatalf("want a *HookPanicError with the value \"hook bug\", got %v", err)
	}
	if want := filepath.Join(dir, "checkpoints", "step_00000003"); res.Checkpoint != want {
		t.Errorf("Result.Checkpoint after the panic = %q; want %q", res.Checkpoint, want)
	}
	again, err := New(cfg, WithRunDir(dir))
	if err != nil {
		t.Fatal(err)
	}
	res, err = again.Run(context.Background())
	if err != nil {
		t.Fatalf("run after a hook's panic: %v", err)
	}
	if res.StartStep != 3 || res.Steps != cfg.Train.Steps || res.Unsaved {
		t.Errorf("resumed run: start %d, steps %d, unsaved %v; want start 3, steps %d, saved", res.StartStep, res.Steps, res.Unsaved, cfg.Train.Steps)
	}
	if want := filepath.Join(dir, "checkpoints", "step_00000008"); res.Checkpoint != want {
		t.Errorf("Result.Checkpoint = %q; want %q", res.Checkpoint, want)
	}
}

// TestRunWithoutRunDirSaysUnsaved: without WithRunDir, Run warns before
// training that nothing will be saved and the result says so.
func TestRunWithoutRunDirSaysUnsaved(t *testing.T) {
	cfg := checkpointConfig()
	cfg.Train.Steps, cfg.Train.WarmupSteps = 2, 0
	var log bytes.Buffer
	eng, err := New(cfg, WithLogger(zerolog.New(zerolog.SyncWriter(&log))))
	if err != nil {
		t.Fatal(err)
	}
	res, err := eng.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !res.Unsaved || res.Checkpoint != "" {
		t.Errorf("run without a run directory: Unsaved %v, Checkpoint %q; want true and \"\"", res.Unsaved, res.Checkpoint)
	}
	warned := false
	for _, line := range strings.Split(log.String(), "\n") {
		if strings.Contains(line, `"level":"warn"`) && strings.Contains(line, "no checkpoint will be saved") {
			warned = true
			break
		}
		if strings.Contains(line, "training starts") {
			break // too late: the warning comes before the model is built
		}
	}
	if !warned {
		t.Errorf("no warning that nothing is saved before training starts:\n%s", log.String())
	}

	// A stop before the first step (the context already cancelled) says so too.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	res, err = eng.Run(ctx)
	if !errors.Is(err, ErrStopped) || !res.Unsaved {
		t.Errorf("stopped run without a run directory: %v, Unsaved %v; want ErrStopped and true", err, res.Unsaved)
	}
}

// TestStepEventJSONIsMetricsLine: a StepEvent encodes as its metrics.jsonl
// line, with or without a validation loss (NaN, which plain encoding
// refuses).
func TestStepEventJSONIsMetricsLine(t *testing.T) {
	for _, ev := range []StepEvent{
		{Step: 3, Steps: 10, Loss: 2.5, LR: 1e-3, Tokens: 96, TokensPerSec: 1234.4, ValLoss: math.NaN(),
			Experts: []ExpertLoad{{Layer: 0, Fraction: []float64{0.25, 0.75}, MaxOverMean: 1.5}}},
		{Step: 10, Steps: 10, Loss: 2.1, ValLoss: 2.2, ValBatches: 4, MFU: 0.41, PeakMemory: 1 << 20},
	} {
		got, err := json.Marshal(ev)
		if err != nil {
			t.Fatalf("step %d: %v", ev.Step, err)
		}
		var line bytes.Buffer
		if err := writeMetrics(&line, ev); err != nil {
			t.Fatal(err)
		}
		if want := strings.TrimSuffix(line.String(), "\n"); string(got) != want {
			t.Errorf("step %d encodes as\n%s\nwant its metrics.jsonl line\n%s", ev.Step, got, want)
		}
		if hasVal := strings.Contains(string(got), `"val_loss":`); hasVal != !math.IsNaN(ev.ValLoss) {
			t.Errorf("step %d: val_loss present %v; want %v: %s", ev.Step, hasVal, !math.IsNaN(ev.ValLoss), got)
		}
	}
}
