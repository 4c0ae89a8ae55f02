package main

import (
	"bytes"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/plan"
)

// TestRunRefusesWhatCannotFit is issue 32's item 2: values that pass
// validation but cannot run on the CPU (they used to end in Go's
// out-of-memory crash, or a first step that never ends) are refused
// before anything large is allocated: exit 2 at once, one sentence that
// names the field, no stack trace.
func TestRunRefusesWhatCannotFit(t *testing.T) {
	cases := []struct {
		set  string
		want []string
	}{
		{"model.vocab=2000000000", []string{"host memory", "model.vocab (2000000000)"}},
		{"model.dim=1000000", []string{"host memory", "model.dim (1000000)"}},
		{"train.global_batch=1000000000", []string{"train.global_batch (1000000000)", "train.micro_batch"}},
		{"model.layers=100000000", []string{"host memory", "model.layers (100000000)"}},
	}
	for _, c := range cases {
		t.Run(c.set, func(t *testing.T) {
			// A run directory of an earlier run: the refused recipe must not
			// replace its recipe.yaml.
			runDir := t.TempDir()
			earlier := []byte("# the recipe of the run this directory holds\n")
			if err := os.WriteFile(filepath.Join(runDir, "recipe.yaml"), earlier, 0o644); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			code, _, stderr := runCLI(t, "run", "tiny", "--run-dir", runDir, "--set", "train.backend=cpu", "--set", c.set)
			if took := time.Since(start); took > 3*time.Second {
				t.Errorf("the refusal took %v", took)
			}
			if code != exitFailure {
				t.Fatalf("exit %d, want %d\n%s", code, exitFailure, stderr)
			}
			for _, w := range append(c.want, "mktrain: ") {
				if !strings.Contains(stderr, w) {
					t.Errorf("stderr does not say %q:\n%s", w, stderr)
				}
			}
			if strings.Contains(stderr, "goroutine ") || strings.Contains(stderr, "fatal error") {
				t.Errorf("a stack trace:\n%s", stderr)
			}
			if b, err := os.ReadFile(filepath.Join(runDir, "recipe.yaml")); err != nil || !bytes.Equal(b, earlier) {
				t.Errorf("the refused run replaced the run directory's recipe.yaml (%v):\n%s", err, b)
			}
		})
	}
}

