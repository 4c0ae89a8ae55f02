package engine

// log.tensorboard: the run's figures as TensorBoard event files in the run
// directory (package observe/tensorboard), written by the process that
// reports the steps. Scalars every step; the experts' load per layer, as an
// imbalance scalar and a histogram over the experts, at the logged steps
// (log.every), as metrics.jsonl has them.

import (
	"fmt"
	"math"
	"time"

	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/observe/tensorboard"
)

// tensorboardRun is the event file of a run in progress.
type tensorboardRun struct {
	e *Engine
	w *tensorboard.Writer
}

// openTensorBoard creates a new event file in the run directory when
// log.tensorboard is set and this process reports the steps (it hosts
// world rank 0), and makes it the engine's; a resumed run (startStep > 0)
// marks its first step with a session start. done closes the file.
func (e *Engine) openTensorBoard(world []*comm.Ranks, startStep int) (done func(), err error) {
	reports := false
	for _, g := range world {
		reports = reports || g.Rank == 0
	}
	if !e.cfg.Log.TensorBoard || !reports {
		return func() {}, nil
	}
	if e.runDir == "" {
		e.log.Warn().Msg("log.tensorboard is set but the run has no run directory (engine.WithRunDir): no event files are written")
		return func() {}, nil
	}
	now := time.Now()
	w, err := tensorboard.Create(e.runDir, now)
	if err != nil {
		return nil, fmt.Errorf("log.tensorboard: %w", err)
	}
	if startStep > 0 {
		if err := w.SessionStart(int64(startStep+1), now); err != nil {
			w.Close()
			return nil, fmt.Errorf("log.tensorboard: %w", err)
		}
	}
	e.log.Info().Str("file", w.Path()).Msg("TensorBoard events")
	t := &tensorboardRun{e: e, w: w}
	e.tensorboard = t
	return func() {
		if t.w != nil {
			if err := t.w.Close(); err != nil {
				e.log.Warn().Err(err).Msg("log.tensorboard")
			}
		}
		e.tensorboard = nil
	}, nil
}

// write adds a step's figures to the event file (nothing without one).
// The file is flushed at the logged steps, so that TensorBoard sees a run
// in progress; an error is logged once and ends the file's writing, not
// the run.
func (t *tensorboardRun) write(ev StepEvent, logged bool) {
	if t == nil || t.w == nil {
		return
	}
	values := []tensorboard.Value{
		tensorboard.Scalar("train/loss", ev.Loss),
		tensorboard.Scalar("train/aux_loss", ev.AuxLoss),
		tensorboard.Scalar("train/z_loss", ev.ZLoss),
		tensorboard.Scalar("train/lr", ev.LR),
		tensorboard.Scalar("train/grad_norm", ev.GradNorm),
		tensorboard.Scalar("perf/tokens_per_s", ev.TokensPerSec),
		tensorboard.Scalar("perf/peak_memory_bytes", float64(ev.PeakMemory)),
	}
	if ev.MFU > 0 {
		values = append(values, tensorboard.Scalar("perf/mfu", ev.MFU))
	}
	if !math.IsNaN(ev.ValLoss) {
		values = append(values, tensorboard.Scalar("val/loss", ev.ValLoss))
	}
	if logged {
		for _, x := range ev.Experts {
			prefix := fmt.Sprintf("experts/layer%d/", x.Layer)
			values = append(values,
				tensorboard.Scalar(prefix+"imbalance", x.MaxOverMean),
				tensorboard.Scalar(prefix+"dropped", float64(x.Dropped)),
				tensorboard.Histogram(prefix+"load", tensorboard.IndexHistogram(x.Fraction)))
		}
	}
	err := t.w.Write(int64(ev.Step), time.Now(), values)
	if err == nil && (logged || ev.Step == ev.Steps) {
		err = t.w.Flush()
	}
	if err != nil {
		t.e.log.Warn().Err(err).Msg("log.tensorboard: no more events are written")
		t.w.Close()
		t.w = nil
	}
}
