package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/rs/zerolog"
	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/recipes"
)

var (
	errHelp        = errors.New("help requested")
	errInterrupted = errors.New("interrupted")
)

// setFlags collects repeated --set key.path=value flags.
type setFlags []string

func (s *setFlags) String() string     { return strings.Join(*s, ",") }
func (s *setFlags) Set(v string) error { *s = append(*s, v); return nil }

// parseInterspersed parses flags that may come before or after positional
// arguments (mktrain run RECIPE --set a=b).
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, errHelp
			}
			return nil, usageError{err.Error()}
		}
		args = fs.Args()
		if len(args) == 0 {
			return positional, nil
		}
		positional = append(positional, args[0])
		args = args[1:]
	}
}

func newFlagSet(name, usage string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	return fs
}

const runUsage = `Usage: mktrain run RECIPE [--set key.path=value]... [--run-dir DIR]

Trains the model a recipe describes. RECIPE is a YAML file or the name of a
shipped recipe (tiny, moe-small). The run directory receives recipe.yaml (the
effective recipe), train.log and metrics.jsonl. Ctrl-C stops between two steps.

Flags:
`

func cmdRun(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("run", runUsage, stderr)
	var sets setFlags
	fs.Var(&sets, "set", "override a recipe field, e.g. --set train.lr=3e-4 (repeatable)")
	runDir := fs.String("run-dir", "", "run directory (default runs/<recipe name>)")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		fs.Usage()
		return usageError{"run takes exactly one recipe"}
	}
	cfg, snapshot, err := recipes.Load(pos[0], sets)
	if err != nil {
		return err
	}
	if *runDir == "" {
		*runDir = filepath.Join("runs", strings.TrimSuffix(filepath.Base(pos[0]), filepath.Ext(pos[0])))
	}
	if err := os.MkdirAll(*runDir, 0o755); err != nil {
		return fmt.Errorf("run directory: %w", err)
	}
	if err := os.WriteFile(filepath.Join(*runDir, "recipe.yaml"), snapshot, 0o644); err != nil {
		return fmt.Errorf("run directory: %w", err)
	}
	logFile, err := os.OpenFile(filepath.Join(*runDir, "train.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("run directory: %w", err)
	}
	defer logFile.Close()
	metricsFile, err := os.OpenFile(filepath.Join(*runDir, "metrics.jsonl"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("run directory: %w", err)
	}
	defer metricsFile.Close()

	level, err := zerolog.ParseLevel(cfg.Log.Level)
	if err != nil {
		return fmt.Errorf("log.level: %w", err)
	}
	bar := progressBar(cfg, stderr)
	console := io.Writer(zerolog.ConsoleWriter{Out: stderr, NoColor: bar == nil, TimeFormat: time.TimeOnly})
	consoleLevel := level
	if bar != nil {
		// The bar owns the terminal; only warnings and errors interrupt it.
		consoleLevel = max(level, zerolog.WarnLevel)
	}
	// The engine logs from its training goroutine and from a background
	// checkpoint writer: the writer must take one line at a time.
	logger := zerolog.New(zerolog.SyncWriter(zerolog.MultiLevelWriter(
		levelWriter{logFile, level},
		levelWriter{console, consoleLevel},
	))).With().Timestamp().Logger()
	logger.Info().Str("recipe", pos[0]).Str("run_dir", *runDir).Str("version", versionString()).Msg("mktrain run")

	opts := []engine.Option{engine.WithLogger(logger), engine.WithMetrics(metricsFile), engine.WithRunDir(*runDir),
		engine.WithRecipe(snapshot, recipes.Hash(cfg))}
	if bar != nil {
		opts = append(opts, engine.WithHook(func(ev engine.StepEvent) {
			desc := fmt.Sprintf("loss %.4f  %.0f tok/s", ev.Loss, ev.TokensPerSec)
			if !math.IsNaN(ev.ValLoss) {
				desc += fmt.Sprintf("  val %.4f", ev.ValLoss)
			}
			bar.Describe(desc)
			_ = bar.Set(ev.Step)
		}))
	}
	eng, err := engine.New(cfg, opts...)
	if err != nil {
		return err
	}
	defer eng.Close()
	res, err := eng.Run(ctx)
	if bar != nil {
		_ = bar.Finish()
		fmt.Fprintln(stderr)
	}
	trained := res.Steps - res.StartStep
	summary := fmt.Sprintf("%d steps, %d tokens in %s (%.0f tokens/s); loss %.4f",
		res.Steps, res.Tokens, res.Elapsed.Round(time.Millisecond),
		float64(int64(trained*cfg.Train.GlobalBatch*cfg.Train.Seq))/res.Elapsed.Seconds(), res.Loss)
	if !math.IsNaN(res.ValLoss) {
		summary += fmt.Sprintf(", val loss %.4f", res.ValLoss)
	}
	if err == nil && trained == 0 && res.StartStep > 0 {
		summary = fmt.Sprintf("the run in %s is already complete at step %d; raise train.steps to train further, or use another --run-dir",
			*runDir, res.StartStep)
	}
	switch {
	case errors.Is(err, engine.ErrStopped):
		logger.Warn().Int("step", res.Steps).Msg("stopped")
		fmt.Fprintln(stdout, summary)
		return fmt.Errorf("%w: stopped after step %d", errInterrupted, res.Steps)
	case err != nil:
		logger.Error().Err(err).Msg("run failed")
		return err
	}
	fmt.Fprintln(stdout, summary)
	return nil
}

// progressBar returns a bar on a terminal (or when log.progress is on), nil
// otherwise.
func progressBar(cfg engine.Config, stderr io.Writer) *progressbar.ProgressBar {
	show := false
	switch cfg.Log.Progress {
	case "on":
		show = true
	case "auto":
		f, ok := stderr.(*os.File)
		show = ok && term.IsTerminal(int(f.Fd()))
	}
	if !show {
		return nil
	}
	return progressbar.NewOptions(cfg.Train.Steps,
		progressbar.OptionSetWriter(stderr),
		progressbar.OptionSetDescription("starting"),
		progressbar.OptionShowCount(),
		progressbar.OptionSetPredictTime(true),
		progressbar.OptionSetWidth(30),
		progressbar.OptionThrottle(100*time.Millisecond),
	)
}

// levelWriter filters one output of a multi-writer logger by level.
type levelWriter struct {
	w     io.Writer
	level zerolog.Level
}

func (l levelWriter) Write(p []byte) (int, error) { return l.w.Write(p) }

func (l levelWriter) WriteLevel(level zerolog.Level, p []byte) (int, error) {
	if level < l.level {
		return len(p), nil
	}
	return l.w.Write(p)
}
