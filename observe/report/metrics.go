package report

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
)

// Step is one line of a run's metrics.jsonl (engine/events.go writes them):
// a logged step.
type Step struct {
	Step         int      `json:"step"`
	Loss         float64  `json:"loss"`
	AuxLoss      float64  `json:"aux_loss"`
	ZLoss        float64  `json:"z_loss"`
	LR           float64  `json:"lr"`
	GradNorm     float64  `json:"grad_norm"`
	Tokens       int64    `json:"tokens"`
	TokensPerSec float64  `json:"tokens_per_s"`
	ElapsedS     float64  `json:"elapsed_s"`
	ValLoss      *float64 `json:"val_loss"`
	ValBatches   int      `json:"val_batches"`
	MFU          *float64 `json:"mfu"`
	PeakMemory   int64    `json:"peak_memory_bytes"`
	Experts      []Layer  `json:"experts"`
}

// Layer is one MoE layer's routing in a logged step.
type Layer struct {
	Layer       int       `json:"layer"`
	Fraction    []float64 `json:"fraction"`
	MaxOverMean float64   `json:"max_over_mean"`
	Dropped     int       `json:"dropped"`
}

// ReadMetrics reads a metrics.jsonl file: its steps in step order, a step
// logged twice (by runs that overlapped before a resume trimmed the file)
// once, with its last line. A line that is not a JSON object with a step
// is an error naming the file and line; a last line cut short by a crash
// is skipped.
func ReadMetrics(path string) ([]Step, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	r := bufio.NewReader(f)
	byStep := map[int]Step{}
	for line := 1; ; line++ {
		text, err := r.ReadBytes('\n')
		if errors.Is(err, io.EOF) {
			break // a last line without a newline was cut short
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		text = bytes.TrimSpace(text)
		if len(text) == 0 {
			continue
		}
		var s Step
		var probe struct {
			Step *int `json:"step"`
		}
		if err := json.Unmarshal(text, &probe); err != nil || probe.Step == nil {
			return nil, fmt.Errorf("%s:%d: not a metrics line (a JSON object with a step)", path, line)
		}
		if err := json.Unmarshal(text, &s); err != nil {
			return nil, fmt.Errorf("%s:%d: %w", path, line, err)
		}
		byStep[s.Step] = s
	}
	steps := make([]Step, 0, len(byStep))
	for _, s := range byStep {
		steps = append(steps, s)
	}
	slices.SortFunc(steps, func(a, b Step) int { return a.Step - b.Step })
	return steps, nil
}

// Bench is what the report reads from a `mktrain bench train` result.
type Bench struct {
	Benchmark string `json:"benchmark"`
	Commit    string `json:"commit"`
	Date      string `json:"date"`
	Recipe    string `json:"recipe"`
	Machine   struct {
		Host    string `json:"host"`
		CPU     string `json:"cpu"`
		Backend string `json:"backend"`
		Device  string `json:"device"`
	} `json:"machine"`
	Figures struct {
		TokensPerSec   float64 `json:"tokens_per_s"`
		StepMSMedian   float64 `json:"step_ms_median"`
		ProfiledStepMS float64 `json:"profiled_step_ms"`
		Breakdown      []struct {
			Kind  string  `json:"kind"`
			MS    float64 `json:"ms"`
			Share float64 `json:"share"`
			Ops   int     `json:"ops"`
		} `json:"breakdown"`
	} `json:"figures"`
}

// ReadBench reads a bench train result; it must hold a time breakdown
// (bench train ran with --profile, the default).
func ReadBench(path string) (*Bench, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var b Bench
	if err := json.Unmarshal(data, &b); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if b.Benchmark != "train" {
		return nil, fmt.Errorf("%s: a %q benchmark result; the report takes a bench train result", path, b.Benchmark)
	}
	if len(b.Figures.Breakdown) == 0 {
		return nil, fmt.Errorf("%s: no time breakdown (run bench train with --profile, the default)", path)
	}
	return &b, nil
}
