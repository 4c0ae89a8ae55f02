package main

// The HTTP side: routes, request decoding, answers and event streams.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/recipes"
)

// handler routes the service's endpoints (see the package documentation).
func (s *service) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /runs", s.handleStart)
	mux.HandleFunc("GET /runs", s.handleList)
	mux.HandleFunc("GET /runs/{name}", s.handleStatus)
	mux.HandleFunc("GET /runs/{name}/events", s.handleEvents)
	mux.HandleFunc("DELETE /runs/{name}", s.handleStop)
	mux.HandleFunc("POST /runs/{name}/sample", s.handleSample)
	mux.Handle("GET /metrics", s.metrics.handler())
	return mux
}

// badRequest marks an error as the client's (400).
type badRequest struct{ err error }

func (e *badRequest) Error() string { return e.err.Error() }
func (e *badRequest) Unwrap() error { return e.err }

// startRequest is POST /runs's JSON body.
type startRequest struct {
	Recipe  string   `json:"recipe"`  // the recipe's YAML text
	Shipped string   `json:"shipped"` // or the name of a shipped recipe (tiny, moe-small)
	Set     []string `json:"set"`     // overrides, key.path=value, as mktrain run --set
	RunDir  string   `json:"run_dir"` // the run's directory under --root
}

// maxRequestBytes bounds a request body: a recipe and its overrides.
const maxRequestBytes = recipes.MaxRecipeBytes + 64<<10

func (s *service) handleStart(w http.ResponseWriter, req *http.Request) {
	start, err := decodeStart(w, req)
	if err != nil {
		writeError(w, &badRequest{err})
		return
	}
	var (
		cfg      engine.Config
		snapshot []byte
	)
	switch {
	case start.Recipe != "" && start.Shipped != "":
		err = errors.New("give the recipe's YAML (recipe) or a shipped recipe's name (shipped), not both")
	case start.Shipped != "":
		if !slices.Contains(recipes.Shipped(), start.Shipped) {
			err = fmt.Errorf("shipped: %q is not a shipped recipe (%s)", start.Shipped, strings.Join(recipes.Shipped(), ", "))
			break
		}
		cfg, snapshot, err = recipes.Load(start.Shipped, start.Set)
	case strings.TrimSpace(start.Recipe) == "":
		err = errors.New("the request holds no recipe: send its YAML as the body, or JSON with recipe or shipped")
	default:
		cfg, snapshot, err = recipes.Parse("recipe", []byte(start.Recipe), start.Set)
	}
	if err != nil {
		writeError(w, &badRequest{err})
		return
	}
	if start.RunDir == "" {
		start.RunDir = "run-" + time.Now().UTC().Format("20060102-150405.000")
	}
	r, err := s.start(start.RunDir, cfg, snapshot)
	if err != nil {
		writeError(w, err)
		return
	}
	w.Header().Set("Location", "/runs/"+r.name)
	writeJSON(w, http.StatusAccepted, r.status())
}

// decodeStart reads POST /runs: JSON (a startRequest), or else the
// recipe's YAML with run_dir and set in the query.
func decodeStart(w http.ResponseWriter, req *http.Request) (startRequest, error) {
	body, err := io.ReadAll(http.MaxBytesReader(w, req.Body, maxRequestBytes))
	if err != nil {
		return startRequest{}, fmt.Errorf("reading the request: %w", err)
	}
	if mediaType, _, _ := mime.ParseMediaType(req.Header.Get("Content-Type")); mediaType == "application/json" {
		var start startRequest
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.DisallowUnknownFields() // as strict as a recipe: a misspelt field is an error
		if err := dec.Decode(&start); err != nil {
			return startRequest{}, fmt.Errorf("the JSON body: %w (want {\"recipe\" or \"shipped\", \"set\", \"run_dir\"})", err)
		}
		return start, nil
	}
	q := req.URL.Query()
	return startRequest{Recipe: string(body), Set: q["set"], RunDir: q.Get("run_dir")}, nil
}

