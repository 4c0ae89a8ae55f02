package main

// The runs this service started: each is one engine.Engine training in its
// own goroutine, watched through its hook.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/mktrain/mktrain/backend/all"
	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/recipes"
)

// The states of a run.
const (
	stateRunning  = "running"
	stateStopping = "stopping" // DELETE asked it to stop; it is saving
	stateStopped  = "stopped"  // stopped on request, checkpoint saved
	stateFinished = "finished" // trained every step
	stateFailed   = "failed"
)

// watcherBuffer is how many steps a server-sent event stream may fall
// behind before it is cut off: the engine's hook never waits for a client.
const watcherBuffer = 256

// service holds the runs. Every field after mu is guarded by it.
type service struct {
	root    string
	maxRuns int
	log     zerolog.Logger
	// console is where log writes (the terminal): the runs' warnings go
	// there too.
	console io.Writer
	metrics *metrics
	models  *modelCache
	// closing is closed when the service shuts down: event streams end.
	closing chan struct{}

	mu     sync.Mutex
	runs   map[string]*run // by name: the latest run of each directory
	closed bool
}

// newService serves the run directories under root, training at most
// maxRuns at once, logging to console.
func newService(root string, maxRuns int, console io.Writer) (*service, error) {
	if err := os.MkdirAll(root, 0o755); err != nil {
		return nil, fmt.Errorf("--root: %w", err)
	}
	m, err := newMetrics()
	if err != nil {
		return nil, err
	}
	return &service{
		root: root, maxRuns: maxRuns, console: console, metrics: m, models: newModelCache(),
		log:     zerolog.New(console).With().Timestamp().Logger(),
		closing: make(chan struct{}), runs: map[string]*run{},
	}, nil
}

// run is one training run: an engine's Run in a goroutine.
type run struct {
	name, dir string
	cancel    context.CancelFunc
	done      chan struct{} // closed once Run returned and the directory is released

	mu       sync.Mutex
	state    string
	backend  string
	steps    int               // train.steps
	first    int               // the first step this run trained; 0 before it
	last     *engine.StepEvent // the latest step
	valLoss  float64           // the latest validation loss (NaN before one)
	started  time.Time
	ended    time.Time
	result   engine.Result
	err      error
	watchers map[*watcher]struct{}
}

// watcher is one event stream's subscription: the JSON of every step.
type watcher struct {
	steps  chan []byte
	lagged bool // cut off for falling behind; steps is closed
}

// status is a run's state as GET /runs/{name} shows it.
type status struct {
	Name       string   `json:"name"`
	RunDir     string   `json:"run_dir"`
	State      string   `json:"state"`
	Backend    string   `json:"backend"`
	Step       int      `json:"step"`
	Steps      int      `json:"steps"`
	StartStep  *int     `json:"start_step,omitempty"`
	Loss       *float64 `json:"loss,omitempty"`
	ValLoss    *float64 `json:"val_loss,omitempty"`
	TokensPerS float64  `json:"tokens_per_s"`
	Checkpoint string   `json:"checkpoint,omitempty"`
	Error      string   `json:"error,omitempty"`
	Started    string   `json:"started"`
	Ended      string   `json:"ended,omitempty"`
}

