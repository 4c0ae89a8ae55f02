package cuda

// Figures: launch overhead, copy bandwidths, kernel bandwidth, compile
// times. Each is logged as "figure: name = value unit", which
// scripts/gpu-test.sh gathers into its table. Checks stay loose (the point
// is the number), but every result is verified so a broken path cannot
// report a good time.

import (
	"math"
	"slices"
	"testing"
	"time"

	"github.com/mktrain/mktrain/kernels"
)

// median runs f reps times and returns the median duration.
func median(reps int, f func() error) (time.Duration, error) {
	ds := make([]time.Duration, reps)
	for i := range ds {
		start := time.Now()
		if err := f(); err != nil {
			return 0, err
		}
		ds[i] = time.Since(start)
	}
	slices.Sort(ds)
	return ds[reps/2], nil
}

func TestFigures(t *testing.T) {
	d := testDevice(t)
	if testing.Short() {
		t.Skip("figures take a few seconds; not in -short")
	}
	fill := kernel(t, d, "elementwise.cu", "fill_f32")
	one, err := d.Alloc(4)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(one)

	// Launch overhead, four ways.
	const sync1, async1 = 2000, 20000
	start := time.Now()
	for range sync1 {
		if err := d.Do(func() error { return nil }); err != nil {
			t.Fatal(err)
		}
	}
	figure(t, "Do round trip to the device thread", float64(time.Since(start).Microseconds())/sync1, "us")

	start = time.Now()
	for range sync1 {
		if err := d.LaunchSync(fill, Grid1D(1, 32), one, float32(1), int64(1)); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	figure(t, "LaunchSync (queue + launch + reply)", float64(time.Since(start).Microseconds())/sync1, "us/launch")

	start = time.Now()
	for range async1 {
		if err := d.Launch(fill, Grid1D(1, 32), one, float32(2), int64(1)); err != nil {
			t.Fatal(err)
		}
	}
	queued := time.Since(start)
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	figure(t, "Launch, host cost to queue", float64(queued.Nanoseconds())/async1/1e3, "us/launch")
	figure(t, "Launch x20000 + Sync, wall", float64(time.Since(start).Microseconds())/async1, "us/launch")

	var inThread time.Duration
	err = d.Do(func() error {
		slots := []uint64{uint64(one.ptr), uint64(math.Float32bits(3)), 1}
		start := time.Now()
		for range async1 {
			if err := d.launchNow(fill, Grid1D(1, 32), slots); err != nil {
				return err
			}
		}
		err := d.drv.StreamSynchronize(d.stream)
		inThread = time.Since(start)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	figure(t, "cuLaunchKernel loop on the device thread + sync", float64(inThread.Nanoseconds())/async1/1e3, "us/launch")
	var got [1]float32
	if err := d.CopyFromDevice(Bytes(got[:]), one, 0); err != nil || got[0] != 3 {
		t.Fatalf("launch loop result %v, %v", got[0], err)
	}

	// Copies: pageable Go memory and page-locked memory, 256 MiB.
	const copyBytes = 256 << 20
	buf, err := d.Alloc(copyBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(buf)
	pageable := make([]byte, copyBytes)
	for i := range pageable {
		pageable[i] = byte(i * 7)
	}
	pinned, err := d.AllocHost(copyBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer d.FreeHost(pinned)
	copy(pinned, pageable)
	gbps := func(bytes int, dt time.Duration) float64 { return float64(bytes) / dt.Seconds() / 1e9 }
	for _, c := range []struct {
		name string
		host []byte
	}{{"pageable", pageable}, {"pinned", pinned}} {
		dt, err := median(5, func() error { return d.CopyToDevice(buf, 0, c.host) })
		if err != nil {
			t.Fatal(err)
		}
		figure(t, "memcpy HtoD "+c.name+" 256 MiB", gbps(copyBytes, dt), "GB/s")
		dt, err = median(5, func() error { return d.CopyFromDevice(c.host, buf, 0) })
		if err != nil {
			t.Fatal(err)
		}
		figure(t, "memcpy DtoH "+c.name+" 256 MiB", gbps(copyBytes, dt), "GB/s")
	}
	if string(pinned[:4096]) != string(pageable[:4096]) || pinned[copyBytes-1] != pageable[copyBytes-1] {
		t.Fatal("copies corrupted the data")
	}

	// Device bandwidth, timed with events: a 1 GiB device-to-device copy
	// (bytes read + written) and the fill kernel writing 1 GiB.
	const big = 1 << 30
	a, err := d.Alloc(big)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(a)
	b, err := d.Alloc(big)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(b)
	timeIt := func(reps int, f func() error) float64 { return eventMS(t, d, reps, f) }
	const n = big / 4
	g := d.StrideGrid(n, 256, 4)
	ms := timeIt(10, func() error { return d.Launch(fill, g, a, float32(1.5), int64(n)) })
	figure(t, "fill_f32 1 GiB write", big/ms/1e6, "GB/s")
	ms = timeIt(10, func() error { return d.CopyDevice(b, 0, a, 0, big) })
	figure(t, "memcpy DtoD 1 GiB (read+write)", 2*big/ms/1e6, "GB/s")
	axpy := kernel(t, d, "elementwise.cu", "axpy_f32")
	ms = timeIt(10, func() error { return d.Launch(axpy, g, b, float32(0.5), a, int64(n)) })
	figure(t, "axpy_f32 256M elements (12 B/element)", 3*big/ms/1e6, "GB/s")
	var tail [4]float32
	if err := d.CopyFromDevice(Bytes(tail[:]), b, big-16); err != nil {
		t.Fatal(err)
	}
	if want := float32(1.5 + 11*0.5*1.5); tail[3] != want { // copy, then 11 axpys
		t.Fatalf("bandwidth runs computed %v, want %v", tail[3], want)
	}

	// Allocator: a cached Alloc+Free pair.
	start = time.Now()
	for range 5000 {
		x, err := d.Alloc(1 << 20)
		if err != nil {
			t.Fatal(err)
		}
		d.Free(x)
	}
	figure(t, "cached Alloc+Free of 1 MiB", float64(time.Since(start).Microseconds())/5000, "us")

	// NVRTC: every source compiled afresh, then read from the cache.
	var total, slowest time.Duration
	var slowestName string
	for _, src := range kernels.Sources() {
		text, err := src.Text()
		if err != nil {
			t.Fatal(err)
		}
		img, info, err := gpu.rt.compile(src.File, text, d.Info().Arch, true)
		if err != nil {
			t.Fatal(err)
		}
		total += info.Elapsed
		if info.Elapsed > slowest {
			slowest, slowestName = info.Elapsed, src.File
		}
		_, hit, err := gpu.rt.compile(src.File, text, d.Info().Arch, false)
		if err != nil || !hit.CacheHit {
			t.Fatalf("%s: cached read: hit=%v %v", src.File, hit.CacheHit, err)
		}
		t.Logf("%s: NVRTC %v, cache read %v, %d-byte cubin", src.File, info.Elapsed.Round(time.Millisecond), hit.Elapsed, len(img))
	}
	figure(t, "NVRTC compile, all sources (cold)", float64(total.Milliseconds()), "ms")
	figure(t, "NVRTC compile, slowest source ("+slowestName+")", float64(slowest.Milliseconds()), "ms")
	for _, src := range kernels.Sources() {
		m, err := d.Load(src)
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range src.Kernels {
			kk, _ := m.Kernel(k.Name)
			t.Logf("%s: %d registers", k.Name, kk.Registers)
		}
	}
}
