package prom_test

import (
	"context"
	"io"
	"math"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/observe/prom"
)

// TestCollectorReportsTheLatestEvents feeds a collector events by hand and
// reads its metrics in the text format.
func TestCollectorReportsTheLatestEvents(t *testing.T) {
	c := prom.NewCollector()
	if n := testutil.CollectAndCount(c); n != 1 { // only the save counter before a run
		t.Errorf("before a run: %d metrics, want 1", n)
	}
	c.ObserveStart(engine.StartEvent{Backend: "cpu", Device: "CPU, 2 cores", Dispatcher: "unfused", Steps: 10, StartStep: 4, Params: 1000})
	c.ObserveStep(engine.StepEvent{Step: 5, Steps: 10, Loss: 2.5, LR: 1e-3, GradNorm: 0.5, Tokens: 640, TokensPerSec: 1234,
		ValLoss: 2.25, ValBatches: 4, PeakMemory: 1 << 20, ETA: 3 * time.Second,
		Experts: []engine.ExpertLoad{{Layer: 0, Fraction: []float64{0.75, 0.25}, MaxOverMean: 1.5, Dropped: 2}}})
	c.ObserveStep(engine.StepEvent{Step: 6, Steps: 10, Loss: 2.4, ValLoss: math.NaN(), PeakMemory: 1 << 20,
		Experts: []engine.ExpertLoad{{Layer: 0, Fraction: []float64{0.5, 0.5}, MaxOverMean: 1}}})
	c.ObserveSave(engine.SaveEvent{Step: 6, Bytes: 4096, Duration: 1500 * time.Millisecond})

	want := `
# HELP mktrain_step The last finished optimizer step.
# TYPE mktrain_step gauge
mktrain_step 6
# HELP mktrain_loss Training cross-entropy of the last step (nats per token).
# TYPE mktrain_loss gauge
mktrain_loss 2.4
# HELP mktrain_val_loss The last validation loss (nats per token).
# TYPE mktrain_val_loss gauge
mktrain_val_loss 2.25
# HELP mktrain_val_batches Micro-batches the last validation loss averages.
# TYPE mktrain_val_batches gauge
mktrain_val_batches 4
# HELP mktrain_expert_load_ratio Expert's share of its layer's token assignments in the last step.
# TYPE mktrain_expert_load_ratio gauge
mktrain_expert_load_ratio{expert="0",layer="0"} 0.5
mktrain_expert_load_ratio{expert="1",layer="0"} 0.5
# HELP mktrain_checkpoints_saved_total Checkpoints saved by this process.
# TYPE mktrain_checkpoints_saved_total counter
mktrain_checkpoints_saved_total 1
# HELP mktrain_checkpoint_save_seconds Time the last checkpoint took to write and commit.
# TYPE mktrain_checkpoint_save_seconds gauge
mktrain_checkpoint_save_seconds 1.5
# HELP mktrain_checkpoint_bytes Size of the last checkpoint's files.
# TYPE mktrain_checkpoint_bytes gauge
mktrain_checkpoint_bytes 4096
# HELP mktrain_info The run's backend, device and MoE dispatcher (always 1).
# TYPE mktrain_info gauge
mktrain_info{backend="cpu",device="CPU, 2 cores",dispatcher="unfused"} 1
# HELP mktrain_start_step The step the run resumed from (0 for a fresh start).
# TYPE mktrain_start_step gauge
mktrain_start_step 4
`
	names := []string{"mktrain_step", "mktrain_loss", "mktrain_val_loss", "mktrain_val_batches", "mktrain_expert_load_ratio",
		"mktrain_checkpoints_saved_total", "mktrain_checkpoint_save_seconds", "mktrain_checkpoint_bytes", "mktrain_info", "mktrain_start_step"}
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), names...); err != nil {
		t.Error(err)
	}
	if n := testutil.CollectAndCount(c, "mktrain_mfu_ratio"); n != 0 {
		t.Errorf("mktrain_mfu_ratio reported on the CPU (%d series)", n)
	}
}

// TestServeMuxDuringARun trains the tiny model with the collector's
// options and scrapes /metrics and /debug/pprof/ through NewServeMux from
// a step hook, while the run is in progress.
func TestServeMuxDuringARun(t *testing.T) {
	c := prom.NewCollector()
	reg, err := prom.NewRegistry(c)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(prom.NewServeMux(reg))
	defer srv.Close()
	get := func(path string) string {
		resp, err := srv.Client().Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 {
			t.Fatalf("GET %s: %s\n%s", path, resp.Status, b)
		}
		return string(b)
	}

	cfg := engine.DefaultConfig()
	cfg.Train.Steps, cfg.Train.Seq, cfg.Train.GlobalBatch, cfg.Train.MicroBatch = 3, 16, 2, 2
	cfg.Train.WarmupSteps, cfg.Train.Backend = 1, "cpu"
	var scraped string
	opts := append(c.Options(), engine.WithRunDir(t.TempDir()), engine.WithHook(func(ev engine.StepEvent) {
		if ev.Step == 2 { // after the collector's hook, which comes first
			scraped = get("/metrics")
		}
	}))
	eng, err := engine.New(cfg, opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	if _, err := eng.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, line := range []string{"mktrain_step 2", "mktrain_steps 3", `mktrain_info{backend="cpu"`, "mktrain_tokens_per_second ",
		"mktrain_peak_memory_bytes ", `mktrain_expert_load_ratio{expert="3",layer="1"} `, "go_goroutines "} {
		if !strings.Contains(scraped, "\n"+line) {
			t.Errorf("/metrics during step 2 lacks %q:\n%s", line, scraped)
		}
	}
	if after := get("/metrics"); !strings.Contains(after, "\nmktrain_checkpoint_step 3") || !strings.Contains(after, "\nmktrain_checkpoints_saved_total 1") {
		t.Errorf("/metrics after the run lacks the checkpoint of step 3:\n%s", after)
	}
	if index := get("/debug/pprof/"); !strings.Contains(index, "goroutine") {
		t.Errorf("/debug/pprof/ does not list the profiles:\n%s", index)
	}
}
