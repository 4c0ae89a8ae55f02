// Package cpu is the plain-Go reference backend. It computes in float32 (the
// training default on a laptop) or float64 (finite-difference gradient
// checks): every op is a generic function over Float, instantiated for the
// backend's FloatType. Storage is plain Go slices; views share their
// backing slices; data enters and leaves as gorgonia.org/tensor dense
// tensors (Upload, Download), whose values are read through
// backend.HostData.
//
// This backend is the oracle the project trusts: its ops are checked against
// central finite differences in float64 (backend/backendtest), and every
// other backend is compared with it.
package cpu

import (
	"fmt"
	"runtime"
	"sync"

	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/backend"
)

// Float is the element type the generic kernels are written for.
type Float interface{ ~float32 | ~float64 }

// Tensor is the CPU backend's tensor: a typed slice (or a view into another
// Tensor's slice) and a shape. A BFloat16
// tensor uses the slice of its backend's float type (bf16.go).
type Tensor struct {
	shape []int
	dt    backend.DType
	f32   []float32
	f64   []float64
	i32   []int32
}

func (t *Tensor) Shape() []int         { return t.shape }
func (t *Tensor) DType() backend.DType { return t.dt }
func (t *Tensor) Len() int             { return numel(t.shape) }

// Float32s, Float64s and Int32s expose the backing slice to code that lives
// on the host anyway (in-process communicators, tests). They panic on the
// wrong dtype.
func (t *Tensor) Float32s() []float32 { t.must(backend.Float32); return t.f32 }
func (t *Tensor) Float64s() []float64 { t.must(backend.Float64); return t.f64 }
func (t *Tensor) Int32s() []int32     { t.must(backend.Int32); return t.i32 }

func (t *Tensor) must(dt backend.DType) {
	if t.dt != dt {
		panic(fmt.Sprintf("cpu: tensor is %v, not %v", t.dt, dt))
	}
}

// Backend is the CPU backend. It is stateless apart from its float type,
// worker count and the error kept for the next Sync, so one Backend may be
// shared by many goroutines (virtual ranks).
type Backend struct {
	dt      backend.DType
	workers int
	mu      sync.Mutex
	err     error // the first reported since the last Sync (report)
	// scatterMu serialises the adds ops make into the peers' tensors:
	// MatMulScatter's atomic landings, ZigzagAttentionBackward's dq shares.
	scatterMu sync.Mutex
}

// New returns a CPU backend computing in dt (backend.Float32 or
// backend.Float64). Kernels split large loops over GOMAXPROCS goroutines.
func New(dt backend.DType) *Backend {
	if dt != backend.Float32 && dt != backend.Float64 {
		panic(fmt.Sprintf("cpu: float type must be float32 or float64, not %v", dt))
	}
	return &Backend{dt: dt, workers: runtime.GOMAXPROCS(0)}
}

// SetWorkers bounds the goroutines one op may use (at least 1). Virtual ranks
// running side by side each use fewer.
func (b *Backend) SetWorkers(n int) {
	if n < 1 {
		n = 1
	}
	b.workers = n
}

func (b *Backend) Name() string             { return "cpu" }
func (b *Backend) FloatType() backend.DType { return b.dt }

// Sync returns the first error an op reported since the last Sync (ops
// run when called, so there is nothing to wait for). Argument errors
// panic at the call instead; only the state of shared data that an op
// finds wrong, such as a combine's flag that was never raised, waits for
// Sync, as it would on a device.
func (b *Backend) Sync() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	err := b.err
	b.err = nil
	return err
}

// report keeps err for the next Sync unless an earlier error waits.
func (b *Backend) report(err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.err == nil {
		b.err = err
	}
}

func numel(shape []int) int {
	n := 1
	for _, s := range shape {
		n *= s
	}
	return n
}

func (b *Backend) New(dt backend.DType, shape ...int) backend.Tensor {
	n := numel(shape)
	t := &Tensor{shape: append([]int(nil), shape...), dt: dt}
	store := dt
	if dt == backend.BFloat16 {
		store = b.dt
	}
	// Plain Go slices, never nil (an empty tensor's too: which slice is
	// set tells the stores apart). Not gorgonia's dense tensors, whose
	// Data hands out their memory through a uintptr (backend.HostData).
	switch store {
	case backend.Float32:
		t.f32 = make([]float32, n)
	case backend.Float64:
		t.f64 = make([]float64, n)
	case backend.Int32:
		t.i32 = make([]int32, n)
	default:
		panic(fmt.Sprintf("cpu: cannot allocate dtype %v", dt))
	}
	return t
}

