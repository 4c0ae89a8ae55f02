package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/engine"
)

// A second `mktrain run` on a run directory another run holds is refused
// at once with exit 2, naming the holder's pid and host, before it writes
// anything there; the kernel frees the directory when the holder dies,
// even by SIGKILL.
func TestSecondRunOnRunDirIsRefused(t *testing.T) {
	dir := t.TempDir()
	holder := startNode(t, tinyArgs(dir, 100000)...)
	deadline := time.Now().Add(30 * time.Second)
	for {
		if b, _ := os.ReadFile(filepath.Join(dir, "metrics.jsonl")); bytes.Count(b, []byte("\n")) >= 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the first run logged no step within 30s:\n%s", holder.out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	recipe, err := os.ReadFile(filepath.Join(dir, "recipe.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	code, _, stderr := runCLI(t, tinyArgs(dir, 3, "train.lr=1e-2")...)
	host, _ := os.Hostname()
	if code != exitFailure {
		t.Fatalf("second run on a held run directory: exit %d, want %d\n%s", code, exitFailure, stderr)
	}
	for _, want := range []string{fmt.Sprintf("pid %d", holder.cmd.Process.Pid), "host " + host, "in use"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("refusal does not name %q:\n%s", want, stderr)
		}
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the refusal took %v", took)
	}
	if now, _ := os.ReadFile(filepath.Join(dir, "recipe.yaml")); !bytes.Equal(now, recipe) {
		t.Error("the refused run replaced the holder's recipe.yaml")
	}
	if err := holder.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-holder.done
	l, err := engine.LockRunDir(dir, 0)
	if err != nil {
		t.Fatalf("after the holder was killed: %v", err)
	}
	l.Unlock()
}

// The same refusal against another engine of this process, and for node
// K of a multi-node run against another node K on a shared directory.
func TestRunDirLockedInProcessIsRefused(t *testing.T) {
	dir := t.TempDir()
	l, err := engine.LockRunDir(dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Unlock()
	code, _, stderr := runCLI(t, tinyArgs(dir, 2)...)
	if code != exitFailure || !strings.Contains(stderr, fmt.Sprintf("pid %d", os.Getpid())) {
		t.Fatalf("run on a locked directory: exit %d\n%s", code, stderr)
	}
	if _, err := os.Stat(filepath.Join(dir, "recipe.yaml")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the refused run wrote recipe.yaml (%v)", err)
	}
}

// After a crash and a resume, metrics.jsonl holds each step once: the
// lines of the steps after the checkpoint resumed from, and a torn last
// line, are dropped before the run trains them again.
func TestResumeTruncatesMetricsJSONL(t *testing.T) {
	dir := t.TempDir()
	args := tinyArgs(dir, 4, "checkpoint.every=2", "checkpoint.keep_last=0")
	if code, _, stderr := runCLI(t, args...); code != exitOK {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	// A crash after step 4's metrics line, before its checkpoint.
	root := filepath.Join(dir, "checkpoints")
	if err := os.RemoveAll(filepath.Join(root, checkpoint.StepDirName(4))); err != nil {
		t.Fatal(err)
	}
	os.Remove(filepath.Join(root, "latest"))
	f, err := os.OpenFile(filepath.Join(dir, "metrics.jsonl"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(`{"step":5,"lo`)
	f.Close()
	if code, _, stderr := runCLI(t, args...); code != exitOK {
		t.Fatalf("resume: exit %d\n%s", code, stderr)
	}
	b, err := os.ReadFile(filepath.Join(dir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	if n := bytes.Count(b, []byte("\n")); n != 4 || !bytes.HasSuffix(b, []byte("\n")) {
		t.Errorf("metrics.jsonl has %d lines, want 4:\n%s", n, b)
	}
	got := metricLosses(t, dir)
	for step := 1; step <= 4; step++ {
		if len(got[step]) != 1 {
			t.Errorf("step %d logged %d times, want once", step, len(got[step]))
		}
	}
}

// ckpt verify fails (exit 2) on a step directory without MANIFEST.json,
// named directly or found in a run directory, instead of skipping it.
func TestCkptVerifyFailsWithoutManifest(t *testing.T) {
	dir := t.TempDir()
	if code, _, stderr := runCLI(t, tinyArgs(dir, 2, "checkpoint.every=1", "checkpoint.keep_last=0")...); code != exitOK {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	step2 := filepath.Join(dir, "checkpoints", checkpoint.StepDirName(2))
	if code, _, stderr := runCLI(t, "ckpt", "verify", dir); code != exitOK {
		t.Fatalf("verify of a sound run: exit %d\n%s", code, stderr)
	}
	if err := os.Remove(filepath.Join(step2, "MANIFEST.json")); err != nil {
		t.Fatal(err)
	}
	for _, target := range []string{dir, step2} {
		code, stdout, stderr := runCLI(t, "ckpt", "verify", target)
		if code != exitFailure || !strings.Contains(stdout, "FAIL "+step2) || !strings.Contains(stderr, "no MANIFEST.json") {
			t.Errorf("ckpt verify %s with %s lacking its manifest: exit %d\nstdout:\n%s\nstderr:\n%s", target, step2, code, stdout, stderr)
		}
		if target == dir && !strings.Contains(stdout, "OK   "+filepath.Join(dir, "checkpoints", checkpoint.StepDirName(1))) {
			t.Errorf("ckpt verify %s: the sound step 1 is not listed OK:\n%s", target, stdout)
		}
	}
	if code, _, stderr := runCLI(t, "ckpt", "inspect", step2); code != exitFailure || !strings.Contains(stderr, "no MANIFEST.json") {
		t.Errorf("ckpt inspect of a step directory without its manifest: exit %d\n%s", code, stderr)
	}
}