// runNamePattern is what a run_dir may be: one path element, so that a
// request can name no directory outside --root.
var runNamePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$`)

// errConflict and errBusy are start's refusals: the run directory is in
// use, or the service trains --max-runs runs already.
var (
	errConflict = errors.New("run directory in use")
	errBusy     = errors.New("service busy")
)

// start starts (or resumes) the run in root/name with cfg, whose YAML
// snapshot the directory keeps as recipe.yaml.
func (s *service) start(name string, cfg engine.Config, snapshot []byte) (*run, error) {
	if !runNamePattern.MatchString(name) {
		return nil, &badRequest{fmt.Errorf("run_dir %q: want a name of letters, digits, '.', '_' and '-' (a directory under the service's root)", name)}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return nil, fmt.Errorf("%w: the service is shutting down", errBusy)
	case s.runs[name] != nil && s.runs[name].isActive():
		return nil, fmt.Errorf("%w: run %s is %s; DELETE it first, or wait for it to end", errConflict, name, s.runs[name].status().State)
	case s.active() >= s.maxRuns:
		return nil, fmt.Errorf("%w: %d runs are training (--max-runs %d); stop one or wait", errBusy, s.active(), s.maxRuns)
	}
	dir := filepath.Join(s.root, name)
	// Locked before anything is written there: a run of another process
	// on the directory is refused at once, naming it.
	lock, err := engine.LockRunDir(dir, 0)
	if busy := (*engine.RunDirBusyError)(nil); errors.As(err, &busy) {
		return nil, fmt.Errorf("%w: %v", errConflict, err)
	} else if err != nil {
		return nil, err
	}
	r, err := s.launch(name, lock, cfg, snapshot)
	if err != nil {
		lock.Unlock()
		return nil, err
	}
	s.runs[name] = r
	return r, nil
}

// launch builds the engine of a run whose directory is locked and starts
// it. The run owns the lock from then on.
func (s *service) launch(name string, lock *engine.RunDirLock, cfg engine.Config, snapshot []byte) (*run, error) {
	dir := lock.Dir()
	if err := os.WriteFile(filepath.Join(dir, "recipe.yaml"), snapshot, 0o644); err != nil {
		return nil, fmt.Errorf("run directory: %w", err)
	}
	logFile, err := os.OpenFile(filepath.Join(dir, "train.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("run directory: %w", err)
	}
	level, err := zerolog.ParseLevel(cfg.Log.Level)
	if err != nil {
		logFile.Close()
		return nil, fmt.Errorf("log.level: %w", err)
	}
	// The engine logs from more than one goroutine: one line at a time.
	// Everything goes to train.log; warnings reach the service's log too,
	// with the run's name.
	logger := zerolog.New(zerolog.SyncWriter(zerolog.MultiLevelWriter(
		levelFilter{logFile, level},
		levelFilter{s.console, zerolog.WarnLevel},
	))).Level(min(level, zerolog.WarnLevel)).With().Timestamp().Str("run", name).Logger()
	ctx, cancel := context.WithCancel(context.Background())
	r := &run{
		name: name, dir: dir, cancel: cancel, done: make(chan struct{}),
		state: stateRunning, steps: cfg.Train.Steps, started: time.Now(), valLoss: math.NaN(), watchers: map[*watcher]struct{}{},
	}
	promOptions, err := s.metrics.runOptions(name)
	if err != nil {
		cancel()
		logFile.Close()
		return nil, err
	}
	opts := append([]engine.Option{
		engine.WithDrivers(all.Drivers()...), // the GPU, when there is one and train.backend allows it
		engine.WithLogger(logger),
		engine.WithRunDirLock(lock),
		engine.WithRecipe(snapshot, recipes.Hash(cfg)),
		engine.WithMetricsFile(filepath.Join(dir, "metrics.jsonl")),
		engine.WithHook(r.onStep),
	}, promOptions...)
	eng, err := engine.New(cfg, opts...)
	if err != nil { // train.backend names a backend this machine lacks, say
		cancel()
		logFile.Close()
		return nil, &badRequest{err}
	}
	r.backend = eng.BackendName()
	s.metrics.runStarted()
	go func() {
		res, err := eng.Run(ctx)
		if cerr := eng.Close(); cerr != nil && err == nil {
			err = fmt.Errorf("releasing the backend: %w", cerr)
		}
		lock.Unlock()
		logFile.Close()
		cancel()
		state := endState(err)
		s.metrics.runEnded(state) // before the status shows the end: whoever sees it sees the counts
		r.finish(res, err, state)
		st := r.status()
		s.log.Info().Str("run", name).Str("state", st.State).Int("step", res.Steps).
			Str("checkpoint", res.Checkpoint).Str("error", st.Error).Msg("run ended")
	}()
	s.log.Info().Str("run", name).Str("dir", dir).Str("backend", r.backend).Msg("run started")
	return r, nil
}

// active counts the runs still training (s.mu held).
func (s *service) active() int {
	n := 0
	for _, r := range s.runs {
		if r.isActive() {
			n++
		}
	}
	return n
}

// get returns the run of that name, or nil.
func (s *service) get(name string) *run {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.runs[name]
}

// list returns every run, newest first.
func (s *service) list() []*run {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*run, 0, len(s.runs))
	for _, r := range s.runs {
		out = append(out, r)
	}
	slices.SortFunc(out, func(a, b *run) int { return b.started.Compare(a.started) })
	return out
}

// close stops every run, waits for their checkpoints, ends the event
// streams and refuses new runs.
func (s *service) close() {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	runs := make([]*run, 0, len(s.runs))
	for _, r := range s.runs {
		runs = append(runs, r)
	}
	s.mu.Unlock()
	for _, r := range runs {
		r.stop()
	}
	for _, r := range runs {
		<-r.done
	}
	close(s.closing)
	s.models.closeAll()
}

// onStep is the run's engine hook: it keeps the step and hands it to the
// event streams without waiting for any.
func (r *run) onStep(ev engine.StepEvent) {
	line, err := json.Marshal(ev) // engine.StepEvent marshals as its metrics.jsonl line
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.first == 0 {
		r.first = ev.Step
	}
	r.last = &ev
	if !math.IsNaN(ev.ValLoss) {
		r.valLoss = ev.ValLoss
	}
	if err != nil {
		return // a step the streams cannot show; the status still has it
	}
	for w := range r.watchers {
		select {
		case w.steps <- line:
		default:
			w.lagged = true
			close(w.steps)
			delete(r.watchers, w)
		}
	}
}

// endState is the state of a run whose Run returned err.
func endState(err error) string {
	switch {
	case errors.Is(err, engine.ErrStopped):
		return stateStopped
	case err != nil:
		return stateFailed
	}
	return stateFinished
}

// finish records Run's outcome and ends the event streams.
func (r *run) finish(res engine.Result, err error, state string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.result, r.ended, r.state = res, time.Now(), state
	if state == stateFailed {
		r.err = err
	}
	for w := range r.watchers {
		close(w.steps)
	}
	clear(r.watchers)
	close(r.done)
}

// stop asks the run to stop after its current step; Run saves a
// checkpoint and returns (r.done).
func (r *run) stop() {
	r.mu.Lock()
	if r.state == stateRunning {
		r.state = stateStopping
	}
	r.mu.Unlock()
	r.cancel()
}

// isActive says whether the run's engine is still running.
func (r *run) isActive() bool {
	select {
	case <-r.done:
		return false
	default:
		return true
	}
}

// watch subscribes an event stream and returns the status it starts from;
// nil when the run has ended (the status is final).
func (r *run) watch() (*watcher, status) {
	r.mu.Lock()
	defer r.mu.Unlock()
	st := r.statusLocked()
	if !r.ended.IsZero() {
		return nil, st
	}
	w := &watcher{steps: make(chan []byte, watcherBuffer)}
	r.watchers[w] = struct{}{}
	return w, st
}

// unwatch ends a subscription (a stream whose client went away).
func (r *run) unwatch(w *watcher) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.watchers[w]; ok {
		delete(r.watchers, w)
		close(w.steps)
	}
}

// isLagged says whether the stream was cut off for falling behind.
func (r *run) isLagged(w *watcher) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return w.lagged
}

func (r *run) status() status {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.statusLocked()
}

func (r *run) statusLocked() status {
	st := status{
		Name: r.name, RunDir: r.dir, State: r.state, Backend: r.backend, Steps: r.steps,
		Started: r.started.Format(time.RFC3339), Checkpoint: r.result.Checkpoint,
	}
	if r.last != nil {
		st.Step, st.TokensPerS = r.last.Step, math.Round(r.last.TokensPerSec)
		loss := r.last.Loss
		st.Loss = &loss
	}
	if r.first > 0 {
		start := r.first - 1
		st.StartStep = &start
	}
	if !math.IsNaN(r.valLoss) {
		v := r.valLoss
		st.ValLoss = &v
	}
	if r.err != nil {
		st.Error = r.err.Error()
	}
	if !r.ended.IsZero() {
		st.Ended = r.ended.Format(time.RFC3339)
		if r.last == nil {
			st.Step = r.result.Steps
		}
	}
	return st
}

// levelFilter passes on the log lines of at least its level.
type levelFilter struct {
	w     io.Writer
	level zerolog.Level
}

func (f levelFilter) Write(p []byte) (int, error) { return f.w.Write(p) }

func (f levelFilter) WriteLevel(l zerolog.Level, p []byte) (int, error) {
	if l < f.level {
		return len(p), nil
	}
	return f.w.Write(p)
}
