package main

// What `mktrain run` shows on stderr. On a terminal: warnings as they come,
// a banner when training starts (backend and device, run directory, model,
// schedule, where the run starts from, where its figures go), then a
// progress bar; a log line that arrives while the bar is up (a warning, an
// error) is printed above the bar, which is drawn again below it. Without
// a terminal: the log lines (each step's reads "step n/N" and then loss,
// lr, tokens/s, MFU, memory and ETA), and no bar.

import (
	"fmt"
	"io"
	"math"
	"os"
	"strings"
	"sync"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/mktrain/mktrain/engine"
)

// runConsole is a run's stderr. Its methods are safe for concurrent use:
// the engine logs from its training goroutine and from a background
// checkpoint writer, and the hooks drive the bar from the first.
type runConsole struct {
	out    io.Writer
	cfg    engine.Config
	useBar bool
	// Told to the banner: the recipe as given, and where the figures go.
	recipe string
	sinks  []string

	mu  sync.Mutex
	bar *progressbar.ProgressBar // from the banner to finish
}

// newRunConsole decides whether stderr gets the bar: log.progress on, or
// auto and stderr a terminal.
func newRunConsole(cfg engine.Config, stderr io.Writer, recipe string) *runConsole {
	show := cfg.Log.Progress == "on"
	if cfg.Log.Progress == "auto" {
		f, ok := stderr.(*os.File)
		show = ok && term.IsTerminal(int(f.Fd()))
	}
	return &runConsole{out: stderr, cfg: cfg, useBar: show, recipe: recipe}
}

// addSink names a place the run's figures go, for the banner
// ("metrics.jsonl runs/tiny/metrics.jsonl").
func (c *runConsole) addSink(s string) { c.sinks = append(c.sinks, s) }

// options are the engine hooks that draw the banner and the bar (none
// without a terminal).
func (c *runConsole) options() []engine.Option {
	if !c.useBar {
		return nil
	}
	return []engine.Option{engine.WithStartHook(c.start), engine.WithHook(c.step)}
}

// Write prints one log line, above the bar when it is up.
func (c *runConsole) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.bar == nil {
		return c.out.Write(p)
	}
	_ = c.bar.Clear()
	n, err := c.out.Write(p)
	_ = c.bar.RenderBlank() // the bar again, below the line
	return n, err
}

// start prints the banner and puts up the bar.
func (c *runConsole) start(ev engine.StartEvent) {
	c.mu.Lock()
	defer c.mu.Unlock()
	fmt.Fprint(c.out, c.banner(ev))
	c.bar = progressbar.NewOptions(ev.Steps,
		progressbar.OptionSetWriter(c.out),
		progressbar.OptionSetDescription("starting"),
		progressbar.OptionShowCount(),
		progressbar.OptionSetPredictTime(false), // the engine's ETA is in the description
		progressbar.OptionSetWidth(30),
		progressbar.OptionThrottle(0), // a render per step: steps are the unit
		progressbar.OptionSetRenderBlankState(false),
	)
	_ = c.bar.Set(ev.StartStep)
}

// banner describes the run about to train.
func (c *runConsole) banner(ev engine.StartEvent) string {
	m, tr := c.cfg.Model, c.cfg.Train
	var b strings.Builder
	row := func(name, format string, args ...any) {
		fmt.Fprintf(&b, "  %-9s %s\n", name, fmt.Sprintf(format, args...))
	}
	fmt.Fprintf(&b, "%s: run %s\n", versionString(), c.recipe)
	ranks := "1 rank"
	if ev.Ranks > 1 {
		ranks = fmt.Sprintf("%d ranks (dp %d, ep %d, cp %d)", ev.Ranks, c.cfg.Parallel.DP, c.cfg.Parallel.EP, c.cfg.Parallel.CP)
	}
	row("backend", "%s (%s), %s", ev.Backend, ev.Device, ranks)
	for _, note := range ev.BackendNotes { // why this backend: the fall-back to the CPU, say
		row("", "%s", note)
	}
	runDir := ev.RunDir
	if runDir == "" {
		runDir = "none: nothing is saved"
	}
	row("run dir", "%s", runDir)
	row("model", "%s parameters: %d layers, dim %d, %d experts top-%d, %s dispatcher",
		humanCount(ev.Params), m.Layers, m.Dim, m.MoE.Experts, m.MoE.TopK, ev.Dispatcher)
	row("training", "%d steps of %d x %d tokens, lr %.3g (%s, warmup %d)", ev.Steps, tr.GlobalBatch, tr.Seq, tr.LR, tr.Schedule, tr.WarmupSteps)
	if ev.StartStep > 0 {
		row("resume", "from step %d (%s)", ev.StartStep, ev.Checkpoint)
	} else {
		row("resume", "none: a fresh start")
	}
	for _, s := range c.sinks {
		row("figures", "%s", s)
	}
	return b.String()
}

// step moves the bar and shows the step's figures.
func (c *runConsole) step(ev engine.StepEvent) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.bar == nil {
		return
	}
	desc := fmt.Sprintf("loss %.4f", ev.Loss)
	if !math.IsNaN(ev.ValLoss) {
		desc += fmt.Sprintf(" (val %.4f, %d batches)", ev.ValLoss, ev.ValBatches)
	}
	mfu := ""
	if ev.MFU > 0 {
		mfu = fmt.Sprintf("  MFU %.1f%%", 100*ev.MFU)
	}
	desc += fmt.Sprintf("  %.0f tok/s%s  %s  ETA %s", ev.TokensPerSec, mfu, engine.FormatBytes(ev.PeakMemory), engine.FormatDuration(ev.ETA))
	c.bar.Describe(desc)
	_ = c.bar.Set(ev.Step)
}

// finish takes the bar down, leaving its last state on its own line.
func (c *runConsole) finish() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.bar == nil {
		return
	}
	fmt.Fprintln(c.out)
	c.bar = nil
}

// humanCount writes n with a unit: 253952 is "254K", 1.2e9 "1.20B".
func humanCount(n int) string {
	v := float64(n)
	switch {
	case v >= 1e12:
		return fmt.Sprintf("%.2fT", v/1e12)
	case v >= 1e9:
		return fmt.Sprintf("%.2fB", v/1e9)
	case v >= 1e6:
		return fmt.Sprintf("%.2fM", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%.0fK", v/1e3)
	}
	return fmt.Sprint(n)
}
