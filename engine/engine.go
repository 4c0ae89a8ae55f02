package engine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/registry"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/data"
)

// Engine trains one model as configured. It holds no global state: a
// process may run several engines.
type Engine struct {
	cfg     Config
	log     zerolog.Logger
	hooks   []func(StepEvent)
	metrics io.Writer
	backend backend.Backend
	// drivers are the accelerator backends train.backend may name
	// (WithDrivers); driver and device are the one the engine opened its
	// backend with and that backend, unwrapped (nil on the CPU and for a
	// backend given by WithBackend).
	drivers []registry.Driver
	driver  registry.Driver
	device  registry.Device
	wrap    func(backend.Backend) backend.Backend
	runDir  string
	// runDirLock is the run directory's lock when the caller took it
	// (WithRunDirLock); nil: Run takes it itself (rundir_lock.go).
	runDirLock *RunDirLock
	// metricsPath is the metrics.jsonl a run appends to (WithMetricsFile).
	metricsPath string
	// The recipe as the user wrote it, kept in checkpoints.
	recipe     []byte
	recipeHash string
	// tokenizer is the run's tokenizer (tokenizer.go); nil: byte-level.
	tokenizer *runTokenizer
	// startHooks and saveHooks take the run's other events (observers.go).
	startHooks []func(StartEvent)
	saveHooks  []func(SaveEvent)
	// tensorboard writes log.tensorboard's event files while a run
	// trains (tensorboard.go); nil otherwise.
	tensorboard *tensorboardRun
	// backendNotes say how New chose the backend (StartEvent).
	backendNotes []string
}

// Option configures an Engine.
type Option func(*Engine)

// WithLogger sends the engine's log lines to l (the default discards them).
// The engine logs from more than one goroutine (an asynchronous checkpoint
// writes in the background), so l's writer must be safe for concurrent use:
// wrap a plain io.Writer in zerolog.SyncWriter.
func WithLogger(l zerolog.Logger) Option { return func(e *Engine) { e.log = l } }

// WithHook calls h after every optimizer step, from the training goroutine:
// keep it quick, or hand the event to another goroutine. A hook that
// panics fails the run: Run recovers the panic and returns it as a
// *HookPanicError (the steps since the last checkpoint are not saved).
func WithHook(h func(StepEvent)) Option { return func(e *Engine) { e.hooks = append(e.hooks, h) } }

// WithMetrics writes one JSON object per logged step to w (metrics.jsonl).
func WithMetrics(w io.Writer) Option { return func(e *Engine) { e.metrics = w } }

// WithBackend runs on b instead of the backend the config names (for
// example cpu.New(backend.Float64) for gradient checks).
func WithBackend(b backend.Backend) Option { return func(e *Engine) { e.backend = b } }

// WithDrivers makes the accelerator backends of drivers available to
// train.backend, auto trying them in the order given (package backend/all
// has every driver: engine.WithDrivers(all.Drivers()...)). Without it the
// engine trains only on the CPU, which it always has: the engine imports
// no accelerator backend itself, so a program that needs none does not
// link one.
func WithDrivers(drivers ...registry.Driver) Option {
	return func(e *Engine) { e.drivers = append(e.drivers, drivers...) }
}

// WithBackendWrapper runs the engine on wrap(b), where b is the backend
// New picked (or the one WithBackend gave): for example a profiler
// (package backend/profile) that times every op. Close still closes b when
// the engine opened it. When the ranks take one GPU each (see Run), wrap
// is called once more for each GPU after the first.
func WithBackendWrapper(wrap func(backend.Backend) backend.Backend) Option {
	return func(e *Engine) { e.wrap = wrap }
}

// WithRunDir names the run directory, where checkpoints are kept. Run
// locks it for the run's life (LockRunDir): a second run on it, in this
// process or another, fails at once. Without it nothing is saved: Run
// logs a warning and sets Result.Unsaved.
func WithRunDir(dir string) Option { return func(e *Engine) { e.runDir = dir } }

// WithRunDirLock is WithRunDir(l.Dir()) for a caller that locked the run
// directory itself (LockRunDir) before writing its own files there; the
// caller unlocks it after Run.
func WithRunDirLock(l *RunDirLock) Option {
	return func(e *Engine) { e.runDir, e.runDirLock = l.Dir(), l }
}

// WithMetricsFile appends one JSON object per logged step to the file at
// path (a run directory's metrics.jsonl), as WithMetrics does to a writer.
// Before the first step, Run drops the file's lines of steps after the one
// it starts from (the checkpoint resumed from, or 0), so that a run
// resumed after a crash logs each step once.
func WithMetricsFile(path string) Option { return func(e *Engine) { e.metricsPath = path } }

