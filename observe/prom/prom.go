// Package prom exposes a training run's figures as Prometheus metrics:
// the step, the losses, the learning rate and gradient norm, tokens/s,
// MFU, memory, each expert's share of its layer's tokens, and the
// checkpoints' save time and size. `mktrain run --metrics-addr HOST:PORT`
// serves them at /metrics (with Go's profiler at /debug/pprof/); a program
// that embeds the engine uses the same Collector:
//
//	c := prom.NewCollector()
//	eng, err := engine.New(cfg, append(opts, c.Options()...)...)
//	reg := prometheus.NewRegistry() // the program's own registry, no global one
//	reg.MustRegister(c)
//	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
//
// A Collector holds the latest event of each kind (engine.StartEvent,
// StepEvent, SaveEvent) and turns them into metrics when scraped, so a
// scrape costs the training loop nothing but a mutex per step. Gauges that
// have no value yet (the validation loss before the first evaluation, the
// MFU on the CPU) are left out of the scrape rather than reported as 0.
//
// # Metrics
//
//	mktrain_info{backend,device,dispatcher}   1 once the run started
//	mktrain_step, mktrain_steps               the last finished step; train.steps
//	mktrain_start_step                        the step the run resumed from (0: fresh)
//	mktrain_params                            model parameters
//	mktrain_loss, mktrain_aux_loss, mktrain_z_loss, mktrain_val_loss
//	mktrain_val_batches                       micro-batches behind mktrain_val_loss
//	mktrain_learning_rate, mktrain_grad_norm
//	mktrain_tokens                            tokens trained on, resumed steps included
//	mktrain_tokens_per_second                 the last step's throughput
//	mktrain_mfu_ratio                         model FLOPs utilisation (GPU)
//	mktrain_peak_memory_bytes                 peak memory (engine.StepEvent.PeakMemory)
//	mktrain_eta_seconds                       time left to the last step
//	mktrain_expert_load_ratio{layer,expert}   share of the layer's token assignments
//	mktrain_expert_imbalance_ratio{layer}     busiest expert's load over the mean
//	mktrain_expert_dropped{layer}             assignments dropped by the capacity factor
//	mktrain_checkpoints_saved_total           checkpoints saved by this process
//	mktrain_checkpoint_step                   the step of the last one
//	mktrain_checkpoint_save_seconds           its save time
//	mktrain_checkpoint_bytes                  its size
package prom

import (
	"math"
	"net/http"
	"net/http/pprof"
	"strconv"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/mktrain/mktrain/engine"
)

// Collector is a prometheus.Collector of one engine's run (or of its runs
// one after the other: each event replaces the last). Its methods are safe
// for concurrent use.
type Collector struct {
	descs descs

	mu      sync.Mutex
	start   *engine.StartEvent
	step    *engine.StepEvent
	valLoss float64 // the last evaluation's; NaN before one
	valBat  int
	save    *engine.SaveEvent
	saves   int
}

// descs are the metrics' descriptions, made once per Collector.
type descs struct {
	info, step, steps, startStep, params                 *prometheus.Desc
	loss, auxLoss, zLoss, valLoss, valBatches            *prometheus.Desc
	lr, gradNorm, tokens, tokensPerSec, mfu, memory, eta *prometheus.Desc
	expertLoad, expertImbalance, expertDropped           *prometheus.Desc
	saves, saveStep, saveSeconds, saveBytes              *prometheus.Desc
}

func newDescs() descs {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("mktrain_"+name, help, labels, nil)
	}
	return descs{
		info:            d("info", "The run's backend, device and MoE dispatcher (always 1).", "backend", "device", "dispatcher"),
		step:            d("step", "The last finished optimizer step."),
		steps:           d("steps", "The run's last step (train.steps)."),
		startStep:       d("start_step", "The step the run resumed from (0 for a fresh start)."),
		params:          d("params", "Model parameters, every expert counted."),
		loss:            d("loss", "Training cross-entropy of the last step (nats per token)."),
		auxLoss:         d("aux_loss", "Load-balancing loss of the last step, summed over layers (unweighted)."),
		zLoss:           d("z_loss", "Router z-loss of the last step, summed over layers (unweighted)."),
		valLoss:         d("val_loss", "The last validation loss (nats per token)."),
		valBatches:      d("val_batches", "Micro-batches the last validation loss averages."),
		lr:              d("learning_rate", "Learning rate of the last step."),
		gradNorm:        d("grad_norm", "Global gradient norm of the last step, before clipping."),
		tokens:          d("tokens", "Tokens trained on, the steps before a resume included."),
		tokensPerSec:    d("tokens_per_second", "Training throughput of the last step."),
		mfu:             d("mfu_ratio", "Model FLOPs utilisation of the last step (GPUs with a known peak only)."),
		memory:          d("peak_memory_bytes", "Peak memory: the GPU allocator's peak, or the Go runtime's on the CPU."),
		eta:             d("eta_seconds", "Estimated time to the run's last step."),
		expertLoad:      d("expert_load_ratio", "Expert's share of its layer's token assignments in the last step.", "layer", "expert"),
		expertImbalance: d("expert_imbalance_ratio", "Busiest expert's load over the mean load, per layer, in the last step.", "layer"),
		expertDropped:   d("expert_dropped", "Token assignments dropped by the capacity factor in the last step.", "layer"),
		saves:           d("checkpoints_saved_total", "Checkpoints saved by this process."),
		saveStep:        d("checkpoint_step", "Step of the last checkpoint saved."),
		saveSeconds:     d("checkpoint_save_seconds", "Time the last checkpoint took to write and commit."),
		saveBytes:       d("checkpoint_bytes", "Size of the last checkpoint's files."),
	}
}

