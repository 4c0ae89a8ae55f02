package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/mktrain/mktrain/backend/all"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/internal/atomicfile"
	"github.com/mktrain/mktrain/launch"
	"github.com/mktrain/mktrain/observe/prom"
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
// arguments (mktrain run RECIPE --set a=b). On -h or --help it returns a
// *helpRequest, whose usage run prints on stdout; a bad flag's error and
// the usage go to the FlagSet's output (stderr).
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	out := fs.Output()
	fs.SetOutput(io.Discard) // the flag package would print the usage of -h there too
	defer fs.SetOutput(out)
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			fs.SetOutput(out)
			if errors.Is(err, flag.ErrHelp) {
				return nil, &helpRequest{fs}
			}
			fmt.Fprintln(out, err) // as the flag package does
			fs.Usage()
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

// newFlagSet is a command's flags: its Usage prints usage and every flag
// to the FlagSet's output, stderr (stdout for -h: helpRequest).
func newFlagSet(name, usage string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usage)
		fs.PrintDefaults()
	}
	return fs
}

// helpRequest is parseInterspersed's answer to -h or --help: it is
// errHelp, and carries the command's flags for exitStatus to print its
// usage on stdout.
type helpRequest struct{ fs *flag.FlagSet }

func (h *helpRequest) Error() string        { return errHelp.Error() }
func (h *helpRequest) Is(target error) bool { return target == errHelp }

// print writes the command's usage and flags to w.
func (h *helpRequest) print(w io.Writer) {
	out := h.fs.Output()
	h.fs.SetOutput(w)
	h.fs.Usage()
	h.fs.SetOutput(out)
}

const runUsage = `Usage: mktrain run RECIPE [--set key.path=value]... [--run-dir DIR] [--metrics-addr HOST:PORT]
                  [--nnodes N --node-rank K --master-addr HOST [--master-port P]]
                  [--rendezvous-timeout D] [--secret-file F] [--bind ADDR]

Trains the model a recipe describes. RECIPE is a YAML file or the name of a
shipped recipe (tiny, moe-small, moe-fine, moe-large, long-context). The run directory receives recipe.yaml (the
effective recipe), train.log and metrics.jsonl (and TensorBoard event files
with log.tensorboard: true). On a terminal a banner describes the run and a
progress bar follows it, with warnings printed above the bar; otherwise each
logged step is a line: step n/N, loss, lr, tokens/s, MFU, memory, ETA.
--metrics-addr serves Prometheus metrics at /metrics and Go's profiler at
/debug/pprof/ while the run lasts (port 0 picks a free port; the address is
printed). Ctrl-C (or SIGTERM) stops after the current step and saves a
checkpoint (exit 130, or 143); a second Ctrl-C exits at once.

Several nodes: start one process per node with the same recipe, the node
count and each its node rank (flags, torchrun's NNODES/NODE_RANK/MASTER_ADDR/
MASTER_PORT, or SLURM's variables). Node 0 holds the rendezvous; each node
trains parallel.dp*ep*cp*tp / nnodes ranks: on the CPU backend over TCP,
on the CUDA backend one GPU per rank with NCCL between the nodes. Node 0 writes metrics.jsonl and the
checkpoints; node K > 0 logs to train.node<K>.log. To resume, every node
must see node 0's checkpoints (a shared run directory). Every node must be
given the same secret (MKTRAIN_SECRET, MKTRAIN_SECRET_FILE or --secret-file;
without one node 0 generates one and prints it): a connection that does not
prove it knows it is dropped. See docs/launch.md.

Flags:
`

