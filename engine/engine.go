package engine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"time"

	"github.com/rs/zerolog"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
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
	runDir  string
	// The recipe as the user wrote it, kept in checkpoints.
	recipe     []byte
	recipeHash string
}

// Option configures an Engine.
type Option func(*Engine)

// WithLogger sends the engine's log lines to l (the default discards them).
func WithLogger(l zerolog.Logger) Option { return func(e *Engine) { e.log = l } }

// WithHook calls h after every optimizer step, from the training goroutine:
// keep it quick, or hand the event to another goroutine.
func WithHook(h func(StepEvent)) Option { return func(e *Engine) { e.hooks = append(e.hooks, h) } }

// WithMetrics writes one JSON object per logged step to w (metrics.jsonl).
func WithMetrics(w io.Writer) Option { return func(e *Engine) { e.metrics = w } }

// WithBackend runs on b instead of the backend the config names (for
// example cpu.New(backend.Float64) for gradient checks).
func WithBackend(b backend.Backend) Option { return func(e *Engine) { e.backend = b } }

// WithRunDir names the run directory, where checkpoints are kept.
func WithRunDir(dir string) Option { return func(e *Engine) { e.runDir = dir } }

// WithRecipe records the recipe's YAML snapshot and hash in checkpoints.
func WithRecipe(snapshot []byte, hash string) Option {
	return func(e *Engine) { e.recipe, e.recipeHash = snapshot, hash }
}

// ErrStopped is returned by Run when its context was cancelled; the run
// stopped cleanly between two steps.
var ErrStopped = errors.New("training stopped")

// New validates cfg and prepares an engine; no work starts before Run.
func New(cfg Config, opts ...Option) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	e := &Engine{cfg: cfg, log: zerolog.Nop()}
	for _, o := range opts {
		o(e)
	}
	if e.backend == nil {
		b, err := e.pickBackend()
		if err != nil {
			return nil, err
		}
		e.backend = b
	}
	return e, nil
}

// Config returns the engine's configuration.
func (e *Engine) Config() Config { return e.cfg }

func (e *Engine) pickBackend() (backend.Backend, error) {
	switch e.cfg.Train.Backend {
	case "cuda":
		return nil, fmt.Errorf("train.backend: cuda: this build of mktrain has no CUDA backend yet; set train.backend: cpu")
	case "auto":
		e.log.Info().Msg("backend auto: no CUDA backend in this build, training on the CPU")
	}
	return cpu.New(backend.Float32), nil
}

// Result sums up a finished (or stopped) run.
type Result struct {
	Steps   int           // optimizer steps completed
	Loss    float64       // training loss of the last step
	ValLoss float64       // last validation loss (NaN when none ran)
	Tokens  int64         // tokens trained on
	Elapsed time.Duration // wall time of the training loop
}

// Run trains until the configured number of steps or until ctx is
// cancelled, in which case it returns the result so far and ErrStopped.
func (e *Engine) Run(ctx context.Context) (Result, error) {
	cfg := e.cfg
	mesh := comm.Mesh{DP: cfg.Parallel.DP, EP: cfg.Parallel.EP, CP: cfg.Parallel.CP, TP: cfg.Parallel.TP}
	world, err := comm.NewLocal(mesh)
	if err != nil {
		return Result{}, err
	}
	ranks := make([]*rank, len(world))
	for i, g := range world {
		train, val, err := e.openData(g.Data.Rank(), g.Data.Size())
		if err != nil {
			return Result{}, err
		}
		if ranks[i], err = newRank(cfg, e.backend, g, train, val); err != nil {
			return Result{}, fmt.Errorf("rank %d: %w", i, err)
		}
	}
	s := &session{e: e, ranks: ranks, world: world, snaps: make([]rankSnapshot, len(ranks))}
	if e.runDir != "" {
		root := filepath.Join(e.runDir, "checkpoints")
		s.saver = &saver{e: e, root: root}
		dir, st, err := e.resumePoint(root)
		if err != nil {
			return Result{}, err
		}
		if dir != "" {
			if err := restoreAll(dir, st, ranks); err != nil {
				return Result{}, fmt.Errorf("resuming from %s: %w", dir, err)
			}
			s.resume = st
			e.log.Info().Str("checkpoint", dir).Int("step", st.Step).Msg("resuming")
		}
	}
	if s.resume == nil && cfg.Checkpoint.InitFrom != "" {
		if err := e.loadHF(cfg.Checkpoint.InitFrom, ranks); err != nil {
			return Result{}, err
		}
	}
	e.log.Info().Int("ranks", len(ranks)).Str("backend", e.backend.Name()).
		Int("params", ParamCount(cfg.Model)).Int("steps", cfg.Train.Steps).Msg("training starts")
	return s.run(ctx)
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
