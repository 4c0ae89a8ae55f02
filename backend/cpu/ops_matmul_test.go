package cpu

import (
	"math/rand/v2"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// BenchmarkMatMul times a 512x512x512 float32 product in each layout.
func BenchmarkMatMul(bm *testing.B) {
	const n = 512
	for _, l := range []struct {
		name           string
		transA, transB bool
	}{{"NN", false, false}, {"NT", false, true}, {"TN", true, false}, {"TT", true, true}} {
		bm.Run(l.name, func(bm *testing.B) {
			b := New(backend.Float32)
			rng := rand.New(rand.NewPCG(1, 2))
			x, y, out := b.New(backend.Float32, n, n), b.New(backend.Float32, n, n), b.New(backend.Float32, n, n)
			for _, t := range []backend.Tensor{x, y} {
				for i := range floats[float32](t) {
					floats[float32](t)[i] = rng.Float32()
				}
			}
			for bm.Loop() {
				b.MatMul(out, x, y, l.transA, l.transB, 1, 0)
			}
			bm.ReportMetric(2*n*n*n*float64(bm.N)/bm.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
	}
}
