package tensorboard_test

import (
	"bytes"
	"context"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/observe/tensorboard"
)

func TestCRC32C(t *testing.T) {
	// The check value of CRC-32C (RFC 3720, appendix B.4).
	if got := crc32c([]byte("123456789")); got != 0xe3069283 {
		t.Fatalf("the test's crc32c(123456789) = %#x, want 0xe3069283", got)
	}
	r := rand.New(rand.NewPCG(1, 2))
	for n := range 100 {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		if got, want := tensorboard.MaskedCRC(b), masked(b); got != want {
			t.Fatalf("MaskedCRC of %d bytes = %#x, want %#x", n, got, want)
		}
	}
}

func TestWriterRecordsParse(t *testing.T) {
	dir := t.TempDir()
	now := time.Unix(1700000000, 250_000_000)
	w, err := tensorboard.Create(dir, now)
	if err != nil {
		t.Fatal(err)
	}
	load := []float64{0.5, 0.25, 0, 0.25}
	if err := w.Write(7, now, []tensorboard.Value{
		tensorboard.Scalar("train/loss", 2.5),
		tensorboard.Histogram("experts/layer0/load", tensorboard.IndexHistogram(load)),
	}); err != nil {
		t.Fatal(err)
	}
	if err := w.SessionStart(8, now); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(filepath.Base(w.Path()), "events.out.tfevents.1700000000.") {
		t.Errorf("file name %s: want events.out.tfevents.<unix seconds>.*", w.Path())
	}
	events := readEvents(t, w.Path())
	if len(events) != 3 {
		t.Fatalf("%d events, want 3 (version, summary, session start)", len(events))
	}
	if events[0].fileVersion != "brain.Event:2" || events[0].wallTime != 1700000000.25 {
		t.Errorf("first event: version %q at %v, want brain.Event:2 at 1700000000.25", events[0].fileVersion, events[0].wallTime)
	}
	if ev := events[1]; ev.step != 7 || ev.scalars["train/loss"] != 2.5 {
		t.Errorf("summary event: step %d, scalars %v", ev.step, ev.scalars)
	}
	h := events[1].histos["experts/layer0/load"]
	if !slices.Equal(h.counts, load) || !slices.Equal(h.limits, []float64{0.5, 1.5, 2.5, 3.5}) ||
		h.min != 0 || h.max != 3 || h.num != 1 || h.sum != 0.25+0.75 || h.sumSquares != 0.25+2.25 {
		t.Errorf("histogram %+v", h)
	}
	if ev := events[2]; !ev.sessionStart || ev.step != 8 {
		t.Errorf("session start event: %+v", ev)
	}
}

func TestCreateNeverReopensAFile(t *testing.T) {
	dir := t.TempDir()
	now := time.Now()
	a, err := tensorboard.Create(dir, now)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	before, _ := os.ReadFile(a.Path())
	b, err := tensorboard.Create(dir, now) // the same second: the name is taken
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if b.Path() == a.Path() {
		t.Fatalf("two writers share %s", a.Path())
	}
	after, _ := os.ReadFile(a.Path())
	if !bytes.Equal(before, after) {
		t.Error("creating a second writer changed the first file")
	}
}

// tinyConfig is the tiny model, shortened to train in a fraction of a
// second, with TensorBoard on.
func tinyConfig(steps int) engine.Config {
	cfg := engine.DefaultConfig()
	cfg.Train.Steps, cfg.Train.Seq = steps, 16
	cfg.Train.GlobalBatch, cfg.Train.MicroBatch = 2, 2
	cfg.Train.WarmupSteps, cfg.Train.EvalEvery, cfg.Train.EvalBatches = 1, 2, 1
	cfg.Train.Backend = "cpu"
	cfg.Log.Every = 1
	cfg.Log.TensorBoard = true
	return cfg
}

func eventFiles(t *testing.T, dir string) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "events.out.tfevents.*"))
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(files)
	return files
}

// TestTinyRunWritesEventFiles trains the tiny model with log.tensorboard
// and reads the event files back: every record's framing and checksums,
// the scalar tags of every step, the experts' histograms; then resumes
// the run and checks that the resumed part went to a new file, starting
// with a session start at its first step, and the first file is intact.
func TestTinyRunWritesEventFiles(t *testing.T) {
	dir := t.TempDir()
	run := func(steps int) {
		t.Helper()
		eng, err := engine.New(tinyConfig(steps), engine.WithRunDir(dir))
		if err != nil {
			t.Fatal(err)
		}
		defer eng.Close()
		if _, err := eng.Run(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	run(2)
	files := eventFiles(t, dir)
	if len(files) != 1 {
		t.Fatalf("event files after the first run: %v, want one", files)
	}
	first, _ := os.ReadFile(files[0])
	events := readEvents(t, files[0])
	if events[0].fileVersion != "brain.Event:2" {
		t.Errorf("first event's file_version is %q", events[0].fileVersion)
	}
	steps := map[int64]event{}
	for _, ev := range events[1:] {
		steps[ev.step] = ev
	}
	for step := int64(1); step <= 2; step++ {
		ev, ok := steps[step]
		if !ok {
			t.Fatalf("no event of step %d", step)
		}
		for _, tag := range []string{"train/loss", "train/aux_loss", "train/z_loss", "train/lr", "train/grad_norm",
			"perf/tokens_per_s", "perf/peak_memory_bytes", "experts/layer0/imbalance", "experts/layer1/imbalance"} {
			if v, ok := ev.scalars[tag]; !ok || math.IsNaN(float64(v)) {
				t.Errorf("step %d: scalar %s missing or NaN (%v)", step, tag, v)
			}
		}
		if ev.scalars["train/loss"] < 1 || ev.scalars["perf/peak_memory_bytes"] <= 0 {
			t.Errorf("step %d: loss %v, peak memory %v", step, ev.scalars["train/loss"], ev.scalars["perf/peak_memory_bytes"])
		}
		h, ok := ev.histos["experts/layer1/load"]
		if !ok || len(h.counts) != 4 || math.Abs(h.num-1) > 1e-3 {
			t.Errorf("step %d: load histogram %+v, want 4 experts' shares summing to 1", step, h)
		}
	}
	if _, ok := steps[2].scalars["val/loss"]; !ok {
		t.Error("step 2 (an evaluation) has no val/loss")
	}

	run(4) // resumes from the checkpoint of step 2
	files = eventFiles(t, dir)
	if len(files) != 2 {
		t.Fatalf("event files after the resumed run: %v, want two", files)
	}
	if again, _ := os.ReadFile(files[0]); !bytes.Equal(first, again) {
		t.Error("the resumed run changed the first run's event file")
	}
	resumed := readEvents(t, files[1])
	if len(resumed) < 4 || !resumed[1].sessionStart || resumed[1].step != 3 {
		t.Fatalf("resumed file: want the version, a session start at step 3, steps 3 and 4; got %+v", resumed)
	}
	if resumed[2].step != 3 || resumed[3].step != 4 {
		t.Errorf("resumed file's steps %d, %d; want 3, 4", resumed[2].step, resumed[3].step)
	}
}