// TestPlanCommand runs mktrain plan: the tiny recipe fits this machine's
// host; moe-small on a named H200 gives its terms as JSON; a batch too
// large for the H200 is refused with exit 2 naming the micro-batch; bad
// flags are usage errors.
func TestPlanCommand(t *testing.T) {
	code, stdout, stderr := runCLI(t, "plan", "tiny")
	if code != exitOK || !strings.Contains(stdout, "parameters") || !strings.Contains(stdout, "verdict") || !strings.Contains(stdout, "fits") {
		t.Errorf("plan tiny: exit %d\n%s%s", code, stdout, stderr)
	}

	code, stdout, stderr = runCLI(t, "plan", "moe-small", "--device", "h200", "--json")
	if code != exitOK {
		t.Fatalf("plan moe-small --device h200: exit %d\n%s", code, stderr)
	}
	var rep planReport
	if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
		t.Fatalf("--json: %v\n%s", err, stdout)
	}
	if !rep.Fits || rep.Plan.Params.Total != 641811456 || rep.Plan.Device.Name != "NVIDIA H200" || rep.Plan.Peak <= 0 {
		t.Errorf("moe-small on an H200: fits %v, %d parameters, device %q, peak %d", rep.Fits, rep.Plan.Params.Total, rep.Plan.Device.Name, rep.Plan.Peak)
	}

	code, stdout, stderr = runCLI(t, "plan", "moe-small", "--device", "h200", "--set", "train.micro_batch=128", "--set", "train.global_batch=128")
	if code != exitFailure || !strings.Contains(stderr, "train.micro_batch (128)") || !strings.Contains(stdout, "does not fit") {
		t.Errorf("micro_batch 128 on an H200: exit %d, want %d naming train.micro_batch\n%s%s", code, exitFailure, stdout, stderr)
	}
	// A machine of one H200 runs long-context's 4 context ranks as
	// virtual ranks of it; one of four H200s runs one rank.
	for _, c := range []struct {
		gpus        string
		deviceRanks int
	}{{"1", 4}, {"4", 1}, {"", 1}} {
		args := []string{"plan", "long-context", "--device", "h200", "--json"}
		if c.gpus != "" {
			args = append(args, "--gpus", c.gpus)
		}
		code, stdout, stderr := runCLI(t, args...)
		var rep planReport
		if code != exitOK || json.Unmarshal([]byte(stdout), &rep) != nil {
			t.Fatalf("%v: exit %d\n%s%s", args, code, stdout, stderr)
		}
		if rep.Plan.DeviceRanks != c.deviceRanks {
			t.Errorf("%v: %d ranks on a device, want %d", args, rep.Plan.DeviceRanks, c.deviceRanks)
		}
	}
	// Mode ring on a named (Hopper) GPU is the fused ring a run there
	// would take: in one pass, or in two under train.deterministic, whose
	// dk and dv partials take more memory; a GPU of --memory alone plans
	// the portable ring.
	ring := func(extra ...string) planReport {
		t.Helper()
		args := append([]string{"plan", "long-context", "--gpus", "1", "--json", "--set", "parallel.cp_attention=ring"}, extra...)
		code, stdout, stderr := runCLI(t, args...)
		var rep planReport
		if code != exitOK || json.Unmarshal([]byte(stdout), &rep) != nil {
			t.Fatalf("%v: exit %d\n%s%s", args, code, stdout, stderr)
		}
		return rep
	}
	onePass, twoPass := ring("--device", "h200"), ring("--device", "h200", "--set", "train.deterministic=true")
	portable := ring("--memory", "139GiB")
	if c := onePass.Plan.Config; !c.CPRingFused || !c.CPRingOnePass {
		t.Errorf("long-context's ring on one H200: fused %v, one pass %v; want both", c.CPRingFused, c.CPRingOnePass)
	}
	if c := twoPass.Plan.Config; !c.CPRingFused || c.CPRingOnePass {
		t.Errorf("long-context's ring on one H200, deterministic: fused %v, one pass %v; want two passes", c.CPRingFused, c.CPRingOnePass)
	}
	if c := portable.Plan.Config; c.CPRingFused {
		t.Errorf("long-context's ring on a GPU of --memory alone: fused; want the portable ring")
	}
	if onePass.Plan.Peak >= twoPass.Plan.Peak {
		t.Errorf("long-context's ring on one H200: one pass %d bytes, two passes %d; want less in one pass", onePass.Plan.Peak, twoPass.Plan.Peak)
	}
	for _, args := range [][]string{
		{"plan", "tiny", "--memory", "lots"},
		{"plan", "tiny", "--device", "tpu"},
		{"plan", "tiny", "--gpus", "2"},
		{"plan", "tiny", "--device", "cpu", "--gpus", "2"},
		{"plan", "moe-small", "--device", "h200", "--gpus", "-1"},
		{"plan"},
	} {
		if code, _, stderr := runCLI(t, args...); code != exitFailure {
			t.Errorf("%v: exit %d, want %d\n%s", args, code, exitFailure, stderr)
		}
	}
	code, stdout, _ = runCLI(t, "plan", "tiny", "--memory", "1MiB")
	if code != exitFailure || !strings.Contains(stdout, "does not fit") {
		t.Errorf("tiny in 1 MiB: exit %d, want %d\n%s", code, exitFailure, stdout)
	}
}

