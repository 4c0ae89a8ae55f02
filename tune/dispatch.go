package tune

import (
	"fmt"
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
	say := sayTo(log)
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
	cache, noTable := DefaultDispatchCache()
	return settling[DispatchEntry, moe.Timing]{
		setting: "model.moe.dispatcher auto", what: "both dispatchers", key: key,
		path: cache.Path, noTable: noTable,
		lookup: func() (DispatchEntry, bool, error) { return cache.Lookup(key) },
		store:  func(t moe.Timing) error { _, err := cache.Store(key, t); return err },
		measure: func() (moe.Timing, error) {
			t, err := moe.MeasureDispatch(b, cfg, dim, tokens, ep, resolveIters)
			if err != nil {
				err = fmt.Errorf("moe: measuring the dispatchers for model.moe.dispatcher auto (set it to %q or %q to skip): %w",
					moe.DispatcherFused, moe.DispatcherUnfused, err)
			}
			return t, err
		},
		entry: func(e DispatchEntry) (string, string) {
			return e.Choice, fmt.Sprintf("measured %s: %.3g ms fused, %.3g ms unfused per forward+backward",
				e.MeasuredAt.Format(time.DateOnly), e.FusedMS, e.UnfusedMS)
		},
		timing: func(t moe.Timing) (string, string) {
			return t.Faster(), fmt.Sprintf("%.3g ms fused, %.3g ms unfused per forward+backward",
				float64(t.FusedStep)/1e6, float64(t.UnfusedStep)/1e6)
		},
	}.settle(say)
}
