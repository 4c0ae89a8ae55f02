package cuda

// Tests that need a GPU. They skip, with one line saying why, where there is
// no driver or no GPU; scripts/gpu-test.sh runs them on a GPU machine.

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/kernels"
)

// gpu is the device every GPU test shares, opened once by TestMain.
var gpu struct {
	rt       *Runtime
	dev      *Device
	skip     string // why GPU tests skip, if they do
	err      error  // a failure to open a GPU that is there
	cacheDir string
}

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "mktrain-kernel-cache")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	gpu.cacheDir = dir
	openGPU()
	code := m.Run()
	if gpu.dev != nil {
		if err := gpu.dev.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "closing the device:", err)
			code = 1
		}
	}
	os.RemoveAll(dir)
	os.Exit(code)
}

func openGPU() {
	rt, err := Load(Options{KernelCacheDir: gpu.cacheDir})
	var nf *driver.NotFoundError
	switch {
	case errors.As(err, &nf):
		gpu.skip = fmt.Sprintf("cuda: no %s found (looked in %s)", strings.Join(nf.Lib.Sonames(), " or "), strings.Join(nf.Looked, ", "))
		return
	case driver.Code(err) == driver.ErrorNoDevice || driver.Code(err) == driver.ErrorNotInitialized:
		gpu.skip = "cuda: no usable GPU: " + err.Error()
		return
	case err != nil:
		gpu.err = err
		return
	}
	n, err := rt.DeviceCount()
	if err != nil {
		gpu.err = err
		return
	}
	if n == 0 {
		gpu.skip = "cuda: the driver sees no GPU"
		return
	}
	gpu.rt = rt
	gpu.dev, gpu.err = rt.Open(0)
}

// testDevice returns the shared device or skips the test.
func testDevice(t *testing.T) *Device {
	t.Helper()
	if gpu.skip != "" {
		t.Skip(gpu.skip)
	}
	if gpu.err != nil {
		t.Fatal(gpu.err)
	}
	return gpu.dev
}

// eventMS runs f once to warm up, then reps times between two events, and
// returns the GPU milliseconds per run.
func eventMS(t *testing.T, d *Device, reps int, f func() error) float64 {
	t.Helper()
	e0, err := d.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	defer e0.Destroy()
	e1, err := d.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	defer e1.Destroy()
	if err := f(); err != nil {
		t.Fatal(err)
	}
	e0.Record()
	for range reps {
		if err := f(); err != nil {
			t.Fatal(err)
		}
	}
	e1.Record()
	ms, err := e1.Since(e0)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	return ms / float64(reps)
}

// figure logs one measured number in a form scripts/gpu-test.sh collects.
func figure(t *testing.T, name string, value float64, unit string) {
	t.Helper()
	t.Logf("figure: %s = %.4g %s", name, value, unit)
}

func TestDeviceQuery(t *testing.T) {
	d := testDevice(t)
	info := d.Info()
	t.Log(info)
	if info.SMs <= 0 || info.TotalMem <= 0 || info.Major <= 0 || !strings.HasPrefix(info.Arch, "sm_") || info.Name == "" {
		t.Errorf("implausible device info: %+v", info)
	}
	free, total, err := d.MemInfo()
	if err != nil {
		t.Fatal(err)
	}
	if free <= 0 || free > total || total > info.TotalMem+1<<30 {
		t.Errorf("MemInfo: %d free of %d (device total %d)", free, total, info.TotalMem)
	}
	t.Logf("memory: %s free of %s", FormatBytes(free), FormatBytes(total))
	for _, l := range []*driver.Library{gpu.rt.Driver().Library(), gpu.rt.NVRTC().Library()} {
		t.Logf("%s: %s (via %s)", l.Lib, l.Path, l.Via)
	}
	// cuBLASLt and NCCL are opened by Gemm and NCCLGroup; check they can be
	// found and opened where the GPU is.
	for _, lib := range []driver.Lib{driver.LibCublasLt, driver.LibNCCL} {
		l, err := driver.Search{}.Open(lib)
		if err != nil {
			t.Errorf("%v: %v", lib, err)
			continue
		}
		t.Logf("%s: %s (via %s)", lib, l.Path, l.Via)
	}
}

