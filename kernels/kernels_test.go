package kernels

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// kernelDecl matches a kernel definition and its optional launch bound
// (threads, and optionally the minimum blocks per SM).
var kernelDecl = regexp.MustCompile(`extern "C" __global__ void (?:__launch_bounds__\((\d+)(?:, *\d+)?\) )?(\w+)\(`)

// TestSourcesMatchFiles checks the Go list against the files: every .cu is
// listed, every kernel defined is listed with a block size that fits its
// launch bound, and every listed kernel is defined.
func TestSourcesMatchFiles(t *testing.T) {
	onDisk, err := Files()
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, s := range Sources() {
		listed = append(listed, s.File)
		text, err := s.Text()
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(text, "#line 1 \""+s.File+"\"") {
			t.Errorf("%s: Text lacks its #line directive", s.File)
		}
		if regexp.MustCompile(`(?m)^\s*#\s*include`).MatchString(text) {
			t.Errorf("%s: Text leaves an #include in place", s.File)
		}
		defined := map[string]bool{}
		for _, m := range kernelDecl.FindAllStringSubmatch(text, -1) {
			name := m[2]
			defined[name] = true
			k, ok := s.Kernel(name)
			if !ok {
				t.Errorf("%s: kernel %s is not listed in Sources", s.File, name)
				continue
			}
			if k.Block <= 0 || k.Block%32 != 0 || k.Block > 1024 || k.Grid == "" {
				t.Errorf("%s: %s has block %d, grid %q", s.File, name, k.Block, k.Grid)
			}
			if m[1] != "" {
				bound, _ := strconv.Atoi(m[1])
				if k.Block > bound {
					t.Errorf("%s: %s listed with block %d over its launch bound %d", s.File, name, k.Block, bound)
				}
			}
		}
		for _, k := range s.Kernels {
			if !defined[k.Name] {
				t.Errorf("%s: listed kernel %s is not defined there", s.File, k.Name)
			}
		}
	}
	slices.Sort(listed)
	slices.Sort(onDisk)
	if !slices.Equal(listed, onDisk) {
		t.Errorf("listed sources %v, embedded files %v", listed, onDisk)
	}
	if _, err := Lookup("rmsnorm.cu"); err != nil {
		t.Error(err)
	}
	if _, err := Lookup("nope.cu"); err == nil {
		t.Error("Lookup of a missing file succeeded")
	}
}

