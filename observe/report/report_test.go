package report

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"html"
	"image/png"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// writeRun writes a run directory whose metrics.jsonl has steps 10..100
// (one every 10, a validation loss every 50) of two layers of four
// experts: in layer 1, expert 3 gets nothing from step 40 on and expert 0
// three times its share; layer 0 stays balanced.
func writeRun(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	var lines bytes.Buffer
	for step := 10; step <= 100; step += 10 {
		line := map[string]any{"step": step, "loss": 5 - float64(step)/50, "aux_loss": 4.1, "z_loss": 0, "lr": 1e-3,
			"grad_norm": 1.5, "tokens": step * 1024, "tokens_per_s": 9000, "elapsed_s": float64(step) / 10,
			"mfu": nil, "peak_memory_bytes": 50 << 20}
		if step%50 == 0 {
			line["val_loss"], line["val_batches"] = 4.5-float64(step)/100, 4
		}
		skewed := []float64{0.25, 0.25, 0.25, 0.25}
		if step >= 40 {
			skewed = []float64{0.75, 0.125, 0.125, 0}
		}
		line["experts"] = []map[string]any{
			{"layer": 0, "fraction": []float64{0.25, 0.25, 0.25, 0.25}, "max_over_mean": 1, "dropped": 0},
			{"layer": 1, "fraction": skewed, "max_over_mean": 3, "dropped": 0},
		}
		b, _ := json.Marshal(line)
		lines.Write(append(b, '\n'))
	}
	lines.WriteString(`{"step": 110, "loss": 1.`) // a line cut short by a crash
	if err := os.WriteFile(filepath.Join(dir, "metrics.jsonl"), lines.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "recipe.yaml"), []byte("model:\n  layers: 2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestFlagExperts(t *testing.T) {
	run, err := LoadRun(writeRun(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(run.Steps) != 10 || run.Steps[9].Step != 100 {
		t.Fatalf("read %d steps (last %d), want 10 up to step 100 (the cut line skipped)", len(run.Steps), run.Steps[len(run.Steps)-1].Step)
	}
	flags := FlagExperts(run.Steps)
	got := fmt.Sprint(flags)
	want := "[{1 0 overloaded 3 90 100} {1 3 dead 0 90 100}]" // the last quarter: 2 of 10 logged steps
	if got != want {
		t.Errorf("flags %s, want %s", got, want)
	}
}

// TestWriteEmbedsCharts renders a report and checks that the page holds
// every chart as an embedded PNG that decodes, the heat map of each layer,
// the flags, the bench breakdown and the recipe, and refers to no other
// file.
func TestWriteEmbedsCharts(t *testing.T) {
	dir := writeRun(t)
	run, err := LoadRun(dir)
	if err != nil {
		t.Fatal(err)
	}
	bench := filepath.Join(dir, "bench.json")
	os.WriteFile(bench, []byte(`{"benchmark": "train", "recipe": "tiny", "commit": "abc", "machine": {"cpu": "test CPU"},
		"figures": {"tokens_per_s": 9000, "step_ms_median": 12, "profiled_step_ms": 13,
		"breakdown": [{"kind": "expert GEMM", "ms": 6, "share": 0.5, "ops": 10}, {"kind": "attention", "ms": 4, "share": 0.3, "ops": 5}]}}`), 0o644)
	if run.Bench, err = ReadBench(bench); err != nil {
		t.Fatal(err)
	}
	var page bytes.Buffer
	if err := Write(&page, run); err != nil {
		t.Fatal(err)
	}
	s := page.String()
	images := regexp.MustCompile(`<img [^>]*src="([^"]*)"`).FindAllStringSubmatch(s, -1)
	// loss, aux/z, lr, grad norm, tokens/s, memory (no MFU on the CPU),
	// two heat maps, the breakdown.
	if len(images) != 9 {
		t.Errorf("%d images, want 9", len(images))
	}
	for _, m := range images {
		uri := html.UnescapeString(m[1])
		data, ok := strings.CutPrefix(uri, "data:image/png;base64,")
		if !ok {
			t.Fatalf("an image that is not an embedded PNG: %.60s", uri)
		}
		b, err := base64.StdEncoding.DecodeString(data)
		if err != nil {
			t.Fatal(err)
		}
		img, err := png.Decode(bytes.NewReader(b))
		if err != nil || img.Bounds().Dx() < 500 {
			t.Fatalf("an embedded PNG does not decode, or is tiny: %v", err)
		}
	}
	for _, want := range []string{"Layer 0", "Layer 1", "No dead or overloaded expert", `<tr class="flag-dead"><td>3</td>`,
		`<tr class="flag-overloaded"><td>0</td>`, "Where a step", "layers: 2", "validation loss", "(4 batches)"} {
		if !strings.Contains(s, want) {
			t.Errorf("the page lacks %q", want)
		}
	}
	if regexp.MustCompile(`(src|href)="(http|/|\.)`).MatchString(s) {
		t.Error("the page refers to another file")
	}
}

func TestLoadRunErrors(t *testing.T) {
	if _, err := LoadRun(t.TempDir()); err == nil || !strings.Contains(err.Error(), "no metrics.jsonl") {
		t.Errorf("a directory without metrics.jsonl: %v", err)
	}
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "metrics.jsonl"), []byte("{\"step\": 1}\nnot json\n"), 0o644)
	if _, err := LoadRun(dir); err == nil || !strings.Contains(err.Error(), "metrics.jsonl:2") {
		t.Errorf("a bad line: %v, want its file and line", err)
	}
}
