package cuda

// Causal grouped-query attention on raw device pointers: the launch side of
// kernels/attention_tc.cu (tensor cores) and kernels/attention.cu (float32
// on the CUDA cores), and the choice of those or attention_hopper.cu's
// (attention_hopper.go). Both are flash style (no Seq x Seq matrix in memory);
// the headers of the .cu files describe their tiling. Semantics are
// backend/cpu's (the oracle): query token b*Seq + i, key token
// b*Keys() + j, query head h reads kv head h/(Heads/KVHeads), scores
// scaled by 1/sqrt(HeadDim) and masked causally with the query offset (key
// j visible to query i iff j <= QOffset + i; every key with Full), lse in
// natural log.
//
// Which kernels run: on Hopper GPUs (sm_90a), for head dims 64 and 128
// when every tensor but lse is 16-byte aligned, attention_hopper.cu's
// wgmma/TMA kernels on q, k, v (and dout) rounded to bf16 in scratch
// first; on other GPUs, for the same head dims, the tensor-core kernels of
// attention_tc.cu (bf16 operands rounded as tiles are staged, float32
// accumulation and softmax statistics); the float32 ones (error ~1e-6)
// for every other case. The Hopper backward adds dq's blocks with TMA
// reductions, in the order its blocks run; a Backend under
// SetDeterministic runs attention_tc.cu's backward instead, whose dq pass
// adds in a fixed order: faster on an H200 than an ordered build of the
// Hopper backward (a key-block-ordered build of its version 3:
// kernels/attention_hopper.md).
// Unmasked calls (AttnShape.Full, the off-diagonal
// blocks of the portable context-parallel ring) run on every set with the
// offset KVSeq-1: the kernels clip a query's keys at the last one, so
// query i then sees keys 0..KVSeq-1. Against float64 the bf16 kernels
// give relative (L2) errors of about 4e-3 on out and up to 8e-3 on the
// gradients; the conformance suite compares attention as whole tensors
// for that reason (backendtest.CompareNormWise): single elements stray up
// to a few percent of the tensor's rms, which rounding the inputs to bf16
// alone causes.

import (
	"fmt"
	"math"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/kernels"
)

// MaxAttnHeadDim is the largest head dim the attention kernels take.
const MaxAttnHeadDim = 128

// attnRows is the rows (queries or keys) one block owns, in both sets of
// kernels.
const attnRows = 64

// maxGridY is CUDA's limit on a grid's y dimension.
const maxGridY = 65535

// attnImpl names a set of attention kernels.
type attnImpl int

const (
	// attnAuto is the tensor-core kernels where they apply, else float32.
	attnAuto attnImpl = iota
	// attnFP32 is attention.cu: float32 on the CUDA cores, any head dim.
	attnFP32
	// attnTC is attention_tc.cu: bf16 tensor cores, head dims 64 and 128,
	// tensors (but lse) 16-byte aligned.
	attnTC
	// attnAutoOrdered is attnAuto with every sum in a fixed order:
	// attention_tc.cu's kernels, free of float atomics (on Hopper too).
	attnAutoOrdered
	// attnHopper is attention_hopper.cu's forward (wgmma and TMA on
	// sm_90a, q, k and v rounded to bf16 first) with attention_tc.cu's
	// backward; the same head dims and alignment as attnTC.
	attnHopper
)

func (i attnImpl) String() string {
	switch i {
	case attnAuto:
		return "auto"
	case attnFP32:
		return "fp32"
	case attnTC:
		return "tensor cores"
	case attnHopper:
		return "hopper"
	case attnAutoOrdered:
		return "auto, fixed order"
	}
	return fmt.Sprintf("attnImpl(%d)", int(i))
}

// attnTensorCores lets attnAuto pick the tensor-core kernels; off, every
// call runs the float32 kernels.
const attnTensorCores = true

// tcHeadDim reports whether the tensor-core kernels take head dim dh.
func tcHeadDim(dh int) bool { return dh == 64 || dh == 128 }

// AttentionForward computes causal GQA attention: q is [B*S, H*Dh], k and
// v are [B*KS, KV*Dh] (KS = s.Keys()), out is [B*S, H*Dh], all float32
// row-major; lse [B, H, S] receives each query row's log-sum-exp of its
// scaled, masked scores, for the backward. It queues the kernel on d's stream; launch
// errors come back from the next Sync.
func AttentionForward(d *Device, out, lse, q, k, v driver.DevicePtr, s backend.AttnShape) error {
	return attentionForward(d, out, lse, q, k, v, s, attnAuto)
}

