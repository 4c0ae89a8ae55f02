package engine

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mktrain/mktrain/checkpoint"
)

// TestSecondEngineOnRunDirIsRefused: while one engine trains in a run
// directory, a second engine of the same process on it fails at once,
// naming the holder's pid and host, and trains nothing; once the first
// is done, the directory is free again.
func TestSecondEngineOnRunDirIsRefused(t *testing.T) {
	cfg := checkpointConfig()
	cfg.Train.Steps, cfg.Train.WarmupSteps = 2, 0
	dir := t.TempDir()
	second, err := New(cfg, WithRunDir(dir))
	if err != nil {
		t.Fatal(err)
	}
	var secondErr error
	var secondTook time.Duration
	secondSteps := 0
	first, err := New(cfg, WithRunDir(dir), WithHook(func(ev StepEvent) {
		if ev.Step != 1 {
			return
		}
		// The first engine holds the directory while its hook runs.
		start := time.Now()
		res, err := second.Run(context.Background())
		secondErr, secondTook, secondSteps = err, time.Since(start), res.Steps
	}))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := first.Run(context.Background()); err != nil {
		t.Fatalf("first engine: %v", err)
	}
	var busy *RunDirBusyError
	if !errors.As(secondErr, &busy) {
		t.Fatalf("second engine on a held run directory: want a *RunDirBusyError, got %v", secondErr)
	}
	host, _ := os.Hostname()
	msg := secondErr.Error()
	for _, want := range []string{fmt.Sprintf("pid %d", os.Getpid()), "host " + host, dir} {
		if !strings.Contains(msg, want) {
			t.Errorf("refusal %q does not name %q", msg, want)
		}
	}
	if strings.Contains(msg, "\n") {
		t.Errorf("refusal is more than one line: %q", msg)
	}
	if secondSteps != 0 || secondTook > 5*time.Second {
		t.Errorf("second engine trained %d steps and took %v before it was refused", secondSteps, secondTook)
	}
	// Released: the directory takes a run again (it resumes at step 2).
	if _, err := second.Run(context.Background()); err != nil {
		t.Fatalf("run after the first ended: %v", err)
	}
}

// TestRunDirLockPerNode: the nodes of a multi-node run each lock their own
// file, so they may share a run directory; two holders of one node rank
// conflict, and Unlock frees the directory.
func TestRunDirLockPerNode(t *testing.T) {
	dir := t.TempDir()
	n0, err := LockRunDir(dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	n1, err := LockRunDir(dir, 1)
	if err != nil {
		t.Fatalf("node 1 beside node 0: %v", err)
	}
	var busy *RunDirBusyError
	if _, err := LockRunDir(dir, 1); !errors.As(err, &busy) || busy.PID != os.Getpid() {
		t.Fatalf("second node 1: want a refusal naming pid %d, got %v", os.Getpid(), err)
	}
	if err := n1.Unlock(); err != nil {
		t.Fatal(err)
	}
	again, err := LockRunDir(dir, 1)
	if err != nil {
		t.Fatalf("after Unlock: %v", err)
	}
	again.Unlock()
	// A caller's lock (WithRunDirLock) is the engine's: Run trains under it.
	cfg := checkpointConfig()
	cfg.Train.Steps, cfg.Train.WarmupSteps = 1, 0
	eng, err := New(cfg, WithRunDirLock(n0))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Run(context.Background()); err != nil {
		t.Fatalf("run under the caller's lock: %v", err)
	}
	n0.Unlock()
}

// metricsSteps reads the steps of a metrics.jsonl, in file order.
func metricsSteps(t *testing.T, path string) []int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var steps []int
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var l struct{ Step int }
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("metrics line %q: %v", sc.Text(), err)
		}
		steps = append(steps, l.Step)
	}
	return steps
}

