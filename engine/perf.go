package engine

// The step's speed and footprint as StepEvent reports them: model FLOPs
// utilisation (MFU), the peak memory, and the time left. MFU counts FLOPs
// as the PyTorch peer benchmark does, so that the figures of the two can be
// compared; `mktrain bench train` uses the same count.

import (
	"runtime/metrics"
	"strings"
	"time"

	"github.com/mktrain/mktrain/backend"
)

// ModelFLOPsPerToken counts a training step's FLOPs per token as the
// PyTorch peer benchmark does (scripts/peer/torch_moe_train.py): 6 per
// active parameter (forward and backward of every matrix multiply) plus
// 6*L*D*S for causal attention (half of 12*L*D*S). Active parameters are
// all parameters less the experts a token does not visit (E-K of each
// layer's E) and less the embedding table, which is a lookup, not a matmul.
func ModelFLOPsPerToken(m ModelConfig, seq int) float64 {
	L, D, V := float64(m.Layers), float64(m.Dim), float64(m.Vocab)
	E, K, F := float64(m.MoE.Experts), float64(m.MoE.TopK), float64(m.MoE.FFN)
	active := float64(ParamCount(m)) - L*E*3*D*F + L*K*3*D*F - V*D
	return 6*active + 6*L*D*float64(seq)
}

// PeakFLOPs is the dense bf16 tensor-core peak (FLOP/s, SXM parts) of the
// GPU named deviceName (as the CUDA backend names it: "NVIDIA H200"), the
// denominator of MFU; 0 for a name it does not know, and for the CPU (""),
// where no MFU is reported.
func PeakFLOPs(deviceName string) float64 {
	// By a word of the device's name; the first match wins.
	peaks := []struct {
		name  string
		flops float64
	}{
		{"H100", 989e12}, {"H200", 989e12}, {"GH200", 989e12},
		{"B200", 2250e12}, {"B100", 1750e12},
		{"A100", 312e12},
	}
	upper := strings.ToUpper(deviceName)
	for _, g := range peaks {
		if strings.Contains(upper, g.name) {
			return g.flops
		}
	}
	return 0
}

// DeviceName is the name of the device b computes on, where b, or a
// backend it wraps (a method Inner, as the profiler has), tells it through
// a method DeviceName() string (the CUDA backend: "NVIDIA H200"); "" for
// the CPU.
func DeviceName(b backend.Backend) string {
	for b != nil {
		if d, ok := b.(interface{ DeviceName() string }); ok {
			if name := d.DeviceName(); name != "" {
				return name
			}
		}
		w, ok := b.(interface{ Inner() backend.Backend })
		if !ok {
			return ""
		}
		b = w.Inner()
	}
	return ""
}

// PeakMemory is the peak memory of the device b computes on, and what the
// figure measures: the allocator's peak of bytes held by live tensors
// where b (or a backend it wraps) has a method PeakMemory() int64 (the
// CUDA backend), else the bytes of memory the Go runtime holds from the
// operating system now (the process's footprint on the CPU; the caller
// keeps the largest it has seen).
func PeakMemory(b backend.Backend) (bytes int64, source string) {
	for inner := b; inner != nil; {
		if p, ok := inner.(interface{ PeakMemory() int64 }); ok {
			return p.PeakMemory(), MemoryDevicePeak
		}
		w, ok := inner.(interface{ Inner() backend.Backend })
		if !ok {
			break
		}
		inner = w.Inner()
	}
	return goRuntimeMemory(), MemoryProcess
}

// What StepEvent.PeakMemory measures.
const (
	MemoryDevicePeak = "device allocator peak"      // bytes of live tensors at most, on the device
	MemoryProcess    = "Go runtime memory, at most" // bytes the process's Go runtime held from the OS, the most seen
)

// goRuntimeMemory reads the bytes the Go runtime has mapped from the OS
// (runtime/metrics: no stop-the-world, unlike runtime.ReadMemStats).
func goRuntimeMemory() int64 {
	s := []metrics.Sample{{Name: "/memory/classes/total:bytes"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return int64(s[0].Value.Uint64())
}

// pace computes the per-step figures of StepEvent that depend on the
// machine rather than the model: MFU, peak memory and the time left.
type pace struct {
	flopsPerToken float64
	peakFLOPs     float64 // of all the devices the ranks use; 0: no MFU
	backend       backend.Backend
	peakMemory    int64
	memorySource  string
	start         time.Time
	firstStep     int // the first step this run trains
}

// newPace prepares the figures for a run whose ranks compute on b (rank
// 0's backend) and devices devices of its kind (the GPUs of one rank each,
// or 1), starting at firstStep now.
func newPace(cfg Config, b backend.Backend, devices, firstStep int) *pace {
	return &pace{
		flopsPerToken: ModelFLOPsPerToken(cfg.Model, cfg.Train.Seq),
		peakFLOPs:     PeakFLOPs(DeviceName(b)) * float64(devices),
		backend:       b,
		start:         time.Now(),
		firstStep:     firstStep,
	}
}

// fill sets ev's MFU, PeakMemory, MemorySource and ETA.
func (p *pace) fill(ev *StepEvent) {
	ev.MFU = 0
	if p.peakFLOPs > 0 {
		ev.MFU = p.flopsPerToken * ev.TokensPerSec / p.peakFLOPs
	}
	bytes, source := PeakMemory(p.backend)
	p.peakMemory, p.memorySource = max(p.peakMemory, bytes), source
	ev.PeakMemory, ev.MemorySource = p.peakMemory, p.memorySource
	if done := ev.Step - p.firstStep + 1; done > 0 {
		perStep := time.Since(p.start) / time.Duration(done)
		ev.ETA = perStep * time.Duration(ev.Steps-ev.Step)
	}
}
