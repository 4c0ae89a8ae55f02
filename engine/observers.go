package engine

// The run's events besides the steps (StepEvent, events.go): when training
// starts, and each checkpoint saved. A program watching a run (the mktrain
// command's banner, package observe/prom's collector) takes them with
// WithStartHook and WithSaveHook, as it takes steps with WithHook.

import (
	"fmt"
	"math"
	"runtime"
	"runtime/debug"
	"time"

	"github.com/mktrain/mktrain/backend"
)

// StartEvent describes a run as it starts training: the model is built,
// and the checkpoint it resumes from, if any, is loaded; no step has run.
type StartEvent struct {
	Backend string // the backend the ranks train on: "cpu", "cuda"
	// Device names what they compute on: the GPU ("NVIDIA H200"), or, on
	// the CPU, its core count ("CPU, 16 cores").
	Device  string
	Devices int // devices the ranks use: GPUs with one rank each, else 1
	// BackendNotes say how train.backend was settled ("backend auto: no
	// GPU (...), training on the CPU"), as logged when the engine was made.
	BackendNotes []string
	Ranks        int // ranks of the whole mesh (parallel.dp*ep*cp*tp)
	Params       int // model parameters, every expert counted
	Steps        int // train.steps
	// StartStep is the step of the checkpoint the run resumes from (0 for
	// a fresh start); Checkpoint is that checkpoint's directory.
	StartStep  int
	Checkpoint string
	RunDir     string // "" without one (WithRunDir): nothing is saved
	Dispatcher string // the MoE dispatcher the ranks use, auto settled
}

// SaveEvent describes a checkpoint once it is committed.
type SaveEvent struct {
	Step     int
	Dir      string        // the checkpoint's directory
	Bytes    int64         // the size of its files
	Duration time.Duration // from the start of writing to the commit
	Async    bool          // written in the background (checkpoint.async)
}

// WithStartHook calls h once per Run, before the first step, from the
// training goroutine. A panic in h fails the run with a *HookPanicError.
func WithStartHook(h func(StartEvent)) Option {
	return func(e *Engine) { e.startHooks = append(e.startHooks, h) }
}

// WithSaveHook calls h after each checkpoint is committed, on the process
// that writes checkpoints (node 0), from the goroutine that wrote it: the
// training goroutine, or with checkpoint.async a background one while
// training goes on. A panic in h fails the run with a *HookPanicError.
func WithSaveHook(h func(SaveEvent)) Option {
	return func(e *Engine) { e.saveHooks = append(e.saveHooks, h) }
}

// reportStart hands ev to the start hooks.
func (e *Engine) reportStart(ev StartEvent) error {
	for i, h := range e.startHooks {
		if err := callEventHook("engine.WithStartHook", i, ev.StartStep, h, ev); err != nil {
			return err
		}
	}
	return nil
}

// reportSave hands ev to the save hooks.
func (e *Engine) reportSave(ev SaveEvent) error {
	for i, h := range e.saveHooks {
		if err := callEventHook("engine.WithSaveHook", i, ev.Step, h, ev); err != nil {
			return err
		}
	}
	return nil
}

// callEventHook calls h with ev, turning a panic into a *HookPanicError
// (see callHook).
func callEventHook[E any](option string, index, step int, h func(E), ev E) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = &HookPanicError{Option: option, Hook: index, Step: step, Value: p, Stack: debug.Stack()}
		}
	}()
	h(ev)
	return nil
}

// begin prepares the reports of a run about to train the step after
// startStep: the machine's figures of each step (pace), the TensorBoard
// event file (log.tensorboard), and the start event. finish closes what
// it opened.
func (s *session) begin(backends []backend.Backend, startStep int) (finish func(), err error) {
	e, r := s.e, s.ranks[0]
	devices := 1
	if backends != nil { // one GPU per rank, on every process
		devices = e.cfg.mesh().World()
	}
	s.pace = newPace(e.cfg, r.b, devices, startStep+1)
	closeTB, err := e.openTensorBoard(s.world, startStep)
	if err != nil {
		return nil, err
	}
	ev := StartEvent{
		Backend: e.backend.Name(), Device: deviceDescription(DeviceName(r.b), devices), Devices: devices,
		Ranks: e.cfg.mesh().World(), Params: ParamCount(e.cfg.Model), Steps: e.cfg.Train.Steps,
		StartStep: startStep, RunDir: e.runDir, Dispatcher: r.cfg.Model.MoE.Dispatcher, BackendNotes: e.backendNotes,
	}
	if s.resume != nil && s.saver != nil {
		ev.Checkpoint = s.saver.lastDir
	}
	if err := e.reportStart(ev); err != nil {
		closeTB()
		return nil, err
	}
	return closeTB, nil
}

// deviceDescription is StartEvent.Device for devices devices named
// deviceName ("" on the CPU).
func deviceDescription(deviceName string, devices int) string {
	switch {
	case deviceName == "":
		return fmt.Sprintf("CPU, %d cores", runtime.GOMAXPROCS(0))
	case devices > 1:
		return fmt.Sprintf("%d x %s", devices, deviceName)
	}
	return deviceName
}

// logStep writes a step's log line: "step 10/300" and the figures,
// loss first and the time left last, as the console shows them.
func (e *Engine) logStep(ev StepEvent) {
	l := e.log.Info().Float64("loss", round4(ev.Loss))
	if !math.IsNaN(ev.ValLoss) {
		l = l.Float64("val_loss", round4(ev.ValLoss)).Int("val_batches", ev.ValBatches)
	}
	mfu := "-"
	if ev.MFU > 0 {
		mfu = fmt.Sprintf("%.1f%%", 100*ev.MFU)
	}
	l.Str("lr", fmt.Sprintf("%.3g", ev.LR)).Float64("grad_norm", round4(ev.GradNorm)).
		Float64("tokens_per_s", math.Round(ev.TokensPerSec)).Str("mfu", mfu).
		Str("memory", FormatBytes(ev.PeakMemory)).Str("eta", FormatDuration(ev.ETA)).
		Msgf("step %d/%d", ev.Step, ev.Steps)
}

// StepLogFields are the fields of a step's log line in the order they are
// written; a console writer (zerolog.ConsoleWriter.FieldsOrder) keeps it.
func StepLogFields() []string {
	return []string{"loss", "val_loss", "val_batches", "lr", "grad_norm", "tokens_per_s", "mfu", "memory", "eta"}
}

// FormatBytes writes n in binary units: "512 B", "1.5 GiB".
func FormatBytes(n int64) string {
	v, units := float64(n), []string{"B", "KiB", "MiB", "GiB", "TiB"}
	i := 0
	for v >= 1024 && i < len(units)-1 {
		v /= 1024
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%d B", n)
	}
	return fmt.Sprintf("%.1f %s", v, units[i])
}

// FormatDuration writes d for a person, to the second above a minute:
// "850ms", "42s", "3m05s", "2h07m".
func FormatDuration(d time.Duration) string {
	switch {
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(time.Second).String()
	case d < time.Hour:
		d = d.Round(time.Second)
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	}
	d = d.Round(time.Minute)
	return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
}
