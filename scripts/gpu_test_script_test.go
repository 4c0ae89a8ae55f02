// Package scripts holds the repository's scripts; its test runs
// gpu-test.sh's run step on this machine, without a GPU, so that a broken
// script is found here rather than in a device call.
package scripts

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestGPUTestScriptRunStep builds one test binary as `gpu-test.sh build`
// would (backend/cuda/driver, whose tests need no GPU), names it and a
// package whose binary is missing in packages.txt, and runs the script's
// run step on them: the built package's tests run from its folder (a
// package path with slashes, whose logs must still find a place), the
// missing one fails the run with its row, and summary.json is valid JSON
// with the built package's counts.
func TestGPUTestScriptRunStep(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("scripts: bash not on PATH, gpu-test.sh not run")
	}
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("scripts: go not on PATH, gpu-test.sh's binaries not built")
	}
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	bin := t.TempDir()
	build := exec.Command(goTool, "test", "-c", "-o", filepath.Join(bin, "backend_cuda_driver.test"), "./backend/cuda/driver")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", build, err, out)
	}
	packages := "backend/cuda/driver|\nengine|^TestTinyRecipeCUDAMatchesCPU$\n"
	if err := os.WriteFile(filepath.Join(bin, "packages.txt"), []byte(packages), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bin, "commit.txt"), []byte("0123abc\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "out")
	run := exec.Command(bash, filepath.Join(root, "scripts", "gpu-test.sh"))
	run.Dir = root
	run.Env = append(os.Environ(), "GPU_TEST_BIN="+bin, "OUT="+out, "NO_BENCH=1", "NO_HF=1",
		"GPU_TEST_PACKAGES=", "GPU_TEST_RUN=", "LABS=", "PYTHON=/nonexistent")
	console, err := run.CombinedOutput()
	if err == nil {
		t.Errorf("gpu-test.sh exited 0 with engine's test binary missing\n%s", console)
	}
	if !strings.Contains(string(console), "engine: "+filepath.Join(bin, "engine.test")+" missing") {
		t.Errorf("gpu-test.sh did not name the missing binary\n%s", console)
	}

	raw, err := os.ReadFile(filepath.Join(out, "summary.json"))
	if err != nil {
		t.Fatalf("no summary.json: %v\n%s", err, console)
	}
	var summary struct {
		Commit   string `json:"commit"`
		Packages []struct {
			Package string `json:"package"`
			Exit    int    `json:"exit"`
			Passed  int    `json:"passed"`
			Failed  int    `json:"failed"`
		} `json:"packages"`
	}
	if err := json.Unmarshal(raw, &summary); err != nil {
		t.Fatalf("summary.json is not JSON: %v\n%s", err, raw)
	}
	if summary.Commit != "0123abc" {
		t.Errorf("summary.json's commit is %q, want the bundle's 0123abc", summary.Commit)
	}
	if len(summary.Packages) != 1 || summary.Packages[0].Package != "backend/cuda/driver" {
		t.Fatalf("summary.json's packages are %+v, want backend/cuda/driver's row alone\n%s", summary.Packages, console)
	}
	if p := summary.Packages[0]; p.Exit != 0 || p.Passed == 0 || p.Failed != 0 {
		t.Errorf("backend/cuda/driver: exit %d, %d passed, %d failed; want exit 0 and only passes\n%s", p.Exit, p.Passed, p.Failed, console)
	}
	if _, err := os.Stat(filepath.Join(out, "logs.tgz")); err != nil {
		t.Errorf("no logs.tgz: %v", err)
	}
}
