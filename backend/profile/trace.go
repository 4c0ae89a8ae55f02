package profile

// A Report's timeline as a Chrome trace: the JSON "trace event format"
// that Perfetto (ui.perfetto.dev) and chrome://tracing open. Three tracks
// of one process: the profiled window as one span, the model's scopes
// (attention, MoE, head, optimizer, elsewhere) as runs of consecutive ops,
// and every op, named by its backend method and coloured by kind. Times are
// the profiler clock's: the GPU's on the CUDA backend, so gaps between
// ops are time the device sat idle.

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"time"
)

// TraceInfo names what a trace shows.
type TraceInfo struct {
	Process string        // the process track's name: "mktrain bench train tiny (cpu)"
	Window  string        // the window span's name: "step 24"
	Wall    time.Duration // the window's wall time (0: from the first op's start to the last op's end)
}

// traceEvent is one event of the trace event format: ph "X" a complete
// event (ts and dur in microseconds), "M" metadata naming a track.
type traceEvent struct {
	Name string         `json:"name"`
	Cat  string         `json:"cat,omitempty"`
	Ph   string         `json:"ph"`
	Ts   float64        `json:"ts"`
	Dur  float64        `json:"dur,omitempty"`
	Pid  int            `json:"pid"`
	Tid  int            `json:"tid"`
	Args map[string]any `json:"args,omitempty"`
}

// Tracks (thread ids) of the trace.
const (
	trackWindow = 1
	trackScopes = 2
	trackOps    = 3
)

// WriteTrace writes r's timeline (r.Spans) to w as a Chrome trace.
func WriteTrace(w io.Writer, r Report, info TraceInfo) error {
	if len(r.Spans) == 0 {
		return fmt.Errorf("profile: no op was recorded: the trace would be empty")
	}
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	meta := func(tid int, key, name string, sort int) []traceEvent {
		return []traceEvent{
			{Name: key, Ph: "M", Pid: 1, Tid: tid, Args: map[string]any{"name": name}},
			{Name: "thread_sort_index", Ph: "M", Pid: 1, Tid: tid, Args: map[string]any{"sort_index": sort}},
		}
	}
	events := []traceEvent{{Name: "process_name", Ph: "M", Pid: 1, Args: map[string]any{"name": info.Process}}}
	events = append(events, meta(trackWindow, "thread_name", "window", 1)...)
	events = append(events, meta(trackScopes, "thread_name", "scopes", 2)...)
	events = append(events, meta(trackOps, "thread_name", "ops", 3)...)

	last := r.Spans[len(r.Spans)-1]
	end := last.Start + last.Time
	wall := info.Wall
	if wall <= 0 {
		wall = end
	}
	var opTime time.Duration
	for _, s := range r.Spans {
		opTime += s.Time
	}
	events = append(events, traceEvent{Name: cmp.Or(info.Window, "profiled window"), Ph: "X", Ts: 0, Dur: us(wall),
		Pid: 1, Tid: trackWindow, Args: map[string]any{"ops": len(r.Spans), "op_time_ms": opTime.Seconds() * 1e3}})

	// Runs of ops of one scope, from the first one's start to the last
	// one's end.
	for i := 0; i < len(r.Spans); {
		j := i
		for j+1 < len(r.Spans) && r.Spans[j+1].Scope == r.Spans[i].Scope {
			j++
		}
		scope := cmp.Or(r.Spans[i].Scope, "elsewhere")
		events = append(events, traceEvent{Name: scope, Cat: "scope", Ph: "X", Ts: us(r.Spans[i].Start),
			Dur: us(r.Spans[j].Start + r.Spans[j].Time - r.Spans[i].Start), Pid: 1, Tid: trackScopes,
			Args: map[string]any{"ops": j - i + 1}})
		i = j + 1
	}
	for _, s := range r.Spans {
		events = append(events, traceEvent{Name: s.Op, Cat: s.Kind, Ph: "X", Ts: us(s.Start), Dur: us(s.Time),
			Pid: 1, Tid: trackOps, Args: map[string]any{"scope": cmp.Or(s.Scope, "elsewhere"), "kind": s.Kind}})
	}
	return json.NewEncoder(w).Encode(struct {
		TraceEvents     []traceEvent `json:"traceEvents"`
		DisplayTimeUnit string       `json:"displayTimeUnit"`
	}{events, "ms"})
}
