package scripts

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestNVRTCLocalScriptArgs runs nvrtc-local.sh's paths that need no
// network: --help, an unknown option (exit 2, named), and --env on a
// folder with no NVRTC yet (exit 1, telling what to run), then --env on a
// folder laid out as a fetch leaves it (the export line for that folder).
func TestNVRTCLocalScriptArgs(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("scripts: bash not on PATH, nvrtc-local.sh not run")
	}
	script, err := filepath.Abs("nvrtc-local.sh")
	if err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) (string, int) {
		cmd := exec.Command(bash, append([]string{script}, args...)...)
		out, err := cmd.CombinedOutput()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return string(out), code
	}
	if out, code := run("--help"); code != 0 || !strings.Contains(out, "nvrtc-local.sh [--sass] [DIR]") {
		t.Errorf("--help: exit %d\n%s", code, out)
	}
	if out, code := run("--bogus"); code != 2 || !strings.Contains(out, "unknown option --bogus") {
		t.Errorf("--bogus: exit %d\n%s", code, out)
	}
	dir := t.TempDir()
	if out, code := run("--env", dir); code != 1 || !strings.Contains(out, "run bash scripts/nvrtc-local.sh first") {
		t.Errorf("--env before a fetch: exit %d\n%s", code, out)
	}
	lib := filepath.Join(dir, "root", "usr", "lib", "x86_64-linux-gnu")
	if err := os.MkdirAll(lib, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(lib, "libnvrtc.so.12"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	out, code := run("--env", dir)
	if code != 0 || !strings.Contains(out, "export MKTRAIN_CUDA_LIB_DIR='"+lib+"' LD_LIBRARY_PATH='"+lib+"'") {
		t.Errorf("--env after a fetch: exit %d\n%s", code, out)
	}
}
