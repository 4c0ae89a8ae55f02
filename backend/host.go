package backend

import (
	"fmt"
	"runtime"

	"gorgonia.org/tensor"
)

// Host-side helpers over Upload and Download for code that holds plain
// slices (initialisation, batches, checkpoints, routing plans).

// HostData is d.Data(), the dense tensor's values as a slice ([]float32,
// []float64, []int32), with d kept alive until that slice exists.
// gorgonia.org/tensor's Data builds the slice from the address of d's
// memory held as a uintptr, which keeps nothing alive: called on a dense
// tensor nothing else references (a Download's result, say), a garbage
// collection inside the call could free the memory the slice is about to
// point to, and a later allocation would then share it (wrong values, or
// the runtime's "found bad pointer in Go heap"). Call Data through this.
func HostData(d *tensor.Dense) any {
	v := d.Data() // the one direct call (TestDenseDataGoesThroughHostData)
	runtime.KeepAlive(d)
	return v
}

// UploadSlice copies a host slice ([]float32, []float64 or []int32) into t,
// which must have its length.
func UploadSlice[T float32 | float64 | int32](b Backend, t Tensor, host []T) {
	b.Upload(t, tensor.New(tensor.WithShape(len(host)), tensor.WithBacking(host)))
}

// DownloadFloat32 copies a float tensor to a new float32 slice.
func DownloadFloat32(b Backend, t Tensor) []float32 {
	switch d := HostData(b.Download(t)).(type) {
	case []float32:
		return d
	case []float64:
		out := make([]float32, len(d))
		for i, v := range d {
			out[i] = float32(v)
		}
		return out
	default:
		panic(fmt.Sprintf("backend: DownloadFloat32 of a %v tensor", t.DType()))
	}
}

// DownloadFloat64 copies a float tensor to a new float64 slice.
func DownloadFloat64(b Backend, t Tensor) []float64 {
	return float64s(b.Download(t), t.DType())
}

// StartDownloadFloat64 is DownloadFloat64 without the wait
// (Backend.StartDownload): the copy is queued behind the work queued so
// far, and calling the result, once, waits for it alone.
func StartDownloadFloat64(b Backend, t Tensor) func() []float64 {
	pending, dt := b.StartDownload(t), t.DType()
	return func() []float64 { return float64s(pending(), dt) }
}

// float64s is a downloaded float tensor's data as float64; dt, the
// tensor's dtype, names it in the panic for any other data.
func float64s(d *tensor.Dense, dt DType) []float64 {
	switch d := HostData(d).(type) {
	case []float64:
		return d
	case []float32:
		out := make([]float64, len(d))
		for i, v := range d {
			out[i] = float64(v)
		}
		return out
	default:
		panic(fmt.Sprintf("backend: DownloadFloat64 of a %v tensor", dt))
	}
}

// DownloadInt32 copies an Int32 tensor to a new slice.
func DownloadInt32(b Backend, t Tensor) []int32 {
	d, ok := HostData(b.Download(t)).([]int32)
	if !ok {
		panic(fmt.Sprintf("backend: DownloadInt32 of a %v tensor", t.DType()))
	}
	return d
}
