package cuda

import (
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// TestStagedUploads queues many more small uploads than there are staging
// slots, each of different values and with a kernel between them, reuses
// the host slice at once after each, and then reads everything back: a
// slot reused before its copy ran, or a copy that read the caller's slice
// late, shows as a wrong value. One upload over the slot size takes the
// driver's path.
func TestStagedUploads(t *testing.T) {
	b := testBackend(t)
	const n = 5 * stagingSlots
	src := make([]float32, 1000)
	ts := make([]backend.Tensor, n)
	for i := range ts {
		for j := range src {
			src[j] = float32(i*1000 + j)
		}
		ts[i] = b.New(backend.Float32, len(src))
		backend.UploadSlice(b, ts[i], src)
		b.Scale(ts[i], 2) // a kernel behind each copy
	}
	big := make([]float32, stagingSlotBytes) // 4x the slot size in bytes
	for j := range big {
		big[j] = float32(j)
	}
	bigT := b.New(backend.Float32, len(big))
	backend.UploadSlice(b, bigT, big)
	for j := range big {
		big[j] = -1 // reused at once
	}
	for i, tt := range ts {
		got := backend.DownloadFloat32(b, tt)
		for j, v := range got {
			if want := 2 * float32(i*1000+j); v != want {
				t.Fatalf("upload %d element %d: %v, want %v", i, j, v, want)
			}
		}
	}
	for j, v := range backend.DownloadFloat32(b, bigT) {
		if v != float32(j) {
			t.Fatalf("large upload element %d: %v", j, v)
		}
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
}
