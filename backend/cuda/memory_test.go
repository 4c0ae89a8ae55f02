package cuda

import (
	"errors"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/plan"
)

func TestSizeClass(t *testing.T) {
	prev := int64(0)
	perOctave := map[int]int{}
	for n := int64(0); n < 1<<20; n += 1 + n/64 {
		c := sizeClass(n)
		if c < n || c < minClass {
			t.Fatalf("sizeClass(%d) = %d is too small", n, c)
		}
		if n > minClass && float64(c) > 1.25*float64(n) {
			t.Fatalf("sizeClass(%d) = %d wastes more than a quarter", n, c)
		}
		if c < prev {
			t.Fatalf("sizeClass not monotonic at %d: %d < %d", n, c, prev)
		}
		if sizeClass(c) != c {
			t.Fatalf("sizeClass(%d) = %d is not a fixed point", c, sizeClass(c))
		}
		if c != prev && c > minClass {
			perOctave[int(sizeClassOctave(c))]++
		}
		prev = c
	}
	for oct, k := range perOctave {
		if oct > 10 && oct < 20 && k != 4 {
			t.Errorf("octave 2^%d has %d classes, want 4", oct, k)
		}
	}
	// Above fineAbove: at most 1/32 slack, 32 classes per power of two.
	prev, perOctave = 0, map[int]int{}
	for n := int64(fineAbove - 4096); n < 1<<37; n += 1 + n/1024 {
		c := sizeClass(n)
		if c < n || c < prev || sizeClass(c) != c {
			t.Fatalf("sizeClass(%d) = %d (previous class %d, class of the class %d)", n, c, prev, sizeClass(c))
		}
		if n > fineAbove && float64(c) > (1+1.0/32)*float64(n) {
			t.Fatalf("sizeClass(%d) = %d wastes more than 1/32", n, c)
		}
		if c != prev {
			perOctave[sizeClassOctave(c)]++
		}
		prev = c
	}
	for oct := 31; oct < 37; oct++ {
		if perOctave[oct] != 32 {
			t.Errorf("octave 2^%d has %d classes, want 32", oct, perOctave[oct])
		}
	}
	if fineAbove != plan.CUDAFineClassesAbove {
		t.Errorf("fineAbove is %d, package plan's mirror %d", int64(fineAbove), int64(plan.CUDAFineClassesAbove))
	}
	if got := sizeClass(1 << 50); got != 1<<50 {
		t.Errorf("sizeClass(1 PiB) = %d", got)
	}
}

// sizeClassOctave is k with 2^(k-1) < c <= 2^k.
func sizeClassOctave(c int64) int {
	k := 0
	for int64(1)<<k < c {
		k++
	}
	return k
}

// fakeMemory is a device of capacity bytes that hands out fake addresses.
type fakeMemory struct {
	capacity, used int64
	next           driver.DevicePtr
	blocks         map[driver.DevicePtr]int64
	syncs, allocs  int
}

func newFakeMemory(capacity int64) *fakeMemory {
	return &fakeMemory{capacity: capacity, next: 1 << 20, blocks: map[driver.DevicePtr]int64{}}
}

func (f *fakeMemory) alloc(n int64) (driver.DevicePtr, error) {
	if f.used+n > f.capacity {
		return 0, &driver.Error{Call: "cuMemAlloc_v2", Code: driver.ErrorOutOfMemory, Name: "CUDA_ERROR_OUT_OF_MEMORY", Text: "out of memory"}
	}
	p := f.next
	f.next += driver.DevicePtr(n + 256)
	f.blocks[p] = n
	f.used += n
	f.allocs++
	return p, nil
}

func (f *fakeMemory) free(p driver.DevicePtr) error {
	n, ok := f.blocks[p]
	if !ok {
		return errors.New("fake: free of unknown pointer")
	}
	delete(f.blocks, p)
	f.used -= n
	return nil
}

func (f *fakeMemory) info() (int64, int64, error) { return f.capacity - f.used, f.capacity, nil }
func (f *fakeMemory) sync() error                 { f.syncs++; return nil }

func mustFree(t *testing.T, a *allocator, b *Buffer) {
	t.Helper()
	toCache, err := a.release(b)
	if err != nil {
		t.Fatal(err)
	}
	toCache()
}

