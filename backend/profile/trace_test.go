package profile

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
)

// TestTraceTimeline profiles ops of known durations with host time between
// them and reads the Chrome trace back: every op in order at its start and
// with its duration, the scopes as runs of consecutive ops, the window,
// and the tracks named.
func TestTraceTimeline(t *testing.T) {
	clk := newFakeClock()
	inner := &slowBackend{Backend: cpu.New(backend.Float64), clk: clk, cost: 2 * time.Millisecond}
	p := New(inner, clk)
	x, out := p.New(backend.Float64, 2, 2), p.New(backend.Float64, 2, 2)
	p.SetEnabled(true)
	clk.advance(5 * time.Millisecond) // before the first op: not on the timeline
	Scope(p, ScopeAttention)
	p.MatMul(out, x, x, false, false, 1, 0) // 0-2 ms
	clk.advance(time.Millisecond)           // a host gap
	Scope(p, ScopeMoE)
	p.Copy(out, x) // 3-5
	p.Zero(out)    // 5-7
	Scope(p, ScopeHead)
	p.Sum(out) // 7-9
	p.SetEnabled(false)
	rep, err := p.Report()
	if err != nil {
		t.Fatal(err)
	}
	if clk.outstanding() != 0 {
		t.Errorf("%d marks not released", clk.outstanding())
	}
	var buf bytes.Buffer
	if err := WriteTrace(&buf, rep.WithWall(10*time.Millisecond), TraceInfo{Process: "test", Window: "step 3", Wall: 10 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	var trace struct {
		TraceEvents []struct {
			Name, Cat, Ph string
			Ts, Dur       float64
			Tid           int
			Args          map[string]any
		}
	}
	if err := json.Unmarshal(buf.Bytes(), &trace); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, buf.String())
	}
	type span struct {
		name    string
		tid     int
		ts, dur float64
	}
	var spans []span
	names := map[int]string{}
	for _, e := range trace.TraceEvents {
		switch e.Ph {
		case "X":
			spans = append(spans, span{e.Name, e.Tid, e.Ts, e.Dur})
		case "M":
			if e.Name == "thread_name" {
				names[e.Tid] = e.Args["name"].(string)
			}
		default:
			t.Errorf("unexpected phase %q", e.Ph)
		}
	}
	want := []span{
		{"step 3", trackWindow, 0, 10000},
		{ScopeAttention, trackScopes, 0, 2000}, {ScopeMoE, trackScopes, 3000, 4000}, {ScopeHead, trackScopes, 7000, 2000},
		{"MatMul", trackOps, 0, 2000}, {"Copy", trackOps, 3000, 2000}, {"Zero", trackOps, 5000, 2000}, {"Sum", trackOps, 7000, 2000},
	}
	if len(spans) != len(want) {
		t.Fatalf("spans %+v, want %+v", spans, want)
	}
	for i := range want {
		if spans[i] != want[i] {
			t.Errorf("span %d: %+v, want %+v", i, spans[i], want[i])
		}
	}
	if names[trackWindow] != "window" || names[trackScopes] != "scopes" || names[trackOps] != "ops" {
		t.Errorf("track names %v", names)
	}
	if err := WriteTrace(&buf, Report{}, TraceInfo{}); err == nil {
		t.Error("a trace of no op: no error")
	}
}