// TestPlanAgainstMeasuredPeaks holds the plan to the peaks bench train
// measured on the H200 and the H100 (bench/results/{h200,h100}/train-*.json,
// each with its recipe and the dispatcher it settled on, planned for the
// device it ran on). The bar of issue 28 is the
// plan within 10% of the peak at the measured commit: bench train wrote
// that commit's plan beside the peak (plan_peak_memory_bytes), which must
// agree. The current plan of the same recipe is compared too: memory
// saved since the measurement (buffers made smaller, not yet measured)
// moves it below the old peak, which the log shows; beyond
// planDriftBound the plan would have lost a buffer the CUDA path still
// allocates, or counted one twice.
func TestPlanAgainstMeasuredPeaks(t *testing.T) {
	for _, machine := range []string{"h200", "h100"} {
		paths, _ := filepath.Glob(filepath.Join("..", "..", "bench", "results", machine, "train-*.json"))
		if len(paths) == 0 {
			t.Fatalf("no bench/results/%s/train-*.json to compare with", machine)
		}
		device, err := plan.NamedDevice(machine)
		if err != nil {
			t.Fatal(err)
		}
		for _, path := range paths {
			checkPlanAgainstPeak(t, path, device)
		}
	}
}

// checkPlanAgainstPeak is TestPlanAgainstMeasuredPeaks for the result at
// path, measured on device.
func checkPlanAgainstPeak(t *testing.T, path string, device plan.Device) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var res struct {
		Commit  string        `json:"commit"`
		Config  engine.Config `json:"config"`
		Figures struct {
			Peak       int64  `json:"peak_memory_bytes"`
			PlanPeak   int64  `json:"plan_peak_memory_bytes"`
			FineAbove  int64  `json:"allocator_fine_classes_above"`
			Dispatcher string `json:"moe_dispatcher"`
			Ranks      int    `json:"ranks"`
		} `json:"figures"`
	}
	if err := json.Unmarshal(raw, &res); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	cfg := res.Config
	cfg.Model.MoE.Dispatcher = res.Figures.Dispatcher
	// bench train runs every rank on the one GPU, as virtual ranks;
	// mode ring there is the fused ring (the measured recipes' head
	// dims and chunks are ones its kernels take).
	ranks := max(1, res.Figures.Ranks)
	pc := engine.PlanConfig(cfg, ranks, ranks, false)
	pc.CPRingFused = cfg.Parallel.CP > 1 && cfg.Parallel.CPAttention == plan.CPRing
	// The allocator's size classes when the peak was measured: those
	// without the field predate the finer classes above 1 GiB.
	dev := device
	dev.FineClassesAbove = res.Figures.FineAbove
	p, err := plan.New(pc, dev)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	if res.Figures.PlanPeak <= 0 {
		t.Errorf("%s: no plan_peak_memory_bytes: the measured commit's plan is not recorded", path)
	} else if at := float64(res.Figures.PlanPeak)/float64(res.Figures.Peak) - 1; math.Abs(at) > 0.10 {
		t.Errorf("%s: at %.8s the plan's peak %d was %+.1f%% off the measured %d", path, res.Commit, res.Figures.PlanPeak, 100*at, res.Figures.Peak)
	}
	off := float64(p.Peak)/float64(res.Figures.Peak) - 1
	t.Logf("%s (%.8s): measured %s; that commit's plan %s; this one's %s (%+.2f%%)", filepath.Join(filepath.Base(filepath.Dir(path)), filepath.Base(path)), res.Commit,
		plan.FormatBytes(res.Figures.Peak), plan.FormatBytes(res.Figures.PlanPeak), plan.FormatBytes(p.Peak), 100*off)
	if math.Abs(off) > planDriftBound {
		t.Errorf("%s: this commit's plan %d is %+.1f%% off the peak measured at %.8s, %d: more than the memory saved since explains; measure again (scripts/gpu-test.sh) or find the lost buffer",
			path, p.Peak, 100*off, res.Commit, res.Figures.Peak)
	}
}

// planDriftBound is how far below (or above) a peak measured at an older
// commit this commit's plan may be: the savings made since fdd8c22, not
// yet measured (bf16 q, k, v and expert outputs, the norms writing the
// stream), take the long-context recipe's plan 11% under its peak.
const planDriftBound = 0.20
