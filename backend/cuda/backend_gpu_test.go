package cuda

// The Backend's own behaviour on the GPU, beyond the conformance suite:
// failed allocations surface at Sync, memory comes back when tensors are
// collected, and the dtypes the GPU does not store panic.

import (
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
)

func TestBackendOutOfMemoryIsSticky(t *testing.T) {
	b := testBackend(t)
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	huge := b.New(backend.Float32, 1<<24, 1<<24) // 1 PiB
	if huge.Len() != 1<<48 {
		t.Fatalf("shape lost: %v", huge.Shape())
	}
	// Ops on it do nothing; the failure waits for Sync.
	b.Zero(huge)
	small := b.New(backend.Float32, 4)
	b.Scale(b.View(huge, 0, 4), 2)
	b.Copy(small, b.View(huge, 8, 4))
	var oom *OutOfMemoryError
	if err := b.Sync(); !errors.As(err, &oom) {
		t.Fatalf("Sync after a 1 PiB tensor: %v, want *OutOfMemoryError", err)
	}
	if err := b.Sync(); err != nil {
		t.Fatalf("the error was not cleared by the Sync that returned it: %v", err)
	}
	backend.UploadSlice(b, small, []float32{1, 2, 3, 4})
	b.Scale(small, 0.5)
	if got := backend.DownloadFloat32(b, small); got[3] != 2 {
		t.Fatalf("the backend does not work after an OOM: %v", got)
	}
}

func TestBackendFreesCollectedTensors(t *testing.T) {
	b := testBackend(t)
	d := b.Device()
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	// Let garbage from earlier tests go first.
	runtime.GC()
	time.Sleep(50 * time.Millisecond)
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	before := d.AllocStats().Live
	for range 100 {
		x := b.New(backend.Float32, 1000)
		b.Scale(b.View(x, 10, 20), 3) // a view keeps the storage, then dies with it
	}
	// Cleanups run on their own goroutine after a collection.
	deadline := time.Now().Add(5 * time.Second)
	for {
		runtime.GC()
		if err := b.Sync(); err != nil {
			t.Fatal(err)
		}
		if d.AllocStats().Live <= before || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if live := d.AllocStats().Live; live > before {
		t.Errorf("%d live buffers after the tensors died, %d before", live, before)
	}
}

func TestBackendRefusesFloat64(t *testing.T) {
	b := testBackend(t)
	defer func() {
		p := recover()
		if p == nil || !strings.Contains(p.(string), "float64 tensors are not supported on the GPU") {
			t.Errorf("New(Float64) panicked with %v", p)
		}
	}()
	b.New(backend.Float64, 3)
}

func TestBackendUploadDownloadViews(t *testing.T) {
	b := testBackend(t)
	x := b.New(backend.Float32, 4, 5)
	if got := backend.DownloadFloat32(b, x); got[0] != 0 || got[19] != 0 {
		t.Fatalf("New is not zeroed: %v", got)
	}
	backend.UploadSlice(b, b.View(x, 6, 2, 3), []float64{1, 2, 3, 4, 5, 6.5})
	got := backend.DownloadFloat32(b, x)
	for i, v := range got {
		want := float32(0)
		if i >= 6 && i < 12 {
			want = []float32{1, 2, 3, 4, 5, 6.5}[i-6]
		}
		if v != want {
			t.Fatalf("element %d = %v, want %v (all %v)", i, v, want, got)
		}
	}
	ids := b.New(backend.Int32, 3)
	backend.UploadSlice(b, ids, []int32{-4, 0, 1 << 30})
	if got := backend.DownloadInt32(b, b.View(ids, 1, 2)); got[0] != 0 || got[1] != 1<<30 {
		t.Fatalf("int32 view: %v", got)
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
}

// TestSumSquaresLater: reductions queued with SumSquaresLater and read
// after more work has been queued give SumSquares' bits, each read once
// (its partials' buffer goes back to the allocator).
func TestSumSquaresLater(t *testing.T) {
	b := testBackend(t)
	xs := make([]backend.Tensor, 3)
	want := make([]float64, len(xs))
	later := make([]func() float64, len(xs))
	for i := range xs {
		host := make([]float32, 100003*(i+1))
		for j := range host {
			host[j] = float32(j%97) * 0.01 * float32(i+1)
		}
		xs[i] = b.New(backend.Float32, len(host))
		backend.UploadSlice(b, xs[i], host)
		want[i] = b.SumSquares(xs[i])
		later[i] = b.SumSquaresLater(xs[i])
		b.Scale(xs[i], 2) // queued after the reduction: it must not see it
	}
	for i, f := range later {
		if got := f(); got != want[i] {
			t.Errorf("tensor %d: SumSquaresLater %.17g, SumSquares %.17g", i, got, want[i])
		}
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
}
