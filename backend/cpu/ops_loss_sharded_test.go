package cpu_test

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
)

// The sharded cross-entropy over R slices of the vocabulary, joined as the
// LM head joins them (the slices' log-sum-exps gathered, the target logits
// summed), gives CrossEntropy's loss and gradient on the whole rows: with
// ignored targets, a slice whose logits are 300 above the others' (a
// max-free sum of exponentials would overflow), and in place.
func TestCrossEntropyShardJoinsToCrossEntropy(t *testing.T) {
	const T, V, scale = 5, 12, 0.5
	for _, dt := range []backend.DType{backend.Float64, backend.Float32} {
		b := cpu.New(dt)
		rng := rand.New(rand.NewPCG(3, 4))
		logits := make([]float64, T*V)
		for i := range logits {
			logits[i] = rng.NormFloat64() * 3
		}
		for r := range T {
			for j := 8; j < V; j++ {
				logits[r*V+j] += 300 // the last slice (of 3) dominates
			}
		}
		targets := []int32{0, 11, -1, 5, 9}
		targetsT := b.New(backend.Int32, T)
		backend.UploadSlice(b, targetsT, targets)
		wantLoss, wantD := b.New(dt, T), b.New(dt, T, V)
		whole := b.New(dt, T, V)
		backend.UploadSlice(b, whole, logits)
		b.CrossEntropy(wantLoss, wantD, whole, targetsT, scale)
		tol, lossTol := 1e-12, 1e-12
		if dt == backend.Float32 {
			// The slices' log-sum-exps travel in float32: near 300 that
			// is 2^-15 apart.
			tol, lossTol = 1e-5, 1e-4
		}
		for _, R := range []int{1, 2, 3} {
			vs := V / R
			slices := make([]backend.Tensor, R)
			lseRT, target := b.New(dt, R, T), b.New(dt, T)
			for q := range R {
				host := make([]float64, T*vs)
				for r := range T {
					copy(host[r*vs:(r+1)*vs], logits[r*V+q*vs:r*V+(q+1)*vs])
				}
				slices[q] = b.New(dt, T, vs)
				backend.UploadSlice(b, slices[q], host)
				tq := b.New(dt, T)
				b.CrossEntropyShard(b.View(lseRT, q*T, T), tq, slices[q], targetsT, q*vs)
				b.Axpy(target, 1, tq) // the all-reduce
			}
			for q := range R {
				loss := b.New(dt, T)
				b.CrossEntropyShardFinish(loss, slices[q], slices[q], lseRT, target, targetsT, q*vs, scale) // in place
				gotLoss, want := backend.DownloadFloat64(b, loss), backend.DownloadFloat64(b, wantLoss)
				for r := range T {
					if math.Abs(gotLoss[r]-want[r]) > lossTol {
						t.Errorf("%v, %d slices, slice %d: loss[%d] = %v, CrossEntropy %v", dt, R, q, r, gotLoss[r], want[r])
					}
				}
				gotD, wantDs := backend.DownloadFloat64(b, slices[q]), backend.DownloadFloat64(b, wantD)
				for r := range T {
					for j := range vs {
						if g, w := gotD[r*vs+j], wantDs[r*V+q*vs+j]; math.Abs(g-w) > tol {
							t.Errorf("%v, %d slices, slice %d: dlogits[%d][%d] = %v, CrossEntropy %v", dt, R, q, r, q*vs+j, g, w)
						}
					}
				}
			}
		}
	}
}
