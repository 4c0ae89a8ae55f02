package cpu

// The cross-entropy of logits split by vocabulary over tensor-parallel
// ranks (Backend.CrossEntropyShard, CrossEntropyShardFinish): each rank's log-sum-exp of its
// slice, then the whole row's from every slice's, in float64 as
// CrossEntropy accumulates.

import (
	"math"

	"github.com/mktrain/mktrain/backend"
)

// CrossEntropyShard writes each row's log-sum-exp of this slice of the
// vocabulary and the target's logit where the slice holds it (else 0).
func (b *Backend) CrossEntropyShard(lseT, targetLogitT, logitsTV, targetsT backend.Tensor, vocabLo int) {
	const op = "CrossEntropyShard"
	t, v := b.matrix(op, "logits", logitsTV)
	b.vector(op, "lse", lseT, t)
	b.vector(op, "targetLogit", targetLogitT, t)
	targets := indices(op, "targets", targetsT, t, math.MaxInt32, true)
	if b.dt == backend.Float32 {
		crossEntropyShard(b, floats[float32](lseT), floats[float32](targetLogitT), floats[float32](logitsTV), targets, v, vocabLo)
	} else {
		crossEntropyShard(b, floats[float64](lseT), floats[float64](targetLogitT), floats[float64](logitsTV), targets, v, vocabLo)
	}
}

func crossEntropyShard[T Float](b *Backend, lse, targetLogit, logits []T, targets []int32, v, vocabLo int) {
	b.parallelFor(len(targets), rowChunk(v), func(lo, hi int) {
		for t := lo; t < hi; t++ {
			row := logits[t*v : (t+1)*v]
			lse[t] = T(rowLSE(row))
			targetLogit[t] = 0
			if j := int(targets[t]) - vocabLo; targets[t] >= 0 && j >= 0 && j < v {
				targetLogit[t] = row[j]
			}
		}
	})
}

// CrossEntropyShardFinish joins the slices' log-sum-exps lseRT [R, T] into
// the loss and writes this slice's gradient.
func (b *Backend) CrossEntropyShardFinish(lossT, dlogitsTV, logitsTV, lseRT, targetLogitT, targetsT backend.Tensor, vocabLo int, gradScale float64) {
	const op = "CrossEntropyShardFinish"
	t, v := b.matrix(op, "logits", logitsTV)
	b.vector(op, "loss", lossT, t)
	b.wantMatrix(op, "dlogits", dlogitsTV, t, v)
	r, _ := b.matrix(op, "lse", lseRT)
	b.wantMatrix(op, "lse", lseRT, r, t)
	b.vector(op, "targetLogit", targetLogitT, t)
	targets := indices(op, "targets", targetsT, t, math.MaxInt32, true)
	if b.dt == backend.Float32 {
		crossEntropyShardFinish(b, floats[float32](lossT), floats[float32](dlogitsTV), floats[float32](logitsTV), floats[float32](lseRT),
			floats[float32](targetLogitT), targets, r, v, vocabLo, gradScale)
	} else {
		crossEntropyShardFinish(b, floats[float64](lossT), floats[float64](dlogitsTV), floats[float64](logitsTV), floats[float64](lseRT),
			floats[float64](targetLogitT), targets, r, v, vocabLo, gradScale)
	}
}

func crossEntropyShardFinish[T Float](b *Backend, loss, dlogits, logits, lseR, targetLogit []T, targets []int32, r, v, vocabLo int, scale float64) {
	n := len(targets)
	b.parallelFor(n, rowChunk(v), func(lo, hi int) {
		for t := lo; t < hi; t++ {
			row, drow := logits[t*v:(t+1)*v], dlogits[t*v:(t+1)*v]
			if targets[t] < 0 {
				loss[t] = 0
				clear(drow)
				continue
			}
			mx := math.Inf(-1)
			for q := range r {
				mx = max(mx, float64(lseR[q*n+t]))
			}
			var se float64
			for q := range r {
				se += math.Exp(float64(lseR[q*n+t]) - mx)
			}
			lse := mx + math.Log(se)
			loss[t] = T(lse - float64(targetLogit[t]))
			tgt := int(targets[t]) - vocabLo
			for j := range drow { // drow may alias row: each element read before written
				p := math.Exp(float64(row[j]) - lse)
				if j == tgt {
					p--
				}
				drow[j] = T(p * scale)
			}
		}
	})
}