func TestAllocatorReuseAndStats(t *testing.T) {
	mem := newFakeMemory(1 << 30)
	a := newAllocator(mem, "fake GPU")
	if b, ok := a.fromCache(1000); ok || b != nil || a.snapshot() != (AllocStats{}) {
		t.Fatalf("fromCache on an empty cache: %v %v %+v", b, ok, a.snapshot())
	}
	b1, err := a.allocate(1000)
	if err != nil {
		t.Fatal(err)
	}
	b2, err := a.allocate(3000)
	if err != nil {
		t.Fatal(err)
	}
	s := a.snapshot()
	want := AllocStats{InUse: sizeClass(1000) + sizeClass(3000), Requested: 4000, Peak: sizeClass(1000) + sizeClass(3000),
		Live: 2, Allocs: 2, DriverAllocs: 2}
	if s != want {
		t.Fatalf("stats %+v, want %+v", s, want)
	}
	p1 := b1.ptr
	mustFree(t, a, b1)
	if _, err := a.release(b1); err == nil {
		t.Fatal("second Free of the same buffer succeeded")
	}
	// A request of the same class reuses the block without the driver,
	// through the path Device.Alloc takes off the device thread.
	b3, ok := a.fromCache(990)
	if !ok {
		t.Fatal("fromCache missed a cached block of the same class")
	}
	if b3.ptr != p1 || mem.allocs != 2 {
		t.Fatalf("no reuse: got %#x (first was %#x), %d driver allocations", b3.ptr, p1, mem.allocs)
	}
	s = a.snapshot()
	if s.CacheHits != 1 || s.Cached != 0 || s.Requested != 3990 || s.Frees != 1 || s.Peak != want.Peak {
		t.Fatalf("after reuse: %+v", s)
	}
	mustFree(t, a, b2)
	mustFree(t, a, b3)
	if s := a.snapshot(); s.InUse != 0 || s.Live != 0 || s.Cached != want.InUse {
		t.Fatalf("after freeing all: %+v", s)
	}
	if err := a.releaseAll(); err != nil {
		t.Fatal(err)
	}
	if s := a.snapshot(); s.Cached != 0 || s.DriverFrees != 2 || mem.used != 0 {
		t.Fatalf("after releaseAll: %+v, fake still holds %d bytes", s, mem.used)
	}
}

func TestAllocatorOutOfMemory(t *testing.T) {
	mem := newFakeMemory(10 << 20)
	a := newAllocator(mem, "GPU 0: fake")
	// Fill the cache with small blocks, then ask for one large block: the
	// allocator must give the cache back and retry.
	var bufs []*Buffer
	for range 8 {
		b, err := a.allocate(1 << 20)
		if err != nil {
			t.Fatal(err)
		}
		bufs = append(bufs, b)
	}
	for _, b := range bufs {
		mustFree(t, a, b)
	}
	big, err := a.allocate(6 << 20)
	if err != nil {
		t.Fatalf("allocation after the cache could be given back failed: %v", err)
	}
	if s := a.snapshot(); s.Cached != 0 || s.DriverFrees != 8 || mem.syncs != 1 {
		t.Fatalf("cache not given back before the retry: %+v, %d syncs", s, mem.syncs)
	}
	_, err = a.allocate(1 << 50)
	var oom *OutOfMemoryError
	if !errors.As(err, &oom) {
		t.Fatalf("err = %v, want *OutOfMemoryError", err)
	}
	if driver.Code(err) != driver.ErrorOutOfMemory {
		t.Errorf("the driver's error is not wrapped: %v", err)
	}
	for _, want := range []string{"1125899906842624 bytes", "1.0 PiB", "free of 10.0 MiB", "lower train.micro_batch or train.seq", "GPU 0: fake"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("message lacks %q: %s", want, err)
		}
	}
	if oom.Asked != 1<<50 || oom.InUse != big.class || oom.Free != mem.capacity-mem.used {
		t.Errorf("fields: %+v", oom)
	}
	if _, err := a.allocate(-1); err == nil {
		t.Error("negative size accepted")
	}
}

// TestAllocatorRandom runs random allocations and frees against the fake and
// checks the books balance after every step.
func TestAllocatorRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	mem := newFakeMemory(64 << 20)
	a := newAllocator(mem, "fake")
	var live []*Buffer
	var pending []func()
	for step := range 5000 {
		switch r := rng.IntN(10); {
		case r < 5:
			n := rng.Int64N(1 << rng.IntN(22))
			b, err := a.allocate(n)
			if err != nil {
				var oom *OutOfMemoryError
				if !errors.As(err, &oom) {
					t.Fatal(err)
				}
				continue
			}
			live = append(live, b)
		case r < 9 && len(live) > 0:
			i := rng.IntN(len(live))
			toCache, err := a.release(live[i])
			if err != nil {
				t.Fatal(err)
			}
			pending = append(pending, toCache)
			live = append(live[:i], live[i+1:]...)
		default:
			for _, f := range pending {
				f()
			}
			pending = nil
		}
		s := a.snapshot()
		var inUse, req, cached int64
		seen := map[driver.DevicePtr]bool{}
		for _, b := range live {
			inUse += b.class
			req += b.size
			if seen[b.ptr] {
				t.Fatalf("step %d: pointer %#x handed out twice", step, b.ptr)
			}
			seen[b.ptr] = true
		}
		for class, ptrs := range a.cache {
			cached += class * int64(len(ptrs))
			for _, p := range ptrs {
				if seen[p] {
					t.Fatalf("step %d: live pointer %#x also cached", step, p)
				}
			}
		}
		if s.InUse != inUse || s.Requested != req || s.Cached != cached || s.Live != len(live) ||
			mem.used != s.InUse+s.Cached+s.Pending || s.Peak < s.InUse {
			t.Fatalf("step %d: stats %+v; live %d bytes (%d asked), cached %d, fake holds %d", step, s, inUse, req, cached, mem.used)
		}
	}
}

func TestFormatBytes(t *testing.T) {
	for n, want := range map[int64]string{0: "0 B", 512: "512 B", 1536: "1.5 KiB", 1 << 30: "1.0 GiB", 1 << 50: "1.0 PiB", 150110011392: "139.8 GiB"} {
		if got := FormatBytes(n); got != want {
			t.Errorf("FormatBytes(%d) = %q, want %q", n, got, want)
		}
	}
}
