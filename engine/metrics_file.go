package engine

// metrics.jsonl as a run directory keeps it (WithMetricsFile): appended to
// by every run in the directory, and cut back to the step a run starts
// from, so that the steps a resumed run replays after a crash appear once.

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"

	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/internal/atomicfile"
)

// openMetricsFile opens the WithMetricsFile file for a run that starts
// after startStep, when this process reports the steps (it hosts world
// rank 0), and makes it the engine's metrics writer (beside a WithMetrics
// writer, if any). done closes it and puts the writer back.
func (e *Engine) openMetricsFile(world []*comm.Ranks, startStep int) (done func(), err error) {
	reports := false
	for _, g := range world {
		reports = reports || g.Rank == 0
	}
	if e.metricsPath == "" || !reports {
		return func() {}, nil
	}
	dropped, err := trimMetrics(e.metricsPath, startStep)
	if err != nil {
		return nil, err
	}
	if dropped > 0 {
		e.log.Info().Int("lines", dropped).Int("after_step", startStep).Str("file", e.metricsPath).
			Msg("dropped the metrics of steps this run trains again")
	}
	f, err := os.OpenFile(e.metricsPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	prev := e.metrics
	if prev != nil {
		e.metrics = io.MultiWriter(prev, f)
	} else {
		e.metrics = f
	}
	return func() {
		e.metrics = prev
		if err := f.Close(); err != nil {
			e.log.Warn().Err(err).Msg("cannot write metrics")
		}
	}, nil
}

// trimMetrics removes from the metrics.jsonl at path every line of a step
// after lastStep, and a last line cut short by a crash (no newline), by
// replacing the file atomically; it returns how many lines went. Lines it
// cannot read as a step are kept. A missing file is left missing.
func trimMetrics(path string, lastStep int) (int, error) {
	dropped, err := scanMetrics(path, lastStep, io.Discard)
	if errors.Is(err, fs.ErrNotExist) || err == nil && dropped == 0 {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	err = atomicfile.WriteFile(path, func(w io.Writer) error {
		_, err := scanMetrics(path, lastStep, w)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("metrics: rewriting %s: %w", path, err)
	}
	return dropped, nil
}

// scanMetrics copies the lines of path that trimMetrics keeps to w and
// counts the others.
func scanMetrics(path string, lastStep int, w io.Writer) (dropped int, err error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	r := bufio.NewReader(f)
	for {
		line, err := r.ReadBytes('\n')
		if errors.Is(err, io.EOF) {
			if len(line) > 0 { // a line cut short
				dropped++
			}
			return dropped, nil
		}
		if err != nil {
			return 0, fmt.Errorf("metrics: reading %s: %w", path, err)
		}
		var l struct {
			Step *int `json:"step"`
		}
		if json.Unmarshal(bytes.TrimSpace(line), &l) == nil && l.Step != nil && *l.Step > lastStep {
			dropped++
			continue
		}
		if _, err := w.Write(line); err != nil {
			return 0, err
		}
	}
}
