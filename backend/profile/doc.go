// Package profile says where a training step's time goes. It wraps a
// backend, times every op it runs, and sums the times by kind of work:
// attention, expert GEMMs, other GEMMs, token dispatch, routing, norms and
// elementwise ops, the loss, the optimizer, host transfers, communication,
// and the host gaps in between. `mktrain bench train` prints its table for
// one profiled step after the measured ones.
//
// # Use
//
//	p := profile.New(inner, profile.ClockFor(inner)) // WallClock, or the backend's own
//	// train on p.Backend() instead of inner (engine.WithBackendWrapper) ...
//	p.SetEnabled(true)
//	// ... one step ...
//	p.SetEnabled(false)
//	rep, err := p.Report()       // per kind (Kinds) and per op (Ops), longest first
//	rep = rep.WithWall(stepWall) // adds "host gaps": wall time no op covers
//	err = profile.WriteTrace(f, rep, profile.TraceInfo{...}) // rep.Spans as a Chrome/Perfetto trace
//
// The model code names what it is doing with Scope(b, ScopeAttention),
// ScopeMoE, ScopeHead, ScopeOptimizer or "" (anything else); Scope does
// nothing on a backend that is not a profiler, so the engine calls it
// unconditionally. KindOf maps (scope, op) to a kind; its doc comment is
// the table. Collective times a communicator's call that queues work on the
// device without going through the wrapper (an NCCL collective) as kind
// communication.
//
// # Design notes
//
// A *Backend forwards every op of backend.Backend to the backend it wraps.
// While enabled it brackets each op with two marks of its Clock and records
// (scope, op, start mark, end mark); Report turns the marks into durations,
// and into a timeline (Report.Spans: each op's start from the first op's
// start) that WriteTrace writes in the trace event format (trace.go).
// On the CPU ops run synchronously and WallClock's marks are the time of
// day. On the GPU ops only queue work, so the CUDA backend is a ClockSource
// whose clock records events on the stream: a mark is when the GPU reaches
// it, and an op's duration is its GPU time. New and View are not timed (they
// queue no work). While enabled, ops run one at a time (a mutex spans each
// op and its marks), so ops from several goroutines do not overlap.
//
// The scope is one value per profiler, not per goroutine: with several
// virtual ranks sharing one backend an op near a scope change can carry
// another rank's scope, so the breakdown is exact for one rank and close
// for several.
//
// Host gaps are the profiled window's wall time minus the summed op time:
// on the GPU, the time the stream sat idle waiting for the host (launches,
// host-side routing, Go code between ops); on the CPU, the Go code between
// ops. When the summed op time exceeds the wall time (the profiler
// serialises ops of several goroutines) the gap is 0 and shares are taken
// of the op sum, so shares always add up to 1.
package profile
