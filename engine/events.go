package engine

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"time"
)

// StepEvent describes one optimizer step. Hooks receive one per step;
// metrics.jsonl holds the logged ones.
type StepEvent struct {
	Step, Steps  int
	Loss         float64 // mean next-token cross-entropy over the global batch
	AuxLoss      float64 // load-balancing loss, summed over layers (unweighted)
	ZLoss        float64 // router z-loss, summed over layers (unweighted)
	LR           float64
	GradNorm     float64 // global gradient norm before clipping
	Tokens       int64   // tokens trained on so far
	TokensPerSec float64 // this step's throughput
	Elapsed      time.Duration
	ValLoss      float64 // NaN unless validation ran after this step
	// ValBatches is how many micro-batches (of train.micro_batch
	// sequences, over all data ranks) ValLoss averages: train.eval_batches
	// per data rank, not `mktrain eval`'s full pass. 0 without ValLoss.
	ValBatches int
	Experts    []ExpertLoad
	// MFU is the model FLOPs utilisation of this step (ModelFLOPsPerToken
	// times TokensPerSec over the devices' PeakFLOPs); 0 on the CPU and on
	// GPUs whose peak is not known.
	MFU float64
	// PeakMemory is the most memory seen so far, in bytes; MemorySource
	// says what it measures (MemoryDevicePeak or MemoryProcess).
	PeakMemory   int64
	MemorySource string
	// ETA is the time left to the last step, at this run's mean step time.
	ETA time.Duration
}

// HookPanicError is Run's error when a hook (WithHook) panicked: the run
// stopped at that step, and the panic did not reach the host.
type HookPanicError struct {
	// Option names the kind of hook: "engine.WithStartHook" or
	// "engine.WithSaveHook" (observers.go); "" for engine.WithHook.
	Option string
	Hook   int    // the hook's position among the options of its kind, from 0
	Step   int    // the step whose event it was handling
	Value  any    // what it panicked with
	Stack  []byte // the hook's goroutine stack at the panic
}

func (e *HookPanicError) Error() string {
	option := e.Option
	if option == "" {
		option = "engine.WithHook"
	}
	return fmt.Sprintf("hook %d (%s) panicked at step %d: %v", e.Hook, option, e.Step, e.Value)
}

// ExpertLoad is one MoE layer's routing in a step.
type ExpertLoad struct {
	Layer       int       `json:"layer"`
	Fraction    []float64 `json:"fraction"`      // share of token assignments per expert
	MaxOverMean float64   `json:"max_over_mean"` // imbalance: busiest expert's load over the mean
	Dropped     int       `json:"dropped"`       // assignments dropped by the capacity factor
}

func expertLoads(sr stepResult) []ExpertLoad {
	out := make([]ExpertLoad, len(sr.expertLoad))
	for l, counts := range sr.expertLoad {
		total, peak := 0.0, 0.0
		for _, c := range counts {
			total += c
			peak = math.Max(peak, c)
		}
		frac := make([]float64, len(counts))
		imbalance := 0.0
		if total > 0 {
			for e, c := range counts {
				frac[e] = round4(c / total)
			}
			imbalance = round4(peak / (total / float64(len(counts))))
		}
		out[l] = ExpertLoad{Layer: l, Fraction: frac, MaxOverMean: imbalance, Dropped: sr.dropped[l]}
	}
	return out
}

// metricsLine is the JSON form of a logged step in metrics.jsonl.
type metricsLine struct {
	Step         int          `json:"step"`
	Loss         float64      `json:"loss"`
	AuxLoss      float64      `json:"aux_loss"`
	ZLoss        float64      `json:"z_loss"`
	LR           float64      `json:"lr"`
	GradNorm     float64      `json:"grad_norm"`
	Tokens       int64        `json:"tokens"`
	TokensPerSec float64      `json:"tokens_per_s"`
	ElapsedS     float64      `json:"elapsed_s"`
	ValLoss      *float64     `json:"val_loss,omitempty"`
	ValBatches   int          `json:"val_batches,omitempty"` // micro-batches behind val_loss
	MFU          *float64     `json:"mfu"`                   // null where no peak is known (the CPU)
	PeakMemory   int64        `json:"peak_memory_bytes"`
	Experts      []ExpertLoad `json:"experts"`
}

func writeMetrics(w io.Writer, ev StepEvent) error {
	line := metricsLine{
		Step: ev.Step, Loss: ev.Loss, AuxLoss: ev.AuxLoss, ZLoss: ev.ZLoss, LR: ev.LR,
		GradNorm: ev.GradNorm, Tokens: ev.Tokens, TokensPerSec: math.Round(ev.TokensPerSec),
		ElapsedS: ev.Elapsed.Seconds(), Experts: ev.Experts, PeakMemory: ev.PeakMemory,
	}
	if !math.IsNaN(ev.ValLoss) {
		v := ev.ValLoss
		line.ValLoss, line.ValBatches = &v, ev.ValBatches
	}
	if ev.MFU > 0 {
		mfu := math.Round(ev.MFU*1e6) / 1e6 // small models on big GPUs are far below 1e-4
		line.MFU = &mfu
	}
	b, err := json.Marshal(line)
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

// MarshalJSON encodes the step as its metrics.jsonl line (without the
// newline), for a program that streams or stores steps: a plain encoding
// would fail on ValLoss, NaN when no validation ran.
func (ev StepEvent) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	if err := writeMetrics(&b, ev); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n")), nil
}
