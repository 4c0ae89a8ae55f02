package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// lockedBuffer collects a child's output while the test reads it.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// child is a running mktrain.
type child struct {
	t              *testing.T
	cmd            *exec.Cmd
	stdout, stderr *lockedBuffer
	done           chan struct{}
	err            error
}

func startChild(t *testing.T, bin string, args ...string) *child {
	t.Helper()
	c := &child{t: t, cmd: exec.Command(bin, args...), stdout: &lockedBuffer{}, stderr: &lockedBuffer{}, done: make(chan struct{})}
	c.cmd.Stdout, c.cmd.Stderr = c.stdout, c.stderr
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { c.err = c.cmd.Wait(); close(c.done) }()
	t.Cleanup(func() {
		select {
		case <-c.done:
		default:
			_ = c.cmd.Process.Kill()
			<-c.done
		}
	})
	return c
}

// waitFor polls until ready holds; the child exiting first, or a minute
// passing, fails the test.
func (c *child) waitFor(what string, ready func() bool) {
	c.t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !ready() {
		select {
		case <-c.done:
			if ready() { // written just before the exit
				return
			}
			c.t.Fatalf("exited (%v) before %s\nstdout:\n%s\nstderr:\n%s", c.err, what, c.stdout, c.stderr)
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("no %s after a minute\nstderr:\n%s", what, c.stderr)
		}
	}
}

func (c *child) waitForStderr(s string) {
	c.t.Helper()
	c.waitFor(fmt.Sprintf("%q on stderr", s), func() bool { return strings.Contains(c.stderr.String(), s) })
}

func (c *child) signal(sig os.Signal) {
	c.t.Helper()
	if err := c.cmd.Process.Signal(sig); err != nil {
		c.t.Fatal(err)
	}
}

// exit waits at most within for the child to exit and checks its status.
func (c *child) exit(want int, within time.Duration) {
	c.t.Helper()
	select {
	case <-c.done:
	case <-time.After(within):
		_ = c.cmd.Process.Kill()
		<-c.done
		c.t.Fatalf("still running %s after the signal\nstderr:\n%s", within, c.stderr)
	}
	var exit *exec.ExitError
	code := 0
	if errors.As(c.err, &exit) {
		code = exit.ExitCode()
	} else if c.err != nil {
		c.t.Fatal(c.err)
	}
	if code != want {
		c.t.Fatalf("exit %d (%v), want %d\nstdout:\n%s\nstderr:\n%s", code, c.err, want, c.stdout, c.stderr)
	}
	if s := c.stderr.String(); strings.Contains(s, "goroutine ") || strings.Contains(s, "panic") {
		c.t.Errorf("stderr shows a panic or stack trace:\n%s", s)
	}
}

// slowInitArgs is a run whose model takes seconds to build (many thin
// layers) and whose steps are quick.
func slowInitArgs(runDir string) []string {
	return []string{"run", "tiny", "--run-dir", runDir,
		"--set", "model.layers=20000", "--set", "model.dim=16", "--set", "model.heads=2", "--set", "model.kv_heads=1",
		"--set", "model.moe.experts=2", "--set", "model.moe.top_k=1", "--set", "model.moe.ffn=16",
		"--set", "model.moe.dispatcher=unfused", "--set", "train.backend=cpu", "--set", "log.progress=off",
		"--set", "train.steps=1", "--set", "train.warmup_steps=0", "--set", "train.seq=16",
		"--set", "train.global_batch=1", "--set", "train.micro_batch=1", "--set", "checkpoint.every=0"}
}

// slowStepArgs is a run of a small model whose steps take seconds (large
// batches of long sequences).
func slowStepArgs(runDir string) []string {
	return []string{"run", "tiny", "--run-dir", runDir,
		"--set", "model.layers=4", "--set", "model.moe.dispatcher=unfused", "--set", "train.backend=cpu",
		"--set", "log.progress=off", "--set", "train.steps=3", "--set", "train.warmup_steps=0",
		"--set", "train.seq=256", "--set", "train.global_batch=64", "--set", "train.micro_batch=64",
		"--set", "train.eval_every=0", "--set", "train.eval_batches=1", "--set", "checkpoint.every=0"}
}