func cmdRun(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("run", runUsage, stderr)
	var sets setFlags
	fs.Var(&sets, "set", "override a recipe field, e.g. --set train.lr=3e-4 (repeatable)")
	runDir := fs.String("run-dir", "", "run directory (default runs/<recipe name>)")
	metricsAddr := fs.String("metrics-addr", "", "serve Prometheus metrics (/metrics) and pprof (/debug/pprof/) on HOST:PORT while the run lasts")
	var launchFlags launch.Flags
	launchFlags.Register(fs)
	rdvTimeout := fs.Duration("rendezvous-timeout", launch.DefaultRendezvousTimeout, "multi-node: how long the nodes wait for each other to start")
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
	launch, err := launch.FromEnv(os.Getenv, launchFlags)
	if err != nil {
		return err
	}
	if launch, err = launch.WithSecret(os.Getenv, launchFlags.SecretFile); err != nil {
		return err
	}
	if hint := launch.SecretHint(); hint != "" {
		fmt.Fprintln(stderr, "mktrain: "+hint)
	}
	if launch.MultiNode() {
		p := cfg.Parallel
		if world := p.DP * p.EP * p.CP * p.TP; world%launch.NNodes != 0 {
			return fmt.Errorf("parallel: dp %d x ep %d x cp %d x tp %d = %d ranks do not split evenly over %s; choose a layout whose rank count is a multiple of the node count",
				p.DP, p.EP, p.CP, p.TP, world, nodesOrigin(launch))
		}
		launch.LocalRanks = p.DP * p.EP * p.CP * p.TP / launch.NNodes
	}
	if *runDir == "" {
		*runDir = filepath.Join("runs", strings.TrimSuffix(filepath.Base(pos[0]), filepath.Ext(pos[0])))
	}
	if err := os.MkdirAll(*runDir, 0o755); err != nil {
		return fmt.Errorf("run directory: %w", err)
	}
	// Before writing there: a second run on the directory is refused at
	// once, naming the holder (each node locks its own file).
	runDirLock, err := engine.LockRunDir(*runDir, launch.NodeRank)
	if err != nil {
		return err
	}
	defer runDirLock.Unlock()
	// Node 0 owns the run directory's shared files; the other nodes keep
	// their own log beside them (the directory may be shared).
	logName := "train.log"
	if launch.NodeRank > 0 {
		logName = fmt.Sprintf("train.node%d.log", launch.NodeRank)
	}
	logFile, err := os.OpenFile(filepath.Join(*runDir, logName), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("run directory: %w", err)
	}
	defer logFile.Close()

	level, err := zerolog.ParseLevel(cfg.Log.Level)
	if err != nil {
		return fmt.Errorf("log.level: %w", err)
	}
	screen := newRunConsole(cfg, stderr, pos[0])
	if launch.NodeRank > 0 {
		// Only node 0 hears the steps (world rank 0 reports them): the
		// other nodes print their log lines instead of a bar that would
		// never move.
		screen.useBar = false
	}
	console := io.Writer(zerolog.ConsoleWriter{Out: screen, NoColor: !screen.useBar, TimeFormat: time.TimeOnly,
		FieldsOrder: engine.StepLogFields()})
	consoleLevel := level
	if screen.useBar {
		// The banner and the bar tell what the info lines would; warnings
		// and errors are printed above the bar.
		consoleLevel = max(level, zerolog.WarnLevel)
	}
	// The engine logs from its training goroutine and from a background
	// checkpoint writer: the writer must take one line at a time.
	logger := zerolog.New(zerolog.SyncWriter(zerolog.MultiLevelWriter(
		levelWriter{logFile, level},
		levelWriter{console, consoleLevel},
	))).With().Timestamp().Logger()
	logger.Info().Str("recipe", pos[0]).Str("run_dir", *runDir).Str("version", versionString()).Str("launch", launch.String()).Msg("mktrain run")
	// The run's error goes to train.log only: the command prints it on
	// stderr itself as it exits (after the engine's goroutines are done, so
	// nothing else writes to the file then).
	fileLog := zerolog.New(levelWriter{logFile, level}).With().Timestamp().Logger()

	opts := []engine.Option{engine.WithDrivers(all.Drivers()...), engine.WithLogger(logger), engine.WithRunDirLock(runDirLock),
		engine.WithRecipe(snapshot, recipes.Hash(cfg))}
	if launch.NodeRank == 0 { // only world rank 0 reports steps
		metricsFile := filepath.Join(*runDir, "metrics.jsonl")
		opts = append(opts, engine.WithMetricsFile(metricsFile))
		screen.addSink("metrics.jsonl: " + metricsFile)
		if cfg.Log.TensorBoard {
			screen.addSink("TensorBoard: tensorboard --logdir " + *runDir)
		}
	}
	if *metricsAddr != "" {
		collector := prom.NewCollector()
		server, err := serveMetrics(*metricsAddr, collector, logger)
		if err != nil {
			return err
		}
		defer server.stop()
		fmt.Fprintf(stderr, "mktrain: metrics at %s, profiles at %s\n", server.url("/metrics"), server.url("/debug/pprof/"))
		screen.addSink("Prometheus: " + server.url("/metrics"))
		opts = append(opts, collector.Options()...)
	}
	if launch.NodeRank == 0 {
		// recipe.yaml is the recipe of the run in the directory: written
		// once the engine has accepted it (memory plan, resume, data), so
		// a refused recipe leaves the directory's as it was.
		recipePath := filepath.Join(*runDir, "recipe.yaml")
		opts = append(opts, engine.WithStartHook(func(engine.StartEvent) {
			if err := atomicfile.WriteFile(recipePath, func(w io.Writer) error { _, err := w.Write(snapshot); return err }); err != nil {
				logger.Warn().Err(err).Msg("could not write the recipe into the run directory")
			}
		}))
	}
	opts = append(opts, screen.options()...)
	eng, err := engine.New(cfg, opts...)
	if err != nil {
		return err
	}
	defer eng.Close()
	var res engine.Result
	if launch.MultiNode() {
		res, err = runMultiNode(ctx, eng, launch, recipes.Hash(cfg), *rdvTimeout, logger)
	} else {
		res, err = eng.Run(ctx)
	}
	screen.finish()
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
	case errors.Is(err, engine.ErrStopped) && res.Elapsed == 0:
		// Stopped while the model was built, before the first step.
		logger.Warn().Msg("stopped before training started")
		return stoppedError(ctx, "stopped before training started")
	case errors.Is(err, engine.ErrStopped):
		logger.Warn().Int("step", res.Steps).Msg("stopped")
		fmt.Fprintln(stdout, summary)
		return stoppedError(ctx, fmt.Sprintf("stopped after step %d", res.Steps))
	case err != nil:
		fileLog.Error().Err(err).Msg("run failed")
		return failedRun(err) // exit 1, unless the engine found bad input first (exit 2)
	}
	fmt.Fprintln(stdout, summary)
	return nil
}

