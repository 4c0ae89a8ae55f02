package cuda

// Causal grouped-query attention on raw device pointers: the launch side of
// kernels/attention.cu. The kernels are flash style (no Seq x Seq matrix in
// memory), float32 on the CUDA cores; the header of attention.cu describes
// the tiling. Semantics are backend/cpu's (the oracle): token t = b*Seq + i,
// query head h reads kv head h/(Heads/KVHeads), scores scaled by
// 1/sqrt(HeadDim) and masked causally, lse in natural log.

import (
	"fmt"
	"math"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/kernels"
)

// MaxAttnHeadDim is the largest head dim the attention kernels take.
const MaxAttnHeadDim = 128

// attnRows is the rows (queries or keys) one block of the kernels owns.
const attnRows = 64

// maxGridY is CUDA's limit on a grid's y dimension.
const maxGridY = 65535

// AttentionForward computes causal GQA attention: q is [B*S, H*Dh], k and
// v are [B*S, KV*Dh], out is [B*S, H*Dh], all float32 row-major; lse
// [B, H, S] receives each query row's log-sum-exp of its scaled, masked
// scores, for the backward. It queues the kernel on d's stream; launch
// errors come back from the next Sync.
func AttentionForward(d *Device, out, lse, q, k, v driver.DevicePtr, s backend.AttnShape) error {
	dp, err := checkAttnShape("AttentionForward", s)
	if err != nil {
		return err
	}
	kern, err := attnKernel(d, fmt.Sprintf("attn_forward_d%d_f32", dp))
	if err != nil {
		return err
	}
	_, scaleLog2 := attnScales(s.HeadDim)
	return d.Launch(kern, attnGrid(s.Batch*s.Heads, s.Seq, dp), out, lse, q, k, v,
		int32(s.Seq), int32(s.Heads), int32(s.KVHeads), int32(s.HeadDim), scaleLog2)
}

// AttentionBackward writes (overwrites) dq [B*S, H*Dh], dk and dv
// [B*S, KV*Dh] from dout, the forward's inputs, its out and its lse. It
// runs two kernels, deterministic and free of atomics: one over query tiles
// for dq, which also saves D_i = rowsum(dout*out) in a [B, H, S] scratch,
// and one over key tiles for dk and dv, each owning its rows across the
// query heads of its GQA group. Asynchronous, as AttentionForward.
func AttentionBackward(d *Device, dq, dk, dv, dout, q, k, v, out, lse driver.DevicePtr, s backend.AttnShape) error {
	dp, err := checkAttnShape("AttentionBackward", s)
	if err != nil {
		return err
	}
	dqKern, err := attnKernel(d, fmt.Sprintf("attn_backward_dq_d%d_f32", dp))
	if err != nil {
		return err
	}
	dkvKern, err := attnKernel(d, fmt.Sprintf("attn_backward_dkdv_d%d_f32", dp))
	if err != nil {
		return err
	}
	delta, err := d.Alloc(4 * int64(s.Batch) * int64(s.Heads) * int64(s.Seq))
	if err != nil {
		return err
	}
	// Free is stream-ordered: the kernels queued before it still see delta.
	defer d.Free(delta)
	scale, scaleLog2 := attnScales(s.HeadDim)
	S, H, KV, Dh := int32(s.Seq), int32(s.Heads), int32(s.KVHeads), int32(s.HeadDim)
	if err := d.Launch(dqKern, attnGrid(s.Batch*s.Heads, s.Seq, dp),
		dq, delta, dout, q, k, v, out, lse, S, H, KV, Dh, scaleLog2, scale); err != nil {
		return err
	}
	return d.Launch(dkvKern, attnGrid(s.Batch*s.KVHeads, s.Seq, dp),
		dk, dv, dout, q, k, v, lse, delta, S, H, KV, Dh, scaleLog2, scale)
}

// checkAttnShape validates s and returns the padded head dim (32, 64 or
// 128) whose kernels serve it.
func checkAttnShape(op string, s backend.AttnShape) (int, error) {
	if s.Batch < 1 || s.Seq < 1 || s.Heads < 1 || s.KVHeads < 1 || s.HeadDim < 1 || s.Heads%s.KVHeads != 0 {
		return 0, fmt.Errorf("cuda: %s: attention shape %+v: all sizes must be positive and KVHeads must divide Heads", op, s)
	}
	if s.HeadDim > MaxAttnHeadDim {
		return 0, fmt.Errorf("cuda: %s: head dim %d is over the kernels' limit of %d", op, s.HeadDim, MaxAttnHeadDim)
	}
	if tiles := (s.Seq + attnRows - 1) / attnRows; tiles > maxGridY {
		return 0, fmt.Errorf("cuda: %s: sequence length %d is over the kernels' limit of %d", op, s.Seq, maxGridY*attnRows)
	}
	if int64(s.Batch)*int64(s.Heads) > math.MaxInt32 || int64(s.Batch)*int64(s.Seq) > math.MaxInt32 {
		return 0, fmt.Errorf("cuda: %s: attention shape %+v is too large (batch*heads and batch*seq must fit in 32 bits)", op, s)
	}
	switch {
	case s.HeadDim <= 32:
		return 32, nil
	case s.HeadDim <= 64:
		return 64, nil
	}
	return 128, nil
}

// attnScales returns 1/sqrt(Dh) and log2(e)/sqrt(Dh): the kernels keep
// scores in base 2.
func attnScales(headDim int) (scale, scaleLog2 float32) {
	s := 1 / math.Sqrt(float64(headDim))
	return float32(s), float32(s / math.Ln2)
}

// attnGrid is (units, ceil(seq/64)) blocks of 64*dp/32 threads, units
// being batch*heads or batch*kv heads.
func attnGrid(units, seq, dp int) Grid {
	return Grid{
		Grid:  driver.Dim3{X: units, Y: (seq + attnRows - 1) / attnRows, Z: 1},
		Block: driver.Dim3{X: attnRows * dp / 32, Y: 1, Z: 1},
	}
}

// attnKernel returns kernel name of attention.cu, loading the module on
// first use (Device.Load caches it).
func attnKernel(d *Device, name string) (*Kernel, error) {
	return sourceKernel(d, "attention.cu", name)
}

// sourceKernel loads file on d (once) and returns its kernel name.
func sourceKernel(d *Device, file, name string) (*Kernel, error) {
	src, err := kernels.Lookup(file)
	if err != nil {
		return nil, err
	}
	m, err := d.Load(src)
	if err != nil {
		return nil, err
	}
	return m.Kernel(name)
}
