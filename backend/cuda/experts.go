package cuda

// The experts' forward products on the Hopper grouped GEMM (GroupedGemm,
// kernels/grouped_gemm.cu) instead of one cuBLASLt call per expert: one
// persistent kernel over every expert, reading the group offsets on the
// device. It serves GroupedMatMul's NT case (out = a·W_gᵀ, the forward of
// w1, w3 and w2) with bf16 operands, beta 0, and sizes and addresses the
// kernel takes; everything else, the weight gradients (GroupedMatMulTN)
// included, keeps the cuBLASLt path. The weight-gradient kernel
// (GroupedGemm.RunTN) is not routed to yet: at 53821a3 its accumulating
// epilogue made the weight gradients 1.36x slower than the cuBLASLt loop
// in moe-small's step (kernels/grouped_gemm.md, "The weight-gradient
// kernel"). bf16 outputs use
// the TMA-store epilogue (bn256s), the fastest variant measured
// (bench/results/h200-20261202-fa2ca3b/).

import (
	"sync"

	"github.com/mktrain/mktrain/backend"
)

// expertGemm is the Backend's grouped GEMM state, made on first use.
type expertGemm struct {
	once     sync.Once
	bf16Out  *GroupedGemm // Store: bn256s
	floatOut *GroupedGemm // the register epilogue (float32 out)
	err      error        // why the kernel is not used (not Hopper, ...)

	mu       sync.Mutex
	offsets  *Buffer // the last call's group offsets, int32
	offsetsH []int32 // their host copy, reused from call to call
}

// expertKernels loads the grouped GEMM kernels on first use and reports
// whether they run here (Hopper, a driver with tensor maps).
func (b *Backend) expertKernels() (*expertGemm, bool) {
	x := &b.experts
	x.once.Do(func() {
		x.bf16Out, x.err = NewGroupedGemm(b.dev)
		if x.err == nil {
			x.bf16Out.Store = 1
			x.floatOut, x.err = NewGroupedGemm(b.dev)
		}
	})
	return x, x.err == nil
}

// groupedKernel runs out = alpha·a·op(bG)ᵀ per group on the grouped GEMM
// when the call is one it serves, and reports whether it did.
func (b *Backend) groupedKernel(ot, at, bt *Tensor, groupRows []int, n, k int, transB bool, alpha, beta float64) bool {
	if !transB || beta != 0 || at.dt != backend.BFloat16 || bt.dt != backend.BFloat16 || n%8 != 0 || k%8 != 0 {
		return false
	}
	x, ok := b.expertKernels()
	if !ok || len(groupRows) > ggMaxExperts {
		return false
	}
	ps, ok := devicePtrs(ot, at, bt)
	if !ok {
		return false
	}
	// The kernel's own checks (sizes, alignment), made before committing
	// to it; the offsets' address is not known yet and is any aligned one.
	if checkGroupedGemm(ps[0], ps[1], ps[2], 16, at.shape[0], n, k, len(groupRows), 0) != nil {
		return false
	}
	rows := 0
	for _, r := range groupRows {
		rows += r
	}
	if rows == 0 {
		return true
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if staged, err := x.stageOffsets(b.dev, groupRows); !staged {
		return false
	} else if err != nil {
		b.fail(err)
		return true
	}
	gg := x.floatOut
	if ot.dt == backend.BFloat16 {
		gg = x.bf16Out
	}
	b.fail(gg.Run(ps[0], ps[1], ps[2], x.offsets.Ptr(), rows, n, k, len(groupRows), ot.dt == backend.BFloat16, float32(alpha), 0))
	return true
}

// stageOffsets writes the prefix sums of groupRows (len+1 int32) into the
// offsets buffer, allocating it on first use; x.mu is held. It reports
// false when there is no buffer (the call keeps the cuBLASLt path), and an
// error from the copy. The offsets go up through the staging slots: no
// wait for the GPU, and the buffer's previous contents were read by the
// kernels queued before this copy. StageToDevice copies the host slice
// before it returns, so it is reused.
func (x *expertGemm) stageOffsets(d *Device, groupRows []int) (bool, error) {
	x.offsetsH = append(x.offsetsH[:0], 0)
	for _, r := range groupRows {
		x.offsetsH = append(x.offsetsH, x.offsetsH[len(x.offsetsH)-1]+int32(r))
	}
	if x.offsets == nil { // room for the most experts the kernel takes
		var err error
		if x.offsets, err = d.Alloc(4 * (ggMaxExperts + 1)); err != nil {
			x.offsets = nil
			return false, nil
		}
	}
	return true, d.StageToDevice(x.offsets, 0, Bytes(x.offsetsH))
}

// close frees the offsets buffer.
func (x *expertGemm) close(d *Device) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.offsets == nil {
		return nil
	}
	err := d.Free(x.offsets)
	x.offsets = nil
	return err
}
