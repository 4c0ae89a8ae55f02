package engine

// The MoE dispatcher (model.moe.dispatcher) from the engine's side: the
// fused and unfused dispatchers train the same model, auto is settled once
// per run, and a changed dispatcher does not stop a resume.

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

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
	"github.com/mktrain/mktrain/tune"
)

// dispatchLayouts are the virtual-rank layouts the fused dispatcher is
// compared on, with the micro-batch that keeps the tiny recipe's global
// batch of 16 in one micro-batch per rank.
var dispatchLayouts = []struct{ dp, ep, micro int }{{1, 2, 8}, {2, 2, 4}}

// fusedVsUnfusedTol bounds the relative difference of the two
// dispatchers' losses on the float32 CPU: they compute the same rows in
// the same order, so only the order of a few sums may differ.
const fusedVsUnfusedTol = 1e-5

// TestDispatchersTrainAlike trains 20 steps of the tiny recipe with each
// dispatcher on ep=2 and dp=2 x ep=2 virtual ranks of the CPU and wants
// the same losses.
func TestDispatchersTrainAlike(t *testing.T) {
	const steps = 20
	for _, l := range dispatchLayouts {
		cfg := tinyRecipeConfig()
		cfg.Train.Backend = "cpu"
		cfg.Parallel.DP, cfg.Parallel.EP, cfg.Train.MicroBatch = l.dp, l.ep, l.micro
		cfg.Model.MoE.Dispatcher = moe.DispatcherUnfused
		want, _ := runSteps(t, cfg, cpu.New(backend.Float32), steps)
		cfg.Model.MoE.Dispatcher = moe.DispatcherFused
		got, _ := runSteps(t, cfg, cpu.New(backend.Float32), steps)
		worst := 0.0
		for i := range want {
			rel := math.Abs(got[i]-want[i]) / math.Abs(want[i])
			worst = max(worst, rel)
			if !(rel <= fusedVsUnfusedTol) {
				t.Errorf("dp%d ep%d: step %d: loss %.7f fused, %.7f unfused: relative difference %.3g > %g",
					l.dp, l.ep, i+1, got[i], want[i], rel, fusedVsUnfusedTol)
			}
		}
		if want[steps-1] >= want[0] {
			t.Errorf("dp%d ep%d: the loss did not fall: %.4f -> %.4f", l.dp, l.ep, want[0], want[steps-1])
		}
		t.Logf("dp%d ep%d: worst relative loss difference fused vs unfused %.3g", l.dp, l.ep, worst)
	}
}

// noPeers hides the in-process group's peer access, as the groups across
// processes lack it.
type noPeers struct{ comm.Group }

// resolveOn resolves cfg's dispatcher for a dp=1 x ep layout on b, the
// expert groups with or without peer access, and returns the value and
// the log.
func resolveOn(t *testing.T, cfg Config, b backend.Backend, peers bool) (string, string, error) {
	t.Helper()
	var logBuf bytes.Buffer
	eng, err := New(cfg, WithBackend(b), WithLogger(zerolog.New(zerolog.SyncWriter(&logBuf))))
	if err != nil {
		t.Fatal(err)
	}
	world, err := comm.NewLocal(cfg.mesh(), b)
	if err != nil {
		t.Fatal(err)
	}
	if !peers {
		for _, r := range world {
			r.Expert = noPeers{r.Expert}
		}
	}
	got, err := eng.resolveDispatcher(cfg, world)
	if err == nil && got.Model.MoE.Dispatcher != moe.DispatcherFused && got.Model.MoE.Dispatcher != moe.DispatcherUnfused {
		t.Errorf("resolved to %q", got.Model.MoE.Dispatcher)
	}
	if eng.Config().Model.MoE.Dispatcher != cfg.Model.MoE.Dispatcher {
		t.Errorf("the engine's configuration changed: %q", eng.Config().Model.MoE.Dispatcher)
	}
	return got.Model.MoE.Dispatcher, logBuf.String(), err
}

