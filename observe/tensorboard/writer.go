package tensorboard

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Writer appends events to one event file it created. It is not safe for
// concurrent use.
type Writer struct {
	path string
	f    *os.File
	buf  *bufio.Writer
}

// Create makes a new event file in dir (made if missing), named after now,
// the host and the process, and writes its file_version event. It never
// opens an existing file: when the name is taken (two writers in one
// second) the counter at its end goes up.
func Create(dir string, now time.Time) (*Writer, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("tensorboard: %w", err)
	}
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "localhost"
	}
	// A dot in the host would read as another part of the name.
	host = strings.ReplaceAll(host, ".", "_")
	for n := 0; ; n++ {
		name := fmt.Sprintf("events.out.tfevents.%d.%s.%d.%d", now.Unix(), host, os.Getpid(), n)
		path := filepath.Join(dir, name)
		f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("tensorboard: %w", err)
		}
		w := &Writer{path: path, f: f, buf: bufio.NewWriter(f)}
		if err := w.record(appendEvent(nil, now, 0, appendFileVersion)); err != nil {
			f.Close()
			return nil, err
		}
		return w, nil
	}
}

// Path is the event file's path.
func (w *Writer) Path() string { return w.path }

// Write appends one event holding values at step.
func (w *Writer) Write(step int64, wall time.Time, values []Value) error {
	return w.record(appendEvent(nil, wall, step, func(b []byte) []byte { return appendSummary(b, values) }))
}

// SessionStart appends a SessionLog START event at step: the first step of
// a run resumed from a checkpoint. TensorBoard then drops the events at
// and after step that the run's earlier files hold.
func (w *Writer) SessionStart(step int64, wall time.Time) error {
	return w.record(appendEvent(nil, wall, step, appendSessionStart))
}

// Flush writes the buffered events to the file.
func (w *Writer) Flush() error {
	if err := w.buf.Flush(); err != nil {
		return fmt.Errorf("tensorboard: %s: %w", w.path, err)
	}
	return nil
}

// Close flushes and closes the file.
func (w *Writer) Close() error {
	err := w.Flush()
	if cerr := w.f.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("tensorboard: %s: %w", w.path, cerr)
	}
	return err
}

func (w *Writer) record(event []byte) error {
	if err := WriteRecord(w.buf, event); err != nil {
		return fmt.Errorf("tensorboard: %s: %w", w.path, err)
	}
	return nil
}

// IndexHistogram is the histogram whose x axis is an index (an expert's
// number) and whose bucket i, from i-0.5 to i+0.5, weighs weights[i]: a
// bar chart of weights that TensorBoard's histogram views draw.
func IndexHistogram(weights []float64) HistogramData {
	h := HistogramData{Min: 0, Max: float64(max(len(weights)-1, 0))}
	h.Limits = make([]float64, len(weights))
	h.Counts = make([]float64, len(weights))
	for i, w := range weights {
		x := float64(i)
		h.Limits[i], h.Counts[i] = x+0.5, w
		h.Num += w
		h.Sum += w * x
		h.SumSquares += w * x * x
	}
	return h
}
