package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/checkpoint"
)

// fastTiny are the overrides that keep the tiny recipe's runs short on
// the CPU (its steps take tens of milliseconds: an event stream read by
// a busy test stays far from the service's limit on falling behind); the
// steps are set per request.
var fastTiny = []string{
	"train.backend=cpu", "model.moe.dispatcher=unfused", // no measuring, nothing cached in $HOME
	"train.warmup_steps=1", "train.eval_every=0", "train.eval_batches=1", "checkpoint.every=0", "log.every=1",
}

// TestService runs the service end to end on a free port: it starts the
// tiny recipe, streams its steps, stops it with a checkpoint (DELETE),
// resumes it by posting the same run directory again, samples from its
// checkpoint and reads /metrics, with the refusals on the way (a run
// directory in use, a bad recipe, a resume that changes the model,
// unknown runs).
func TestService(t *testing.T) {
	root := t.TempDir()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var log bytes.Buffer
	svc, err := newService(root, 1, &syncBuffer{b: &log})
	if err != nil {
		t.Fatal(err)
	}
	ctx, shutdown := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- serve(ctx, ln, svc) }()
	defer func() {
		shutdown()
		if err := <-served; err != nil {
			t.Errorf("serve: %v", err)
		}
		if t.Failed() {
			t.Logf("service log:\n%s", log.String())
		}
	}()
	base := "http://" + ln.Addr().String()

	// Start: JSON naming a shipped recipe; it would train for long.
	var st status
	code := call(t, "POST", base+"/runs", "application/json", map[string]any{
		"shipped": "tiny", "set": append([]string{"train.steps=100000"}, fastTiny...), "run_dir": "svc",
	}, &st)
	if code != http.StatusAccepted || st.Name != "svc" || st.State != stateRunning || st.Backend != "cpu" {
		t.Fatalf("POST /runs: %d %+v; want 202, run svc running on the cpu", code, st)
	}

	// Stream its steps until the third.
	events := openEvents(t, base+"/runs/svc/events")
	defer events.Close()
	if ev := events.next(t); ev.name != "status" {
		t.Fatalf("first event %q; want the status", ev.name)
	}
	for want := 1; want <= 3; want++ {
		ev := events.next(t)
		var step struct {
			Step int     `json:"step"`
			Loss float64 `json:"loss"`
		}
		if err := json.Unmarshal([]byte(ev.data), &step); err != nil || ev.name != "step" || step.Step != want || ev.id != fmt.Sprint(want) || step.Loss <= 0 {
			t.Fatalf("event %d: %q id %q %s (%v); want step %d with its loss", want, ev.name, ev.id, ev.data, err, want)
		}
	}

	// While it trains, its directory takes no second run.
	var refusal map[string]string
	if code := call(t, "POST", base+"/runs", "application/json", map[string]any{"shipped": "tiny", "set": fastTiny, "run_dir": "svc"}, &refusal); code != http.StatusConflict || !strings.Contains(refusal["error"], "DELETE") {
		t.Errorf("second POST on a training run: %d %v; want 409 saying to DELETE it", code, refusal)
	}

	// Stop: the answer comes once the checkpoint is saved.
	if code := call(t, "DELETE", base+"/runs/svc", "", nil, &st); code != http.StatusOK || st.State != stateStopped || st.Error != "" {
		t.Fatalf("DELETE: %d %+v; want 200, stopped", code, st)
	}
	stoppedAt := st.Step
	wantCkpt := filepath.Join(root, "svc", "checkpoints", checkpoint.StepDirName(stoppedAt))
	if stoppedAt < 3 || st.Checkpoint != wantCkpt {
		t.Fatalf("stopped at step %d with checkpoint %q; want step 3 or later and %s", stoppedAt, st.Checkpoint, wantCkpt)
	}
	if err := checkpoint.Verify(st.Checkpoint); err != nil {
		t.Fatalf("the stop's checkpoint: %v", err)
	}
	// The stream carried every step to the stop, then the end.
	for want := 4; ; want++ {
		ev := events.next(t)
		if ev.name == "end" {
			var end status
			if err := json.Unmarshal([]byte(ev.data), &end); err != nil || end.State != stateStopped || want != stoppedAt+1 {
				t.Errorf("end event %s after step %d; want state stopped after step %d", ev.data, want-1, stoppedAt)
			}
			break
		}
		if ev.name != "step" || ev.id != fmt.Sprint(want) {
			t.Fatalf("event %q id %q; want step %d", ev.name, ev.id, want)
		}
	}

	// Resume: the recipe's YAML as the body, the same run directory, two
	// steps more.
	tinyYAML, err := os.ReadFile(filepath.Join("..", "..", "recipes", "tiny.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	q := url.Values{"run_dir": {"svc"}, "set": append([]string{fmt.Sprintf("train.steps=%d", stoppedAt+2)}, fastTiny...)}
	if code := call(t, "POST", base+"/runs?"+q.Encode(), "application/yaml", string(tinyYAML), &st); code != http.StatusAccepted {
		t.Fatalf("resuming POST: %d %+v", code, st)
	}
	st = waitEnded(t, base+"/runs/svc")
	wantCkpt = filepath.Join(root, "svc", "checkpoints", checkpoint.StepDirName(stoppedAt+2))
	if st.State != stateFinished || st.StartStep == nil || *st.StartStep != stoppedAt || st.Step != stoppedAt+2 ||
		st.Checkpoint != wantCkpt || st.ValLoss == nil {
		t.Fatalf("resumed run: %+v; want finished, from step %d to %d, with a validation loss and checkpoint %s", st, stoppedAt, stoppedAt+2, wantCkpt)
	}

	// Sample from the newest checkpoint, twice alike (greedy).
	var sample, again sampleAnswer
	req := map[string]any{"prompt": "The ", "tokens": 8, "temperature": 0}
	if code := call(t, "POST", base+"/runs/svc/sample", "application/json", req, &sample); code != http.StatusOK {
		t.Fatalf("sample: %d", code)
	}
	if sample.Checkpoint != wantCkpt || sample.Step != stoppedAt+2 || len(sample.Tokens) != 8 || sample.Text == nil ||
		len(*sample.Text) != 4+8 || !strings.HasPrefix(*sample.Text, "The ") {
		t.Fatalf("sample: %+v; want 8 tokens from %s, and the prompt with its 8 bytes more as text", sample, wantCkpt)
	}
	call(t, "POST", base+"/runs/svc/sample", "application/json", req, &again)
	if fmt.Sprint(again.Tokens) != fmt.Sprint(sample.Tokens) {
		t.Errorf("greedy samples differ: %v and %v", sample.Tokens, again.Tokens)
	}

	// A resume that changes the model is refused by the engine as it
	// starts: the run fails, saying why, and its checkpoints stay.
	code = call(t, "POST", base+"/runs", "application/json", map[string]any{
		"shipped": "tiny", "set": append([]string{"model.moe.ffn=64"}, fastTiny...), "run_dir": "svc",
	}, &st)
	if code != http.StatusAccepted {
		t.Fatalf("POST /runs with another model: %d %+v", code, st)
	}
	if st = waitEnded(t, base+"/runs/svc"); st.State != stateFailed || !strings.Contains(st.Error, "model.moe.ffn") {
		t.Errorf("resume with another model: %+v; want failed, naming model.moe.ffn", st)
	}
	if latest, err := checkpoint.Latest(filepath.Join(root, "svc", "checkpoints")); err != nil || latest != wantCkpt {
		t.Errorf("after the refused resume the newest checkpoint is %q (%v); want %s", latest, err, wantCkpt)
	}

	// Metrics: mktrain's collector per run, and the service's counts.
	metrics := get(t, base+"/metrics")
	for _, want := range []string{
		fmt.Sprintf(`mktrain_step{run="svc"} %d`, stoppedAt+2),
		fmt.Sprintf(`mktrain_start_step{run="svc"} %d`, stoppedAt),
		`mktrain_checkpoints_saved_total{run="svc"} 1`,
		`trainsvc_runs_ended_total{state="stopped"} 1`,
		`trainsvc_runs_ended_total{state="finished"} 1`,
		`trainsvc_runs_ended_total{state="failed"} 1`,
		`trainsvc_runs_active 0`,
	} {
		if !strings.Contains(metrics, want+"\n") {
			t.Errorf("/metrics lacks the line %q", want)
		}
	}

	// Refusals.
	for _, c := range []struct {
		method, path, contentType string
		body                      any
		code                      int
		says                      string
	}{
		{"POST", "/runs?run_dir=bad", "application/yaml", "model:\n  dim: 65\n", 400, "model.dim"},
		{"POST", "/runs", "application/json", map[string]any{"shipped": "tiny", "run_dir": "../escape"}, 400, "run_dir"},
		{"POST", "/runs", "application/json", map[string]any{"shiped": "tiny"}, 400, "shiped"},
		{"POST", "/runs", "application/json", map[string]any{"shipped": "huge"}, 400, "not a shipped recipe"},
		{"GET", "/runs/nosuch", "", nil, 404, "nosuch"},
		{"DELETE", "/runs/nosuch", "", nil, 404, "nosuch"},
		{"POST", "/runs/nosuch/sample", "application/json", map[string]any{"prompt": "a"}, 404, "no checkpoint"},
		{"POST", "/runs/svc/sample", "application/json", map[string]any{"prompt": "a", "temperature": -1}, 400, "temperature"},
	} {
		var answer map[string]string
		if code := call(t, c.method, base+c.path, c.contentType, c.body, &answer); code != c.code || !strings.Contains(answer["error"], c.says) {
			t.Errorf("%s %s %v: %d %q; want %d saying %q", c.method, c.path, c.body, code, answer["error"], c.code, c.says)
		}
	}

	// The run directory holds what mktrain run writes.
	for _, name := range []string{"recipe.yaml", "train.log", "metrics.jsonl"} {
		if _, err := os.Stat(filepath.Join(root, "svc", name)); err != nil {
			t.Errorf("run directory: %v", err)
		}
	}
}

// TestShutdownStopsRuns: when the service stops (SIGINT in main), a run in
// progress stops with a checkpoint and the server closes.
func TestShutdownStopsRuns(t *testing.T) {
	root := t.TempDir()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	svc, err := newService(root, 1, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ctx, shutdown := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- serve(ctx, ln, svc) }()
	base := "http://" + ln.Addr().String()
	var st status
	if code := call(t, "POST", base+"/runs", "application/json", map[string]any{
		"shipped": "tiny", "set": append([]string{"train.steps=100000"}, fastTiny...), "run_dir": "down",
	}, &st); code != http.StatusAccepted {
		t.Fatalf("POST /runs: %d %+v", code, st)
	}
	events := openEvents(t, base+"/runs/down/events")
	defer events.Close()
	for ev := events.next(t); ev.name != "step"; ev = events.next(t) {
	}
	shutdown()
	if err := <-served; err != nil {
		t.Fatalf("serve: %v", err)
	}
	st = svc.get("down").status()
	if st.State != stateStopped || st.Checkpoint == "" {
		t.Fatalf("after shutdown: %+v; want stopped with a checkpoint", st)
	}
	if err := checkpoint.Verify(st.Checkpoint); err != nil {
		t.Fatal(err)
	}
}

// call sends body (JSON, or a string as is) and decodes the JSON answer
// into out; it returns the status code.
func call(t *testing.T, method, url, contentType string, body, out any) int {
	t.Helper()
	var r io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		r = strings.NewReader(b)
	default:
		data, err := json.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		r = bytes.NewReader(data)
	}
	req, err := http.NewRequest(method, url, r)
	if err != nil {
		t.Fatal(err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			t.Fatalf("%s %s: answer %d %q is not the JSON expected: %v", method, url, resp.StatusCode, data, err)
		}
	}
	return resp.StatusCode
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %v", url, resp.StatusCode, err)
	}
	return string(data)
}

