package cuda

// Kernels are compiled by NVRTC when first used and the cubins cached on
// disk, keyed by everything that can change the output: the source text, the
// target, the options and NVRTC's version. A cache file is written to a
// temporary name and renamed into place, so a crash or a second process
// racing on the same key never leaves a torn file behind.

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/internal/atomicfile"
)

// compileOptions are NVRTC's options besides the target, then one -D for
// each of defines (a test build's: Device.load). -lineinfo costs nothing
// at run time and lets profilers map time to source lines.
func compileOptions(arch string, defines ...string) []string {
	opts := []string{"--gpu-architecture=" + arch, "--std=c++17", "-lineinfo"}
	for _, d := range defines {
		opts = append(opts, "-D"+d)
	}
	return opts
}

// CompileInfo says how a module's code was obtained.
type CompileInfo struct {
	File      string
	Arch      string
	Options   []string
	CacheHit  bool
	CachePath string        // "" when caching is off
	CacheErr  error         // a failed cache write (the module still works)
	Elapsed   time.Duration // compiling or reading the cache
	Log       string        // NVRTC's warnings, if any
}

// cacheKey hashes what determines a cubin. Fields are length-prefixed, so
// no two different inputs hash the same text.
func cacheKey(source, arch string, options []string, nvrtcMajor, nvrtcMinor int) string {
	h := sha256.New()
	field := func(s string) { fmt.Fprintf(h, "%d:%s;", len(s), s) }
	field("mktrain-kernel-cache-v1")
	field(source)
	field(arch)
	for _, o := range options {
		field(o)
	}
	field(fmt.Sprintf("nvrtc %d.%d", nvrtcMajor, nvrtcMinor))
	return hex.EncodeToString(h.Sum(nil))
}

// cachedCompile returns the image for key from dir, or calls compile and
// stores its result there. dir "" disables the cache. A cache that cannot be
// written is reported in CompileInfo.CacheErr, never as a failure.
func cachedCompile(dir, key string, skipRead bool, compile func() ([]byte, string, error)) ([]byte, CompileInfo, error) {
	var info CompileInfo
	start := time.Now()
	if dir != "" {
		info.CachePath = filepath.Join(dir, key+".cubin")
		if !skipRead {
			if img, err := os.ReadFile(info.CachePath); err == nil && len(img) > 0 {
				info.CacheHit = true
				info.Elapsed = time.Since(start)
				return img, info, nil
			}
		}
	}
	img, log, err := compile()
	info.Log = log
	info.Elapsed = time.Since(start)
	if err != nil {
		return nil, info, err
	}
	if dir != "" {
		info.CacheErr = writeAtomic(info.CachePath, img)
	}
	return img, info, nil
}

// writeAtomic writes data to path through internal/atomicfile, so that a
// concurrent or later reader sees the whole image or none.
func writeAtomic(path string, data []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("kernel cache: %w", err)
	}
	if err := atomicfile.WriteFile(path, func(w io.Writer) error {
		_, err := w.Write(data)
		return err
	}); err != nil {
		return fmt.Errorf("kernel cache: writing %s: %w", path, err)
	}
	return nil
}

// Compile compiles source (a complete translation unit, e.g. from
// kernels.Source.Text) for arch with NVRTC, through the runtime's disk
// cache. name labels it in messages. It needs no GPU. A source NVRTC
// rejects returns a *driver.CompileError with the compiler's log.
func (r *Runtime) Compile(name, source, arch string) ([]byte, CompileInfo, error) {
	return r.compile(name, source, arch, false)
}

func (r *Runtime) compile(name, source, arch string, skipCache bool, defines ...string) ([]byte, CompileInfo, error) {
	opts := compileOptions(arch, defines...)
	major, minor := r.nvrtc.Version()
	key := cacheKey(source, arch, opts, major, minor)
	img, info, err := cachedCompile(r.cacheDir, key, skipCache, func() ([]byte, string, error) {
		return r.nvrtc.Compile(name, source, opts, driver.OutputCubin)
	})
	info.File, info.Arch, info.Options = name, arch, opts
	return img, info, err
}