// stepDirs lists the checkpoints of a run directory.
func stepDirs(t *testing.T, runDir string) []string {
	t.Helper()
	dirs, err := filepath.Glob(filepath.Join(runDir, "checkpoints", "step_*"))
	if err != nil {
		t.Fatal(err)
	}
	return dirs
}

// stopWithin bounds how long a child may take to stop after a signal. It
// is generous for loaded machines (a stop takes well under a second
// alone): each case also checks what a late stop would leave behind, a
// built model, a saved step or a reported checkpoint.
const stopWithin = 10 * time.Second

// TestSignals: Ctrl-C and SIGTERM are honoured in every phase and
// command, with exit 130 and 143; a second Ctrl-C exits at once.
func TestSignals(t *testing.T) {
	bin := buildBinary(t)

	// The model of slowInitArgs takes seconds to build; the signal must
	// stop the build, not wait for it (which would log "training starts").
	for _, tc := range []struct {
		sig  os.Signal
		code int
	}{{os.Interrupt, exitInterrupted}, {syscall.SIGTERM, exitTerminated}} {
		t.Run("during model initialisation "+signalName(tc.sig), func(t *testing.T) {
			c := startChild(t, bin, slowInitArgs(t.TempDir())...)
			c.waitForStderr("mktrain run")
			c.signal(tc.sig)
			c.exit(tc.code, stopWithin)
			stderr := c.stderr.String()
			if strings.Contains(stderr, "training starts") {
				t.Errorf("the model was built to the end before the run stopped:\n%s", stderr)
			}
			for _, want := range []string{signalName(tc.sig) + ": stopping cleanly", "interrupted by " + signalName(tc.sig) + ": stopped before training started"} {
				if !strings.Contains(stderr, want) {
					t.Errorf("stderr lacks %q:\n%s", want, stderr)
				}
			}
		})
	}

	t.Run("a second Ctrl-C exits during a step", func(t *testing.T) {
		// "training starts" is logged just before the first step: a
		// signal that lands in between stops the run before the step,
		// cleanly and at once, which leaves no step for a second Ctrl-C
		// to cut short. So the first Ctrl-C comes a little later, inside
		// the first step (which takes seconds), and a run that still
		// stopped before its second Ctrl-C is tried again.
		var c *child
		var dir string
		for attempt := 1; ; attempt++ {
			dir = t.TempDir()
			c = startChild(t, bin, slowStepArgs(dir)...)
			c.waitForStderr("training starts")
			time.Sleep(200 * time.Millisecond)
			c.signal(os.Interrupt)
			c.waitForStderr("press Ctrl-C again to exit now")
			if c.cmd.Process.Signal(os.Interrupt) == nil {
				break
			}
			<-c.done // it stopped cleanly before the second signal
			if attempt == 3 {
				t.Fatalf("three runs stopped before a second Ctrl-C could reach them\nstderr:\n%s", c.stderr)
			}
		}
		c.exit(exitInterrupted, stopWithin)
		if !strings.Contains(c.stderr.String(), "SIGINT again: exiting now") {
			t.Errorf("stderr lacks the forced exit:\n%s", c.stderr)
		}
		// The first Ctrl-C would have finished step 1 and saved it.
		if dirs := stepDirs(t, dir); len(dirs) != 0 {
			t.Errorf("the run saved %v: it finished its step instead of exiting", dirs)
		}
	})

	t.Run("rendezvous", func(t *testing.T) {
		// Node 0 of two waits for node 1, which never comes.
		c := startChild(t, bin, nodeArgs(tinyArgs(t.TempDir(), 3, "parallel.dp=2"), 0, freePort(t), "1m")...)
		c.waitForStderr("waiting for the other nodes")
		c.signal(os.Interrupt)
		c.exit(exitInterrupted, stopWithin)
		if !strings.Contains(c.stderr.String(), "interrupted by SIGINT") {
			t.Errorf("stderr does not say the wait was interrupted:\n%s", c.stderr)
		}
	})

	t.Run("data prepare", func(t *testing.T) {
		// 8 GiB of zeros, sparse: the shards would take minutes to write.
		in := filepath.Join(t.TempDir(), "big.txt")
		f, err := os.Create(in)
		if err != nil {
			t.Fatal(err)
		}
		if err := f.Truncate(8 << 30); err != nil {
			t.Fatal(err)
		}
		f.Close()
		out := filepath.Join(t.TempDir(), "shards")
		c := startChild(t, bin, "data", "prepare", "--out", out, "--shard-tokens", "1000000", in)
		c.waitFor("a first shard", func() bool {
			entries, _ := os.ReadDir(out)
			return len(entries) > 0
		})
		c.signal(os.Interrupt)
		c.exit(exitInterrupted, stopWithin)
		if _, err := os.Stat(out); !errors.Is(err, os.ErrNotExist) {
			entries, _ := os.ReadDir(out)
			t.Errorf("interrupted prepare left %s (%d entries): %v", out, len(entries), err)
		}
		if !strings.Contains(c.stderr.String(), "interrupted by SIGINT") {
			t.Errorf("stderr does not say it was interrupted:\n%s", c.stderr)
		}
	})

	t.Run("ckpt verify", func(t *testing.T) {
		// Two checkpoints, oldest first: a small one and one of 8 GiB
		// (sparse), whose hashing the signal interrupts.
		root := filepath.Join(t.TempDir(), "checkpoints")
		writeCheckpoint(t, filepath.Join(root, "step_00000001"), 4)
		writeCheckpoint(t, filepath.Join(root, "step_00000002"), 8<<30)
		c := startChild(t, bin, "ckpt", "verify", root)
		c.waitFor("the first checkpoint verified", func() bool { return strings.Contains(c.stdout.String(), "step_00000001") })
		c.signal(os.Interrupt)
		c.exit(exitInterrupted, stopWithin)
		if strings.Contains(c.stdout.String(), "step_00000002") {
			t.Errorf("the big checkpoint was reported after the signal:\n%s", c.stdout)
		}
		if !strings.Contains(c.stderr.String(), "interrupted by SIGINT: verification of") {
			t.Errorf("stderr does not say verification was interrupted:\n%s", c.stderr)
		}
	})
}