// NewCollector returns a Collector with no run yet.
func NewCollector() *Collector {
	return &Collector{descs: newDescs(), valLoss: math.NaN()}
}

// Options are the engine options that feed c: hand them to engine.New.
func (c *Collector) Options() []engine.Option {
	return []engine.Option{engine.WithStartHook(c.ObserveStart), engine.WithHook(c.ObserveStep), engine.WithSaveHook(c.ObserveSave)}
}

// ObserveStart records the start of a run.
func (c *Collector) ObserveStart(ev engine.StartEvent) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.start, c.step, c.save, c.saves, c.valLoss, c.valBat = &ev, nil, nil, 0, math.NaN(), 0
}

// ObserveStep records a finished step.
func (c *Collector) ObserveStep(ev engine.StepEvent) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.step = &ev
	if !math.IsNaN(ev.ValLoss) {
		c.valLoss, c.valBat = ev.ValLoss, ev.ValBatches
	}
}

// ObserveSave records a saved checkpoint.
func (c *Collector) ObserveSave(ev engine.SaveEvent) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.save = &ev
	c.saves++
}

// Describe sends the descriptions of every metric c may collect.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	d := c.descs
	for _, desc := range []*prometheus.Desc{d.info, d.step, d.steps, d.startStep, d.params, d.loss, d.auxLoss, d.zLoss,
		d.valLoss, d.valBatches, d.lr, d.gradNorm, d.tokens, d.tokensPerSec, d.mfu, d.memory, d.eta,
		d.expertLoad, d.expertImbalance, d.expertDropped, d.saves, d.saveStep, d.saveSeconds, d.saveBytes} {
		ch <- desc
	}
}

// Collect sends the metrics of the events recorded so far.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	start, step, save, saves, valLoss, valBat := c.start, c.step, c.save, c.saves, c.valLoss, c.valBat
	c.mu.Unlock()
	d := c.descs
	gauge := func(desc *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(desc, prometheus.GaugeValue, v, labels...)
	}
	if start != nil {
		gauge(d.info, 1, start.Backend, start.Device, start.Dispatcher)
		gauge(d.steps, float64(start.Steps))
		gauge(d.startStep, float64(start.StartStep))
		gauge(d.params, float64(start.Params))
	}
	if step != nil {
		gauge(d.step, float64(step.Step))
		gauge(d.loss, step.Loss)
		gauge(d.auxLoss, step.AuxLoss)
		gauge(d.zLoss, step.ZLoss)
		gauge(d.lr, step.LR)
		gauge(d.gradNorm, step.GradNorm)
		gauge(d.tokens, float64(step.Tokens))
		gauge(d.tokensPerSec, step.TokensPerSec)
		if step.MFU > 0 {
			gauge(d.mfu, step.MFU)
		}
		gauge(d.memory, float64(step.PeakMemory))
		gauge(d.eta, step.ETA.Seconds())
		for _, x := range step.Experts {
			layer := strconv.Itoa(x.Layer)
			for e, f := range x.Fraction {
				gauge(d.expertLoad, f, layer, strconv.Itoa(e))
			}
			gauge(d.expertImbalance, x.MaxOverMean, layer)
			gauge(d.expertDropped, float64(x.Dropped), layer)
		}
	}
	if !math.IsNaN(valLoss) {
		gauge(d.valLoss, valLoss)
		gauge(d.valBatches, float64(valBat))
	}
	ch <- prometheus.MustNewConstMetric(d.saves, prometheus.CounterValue, float64(saves))
	if save != nil {
		gauge(d.saveStep, float64(save.Step))
		gauge(d.saveSeconds, save.Duration.Seconds())
		gauge(d.saveBytes, float64(save.Bytes))
	}
}

// NewRegistry returns a registry of its own (not Prometheus's global one)
// holding c and the Go runtime's and the process's collectors.
func NewRegistry(c *Collector) (*prometheus.Registry, error) {
	reg := prometheus.NewRegistry()
	for _, col := range []prometheus.Collector{c, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})} {
		if err := reg.Register(col); err != nil {
			return nil, err
		}
	}
	return reg, nil
}

// NewServeMux serves g's metrics at /metrics and Go's profiler (package
// net/http/pprof) under /debug/pprof/, on a mux of its own.
func NewServeMux(g prometheus.Gatherer) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{}))
	// net/http/pprof also registers these on http.DefaultServeMux when
	// imported; that mux is never served here.
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return mux
}
