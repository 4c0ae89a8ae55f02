package main

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/profile"
	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/recipes"
)

// readBench runs bench train on the quick tiny recipe and returns its
// stdout and the JSON figures it wrote.
func readBench(t *testing.T, extra ...string) (string, map[string]any) {
	t.Helper()
	dir := t.TempDir()
	args := append([]string{"bench", "train", "tiny", "--steps", "2", "--warmup", "1", "--out", dir}, quick...)
	code, stdout, stderr := runCLI(t, append(args, extra...)...)
	if code != exitOK {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	var res struct {
		Figures map[string]any `json:"figures"`
	}
	readResult(t, dir, "train-tiny.json", &res)
	return stdout, res.Figures
}

// readResult decodes the one benchmark result in dir whose name matches
// pattern into v, and fails if the folder holds any other file.
func readResult(t *testing.T, dir, pattern string, v any) {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, pattern))
	if err != nil || len(files) != 1 {
		t.Fatalf("result files %v (%v)", files, err)
	}
	if all, err := os.ReadDir(dir); err != nil || len(all) != 1 {
		t.Fatalf("%s holds %d entries (%v), want only %s", dir, len(all), err, pattern)
	}
	buf, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(buf, v); err != nil {
		t.Fatal(err)
	}
}

func TestBenchTrainProfile(t *testing.T) {
	stdout, fig := readBench(t)
	if fig["measured_steps"] != 2.0 {
		t.Errorf("measured_steps %v, want 2", fig["measured_steps"])
	}
	if v, ok := fig["mfu"]; !ok || v != nil {
		t.Errorf("mfu on the CPU is %v (present %v), want null", v, ok)
	}
	// auto settles to unfused on the CPU, where both run the same ops.
	if fig["moe_dispatcher"] != "unfused" || !strings.Contains(stdout, "unfused") {
		t.Errorf("moe_dispatcher %v, want unfused in the figures and the table:\n%s", fig["moe_dispatcher"], stdout)
	}
	if v, _ := fig["peak_memory_bytes"].(float64); v <= 0 {
		t.Errorf("peak_memory_bytes %v", fig["peak_memory_bytes"])
	}
	wall, _ := fig["profiled_step_ms"].(float64)
	if wall <= 0 {
		t.Fatalf("profiled_step_ms %v", fig["profiled_step_ms"])
	}
	rows, _ := fig["breakdown"].([]any)
	shares, ms := 0.0, 0.0
	kinds := map[string]bool{}
	for _, r := range rows {
		row := r.(map[string]any)
		kind, _ := row["kind"].(string)
		share, _ := row["share"].(float64)
		rowMS, _ := row["ms"].(float64)
		ops, _ := row["ops"].(float64)
		if share < 0 || rowMS < 0 || (kind != profile.KindHostGaps && ops < 1) {
			t.Errorf("breakdown row %v", row)
		}
		if kinds[kind] {
			t.Errorf("kind %q listed twice", kind)
		}
		kinds[kind] = true
		shares += share
		ms += rowMS
	}
	if math.Abs(shares-1) > 1e-9 {
		t.Errorf("shares add up to %v:\n%s", shares, stdout)
	}
	hostShare := 0.0
	for _, r := range rows {
		row := r.(map[string]any)
		if k := row["kind"]; k == profile.KindHostGaps || k == profile.KindTransfers {
			hostShare += row["share"].(float64)
		}
	}
	if got, _ := fig["host_share"].(float64); math.Abs(got-hostShare) > 1e-12 || !strings.Contains(stdout, "host gaps and host transfers:") {
		t.Errorf("host_share %v, the breakdown's host gaps and transfers %v; table:\n%s", fig["host_share"], hostShare, stdout)
	}
	// The kinds cover the whole step: their sum is the profiled step's
	// wall time, or the op time when that is larger.
	if ms < wall*(1-1e-9) {
		t.Errorf("breakdown sums to %.3f ms, the profiled step took %.3f ms", ms, wall)
	}
	for _, k := range []string{profile.KindAttention, profile.KindExpertGEMM, profile.KindDenseGEMM, profile.KindDispatch,
		profile.KindRouter, profile.KindElementwise, profile.KindLoss, profile.KindOptimizer, profile.KindTransfers, profile.KindHostGaps} {
		if !kinds[k] {
			t.Errorf("breakdown lacks %q: %v", k, rows)
		}
		if !strings.Contains(stdout, k) {
			t.Errorf("the printed table lacks %q:\n%s", k, stdout)
		}
	}
	if !strings.Contains(stdout, "where the time goes") {
		t.Errorf("no breakdown table:\n%s", stdout)
	}
}

