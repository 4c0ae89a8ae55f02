package moe

// Phase names a stage of a Layer's Forward or Backward, for WithPhaseHook.
type Phase string

// The phases, in the order a Forward and then a Backward run them (Phases
// lists them for a dispatcher). Every rank passes through the same phases,
// whatever its row counts.
const (
	// PhaseRoute: the router GEMM, softmax and top-k, the sort of the
	// assignments by expert, the counts to the host (across expert ranks;
	// one rank only queues their download) and the load statistics.
	PhaseRoute Phase = "route"
	// PhaseCountExchange: the all-reduce of the [EP, E] count matrix and
	// the plan of what each rank receives.
	PhaseCountExchange Phase = "count exchange"
	// PhaseDispatch: the token rows gathered into send order, exchanged
	// (all-to-all) and permuted into expert-major order.
	PhaseDispatch Phase = "dispatch"
	// PhaseExperts: the grouped expert GEMMs and SwiGLU.
	PhaseExperts Phase = "experts"
	// PhaseDispatchExperts replaces PhaseDispatch and PhaseExperts with the
	// fused dispatcher: the peer exchange, then the experts gathering their
	// rows from the source ranks (DispatchSwiGLU) and writing their outputs
	// into the source ranks' buffers (DownCombine).
	PhaseDispatchExperts Phase = "dispatch+experts"
	// PhaseCombine: the outputs permuted back, exchanged and added into
	// their tokens' rows, scaled by the gates (fused: the barrier that
	// waits for the peers' outputs, then the add).
	PhaseCombine Phase = "combine"
	// PhaseRouterBackward: the gate gradients, the router's backward and
	// its GEMMs.
	PhaseRouterBackward Phase = "router backward"
	// PhaseDispatchBackward, PhaseExpertsBackward, PhaseCombineBackward:
	// the routed path in reverse (output gradients to the experts, their
	// dgrad and wgrad GEMMs, input gradients back to the tokens). Fused,
	// the output gradients are gathered from the source ranks and the
	// input gradients written into theirs (GatherPeerRows,
	// ScatterPeerRows), then a barrier.
	PhaseDispatchBackward Phase = "dispatch backward"
	PhaseExpertsBackward  Phase = "experts backward"
	PhaseCombineBackward  Phase = "combine backward"
	// PhaseEnd closes a Forward or a Backward.
	PhaseEnd Phase = "end"
)

// Phases lists the phases, PhaseEnd left out, that a Forward and then a
// Backward pass through with the given resolved dispatcher
// (Config.Dispatcher: DispatcherFused or DispatcherUnfused).
func Phases(dispatcher string) []Phase {
	forward := []Phase{PhaseDispatch, PhaseExperts}
	if dispatcher == DispatcherFused {
		forward = []Phase{PhaseDispatchExperts}
	}
	return append(append([]Phase{PhaseRoute, PhaseCountExchange}, forward...),
		PhaseCombine, PhaseRouterBackward, PhaseDispatchBackward, PhaseExpertsBackward, PhaseCombineBackward)
}

// WithPhaseHook calls hook with each phase as it begins, and with PhaseEnd
// when Forward or Backward is done (not after an error). Work is queued on
// the backend asynchronously, so a hook that times phases must wait for
// it (Sync) and, with several ranks, for the other ranks (a barrier) before
// reading a clock: `mktrain bench moe` does so. Without a hook the layer
// pays nothing.
func WithPhaseHook(hook func(Phase)) Option { return func(l *Layer) { l.onPhase = hook } }

// phase reports the start of p to the hook, if any.
func (l *Layer) phase(p Phase) {
	if l.onPhase != nil {
		l.onPhase(p)
	}
}
