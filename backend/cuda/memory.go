package cuda

// The caching allocator. cuMemAlloc and cuMemFree are slow (they can
// synchronize the whole device), and a training step frees and asks for the
// same sizes again and again, so freed blocks go to a free list per size
// class and are handed out again. All work runs on one stream in order, so a
// block freed while a queued kernel still uses it is safe to reuse for work
// queued later. Blocks go back to the driver only when an allocation fails
// for lack of memory, on EmptyCache, and on Close.

import (
	"errors"
	"fmt"
	"math/bits"
	"sync"

	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// minClass is the smallest block handed out; smaller requests round up.
const minClass = 512

// fineAbove is the block size above which the classes are finer: the
// blocks that large are the model's flat stores and a few activation
// buffers, allocated once, where a coarse class would waste gigabytes (a
// quarter of moe-fine's 17.3 GiB stores) for no reuse.
const fineAbove = 1 << 30

// sizeClass rounds n up to its class: at least minClass, else one of four
// steps per power of two (n in (2^(k-1), 2^k] rounds up to a multiple of
// 2^(k-3)), so at most a quarter of a block is slack; above fineAbove one
// of 32 steps (a multiple of 2^(k-6)), at most 1/32 slack.
func sizeClass(n int64) int64 {
	if n <= minClass {
		return minClass
	}
	k := bits.Len64(uint64(n - 1)) // 2^k >= n > 2^(k-1)
	shift := 3
	if n > fineAbove {
		shift = 6
	}
	step := int64(1) << (k - shift)
	return (n + step - 1) / step * step
}

// Buffer is a block of device memory from Device.Alloc.
type Buffer struct {
	ptr   driver.DevicePtr
	size  int64 // bytes asked for
	class int64 // bytes reserved
}

// Ptr is the device address, for kernel arguments.
func (b *Buffer) Ptr() driver.DevicePtr { return b.ptr }

// Size is the number of bytes asked for.
func (b *Buffer) Size() int64 { return b.size }

// span checks that [offset, offset+n) lies inside b.
func (b *Buffer) span(op string, offset, n int64) error {
	if b == nil || b.ptr == 0 {
		return fmt.Errorf("cuda: %s on a nil or freed buffer", op)
	}
	if offset < 0 || n < 0 || offset+n > b.size {
		return fmt.Errorf("cuda: %s of bytes [%d, %d) outside a buffer of %d bytes", op, offset, offset+n, b.size)
	}
	return nil
}

// AllocStats are the allocator's counters.
type AllocStats struct {
	InUse        int64 // bytes reserved by live buffers (their size classes)
	Requested    int64 // bytes asked for by live buffers
	Cached       int64 // bytes in free lists, held from the driver for reuse
	Pending      int64 // bytes freed but not yet in a free list (queued)
	Peak         int64 // the largest InUse so far
	Live         int   // live buffers
	Allocs       int64 // successful Alloc calls
	Frees        int64 // Free calls
	CacheHits    int64 // Allocs served from a free list
	DriverAllocs int64 // cuMemAlloc calls that succeeded
	DriverFrees  int64 // cuMemFree calls
}

// OutOfMemoryError is an allocation the GPU could not hold even after the
// cache was given back.
type OutOfMemoryError struct {
	GPU           string // Info.String() of the device
	Asked         int64  // bytes asked for
	Class         int64  // bytes the allocator tried to reserve
	Free, Total   int64  // the driver's view after giving the cache back
	InUse, Cached int64  // the allocator's own holdings
	Err           error  // the driver's error
}

func (e *OutOfMemoryError) Error() string {
	return fmt.Sprintf("cuda: out of GPU memory: asked for %s (%d bytes) with %s free of %s, %s held by mktrain's live tensors; lower train.micro_batch or train.seq (%s; %v)",
		FormatBytes(e.Asked), e.Asked, FormatBytes(e.Free), FormatBytes(e.Total), FormatBytes(e.InUse), e.GPU, e.Err)
}

func (e *OutOfMemoryError) Unwrap() error { return e.Err }

// memory is what the allocator needs from the driver; the device thread
// provides it, tests fake it.
type memory interface {
	alloc(bytes int64) (driver.DevicePtr, error)
	free(p driver.DevicePtr) error
	info() (free, total int64, err error)
	// sync waits for queued work, before blocks go back to the driver.
	sync() error
}

type allocator struct {
	mem  memory
	desc string

	mu    sync.Mutex
	cache map[int64][]driver.DevicePtr // class -> free blocks
	live  map[driver.DevicePtr]*Buffer
	stats AllocStats
}

func newAllocator(mem memory, desc string) *allocator {
	return &allocator{mem: mem, desc: desc, cache: map[int64][]driver.DevicePtr{}, live: map[driver.DevicePtr]*Buffer{}}
}

// fromCache serves n from its class's free list, if that holds a block. It
// needs no driver call, so it runs on any goroutine: a block enters the
// list only in queue order (see release), so work queued by the new owner
// runs after the old owner's.
func (a *allocator) fromCache(n int64) (*Buffer, bool) {
	class := sizeClass(n)
	a.mu.Lock()
	defer a.mu.Unlock()
	free := a.cache[class]
	if n < 0 || len(free) == 0 {
		return nil, false
	}
	p := free[len(free)-1]
	a.cache[class] = free[:len(free)-1]
	a.stats.Cached -= class
	a.stats.CacheHits++
	return a.addLiveLocked(p, n, class), true
}

// allocate serves n from the cache or the driver; it runs on the device
// thread.
func (a *allocator) allocate(n int64) (*Buffer, error) {
	if n < 0 {
		return nil, fmt.Errorf("cuda: Alloc of %d bytes", n)
	}
	if b, ok := a.fromCache(n); ok {
		return b, nil
	}
	class := sizeClass(n)
	a.mu.Lock()
	defer a.mu.Unlock()
	p, err := a.mem.alloc(class)
	if driver.Code(err) == driver.ErrorOutOfMemory && a.stats.Cached > 0 {
		// Give the cache back and try once more: the free lists may hold
		// plenty of memory in the wrong sizes.
		if rerr := a.releaseCacheLocked(); rerr != nil {
			return nil, rerr
		}
		p, err = a.mem.alloc(class)
	}
	if driver.Code(err) == driver.ErrorOutOfMemory {
		e := &OutOfMemoryError{GPU: a.desc, Asked: n, Class: class, InUse: a.stats.InUse, Cached: a.stats.Cached, Err: err}
		e.Free, e.Total, _ = a.mem.info()
		return nil, e
	}
	if err != nil {
		return nil, err
	}
	a.stats.DriverAllocs++
	return a.addLiveLocked(p, n, class), nil
}

func (a *allocator) addLiveLocked(p driver.DevicePtr, n, class int64) *Buffer {
	b := &Buffer{ptr: p, size: n, class: class}
	a.live[p] = b
	a.stats.Allocs++
	a.stats.Live++
	a.stats.InUse += class
	a.stats.Requested += n
	a.stats.Peak = max(a.stats.Peak, a.stats.InUse)
	return b
}

// release takes b out of the live set. The block joins the free list only
// when the returned function runs on the device thread: by then every piece
// of work queued before the Free is on the stream, so a later stream sync
// covers it before the block can go back to the driver.
func (a *allocator) release(b *Buffer) (func(), error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if b == nil || b.ptr == 0 || a.live[b.ptr] != b {
		return nil, errors.New("cuda: Free of a buffer that is not live (freed twice, or from another device)")
	}
	p, class := b.ptr, b.class
	delete(a.live, p)
	a.stats.Frees++
	a.stats.Live--
	a.stats.InUse -= class
	a.stats.Requested -= b.size
	a.stats.Pending += class
	b.ptr = 0
	return func() {
		a.mu.Lock()
		defer a.mu.Unlock()
		a.cache[class] = append(a.cache[class], p)
		a.stats.Pending -= class
		a.stats.Cached += class
	}, nil
}

// releaseCacheLocked gives every cached block back to the driver.
func (a *allocator) releaseCacheLocked() error {
	if a.stats.Cached == 0 {
		return nil
	}
	if err := a.mem.sync(); err != nil {
		return err
	}
	var errs []error
	for class, ptrs := range a.cache {
		for _, p := range ptrs {
			if err := a.mem.free(p); err != nil {
				errs = append(errs, err)
			}
			a.stats.DriverFrees++
			a.stats.Cached -= class
		}
		delete(a.cache, class)
	}
	return errors.Join(errs...)
}

// releaseAll frees cached and live blocks (on Close).
func (a *allocator) releaseAll() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	errs := []error{a.releaseCacheLocked()}
	for p, b := range a.live {
		errs = append(errs, a.mem.free(p))
		a.stats.DriverFrees++
		a.stats.InUse -= b.class
		a.stats.Requested -= b.size
		a.stats.Live--
		b.ptr = 0
		delete(a.live, p)
	}
	return errors.Join(errs...)
}

