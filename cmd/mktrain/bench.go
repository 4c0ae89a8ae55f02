package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/recipes"
)

const benchUsage = `Usage: mktrain bench train [RECIPE] [--steps N] [--warmup N] [--set k=v]... [--out DIR]
       mktrain bench checkpoint [RECIPE] [--set k=v]... (see mktrain bench checkpoint --help)

Measures training throughput: runs RECIPE (default tiny) for warmup+steps
optimizer steps, ignores the warmup steps, and prints the median tokens/s and
step time. Writes DIR/train-<recipe>-<time>.json with the commit, the machine,
the command and the figures.

Flags:
`

// benchResult is the JSON a benchmark leaves in bench/results/.
type benchResult struct {
	Benchmark string         `json:"benchmark"`
	Commit    string         `json:"commit"`
	Date      string         `json:"date"`
	Command   string         `json:"command"`
	Machine   machineInfo    `json:"machine"`
	Recipe    string         `json:"recipe"`
	Config    engine.Config  `json:"config"`
	Figures   map[string]any `json:"figures"`
}

type machineInfo struct {
	Host    string `json:"host"`
	OS      string `json:"os"`
	Arch    string `json:"arch"`
	CPUs    int    `json:"cpus"`
	CPU     string `json:"cpu"`
	Backend string `json:"backend,omitempty"`
}

func cmdBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == "checkpoint" {
		return cmdBenchCheckpoint(ctx, args[1:], stdout, stderr)
	}
	if len(args) == 0 || args[0] != "train" {
		fmt.Fprint(stderr, benchUsage)
		return usageError{"bench takes the subcommand train or checkpoint"}
	}
	fs := newFlagSet("bench train", benchUsage, stderr)
	var sets setFlags
	fs.Var(&sets, "set", "override a recipe field (repeatable)")
	steps := fs.Int("steps", 20, "measured steps")
	warmup := fs.Int("warmup", 3, "steps run before measuring")
	out := fs.String("out", filepath.Join("bench", "results"), "directory for the JSON result")
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
	sets = append(sets, fmt.Sprintf("train.steps=%d", *steps+*warmup), "train.eval_every=0", "train.warmup_steps=0")
	cfg, _, err := recipes.Load(recipe, sets)
	if err != nil {
		return err
	}
	var stepSeconds []float64
	eng, err := engine.New(cfg, engine.WithHook(func(ev engine.StepEvent) {
		if ev.Step > *warmup {
			stepSeconds = append(stepSeconds, float64(cfg.Train.GlobalBatch*cfg.Train.Seq)/ev.TokensPerSec)
		}
	}))
	if err != nil {
		return err
	}
	defer eng.Close()
	fmt.Fprintf(stderr, "bench: %s on %s, %d warmup + %d measured steps\n", recipe, eng.BackendName(), *warmup, *steps)
	if _, err := eng.Run(ctx); err != nil {
		return err
	}
	slices.Sort(stepSeconds)
	median := stepSeconds[len(stepSeconds)/2]
	tokens := float64(cfg.Train.GlobalBatch * cfg.Train.Seq)
	res := benchResult{
		Benchmark: "train",
		Commit:    commit(),
		Date:      time.Now().UTC().Format(time.RFC3339),
		Command:   "mktrain bench " + strings.Join(args, " "),
		Machine:   machine(eng.BackendName()),
		Recipe:    recipe,
		Config:    cfg,
		Figures: map[string]any{
			"tokens_per_step": tokens,
			"step_ms_median":  median * 1e3,
			"step_ms_min":     stepSeconds[0] * 1e3,
			"tokens_per_s":    tokens / median,
			"measured_steps":  len(stepSeconds),
			"ranks":           cfg.Parallel.DP * cfg.Parallel.EP * cfg.Parallel.CP * cfg.Parallel.TP,
			"model_params":    engine.ParamCount(cfg.Model),
		},
	}
	fmt.Fprintf(stdout, "%-12s %-10s %12s %12s\n", "benchmark", "recipe", "tokens/s", "step ms")
	fmt.Fprintf(stdout, "%-12s %-10s %12.0f %12.1f\n", "train", recipe, tokens/median, median*1e3)
	return writeResult(stdout, *out, res)
}

// writeBenchResult records a benchmark's figures with the commit, machine
// and command.
func writeBenchResult(stdout io.Writer, dir, benchmark, recipe, backendName string, cfg engine.Config, command string, figures map[string]any) error {
	return writeResult(stdout, dir, benchResult{
		Benchmark: benchmark, Commit: commit(), Date: time.Now().UTC().Format(time.RFC3339),
		Command: command, Machine: machine(backendName), Recipe: recipe, Config: cfg, Figures: figures,
	})
}

func writeResult(stdout io.Writer, dir string, res benchResult) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("bench results: %w", err)
	}
	name := fmt.Sprintf("%s-%s-%s.json", res.Benchmark, strings.TrimSuffix(filepath.Base(res.Recipe), ".yaml"), time.Now().UTC().Format("20060102T150405Z"))
	path := filepath.Join(dir, name)
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

// commit is the source revision, from the build info (with "+dirty" when
// the tree had uncommitted changes), else from git.
func commit() string {
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
