package driver

// Finding NVIDIA's shared libraries at run time. The binary links none of
// them: each is searched for in a fixed order of places (see the package
// doc), and the first place holding any supported version wins.

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
)

// Lib names one of the shared libraries the CUDA backend loads.
type Lib int

const (
	LibCUDA     Lib = iota + 1 // the driver API, libcuda.so.1 (installed with the NVIDIA driver)
	LibNVRTC                   // the run-time compiler, libnvrtc.so.13 or .12
	LibCublasLt                // cuBLASLt matrix products, libcublasLt.so.13 or .12
	LibNCCL                    // collectives, libnccl.so.2
)

// Libs lists every library, in the order the backend needs them.
func Libs() []Lib { return []Lib{LibCUDA, LibNVRTC, LibCublasLt, LibNCCL} }

func (l Lib) String() string {
	switch l {
	case LibCUDA:
		return "libcuda"
	case LibNVRTC:
		return "libnvrtc"
	case LibCublasLt:
		return "libcublasLt"
	case LibNCCL:
		return "libnccl"
	}
	return fmt.Sprintf("Lib(%d)", int(l))
}

// Sonames are the file names accepted for l, preferred first.
func (l Lib) Sonames() []string {
	switch l {
	case LibCUDA:
		return []string{"libcuda.so.1"}
	case LibNVRTC:
		return []string{"libnvrtc.so.13", "libnvrtc.so.12"}
	case LibCublasLt:
		return []string{"libcublasLt.so.13", "libcublasLt.so.12"}
	case LibNCCL:
		return []string{"libnccl.so.2"}
	}
	return nil
}

// EnvVar is the variable that names l's file (or a folder holding it)
// explicitly, e.g. MKTRAIN_LIBCUDA.
func (l Lib) EnvVar() string { return "MKTRAIN_" + strings.ToUpper(l.String()) }

// Environment variables the search reads.
const (
	// EnvLibDir is a colon-separated list of folders searched before any
	// other place (after the per-library variables).
	EnvLibDir = "MKTRAIN_CUDA_LIB_DIR"
	// DefaultLdCache is the dynamic loader's cache, as ldconfig writes it.
	DefaultLdCache = "/etc/ld.so.cache"
)

// Search describes where libraries are looked for. The zero value searches
// the real file system with the process environment; tests set Getenv and
// Root to search a fake tree.
type Search struct {
	// Getenv reads an environment variable; nil means os.Getenv.
	Getenv func(string) string
	// Root is prefixed to every absolute path the search visits (the loader
	// cache and the fixed folders too); "" is the real root.
	Root string
}

// NotFoundError is returned when no place holds a library. Looked lists
// every place that was searched, in order.
type NotFoundError struct {
	Lib    Lib
	Looked []string
}

func (e *NotFoundError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "cuda: no %s found (%s); looked in:", e.Lib, strings.Join(e.Lib.Sonames(), " or "))
	for _, p := range e.Looked {
		b.WriteString("\n\t")
		b.WriteString(p)
	}
	fmt.Fprintf(&b, "\nset %s to the library's path, or %s to its folder", e.Lib.EnvVar(), EnvLibDir)
	return b.String()
}

// Found is the result of a successful search.
type Found struct {
	Lib  Lib
	Path string // the file to dlopen
	Via  string // which place held it, e.g. "LD_LIBRARY_PATH" or "loader cache"
}

// place is one folder (or one explicit file) the search visits.
type place struct {
	via  string // the reason it is searched, for messages
	path string // a folder
	note bool   // not a folder: only a line for the message
}

// Find looks for lib in every place in order and returns the first hit.
func (s Search) Find(lib Lib) (Found, error) {
	if len(lib.Sonames()) == 0 {
		return Found{}, fmt.Errorf("cuda: unknown library %v", lib)
	}
	// An explicit per-library override must work: falling back silently to
	// another copy would hide the user's mistake.
	if v := s.getenv(lib.EnvVar()); v != "" {
		return s.findOverride(lib, v)
	}
	var looked []string
	cache, cacheErr := s.ldCache()
	for _, p := range s.places(cache, cacheErr) {
		looked = append(looked, p.describe())
		if p.note {
			continue
		}
		if p.via == "loader cache" {
			for _, name := range lib.Sonames() {
				if path, ok := cache[name]; ok && s.isFile(path) {
					return Found{Lib: lib, Path: s.root(path), Via: p.via}, nil
				}
			}
			continue
		}
		for _, name := range lib.Sonames() {
			path := filepath.Join(p.path, name)
			if s.isFile(path) {
				return Found{Lib: lib, Path: s.root(path), Via: p.via}, nil
			}
		}
	}
	return Found{}, &NotFoundError{Lib: lib, Looked: looked}
}

// findOverride resolves a per-library variable naming a file or a folder.
func (s Search) findOverride(lib Lib, v string) (Found, error) {
	via := lib.EnvVar()
	fi, err := os.Stat(s.root(v))
	if err != nil {
		return Found{}, fmt.Errorf("cuda: %s=%s: %w", via, v, err)
	}
	if !fi.IsDir() {
		return Found{Lib: lib, Path: s.root(v), Via: via}, nil
	}
	for _, name := range lib.Sonames() {
		if p := filepath.Join(v, name); s.isFile(p) {
			return Found{Lib: lib, Path: s.root(p), Via: via}, nil
		}
	}
	return Found{}, &NotFoundError{Lib: lib, Looked: []string{v + " (" + via + ")"}}
}