// WithRecipe records the recipe's YAML snapshot and hash in checkpoints.
func WithRecipe(snapshot []byte, hash string) Option {
	return func(e *Engine) { e.recipe, e.recipeHash = snapshot, hash }
}

// ErrStopped is returned by Run when its context was cancelled; the run
// stopped cleanly between two steps (after saving a checkpoint, with a run
// directory), or before the first while the model was initialised (between
// two tensors or layers; then Result.Elapsed is 0).
var ErrStopped = errors.New("training stopped")

// New validates cfg and prepares an engine; no work starts before Run.
func New(cfg Config, opts ...Option) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	tok, err := loadTokenizer(cfg)
	if err != nil {
		return nil, err
	}
	e := &Engine{cfg: cfg, log: zerolog.Nop(), tokenizer: tok}
	for _, o := range opts {
		o(e)
	}
	if e.backend == nil {
		b, err := e.pickBackend()
		if err != nil {
			return nil, backendInputError(err)
		}
		e.backend = b
	}
	e.setDeterministic(e.backend)
	if e.wrap != nil {
		e.backend = e.wrap(e.backend)
	}
	return e, nil
}

// setDeterministic selects b's fixed-order ops when train.deterministic
// asks for them; a backend without the capability adds in a fixed order
// already (backend.Deterministic).
func (e *Engine) setDeterministic(b backend.Backend) {
	if d, ok := b.(backend.Deterministic); ok {
		d.SetDeterministic(e.cfg.Train.Deterministic)
	}
}

// Config returns the engine's configuration.
func (e *Engine) Config() Config { return e.cfg }

// BackendName is the name of the backend the engine trains on ("cpu",
// "cuda"), once New has resolved train.backend: auto.
func (e *Engine) BackendName() string { return e.backend.Name() }

// pickBackend opens the backend train.backend names: "cpu"; a driver's
// ("cuda"), which fails with the reason when its device cannot be used or
// the model exceeds its kernels' limits; or "auto": the first driver (of
// WithDrivers) whose device is there and whose limits the model fits, else
// the CPU with the reason logged.
func (e *Engine) pickBackend() (backend.Backend, error) {
	name := e.cfg.Train.Backend
	set, err := registry.NewSet(e.drivers...)
	if err != nil {
		return nil, fmt.Errorf("engine.WithDrivers: %w", err)
	}
	opened, err := set.Open(name, func(d registry.Driver) error { return unsupported(d, e.cfg) })
	var notLinked *registry.NotLinkedError
	switch {
	case errors.As(err, &notLinked):
		return nil, fmt.Errorf("train.backend: %s: %w: give engine.New its driver with engine.WithDrivers (package backend/all has every driver; the mktrain command links them all)", name, err)
	case err != nil:
		return nil, fmt.Errorf("train.backend: %s: %w", name, err)
	}
	for _, n := range opened.Notes {
		e.backendNotes = append(e.backendNotes, n.Text)
		if n.Warning {
			e.log.Warn().Msg(n.Text)
		} else {
			e.log.Info().Msg(n.Text)
		}
	}
	e.driver, e.device = opened.Driver, opened.Device
	return opened.Backend, nil
}

// unsupported says why c cannot train on d's backend, or returns nil: the
// router and attention kernels have size limits (Capabilities.Limits).
// Layouts of several ranks run there as virtual ranks on the one device.
func unsupported(d registry.Driver, c Config) error {
	lim, kind := d.Capabilities().Limits, strings.ToUpper(d.Name())
	if m := c.Model.MoE; (lim.RouterMaxExperts > 0 && m.Experts > lim.RouterMaxExperts) || (lim.RouterMaxTopK > 0 && m.TopK > lim.RouterMaxTopK) {
		return &limitError{fmt.Sprintf("model.moe.experts is %d and model.moe.top_k %d: the %s router handles at most %d experts and top-%d",
			m.Experts, m.TopK, kind, lim.RouterMaxExperts, lim.RouterMaxTopK)}
	}
	if dh := c.Model.HeadDim(); lim.AttnMaxHeadDim > 0 && dh > lim.AttnMaxHeadDim {
		return &limitError{fmt.Sprintf("the head dim (model.dim / model.heads) is %d: the %s attention kernels take at most %d", dh, kind, lim.AttnMaxHeadDim)}
	}
	return nil
}

