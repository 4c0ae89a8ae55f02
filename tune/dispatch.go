package tune

import (
	"fmt"
	"runtime"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/moe"
)

// resolveIters is the number of steps of each kind ResolveDispatcher
// measures (forward, and forward+backward): enough for a stable median of
// one layer's steps at little cost.
const resolveIters = 5

// ResolveDispatcher settles cfg.Dispatcher for a layer of width dim with
// tokens local tokens on ep expert-parallel ranks of b; canPeer says
// whether the expert group offers peer access (comm.PeerAccess). It
// returns "fused" or "unfused":
//
//   - "unfused" and "fused" pass through; "fused" without peer access is
//     an error.
//   - "auto" (or "") without peer access is "unfused": the fused path
//     needs it.
//   - "auto" on the CPU backend is "unfused", unmeasured: there the fused
//     ops are the unfused sequence of ops (the reference compositions), so
//     neither can be faster, and the unfused path is the reference.
//   - otherwise "auto" is the table's entry for this machine and shape
//     (DefaultDispatchCache), or, when there is none, the faster in a
//     measurement (moe.MeasureDispatch) that is then stored. A table that
//     cannot be read or written costs a measurement, not the run.
//
// log, when not nil, receives one sentence on the choice and why
// (measured or from the table), and one before a measurement starts. All
// ranks of a run must use the same dispatcher: resolve once, before the
// ranks build their layers.
func ResolveDispatcher(b backend.Backend, cfg moe.Config, dim, tokens, ep int, canPeer bool, log func(string)) (string, error) {
	say := func(format string, args ...any) {
		if log != nil {
			log(fmt.Sprintf(format, args...))
		}
	}
	switch cfg.Dispatcher {
	case moe.DispatcherUnfused:
		say("model.moe.dispatcher: unfused, as the recipe says")
		return moe.DispatcherUnfused, nil
	case moe.DispatcherFused:
		if !canPeer {
			return "", fmt.Errorf("moe: model.moe.dispatcher is %q, but the expert group has no peer access: "+
				"in-process virtual ranks and the NCCL groups of one process offer it, groups across processes do not yet; use %q or %q",
				moe.DispatcherFused, moe.DispatcherUnfused, moe.DispatcherAuto)
		}
		say("model.moe.dispatcher: fused, as the recipe says")
		return moe.DispatcherFused, nil
	case moe.DispatcherAuto, "":
	default:
		return "", fmt.Errorf("moe: model.moe.dispatcher is %q; want %q, %q or %q", cfg.Dispatcher, moe.DispatcherAuto, moe.DispatcherFused, moe.DispatcherUnfused)
	}
	if !canPeer {
		say("model.moe.dispatcher auto: unfused, since the expert group has no peer access")
		return moe.DispatcherUnfused, nil
	}
	if b.Name() == "cpu" {
		say("model.moe.dispatcher auto: unfused, unmeasured: on the CPU the fused ops are the unfused sequence")
		return moe.DispatcherUnfused, nil
	}
	key := NewDispatchKey(b, cfg, dim, tokens, ep)
	cache, err := DefaultDispatchCache()
	if err == nil {
		e, ok, lerr := cache.Lookup(key)
		switch {
		case lerr != nil:
			say("model.moe.dispatcher auto: %v; measuring instead", lerr)
		case ok:
			say("model.moe.dispatcher auto: %s, from the table %s (measured %s: %.3g ms fused, %.3g ms unfused per forward+backward; %s)",
				e.Choice, cache.Path, e.MeasuredAt.Format(time.DateOnly), e.FusedMS, e.UnfusedMS, key)
			return e.Choice, nil
		}
	}
	say("model.moe.dispatcher auto: measuring both dispatchers (%s)", key)
	t, merr := moe.MeasureDispatch(b, cfg, dim, tokens, ep, resolveIters)
	// The measurement's tensors are garbage now; collecting them hands
	// their device memory back to the backend before the model allocates.
	runtime.GC()
	if merr != nil {
		return "", fmt.Errorf("moe: measuring the dispatchers for model.moe.dispatcher auto (set it to %q or %q to skip): %w",
			moe.DispatcherFused, moe.DispatcherUnfused, merr)
	}
	stored := "not stored"
	switch {
	case err != nil:
		stored += ": " + err.Error()
	default:
		if _, serr := cache.Store(key, t); serr != nil {
			stored += ": " + serr.Error()
		} else {
			stored = "stored in " + cache.Path
		}
	}
	say("model.moe.dispatcher auto: %s, measured: %.3g ms fused, %.3g ms unfused per forward+backward (%s)",
		t.Faster(), float64(t.FusedStep)/1e6, float64(t.UnfusedStep)/1e6, stored)
	return t.Faster(), nil
}
