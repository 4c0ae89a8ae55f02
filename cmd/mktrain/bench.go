package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/all"
	"github.com/mktrain/mktrain/backend/profile"
	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/internal/atomicfile"
	"github.com/mktrain/mktrain/plan"
	"github.com/mktrain/mktrain/recipes"
)

const benchUsage = `Usage: mktrain bench train [RECIPE] [--steps N] [--warmup N] [--profile=false] [--trace FILE.json] [--set k=v]... [--out DIR]
       mktrain bench checkpoint [RECIPE] [--set k=v]... (see mktrain bench checkpoint --help)
       mktrain bench moe [--shape S,...] [--world W,...] (see mktrain bench moe --help)
       mktrain bench kernels [--shape S,...] [--world W,...] (see mktrain bench kernels --help)
       mktrain bench attention [--shapes S,...] [--peer PYTHON] (see mktrain bench attention --help)
       mktrain bench tp [--shapes S,...] [--tp 2,4,8] (see mktrain bench tp --help)
       mktrain bench prepare --tokenizer FILE FILE... (see mktrain bench prepare --help)

Measures training throughput: runs RECIPE (default tiny) for warmup+steps
optimizer steps, ignores the warmup steps, and prints the median tokens/s and
step time, the model FLOPs utilisation (MFU, on the GPU) and the peak memory.
With --profile (the default) one more step runs with every backend op timed,
and a table shows where that step's time goes: attention, expert GEMMs,
other GEMMs, dispatch, router, norms and elementwise, loss, optimizer, host
transfers, communication (the NCCL collectives, with one rank per GPU) and
host gaps (time no op covers), and the share of host gaps and transfers
(host_share: the time the device waited for the host); with several GPUs
it is rank 0's step.
--trace FILE.json writes that step as a Chrome trace (open it in
ui.perfetto.dev or chrome://tracing): its ops in order on the profiler's
clock (the GPU's on CUDA), their scopes, the step. On CUDA the measured steps
are bracketed by cuProfilerStart/cuProfilerStop, so that
nsys profile --capture-range=cudaProfilerApi records only them. A
last, untimed step follows (it runs the final evaluation). Writes
train-<recipe>.json, with the commit, the machine, the command and the
figures, into bench/results/<machine>/ (cpu, h200, ...: the latest result
of each benchmark per machine, overwritten by the next run) or into the
folder --out names.

Flags:
`

// benchResult is the JSON a benchmark leaves in bench/results/<machine>/.
type benchResult struct {
	Benchmark string         `json:"benchmark"`
	Commit    string         `json:"commit"`
	Date      string         `json:"date"`
	Command   string         `json:"command"`
	Machine   machineInfo    `json:"machine"`
	Recipe    string         `json:"recipe"`
	Config    any            `json:"config"` // the engine.Config, or a benchmark's own settings
	Figures   map[string]any `json:"figures"`
}

type machineInfo struct {
	Host    string `json:"host"`
	OS      string `json:"os"`
	Arch    string `json:"arch"`
	CPUs    int    `json:"cpus"`
	CPU     string `json:"cpu"`
	Backend string `json:"backend,omitempty"`
	Device  string `json:"device,omitempty"` // the GPU's name, where the backend names its device
}

func cmdBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == "checkpoint" {
		return cmdBenchCheckpoint(ctx, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "moe" {
		return cmdBenchMoE(ctx, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "kernels" {
		return cmdBenchKernels(ctx, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "attention" {
		return cmdBenchAttention(ctx, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "tp" {
		return cmdBenchTP(ctx, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "prepare" {
		return cmdBenchPrepare(ctx, args[1:], stdout, stderr)
	}
	if len(args) > 0 && (isHelpFlag(args[0]) || args[0] == "help") {
		fmt.Fprint(stdout, groupUsage("bench"))
		return errHelp
	}
	if len(args) == 0 || args[0] != "train" {
		fmt.Fprint(stderr, groupUsage("bench"))
		return usageError{"bench takes the subcommand train, checkpoint, moe, kernels, attention, tp or prepare"}
	}
	fs := newFlagSet("bench train", benchUsage, stderr)
	var sets setFlags
	fs.Var(&sets, "set", "override a recipe field (repeatable)")
	steps := fs.Int("steps", 20, "measured steps")
	warmup := fs.Int("warmup", 3, "steps run before measuring")
	doProfile := fs.Bool("profile", true, "time one extra step op by op and print where its time goes")
	tracePath := fs.String("trace", "", "write the profiled step as a Chrome/Perfetto trace (JSON) to this file")
	out := fs.String("out", "", "directory for the JSON result (default bench/results/<machine>)")
	pos, err := parseInterspersed(fs, args[1:])
	if err != nil {
		return err
	}
	recipe := "tiny"
	if len(pos) > 1 {
		return usageError{"bench train takes at most one recipe"}
	} else if len(pos) == 1 {
		recipe = pos[0]
	}
	if *steps < 1 || *warmup < 0 {
		return usageError{"--steps must be positive and --warmup not negative"}
	}
	if *tracePath != "" && !*doProfile {
		return usageError{"--trace needs the profiled step: drop --profile=false"}
	}
	measuredEnd := *warmup + *steps
	total := measuredEnd
	if *doProfile {
		// The profiled step, then one that runs the final evaluation,
		// which must not fall into the profile.
		total += 2
	}
	sets = append(sets, fmt.Sprintf("train.steps=%d", total), "train.eval_every=0", "train.warmup_steps=0")
	cfg, _, err := recipes.Load(recipe, sets)
	if err != nil {
		return err
	}
	tokens := float64(cfg.Train.GlobalBatch * cfg.Train.Seq)
	var (
		inner       backend.Backend // the engine's backend, under the profiler
		devices     []backend.Backend
		prof        *profile.Backend
		stepSeconds []float64
		profWall    time.Duration
		rep         profile.Report
		profErr     error
	)
	// The engine wraps its backend first, then, with one rank per GPU,
	// each further GPU's: rank 0's is the one profiled (its NCCL
	// collectives too, as kind communication) and whose memory is
	// reported.
	wrap := func(b backend.Backend) backend.Backend {
		devices = append(devices, b)
		if inner != nil {
			return b
		}
		inner = b
		if !*doProfile {
			return b
		}
		prof = profile.New(b, profile.ClockFor(b))
		return prof.Backend()
	}
	// The hook runs after each step, before the next: it switches the
	// profiler on for step measuredEnd+1 and reads it after that step.
	hook := func(ev engine.StepEvent) {
		if ev.Step > *warmup && ev.Step <= measuredEnd {
			stepSeconds = append(stepSeconds, tokens/ev.TokensPerSec)
		}
		switch ev.Step {
		case *warmup:
			profilerRange(devices, true, stderr)
		case measuredEnd:
			profilerRange(devices, false, stderr)
		}
		if prof == nil {
			return
		}
		switch ev.Step {
		case measuredEnd:
			prof.SetEnabled(true)
		case measuredEnd + 1:
			prof.SetEnabled(false)
			profWall = time.Duration(tokens / ev.TokensPerSec * float64(time.Second))
			rep, profErr = prof.Report()
		}
	}
	eng, err := engine.New(cfg, engine.WithDrivers(all.Drivers()...), engine.WithHook(hook), engine.WithBackendWrapper(wrap))
	if err != nil {
		return err
	}
	defer eng.Close()
	fmt.Fprintf(stderr, "bench: %s on %s, %d warmup + %d measured steps\n", recipe, eng.BackendName(), *warmup, *steps)
	if *warmup == 0 {
		profilerRange(devices, true, stderr)
	}
	run, err := eng.Run(ctx)
	if err != nil {
		return failedRun(err)
	}
	if profErr != nil {
		return fmt.Errorf("bench: profiling step %d: %w", measuredEnd+1, profErr)
	}
	stepMS := make([]float64, len(stepSeconds)) // in step order, for spotting outliers
	for i, s := range stepSeconds {
		stepMS[i] = s * 1e3
	}
	slices.Sort(stepSeconds)
	median := stepSeconds[len(stepSeconds)/2]
	flopsPerToken := engine.ModelFLOPsPerToken(cfg.Model, cfg.Train.Seq)
	figures := map[string]any{
		"tokens_per_step": tokens,
		"step_ms_median":  median * 1e3,
		"step_ms_min":     stepSeconds[0] * 1e3,
		"step_ms":         stepMS,
		"tokens_per_s":    tokens / median,
		"measured_steps":  len(stepSeconds),
		"ranks":           cfg.Parallel.DP * cfg.Parallel.EP * cfg.Parallel.CP * cfg.Parallel.TP,
		"model_params":    engine.ParamCount(cfg.Model),
		"flops_per_token": flopsPerToken,
		"model_tflops":    flopsPerToken * tokens / median / 1e12,
		"mfu":             nil, // null on the CPU
		"moe_dispatcher":  run.Dispatcher,
		// train.recompute, as in the config section ("" there is none).
		"recompute": cmp.Or(cfg.Train.Recompute, engine.RecomputeNone),
		// Whether AdamW updated the experts in the backward
		// (train.optimizer_in_backward, settled).
		"experts_updated_in_backward": cfg.ExpertsUpdatedInBackward(),
		// Whether the weights' masters were split (train.master_weights,
		// settled for this backend).
		"split_master_weights": cfg.SplitsMasters(inner),
	}
	mem := peakMemory(inner)
	figures["peak_memory_bytes"], figures["peak_memory_source"] = mem.bytes, mem.source
	if inner.Name() == plan.BackendCUDA {
		// The allocator's rounding behind that peak (backend/cuda's
		// fineAbove, which plan.CUDAFineClassesAbove mirrors), so the
		// plan compares with it as the allocator was when measured.
		figures["allocator_fine_classes_above"] = plan.CUDAFineClassesAbove
	}
	mfu := math.NaN()
	if peak := engine.PeakFLOPs(engine.DeviceName(inner)); peak > 0 {
		mfu = flopsPerToken * tokens / median / peak
		figures["mfu"], figures["mfu_peak_flops"] = mfu, peak
	}
	fmt.Fprintf(stdout, "%-12s %-10s %12s %12s %8s %12s  %s\n", "benchmark", "recipe", "tokens/s", "step ms", "MFU", "peak memory", "MoE dispatcher")
	fmt.Fprintf(stdout, "%-12s %-10s %12.0f %12.1f %8s %12s  %s\n", "train", recipe, tokens/median, median*1e3, formatMFU(mfu), engine.FormatBytes(mem.bytes), run.Dispatcher)
	fmt.Fprintln(stdout, addPlanFigures(figures, eng, run.Dispatcher, mem.bytes)) // the plan's peak beside the measured one
	if prof != nil {
		rep = rep.WithWall(profWall)
		figures["profiled_step_ms"] = profWall.Seconds() * 1e3
		figures["breakdown"] = breakdownRows(rep)
		figures["breakdown_ops"] = opRows(rep)
		figures["host_share"] = hostShare(rep)
		printBreakdown(stdout, rep, profWall, median)
		if *tracePath != "" {
			info := profile.TraceInfo{Process: fmt.Sprintf("mktrain bench train %s (%s)", recipeName(recipe), machineKind(inner)),
				Window: fmt.Sprintf("step %d", measuredEnd+1), Wall: profWall}
			err := atomicfile.WriteFile(*tracePath, func(w io.Writer) error { return profile.WriteTrace(w, rep, info) })
			if err != nil {
				return fmt.Errorf("bench: --trace: %w", err)
			}
			fmt.Fprintf(stdout, "wrote %s (%d ops; open it in ui.perfetto.dev)\n", *tracePath, len(rep.Spans))
		}
	}
	res := benchResult{
		Benchmark: "train",
		Commit:    commit(),
		Date:      time.Now().UTC().Format(time.RFC3339),
		Command:   "mktrain bench " + strings.Join(args, " "),
		Machine:   machine(eng.BackendName()),
		Recipe:    recipe,
		Config:    cfg,
		Figures:   figures,
	}
	return writeResult(stdout, *out, "train-"+recipeName(recipe), inner, res)
}

// profilerRange starts (or stops) the CUDA profiler API's capture range
// on every device the ranks train on that has one (cuProfilerStart/Stop);
// a failure is a warning: the benchmark stands without it.
func profilerRange(devices []backend.Backend, start bool, stderr io.Writer) {
	type profilerAPI interface {
		StartProfiler() error
		StopProfiler() error
	}
	for _, b := range devices {
		p, ok := b.(profilerAPI)
		if !ok {
			continue
		}
		call, name := p.StopProfiler, "cuProfilerStop"
		if start {
			call, name = p.StartProfiler, "cuProfilerStart"
		}
		if err := call(); err != nil {
			fmt.Fprintf(stderr, "bench: warning: %s: %v\n", name, err)
		}
	}
}

// memoryFigure is the peak memory and what it measures.
type memoryFigure struct {
	bytes  int64
	source string
}

// peakMemory is the CUDA allocator's peak of bytes held by live tensors,
// or, on the CPU, the bytes the Go runtime has obtained from the OS
// (runtime.MemStats.Sys): the process's footprint, an upper bound of the
// tensors' peak.
func peakMemory(b backend.Backend) memoryFigure {
	if p, ok := b.(interface{ PeakMemory() int64 }); ok {
		return memoryFigure{p.PeakMemory(), "peak bytes of live tensors (allocator)"}
	}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return memoryFigure{int64(ms.Sys), "bytes obtained from the OS by the Go runtime (runtime.MemStats.Sys)"}
}

// breakdownRow is one kind of work in the JSON figures.
type breakdownRow struct {
	Kind  string  `json:"kind"`
	MS    float64 `json:"ms"`
	Share float64 `json:"share"`
	Ops   int     `json:"ops"`
}

func breakdownRows(rep profile.Report) []breakdownRow {
	rows := make([]breakdownRow, len(rep.Kinds))
	for i, k := range rep.Kinds {
		rows[i] = breakdownRow{Kind: k.Kind, MS: k.Time.Seconds() * 1e3, Share: k.Share, Ops: k.Ops}
	}
	return rows
}

// opRow is one (scope, op) pair of the profiled step in the JSON figures:
// the detail behind the kinds.
type opRow struct {
	Scope string  `json:"scope"`
	Op    string  `json:"op"`
	Kind  string  `json:"kind"`
	MS    float64 `json:"ms"`
	Calls int     `json:"calls"`
}

func opRows(rep profile.Report) []opRow {
	rows := make([]opRow, len(rep.Ops))
	for i, o := range rep.Ops {
		rows[i] = opRow{Scope: o.Scope, Op: o.Op, Kind: o.Kind, MS: o.Time.Seconds() * 1e3, Calls: o.Calls}
	}
	return rows
}

// printBreakdown writes the profiled step's time per kind of work, then
// the share the device spent on the host (hostShare).
func printBreakdown(w io.Writer, rep profile.Report, wall time.Duration, median float64) {
	fmt.Fprintf(w, "\nwhere the time goes (profiled step: %.1f ms; median measured step: %.1f ms)\n", wall.Seconds()*1e3, median*1e3)
	fmt.Fprintf(w, "%-24s %10s %8s %8s\n", "kind", "ms/step", "share", "ops")
	for _, k := range rep.Kinds {
		fmt.Fprintf(w, "%-24s %10.2f %7.1f%% %8d\n", k.Kind, k.Time.Seconds()*1e3, 100*k.Share, k.Ops)
	}
	fmt.Fprintf(w, "%s and %s: %.2f%% of the step\n", profile.KindHostGaps, profile.KindTransfers, 100*hostShare(rep))
}

// hostShare is the share of the profiled step in host gaps and host
// transfers: on the GPU, the time the device waited for the host (its
// queue empty, or a copy to or from the host's memory on it).
func hostShare(rep profile.Report) float64 {
	share := 0.0
	for _, k := range rep.Kinds {
		if k.Kind == profile.KindHostGaps || k.Kind == profile.KindTransfers {
			share += k.Share
		}
	}
	return share
}

func formatMFU(mfu float64) string {
	if math.IsNaN(mfu) {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*mfu)
}

// writeBenchResult records a benchmark that runs on no backend (bench
// checkpoint) with the commit, machine and command, as
// <benchmark>-<recipe>.json.
func writeBenchResult(stdout io.Writer, out, benchmark, recipe, backendName string, cfg engine.Config, command string, figures map[string]any) error {
	return writeResult(stdout, out, benchmark+"-"+recipeName(recipe), nil, benchResult{
		Benchmark: benchmark, Commit: commit(), Date: time.Now().UTC().Format(time.RFC3339),
		Command: command, Machine: machine(backendName), Recipe: recipe, Config: cfg, Figures: figures,
	})
}

// writeResult writes res as name.json into the folder out names, or,
// when out is "", into bench/results/<machine kind of b>/: that folder
// keeps the latest result of each benchmark per machine (a run overwrites
// the one before; the history is in git). A benchmark of a recipe names
// its file <benchmark>-<recipe> (train-moe-small), one of its own shapes
// <benchmark> (moe, kernels). b is the backend the figures were measured
// on (nil: none, as for bench checkpoint); its device's name goes into
// the machine record too.
func writeResult(stdout io.Writer, out, name string, b backend.Backend, res benchResult) error {
	dir := out
	if dir == "" {
		dir = filepath.Join("bench", "results", machineKind(b))
	}
	if res.Machine.Device == "" {
		res.Machine.Device = engine.DeviceName(b)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("bench results: %w", err)
	}
	path := filepath.Join(dir, name+".json")
	buf, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(path, append(buf, '\n'), 0o644); err != nil {
		return fmt.Errorf("bench results: %w", err)
	}
	fmt.Fprintf(stdout, "wrote %s\n", path)
	return nil
}

// recipeName is a recipe as a result's file names it: without its
// folder and .yaml (recipes/moe-small.yaml is moe-small).
func recipeName(recipe string) string {
	return strings.TrimSuffix(filepath.Base(recipe), ".yaml")
}

// machineKind names the kind of machine a result was measured on, the
// folder of bench/results it goes to: the GPU's model where the backend
// names its device ("h200" for "NVIDIA H200", "h100-80gb-hbm3" for
// "NVIDIA H100 80GB HBM3"), else the backend's name; "cpu" without a
// backend.
func machineKind(b backend.Backend) string {
	name := engine.DeviceName(b)
	if name == "" {
		if b == nil {
			return "cpu"
		}
		return b.Name()
	}
	name = strings.TrimPrefix(strings.ToLower(strings.TrimSpace(name)), "nvidia ")
	var kind strings.Builder
	dash := false
	for _, r := range name {
		if ('a' <= r && r <= 'z') || ('0' <= r && r <= '9') {
			if dash && kind.Len() > 0 {
				kind.WriteByte('-')
			}
			kind.WriteRune(r)
			dash = false
		} else {
			dash = true
		}
	}
	if kind.Len() == 0 {
		return b.Name()
	}
	return kind.String()
}

// commit is the source revision, from the build info (with "+dirty" when
// the tree had uncommitted changes), else from git.
func commit() string {
	if buildCommit != "" {
		return buildCommit
	}
	if info, ok := debug.ReadBuildInfo(); ok {
		rev, dirty := "", ""
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				if s.Value == "true" {
					dirty = "+dirty"
				}
			}
		}
		if rev != "" {
			return rev + dirty
		}
	}
	if out, err := exec.Command("git", "rev-parse", "HEAD").Output(); err == nil {
		return strings.TrimSpace(string(out))
	}
	return "unknown"
}

func machine(backendName string) machineInfo {
	host, _ := os.Hostname()
	m := machineInfo{Host: host, OS: runtime.GOOS, Arch: runtime.GOARCH, CPUs: runtime.NumCPU(), Backend: backendName}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
	}
	return m
}

// pickNamed returns the entries of known that list names (comma-separated,
// in list's order), name giving an entry's name; an unknown name is a
// usage error naming flag and the known names.
func pickNamed[T any](flag, list string, known []T, name func(T) string) ([]T, error) {
	names := make([]string, len(known))
	for i, s := range known {
		names[i] = name(s)
	}
	var out []T
	for _, n := range strings.Split(list, ",") {
		i := slices.Index(names, strings.TrimSpace(n))
		if i < 0 {
			return nil, usageError{fmt.Sprintf("%s: unknown shape %q (known: %s)", flag, n, strings.Join(names, ", "))}
		}
		out = append(out, known[i])
	}
	return out, nil
}

// parseCounts reads a comma-separated list of integers for flag, each of
// which valid must accept; one it does not is a usage error saying it "is
// not" what.
func parseCounts(flag, list string, valid func(int) bool, what string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(list, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || !valid(n) {
			return nil, usageError{fmt.Sprintf("%s: %q is not %s", flag, f, what)}
		}
		out = append(out, n)
	}
	return out, nil
}
