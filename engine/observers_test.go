package engine

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// TestRunEvents: the start hook sees a fresh run and then a resumed one
// (its step and checkpoint), the save hook sees every checkpoint with its
// size, each step carries its peak memory, ETA and, with a validation
// loss, the batches behind it; metrics.jsonl and the log line say the same.
func TestRunEvents(t *testing.T) {
	cfg := checkpointConfig() // 8 steps, checkpoints every 3, evaluation every 4
	runDir := t.TempDir()
	var (
		starts []StartEvent
		saves  []SaveEvent
		steps  []StepEvent
		logBuf bytes.Buffer
	)
	run := func(last int) {
		t.Helper()
		c := cfg
		c.Train.Steps = last
		eng, err := New(c, WithRunDir(runDir), WithMetricsFile(filepath.Join(runDir, "metrics.jsonl")),
			WithLogger(zerolog.New(zerolog.SyncWriter(&logBuf))),
			WithStartHook(func(ev StartEvent) { starts = append(starts, ev) }),
			WithSaveHook(func(ev SaveEvent) { saves = append(saves, ev) }),
			WithHook(func(ev StepEvent) { steps = append(steps, ev) }))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := eng.Run(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	run(4)
	run(8)

	if len(starts) != 2 {
		t.Fatalf("%d start events, want 2", len(starts))
	}
	fresh, resumed := starts[0], starts[1]
	if fresh.StartStep != 0 || fresh.Checkpoint != "" || fresh.Backend != "cpu" || fresh.Params != ParamCount(cfg.Model) ||
		fresh.Steps != 4 || fresh.RunDir != runDir || fresh.Ranks != 1 || !strings.HasPrefix(fresh.Device, "CPU, ") {
		t.Errorf("fresh start: %+v", fresh)
	}
	if resumed.StartStep != 4 || !strings.HasSuffix(resumed.Checkpoint, "step_00000004") || resumed.Steps != 8 {
		t.Errorf("resumed start: %+v", resumed)
	}
	// Checkpoints: step 3, 4 (the end of the first run), 6, 8.
	var saved []int
	for _, s := range saves {
		saved = append(saved, s.Step)
		if s.Bytes <= 0 || s.Duration <= 0 || !strings.HasSuffix(s.Dir, fmt.Sprintf("step_%08d", s.Step)) {
			t.Errorf("save event %+v", s)
		}
	}
	if want := []int{3, 4, 6, 8}; !slices.Equal(saved, want) {
		t.Errorf("saved steps %v, want %v", saved, want)
	}
	for _, ev := range steps {
		if ev.PeakMemory <= 0 || ev.MemorySource != MemoryProcess || ev.MFU != 0 {
			t.Errorf("step %d: peak memory %d (%s), MFU %v; want a positive process memory and no MFU on the CPU",
				ev.Step, ev.PeakMemory, ev.MemorySource, ev.MFU)
		}
		if ev.Step < ev.Steps && ev.ETA <= 0 || ev.Step == ev.Steps && ev.ETA != 0 {
			t.Errorf("step %d of %d: ETA %v", ev.Step, ev.Steps, ev.ETA)
		}
		if evaluated := !math.IsNaN(ev.ValLoss); evaluated != (ev.ValBatches == cfg.Train.EvalBatches) {
			t.Errorf("step %d: val loss %v over %d batches; want %d batches with a val loss, 0 without", ev.Step, ev.ValLoss, ev.ValBatches, cfg.Train.EvalBatches)
		}
	}

	f, err := os.Open(filepath.Join(runDir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var line map[string]any
		if err := json.Unmarshal(sc.Bytes(), &line); err != nil {
			t.Fatal(err)
		}
		if mfu, ok := line["mfu"]; !ok || mfu != nil {
			t.Errorf("metrics line %v: mfu should be null on the CPU", line)
		}
		if m, _ := line["peak_memory_bytes"].(float64); m <= 0 {
			t.Errorf("metrics line %v: no peak_memory_bytes", line)
		}
		if _, val := line["val_loss"]; val && line["val_batches"] != float64(cfg.Train.EvalBatches) {
			t.Errorf("metrics line %v: val_loss without val_batches %d", line, cfg.Train.EvalBatches)
		}
	}
	if !strings.Contains(logBuf.String(), `"message":"step 8/8"`) || !strings.Contains(logBuf.String(), `"val_batches":`) ||
		!strings.Contains(logBuf.String(), `"eta":`) || !strings.Contains(logBuf.String(), `"mfu":"-"`) {
		t.Errorf("log lacks the step line's parts:\n%s", logBuf.String())
	}
}

// TestPanickingStartAndSaveHooksAreRunErrors: a panic in a start or save
// hook comes back from Run as a *HookPanicError naming the option.
func TestPanickingStartAndSaveHooksAreRunErrors(t *testing.T) {
	for _, tc := range []struct {
		option string
		opt    Option
	}{
		{"engine.WithStartHook", WithStartHook(func(StartEvent) { panic("start") })},
		{"engine.WithSaveHook", WithSaveHook(func(SaveEvent) { panic("save") })},
	} {
		cfg := checkpointConfig()
		cfg.Train.Steps = 4
		eng, err := New(cfg, WithRunDir(t.TempDir()), tc.opt)
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { _, err := eng.Run(context.Background()); done <- err }()
		select {
		case err = <-done:
		case <-time.After(time.Minute):
			t.Fatalf("%s: Run did not return", tc.option)
		}
		var hp *HookPanicError
		if !errors.As(err, &hp) || hp.Option != tc.option || !strings.Contains(err.Error(), tc.option) {
			t.Errorf("a panicking %s: Run returned %v, want a *HookPanicError naming it", tc.option, err)
		}
	}
}
