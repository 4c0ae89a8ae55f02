package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mktrain/mktrain/checkpoint"
)

// buildBinary compiles mktrain once for the tests that need a real process.
func buildBinary(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("builds the binary; skipped with -short")
	}
	bin := filepath.Join(t.TempDir(), "mktrain")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// crashArgs is a short run that logs and checkpoints every step.
func crashArgs(runDir string) []string {
	return []string{"run", "tiny", "--run-dir", runDir,
		"--set", "train.steps=24", "--set", "train.seq=32", "--set", "train.global_batch=4",
		"--set", "train.micro_batch=2", "--set", "train.warmup_steps=2", "--set", "train.eval_every=0",
		"--set", "train.eval_batches=1", "--set", "train.backend=cpu", "--set", "log.every=1",
		"--set", "checkpoint.every=1", "--set", "checkpoint.keep_last=2", "--set", "log.progress=off"}
}

// metricLosses reads every (step, loss) line of a run's metrics.jsonl; a
// step logged twice (a resume that kept the metrics of the steps it
// trained again) appears twice.
func metricLosses(t *testing.T, runDir string) map[int][]float64 {
	t.Helper()
	f, err := os.Open(filepath.Join(runDir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[int][]float64{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var line struct {
			Step int     `json:"step"`
			Loss float64 `json:"loss"`
		}
		if err := json.Unmarshal(sc.Bytes(), &line); err != nil {
			// A process killed mid-write leaves at most a torn last line.
			continue
		}
		out[line.Step] = append(out[line.Step], line.Loss)
	}
	return out
}

// TestSIGKILLResumesFromLastCompleteCheckpoint kills the real binary at
// random moments, saves included, and restarts it with the same command
// until the run completes. Every loss it ever logged must equal the
// uninterrupted run's loss at that step, bit for bit: each restart resumed
// from a complete checkpoint, never a partial one.
func TestSIGKILLResumesFromLastCompleteCheckpoint(t *testing.T) {
	bin := buildBinary(t)
	straight := t.TempDir()
	if out, err := exec.Command(bin, crashArgs(straight)...).CombinedOutput(); err != nil {
		t.Fatalf("uninterrupted run: %v\n%s", err, out)
	}
	want := metricLosses(t, straight)

	crashed := t.TempDir()
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	kills := 0
	for attempt := 0; ; attempt++ {
		if attempt == 25 {
			t.Fatal("the run did not complete in 25 attempts")
		}
		cmd := exec.Command(bin, crashArgs(crashed)...)
		var out strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		// After 20 kills the run is let finish, so a slow machine, where
		// few steps fit between two kills, still completes the test.
		killAfter := time.Duration(100+rng.IntN(500)) * time.Millisecond
		if kills >= 20 {
			killAfter = time.Hour
		}
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("attempt %d: %v\n%s", attempt, err, out.String())
			}
		case <-time.After(killAfter):
			_ = cmd.Process.Signal(syscall.SIGKILL)
			err := <-done
			var exit *exec.ExitError
			if errors.As(err, &exit) {
				kills++
				continue
			}
			if err != nil {
				t.Fatal(err)
			}
		}
		break
	}
	if kills == 0 {
		t.Log("the run finished before any kill landed; the comparison still holds")
	}
	got := metricLosses(t, crashed)
	for step, losses := range want {
		if len(got[step]) == 0 {
			t.Errorf("step %d never logged after %d kills", step, kills)
		}
		for _, l := range got[step] {
			if l != losses[0] {
				t.Errorf("step %d: loss %v after crashes, %v uninterrupted", step, l, losses[0])
			}
		}
		if len(got[step]) > 1 {
			t.Errorf("step %d logged %d times: a resumed run must drop the metrics of the steps it trains again", step, len(got[step]))
		}
	}
	root := filepath.Join(crashed, "checkpoints")
	latest, err := checkpoint.Latest(root)
	if err != nil || filepath.Base(latest) != checkpoint.StepDirName(24) {
		t.Fatalf("latest checkpoint %q, %v", latest, err)
	}
	if err := checkpoint.Verify(latest); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d kills", kills)
}

// TestInterruptSavesAndSameCommandContinues is the newcomer's path: Ctrl-C
// stops a run with a checkpoint, and the same command continues it.
func TestInterruptSavesAndSameCommandContinues(t *testing.T) {
	bin := buildBinary(t)
	dir := t.TempDir()
	args := crashArgs(dir)
	args = append(args, "--set", "checkpoint.every=0", "--set", "train.steps=150")
	cmd := exec.Command(bin, args...)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		if _, err := os.Stat(filepath.Join(dir, "metrics.jsonl")); err == nil && len(metricLosses(t, dir)) >= 3 {
			break
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			t.Fatalf("no progress:\n%s", out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	_ = cmd.Process.Signal(os.Interrupt)
	err := cmd.Wait()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != exitInterrupted {
		t.Fatalf("after Ctrl-C: %v, want exit %d\n%s", err, exitInterrupted, out.String())
	}
	latest, err := checkpoint.Latest(filepath.Join(dir, "checkpoints"))
	if err != nil {
		t.Fatalf("no checkpoint after Ctrl-C: %v\n%s", err, out.String())
	}
	stoppedAt := len(metricLosses(t, dir))

	if filepath.Base(latest) != checkpoint.StepDirName(stoppedAt) {
		t.Errorf("checkpoint %s after stopping at step %d", latest, stoppedAt)
	}
	res, err := exec.Command(bin, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("same command again: %v\n%s", err, res)
	}
	if !strings.Contains(string(res), "150 steps") {
		t.Errorf("second run did not complete the run:\n%s", res)
	}
	if n := len(metricLosses(t, dir)); n < 150 || stoppedAt < 3 {
		t.Errorf("logged %d distinct steps (stopped at %d)", n, stoppedAt)
	}
}
