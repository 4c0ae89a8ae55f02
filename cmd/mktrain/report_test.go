package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestReportOnARun trains the tiny model a few steps and writes its
// report: one HTML file with the charts embedded.
func TestReportOnARun(t *testing.T) {
	dir := t.TempDir()
	args := append([]string{"run", "tiny", "--run-dir", dir}, quick...)
	args = append(args, "--set", "train.steps=4", "--set", "log.every=1", "--set", "train.eval_every=2")
	if code, _, stderr := runCLI(t, args...); code != exitOK {
		t.Fatalf("run: exit %d\n%s", code, stderr)
	}
	out := filepath.Join(t.TempDir(), "r.html")
	code, stdout, stderr := runCLI(t, "report", dir, "--out", out)
	if code != exitOK || !strings.Contains(stdout, "wrote "+out+" (4 logged steps)") {
		t.Fatalf("report: exit %d\n%s%s", code, stdout, stderr)
	}
	page, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(page), `src="data:image/png;base64,`); n < 8 {
		t.Errorf("the report embeds %d charts, want at least 8 (6 curves, 2 layers' heat maps)", n)
	}

	bad := filepath.Join(t.TempDir(), "bench.json")
	writeFile(t, bad, `{"benchmark": "moe"}`)
	if code, _, stderr := runCLI(t, "report", dir, "--bench", bad); code != exitFailure || !strings.Contains(stderr, "bench train result") {
		t.Errorf("a bench moe result: exit %d\n%s", code, stderr)
	}
	if code, _, stderr := runCLI(t, "report", t.TempDir()); code != exitFailure || !strings.Contains(stderr, "no metrics.jsonl") {
		t.Errorf("a directory without a run: exit %d\n%s", code, stderr)
	}
}