func TestAllocCopyRoundTrip(t *testing.T) {
	d := testDevice(t)
	rng := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{1, 1000, 1<<20 + 3, 64 << 20} {
		src := make([]byte, n)
		for i := range src {
			src[i] = byte(rng.Uint32())
		}
		a, err := d.Alloc(int64(n))
		if err != nil {
			t.Fatal(err)
		}
		b, err := d.Alloc(int64(n) + 8)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.CopyToDevice(a, 0, src); err != nil {
			t.Fatal(err)
		}
		// Device to device at an offset, then back.
		if err := d.CopyDevice(b, 8, a, 0, int64(n)); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, n)
		if err := d.CopyFromDevice(got, b, 8); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, src) {
			t.Fatalf("%d bytes: round trip differs", n)
		}
		if err := d.Sync(); err != nil {
			t.Fatal(err)
		}
		d.Free(a)
		d.Free(b)
	}
	// Memset32 and bounds.
	buf, err := d.Alloc(4 * 1000)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Memset32(buf, 10, 980, 0xdeadbeef); err != nil {
		t.Fatal(err)
	}
	if err := d.Memset32(buf, 0, 10, 1); err != nil {
		t.Fatal(err)
	}
	if err := d.Memset32(buf, 990, 10, 2); err != nil {
		t.Fatal(err)
	}
	words := make([]uint32, 1000)
	if err := d.CopyFromDevice(Bytes(words), buf, 0); err != nil {
		t.Fatal(err)
	}
	for i, w := range words {
		want := uint32(0xdeadbeef)
		if i < 10 {
			want = 1
		} else if i >= 990 {
			want = 2
		}
		if w != want {
			t.Fatalf("word %d = %#x, want %#x", i, w, want)
		}
	}
	if err := d.CopyToDevice(buf, 3990, make([]byte, 11)); err == nil {
		t.Error("copy past the end accepted")
	}
	if err := d.Memset32(buf, 999, 2, 0); err == nil {
		t.Error("memset past the end accepted")
	}
	d.Free(buf)
	if err := d.Free(buf); err == nil {
		t.Error("double Free accepted")
	}
	if err := d.CopyToDevice(buf, 0, []byte{1}); err == nil {
		t.Error("copy into a freed buffer accepted")
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
}

func TestAllocatorOnGPU(t *testing.T) {
	d := testDevice(t)
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := d.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	before := d.AllocStats()
	const n = 3 << 20
	a, err := d.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	s := d.AllocStats()
	if s.InUse-before.InUse != sizeClass(n) || s.Live != before.Live+1 || s.DriverAllocs != before.DriverAllocs+1 || s.Peak < s.InUse {
		t.Fatalf("after Alloc: %+v (before %+v)", s, before)
	}
	p := a.Ptr()
	d.Free(a)
	if err := d.Sync(); err != nil { // the free reaches the cache in queue order
		t.Fatal(err)
	}
	if s := d.AllocStats(); s.Cached != sizeClass(n) || s.InUse != before.InUse {
		t.Fatalf("after Free: %+v", s)
	}
	b, err := d.Alloc(n - 1000) // same class
	if err != nil {
		t.Fatal(err)
	}
	if b.Ptr() != p || d.AllocStats().CacheHits != before.CacheHits+1 {
		t.Fatalf("same-class Alloc did not reuse the cached block: %#x vs %#x, %+v", b.Ptr(), p, d.AllocStats())
	}
	d.Free(b)
	free0, _, _ := d.MemInfo()
	if err := d.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	free1, _, _ := d.MemInfo()
	if s := d.AllocStats(); s.Cached != 0 || s.DriverFrees <= before.DriverFrees {
		t.Fatalf("after EmptyCache: %+v", s)
	}
	t.Logf("EmptyCache returned %s to the driver; stats %+v", FormatBytes(free1-free0), d.AllocStats())
}

func TestOutOfMemoryOnGPU(t *testing.T) {
	d := testDevice(t)
	const petabyte = 1 << 50
	_, err := d.Alloc(petabyte)
	var oom *OutOfMemoryError
	if !errors.As(err, &oom) {
		t.Fatalf("Alloc(1 PiB): %v, want *OutOfMemoryError", err)
	}
	t.Logf("the message: %v", err)
	for _, want := range []string{"1125899906842624 bytes", "lower train.micro_batch or train.seq", "CUDA_ERROR_OUT_OF_MEMORY", "cuMemAlloc_v2"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("message lacks %q", want)
		}
	}
	if oom.Free <= 0 || oom.Total < oom.Free {
		t.Errorf("free/total not filled in: %+v", oom)
	}
	// The device still works.
	b, err := d.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.CopyToDevice(b, 0, make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
	d.Free(b)
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
}