func TestBenchTrainWithoutProfile(t *testing.T) {
	stdout, fig := readBench(t, "--profile=false", "--set", "model.moe.dispatcher=fused", "--set", "train.recompute=selective")
	if fig["moe_dispatcher"] != "fused" {
		t.Errorf("moe_dispatcher %v, want fused as the recipe says", fig["moe_dispatcher"])
	}
	if fig["recompute"] != "selective" {
		t.Errorf("recompute %v, want selective as --set says", fig["recompute"])
	}
	if _, ok := fig["breakdown"]; ok || strings.Contains(stdout, "where the time goes") {
		t.Errorf("--profile=false still profiled:\n%s", stdout)
	}
	if fig["measured_steps"] != 2.0 || fig["flops_per_token"] == nil {
		t.Errorf("figures %v", fig)
	}
}

// TestBenchTrainTrace: --trace writes the profiled step as a Chrome trace
// whose op events are the step's ops, in order and not overlapping; and
// --trace without the profiled step is refused.
func TestBenchTrainTrace(t *testing.T) {
	path := filepath.Join(t.TempDir(), "step.json")
	stdout, _ := readBench(t, "--trace", path)
	if !strings.Contains(stdout, "wrote "+path) {
		t.Errorf("stdout does not name the trace:\n%s", stdout)
	}
	buf, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var trace struct {
		TraceEvents []struct {
			Name, Cat, Ph string
			Ts, Dur       float64
			Tid           int
		}
	}
	if err := json.Unmarshal(buf, &trace); err != nil {
		t.Fatal(err)
	}
	ops, end, seen := 0, 0.0, map[string]bool{}
	for _, e := range trace.TraceEvents {
		if e.Ph != "X" || e.Tid != 3 { // the ops track
			continue
		}
		if e.Ts < end-1e-3 || e.Dur < 0 {
			t.Fatalf("op %s at %.3f us (%.3f us) overlaps the one before, ending at %.3f", e.Name, e.Ts, e.Dur, end)
		}
		end = e.Ts + e.Dur
		ops++
		seen[e.Name], seen[e.Cat] = true, true
	}
	for _, want := range []string{"MatMul", "AttentionForward", "AdamWUpdate", profile.KindExpertGEMM, profile.KindAttention} {
		if !seen[want] {
			t.Errorf("the trace has no %s", want)
		}
	}
	if ops < 50 {
		t.Errorf("%d ops in the trace of a step", ops)
	}
	args := append([]string{"bench", "train", "tiny", "--profile=false", "--trace", path, "--out", t.TempDir()}, quick...)
	if code, _, stderr := runCLI(t, args...); code != exitFailure || !strings.Contains(stderr, "--trace needs the profiled step") {
		t.Errorf("--trace with --profile=false: exit %d\n%s", code, stderr)
	}
}