func (s *service) handleList(w http.ResponseWriter, req *http.Request) {
	runs := s.list()
	out := make([]status, len(runs))
	for i, r := range runs {
		out[i] = r.status()
	}
	writeJSON(w, http.StatusOK, out)
}

// lookup finds the run a path names, or answers 404.
func (s *service) lookup(w http.ResponseWriter, req *http.Request) *run {
	name := req.PathValue("name")
	r := s.get(name)
	if r == nil {
		writeJSON(w, http.StatusNotFound, map[string]string{"error": fmt.Sprintf("no run %q in this service (POST /runs starts one)", name)})
	}
	return r
}

func (s *service) handleStatus(w http.ResponseWriter, req *http.Request) {
	if r := s.lookup(w, req); r != nil {
		writeJSON(w, http.StatusOK, r.status())
	}
}

// handleStop stops a run and answers once its checkpoint is saved.
func (s *service) handleStop(w http.ResponseWriter, req *http.Request) {
	r := s.lookup(w, req)
	if r == nil {
		return
	}
	r.stop()
	select {
	case <-r.done:
		writeJSON(w, http.StatusOK, r.status())
	case <-req.Context().Done(): // the client left; the run stops all the same
	}
}

// handleEvents streams a run's steps as server-sent events.
func (s *service) handleEvents(w http.ResponseWriter, req *http.Request) {
	r := s.lookup(w, req)
	if r == nil {
		return
	}
	rc := http.NewResponseController(w)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	watch, st := r.watch()
	if watch == nil { // the run has ended: its final status
		_ = writeEvent(w, rc, "", "status", st) // the client may have left; nothing to do then
		_ = writeEvent(w, rc, "", "end", st)
		return
	}
	defer r.unwatch(watch)
	if err := writeEvent(w, rc, "", "status", st); err != nil {
		return
	}
	for {
		select {
		case line, ok := <-watch.steps:
			switch {
			case ok:
				var step struct{ Step int }
				_ = json.Unmarshal(line, &step) // the engine wrote it: it decodes
				if writeEvent(w, rc, fmt.Sprint(step.Step), "step", json.RawMessage(line)) != nil {
					return
				}
			case r.isLagged(watch):
				_ = writeEvent(w, rc, "", "error", map[string]string{
					"error": fmt.Sprintf("this stream fell %d steps behind and was cut off; reconnect", watcherBuffer)})
				return
			default: // the run ended
				_ = writeEvent(w, rc, "", "end", r.status())
				return
			}
		case <-req.Context().Done():
			return
		case <-s.closing:
			return
		}
	}
}

// writeEvent writes one server-sent event whose data is v as JSON (one
// line), and flushes it to the client.
func writeEvent(w io.Writer, rc *http.ResponseController, id, event string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	var b bytes.Buffer
	if id != "" {
		fmt.Fprintf(&b, "id: %s\n", id)
	}
	fmt.Fprintf(&b, "event: %s\ndata: %s\n\n", event, data)
	if _, err := w.Write(b.Bytes()); err != nil {
		return err
	}
	return rc.Flush()
}

// writeError answers err with its status: 400 for the client's mistakes,
// 404 for a run with no checkpoint to sample, 409 for a run directory in use, 503 when the service is full or closing,
// 500 otherwise.
func writeError(w http.ResponseWriter, err error) {
	code := http.StatusInternalServerError
	switch {
	case errors.As(err, new(*badRequest)):
		code = http.StatusBadRequest
	case errors.As(err, new(*errNoCheckpoint)):
		code = http.StatusNotFound
	case errors.Is(err, errConflict):
		code = http.StatusConflict
	case errors.Is(err, errBusy):
		code = http.StatusServiceUnavailable
	}
	writeJSON(w, code, map[string]string{"error": err.Error()})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v) // a client that left cannot be told
}