func TestCompileErrorHasLog(t *testing.T) {
	d := testDevice(t)
	src := "extern \"C\" __global__ void broken(float* x) {\n#line 7 \"broken.cu\"\n  x[0] = undefined_name;\n}\n"
	_, _, err := gpu.rt.Compile("broken.cu", src, d.Info().Arch)
	var ce *driver.CompileError
	if !errors.As(err, &ce) {
		t.Fatalf("err = %v, want *driver.CompileError", err)
	}
	if !strings.Contains(ce.Log, "undefined_name") || !strings.Contains(ce.Log, "broken.cu(7)") {
		t.Errorf("log does not point at the error:\n%s", ce.Log)
	}
	t.Logf("NVRTC said: %v", err)
}

func TestKernelCacheOnGPU(t *testing.T) {
	d := testDevice(t)
	src, err := kernels.Lookup("swiglu.cu")
	if err != nil {
		t.Fatal(err)
	}
	text, _ := src.Text()
	img1, info1, err := gpu.rt.Compile(src.File, text, d.Info().Arch)
	if err != nil {
		t.Fatal(err)
	}
	img2, info2, err := gpu.rt.Compile(src.File, text, d.Info().Arch)
	if err != nil {
		t.Fatal(err)
	}
	if !info2.CacheHit || !bytes.Equal(img1, img2) || filepath.Dir(info2.CachePath) != gpu.cacheDir {
		t.Fatalf("second compile: hit=%v, same=%v, path %s", info2.CacheHit, bytes.Equal(img1, img2), info2.CachePath)
	}
	t.Logf("%s: compiled or read in %v, cached read %v, %d-byte cubin", src.File, info1.Elapsed, info2.Elapsed, len(img2))
	// A damaged cache file: a second Device on the same GPU must recompile
	// it and repair the cache.
	if err := os.WriteFile(info2.CachePath, []byte("not a cubin"), 0o644); err != nil {
		t.Fatal(err)
	}
	d2, err := gpu.rt.Open(d.Info().Ordinal)
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	m, err := d2.Load(src)
	if err != nil {
		t.Fatalf("Load with a damaged cache file: %v", err)
	}
	if m.Info.CacheHit {
		t.Error("damaged cache file reported as a hit")
	}
	if fixed, _ := os.ReadFile(info2.CachePath); !bytes.Equal(fixed, img1) {
		t.Error("cache file not repaired")
	}
}

func TestLaunchErrors(t *testing.T) {
	d := testDevice(t)
	k := kernel(t, d, "elementwise.cu", "fill_f32")
	if err := d.Launch(k, Grid1D(1, 32), (*Buffer)(nil), float32(0), 5); err == nil || !strings.Contains(err.Error(), "plain int") {
		t.Errorf("plain int argument: %v", err)
	}
	// 2048 threads per block is over every GPU's limit: the launch fails
	// and the failure comes back from Sync, naming the call.
	if err := d.Launch(k, Grid1D(1, 2048), (*Buffer)(nil), float32(0), int64(0)); err != nil {
		t.Fatal(err)
	}
	err := d.Sync()
	if err == nil || !strings.Contains(err.Error(), "cuLaunchKernel") || !strings.Contains(err.Error(), "fill_f32") {
		t.Fatalf("Sync after a bad launch: %v", err)
	}
	if err := d.Sync(); err != nil {
		t.Fatalf("the error was not cleared by the Sync that returned it: %v", err)
	}
	if err := d.LaunchSync(k, Grid1D(1, 2048), (*Buffer)(nil), float32(0), int64(0)); err == nil {
		t.Fatal("LaunchSync of a bad launch returned nil")
	}
}

// kernel loads file on d and returns its kernel name.
func kernel(t *testing.T, d *Device, file, name string) *Kernel {
	t.Helper()
	src, err := kernels.Lookup(file)
	if err != nil {
		t.Fatal(err)
	}
	m, err := d.Load(src)
	if err != nil {
		t.Fatal(err)
	}
	k, err := m.Kernel(name)
	if err != nil {
		t.Fatal(err)
	}
	return k
}
