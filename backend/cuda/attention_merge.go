package cuda

// The merge of two partial attentions of the same query rows: the launch
// side of kernels/attention_merge.cu, and the Backend op
// (backend.Backend.AttentionMerge). A context-parallel ring merges each
// chunk's partial output into its running output with it.

import (
	"fmt"
	"math"
	"runtime"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// AttentionMerge folds part and plse into out and lse, in place (see
// backend.Backend.AttentionMerge): out and part are float32 [B*S, H*Dh],
// lse and plse [B, H, S]. It queues the kernel on d's stream; launch
// errors come back from the next Sync.
func AttentionMerge(d *Device, out, lse, part, plse driver.DevicePtr, s backend.AttnShape) error {
	if s.Batch < 1 || s.Seq < 1 || s.Heads < 1 || s.HeadDim < 1 {
		return fmt.Errorf("cuda: AttentionMerge: attention shape %+v: batch, seq, heads and head dim must be positive", s)
	}
	if int64(s.Batch)*int64(s.Seq) > math.MaxInt32 || s.Heads*s.HeadDim > math.MaxInt32/2 {
		return fmt.Errorf("cuda: AttentionMerge: attention shape %+v is too large", s)
	}
	kern, err := sourceKernel(d, "attention_merge.cu", "attn_merge_f32")
	if err != nil {
		return err
	}
	rows := int64(s.Batch) * int64(s.Seq)
	const threads = 256
	return d.Launch(kern, d.StrideGrid(rows*int64(s.Heads)*32, threads, 8), out, lse, part, plse, rows, int32(s.Seq), int32(s.Heads), int32(s.HeadDim))
}

// AttentionMerge merges a partial attention into a running one (see
// backend.Backend).
func (b *Backend) AttentionMerge(outTQ, lseBHS, partTQ, partLseBHS backend.Tensor, s backend.AttnShape) {
	const op = "AttentionMerge"
	shape := backend.AttnShape{Batch: s.Batch, Seq: s.Seq, Heads: s.Heads, KVHeads: s.Heads, HeadDim: s.HeadDim}
	ts := checkAttn(op, shape, lseBHS, attnArg{"out", outTQ, s.Heads, false, false}, attnArg{"part", partTQ, s.Heads, false, false})
	pl := vector(op, "partLse", partLseBHS, s.Batch*s.Heads*s.Seq)
	ps, ok := devicePtrs(append(ts, pl)...)
	if !ok {
		return
	}
	out, part, lse, plse := ps[0], ps[1], ps[2], ps[3]
	b.fail(AttentionMerge(b.dev, out, lse, part, plse, s))
	runtime.KeepAlive(ts)
	runtime.KeepAlive(pl)
}
