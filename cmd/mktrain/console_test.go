package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/mktrain/mktrain/engine"
)

// TestConsoleBannerBarAndWarnings drives the terminal view by hand: the
// banner names the backend (with why it was chosen), the run directory,
// the parameters and the resume point; the bar starts at the resume step
// and shows the step's figures; a warning that arrives while the bar is up
// is printed on its own line, and the bar is drawn again after it.
func TestConsoleBannerBarAndWarnings(t *testing.T) {
	cfg := engine.DefaultConfig()
	cfg.Log.Progress = "on"
	var out bytes.Buffer
	c := newRunConsole(cfg, &out, "tiny")
	if !c.useBar || len(c.options()) != 2 {
		t.Fatal("log.progress on: no bar")
	}
	c.addSink("metrics.jsonl: runs/tiny/metrics.jsonl")
	fmt.Fprintln(c, "WRN before the banner")
	c.start(engine.StartEvent{Backend: "cpu", Device: "CPU, 2 cores", Ranks: 1, Params: 254784, Steps: 300,
		StartStep: 100, Checkpoint: "runs/tiny/checkpoints/step_00000100", RunDir: "runs/tiny", Dispatcher: "unfused",
		BackendNotes: []string{"backend auto: no GPU, training on the CPU"}})
	c.step(engine.StepEvent{Step: 101, Steps: 300, Loss: 1.2345, ValLoss: 1.5, ValBatches: 4, TokensPerSec: 9876,
		PeakMemory: 3 << 20, ETA: 95 * time.Second})
	fmt.Fprintln(c, "WRN cannot prune old checkpoints")
	c.step(engine.StepEvent{Step: 102, Steps: 300, Loss: 1.2, ValLoss: math.NaN(), TokensPerSec: 9000, PeakMemory: 3 << 20})
	c.finish()
	fmt.Fprintln(c, "after the bar")
	s := out.String()

	banner := []string{"WRN before the banner", "run tiny", "cpu (CPU, 2 cores), 1 rank", "backend auto: no GPU, training on the CPU",
		"run dir   runs/tiny", "255K parameters", "from step 100 (runs/tiny/checkpoints/step_00000100)",
		"metrics.jsonl: runs/tiny/metrics.jsonl"}
	last := -1
	for _, want := range banner {
		i := strings.Index(s, want)
		if i < last {
			t.Errorf("banner: %q missing or out of order in\n%s", want, s)
		}
		last = i
	}
	bar := strings.Index(s, "(101/300)")
	if bar < last || !strings.Contains(s, "loss 1.2345 (val 1.5000, 4 batches)  9876 tok/s  3.0 MiB  ETA 1m35s") {
		t.Errorf("the bar after the banner lacks step 101's figures:\n%q", s)
	}
	warn := strings.Index(s, "WRN cannot prune old checkpoints\n")
	if warn < bar || !strings.Contains(s[warn:], "(101/300)") || !strings.Contains(s[warn:], "(102/300)") {
		t.Errorf("the warning is not above a redrawn bar:\n%q", s)
	}
	// The line before the warning is cleared (\r), not left mid-bar.
	if !strings.Contains(s[:warn], "\r") {
		t.Errorf("the bar is not cleared before the warning:\n%q", s)
	}
	if !strings.HasSuffix(s, "\nafter the bar\n") {
		t.Errorf("output after the bar does not start on a line of its own:\n%q", s)
	}
}

// TestRunStepLinesWithoutTerminal: without a terminal each logged step is
// one line, "step n/N" first, then loss, lr, tokens/s, MFU, memory and ETA
// in that order.
func TestRunStepLinesWithoutTerminal(t *testing.T) {
	code, _, stderr := runCLI(t, append([]string{"run", "tiny", "--run-dir", t.TempDir()}, quick...)...)
	if code != exitOK {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	line := regexp.MustCompile(`(?m)^\S+ INF step 2/2 loss=\S+ val_loss=\S+ val_batches=1 lr=\S+ grad_norm=\S+ tokens_per_s=\d+ mfu=- memory="[\d.]+ [KMG]iB" eta=\S+$`)
	if !line.MatchString(stderr) {
		t.Errorf("no step line of the expected form in:\n%s", stderr)
	}
}

// TestRunServesMetrics: during a run with --metrics-addr 127.0.0.1:0 the
// printed address answers /metrics with mktrain's metrics and
// /debug/pprof/ with the profiles.
func TestRunServesMetrics(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stderr := &lockedBuffer{}
	args := append([]string{"--run-dir", t.TempDir(), "--metrics-addr", "127.0.0.1:0", "tiny"}, quick...)
	args = append(args, "--set", "train.steps=100000", "--set", "log.every=0") // runs until cancelled
	done := make(chan error, 1)
	go func() { done <- cmdRun(ctx, args, io.Discard, stderr) }()

	addr := regexp.MustCompile(`metrics at (http://127\.0\.0\.1:\d+)/metrics`)
	var base string
	deadline := time.Now().Add(time.Minute)
	for base == "" {
		if m := addr.FindStringSubmatch(stderr.String()); m != nil {
			base = m[1]
			break
		}
		select {
		case err := <-done:
			t.Fatalf("the run ended (%v) before printing the metrics address:\n%s", err, stderr)
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("no metrics address after a minute:\n%s", stderr)
		}
	}
	get := func(path string) string {
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %s", path, resp.Status)
		}
		return string(b)
	}
	// Poll until a step has been reported.
	var metrics string
	for !regexp.MustCompile(`(?m)^mktrain_step [1-9]`).MatchString(metrics) {
		if time.Now().After(deadline) {
			t.Fatalf("/metrics shows no step after a minute:\n%s", metrics)
		}
		time.Sleep(20 * time.Millisecond)
		metrics = get("/metrics")
	}
	for _, want := range []string{"\nmktrain_loss ", "\nmktrain_tokens_per_second ", "\nmktrain_peak_memory_bytes ",
		"\nmktrain_steps 100000", `mktrain_expert_load_ratio{expert="0",layer="0"}`, `mktrain_info{backend="cpu"`} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %q:\n%s", want, metrics)
		}
	}
	if !strings.Contains(get("/debug/pprof/"), "heap") {
		t.Error("/debug/pprof/ does not list the heap profile")
	}
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, errInterrupted) {
			t.Errorf("cancelled run: %v, want it stopped", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the run did not stop within a minute of its cancellation")
	}
	if _, err := http.Get(base + "/metrics"); err == nil {
		t.Error("the metrics server still answers after the run")
	}
}

// TestMetricsAddrBadAddress: an address that cannot be listened on is a
// usage error naming the flag.
func TestMetricsAddrBadAddress(t *testing.T) {
	code, _, stderr := runCLI(t, append([]string{"run", "tiny", "--run-dir", t.TempDir(), "--metrics-addr", "no-port"}, quick...)...)
	if code != exitFailure || !strings.Contains(stderr, "--metrics-addr no-port") {
		t.Errorf("exit %d, stderr:\n%s", code, stderr)
	}
}
