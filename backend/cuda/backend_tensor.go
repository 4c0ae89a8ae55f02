package cuda

// Tensors and their memory. A Tensor is a window (element offset, shape,
// dtype) on a storage: one Buffer from the device's caching allocator. New
// makes a storage; View makes another window on the same one.
//
// Memory is given back when the garbage collector finds a storage
// unreachable (runtime.AddCleanup): no Tensor or view refers to it any
// more. The cleanup calls Device.Free, which is stream-ordered: the block
// joins the free list only after every piece of work queued before the Free,
// so a kernel queued while the tensor was alive still reads valid memory,
// and only work queued later can be handed the block. The one gap is
// between reading a tensor's address and queuing the launch that uses it;
// Backend.launch keeps its tensors alive across that (runtime.KeepAlive).
//
// The collector sees only the small Go objects, not the device memory behind
// them, so it does not run on its own account of GPU memory. The engine
// allocates its tensors once, which suits this; when an allocation fails,
// New runs the collector, waits for the cleanups it frees to reach the
// device, and tries once more before reporting the failure.

import (
	"errors"
	"fmt"
	"runtime"
	"time"

	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// dtypeBytes is the size in bytes of an element of dt: 2 for BFloat16
// (stored as its 16 bits), 4 for float32 and int32.
func dtypeBytes(dt backend.DType) int {
	if dt == backend.BFloat16 {
		return 2
	}
	return 4
}

// storage owns one device allocation shared by a tensor and its views. buf
// is nil when the allocation failed (the error waits for Sync).
type storage struct {
	buf *Buffer
}

// Tensor is the CUDA backend's tensor.
type Tensor struct {
	st    *storage
	off   int // elements into st.buf
	shape []int
	dt    backend.DType
}

func (t *Tensor) Shape() []int         { return t.shape }
func (t *Tensor) DType() backend.DType { return t.dt }
func (t *Tensor) Len() int             { return numel(t.shape) }

// Ptr is the device address of t's first element, for kernels outside this
// package; 0 if t's allocation failed. It stays valid while t (or a view
// sharing its memory) is reachable: keep t alive until the work that uses
// the address is queued (runtime.KeepAlive).
func (t *Tensor) Ptr() driver.DevicePtr {
	p, _ := t.ptr()
	return p
}

func (t *Tensor) ptr() (driver.DevicePtr, bool) {
	if t.st.buf == nil {
		return 0, false
	}
	return t.st.buf.Ptr() + driver.DevicePtr(dtypeBytes(t.dt)*t.off), true
}

func numel(shape []int) int {
	n := 1
	for _, s := range shape {
		n *= s
	}
	return n
}

// checkDType panics on dtypes the GPU does not store.
func checkDType(op string, dt backend.DType) {
	switch dt {
	case backend.Float32, backend.Int32, backend.BFloat16:
	case backend.Float64:
		panic(fmt.Sprintf("cuda.%s: float64 tensors are not supported on the GPU; the CUDA backend computes in float32 (use backend/cpu with Float64 for gradient checks)", op))
	default:
		panic(fmt.Sprintf("cuda.%s: cannot store dtype %v", op, dt))
	}
}

// New allocates a zeroed tensor. When the GPU cannot hold it the returned
// tensor has no memory, ops on it do nothing, and the next Sync returns the
// *OutOfMemoryError.
func (b *Backend) New(dt backend.DType, shape ...int) backend.Tensor {
	checkDType("New", dt)
	for _, s := range shape {
		if s < 0 {
			panic(fmt.Sprintf("cuda.New: negative dimension in shape %v", shape))
		}
	}
	n := numel(shape)
	t := &Tensor{st: &storage{}, shape: append([]int(nil), shape...), dt: dt}
	buf, err := b.alloc(int64(dtypeBytes(dt) * n))
	if err != nil {
		b.fail(err)
		return t
	}
	t.st.buf = buf
	d := b.dev
	runtime.AddCleanup(t.st, func(buf *Buffer) { d.Free(buf) }, buf)
	b.zero(t)
	return t
}

// alloc is Device.Alloc with one retry after a garbage collection when the
// GPU is full: unreachable tensors may hold the memory asked for.
func (b *Backend) alloc(bytes int64) (*Buffer, error) {
	buf, err := b.dev.Alloc(bytes)
	var oom *OutOfMemoryError
	if !errors.As(err, &oom) {
		return buf, err
	}
	runtime.GC()
	// Cleanups run on their own goroutine after the collection; give them
	// a moment, then a round trip through the device queue moves the
	// blocks they freed into the cache.
	time.Sleep(20 * time.Millisecond)
	if err := b.dev.Do(func() error { return nil }); err != nil {
		return nil, err
	}
	return b.dev.Alloc(bytes)
}

// tensorOf returns t as a CUDA tensor (nil for nil) and panics on a tensor
// of another backend.
func tensorOf(op, name string, t backend.Tensor) *Tensor {
	if t == nil {
		return nil
	}
	ct, ok := t.(*Tensor)
	if !ok {
		panic(fmt.Sprintf("cuda.%s: %s is a %T, not a tensor of the CUDA backend", op, name, t))
	}
	return ct
}

// View returns a tensor sharing t's memory, offset elements in.
func (b *Backend) View(t backend.Tensor, offset int, shape ...int) backend.Tensor {
	src := tensorOf("View", "t", t)
	if src == nil {
		panic("cuda.View: tensor is nil")
	}
	n := numel(shape)
	if offset < 0 || n < 0 || offset+n > src.Len() {
		panic(fmt.Sprintf("cuda.View: view [%d, %d) outside tensor of %d elements", offset, offset+n, src.Len()))
	}
	return &Tensor{st: src.st, off: src.off + offset, shape: append([]int(nil), shape...), dt: src.dt}
}

// Upload copies host data into dst and returns when the copy is done.
// Float data ([]float32 or []float64) goes into a float32 tensor, or a
// bfloat16 one (rounded to nearest even on the host), []int32 into an
// int32 one.
func (b *Backend) Upload(dst backend.Tensor, src *tensor.Dense) {
	d := tensorOf("Upload", "dst", dst)
	if d == nil {
		panic("cuda.Upload: dst is nil")
	}
	if src.Size() != d.Len() {
		panic(fmt.Sprintf("cuda.Upload: upload of %d elements into tensor of %d", src.Size(), d.Len()))
	}
	n := d.Len()
	var bytes []byte
	switch s := backend.HostData(src).(type) {
	case []float32:
		if d.dt == backend.BFloat16 {
			bytes = Bytes(bf16Slice(s[:n]))
			break
		}
		d.must("Upload", backend.Float32, "float32 data")
		bytes = Bytes(s[:n])
	case []float64:
		if d.dt != backend.BFloat16 {
			d.must("Upload", backend.Float32, "float64 data")
		}
		f := make([]float32, n)
		for i, v := range s[:n] {
			f[i] = float32(v)
		}
		bytes = Bytes(f)
		if d.dt == backend.BFloat16 {
			bytes = Bytes(bf16Slice(f))
		}
	case []int32:
		d.must("Upload", backend.Int32, "int32 data")
		bytes = Bytes(s[:n])
	default:
		panic(fmt.Sprintf("cuda.Upload: cannot upload %T", s))
	}
	if n == 0 || d.st.buf == nil {
		return
	}
	// The data is Go memory: staged by the driver, so no wait for the GPU
	// (an upload between two kernels of a step does not drain the queue).
	b.fail(b.dev.StageToDevice(d.st.buf, int64(dtypeBytes(d.dt)*d.off), bytes))
	runtime.KeepAlive(d)
}

// must panics unless t has dtype dt.
func (t *Tensor) must(op string, dt backend.DType, what string) {
	if t.dt != dt {
		panic(fmt.Sprintf("cuda.%s: %s into a %v tensor", op, what, t.dt))
	}
}

// Download copies t to a new host tensor of t's dtype and shape, after the
// work queued before it; a bfloat16 tensor comes back as float32 (exact).
// If the copy fails, the host tensor holds zeros and the error waits for
// Sync.
func (b *Backend) Download(t backend.Tensor) *tensor.Dense {
	s := tensorOf("Download", "t", t)
	if s == nil {
		panic("cuda.Download: tensor is nil")
	}
	bytes, finish := hostCopy(s)
	if len(bytes) > 0 && s.st.buf != nil {
		b.fail(b.dev.CopyFromDevice(bytes, s.st.buf, int64(dtypeBytes(s.dt)*s.off)))
	}
	runtime.KeepAlive(s)
	return finish()
}

// StartDownload queues t's copy to the host behind the work queued so far
// (Device.StartCopyFromDevice) and returns its wait; a tensor larger than
// a slot is downloaded at once.
func (b *Backend) StartDownload(t backend.Tensor) backend.PendingDownload {
	s := tensorOf("StartDownload", "t", t)
	if s == nil {
		panic("cuda.StartDownload: tensor is nil")
	}
	bytes, finish := hostCopy(s)
	if len(bytes) == 0 || len(bytes) > fetchSlotBytes || s.st.buf == nil {
		d := b.Download(t)
		return func() *tensor.Dense { return d }
	}
	wait, err := b.dev.StartCopyFromDevice(s.st.buf, int64(dtypeBytes(s.dt)*s.off), len(bytes))
	if err != nil {
		b.fail(err)
		d := b.Download(t)
		return func() *tensor.Dense { return d }
	}
	// The buffer stays alive until the copy is done: the wait holds s.
	return func() *tensor.Dense {
		b.fail(wait(bytes))
		runtime.KeepAlive(s)
		return finish()
	}
}

// hostCopy returns the host bytes a download of s is copied into and the
// function that makes the downloaded tensor of them: of s's dtype and
// shape, bf16 widened to float32 (which holds it exactly).
func hostCopy(s *Tensor) (bytes []byte, finish func() *tensor.Dense) {
	shape := s.shape
	if len(shape) == 0 {
		shape = []int{1}
	}
	n := s.Len()
	var backing any
	var bits []uint16
	switch s.dt {
	case backend.Float32:
		f := make([]float32, max(n, 1))[:n]
		backing, bytes = f, Bytes(f)
	case backend.BFloat16:
		bits = make([]uint16, n)
		bytes = Bytes(bits)
	default:
		i := make([]int32, max(n, 1))[:n]
		backing, bytes = i, Bytes(i)
	}
	return bytes, func() *tensor.Dense {
		if s.dt == backend.BFloat16 {
			f := make([]float32, max(n, 1))[:n]
			for i, h := range bits {
				f[i] = bf16Value(h)
			}
			backing = f
		}
		return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(backing))
	}
}
