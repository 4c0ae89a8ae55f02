package main

// mktrain plan: the memory plan of a recipe (package plan), the same one
// mktrain run checks before it allocates anything.

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"

	"github.com/mktrain/mktrain/backend/all"
	"github.com/mktrain/mktrain/backend/cuda"
	"github.com/mktrain/mktrain/backend/registry"
	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/plan"
	"github.com/mktrain/mktrain/recipes"
)

const planUsage = `Usage: mktrain plan RECIPE [--set key.path=value]... [--device NAME] [--memory SIZE] [--gpus N] [--json]

Prints what a run of RECIPE needs: its parameters (all, and those active
per token), the FLOPs per token that bench train's MFU counts, and per rank
the bytes of the weights (fp32 masters and the GPU's bf16 copy), gradients,
AdamW moments, the activations each kind of layer keeps for the backward,
and the working memory of the backward, the MoE dispatch, the matrix
products and the collectives, against the memory of the device: the GPU
this machine would train on, the host's memory for the CPU backend, or the
device --device names (h200, h100, cpu), with --memory SIZE (141GiB, 80GB)
instead of the device's. On a named GPU the ranks are planned as mktrain
run places them on a machine of --gpus N such GPUs: one rank on each when
there are at least as many GPUs as ranks (the default), else every rank on
one GPU as virtual ranks (--gpus 1: a one-GPU machine). mktrain run
checks the same plan before it allocates anything and refuses a run that
does not fit; so does plan, with exit status 2 and the same sentence.
docs/memory.md explains each term.

Flags:
`

// planReport is mktrain plan --json's object.
type planReport struct {
	Recipe  string    `json:"recipe"`
	Fits    bool      `json:"fits"`
	Verdict string    `json:"verdict"`
	Warning string    `json:"warning,omitempty"`
	Plan    plan.Plan `json:"plan"`
}

func cmdPlan(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("plan", planUsage, stderr)
	var sets setFlags
	fs.Var(&sets, "set", "override a recipe field, e.g. --set train.micro_batch=4 (repeatable)")
	device := fs.String("device", "", "plan for this device instead of this machine's: "+strings.Join(plan.DeviceNames(), ", "))
	memory := fs.String("memory", "", "the device's memory for the run, e.g. 141GiB or 80GB (default: the device's)")
	gpus := fs.Int("gpus", 0, "with --device or --memory: the machine's GPUs, fewer than the ranks putting every rank on one (default: one for each rank)")
	asJSON := fs.Bool("json", false, "print the plan as one JSON object")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		fs.Usage()
		return usageError{"plan takes exactly one recipe"}
	}
	cfg, _, err := recipes.Load(pos[0], sets)
	if err != nil {
		return err
	}
	p, err := recipePlan(cfg, *device, *memory, *gpus)
	if err != nil {
		return err
	}
	verdict := p.Check()
	host := int64(0) // the host check is of this machine's host, not a named device's
	if *device == "" && *memory == "" {
		host = hostMemory(p)
	}
	if *asJSON {
		rep := planReport{Recipe: pos[0], Fits: verdict == nil, Verdict: "fits", Warning: p.Warning(host), Plan: p}
		if verdict != nil {
			rep.Verdict = verdict.Error()
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return err
		}
	} else {
		printPlan(stdout, pos[0], p, verdict, host)
	}
	if verdict != nil {
		return &engine.InputError{Err: verdict}
	}
	return nil
}