// runMultiNode trains this node's share of a multi-node run: it opens the
// data listener, meets the other nodes at the rendezvous (which checks that
// all run the same recipe and version, and publishes every node's data
// port), then trains: over TCP between the nodes on the CPU, over NCCL on
// CUDA.
func runMultiNode(ctx context.Context, eng *engine.Engine, node launch.Launch, recipeHash string, timeout time.Duration, logger zerolog.Logger) (engine.Result, error) {
	// Node 0 of a CUDA run puts the NCCL unique id in the blob.
	blob, err := eng.RendezvousBlob(node.NodeRank)
	if err != nil {
		return engine.Result{}, fmt.Errorf("node %d: %w", node.NodeRank, err)
	}
	// On --bind (node 0: the master address), else every interface: the
	// other nodes reach this one at the address the rendezvous saw it
	// connect from.
	ln, err := net.Listen("tcp", net.JoinHostPort(node.Bind, "0"))
	if err != nil {
		return engine.Result{}, fmt.Errorf("node %d: cannot open a port for the other nodes' data connections: %w", node.NodeRank, err)
	}
	logger.Info().Str("launch", node.String()).Msg("waiting for the other nodes")
	rdv, err := launch.Join(ctx, launch.RendezvousConfig{
		Launch: node, RecipeHash: recipeHash, Version: versionString(),
		Blob: blob, DataPort: ln.Addr().(*net.TCPAddr).Port, Timeout: timeout,
	})
	if err != nil {
		ln.Close()
		return engine.Result{}, err
	}
	defer rdv.Close()
	addrs, err := launch.DataAddrs(rdv.Nodes())
	if err != nil {
		ln.Close()
		rdv.Abort(err)
		return engine.Result{}, err
	}
	return eng.RunDistributed(ctx, engine.Distributed{
		TCP: comm.TCPConfig{
			NodeRank: node.NodeRank, Addrs: addrs, Listener: ln,
			RunID: comm.RunIDFromBlob(rdv.Blob()), Secret: node.Secret, DialTimeout: timeout,
		},
		Rendezvous: rdv,
	})
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

// nodesOrigin names the node count for an error: "2 nodes (node count
// from flags)".
func nodesOrigin(l launch.Launch) string {
	return fmt.Sprintf("%d nodes (node count from %s)", l.NNodes, l.Source)
}
