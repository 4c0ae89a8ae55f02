package engine

// The training loop. Every rank runs loop in its own goroutine; rank 0 also
// reports and writes checkpoints. Read top to bottom: decide whether to
// stop, train one step, evaluate when due, report, save when due.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime/debug"
	"slices"
	"sync"
	"time"

	"github.com/mktrain/mktrain/comm"
)

// session is one Run's shared state across its ranks.
type session struct {
	e      *Engine
	ranks  []*rank
	world  []*comm.Ranks
	start  time.Time
	resume *trainState    // nil for a fresh run
	saver  *saver         // nil without a run directory
	snaps  []rankSnapshot // filled by every rank at a save, handed over by rank 0
}

func (s *session) run(ctx context.Context) (Result, error) {
	var (
		wg      sync.WaitGroup
		errOnce sync.Once
		first   error
		result  Result
	)
	fail := func(err error) {
		errOnce.Do(func() {
			first = err
			// Wake every rank blocked in a collective so none waits for
			// the one that failed.
			for _, g := range s.world {
				g.Abort(err)
			}
		})
	}
	s.start = time.Now()
	for i, r := range s.ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() {
				if p := recover(); p != nil {
					fail(fmt.Errorf("rank %d: internal error: %v\n%s", i, p, debug.Stack()))
				}
			}()
			res, err := s.loop(ctx, r, i)
			if i == 0 {
				result = res
			}
			switch {
			case err == nil:
			case errors.Is(err, ErrStopped):
				if i == 0 {
					fail(err)
				}
			default:
				fail(fmt.Errorf("rank %d: %w", i, err))
			}
		}()
	}
	wg.Wait()
	if s.saver != nil {
		if err := s.saver.wait(); err != nil && (first == nil || errors.Is(first, ErrStopped)) {
			first = err
		}
	}
	result.Elapsed = time.Since(s.start)
	// The first error is the cause; ranks woken by the abort report later
	// and are ignored.
	return result, first
}

// loop is one rank's training loop.
func (s *session) loop(ctx context.Context, r *rank, worldRank int) (Result, error) {
	cfg := s.e.cfg
	lead := worldRank == 0
	res := Result{Loss: math.NaN(), ValLoss: math.NaN()}
	if s.resume != nil {
		res.StartStep, res.Steps, res.Tokens = s.resume.Step, s.resume.Step, s.resume.Tokens
	}
	firstStep := res.Steps + 1
	lastSaved := res.Steps
	tokensPerStep := int64(cfg.Train.GlobalBatch * cfg.Train.Seq)
	for step := firstStep; step <= cfg.Train.Steps; step++ {
		// Every rank stops at the same step: rank 0 reads the context and
		// the others learn its decision through the world group.
		stop := []float64{0}
		if lead && ctx.Err() != nil {
			stop[0] = 1
		}
		if err := r.groups.World.AllReduceFloat64(stop); err != nil {
			return res, err
		}
		if stop[0] > 0 {
			if res.Steps > lastSaved {
				if err := s.checkpoint(r, worldRank, res); err != nil {
					return res, err
				}
			}
			return res, ErrStopped
		}

		t0 := time.Now()
		sr, err := r.trainStep(step)
		if err != nil {
			return res, err
		}
		stepTime := time.Since(t0)
		res.Steps, res.Loss = step, sr.loss
		res.Tokens += tokensPerStep

		ev := StepEvent{
			Step: step, Steps: cfg.Train.Steps, Loss: sr.loss, AuxLoss: sr.auxLoss, ZLoss: sr.zLoss,
			LR: sr.lr, GradNorm: sr.gradNorm, Tokens: res.Tokens,
			TokensPerSec: float64(tokensPerStep) / stepTime.Seconds(),
			Elapsed:      time.Since(s.start), ValLoss: math.NaN(),
			Experts: expertLoads(sr),
		}
		if (cfg.Train.EvalEvery > 0 && step%cfg.Train.EvalEvery == 0) || step == cfg.Train.Steps {
			v, err := r.evaluate()
			if err != nil {
				return res, err
			}
			res.ValLoss, ev.ValLoss = v, v
		}
		if lead {
			s.e.report(ev)
		}
		if every := cfg.Checkpoint.Every; (every > 0 && step%every == 0) || step == cfg.Train.Steps {
			if err := s.checkpoint(r, worldRank, res); err != nil {
				return res, err
			}
			lastSaved = step
		}
	}
	return res, nil
}

// checkpoint saves the state after res.Steps. Every rank snapshots its
// share; rank 0 hands them to the saver. Without a run directory it does
// nothing.
func (s *session) checkpoint(r *rank, worldRank int, res Result) error {
	if s.saver == nil {
		return nil
	}
	s.snaps[worldRank] = r.snapshot(worldRank)
	if err := r.groups.World.Barrier(); err != nil {
		return err
	}
	if worldRank == 0 {
		cfg := s.e.cfg
		st := trainState{
			Step: res.Steps, Tokens: res.Tokens, LR: learningRate(cfg.Train, res.Steps),
			Config: cfg, Recipe: string(s.e.recipe), RecipeHash: s.e.recipeHash,
			Mesh:    comm.Mesh{DP: cfg.Parallel.DP, EP: cfg.Parallel.EP, CP: cfg.Parallel.CP, TP: cfg.Parallel.TP},
			Backend: s.e.backend.Name(), Version: Version,
		}
		if err := s.saver.save(slices.Clone(s.snaps), st); err != nil {
			return fmt.Errorf("checkpoint of step %d: %w", res.Steps, err)
		}
	}
	// Nobody refills the snapshots before rank 0 has handed them over.
	return r.groups.World.Barrier()
}

// report hands a step to the hooks, the metrics file and the log.
func (e *Engine) report(ev StepEvent) {
	for _, h := range e.hooks {
		h(ev)
	}
	every := e.cfg.Log.Every
	logged := ev.Step == 1 || ev.Step == ev.Steps || (every > 0 && ev.Step%every == 0) || !math.IsNaN(ev.ValLoss)
	if !logged {
		return
	}
	if e.metrics != nil {
		if err := writeMetrics(e.metrics, ev); err != nil {
			e.log.Warn().Err(err).Msg("cannot write metrics")
		}
	}
	l := e.log.Info().Int("step", ev.Step).Float64("loss", round4(ev.Loss)).Str("lr", fmt.Sprintf("%.3g", ev.LR)).
		Float64("grad_norm", round4(ev.GradNorm)).Float64("tokens_per_s", math.Round(ev.TokensPerSec))
	if !math.IsNaN(ev.ValLoss) {
		l = l.Float64("val_loss", round4(ev.ValLoss))
	}
	l.Msg("step")
}

func round4(x float64) float64 { return math.Round(x*1e4) / 1e4 }
