// Command trainsvc is a small HTTP/JSON service built on mktrain's public
// Go API (packages engine, recipes, infer and checkpoint): it starts
// training runs from recipes, reports and streams their steps, stops them
// with a checkpoint, resumes them, samples from their checkpoints and
// serves Prometheus metrics. It is an example to copy from, kept working
// by its test (go test ./examples/...), not a hardened product: it has no
// authentication, and a recipe may name any file the service can read
// (data shards, checkpoint.init_from), so it listens on localhost unless
// told otherwise.
//
//	go run ./examples/trainsvc --addr 127.0.0.1:8080 --root runs
//
// # Endpoints
//
//	POST   /runs                  start a run, or resume one (same run_dir)
//	GET    /runs                  every run this service started, newest first
//	GET    /runs/{name}           a run's status
//	GET    /runs/{name}/events    its steps as server-sent events
//	DELETE /runs/{name}           stop it after the current step, saving a checkpoint
//	POST   /runs/{name}/sample    continue a prompt with its newest checkpoint
//	GET    /metrics               Prometheus text format
//
// POST /runs takes a recipe as YAML (any content type but JSON; the query
// may add run_dir=NAME and set=key.path=value, repeated):
//
//	curl --data-binary @recipes/tiny.yaml 'localhost:8080/runs?run_dir=tiny&set=train.steps=50'
//
// or as JSON, with the recipe's YAML text or the name of a shipped recipe:
//
//	curl -H 'Content-Type: application/json' localhost:8080/runs \
//	     -d '{"shipped": "tiny", "set": ["train.steps=50"], "run_dir": "tiny"}'
//
// Either answers 202 Accepted with the run's status (below) and a Location
// header. run_dir is a name (letters, digits, '.', '_', '-'), the run's
// directory under --root; without one the service makes one up from the
// time. Posting to a run_dir that holds checkpoints resumes its newest
// valid one, exactly as `mktrain run` typed again does; the model section
// must not change, other fields may (train.steps, to train longer). A run
// directory in use (by a run of this service or another process) is
// refused with 409 Conflict; more than --max-runs runs at once with 503.
// A recipe that does not parse or validate is 400, with mktrain's message
// naming the field.
//
// A status is a JSON object: name, run_dir, state (running, stopping,
// stopped, finished, failed), backend, step and steps, start_step (the
// step it resumed from, once the first step is done), the last step's
// loss, val_loss (the latest validation loss), tokens_per_s, checkpoint
// (the newest checkpoint, once Run has returned), error, started and
// ended (RFC 3339).
//
// GET /runs/{name}/events is a server-sent event stream: first an event
// "status" with the status, then an event "step" per optimizer step (id:
// the step; data: the step as metrics.jsonl writes it), and an event
// "end" with the final status when the run ends. A client that falls more
// than a few hundred steps behind gets an event "error" and the stream
// ends; it reconnects and continues from the status.
//
// DELETE /runs/{name} cancels the run's context: the engine stops between
// two steps and saves a checkpoint. The answer comes when it has: the
// status, state "stopped", with the checkpoint's directory. A run that
// already ended answers its final status.
//
// POST /runs/{name}/sample takes {"prompt": TEXT, "tokens": N,
// "temperature": T, "top_k": K, "seed": S} (or prompt_tokens, a list of
// token ids, instead of prompt; defaults 64 tokens, temperature 0.8, all
// tokens, seed 1) and answers {"checkpoint", "step", "tokens", "text"}
// from the newest checkpoint of the run's directory, while it trains or
// after (a directory under --root that no run of this service started
// works too). The prompt is encoded with the checkpoint's tokenizer (byte
// by byte for a byte-level run), sampling stops after its end-of-document
// token, and text is the prompt and its continuation. The model is loaded once per
// checkpoint and shared by concurrent requests (infer.Model is safe for
// concurrent use).
//
// Each run directory holds what `mktrain run` writes: recipe.yaml,
// train.log (the engine's log, JSON lines), metrics.jsonl and
// checkpoints/. SIGINT or SIGTERM stops every run with a checkpoint, then
// the server.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/term"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		<-ctx.Done()
		stop() // a second signal kills the process at once
	}()
	os.Exit(runService(ctx, os.Args[1:], os.Stderr))
}

const usage = `Usage: trainsvc [--addr HOST:PORT] [--root DIR] [--max-runs N]

Serves mktrain training runs over HTTP/JSON (see the package documentation:
go doc ./examples/trainsvc).

Flags:
`

// runService is the service's main: it parses flags, listens and serves
// until ctx ends. It returns the process's exit status: 0, or 2 for bad
// flags and failures.
func runService(ctx context.Context, args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("trainsvc", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	addr := fs.String("addr", "127.0.0.1:8080", "address to listen on")
	root := fs.String("root", "runs", "directory that holds the run directories")
	maxRuns := fs.Int("max-runs", 1, "runs training at once (each takes every CPU core, or a GPU)")
	if err := fs.Parse(args); errors.Is(err, flag.ErrHelp) {
		return 0
	} else if err != nil {
		return 2
	}
	if fs.NArg() > 0 || *maxRuns < 1 {
		fmt.Fprintf(stderr, "trainsvc: takes only flags, and --max-runs of 1 or more\n")
		return 2
	}
	f, isFile := stderr.(*os.File)
	colour := isFile && term.IsTerminal(int(f.Fd()))
	console := zerolog.SyncWriter(zerolog.ConsoleWriter{Out: stderr, NoColor: !colour, TimeFormat: time.TimeOnly})
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		fmt.Fprintln(stderr, "trainsvc:", err)
		return 2
	}
	svc, err := newService(*root, *maxRuns, console)
	if err != nil {
		ln.Close()
		fmt.Fprintln(stderr, "trainsvc:", err)
		return 2
	}
	svc.log.Info().Str("addr", "http://"+ln.Addr().String()).Str("root", *root).Msg("trainsvc listening")
	if err := serve(ctx, ln, svc); err != nil {
		fmt.Fprintln(stderr, "trainsvc:", err)
		return 2
	}
	return 0
}

// serve answers requests on ln until ctx ends, then stops every run (each
// saves a checkpoint), ends the event streams and closes the server.
func serve(ctx context.Context, ln net.Listener, svc *service) error {
	srv := &http.Server{Handler: svc.handler(), ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		svc.close()
		return err
	case <-ctx.Done():
	}
	svc.log.Info().Msg("stopping: every run saves a checkpoint")
	svc.close()
	shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil {
		return fmt.Errorf("closing the server: %w", err)
	}
	return nil
}
