package cuda

import "testing"

// TestProfilerAPI starts and stops the profiler's capture range around a
// little work; without a profiler attached both calls succeed and do
// nothing.
func TestProfilerAPI(t *testing.T) {
	d := testDevice(t)
	b := &Backend{dev: d}
	if err := b.StartProfiler(); err != nil {
		t.Fatal(err)
	}
	buf, err := d.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Free(buf); err != nil {
		t.Fatal(err)
	}
	if err := b.StopProfiler(); err != nil {
		t.Fatal(err)
	}
}