// writeCheckpoint writes a step directory of one sparse file of size
// zeros, with a manifest that lists it (the checksum is right for size 4).
func writeCheckpoint(t *testing.T, dir string, size int64) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(dir, "zeros.bin"))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	manifest, err := json.Marshal(map[string]any{
		"format": "mktrain-checkpoint", "format_version": 1, "step": 1,
		"files": []map[string]any{{"name": "zeros.bin", "size": size,
			// sha256 of four zero bytes
			"sha256": "df3f619804a92fdb4057192dc43dd748ea778adc52bc498ce80524c014b81119"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "MANIFEST.json"), manifest, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestMultiNodeInterruptAnyNode: Ctrl-C on node 1 (not node 0, whose rank
// 0 writes the checkpoints) stops both nodes at the same step, saved by
// node 0; node 1 exits 130 and node 0 exits 130 too.
func TestMultiNodeInterruptAnyNode(t *testing.T) {
	if testing.Short() {
		t.Skip("starts two processes; skipped with -short")
	}
	dir := t.TempDir()
	port := freePort(t)
	nodes := startTrainingNodes(t, dir, port, time.Minute)
	if err := nodes[1].cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	for rank, n := range nodes {
		if code := n.wait(t, 30*time.Second); code != exitInterrupted {
			t.Errorf("node %d: exit %d after Ctrl-C on node 1, want %d:\n%s", rank, code, exitInterrupted, n.out.String())
		}
	}
	dirs := stepDirs(t, nodes[0].runDir)
	if len(dirs) != 1 {
		t.Fatalf("node 0 saved %v, want the one checkpoint of the stop", dirs)
	}
	// Both nodes name the step the checkpoint holds.
	want := fmt.Sprintf("stopped after step %d", metricSteps(t, nodes[0].runDir))
	for rank, n := range nodes {
		if !strings.Contains(n.out.String(), want) {
			t.Errorf("node %d does not say %q:\n%s", rank, want, n.out.String())
		}
	}
	if !strings.Contains(nodes[1].out.String(), "interrupted by SIGINT") {
		t.Errorf("node 1 does not say it was interrupted:\n%s", nodes[1].out.String())
	}
}

// metricSteps is the number of distinct steps in a run's metrics.jsonl.
func metricSteps(t *testing.T, runDir string) int {
	t.Helper()
	return len(metricLosses(t, runDir))
}
