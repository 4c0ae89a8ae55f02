package cuda

// The conformance suite (backend/backendtest) on the GPU: every op of the
// Backend against the float64 CPU backend, at the Backend's precision
// (RelTolerance, bf16-level because MatMul multiplies in bf16).

import (
	"sync"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/backendtest"
	"github.com/mktrain/mktrain/backend/cpu"
)

// testB is the Backend the tests share, made on first use on the shared
// device (a Backend holds a Gemm with its workspace; one is enough).
var testB struct {
	once sync.Once
	b    *Backend
	err  error
}

// testBackend returns the shared Backend or skips.
func testBackend(t *testing.T) *Backend {
	t.Helper()
	d := testDevice(t)
	testB.once.Do(func() { testB.b, testB.err = NewBackend(d) })
	if testB.err != nil {
		t.Fatal(testB.err)
	}
	return testB.b
}

func TestConformance(t *testing.T) {
	b := testBackend(t)
	backendtest.RunAll(t, b, cpu.New(backend.Float64))
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
}