// recipePlan is cfg's plan on the device named, or with --memory on a
// device of that much memory, on a machine of gpus such GPUs (0: one for
// each rank), or else on the device mktrain run would train on here
// (opening it, for a GPU).
func recipePlan(cfg engine.Config, device, memory string, gpus int) (plan.Plan, error) {
	if gpus < 0 {
		return plan.Plan{}, usageError{fmt.Sprintf("--gpus is %d; give the machine's GPU count, at least 1", gpus)}
	}
	if gpus > 0 && device == "" && memory == "" {
		return plan.Plan{}, usageError{"--gpus goes with --device or --memory: without them the plan counts this machine's GPUs"}
	}
	var mem int64
	if memory != "" {
		var err error
		if mem, err = plan.ParseBytes(memory); err != nil {
			return plan.Plan{}, usageError{"--memory: " + err.Error()}
		}
	}
	if device == "" && memory != "" {
		device = "cpu"
		if cfg.Train.Backend != registry.CPU {
			device = "gpu"
		}
	}
	if device == "" {
		return enginePlan(cfg)
	}
	var d plan.Device
	switch {
	case device == "gpu": // --memory alone for a GPU recipe: a GPU of that memory
		d = plan.CUDADevice(fmt.Sprintf("GPU of %s", plan.FormatBytes(mem)), mem, 0)
	case !plan.IsNamedDevice(device):
		_, err := plan.NamedDevice(device)
		return plan.Plan{}, usageError{"--device: " + err.Error()}
	default:
		var err error
		// Only the host's memory can be unknown (no /proc/meminfo).
		if d, err = plan.NamedDevice(device); err != nil && memory == "" {
			return plan.Plan{}, fmt.Errorf("--device %s: %w; give --memory SIZE", device, err)
		}
	}
	if mem > 0 {
		d.Memory = mem
	}
	// One rank per GPU on a named GPU, unless the machine has fewer GPUs
	// than ranks: then every rank on one, as mktrain run places them
	// (virtual ranks); every rank on the host for the CPU.
	world := cfg.Parallel.DP * cfg.Parallel.EP * cfg.Parallel.CP * cfg.Parallel.TP
	deviceRanks := 1
	if gpus > 0 && gpus < world {
		deviceRanks = 0
	}
	if d.Backend == plan.BackendCPU {
		if gpus > 0 {
			return plan.Plan{}, usageError{"--gpus is for a GPU device; the CPU backend runs every rank on the host"}
		}
		deviceRanks = 0
	}
	pc := engine.PlanConfig(cfg, 0, deviceRanks, true)
	if device != "gpu" && d.Backend == plan.BackendCUDA {
		// The named GPUs are Hopper GPUs: mode ring runs the fused ring
		// there, in one pass where its kernels take the shape, as a run
		// would (a GPU of --memory alone plans the portable ring's buffers).
		pc.CPRingFused, pc.CPRingOnePass = engine.PlanRing(cfg, world, cmp.Or(deviceRanks, world), cuda.HopperZigzag{})
	}
	return plan.New(pc, d)
}

// enginePlan is the plan of the engine mktrain run would build for cfg,
// on the device it opens.
func enginePlan(cfg engine.Config) (plan.Plan, error) {
	// A run directory, as mktrain run has one, so that the plan counts a
	// checkpoint's snapshot on the host; the engine writes nothing there
	// before Run.
	eng, err := engine.New(cfg, engine.WithDrivers(all.Drivers()...), engine.WithRunDir("plan"))
	if err != nil {
		if cfg.Train.Backend != registry.CPU && !engine.IsInputError(err) {
			return plan.Plan{}, err
		}
		return plan.Plan{}, fmt.Errorf("%w (to plan for a GPU this machine lacks, name it: --device %s, or --memory SIZE)",
			err, strings.Join(plan.DeviceNames()[1:], " or --device "))
	}
	defer eng.Close()
	return eng.Plan()
}

// hostMemory is the host's memory for a GPU plan's host check, 0 where
// unknown or for the CPU (whose plan counts the host already).
func hostMemory(p plan.Plan) int64 {
	if p.Device.Backend == plan.BackendCPU {
		return 0
	}
	total, _, err := plan.HostMemory()
	if err != nil {
		return 0
	}
	return total
}

