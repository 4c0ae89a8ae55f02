package engine

// Split master weights (train.master_weights: split, or auto).
//
// Where the products multiply in bf16 (the GPU), a training rank would hold
// every product weight twice: the float32 master AdamW updates and the
// bf16 copy the products read, rounded from the masters once per step. With
// split masters it holds the bf16 operands themselves (hi) and the 16 bits
// that make each one its float32 master again (lo, two to an Int32 word;
// backend.SplitMaster), and AdamW updates the pair in place
// (backend.AdamWUpdateSplit). That is 4 bytes a weight instead of 6, and
// the per-step rounding pass is gone. The norms and the embedding table,
// which no product reads, stay float32 masters the model reads directly:
// they are the front of the flat layout (norms, then the embedding), so
// the weight store is
//
//	[0, splitAt)      float32 masters (wStore.flat)
//	[splitAt, total)  hi (bf16, the operand store) and lo (Int32, half as long)
//
// at the layout's offsets less splitAt. Every tensor starts on a
// flatAlign boundary, so each lies in one part and its halves pair up.
// The masters are the same bits as float32 ones (AdamWUpdateSplit/ref),
// and checkpoints hold them whole: a run resumes under either setting.

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
)

// masterWeightsSplit says c asks for split masters where the backend
// multiplies in bf16: split, or auto without ZeRO-1 (whose all-gathers
// move float32 pieces of the replicated span).
func (c Config) masterWeightsSplit() bool {
	switch c.Train.MasterWeights {
	case MasterWeightsSplit:
		return true
	case MasterWeightsAuto:
		return c.Parallel.Zero != 1
	}
	return false // fp32, and "" (configurations saved before the field existed)
}

// SplitsMasters says a training rank of c on b holds split masters: c
// asks for them (masterWeightsSplit) and b multiplies float32 weights in
// bf16.
func (c Config) SplitsMasters(b backend.Backend) bool {
	return c.masterWeightsSplit() && b.FloatType() == backend.Float32 && b.OperandType() == backend.BFloat16
}

// fp32Prefix is where the flat layout's float32 part ends: after the
// norms and the embedding table. It panics if a tensor the products read
// lies before it (a layout that no longer puts those two first).
func (lay *flatLayout) fp32Prefix() int {
	end := 0
	for i, s := range lay.slots {
		if keepsFloat32(s) {
			end = max(end, lay.offset[i]+lay.padded(i))
		}
	}
	for i, s := range lay.slots {
		if !keepsFloat32(s) && lay.offset[i] < end {
			panic(fmt.Sprintf("engine: %s lies at %d, before the float32 masters end at %d", s.name, lay.offset[i], end))
		}
	}
	return end
}

// keepsFloat32 says s is read as its float32 master by the model: the
// norms and the embedding table, which no product reads (newOperandStore
// gives them no bf16 copy).
func keepsFloat32(s paramSlot) bool { return s.role == roleNorm || s.name == nameEmbed }

// splitWeights is a rank's weight store under split masters.
type splitWeights struct {
	at     int            // splitAt: where the split part begins
	hi, lo backend.Tensor // [total-at] BFloat16, [(total-at)/2] Int32
}

// newSplitWeightStore allocates the weights of lay as split masters: the
// float32 store of the prefix (its p holds every tensor: the prefix's as
// float32 views, the others as views of hi) and the halves.
func newSplitWeightStore(b backend.Backend, m ModelConfig, lay *flatLayout) (paramStore, splitWeights) {
	at := lay.fp32Prefix()
	sw := splitWeights{at: at, hi: b.New(backend.BFloat16, lay.total-at), lo: b.New(backend.Int32, (lay.total-at)/2)}
	flat := b.New(b.FloatType(), at)
	p := newModelParams(m)
	for i, s := range lay.slots {
		if off := lay.offset[i]; off < at {
			*s.pick(p) = b.View(flat, off, lay.shape[i]...)
		} else {
			*s.pick(p) = b.View(sw.hi, off-at, lay.shape[i]...)
		}
	}
	return paramStore{flat: flat, p: p}, sw
}

// loView is the lo words of the n weights from layout offset off.
func (sw splitWeights) loView(b backend.Backend, off, n int) backend.Tensor {
	return b.View(sw.lo, (off-sw.at)/2, (n+1)/2)
}

// adamW runs AdamW over the span s of the weight store, whose gradients,
// m and v are g, m and v (each s's length): float32 masters with
// AdamWUpdate, split ones with AdamWUpdateSplit, a span across the two
// parts in two calls.
func (r *rank) adamW(s span, g, m, v backend.Tensor, h backend.AdamW) {
	b := r.b
	r.adamWParts(s, g, m, v,
		func(param, g, m, v backend.Tensor) { b.AdamWUpdate(param, g, m, v, h) },
		func(hi, lo, g, m, v backend.Tensor) { b.AdamWUpdateSplit(hi, lo, g, m, v, h) })
}

// adamWSquares is adamW that also queues Σ g² over s for the gradient
// norm, summed in the update's pass where the backend can
// (backend.SquaringOptimizer); the function returns it, once.
func (r *rank) adamWSquares(s span, g, m, v backend.Tensor, h backend.AdamW) func() float64 {
	b := r.b
	var parts []func() float64
	r.adamWParts(s, g, m, v,
		func(param, g, m, v backend.Tensor) {
			parts = append(parts, backend.AdamWUpdateSquares(b, param, g, m, v, h))
		},
		func(hi, lo, g, m, v backend.Tensor) {
			parts = append(parts, backend.AdamWUpdateSplitSquares(b, hi, lo, g, m, v, h))
		})
	return func() float64 {
		sum := 0.0
		for _, f := range parts {
			sum += f()
		}
		return sum
	}
}

// adamWParts splits the span s (gradients, m and v g, m and v) where the
// masters stop being float32 and start being split, and calls plain with
// the float32 part's weights, split with the split part's halves; an
// empty part is skipped.
func (r *rank) adamWParts(s span, g, m, v backend.Tensor, plain func(param, g, m, v backend.Tensor), split func(hi, lo, g, m, v backend.Tensor)) {
	b := r.b
	if r.split.hi == nil || s.hi <= r.split.at {
		plain(r.wStore.view(b, s), g, m, v)
		return
	}
	if s.lo < r.split.at {
		k, n := r.split.at-s.lo, s.hi-s.lo
		plain(r.wStore.view(b, span{s.lo, r.split.at}), b.View(g, 0, k), b.View(m, 0, k), b.View(v, 0, k))
		s.lo, g, m, v = r.split.at, b.View(g, k, n-k), b.View(m, k, n-k), b.View(v, k, n-k)
	}
	n := s.hi - s.lo
	split(b.View(r.split.hi, s.lo-r.split.at, n), r.split.loView(b, s.lo, n), g, m, v)
}

// download is p's weight as float32s: the master, joined from its halves
// when it is split.
func (p *param) download(b backend.Backend) []float32 {
	if p.lo == nil {
		return backend.DownloadFloat32(b, p.w)
	}
	return backend.JoinMasters(backend.DownloadFloat32(b, p.w), backend.DownloadInt32(b, p.lo))
}

// upload sets p's weight to host (its length), splitting it when p's
// master is split.
func (p *param) upload(b backend.Backend, host []float32) {
	if p.lo == nil {
		backend.UploadSlice(b, p.w, host)
		return
	}
	hi, lo := backend.SplitMasters(host)
	backend.UploadSlice(b, p.w, hi)
	backend.UploadSlice(b, p.lo, lo)
}
