package main

// One profiled forward+backward step of a ring row's core and fused ring,
// op by op: where the ring's step spends the time its kernels alone do
// not account for.

import (
	"cmp"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/profile"
)

// attnRingProfile is a ring row's profiled steps: one forward+backward
// step of the core on the whole sequence and one of the fused ring
// (mode ring with peer access), after the timed ones.
type attnRingProfile struct {
	Note string          `json:"note"`
	Core attnStepProfile `json:"core"`
	Ring attnStepProfile `json:"ring"`
}

// attnRingProfileNote says how the profiled steps were taken.
const attnRingProfileNote = "one forward+backward step of each after a warm-up step, on a profiling wrapper of the backend (backend/profile): every op between two marks of the device's clock, ops one at a time, the step queued behind a hold of the device; an op's time is the device's from its first mark to its second, so ops_ms is the ops' own time and step_ms minus ops_ms the device's time between them"

// attnStepProfile is one profiled step: StepMS from the first op's start
// to the last op's end, OpsMS the ops' summed time, and each op's calls
// and time, longest first.
type attnStepProfile struct {
	Path   string       `json:"path"`
	StepMS float64      `json:"step_ms"`
	OpsMS  float64      `json:"ops_ms"`
	Ops    []attnOpTime `json:"ops"`
}

// attnOpTime is one backend op's calls and summed time in a profiled step.
type attnOpTime struct {
	Op    string  `json:"op"`
	Calls int     `json:"calls"`
	MS    float64 `json:"ms"`
}

// profileRingRow takes the profiled steps of a ring row of virtual ranks
// on b: the core on the whole sequence, then the fused ring on w ranks,
// each on a profiler wrapping b, built afresh (the wrapper has to be the
// backend the ranks' cores are built on).
func profileRingRow(b backend.Backend, clock profile.Clock, g attnBenchShape, in ringInputs, w int) (*attnRingProfile, error) {
	prof := profile.New(b, clock)
	pb := prof.Backend()
	out := &attnRingProfile{Note: attnRingProfileNote}
	core := ringCoreSampler(pb, clock, g, in, true)
	var err error
	if out.Core, err = profileStep(prof, func() error {
		_, _, _, err := core(ringForwardBackward, stepHoldMax)
		return err
	}); err != nil {
		return nil, fmt.Errorf("core: %w", err)
	}
	out.Core.Path = "core on the whole sequence"

	world, bs, release, err := virtualRanks(pb, contextMesh)(w)
	if err != nil {
		return nil, err
	}
	defer release()
	ranks, buildErr, err := buildRingRanks(world, bs, false, g, in, w, ringModeRing, false)
	if err = cmp.Or(err, buildErr); err != nil {
		return nil, fmt.Errorf("mode ring: %w", err)
	}
	steps := ringSteps(ranks, true)
	if out.Ring, err = profileStep(prof, func() error {
		_, _, _, err := oneRankStep(pb, clock, steps, stepHoldMax)
		return err
	}); err != nil {
		return nil, fmt.Errorf("mode ring: %w", err)
	}
	out.Ring.Path = ranks[0].core.Path()
	return out, nil
}

// profileStep runs step once unprofiled (a warm-up: first calls allocate
// and load kernels; step waits for the device) and once with prof
// enabled, and returns the second's ops.
func profileStep(prof *profile.Backend, step func() error) (attnStepProfile, error) {
	if err := step(); err != nil {
		return attnStepProfile{}, err
	}
	prof.SetEnabled(true)
	err := step()
	prof.SetEnabled(false)
	rep, repErr := prof.Report()
	if err = cmp.Or(err, repErr); err != nil {
		return attnStepProfile{}, err
	}
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	var p attnStepProfile
	for _, s := range rep.Spans {
		p.StepMS = max(p.StepMS, ms(s.Start+s.Time))
	}
	for _, o := range rep.Ops {
		if o.Op == "Sync" { // the step's wait for the device: no work of its own
			continue
		}
		p.Ops = append(p.Ops, attnOpTime{Op: o.Op, Calls: o.Calls, MS: ms(o.Time)})
		p.OpsMS += ms(o.Time)
	}
	return p, nil
}

// printRingProfiles prints each profiled row's steps on a line of its own:
// the step's time, the ops' and each op's calls and time.
func printRingProfiles(w io.Writer, rows []attnRingRow) {
	step := func(p attnStepProfile) string {
		ops := make([]string, len(p.Ops))
		for i, o := range p.Ops {
			ops[i] = fmt.Sprintf("%s %dx %.3f", o.Op, o.Calls, o.MS)
		}
		return fmt.Sprintf("%.3f ms, ops %.3f: %s", p.StepMS, p.OpsMS, strings.Join(ops, ", "))
	}
	printed := false
	for _, r := range rows {
		if r.Profile == nil {
			continue
		}
		if !printed {
			fmt.Fprintf(w, "(one profiled forward+backward step a row, op by op: calls and ms of the device's time; the step's ms minus the ops' is the device's time between ops)\n")
			printed = true
		}
		fmt.Fprintf(w, "W %d S/W %d core: %s\n", r.World, r.SeqPerRank, step(r.Profile.Core))
		fmt.Fprintf(w, "W %d S/W %d ring: %s\n", r.World, r.SeqPerRank, step(r.Profile.Ring))
	}
}
