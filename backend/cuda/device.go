package cuda

// One Device per GPU. A CUDA context is bound to an OS thread, and Go moves
// goroutines between threads at will, so every call that needs the context
// runs on one goroutine locked to one thread, fed closures through a
// channel. Calls that wait for a result (Do) pay a hand-off to that thread
// and back; calls that don't (Submit, Launch) only queue, and their errors
// wait for the next Sync, like the device's own asynchronous errors.

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// ErrClosed is returned by calls on a closed Device.
var ErrClosed = errors.New("cuda: device is closed")

// Info describes a GPU.
type Info struct {
	Ordinal        int
	Name           string
	Major, Minor   int    // compute capability
	Arch           string // NVRTC target, e.g. sm_90a
	SMs            int
	TotalMem       int64 // bytes
	L2Bytes        int
	MaxSharedOptIn int // bytes of shared memory a block may opt in to
	DriverVersion  int // e.g. 13000
	NVRTCMajor     int
	NVRTCMinor     int
}

func (i Info) String() string {
	return fmt.Sprintf("GPU %d: %s, compute capability %d.%d (%s), %d SMs, %s, %s",
		i.Ordinal, i.Name, i.Major, i.Minor, i.Arch, i.SMs, FormatBytes(i.TotalMem), i.Software())
}

// Software names the driver and NVRTC versions ("driver 13.0, NVRTC 13.0").
func (i Info) Software() string {
	return fmt.Sprintf("driver %d.%d, NVRTC %d.%d", i.DriverVersion/1000, i.DriverVersion%1000/10, i.NVRTCMajor, i.NVRTCMinor)
}

// work is one closure for the device thread; reply is nil for asynchronous
// work.
type work struct {
	f     func() error
	reply chan error
}

// Device owns one GPU: the locked OS thread, the primary context, one
// stream, a caching allocator and the kernels loaded so far. Its methods
// are safe for concurrent use.
type Device struct {
	rt   *Runtime
	drv  *driver.Driver
	info Info

	// mu guards closed; sends on queue hold it for reading, so nothing is
	// queued after the quit item.
	mu     sync.RWMutex
	closed bool
	queue  chan work
	exited chan struct{}

	// Set once on the device thread during Open, read-only after.
	dev    driver.Device
	ctx    driver.Context
	stream driver.Stream

	// Touched only on the device thread.
	asyncErr error
	staging  stagingRing // small uploads (staging.go)
	fetch    fetchPool   // queued downloads (fetch.go)

	mem *allocator

	modMu   sync.Mutex
	modules map[string]*Module // by file, and by the name of a test's build (Device.load)

	// ropeTabs are RoPE's cos/sin tables, by theta and head dim (rope.go).
	ropeMu   sync.Mutex
	ropeTabs map[ropeKey]*ropeTable

	// tmapEnc is cuTensorMapEncodeTiled, resolved on first use
	// (TensorMapEncoder).
	tmapOnce sync.Once
	tmapEnc  *driver.TensorMapEncoder
	tmapErr  error
}

// TensorMapEncoder is the driver's cuTensorMapEncodeTiled, resolved once
// per Device; drivers before CUDA 12.0 lack it (an error).
func (d *Device) TensorMapEncoder() (*driver.TensorMapEncoder, error) {
	d.tmapOnce.Do(func() { d.tmapEnc, d.tmapErr = d.drv.TensorMapEncoder() })
	return d.tmapEnc, d.tmapErr
}

// queueDepth bounds how far asynchronous work runs ahead of the device
// thread.
const queueDepth = 1024