// mesh is the parallel layout as a comm.Mesh.
func (c Config) mesh() comm.Mesh {
	return comm.Mesh{DP: c.Parallel.DP, EP: c.Parallel.EP, CP: c.Parallel.CP, TP: c.Parallel.TP}
}

// Close releases the backend the engine opened itself (the device of
// train.backend: cuda, or of auto); a backend given by WithBackend stays
// open. The engine must not be used afterwards.
func (e *Engine) Close() error {
	if e.device == nil {
		return nil
	}
	err := e.device.Close()
	e.device = nil
	return err
}

// Result sums up a finished (or stopped) run.
type Result struct {
	StartStep int           // steps already done when Run began (resumed runs)
	Steps     int           // optimizer steps completed, StartStep included
	Loss      float64       // training loss of the last step (NaN when none ran)
	ValLoss   float64       // last validation loss (NaN when none ran)
	Tokens    int64         // tokens trained on, those before StartStep included
	Elapsed   time.Duration // wall time of the training loop
	// Dispatcher is the MoE dispatcher the ranks trained with:
	// model.moe.dispatcher with auto settled ("fused" or "unfused").
	Dispatcher string
	// Checkpoint is the run directory's newest checkpoint when Run
	// returned (on node 0 of a distributed run): the last one this run
	// saved, or else the one it resumed from; "" when there is none.
	Checkpoint string
	// Unsaved is true when the run had no run directory (WithRunDir): it
	// saved no checkpoint, so what it trained is lost when the process
	// ends and a stopped run cannot be resumed. Run logs a warning
	// saying so before it builds the model.
	Unsaved bool
}

// Run trains until the configured number of steps or until ctx is
// cancelled, in which case it returns the result so far and ErrStopped.
// On a backend whose driver places one rank per device (the CUDA backend:
// registry.RankPerDevice) a layout of W ranks trains on W GPUs, one rank
// each with NCCL between them, when W GPUs are visible, and as virtual
// ranks on GPU 0 otherwise (placement.go).
func (e *Engine) Run(ctx context.Context) (Result, error) {
	// The memory plan before anything large is allocated (plan.go).
	deviceRanks, err := e.ranksPerDevice()
	if err != nil {
		return Result{}, err
	}
	if err := e.checkPlan(e.cfg.mesh().World(), deviceRanks); err != nil {
		return Result{}, err
	}
	unlock, err := e.holdRunDir(0)
	if err != nil {
		return Result{}, err
	}
	defer unlock()
	world, backends, release, err := e.placeRanks()
	if err != nil {
		return Result{}, err
	}
	res, err := e.runWorld(ctx, world, backends, false, nil)
	if rerr := release(); rerr != nil {
		e.log.Warn().Err(rerr).Msg("closing the GPUs of the ranks")
	}
	return res, err
}

// openData opens the training and validation batches of one data rank: the
// recipe's shards, or the embedded corpus when no glob is given.
func (e *Engine) openData(rank, ranks int) (batchSource, evalSource, error) {
	c := e.cfg
	if c.Data.Train == "" {
		if c.Data.Val != "" {
			return nil, nil, fmt.Errorf("data.val is set but data.train is empty; set both or neither")
		}
		if c.Model.Vocab < 256 {
			return nil, nil, fmt.Errorf("model.vocab (%d) must be at least 256 for the embedded byte-level corpus", c.Model.Vocab)
		}
		train, val, err := data.DefaultSources(c.Train.Seq, c.Model.Vocab, c.Train.Seed, rank, ranks)
		return train, val, err
	}
	train, err := data.NewLoader(c.Data.Train, c.Train.Seq, c.Model.Vocab, c.Train.Seed, rank, ranks)
	if err != nil {
		return nil, nil, fmt.Errorf("data.train: %w", err)
	}
	valGlob := c.Data.Val
	if valGlob == "" {
		return nil, nil, fmt.Errorf("data.val is empty; name the validation shards (data.val) too")
	}
	val, err := data.NewEvalLoader(valGlob, c.Train.Seq, c.Model.Vocab, rank, ranks)
	if err != nil {
		return nil, nil, fmt.Errorf("data.val: %w", err)
	}
	return train, val, nil
}

// ParamCount is the number of model parameters (all experts).
func ParamCount(m ModelConfig) int {
	D, F, E := m.Dim, m.MoE.FFN, m.MoE.Experts
	Q, KD := m.Dim, m.KVHeads*m.HeadDim()
	perLayer := 2*D + 2*Q*D + 2*KD*D + E*D + 3*E*F*D + m.MoE.SharedExperts*3*F*D
	return 2*m.Vocab*D + D + m.Layers*perLayer
}