// AttentionBackward writes (overwrites) dq [B*S, H*Dh], dk and dv
// [B*KS, KV*Dh] (every key row; 0 where no query sees the key) from dout,
// the forward's inputs, its out and its lse. On Hopper it runs
// attention_hopper.cu's backward (one kernel over key tiles that adds dq
// with TMA reductions, so dq's last bits vary from run to run, unless
// AttentionBackwardOrdered has them added in key-block order); elsewhere
// two kernels, deterministic and free of atomics: one over query tiles
// for dq, which also saves D_i = rowsum(dout*out) in a [B, H, S]
// scratch, and one over key tiles for dk and dv, each owning its rows
// across the query heads of its GQA group.
// Asynchronous, as AttentionForward.
func AttentionBackward(d *Device, dq, dk, dv, dout, q, k, v, out, lse driver.DevicePtr, s backend.AttnShape) error {
	return attentionBackward(d, dq, dk, dv, dout, q, k, v, out, lse, s, attnAuto)
}

// AttentionBackwardOrdered is AttentionBackward that adds in a fixed
// order: the same inputs give the same bits on every run.
func AttentionBackwardOrdered(d *Device, dq, dk, dv, dout, q, k, v, out, lse driver.DevicePtr, s backend.AttnShape) error {
	return attentionBackward(d, dq, dk, dv, dout, q, k, v, out, lse, s, attnAutoOrdered)
}

// attentionForward is AttentionForward on the kernels impl names.
func attentionForward(d *Device, out, lse, q, k, v driver.DevicePtr, s backend.AttnShape, impl attnImpl) error {
	const op = "AttentionForward"
	auto := impl == attnAuto || impl == attnAutoOrdered // the forward adds in a fixed order either way
	dp, err := checkAttnShape(op, s)
	if err != nil {
		return err
	}
	if impl, err = chooseAttn(op, impl, s, out, q, k, v); err != nil {
		return err
	}
	if impl == attnHopper || (impl == attnTC && auto && hopperAttnTakes(d, s)) {
		if !hopperAttnTakes(d, s) {
			return fmt.Errorf("cuda: %s: the Hopper kernels need an sm_90a GPU, not %s", op, d.info.Arch)
		}
		return hopperAttnForwardF32(d, out, lse, q, k, v, s)
	}
	_, scaleLog2 := attnScales(s.HeadDim)
	S, KS, off, H, KV := int32(s.Seq), int32(s.Keys()), attnOffset(s), int32(s.Heads), int32(s.KVHeads)
	if impl == attnTC {
		kern, err := sourceKernel(d, "attention_tc.cu", fmt.Sprintf("attn_tc_forward_d%d", s.HeadDim))
		if err != nil {
			return err
		}
		return d.Launch(kern, tcGrid(s.Batch*s.Heads, s.Seq), out, lse, q, k, v, S, KS, off, H, KV, scaleLog2)
	}
	kern, err := attnKernel(d, fmt.Sprintf("attn_forward_d%d_f32", dp))
	if err != nil {
		return err
	}
	return d.Launch(kern, attnGrid(s.Batch*s.Heads, s.Seq, dp), out, lse, q, k, v, S, KS, off, H, KV, int32(s.HeadDim), scaleLog2)
}

// attentionBackward is AttentionBackward on the kernels impl names.
func attentionBackward(d *Device, dq, dk, dv, dout, q, k, v, out, lse driver.DevicePtr, s backend.AttnShape, impl attnImpl) error {
	const op = "AttentionBackward"
	// Under attnAutoOrdered the tensor-core kernels' ordered backward runs:
	// on an H200 it was faster than an ordered Hopper kernel (134 and 130
	// TFLOP/s against 71 and 90 at head dims 64 and 128, at 410ec3e:
	// kernels/attention_hopper.md).
	auto := impl == attnAuto
	dp, err := checkAttnShape(op, s)
	if err != nil {
		return err
	}
	if impl, err = chooseAttn(op, impl, s, dq, dk, dv, dout, q, k, v, out); err != nil {
		return err
	}
	if impl == attnHopper || (impl == attnTC && auto && hopperAttnTakes(d, s)) {
		if !hopperAttnTakes(d, s) {
			return fmt.Errorf("cuda: %s: the Hopper kernels need an sm_90a GPU, not %s", op, d.info.Arch)
		}
		return hopperAttnBackward(d, dq, dk, dv, dout, q, k, v, out, lse, s, attnBwdInputs{})
	}
	dqName, dkvName := fmt.Sprintf("attn_backward_dq_d%d_f32", dp), fmt.Sprintf("attn_backward_dkdv_d%d_f32", dp)
	// dq runs over query tiles, dk/dv over key tiles.
	file, qGrid, kGrid := "attention.cu", attnGrid(s.Batch*s.Heads, s.Seq, dp), attnGrid(s.Batch*s.KVHeads, s.Keys(), dp)
	if impl == attnTC {
		dqName, dkvName = fmt.Sprintf("attn_tc_backward_dq_d%d", s.HeadDim), fmt.Sprintf("attn_tc_backward_dkdv_d%d", s.HeadDim)
		file, qGrid, kGrid = "attention_tc.cu", tcGrid(s.Batch*s.Heads, s.Seq), tcGrid(s.Batch*s.KVHeads, s.Keys())
	}
	dqKern, err := sourceKernel(d, file, dqName)
	if err != nil {
		return err
	}
	dkvKern, err := sourceKernel(d, file, dkvName)
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
	S, KS, off := int32(s.Seq), int32(s.Keys()), attnOffset(s)
	H, KV, Dh := int32(s.Heads), int32(s.KVHeads), int32(s.HeadDim)
	if impl == attnTC {
		if err := d.Launch(dqKern, qGrid, dq, delta, dout, q, k, v, out, lse, S, KS, off, H, KV, scaleLog2, scale); err != nil {
			return err
		}
		return d.Launch(dkvKern, kGrid, dk, dv, dout, q, k, v, lse, delta, S, KS, off, H, KV, scaleLog2, scale)
	}
	if err := d.Launch(dqKern, qGrid, dq, delta, dout, q, k, v, out, lse, S, KS, off, H, KV, Dh, scaleLog2, scale); err != nil {
		return err
	}
	return d.Launch(dkvKern, kGrid, dk, dv, dout, q, k, v, lse, delta, S, KS, off, H, KV, Dh, scaleLog2, scale)
}