// Open starts the device thread for GPU ordinal, retains its primary
// context, makes it current on that thread and creates a non-blocking
// stream.
func (r *Runtime) Open(ordinal int) (*Device, error) {
	n, err := r.drv.DeviceCount()
	if err != nil {
		return nil, err
	}
	if ordinal < 0 || ordinal >= n {
		return nil, fmt.Errorf("cuda: GPU %d asked for, but the driver sees %d", ordinal, n)
	}
	d := &Device{
		rt:      r,
		drv:     r.drv,
		queue:   make(chan work, queueDepth),
		exited:  make(chan struct{}),
		modules: map[string]*Module{},
	}
	ready := make(chan error, 1)
	go d.loop(ordinal, ready)
	if err := <-ready; err != nil {
		<-d.exited
		return nil, err
	}
	d.mem = newAllocator(deviceMemory{d}, d.info.String())
	return d, nil
}

// loop is the device thread.
func (d *Device) loop(ordinal int, ready chan<- error) {
	// Never unlocked: when this goroutine returns, its thread exits, and
	// the context binding with it.
	runtime.LockOSThread()
	defer close(d.exited)
	if err := d.setup(ordinal); err != nil {
		ready <- err
		return
	}
	ready <- nil
	for w := range d.queue {
		if w.f == nil { // quit
			return
		}
		err := w.f()
		if w.reply != nil {
			w.reply <- err
		} else if err != nil && d.asyncErr == nil {
			d.asyncErr = err
		}
	}
}

func (d *Device) setup(ordinal int) error {
	drv := d.drv
	dev, err := drv.DeviceGet(ordinal)
	if err != nil {
		return err
	}
	info := Info{Ordinal: ordinal}
	if info.Name, err = drv.DeviceName(dev); err != nil {
		return err
	}
	attrs := []struct {
		dst *int
		a   driver.DeviceAttribute
	}{
		{&info.Major, driver.AttrComputeCapabilityMajor},
		{&info.Minor, driver.AttrComputeCapabilityMinor},
		{&info.SMs, driver.AttrMultiprocessorCount},
		{&info.L2Bytes, driver.AttrL2CacheSize},
		{&info.MaxSharedOptIn, driver.AttrMaxSharedMemoryPerBlockIn},
	}
	for _, a := range attrs {
		if *a.dst, err = drv.DeviceAttribute(dev, a.a); err != nil {
			return err
		}
	}
	if info.TotalMem, err = drv.DeviceTotalMem(dev); err != nil {
		return err
	}
	if info.DriverVersion, err = drv.Version(); err != nil {
		return err
	}
	info.Arch = Arch(info.Major, info.Minor)
	info.NVRTCMajor, info.NVRTCMinor = d.rt.nvrtc.Version()
	ctx, err := drv.PrimaryCtxRetain(dev)
	if err != nil {
		return err
	}
	if err := drv.CtxSetCurrent(ctx); err != nil {
		drv.PrimaryCtxRelease(dev)
		return err
	}
	stream, err := drv.StreamCreate(driver.StreamNonBlocking)
	if err != nil {
		drv.PrimaryCtxRelease(dev)
		return err
	}
	d.dev, d.ctx, d.stream, d.info = dev, ctx, stream, info
	return nil
}

// Info describes the GPU.
func (d *Device) Info() Info { return d.info }

// Driver is the driver API. Calls that need the context must be made inside
// Do or Submit.
func (d *Device) Driver() *driver.Driver { return d.drv }

// Stream is the device's stream; all work is queued on it, in order.
func (d *Device) Stream() driver.Stream { return d.stream }

// Do runs f on the device thread and returns its error. f must not call
// the Device's own methods: they would wait for the thread f holds.
func (d *Device) Do(f func() error) error {
	reply := make(chan error, 1)
	if err := d.send(work{f: f, reply: reply}); err != nil {
		return err
	}
	return <-reply
}

// Submit queues f for the device thread and returns at once. An error from
// f is kept and returned by the next Sync.
func (d *Device) Submit(f func() error) error {
	return d.send(work{f: f})
}

func (d *Device) send(w work) error {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return ErrClosed
	}
	d.queue <- w
	return nil
}

