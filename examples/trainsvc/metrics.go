package main

// GET /metrics: each run's figures from mktrain's own collector (package
// observe/prom), labelled with the run's name, and the service's.

import (
	"net/http"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/observe/prom"
)

// metrics is the service's registry (its own, not Prometheus's global
// one): a prom.Collector per run name, kept across resumes of that run,
// the runs training now and the runs ended by state.
type metrics struct {
	reg    *prometheus.Registry
	active prometheus.Gauge
	ended  *prometheus.CounterVec

	mu    sync.Mutex
	byRun map[string]*prom.Collector
}

func newMetrics() (*metrics, error) {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		active: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "trainsvc_runs_active", Help: "Runs training now.",
		}),
		ended: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "trainsvc_runs_ended_total", Help: "Runs ended, by how: finished, stopped or failed.",
		}, []string{"state"}),
		byRun: map[string]*prom.Collector{},
	}
	for _, c := range []prometheus.Collector{m.active, m.ended, collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})} {
		if err := m.reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// runOptions returns the engine options that feed the collector of the
// run named name (mktrain_* metrics with the label run=name), registering
// it on the run's first start.
func (m *metrics) runOptions(name string) ([]engine.Option, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	c := m.byRun[name]
	if c == nil {
		c = prom.NewCollector()
		if err := prometheus.WrapRegistererWith(prometheus.Labels{"run": name}, m.reg).Register(c); err != nil {
			return nil, err
		}
		m.byRun[name] = c
	}
	return c.Options(), nil
}

func (m *metrics) runStarted() { m.active.Inc() }

func (m *metrics) runEnded(state string) {
	m.active.Dec()
	m.ended.WithLabelValues(state).Inc()
}

func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}
