package cuda

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// Options configures Load. The zero value searches the process environment
// for the libraries and caches kernels in the default folder.
type Options struct {
	// Search says where libraries are looked for (see package driver).
	Search driver.Search
	// KernelCacheDir holds compiled kernels; "" means DefaultKernelCacheDir.
	KernelCacheDir string
	// NoKernelCache compiles every kernel afresh and writes nothing to disk.
	NoKernelCache bool
}

// Runtime is the loaded driver and compiler, shared by the Devices opened
// from it.
type Runtime struct {
	drv      *driver.Driver
	nvrtc    *driver.NVRTC
	cacheDir string // "" when caching is off
}

// Load finds and opens libcuda and libnvrtc and initializes the driver. It
// touches no GPU beyond cuInit.
func Load(opts Options) (*Runtime, error) {
	drv, err := opts.Search.LoadDriver()
	if err != nil {
		return nil, err
	}
	nv, err := opts.Search.LoadNVRTC()
	if err != nil {
		return nil, err
	}
	r := &Runtime{drv: drv, nvrtc: nv}
	if !opts.NoKernelCache {
		r.cacheDir = opts.KernelCacheDir
		if r.cacheDir == "" {
			r.cacheDir = DefaultKernelCacheDir(os.Getenv)
		}
	}
	return r, nil
}

// Driver is the loaded driver API.
func (r *Runtime) Driver() *driver.Driver { return r.drv }

// NVRTC is the loaded compiler.
func (r *Runtime) NVRTC() *driver.NVRTC { return r.nvrtc }

// KernelCacheDir is the folder compiled kernels are cached in, "" if none.
func (r *Runtime) KernelCacheDir() string { return r.cacheDir }

// DeviceCount is the number of GPUs the driver sees.
func (r *Runtime) DeviceCount() (int, error) { return r.drv.DeviceCount() }

// DefaultKernelCacheDir is $XDG_CACHE_HOME/mktrain/kernels, else
// $HOME/.cache/mktrain/kernels, else "" (no disk cache).
func DefaultKernelCacheDir(getenv func(string) string) string {
	if x := getenv("XDG_CACHE_HOME"); x != "" && filepath.IsAbs(x) {
		return filepath.Join(x, "mktrain", "kernels")
	}
	if h := getenv("HOME"); h != "" {
		return filepath.Join(h, ".cache", "mktrain", "kernels")
	}
	return ""
}

// Arch is the NVRTC target for a compute capability: sm_90a on Hopper (9.0,
// which enables wgmma and setmaxnreg), sm_XY otherwise.
func Arch(major, minor int) string {
	if major == 9 && minor == 0 {
		return "sm_90a"
	}
	return fmt.Sprintf("sm_%d%d", major, minor)
}
