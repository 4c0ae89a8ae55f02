package engine

// The training loop. Every rank runs loop in its own goroutine; rank 0 also
// reports. Read top to bottom: decide whether to stop, train one step,
// evaluate when due, report.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime/debug"
	"sync"
	"time"

	"github.com/mktrain/mktrain/comm"
)

func (e *Engine) train(ctx context.Context, ranks []*rank, world []*comm.Ranks) (Result, error) {
	var (
		wg      sync.WaitGroup
		errOnce sync.Once
		first   error
		result  Result
	)
	fail := func(err error) {
		errOnce.Do(func() {
			first = err
			// Wake every rank blocked in a collective so none waits
			// for the one that failed.
			for _, g := range world {
				g.Abort(err)
			}
		})
	}
	start := time.Now()
	for i, r := range ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() {
				if p := recover(); p != nil {
					fail(fmt.Errorf("rank %d: internal error: %v\n%s", i, p, debug.Stack()))
				}
			}()
			res, err := e.loop(ctx, r, i == 0, start)
			if err != nil && !errors.Is(err, ErrStopped) {
				fail(fmt.Errorf("rank %d: %w", i, err))
				return
			}
			if i == 0 {
				result = res
				if err != nil {
					fail(err)
				}
			}
		}()
	}
	wg.Wait()
	result.Elapsed = time.Since(start)
	// The first error is the cause; ranks woken by the abort report later
	// and are ignored.
	return result, first
}

// loop is one rank's training loop.
func (e *Engine) loop(ctx context.Context, r *rank, lead bool, start time.Time) (Result, error) {
	cfg := e.cfg
	res := Result{ValLoss: math.NaN()}
	tokensPerStep := int64(cfg.Train.GlobalBatch * cfg.Train.Seq)
	for step := 1; step <= cfg.Train.Steps; step++ {
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
			Elapsed:      time.Since(start), ValLoss: math.NaN(),
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
			e.report(ev)
		}
	}
	return res, nil
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
	l := e.log.Info().Int("step", ev.Step).Float64("loss", round4(ev.Loss)).Float64("lr", ev.LR).
		Float64("grad_norm", round4(ev.GradNorm)).Float64("tokens_per_s", math.Round(ev.TokensPerSec))
	if !math.IsNaN(ev.ValLoss) {
		l = l.Float64("val_loss", round4(ev.ValLoss))
	}
	l.Msg("step")
}

func round4(x float64) float64 { return math.Round(x*1e4) / 1e4 }
