package cpu

// Next-token cross-entropy with a stable log-sum-exp (the row maximum is
// subtracted before exponentiating), accumulated in float64.

import (
	"math"

	"github.com/mktrain/mktrain/backend"
)

// CrossEntropy writes lossT[t] = logsumexp(logitsTV[t]) - logitsTV[t][targetsT[t]]
// and dlogitsTV = (softmax - onehot) * gradScale. dlogitsTV may be logitsTV
// itself, or nil when only the loss is wanted. A negative target gives loss
// 0 and a zero gradient row.
func (b *Backend) CrossEntropy(lossT, dlogitsTV, logitsTV, targetsT backend.Tensor, gradScale float64) {
	const op = "CrossEntropy"
	t, v := b.matrix(op, "logits", logitsTV)
	b.vector(op, "loss", lossT, t)
	if dlogitsTV != nil {
		b.wantOperandMatrix(op, "dlogits", dlogitsTV, t, v)
	}
	targets := indices(op, "targets", targetsT, t, v, true)
	if b.dt == backend.Float32 {
		crossEntropy(b, floats[float32](lossT), floats[float32](dlogitsTV), floats[float32](logitsTV), targets, v, gradScale)
	} else {
		crossEntropy(b, floats[float64](lossT), floats[float64](dlogitsTV), floats[float64](logitsTV), targets, v, gradScale)
	}
	if dlogitsTV != nil {
		b.roundIfBF16(dlogitsTV)
	}
}

func crossEntropy[T Float](b *Backend, loss, dlogits, logits []T, targets []int32, v int, scale float64) {
	b.parallelFor(len(targets), rowChunk(v), func(lo, hi int) {
		for t := lo; t < hi; t++ {
			row := logits[t*v : (t+1)*v]
			var drow []T
			if dlogits != nil {
				drow = dlogits[t*v : (t+1)*v][:len(row)]
			}
			tgt := int(targets[t])
			if tgt < 0 {
				loss[t] = 0
				clear(drow)
				continue
			}
			lse := rowLSE(row)
			loss[t] = T(lse - float64(row[tgt]))
			// Element j of drow is written after row[j] is read, so drow may
			// alias row.
			for j := range drow {
				p := math.Exp(float64(row[j]) - lse)
				if j == tgt {
					p--
				}
				drow[j] = T(p * scale)
			}
		}
	})
}

// rowLSE is log(sum(exp(row))) in float64, the row's maximum subtracted
// before exponentiating.
func rowLSE[T Float](row []T) float64 {
	mx := math.Inf(-1)
	for _, x := range row {
		mx = max(mx, float64(x))
	}
	var se float64
	for _, x := range row {
		se += math.Exp(float64(x) - mx)
	}
	return mx + math.Log(se)
}
