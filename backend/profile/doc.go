// Package profile times every backend op of a training step and sums the
// times by kind of work, to say where a step goes: attention, expert GEMMs,
// other GEMMs, token dispatch, routing, norms and elementwise ops, the loss,
// the optimizer, host transfers, and the gaps in between.
//
// # Use
//
//	p := profile.New(inner, profile.ClockFor(inner)) // WallClock, or the GPU's event clock
//	// train on p.Backend() instead of inner ...
//	p.SetEnabled(true)
//	// ... one step ...
//	p.SetEnabled(false)
//	rep, err := p.Report()       // per-kind time and op count of what ran
//	rep = rep.WithWall(stepWall) // adds "host gaps": wall time no op covers
//
// `mktrain bench train` does this for one step after the measured ones
// (engine.WithBackendWrapper puts the wrapper under the engine).
//
// # How ops are timed
//
// A *Backend forwards every op of backend.Backend to the backend it wraps.
// While enabled it brackets each op with two marks of its Clock and records
// (scope, op, start mark, end mark); Report turns the marks into durations.
// On the CPU the ops run synchronously and WallClock's marks are the time of
// day; on the GPU ops only queue work, and the CUDA backend's clock
// (cuda.Backend.ProfileClock) records events on the stream, so a mark is the
// time the GPU reaches it and an op's duration is its GPU time. New and View
// are not timed: they queue no work. While enabled, profiled ops run one at
// a time (a mutex spans each op and its marks), so the intervals of ops from
// several goroutines do not overlap.
//
// # Scopes and kinds
//
// The model code names what it is doing with Scope(b, "attention"), "moe",
// "head", "optimizer" or "" (anything else); Scope does nothing on a backend
// that is not a profiler, so the engine calls it unconditionally. KindOf maps
// (scope, op) to a kind; its doc comment is the table. The scope is one value
// per profiler, not per goroutine: with several virtual ranks sharing one
// backend, ranks run the same code in step, but around a scope change an op
// of one rank can be labelled with another rank's scope, and ops of a rank
// still finishing the previous step can fall into the profiled window. The
// breakdown is exact for one rank and close for several.
//
// # Host gaps
//
// Report.WithWall adds the kind "host gaps": the wall time of the profiled
// window minus the summed op time, never negative. On the GPU it is the time
// the stream sat idle waiting for the host (launch overhead, host-side
// routing, Go code between ops); on the CPU, the Go code between ops. When
// the summed op time exceeds the wall time (ops of several goroutines on the
// CPU are serialised by the profiler, so their sum can outgrow the wall time
// of the unprofiled run) the gap is 0 and shares are taken of the op sum
// instead, so shares always add up to 1.
package profile
