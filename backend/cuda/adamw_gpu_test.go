package cuda

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// TestAdamWUpdateSquares: the updates that also sum the gradient's squares
// (backend.SquaringOptimizer) leave the weights and moments bit for bit as
// the plain updates do, and their sum is SumSquares' up to the order of
// the adds; on 16-byte aligned tensors (adamw_f32_x4), an offset view
// (adamw_f32) and split masters; twice, for the same bits again.
func TestAdamWUpdateSquares(t *testing.T) {
	b := testBackend(t)
	rng := rand.New(rand.NewPCG(31, 7))
	const n = 300_002 // not a multiple of four: the vector kernel's tail runs
	host := func(scale float64) []float32 {
		x := make([]float32, n+1)
		for i := range x {
			x[i] = float32(rng.NormFloat64() * scale)
		}
		return x
	}
	w, g, m, v := host(0.02), host(1e-3), host(1e-4), host(1e-6)
	for i := range v {
		v[i] = float32(math.Abs(float64(v[i])))
	}
	up := func(x []float32) backend.Tensor {
		t := b.New(backend.Float32, len(x))
		backend.UploadSlice(b, t, x)
		return t
	}
	h := backend.AdamW{LR: 3e-4, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01, Step: 3}
	for _, c := range []struct {
		name   string
		offset int
	}{{"aligned", 0}, {"offset", 1}} {
		t.Run(c.name, func(t *testing.T) {
			view := func(x backend.Tensor) backend.Tensor { return b.View(x, c.offset, n) }
			pA, gA, mA, vA := up(w), up(g), up(m), up(v)
			pB, gB, mB, vB := up(w), up(g), up(m), up(v)
			b.AdamWUpdate(view(pA), view(gA), view(mA), view(vA), h)
			want := b.SumSquares(view(gA))
			var sums [2]float64
			for i := range sums {
				if i == 1 { // the same update again from the same state
					pB, mB, vB = up(w), up(m), up(v)
				}
				sums[i] = b.AdamWUpdateSquares(view(pB), view(gB), view(mB), view(vB), h)()
			}
			if err := b.Sync(); err != nil {
				t.Fatal(err)
			}
			for _, pair := range [][2]backend.Tensor{{pA, pB}, {mA, mB}, {vA, vB}} {
				sameUpdate(t, backend.DownloadFloat32(b, pair[0]), backend.DownloadFloat32(b, pair[1]))
			}
			if sums[0] != sums[1] {
				t.Errorf("the squares came to %v, then %v: want the same bits", sums[0], sums[1])
			}
			if math.Abs(sums[0]-want) > 1e-12*want {
				t.Errorf("the squares came to %v, SumSquares to %v", sums[0], want)
			}
		})
	}
	t.Run("split", func(t *testing.T) {
		const pairs = n / 2
		hiHost, loHost := backend.SplitMasters(w[:n])
		mk := func() (backend.Tensor, backend.Tensor) {
			hi, lo := b.New(backend.BFloat16, n), b.New(backend.Int32, pairs)
			backend.UploadSlice(b, hi, hiHost) // bf16 values already: no rounding
			backend.UploadSlice(b, lo, loHost)
			return hi, lo
		}
		hiA, loA := mk()
		hiB, loB := mk()
		gT, mA, vA, mB, vB := up(g[:n]), up(m[:n]), up(v[:n]), up(m[:n]), up(v[:n])
		b.AdamWUpdateSplit(hiA, loA, gT, mA, vA, h)
		sum := b.AdamWUpdateSplitSquares(hiB, loB, gT, mB, vB, h)()
		want := b.SumSquares(gT)
		if err := b.Sync(); err != nil {
			t.Fatal(err)
		}
		for _, pair := range [][2]backend.Tensor{{mA, mB}, {vA, vB}} {
			sameUpdate(t, backend.DownloadFloat32(b, pair[0]), backend.DownloadFloat32(b, pair[1]))
		}
		sameUpdate(t, backend.DownloadFloat32(b, hiA), backend.DownloadFloat32(b, hiB))
		lA, lB := backend.DownloadInt32(b, loA), backend.DownloadInt32(b, loB)
		for i := range lA {
			if lA[i] != lB[i] {
				t.Fatalf("lo word %d: %x with the squares, %x without", i, lB[i], lA[i])
			}
		}
		if math.Abs(sum-want) > 1e-12*want {
			t.Errorf("the squares came to %v, SumSquares to %v", sum, want)
		}
	})
}

// sameUpdate fails t unless got and want hold the same float32 bits.
func sameUpdate(t *testing.T, want, got []float32) {
	t.Helper()
	for i := range want {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Fatalf("element %d: %x with the squares, %x without", i, math.Float32bits(got[i]), math.Float32bits(want[i]))
		}
	}
}