// TestAutoDispatcher: auto is unfused on the CPU without a measurement,
// unfused where the expert group has no peer access, and measured once
// then read from the table on another backend; explicit values pass, and
// fused without peer access is refused.
func TestAutoDispatcher(t *testing.T) {
	cache := t.TempDir()
	t.Setenv("MKTRAIN_CACHE_DIR", cache)
	table := filepath.Join(cache, "dispatch.json")
	cfg := equivalenceConfig()
	cfg.Parallel.EP, cfg.Train.MicroBatch = 2, 4
	cfg.Model.MoE.Dispatcher = moe.DispatcherAuto

	got, log, err := resolveOn(t, cfg, cpu.New(backend.Float32), true)
	if err != nil || got != moe.DispatcherUnfused || !strings.Contains(log, "unmeasured") {
		t.Errorf("auto on the CPU: %q, %v; log:\n%s", got, err, log)
	}
	if _, err := os.Stat(table); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("auto on the CPU touched the table: %v", err)
	}
	got, log, err = resolveOn(t, cfg, otherBackend{cpu.New(backend.Float32)}, false)
	if err != nil || got != moe.DispatcherUnfused || !strings.Contains(log, "no peer access") {
		t.Errorf("auto without peer access: %q, %v; log:\n%s", got, err, log)
	}

	// Another backend: the first resolution measures and stores, the
	// second reads the table.
	measured, log, err := resolveOn(t, cfg, otherBackend{cpu.New(backend.Float32)}, true)
	if err != nil || !strings.Contains(log, "measured") || !strings.Contains(log, table) {
		t.Fatalf("auto on another backend: %q, %v; log:\n%s", measured, err, log)
	}
	key := tune.NewDispatchKey(otherBackend{}, cfg.Model.MoE, cfg.Model.Dim, cfg.Train.MicroBatch*cfg.Train.Seq, 2)
	e, ok, err := tune.DispatchCache{Path: table}.Lookup(key)
	if err != nil || !ok || e.Choice != measured {
		t.Fatalf("table entry for %v: %+v, %v, %v; want the choice %q", key, e, ok, err, measured)
	}
	cached, log, err := resolveOn(t, cfg, otherBackend{cpu.New(backend.Float32)}, true)
	if err != nil || cached != measured || !strings.Contains(log, "from the table") || strings.Contains(log, "measuring") {
		t.Errorf("auto again: %q (measured %q), %v; log:\n%s", cached, measured, err, log)
	}

	for _, d := range []string{moe.DispatcherFused, moe.DispatcherUnfused} {
		cfg.Model.MoE.Dispatcher = d
		if got, _, err := resolveOn(t, cfg, cpu.New(backend.Float32), true); err != nil || got != d {
			t.Errorf("%s: %q, %v", d, got, err)
		}
	}
	cfg.Model.MoE.Dispatcher = moe.DispatcherFused
	_, _, err = resolveOn(t, cfg, cpu.New(backend.Float32), false)
	if err == nil || !strings.Contains(err.Error(), "peer access") {
		t.Errorf("fused without peer access: %v", err)
	}
	// A run on virtual ranks takes fused.
	cfg.Train.Steps = 3
	eng, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Run(context.Background()); err != nil {
		t.Errorf("fused on virtual ranks: %v", err)
	}
}

// TestResumeAcrossDispatchers: the dispatcher is not part of the model, so
// a run resumes under another one, with the change logged.
func TestResumeAcrossDispatchers(t *testing.T) {
	cfg := checkpointConfig()
	cfg.Parallel.EP = 2
	cfg.Train.MicroBatch = 2
	cfg.Model.MoE.Dispatcher = moe.DispatcherUnfused
	dir := t.TempDir()
	runLosses(t, cfg, dir, 3)
	cfg.Model.MoE.Dispatcher = moe.DispatcherFused
	losses, log := runLosses(t, cfg, dir, 0)
	if !strings.Contains(log, "model.moe.dispatcher: unfused -> fused") || len(losses) != cfg.Train.Steps-3 {
		t.Errorf("resumed %d steps (want %d); log:\n%s", len(losses), cfg.Train.Steps-3, log)
	}
}
