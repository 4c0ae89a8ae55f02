package dev

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestSourcesMatchFiles checks the list against the files: every lab
// source is listed, copies a production source, and names its variants
// once, each with a purpose and defines of macros the source defaults
// (#ifndef), so the build with no define is the default.
func TestSourcesMatchFiles(t *testing.T) {
	onDisk, err := Files()
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, s := range Sources() {
		listed = append(listed, s.File)
		if _, err := s.Kernels(); err != nil {
			t.Errorf("%s: %v", s.File, err)
		}
		text, err := s.Text()
		if err != nil {
			t.Fatal(err)
		}
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
			if got, err := s.Variant(v.Name); err != nil || got.Name != v.Name {
				t.Errorf("%s: Variant(%q) = %v, %v", s.File, v.Name, got, err)
			}
		}
		if _, err := s.Variant("nope"); err == nil {
			t.Errorf("%s: Variant(nope) succeeded", s.File)
		}
	}
	slices.Sort(listed)
	slices.Sort(onDisk)
	if !slices.Equal(listed, onDisk) {
		t.Errorf("listed sources %v, embedded files %v", listed, onDisk)
	}
	if _, err := Lookup("nope.cu"); err == nil {
		t.Error("Lookup of a missing file succeeded")
	}
}

// TestCompileWithClang compiles every lab source to sm_90a PTX with
// clang-19: with no define at -O3, where each kernel's PTX must be its
// production source's, instruction for instruction; and every variant
// (at -O0, a quick codegen check) defining every production kernel.
func TestCompileWithClang(t *testing.T) {
	clang, err := exec.LookPath("clang-19")
	if err != nil {
		t.Skip("kernels/dev: clang-19 not on PATH, lab sources not compile-checked (apt-get install -y clang-19)")
	}
	dir := t.TempDir()
	for _, s := range Sources() {
		prod, err := s.Kernels()
		if err != nil {
			t.Fatal(err)
		}
		t.Run(s.File, func(t *testing.T) {
			t.Parallel()
			text, err := s.Text()
			if err != nil {
				t.Fatal(err)
			}
			prodText, err := prod.Text()
			if err != nil {
				t.Fatal(err)
			}
			lab := clangPTX(t, clang, dir, strings.TrimSuffix(s.File, ".cu"), text, "-O3")
			want := clangPTX(t, clang, dir, strings.TrimSuffix(prod.File, ".cu"), prodText, "-O3")
			got, wantEntries := ptxEntries(lab), ptxEntries(want)
			for _, k := range prod.Kernels {
				if got[k.Name] == "" || got[k.Name] != wantEntries[k.Name] {
					t.Errorf("%s: %s's PTX is not %s's: the lab copy has drifted from the production source", s.File, k.Name, prod.File)
				}
			}
		})
		for _, v := range s.Variants {
			t.Run(s.File+"+"+v.Name, func(t *testing.T) {
				t.Parallel()
				text, err := s.Text()
				if err != nil {
					t.Fatal(err)
				}
				args := []string{"-O0"}
				for _, d := range v.Defines {
					args = append(args, "-D"+d)
				}
				ptx := ptxEntries(clangPTX(t, clang, dir, strings.TrimSuffix(s.File, ".cu")+"+"+v.Name, text, args...))
				for _, k := range prod.Kernels {
					if ptx[k.Name] == "" {
						t.Errorf("PTX has no entry %s", k.Name)
					}
				}
			})
		}
	}
}

// clangPTX compiles text (a CUDA translation unit) to sm_90a PTX as
// kernels_test.go does, with the extra arguments given.
func clangPTX(t *testing.T, clang, dir, name, text string, args ...string) []byte {
	t.Helper()
	src := filepath.Join(dir, name+".cu")
	ptx := filepath.Join(dir, name+".ptx")
	if err := os.WriteFile(src, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	all := append([]string{"-x", "cuda", "--cuda-device-only", "--cuda-gpu-arch=sm_90a",
		"-nocudainc", "-nocudalib", "-Wall", "-Werror", "-S", "-o", ptx}, args...)
	cmd := exec.Command(clang, append(all, src)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", cmd, err, out)
	}
	out, err := os.ReadFile(ptx)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(out, []byte(".target sm_90a")) {
		t.Fatalf("%s: PTX is not for sm_90a", name)
	}
	return out
}

// entryStart matches the first line of a kernel in clang's PTX.
var entryStart = regexp.MustCompile(`(?m)^\.visible \.entry (\w+)\(`)

// ptxEntries splits clang's PTX into its kernels, each from its .entry
// line to clang's "// -- End function" (a kernel's functions are all
// inlined into it), with the numbers of its basic-block labels and local
// depot, which count the module's functions, taken out.
func ptxEntries(ptx []byte) map[string]string {
	text := string(ptx)
	out := map[string]string{}
	locs := entryStart.FindAllStringSubmatchIndex(text, -1)
	for _, loc := range locs {
		body := text[loc[0]:]
		if end := strings.Index(body, "// -- End function"); end >= 0 {
			body = body[:end]
		}
		body = regexp.MustCompile(`\$L__BB\d+_`).ReplaceAllString(body, "$$L__BB_")
		body = regexp.MustCompile(`__local_depot\d+`).ReplaceAllString(body, "__local_depot")
		out[text[loc[2]:loc[3]]] = body
	}
	return out
}

// TestPTXEntries: the splitter finds each kernel whole and only its own.
func TestPTXEntries(t *testing.T) {
	ptx := ".version 8.4\n.visible .entry a(\n)\n{\n$L__BB0_1:\n}\n\t// -- End function\n" +
		".visible .entry b(\n)\n{\n\t.local .align 4 .b8 \t__local_depot1[8];\n$L__BB1_2:\n}\n\t// -- End function\n"
	got := ptxEntries([]byte(ptx))
	if len(got) != 2 || got["a"] != ".visible .entry a(\n)\n{\n$L__BB_1:\n}\n\t" ||
		got["b"] != ".visible .entry b(\n)\n{\n\t.local .align 4 .b8 \t__local_depot[8];\n$L__BB_2:\n}\n\t" {
		t.Errorf("ptxEntries = %q", got)
	}
}