// Sync waits for all queued work and all work on the stream, and returns
// the first error since the last Sync: from submitted closures, then from
// the stream (a faulting kernel, say).
func (d *Device) Sync() error {
	return d.Do(func() error {
		err := d.asyncErr
		d.asyncErr = nil
		if serr := d.drv.StreamSynchronize(d.stream); err == nil {
			err = serr
		}
		return err
	})
}

// Close waits for queued work, frees every buffer and module, destroys the
// stream, releases the primary context and stops the device thread.
// Buffers and kernels of the device must not be used afterwards.
func (d *Device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return ErrClosed
	}
	reply := make(chan error, 1)
	d.queue <- work{f: func() error { return d.teardown() }, reply: reply}
	d.queue <- work{} // quit
	d.closed = true
	d.mu.Unlock()
	err := <-reply
	<-d.exited
	return err
}

func (d *Device) teardown() error {
	errs := []error{d.drv.StreamSynchronize(d.stream)}
	errs = append(errs, d.staging.release(d.drv), d.fetch.release(d.drv), d.mem.releaseAll())
	d.modMu.Lock()
	for _, m := range d.modules {
		errs = append(errs, d.drv.ModuleUnload(m.mod))
	}
	d.modules = nil
	d.modMu.Unlock()
	errs = append(errs, d.drv.StreamDestroy(d.stream), d.drv.PrimaryCtxRelease(d.dev))
	return errors.Join(errs...)
}

// MemInfo is the driver's free and total memory of the GPU.
func (d *Device) MemInfo() (free, total int64, err error) {
	err = d.Do(func() error {
		var e error
		free, total, e = d.drv.MemGetInfo()
		return e
	})
	return free, total, err
}

// AllocHost allocates page-locked host memory, which copies to and from the
// GPU at the full bus rate. Free it with FreeHost.
func (d *Device) AllocHost(bytes int) ([]byte, error) {
	var b []byte
	err := d.Do(func() error {
		var e error
		b, e = d.drv.MemAllocHost(bytes)
		return e
	})
	return b, err
}

// FreeHost frees memory from AllocHost.
func (d *Device) FreeHost(b []byte) error {
	return d.Do(func() error { return d.drv.MemFreeHost(b) })
}

// CopyToDevice copies src into dst starting offset bytes into dst, after
// all work queued before it, and returns when the copy is done, so src may
// be reused at once (from page-locked memory, too).
func (d *Device) CopyToDevice(dst *Buffer, offset int64, src []byte) error {
	if err := dst.span("CopyToDevice", offset, int64(len(src))); err != nil || len(src) == 0 {
		return err
	}
	p := dst.ptr + driver.DevicePtr(offset)
	return d.Do(func() error {
		if err := d.drv.MemcpyHtoDAsync(p, unsafe.Pointer(&src[0]), len(src), d.stream); err != nil {
			return err
		}
		return d.drv.StreamSynchronize(d.stream)
	})
}

// StageToDevice queues a copy of src into dst, starting offset bytes into
// it, behind the work queued before it, and returns without waiting for
// the GPU; the caller may reuse src at once. Up to 64 KiB go through the
// device's page-locked staging slots (staging.go); more is handed to the
// driver, which copies pageable memory into its own staging buffers
// before the call returns. src must be ordinary (pageable) Go memory:
// page-locked memory from AllocHost would be read later, while the copy
// runs (use CopyToDevice for it). Errors of the copy come from the next
// Sync.
func (d *Device) StageToDevice(dst *Buffer, offset int64, src []byte) error {
	if err := dst.span("StageToDevice", offset, int64(len(src))); err != nil || len(src) == 0 {
		return err
	}
	p := dst.ptr + driver.DevicePtr(offset)
	if len(src) <= stagingSlotBytes {
		// A private copy lets the caller go on without a round trip to the
		// device thread (~25 us, measured), which a layer pays per upload.
		own := append([]byte(nil), src...)
		return d.Submit(func() error { return d.stage(p, own) })
	}
	return d.Do(func() error {
		return d.drv.MemcpyHtoDAsync(p, unsafe.Pointer(&src[0]), len(src), d.stream)
	})
}