func (a *allocator) snapshot() AllocStats {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.stats
}

// deviceMemory is the allocator's view of a Device; its methods run on the
// device thread (inside Do).
type deviceMemory struct{ d *Device }

func (m deviceMemory) alloc(n int64) (driver.DevicePtr, error) { return m.d.drv.MemAlloc(n) }
func (m deviceMemory) free(p driver.DevicePtr) error           { return m.d.drv.MemFree(p) }
func (m deviceMemory) info() (int64, int64, error)             { return m.d.drv.MemGetInfo() }
func (m deviceMemory) sync() error                             { return m.d.drv.StreamSynchronize(m.d.stream) }

// Alloc returns a buffer of at least bytes bytes, reusing a cached block of
// the same size class when there is one. Its contents are undefined. When
// the GPU is full it returns an *OutOfMemoryError.
func (d *Device) Alloc(bytes int64) (*Buffer, error) {
	// A cached block needs no hand-off to the device thread.
	if b, ok := d.mem.fromCache(bytes); ok {
		return b, nil
	}
	var b *Buffer
	err := d.Do(func() error {
		var err error
		b, err = d.mem.allocate(bytes)
		return err
	})
	return b, err
}

// Free returns b to the cache. Work queued before Free that uses b still
// sees valid memory: the block is reused only by work queued later. Freeing
// a buffer twice is an error.
func (d *Device) Free(b *Buffer) error {
	toCache, err := d.mem.release(b)
	if err != nil {
		return err
	}
	return d.Submit(func() error { toCache(); return nil })
}

// EmptyCache gives every cached block back to the driver.
func (d *Device) EmptyCache() error {
	return d.Do(func() error {
		d.mem.mu.Lock()
		defer d.mem.mu.Unlock()
		return d.mem.releaseCacheLocked()
	})
}

// AllocStats returns the allocator's counters.
func (d *Device) AllocStats() AllocStats { return d.mem.snapshot() }

// FormatBytes writes n in binary units: "512 B", "1.5 KiB", "139.8 GiB".
func FormatBytes(n int64) string {
	const unit = 1024
	if n < unit && n > -unit {
		return fmt.Sprintf("%d B", n)
	}
	v := float64(n)
	for _, u := range []string{"KiB", "MiB", "GiB", "TiB", "PiB"} {
		v /= unit
		if v < unit && v > -unit || u == "PiB" {
			return fmt.Sprintf("%.1f %s", v, u)
		}
	}
	return fmt.Sprintf("%d B", n)
}