// TestResumeTruncatesMetrics: after a crash (here: the newest checkpoint
// lost and a torn last line, as SIGKILL leaves them), the resumed run
// drops the metrics of the steps it trains again, so each step appears
// once.
func TestResumeTruncatesMetrics(t *testing.T) {
	cfg := checkpointConfig() // 8 steps, checkpoints at 3, 6 and 8
	cfg.Log.Every = 1
	cfg.Checkpoint.KeepLast = 0
	dir := t.TempDir()
	path := filepath.Join(dir, "metrics.jsonl")
	run := func() {
		t.Helper()
		eng, err := New(cfg, WithRunDir(dir), WithMetricsFile(path))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := eng.Run(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	run()
	root := filepath.Join(dir, "checkpoints")
	if err := os.RemoveAll(filepath.Join(root, checkpoint.StepDirName(8))); err != nil {
		t.Fatal(err)
	}
	os.Remove(filepath.Join(root, "latest"))
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(`{"step":9,"loss":`) // cut short by the crash
	f.Close()
	run() // resumes from step 6
	want := []int{1, 2, 3, 4, 5, 6, 7, 8}
	if got := metricsSteps(t, path); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("metrics.jsonl steps after the resume: %v, want %v", got, want)
	}
}

// TestResumeFromRunDirectory: checkpoint.resume may name a run directory
// (or its checkpoints root), which stands for its newest checkpoint that
// verifies.
func TestResumeFromRunDirectory(t *testing.T) {
	cfg := checkpointConfig()
	want, _ := runLosses(t, cfg, t.TempDir(), 0)
	from := t.TempDir()
	runLosses(t, cfg, from, 7) // checkpoints at 3, 6 and 7
	for _, resume := range []string{from, filepath.Join(from, "checkpoints")} {
		c := cfg
		c.Checkpoint.Resume = resume
		got, log := runLosses(t, c, t.TempDir(), 0)
		if !strings.Contains(log, `"step":7`) || !strings.Contains(log, "resuming") {
			t.Fatalf("checkpoint.resume %s: did not resume from step 7:\n%s", resume, log)
		}
		if got[8] != want[8] {
			t.Errorf("checkpoint.resume %s: step 8 loss %v, straight %v", resume, got[8], want[8])
		}
	}
}

// TestResumeReportsCheckpointWithoutManifest: a step directory without
// MANIFEST.json is damage: auto resume skips it with a warning naming it,
// and a run directory holding nothing else is an error, not a fresh start.
func TestResumeReportsCheckpointWithoutManifest(t *testing.T) {
	cfg := checkpointConfig()
	dir := t.TempDir()
	runLosses(t, cfg, dir, 7) // checkpoints at 3, 6 and 7
	root := filepath.Join(dir, "checkpoints")
	newest := filepath.Join(root, checkpoint.StepDirName(7))
	if err := os.Remove(filepath.Join(newest, "MANIFEST.json")); err != nil {
		t.Fatal(err)
	}
	_, log := runLosses(t, cfg, dir, 0)
	if !strings.Contains(log, newest) || !strings.Contains(log, "no MANIFEST.json") || !strings.Contains(log, `"step":6`) {
		t.Fatalf("want a warning naming %s and a resume from step 6:\n%s", newest, log)
	}

	only := t.TempDir()
	runLosses(t, cfg, only, 3)
	step3 := filepath.Join(only, "checkpoints", checkpoint.StepDirName(3))
	if err := os.Remove(filepath.Join(step3, "MANIFEST.json")); err != nil {
		t.Fatal(err)
	}
	eng, err := New(cfg, WithRunDir(only))
	if err != nil {
		t.Fatal(err)
	}
	res, err := eng.Run(context.Background())
	if err == nil || !strings.Contains(err.Error(), step3) || !strings.Contains(err.Error(), "no MANIFEST.json") {
		t.Fatalf("a run directory whose only checkpoint lacks its manifest: want an error naming %s, got %v (%d steps)", step3, err, res.Steps)
	}
}