// waitEnded polls a run's status until it is no longer running.
func waitEnded(t *testing.T, url string) status {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		var st status
		call(t, "GET", url, "", nil, &st)
		if st.State != stateRunning && st.State != stateStopping {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("run still %s after a minute: %+v", st.State, st)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// eventStream reads server-sent events.
type eventStream struct {
	body io.ReadCloser
	scan *bufio.Scanner
}

type sseEvent struct{ id, name, data string }

func openEvents(t *testing.T, url string) *eventStream {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	if ct := resp.Header.Get("Content-Type"); resp.StatusCode != http.StatusOK || ct != "text/event-stream" {
		resp.Body.Close()
		t.Fatalf("GET %s: %d %s; want 200 text/event-stream", url, resp.StatusCode, ct)
	}
	return &eventStream{body: resp.Body, scan: bufio.NewScanner(resp.Body)}
}

// next reads the next event; the stream must not end before it.
func (s *eventStream) next(t *testing.T) sseEvent {
	t.Helper()
	var ev sseEvent
	for s.scan.Scan() {
		line := s.scan.Text()
		if line == "" {
			return ev
		}
		field, value, _ := strings.Cut(line, ": ")
		switch field {
		case "id":
			ev.id = value
		case "event":
			ev.name = value
		case "data":
			ev.data = value
		}
	}
	t.Fatalf("event stream ended (%v) in the middle of %+v", s.scan.Err(), ev)
	return ev
}

func (s *eventStream) Close() error { return s.body.Close() }

// syncBuffer is the service's log in a test: written by the service and
// the runs' engines, read at the end.
type syncBuffer struct {
	mu sync.Mutex
	b  *bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