// printPlan writes the plan as a table.
func printPlan(w io.Writer, recipe string, p plan.Plan, verdict error, host int64) {
	c := p.Config
	memory := "memory unknown"
	if p.Device.Memory > 0 {
		memory = plan.FormatBytes(p.Device.Memory) + " for the run"
	}
	ranks := fmt.Sprintf("%d ranks, %d on each device", c.ProcessRanks, p.DeviceRanks)
	if c.ProcessRanks == 1 {
		ranks = "1 rank"
	}
	fmt.Fprintf(w, "plan of %s on %s (%s), %s\n\n", recipe, p.Device.Name, memory, ranks)
	fmt.Fprintf(w, "%-22s %s total, %s active per token, %s on each rank\n", "parameters",
		count(p.Params.Total), count(p.Params.Active), count(p.Params.Rank))
	fmt.Fprintf(w, "%-22s %.4g (6 x active + 6 x layers x dim x seq)\n", "FLOPs per token", p.FLOPsPerToken)
	batches := fmt.Sprintf("%d micro-batches", p.MicroBatches)
	if p.MicroBatches == 1 {
		batches = "1 micro-batch"
	}
	fmt.Fprintf(w, "%-22s %d tokens, %s per rank\n", "optimizer step", p.TokensPerStep, batches)
	recompute := "none: every layer's activations kept for its backward"
	switch c.Recompute {
	case plan.RecomputeSelective:
		recompute = "selective: the attention core's output and the experts' hidden activations kept once, remade in each layer's backward"
	case plan.RecomputeFull:
		recompute = "full: one layer's activations kept, each layer's forward rerun from its kept input before its backward"
	}
	fmt.Fprintf(w, "%-22s %s\n", "train.recompute", recompute)
	update := "after the backward: every expert gradient kept until the step's AdamW"
	if c.ExpertsInBackward {
		update = "in the backward (train.optimizer_in_backward): one expert tensor's gradient at a time"
	}
	fmt.Fprintf(w, "%-22s %s\n", "experts' AdamW", update)
	if p.Device.OperandBytes < p.Device.FloatBytes {
		masters := "fp32, and a bf16 copy for the products (6 bytes a weight)"
		if c.SplitMasters {
			masters = "split: the bf16 operands and their low halves (4 bytes a weight)"
		}
		fmt.Fprintf(w, "%-22s %s\n", "master weights", masters)
	}
	routed := p.Worst != p.Peak
	fmt.Fprintf(w, "\n%-12s %-56s %12s", "per rank", "", "bytes")
	if routed {
		fmt.Fprintf(w, " %12s", "routing bound")
	}
	fmt.Fprintln(w)
	row := func(t plan.Term) {
		fmt.Fprintf(w, "%-12s %-56s %12s", t.Kind, t.What, plan.FormatBytes(t.Bytes))
		if routed {
			fmt.Fprintf(w, " %12s", plan.FormatBytes(t.Worst))
		}
		fmt.Fprintln(w)
	}
	for _, t := range p.Rank {
		row(t)
	}
	if len(p.Shared) > 0 {
		fmt.Fprintf(w, "\n%s\n", "shared by the ranks of a device")
		for _, t := range p.Shared {
			row(t)
		}
	}
	peak := fmt.Sprintf("%s per device", plan.FormatBytes(p.Peak))
	if routed {
		peak += fmt.Sprintf(" (routing bound %s)", plan.FormatBytes(p.Worst))
	}
	if p.Device.Backend == plan.BackendCPU {
		peak = fmt.Sprintf("%s of host memory with the transients below", plan.FormatBytes(p.HostPeak))
	}
	fmt.Fprintf(w, "\n%-22s %s\n", "peak", peak)
	fmt.Fprintf(w, "%-22s", "host (transient)")
	for i, t := range p.Host {
		if i > 0 {
			fmt.Fprint(w, ";")
		}
		fmt.Fprintf(w, " %s %s", strings.TrimSuffix(t.What, " (transient)"), plan.FormatBytes(t.Bytes))
	}
	fmt.Fprintln(w)
	switch {
	case verdict != nil:
		fmt.Fprintf(w, "%-22s does not fit\n", "verdict")
	case p.Device.Memory <= 0:
		fmt.Fprintf(w, "%-22s unknown: the device's memory is not known (give --memory SIZE)\n", "verdict")
	default:
		need := p.Peak
		if p.Device.Backend == plan.BackendCPU {
			need = p.HostPeak
		}
		fmt.Fprintf(w, "%-22s fits: %.0f%% of %s\n", "verdict", 100*float64(need)/float64(p.Device.Memory), plan.FormatBytes(p.Device.Memory))
	}
	if warn := p.Warning(host); warn != "" {
		fmt.Fprintf(w, "%-22s %s\n", "warning", warn)
	}
}

// count writes a parameter count in millions, billions or trillions:
// "641.8M", "4.65B".
func count(n int64) string {
	switch {
	case n == plan.Saturated:
		return "more than 9.2e18"
	case n >= 1e12:
		return fmt.Sprintf("%.2fT", float64(n)/1e12)
	case n >= 1e9:
		return fmt.Sprintf("%.2fB", float64(n)/1e9)
	case n >= 1e6:
		return fmt.Sprintf("%.1fM", float64(n)/1e6)
	}
	return fmt.Sprint(n)
}

// addPlanFigures puts the memory plan's predicted peak beside the peak
// bench train measured (figures' peak_memory_bytes), for the run eng made
// with the dispatcher it settled on, and returns a line that compares the
// two; on the CPU, where the measured figure is the Go runtime's whole
// footprint, the plan's is its tensors and host transients and no ratio
// is given.
func addPlanFigures(figures map[string]any, eng *engine.Engine, dispatcher string, measured int64) string {
	p, err := eng.Plan()
	if err == nil {
		c := p.Config
		c.Dispatcher = dispatcher
		p, err = plan.New(c, p.Device)
	}
	if err != nil {
		return "memory plan: " + err.Error()
	}
	predicted := p.Peak
	if p.Device.Backend == plan.BackendCPU {
		predicted = p.HostPeak
	}
	figures["plan_peak_memory_bytes"] = predicted
	if p.Device.Backend == plan.BackendCPU || measured <= 0 {
		figures["plan_peak_memory_error"] = nil
		return fmt.Sprintf("memory plan: %s predicted (tensors and host transients)", plan.FormatBytes(predicted))
	}
	off := float64(predicted)/float64(measured) - 1
	figures["plan_peak_memory_error"] = off
	return fmt.Sprintf("memory plan: %s predicted, %s measured (%+.1f%%)", plan.FormatBytes(predicted), plan.FormatBytes(measured), 100*off)
}
