package engine

import (
	"bytes"
	"context"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/mktrain/mktrain/checkpoint"
)

// runLosses trains cfg in runDir, cancelling after stopAfter steps when it
// is positive, and returns the losses by step and the log.
func runLosses(t *testing.T, cfg Config, runDir string, stopAfter int) (map[int]float64, string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	losses := map[int]float64{}
	var logBuf bytes.Buffer
	eng, err := New(cfg, WithRunDir(runDir), WithLogger(zerolog.New(zerolog.SyncWriter(&logBuf))), WithHook(func(ev StepEvent) {
		losses[ev.Step] = ev.Loss
		if ev.Step == stopAfter {
			cancel()
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	_, err = eng.Run(ctx)
	if stopAfter > 0 && !errors.Is(err, ErrStopped) {
		t.Fatalf("run stopped after step %d: want ErrStopped, got %v", stopAfter, err)
	}
	if stopAfter <= 0 && err != nil {
		t.Fatalf("%v\n%s", err, logBuf.String())
	}
	return losses, logBuf.String()
}

func checkpointConfig() Config {
	cfg := equivalenceConfig()
	cfg.Model.MoE.BiasUpdateRate = 1e-3 // expert biases must survive a resume too
	cfg.Train.MicroBatch = 4            // two micro-batches per step
	cfg.Train.Steps = 8
	cfg.Train.EvalEvery = 4
	cfg.Checkpoint.Every = 3
	return cfg
}

// checkpointTensors reads the model tensors, and with optimizer the moments
// too, of the newest checkpoint under runDir.
func checkpointTensors(t *testing.T, optimizer bool, runDir string) map[string][]float32 {
	t.Helper()
	dir, err := checkpoint.Latest(filepath.Join(runDir, "checkpoints"))
	if err != nil {
		t.Fatal(err)
	}
	ck, err := checkpoint.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	out := map[string][]float32{}
	sets := []*checkpoint.TensorSet{ck.Model()}
	if optimizer {
		sets = append(sets, ck.Optim())
	}
	for _, set := range sets {
		for _, name := range set.Names() {
			data, _, err := set.Tensor(name)
			if err != nil {
				t.Fatal(err)
			}
			out[name] = data
		}
	}
	return out
}

// TestResumeIsBitExact: N steps, stop, resume, N steps gives exactly the
// losses and final weights and moments of 2N steps straight.
func TestResumeIsBitExact(t *testing.T) {
	for _, async := range []bool{false, true} {
		t.Run(map[bool]string{false: "sync", true: "async"}[async], func(t *testing.T) {
			cfg := checkpointConfig()
			cfg.Checkpoint.Async = async
			cfg.Checkpoint.Compress = map[bool]string{false: "none", true: "zstd"}[async]
			straightDir, resumedDir := t.TempDir(), t.TempDir()
			want, _ := runLosses(t, cfg, straightDir, 0)

			first, _ := runLosses(t, cfg, resumedDir, 4) // stops after step 4: a save on stop
			second, log := runLosses(t, cfg, resumedDir, 0)
			if !strings.Contains(log, `"step":4`) || !strings.Contains(log, "resuming") {
				t.Fatalf("did not resume from step 4:\n%s", log)
			}
			for step := 1; step <= cfg.Train.Steps; step++ {
				got, ok := first[step]
				if step > 4 {
					got, ok = second[step]
				}
				if !ok || got != want[step] {
					t.Errorf("step %d: loss %v (ran %v), straight run %v", step, got, ok, want[step])
				}
			}
			a, b := checkpointTensors(t, true, straightDir), checkpointTensors(t, true, resumedDir)
			if len(a) != len(b) || len(a) == 0 {
				t.Fatalf("%d tensors vs %d", len(a), len(b))
			}
			for name, x := range a {
				y := b[name]
				for i := range x {
					if x[i] != y[i] {
						t.Fatalf("%s[%d]: %v straight, %v resumed", name, i, x[i], y[i])
					}
				}
			}
		})
	}
}

// TestResumeReshards: a checkpoint written by 4 expert-parallel ranks
// resumes on 2 and on 1 rank, and one from 1 rank on 4; one written by 2
// context-parallel ranks (times 2 expert-parallel) on 1 rank and back;
// all with the losses of the uninterrupted run.
func TestResumeReshards(t *testing.T) {
	cfg := checkpointConfig()
	type layout struct{ ep, cp int }
	config := func(l layout) Config {
		c := cfg
		c.Parallel.EP, c.Parallel.CP, c.Train.MicroBatch = l.ep, l.cp, 8/l.ep
		return c
	}
	want, _ := runLosses(t, config(layout{4, 1}), t.TempDir(), 0)
	for _, pair := range [][2]layout{
		{{4, 1}, {2, 1}}, {{4, 1}, {1, 1}}, {{1, 1}, {4, 1}},
		{{2, 2}, {1, 1}}, {{1, 1}, {1, 2}},
	} {
		dir := t.TempDir()
		runLosses(t, config(pair[0]), dir, 3)
		got, _ := runLosses(t, config(pair[1]), dir, 0)
		for step := 4; step <= cfg.Train.Steps; step++ {
			if !(math.Abs(got[step]-want[step]) <= 2e-4*want[step]) {
				t.Errorf("%+v -> %+v, step %d: loss %.6f, uninterrupted %.6f", pair[0], pair[1], step, got[step], want[step])
			}
		}
	}
}

// TestResumeFallsBackFromCorruptCheckpoint: a flipped byte in the newest
// checkpoint makes resume take the previous one, with a warning naming the
// file.
func TestResumeFallsBackFromCorruptCheckpoint(t *testing.T) {
	cfg := checkpointConfig()
	want, _ := runLosses(t, cfg, t.TempDir(), 0)
	dir := t.TempDir()
	runLosses(t, cfg, dir, 7) // checkpoints at 3, 6 and on stop at 7
	latest, err := checkpoint.Latest(filepath.Join(dir, "checkpoints"))
	if err != nil || filepath.Base(latest) != checkpoint.StepDirName(7) {
		t.Fatalf("latest %q, %v", latest, err)
	}
	victim := filepath.Join(latest, checkpoint.ModelFile(0))
	raw, err := os.ReadFile(victim)
	if err != nil {
		t.Fatal(err)
	}
	raw[len(raw)/2] ^= 0x40
	if err := os.WriteFile(victim, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	got, log := runLosses(t, cfg, dir, 0)
	if !strings.Contains(log, "model-rank00000.safetensors") || !strings.Contains(log, `"step":6`) {
		t.Errorf("no warning naming the corrupt file, or not resumed from step 6:\n%s", log)
	}
	for step := 7; step <= cfg.Train.Steps; step++ {
		if got[step] != want[step] {
			t.Errorf("step %d: loss %v, straight %v", step, got[step], want[step])
		}
	}
}

// TestResumeRefusesModelChange: a model field change is refused naming the
// field; a schedule change is accepted and logged.
func TestResumeRefusesModelChange(t *testing.T) {
	cfg := checkpointConfig()
	dir := t.TempDir()
	runLosses(t, cfg, dir, 3)

	changed := cfg
	changed.Model.MoE.FFN = 48
	eng, err := New(changed, WithRunDir(dir))
	if err != nil {
		t.Fatal(err)
	}
	_, err = eng.Run(context.Background())
	if err == nil || !strings.Contains(err.Error(), "model.moe.ffn: 32 -> 48") {
		t.Fatalf("model change: %v", err)
	}

	longer := cfg
	longer.Train.Steps = 10
	_, log := runLosses(t, longer, dir, 0)
	if !strings.Contains(log, "train.steps: 8 -> 10") {
		t.Errorf("schedule change not listed:\n%s", log)
	}
}

// TestResumeFromPathAndNever: checkpoint.resume names a checkpoint to
// continue from (an older one here), and never refuses a run directory
// that already holds checkpoints instead of overwriting them.
func TestResumeFromPathAndNever(t *testing.T) {
	cfg := checkpointConfig()
	want, _ := runLosses(t, cfg, t.TempDir(), 0)
	dir := t.TempDir()
	runLosses(t, cfg, dir, 7) // checkpoints at 3, 6 and 7

	fromPath := cfg
	fromPath.Checkpoint.Resume = filepath.Join(dir, "checkpoints", checkpoint.StepDirName(3))
	got, log := runLosses(t, fromPath, dir, 0)
	if !strings.Contains(log, `"step":3`) || !strings.Contains(log, "resuming") {
		t.Fatalf("did not resume from step 3:\n%s", log)
	}
	for step := 4; step <= cfg.Train.Steps; step++ {
		if got[step] != want[step] {
			t.Errorf("step %d: loss %v, straight %v", step, got[step], want[step])
		}
	}

	never := cfg
	never.Checkpoint.Resume = "never"
	eng, err := New(never, WithRunDir(dir))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Run(context.Background()); err == nil || !strings.Contains(err.Error(), "already holds checkpoints") {
		t.Fatalf("resume never on a run directory with checkpoints: %v", err)
	}
}