// TestModelFLOPsPerToken checks the count on the tiny recipe, worked out
// by hand: 254784 parameters, of which 140096 active (less 2 layers x 2
// unvisited experts x 3*64*128, less the 256 x 64 embedding), so
// 6*140096 + 6*2*64*16 at seq 16.
func TestModelFLOPsPerToken(t *testing.T) {
	cfg, _, err := recipes.Load("tiny", nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := engine.ModelFLOPsPerToken(cfg.Model, 16), 6.0*140096+6*2*64*16; got != want {
		t.Errorf("engine.ModelFLOPsPerToken = %v, want %v", got, want)
	}
}

// TestBenchDefaultOutput runs bench train twice without --out from a
// fresh folder: both runs write bench/results/cpu/train-tiny.json, the
// second over the first, and nothing else.
func TestBenchDefaultOutput(t *testing.T) {
	t.Chdir(t.TempDir())
	for _, steps := range []string{"2", "1"} {
		args := append([]string{"bench", "train", "tiny", "--steps", steps, "--warmup", "0", "--profile=false"}, quick...)
		code, stdout, stderr := runCLI(t, args...)
		if code != exitOK {
			t.Fatalf("exit %d\n%s", code, stderr)
		}
		want := filepath.Join("bench", "results", "cpu", "train-tiny.json")
		if !strings.Contains(stdout, "wrote "+want+"\n") {
			t.Errorf("stdout does not name %s:\n%s", want, stdout)
		}
	}
	var res struct {
		Benchmark string `json:"benchmark"`
		Commit    string `json:"commit"`
		Command   string `json:"command"`
		Machine   struct {
			Backend string `json:"backend"`
			Device  string `json:"device"`
		} `json:"machine"`
		Figures map[string]any `json:"figures"`
	}
	readResult(t, filepath.Join("bench", "results", "cpu"), "train-tiny.json", &res)
	if res.Figures["measured_steps"] != 1.0 || !strings.Contains(res.Command, "--steps 1") {
		t.Errorf("the file is not the second run's: measured_steps %v, command %q", res.Figures["measured_steps"], res.Command)
	}
	if res.Benchmark != "train" || res.Commit == "" || res.Machine.Backend != "cpu" || res.Machine.Device != "" {
		t.Errorf("benchmark %q, commit %q, machine %+v", res.Benchmark, res.Commit, res.Machine)
	}
	if entries, err := os.ReadDir(filepath.Join("bench", "results")); err != nil || len(entries) != 1 {
		t.Errorf("bench/results holds %d entries (%v), want only cpu/", len(entries), err)
	}
}

// deviceBackend is a backend that names its device, as the CUDA backend
// does.
type deviceBackend struct {
	backend.Backend
	device string
}

func (d deviceBackend) Name() string       { return "cuda" }
func (d deviceBackend) DeviceName() string { return d.device }

func TestMachineKind(t *testing.T) {
	cpuB := cpu.New(backend.Float32)
	for _, c := range []struct {
		b          backend.Backend
		kind, name string
	}{
		{nil, "cpu", ""},
		{cpuB, "cpu", ""},
		{deviceBackend{cpuB, "NVIDIA H200"}, "h200", "NVIDIA H200"},
		{deviceBackend{cpuB, "NVIDIA H100 80GB HBM3"}, "h100-80gb-hbm3", "NVIDIA H100 80GB HBM3"},
		{deviceBackend{cpuB, "  NVIDIA GeForce RTX 4090 "}, "geforce-rtx-4090", "  NVIDIA GeForce RTX 4090 "},
		{deviceBackend{cpuB, "???"}, "cuda", "???"},
		{deviceBackend{cpuB, ""}, "cuda", ""},
		// The profiler wraps the engine's backend: the device is looked
		// for through Inner.
		{profile.New(deviceBackend{cpuB, "NVIDIA H200"}, profile.WallClock()).Backend(), "h200", "NVIDIA H200"},
	} {
		if got := machineKind(c.b); got != c.kind {
			t.Errorf("machineKind(%v) = %q, want %q", c.b, got, c.kind)
		}
		if got := engine.DeviceName(c.b); got != c.name {
			t.Errorf("engine.DeviceName(%v) = %q, want %q", c.b, got, c.name)
		}
	}
}
