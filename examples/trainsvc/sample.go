package main

// POST /runs/{name}/sample: a run's newest checkpoint, loaded once
// (package infer) and shared by the requests that sample from it.

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"sync"

	"github.com/rs/zerolog"

	"github.com/mktrain/mktrain/backend/all"
	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/infer"
)

// sampleRequest is POST /runs/{name}/sample's body.
type sampleRequest struct {
	Prompt       string   `json:"prompt"`        // text, encoded with the checkpoint's tokenizer (or byte by byte)
	PromptTokens []int32  `json:"prompt_tokens"` // or token ids
	Tokens       *int     `json:"tokens"`        // tokens to generate; default 64
	Temperature  *float64 `json:"temperature"`   // 0: greedy; default 0.8
	TopK         int      `json:"top_k"`         // 0: every token
	Seed         *uint64  `json:"seed"`          // default 1
}

// sampleAnswer is what a sample request gets back.
type sampleAnswer struct {
	Checkpoint string  `json:"checkpoint"` // the checkpoint sampled from
	Step       int     `json:"step"`       // its training step
	Tokens     []int32 `json:"tokens"`     // the generated token ids (an EOS, when one ended it, included)
	// Text is the prompt and its continuation as text (from prompt), or
	// the continuation's (from prompt_tokens, when the ids decode).
	Text *string `json:"text,omitempty"`
}

// maxSampleTokens bounds one request's work.
const maxSampleTokens = 4096

func (s *service) handleSample(w http.ResponseWriter, req *http.Request) {
	name := req.PathValue("name")
	if !runNamePattern.MatchString(name) {
		writeError(w, &badRequest{fmt.Errorf("run %q: not a run directory's name", name)})
		return
	}
	var sr sampleRequest
	dec := json.NewDecoder(http.MaxBytesReader(w, req.Body, 1<<20))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&sr); err != nil {
		writeError(w, &badRequest{fmt.Errorf("the JSON body: %w (want {\"prompt\", \"tokens\", \"temperature\", \"top_k\", \"seed\"})", err)})
		return
	}
	n, temperature, seed := 64, 0.8, uint64(1)
	if sr.Tokens != nil {
		n = *sr.Tokens
	}
	if sr.Temperature != nil {
		temperature = *sr.Temperature
	}
	if sr.Seed != nil {
		seed = *sr.Seed
	}
	switch {
	case (sr.Prompt == "") == (len(sr.PromptTokens) == 0):
		writeError(w, &badRequest{errors.New("give prompt (text) or prompt_tokens (ids), one of them")})
		return
	case n < 0 || n > maxSampleTokens:
		writeError(w, &badRequest{fmt.Errorf("tokens %d: want 0 to %d", n, maxSampleTokens)})
		return
	}
	m, release, err := s.models.acquire(filepath.Join(s.root, name), s.log)
	if err != nil {
		writeError(w, err)
		return
	}
	defer release()
	// Sampling checks the prompt's ids, the temperature and top_k, and
	// stops between two tokens when the client leaves. From text it
	// stops after the tokenizer's end-of-document token, as
	// transformers' generate does.
	var (
		out  []int32
		text string
	)
	if sr.Prompt != "" {
		text, out, err = m.SampleText(req.Context(), sr.Prompt, n, temperature, sr.TopK, seed)
	} else if out, err = m.Sample(req.Context(), sr.PromptTokens, n, temperature, sr.TopK, seed); err == nil {
		var derr error
		if text, derr = m.Decode(out); derr != nil {
			text = "" // ids beyond the tokenizer's vocabulary: the ids alone
		}
	}
	if err != nil {
		if req.Context().Err() != nil {
			return // the client left
		}
		writeError(w, &badRequest{err})
		return
	}
	answer := sampleAnswer{Checkpoint: m.Dir(), Step: m.Step(), Tokens: out}
	if text != "" {
		answer.Text = &text
	}
	writeJSON(w, http.StatusOK, answer)
}

// modelCache holds the model of each run directory's newest checkpoint.
// A model stays loaded until a newer checkpoint replaces it, and is closed
// once the requests still sampling from it are done.
type modelCache struct {
	mu    sync.Mutex
	byDir map[string]*cachedModel
}

type cachedModel struct {
	model  *infer.Model
	latest string // the checkpoint checkpoint.Latest named when it was loaded
	users  int    // requests sampling from it
	stale  bool   // replaced: close it when users reaches 0
}

func newModelCache() *modelCache { return &modelCache{byDir: map[string]*cachedModel{}} }

// errNoCheckpoint answers 404: there is nothing to sample from.
type errNoCheckpoint struct{ err error }

func (e *errNoCheckpoint) Error() string { return e.err.Error() }

// acquire returns the model of runDir's newest checkpoint, loading it when
// it is not the one held, and the function that hands it back.
func (c *modelCache) acquire(runDir string, log zerolog.Logger) (*infer.Model, func(), error) {
	latest, err := checkpoint.Latest(filepath.Join(runDir, "checkpoints"))
	if err != nil {
		return nil, nil, &errNoCheckpoint{fmt.Errorf("%s has no checkpoint to sample from yet: %w", runDir, err)}
	}
	if m, release := c.hold(runDir, latest); m != nil {
		return m, release, nil
	}
	// Loading reads and verifies the whole checkpoint: not under the lock.
	loaded, err := infer.Load(runDir, engine.WithDrivers(all.Drivers()...), engine.WithLogger(log))
	if err != nil {
		return nil, nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if old := c.byDir[runDir]; old != nil {
		if old.latest == latest { // another request loaded it meanwhile
			if err := loaded.Close(); err != nil {
				return nil, nil, err
			}
			old.users++
			return old.model, c.releaser(old), nil
		}
		c.retire(old)
	}
	cm := &cachedModel{model: loaded, latest: latest, users: 1}
	c.byDir[runDir] = cm
	return loaded, c.releaser(cm), nil
}

// hold takes the held model of runDir when it is latest's.
func (c *modelCache) hold(runDir, latest string) (*infer.Model, func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	cm := c.byDir[runDir]
	if cm == nil || cm.latest != latest {
		return nil, nil
	}
	cm.users++
	return cm.model, c.releaser(cm)
}

func (c *modelCache) releaser(cm *cachedModel) func() {
	return func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		cm.users--
		if cm.stale && cm.users == 0 {
			_ = cm.model.Close() // frees a GPU's memory; on the CPU nothing can fail
		}
	}
}

// retire marks cm replaced and closes it if nobody uses it (c.mu held).
func (c *modelCache) retire(cm *cachedModel) {
	cm.stale = true
	if cm.users == 0 {
		_ = cm.model.Close()
	}
}

// closeAll retires every model.
func (c *modelCache) closeAll() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for dir, cm := range c.byDir {
		c.retire(cm)
		delete(c.byDir, dir)
	}
}
