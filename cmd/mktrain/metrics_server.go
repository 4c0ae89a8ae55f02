package main

// mktrain run --metrics-addr: the run's Prometheus metrics at /metrics and
// Go's profiler at /debug/pprof/ (package observe/prom), served while the
// run lasts.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/rs/zerolog"

	"github.com/mktrain/mktrain/observe/prom"
)

// metricsServer serves a collector's metrics.
type metricsServer struct {
	srv  *http.Server
	addr net.Addr // the address bound (port 0 resolved)
	done chan struct{}
}

// serveMetrics listens on addr (HOST:PORT; port 0 picks a free one) and
// serves c's metrics and the profiler until stop.
func serveMetrics(addr string, c *prom.Collector, logger zerolog.Logger) (*metricsServer, error) {
	reg, err := prom.NewRegistry(c)
	if err != nil {
		return nil, fmt.Errorf("--metrics-addr: %w", err)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, usageError{fmt.Sprintf("--metrics-addr %s: %v", addr, err)}
	}
	s := &metricsServer{
		srv:  &http.Server{Handler: prom.NewServeMux(reg), ReadHeaderTimeout: 10 * time.Second},
		addr: ln.Addr(),
		done: make(chan struct{}),
	}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Warn().Err(err).Msg("--metrics-addr: the metrics server stopped")
		}
	}()
	return s, nil
}

// url is the server's address for a path ("http://127.0.0.1:9090/metrics").
func (s *metricsServer) url(path string) string { return "http://" + s.addr.String() + path }

// stop closes the server, letting a scrape in progress finish.
func (s *metricsServer) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := s.srv.Shutdown(ctx); err != nil {
		s.srv.Close()
	}
	<-s.done
}