func (p place) describe() string {
	return p.path + " (" + p.via + ")"
}

// places lists the folders to visit, in search order, without duplicates.
func (s Search) places(cache map[string]string, cacheErr error) []place {
	var out []place
	seen := map[string]bool{}
	add := func(via, dir string) {
		if dir == "" || seen[dir] {
			return
		}
		seen[dir] = true
		out = append(out, place{via: via, path: dir})
	}
	for _, d := range filepath.SplitList(s.getenv(EnvLibDir)) {
		add(EnvLibDir, d)
	}
	for _, d := range filepath.SplitList(s.getenv("LD_LIBRARY_PATH")) {
		add("LD_LIBRARY_PATH", d)
	}
	cacheDesc := DefaultLdCache
	switch {
	case cacheErr != nil:
		cacheDesc += ": " + cacheErr.Error()
	default:
		cacheDesc += fmt.Sprintf(": %d entries", len(cache))
	}
	out = append(out, place{via: "loader cache", path: cacheDesc})
	target := cudaTarget()
	for _, env := range []string{"CUDA_HOME", "CUDA_PATH"} {
		if h := s.getenv(env); h != "" {
			add(env, filepath.Join(h, "lib64"))
			add(env, filepath.Join(h, "targets", target, "lib"))
		}
	}
	add("CUDA toolkit", "/usr/local/cuda/lib64")
	add("CUDA toolkit", filepath.Join("/usr/local/cuda/targets", target, "lib"))
	wheels, prefixes := s.wheelDirs()
	for _, d := range wheels {
		add("Python wheel", d)
	}
	if len(wheels) == 0 {
		// Still say where wheels were looked for.
		out = append(out, place{via: "Python wheel", path: "no site-packages/nvidia/*/lib under " + strings.Join(prefixes, ", "), note: true})
	}
	for _, d := range systemDirs() {
		add("system folder", d)
	}
	return out
}

// wheelDirs finds the lib folders of NVIDIA's pip wheels (nvidia/cu13/lib,
// nvidia/nccl/lib, nvidia/cublas/lib, ...) under the usual Python prefixes.
func (s Search) wheelDirs() (dirs, prefixes []string) {
	for _, env := range []string{"VIRTUAL_ENV", "CONDA_PREFIX"} {
		if p := s.getenv(env); p != "" {
			prefixes = append(prefixes, p)
		}
	}
	prefixes = append(prefixes, "/opt/torch/.venv", "/usr/local", "/usr")
	if h := s.getenv("HOME"); h != "" {
		prefixes = append(prefixes, filepath.Join(h, ".local"))
	}
	for _, pre := range prefixes {
		for _, pkgs := range []string{"lib/python3*/site-packages", "lib/python3*/dist-packages", "lib/python3/dist-packages"} {
			matches, _ := filepath.Glob(filepath.Join(s.root(pre), pkgs, "nvidia", "*", "lib"))
			sort.Strings(matches)
			for _, m := range matches {
				dirs = append(dirs, s.unroot(m))
			}
		}
	}
	return dirs, prefixes
}

// cudaTarget is the folder name CUDA uses under targets/ for this machine.
func cudaTarget() string {
	if runtime.GOARCH == "arm64" {
		return "sbsa-linux"
	}
	return "x86_64-linux"
}

// systemDirs are folders the dynamic loader searches by default, plus the
// folder where container runtimes mount the driver.
func systemDirs() []string {
	multiarch := "x86_64-linux-gnu"
	if runtime.GOARCH == "arm64" {
		multiarch = "aarch64-linux-gnu"
	}
	return []string{
		"/usr/local/nvidia/lib64",
		"/usr/lib/" + multiarch,
		"/lib/" + multiarch,
		"/usr/lib64",
		"/usr/lib",
		"/usr/lib/wsl/lib",
	}
}

func (s Search) getenv(k string) string {
	if s.Getenv != nil {
		return s.Getenv(k)
	}
	return os.Getenv(k)
}

// root maps an absolute path into the searched tree.
func (s Search) root(p string) string {
	if s.Root == "" || !filepath.IsAbs(p) {
		return p
	}
	return filepath.Join(s.Root, p)
}

// unroot undoes root, so messages show the paths a user would type.
func (s Search) unroot(p string) string {
	if s.Root == "" {
		return p
	}
	if r, err := filepath.Rel(s.Root, p); err == nil && !strings.HasPrefix(r, "..") {
		return "/" + r
	}
	return p
}

func (s Search) isFile(p string) bool {
	fi, err := os.Stat(s.root(p))
	return err == nil && !fi.IsDir()
}

// ldCache reads the loader cache into soname -> path for this machine's
// architecture.
func (s Search) ldCache() (map[string]string, error) {
	data, err := os.ReadFile(s.root(DefaultLdCache))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, errors.New("not present")
		}
		return nil, err
	}
	return parseLdCache(data, ldCacheFlags())
}
