package profile

import (
	"cmp"
	"slices"
	"time"
)

// Report is the time a profiled window spent per kind of work.
type Report struct {
	// Kinds holds one entry per kind that occurred, longest first.
	Kinds []KindTime
	// Ops holds one entry per (scope, op), longest first, for a closer look.
	Ops []OpTime
	// Spans holds every op in the order it ran, each with its start from
	// the first op's start: the window's timeline (WriteTrace).
	Spans []Span
}

// Span is one op on the profiled window's timeline.
type Span struct {
	Scope, Op, Kind string
	Start           time.Duration // from the start of the window's first op
	Time            time.Duration
}

// KindTime is the summed time of one kind of work.
type KindTime struct {
	Kind  string
	Time  time.Duration
	Ops   int     // ops counted (0 for host gaps)
	Share float64 // of the op time, or of the wall time after WithWall
}

// OpTime is the summed time of one op in one scope.
type OpTime struct {
	Scope, Op, Kind string
	Time            time.Duration
	Calls           int
}

// newReport sums ops into kinds and sorts both lists.
func newReport(ops []OpTime) Report {
	index := map[string]int{} // kind -> position in kinds
	var kinds []KindTime
	for _, o := range ops {
		i, ok := index[o.Kind]
		if !ok {
			i = len(kinds)
			index[o.Kind] = i
			kinds = append(kinds, KindTime{Kind: o.Kind})
		}
		kinds[i].Time += o.Time
		kinds[i].Ops += o.Calls
	}
	r := Report{Kinds: kinds, Ops: ops}
	slices.SortFunc(r.Ops, func(a, b OpTime) int {
		return cmp.Or(cmp.Compare(b.Time, a.Time), cmp.Compare(a.Scope, b.Scope), cmp.Compare(a.Op, b.Op))
	})
	r.setShares(r.OpTime())
	return r
}

// OpTime is the summed time of every op (host gaps excluded).
func (r Report) OpTime() time.Duration {
	var sum time.Duration
	for _, k := range r.Kinds {
		if k.Kind != KindHostGaps {
			sum += k.Time
		}
	}
	return sum
}

// WithWall returns r with the kind "host gaps" set to wall minus the op
// time, or to 0 when the ops add up to more than wall (see the package doc),
// and with shares of max(wall, op time), so that they add up to 1.
func (r Report) WithWall(wall time.Duration) Report {
	ops := r.OpTime()
	out := Report{Ops: r.Ops, Spans: r.Spans}
	for _, k := range r.Kinds {
		if k.Kind != KindHostGaps {
			out.Kinds = append(out.Kinds, k)
		}
	}
	out.Kinds = append(out.Kinds, KindTime{Kind: KindHostGaps, Time: max(0, wall-ops)})
	out.setShares(max(wall, ops))
	return out
}

// setShares sets each kind's share of total and sorts the kinds, longest
// first.
func (r *Report) setShares(total time.Duration) {
	for i := range r.Kinds {
		r.Kinds[i].Share = 0
		if total > 0 {
			r.Kinds[i].Share = float64(r.Kinds[i].Time) / float64(total)
		}
	}
	slices.SortFunc(r.Kinds, func(a, b KindTime) int {
		return cmp.Or(cmp.Compare(b.Time, a.Time), cmp.Compare(a.Kind, b.Kind))
	})
}