// CopyFromDevice copies len(dst) bytes from src, starting offset bytes into
// it, after all work queued before it has run.
func (d *Device) CopyFromDevice(dst []byte, src *Buffer, offset int64) error {
	if err := src.span("CopyFromDevice", offset, int64(len(dst))); err != nil || len(dst) == 0 {
		return err
	}
	p := src.ptr + driver.DevicePtr(offset)
	return d.Do(func() error {
		if err := d.drv.MemcpyDtoHAsync(unsafe.Pointer(&dst[0]), p, len(dst), d.stream); err != nil {
			return err
		}
		// Into page-locked memory the copy is still running: wait.
		return d.drv.StreamSynchronize(d.stream)
	})
}

// CopyDevice queues a copy of bytes from src to dst (errors at Sync).
func (d *Device) CopyDevice(dst *Buffer, dstOff int64, src *Buffer, srcOff int64, bytes int64) error {
	if err := dst.span("CopyDevice", dstOff, bytes); err != nil {
		return err
	}
	if err := src.span("CopyDevice", srcOff, bytes); err != nil {
		return err
	}
	// Addresses are read now: the buffers may be freed before this runs.
	to, from := dst.ptr+driver.DevicePtr(dstOff), src.ptr+driver.DevicePtr(srcOff)
	return d.Submit(func() error {
		return d.drv.MemcpyDtoDAsync(to, from, int(bytes), d.stream)
	})
}

// Memset32 queues setting words 32-bit words of b, from word offset on, to
// v (errors at Sync).
func (d *Device) Memset32(b *Buffer, offset, words int64, v uint32) error {
	if err := b.span("Memset32", 4*offset, 4*words); err != nil {
		return err
	}
	p := b.ptr + driver.DevicePtr(4*offset)
	return d.Submit(func() error {
		return d.drv.MemsetD32Async(p, v, int(words), d.stream)
	})
}

// Memset8 queues setting bytes bytes of b, from byte offset on, to v
// (errors at Sync). Memset32 is faster where offset and length allow it.
func (d *Device) Memset8(b *Buffer, offset, bytes int64, v uint8) error {
	if err := b.span("Memset8", offset, bytes); err != nil {
		return err
	}
	p := b.ptr + driver.DevicePtr(offset)
	return d.Submit(func() error {
		return d.drv.MemsetD8Async(p, v, int(bytes), d.stream)
	})
}

// Event is a point on the device's stream, for timing.
type Event struct {
	d  *Device
	ev driver.Event
}

// NewEvent creates a timing event.
func (d *Device) NewEvent() (*Event, error) {
	e := &Event{d: d}
	err := d.Do(func() error {
		var err error
		e.ev, err = d.drv.EventCreate(0)
		return err
	})
	return e, err
}

// Record queues the event on the stream (errors at Sync).
func (e *Event) Record() error {
	return e.d.Submit(func() error { return e.d.drv.EventRecord(e.ev, e.d.stream) })
}

// Since waits for e and returns the milliseconds from start to e.
func (e *Event) Since(start *Event) (float64, error) {
	var ms float32
	err := e.d.Do(func() error {
		if err := e.d.drv.EventSynchronize(e.ev); err != nil {
			return err
		}
		var err error
		ms, err = e.d.drv.EventElapsed(start.ev, e.ev)
		return err
	})
	return float64(ms), err
}

// Destroy frees the event.
func (e *Event) Destroy() error {
	return e.d.Do(func() error { return e.d.drv.EventDestroy(e.ev) })
}

// Bytes views a slice of plain values (float32, int32, uint16, ...) as
// bytes, for the copy calls. It does not copy.
func Bytes[T any](s []T) []byte {
	if len(s) == 0 {
		return nil
	}
	var zero T
	return unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), len(s)*int(unsafe.Sizeof(zero)))
}