// TestCompileWithClang compiles every source to sm_90a PTX with clang-19 as
// a C++ and type check (it does not check inline PTX), and checks that each
// listed kernel is an entry of the output.
func TestCompileWithClang(t *testing.T) {
	clang, err := exec.LookPath("clang-19")
	if err != nil {
		t.Skip("kernels: clang-19 not on PATH, CUDA sources not compile-checked (apt-get install -y clang-19)")
	}
	// With KERNELS_PTX_DIR set, each source's PTX is also written there
	// (name.ptx), to compare the kernels of two builds.
	keep := os.Getenv("KERNELS_PTX_DIR")
	dir := t.TempDir()
	for _, s := range Sources() {
		t.Run(s.File, func(t *testing.T) {
			t.Parallel()
			text, err := s.Text()
			if err != nil {
				t.Fatal(err)
			}
			name := strings.TrimSuffix(s.File, ".cu")
			src := filepath.Join(dir, name+".cu")
			ptx := filepath.Join(dir, name+".ptx")
			if err := os.WriteFile(src, []byte(text), 0o644); err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command(clang, "-x", "cuda", "--cuda-device-only", "--cuda-gpu-arch=sm_90a",
				"-nocudainc", "-nocudalib", "-O3", "-Wall", "-Werror", "-S", "-o", ptx, src)
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("%s: %v\n%s", cmd, err, out)
			}
			out, err := os.ReadFile(ptx)
			if err != nil {
				t.Fatal(err)
			}
			if keep != "" {
				if err := os.WriteFile(filepath.Join(keep, name+".ptx"), out, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			if !strings.Contains(string(out), ".target sm_90a") {
				t.Errorf("PTX is not for sm_90a")
			}
			for _, k := range s.Kernels {
				if !strings.Contains(string(out), ".entry "+k.Name+"(") {
					t.Errorf("PTX has no entry %s", k.Name)
				}
			}
		})
	}
}

// TestAssemble pastes headers into a source: each header once, headers
// within headers, #line directives that map every line back to its file,
// and errors for what NVRTC could not find.
func TestAssemble(t *testing.T) {
	fs := map[string]string{
		"a.cu":  "// a\n#include \"x.cuh\"\nint a;\n#include \"y.cuh\"\n#include \"x.cuh\"\nint a2;\n",
		"x.cuh": "int x;",
		"y.cuh": "#include \"x.cuh\"\nint y;\n",
		"plain": "int p;\n",
		"bad1":  "#include <stdio.h>\n",
		"bad2":  "#include \"z.h\"\n",
		"bad3":  "#include \"none.cuh\"\n",
		"bad4":  "#include \"prelude.cuh\"\n",
	}
	read := func(name string) ([]byte, error) {
		if s, ok := fs[name]; ok {
			return []byte(s), nil
		}
		return nil, os.ErrNotExist
	}
	prelude, err := files.ReadFile(PreludeFile)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Assemble("a.cu", read)
	if err != nil {
		t.Fatal(err)
	}
	want := string(prelude) + "\n#line 1 \"a.cu\"\n" +
		"// a\n#line 1 \"x.cuh\"\nint x;\n#line 3 \"a.cu\"\nint a;\n" +
		"#line 1 \"y.cuh\"\n#line 2 \"y.cuh\"\nint y;\n#line 5 \"a.cu\"\n" +
		"#line 6 \"a.cu\"\nint a2;\n"
	if got != want {
		t.Errorf("Assemble(a.cu) =\n%s\nwant\n%s", got[len(prelude):], want[len(prelude):])
	}
	if got, err := Assemble("plain", read); err != nil || got != string(prelude)+"\n#line 1 \"plain\"\nint p;\n" {
		t.Errorf("a file without includes: %q, %v", got, err)
	}
	for _, f := range []string{"bad1", "bad2", "bad3", "bad4", "missing.cu"} {
		if _, err := Assemble(f, read); err == nil {
			t.Errorf("Assemble(%s) succeeded", f)
		}
	}
}

// TestHeaders: every header but the prelude is pasted into some source
// (none is dead), and Header serves headers only.
func TestHeaders(t *testing.T) {
	entries, err := files.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	var texts []string
	for _, s := range Sources() {
		text, err := s.Text()
		if err != nil {
			t.Fatal(err)
		}
		texts = append(texts, text)
	}
	for _, e := range entries {
		name := e.Name()
		if !strings.HasSuffix(name, ".cuh") || name == PreludeFile {
			continue
		}
		if _, err := Header(name); err != nil {
			t.Error(err)
		}
		if !slices.ContainsFunc(texts, func(text string) bool { return strings.Contains(text, "#line 1 \""+name+"\"\n") }) {
			t.Errorf("%s is included by no source", name)
		}
	}
	for _, bad := range []string{PreludeFile, "rmsnorm.cu", "nope.cuh"} {
		if _, err := Header(bad); err == nil {
			t.Errorf("Header(%q) succeeded", bad)
		}
	}
}

// preprocessorTest matches a conditional directive and its first name.
var preprocessorTest = regexp.MustCompile(`(?m)^\s*#\s*(?:if|ifdef|ifndef|elif)\b\W*(\w*)`)

// TestNoExperimentSwitches: the sources the backend loads are what
// training runs, with no compile-time switch but these (experiments are
// in kernels/dev). No kernel takes a mode argument either.
func TestNoExperimentSwitches(t *testing.T) {
	allowed := map[string]string{
		"__CUDACC_RTC__":     "clang's stand-ins for NVRTC's built-ins (the compile check)",
		"MOE_TEST_LOST_ROWS": "fault injection, defined only by backend/cuda's tests",
		"ATC_HOST_EMULATION": "attention_tc.cu's host emulation of the warp (a test tool)",
	}
	for _, s := range Sources() {
		text, err := s.Text()
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range preprocessorTest.FindAllStringSubmatch(text, -1) {
			if _, ok := allowed[m[1]]; !ok {
				t.Errorf("%s: %q: a compile-time switch in a production source (experiments go to kernels/dev)", s.File, strings.TrimSpace(m[0]))
			}
		}
		for _, word := range []string{"EXPERIMENT", "int mode", "fz.mode"} {
			if strings.Contains(text, word) {
				t.Errorf("%s holds %q: an experiment switch in a production source", s.File, word)
			}
		}
	}
}
