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
		if strings.Contains(text[strings.Index(text, "#line 1"):], "#include") {
			t.Errorf("%s: sources must not #include anything", s.File)
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
		// Every variant is named once and defines macros the source
		// defaults (#ifndef), so the plain compilation is the default.
		names := map[string]bool{}
		for _, v := range s.Variants {
			if v.Name == "" || names[v.Name] || v.Purpose == "" || len(v.Defines) == 0 {
				t.Errorf("%s: variant %q: a unique name, a purpose and defines are required", s.File, v.Name)
			}
			names[v.Name] = true
			for _, d := range v.Defines {
				name, _, ok := strings.Cut(d, "=")
				if !ok || !strings.Contains(text, "#ifndef "+name+"\n") {
					t.Errorf("%s: variant %s: define %q is not NAME=VALUE of a macro the source defaults with #ifndef", s.File, v.Name, d)
				}
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
	dir := t.TempDir()
	type unit struct {
		name    string
		src     Source
		defines []string
	}
	var units []unit
	for _, s := range Sources() {
		units = append(units, unit{s.File, s, nil})
		for _, v := range s.Variants {
			units = append(units, unit{s.File + "+" + v.Name, s, v.Defines})
		}
	}
	for _, u := range units {
		s := u.src
		t.Run(u.name, func(t *testing.T) {
			t.Parallel()
			text, err := s.Text()
			if err != nil {
				t.Fatal(err)
			}
			src := filepath.Join(dir, u.name+".cu")
			ptx := strings.TrimSuffix(src, ".cu") + ".ptx"
			if err := os.WriteFile(src, []byte(text), 0o644); err != nil {
				t.Fatal(err)
			}
			args := []string{"-x", "cuda", "--cuda-device-only", "--cuda-gpu-arch=sm_90a",
				"-nocudainc", "-nocudalib", "-O3", "-Wall", "-Werror", "-S", "-o", ptx}
			for _, d := range u.defines {
				args = append(args, "-D"+d)
			}
			cmd := exec.Command(clang, append(args, src)...)
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("%s: %v\n%s", cmd, err, out)
			}
			out, err := os.ReadFile(ptx)
			if err != nil {
				t.Fatal(err)
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