// chooseAttn resolves attnAuto and checks that the tensor-core kernels,
// if asked for, take s and the pointers ptrs (every tensor but lse: the
// kernels read 16-byte and write 8-byte vectors).
func chooseAttn(op string, impl attnImpl, s backend.AttnShape, ptrs ...driver.DevicePtr) (attnImpl, error) {
	aligned := true
	for _, p := range ptrs {
		aligned = aligned && p%16 == 0
	}
	switch impl {
	case attnAuto, attnAutoOrdered:
		if attnTensorCores && tcHeadDim(s.HeadDim) && aligned {
			return attnTC, nil
		}
		return attnFP32, nil
	case attnFP32:
		return attnFP32, nil
	case attnTC, attnHopper:
		if !tcHeadDim(s.HeadDim) {
			return 0, fmt.Errorf("cuda: %s: the tensor-core kernels take head dims 64 and 128, not %d", op, s.HeadDim)
		}
		if !aligned {
			return 0, fmt.Errorf("cuda: %s: the tensor-core kernels need 16-byte aligned tensors", op)
		}
		return impl, nil
	}
	return 0, fmt.Errorf("cuda: %s: unknown attention kernels %v", op, impl)
}

// checkAttnShape validates s and returns the padded head dim (32, 64 or
// 128) whose kernels serve it.
func checkAttnShape(op string, s backend.AttnShape) (int, error) {
	if s.Batch < 1 || s.Seq < 1 || s.Heads < 1 || s.KVHeads < 1 || s.HeadDim < 1 || s.Heads%s.KVHeads != 0 {
		return 0, fmt.Errorf("cuda: %s: attention shape %+v: all sizes must be positive and KVHeads must divide Heads", op, s)
	}
	if s.KVSeq < 0 || s.QOffset < 0 || s.QOffset+s.Seq > s.Keys() {
		return 0, fmt.Errorf("cuda: %s: attention shape %+v: need 0 <= QOffset and QOffset+Seq <= KVSeq", op, s)
	}
	if s.Full && s.QOffset != 0 {
		return 0, fmt.Errorf("cuda: %s: attention shape %+v: a Full call has no QOffset", op, s)
	}
	if s.HeadDim > MaxAttnHeadDim {
		return 0, fmt.Errorf("cuda: %s: head dim %d is over the kernels' limit of %d", op, s.HeadDim, MaxAttnHeadDim)
	}
	// Keys() >= Seq, so the key tiles bound both grids.
	if tiles := (s.Keys() + attnRows - 1) / attnRows; tiles > maxGridY {
		return 0, fmt.Errorf("cuda: %s: sequence length %d is over the kernels' limit of %d", op, s.Keys(), maxGridY*attnRows)
	}
	if int64(s.Batch)*int64(s.Heads) > math.MaxInt32 || int64(s.Batch)*int64(s.Keys()) > math.MaxInt32 {
		return 0, fmt.Errorf("cuda: %s: attention shape %+v is too large (batch*heads and batch*keys must fit in 32 bits)", op, s)
	}
	switch {
	case s.HeadDim <= 32:
		return 32, nil
	case s.HeadDim <= 64:
		return 64, nil
	}
	return 128, nil
}

// attnOffset is the query offset the kernels get: QOffset, or KVSeq-1 for
// an unmasked call (both kernel sets clip the mask at the last key).
func attnOffset(s backend.AttnShape) int32 {
	if s.Full {
		return int32(s.Keys() - 1)
	}
	return int32(s.QOffset)
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

// tcGrid is (units, ceil(seq/64)) blocks of 128 threads (4 warps of 16
// rows), units being batch*heads or batch*kv heads.
func tcGrid(units, seq int) Grid {
	return Grid{
		Grid:  driver.Dim3{X: units, Y: (seq + attnRows - 1) / attnRows, Z: 1},
		Block: driver.Dim3{X: 128, Y: 1, Z: 1},
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