func (b *Backend) View(t backend.Tensor, offset int, shape ...int) backend.Tensor {
	src := t.(*Tensor)
	n := numel(shape)
	if offset < 0 || offset+n > src.Len() {
		panic(fmt.Sprintf("cpu: view [%d, %d) outside tensor of %d elements", offset, offset+n, src.Len()))
	}
	// Exactly one slice is set (a BFloat16 tensor's is f32 or f64).
	v := &Tensor{shape: append([]int(nil), shape...), dt: src.dt}
	switch {
	case src.f32 != nil:
		v.f32 = src.f32[offset : offset+n : offset+n]
	case src.f64 != nil:
		v.f64 = src.f64[offset : offset+n : offset+n]
	default:
		v.i32 = src.i32[offset : offset+n : offset+n]
	}
	return v
}

func (b *Backend) Upload(dst backend.Tensor, src *tensor.Dense) {
	d := dst.(*Tensor)
	if src.Size() != d.Len() {
		panic(fmt.Sprintf("cpu: upload of %d elements into tensor of %d", src.Size(), d.Len()))
	}
	if d.dt == backend.BFloat16 {
		b.uploadBF16(d, src)
		return
	}
	switch s := backend.HostData(src).(type) {
	case []float32:
		switch d.dt {
		case backend.Float32:
			copy(d.f32, s)
		case backend.Float64:
			for i, v := range s {
				d.f64[i] = float64(v)
			}
		default:
			panic("cpu: upload of float32 data into " + d.dt.String())
		}
	case []float64:
		switch d.dt {
		case backend.Float32:
			for i, v := range s {
				d.f32[i] = float32(v)
			}
		case backend.Float64:
			copy(d.f64, s)
		default:
			panic("cpu: upload of float64 data into " + d.dt.String())
		}
	case []int32:
		d.must(backend.Int32)
		copy(d.i32, s)
	default:
		panic(fmt.Sprintf("cpu: cannot upload %T", s))
	}
}

func (b *Backend) Download(t backend.Tensor) *tensor.Dense {
	s := t.(*Tensor)
	shape := s.shape
	if len(shape) == 0 {
		shape = []int{1}
	}
	switch s.dt {
	case backend.BFloat16:
		// float32 holds bf16 values exactly; the float64 store's too.
		f := make([]float32, len(s.f32)+len(s.f64))
		copy(f, s.f32)
		for i, v := range s.f64 {
			f[i] = float32(v)
		}
		return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(f))
	case backend.Float32:
		return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(append([]float32(nil), s.f32...)))
	case backend.Float64:
		return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(append([]float64(nil), s.f64...)))
	default:
		return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(append([]int32(nil), s.i32...)))
	}
}

// floats returns t's backing slice as []T; T must match t's dtype, or be
// the storage of a BFloat16 tensor.
func floats[T Float](t backend.Tensor) []T {
	if t == nil {
		return nil
	}
	ct := t.(*Tensor)
	var zero T
	switch any(zero).(type) {
	case float32:
		if ct.dt != backend.BFloat16 || ct.f32 == nil {
			ct.must(backend.Float32)
		}
		return any(ct.f32).([]T)
	default:
		if ct.dt != backend.BFloat16 || ct.f64 == nil {
			ct.must(backend.Float64)
		}
		return any(ct.f64).([]T)
	}
}

// ints returns an Int32 tensor's backing slice (nil for a nil tensor).
func ints(t backend.Tensor) []int32 {
	if t == nil {
		return nil
	}
	return t.(*Tensor).Int32s()
}

// parallelFor runs body over [0, n) split into contiguous chunks, one per
// worker. Small loops run inline.
func (b *Backend) parallelFor(n, minChunk int, body func(lo, hi int)) {
	w := b.workers
	if w <= 1 || n < 2*minChunk {
		body(0, n)
		return
	}
	if w > n/minChunk {
		w = n / minChunk
	}
	var wg sync.WaitGroup
	chunk := (n + w - 1) / w
	for lo := 0; lo < n; lo += chunk {
		hi := min(lo+chunk, n)
		wg.Add(1)
		go func() { defer wg.Done(); body(lo, hi) }()
	}
	wg.Wait()
}

// StartDownload downloads t now: the CPU has no queue to keep going.
func (b *Backend) StartDownload(t backend.Tensor) backend.PendingDownload {
	d := b.Download(t)
	return func() *tensor.Dense { return d }
}
