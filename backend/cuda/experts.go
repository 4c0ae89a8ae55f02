package cuda

// The experts' forward products on the Hopper grouped GEMM (GroupedGemm,
// kernels/grouped_gemm.cu) instead of one cuBLASLt call per expert: one
// persistent kernel over every expert, reading the group offsets on the
// device. It serves GroupedMatMul's NT case (out = a·W_gᵀ, the forward of
// w1, w3 and w2) with bf16 operands, beta 0, and sizes and addresses the
// kernel takes. bf16 outputs use the TMA-store epilogue (bn256s), the
// fastest variant measured (kernels/grouped_gemm.md).
//
// The weight gradients (GroupedMatMulTN, float32 out accumulated with beta
// 1) run on the TN kernel (GroupedGemm.RunTN) when its tiles fill their
// last wave of SMs to at least ggTNMinFill, else on one cuBLASLt product
// per expert. Measured at 3762013 (kernels/grouped_gemm.md, "The
// weight-gradient kernel"): with beta 1 the kernel took 0.93x and 0.99x
// the cuBLASLt loop's time at the fine-grained shape (5632 tiles, the
// last of 43 waves 67% full: a fill of 0.99) and 1.11x at moe-small (704
// tiles, the last of 6 waves 33% full: 0.89). Per full wave it runs at
// the loop's rate; what it loses is the idle SMs of the last wave.

import (
	"errors"
	"runtime"
	"sync"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// expertGemm is the Backend's grouped GEMM state, made on first use.
type expertGemm struct {
	once     sync.Once
	bf16Out  *GroupedGemm // bf16 outputs (bn256s) and the fused kernels
	floatOut *GroupedGemm // the register epilogue (float32 out)
	err      error        // why the kernel is not used (not Hopper, ...)
	// tnMinFill is the least last-wave fill (ggTNFill) at which the
	// weight gradients take the TN kernel: ggTNMinFill (tests move it).
	tnMinFill float64

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
			x.floatOut, x.err = NewGroupedGemm(b.dev)
		}
		x.tnMinFill = ggTNMinFill
	})
	return x, x.err == nil
}

// ReadsGroupOffsets reports whether the grouped GEMM kernel runs here
// (Hopper) and takes groups matrices [n, k] of bf16 operands: then
// GroupedMatMul's NT products and the fused MoE ops read device offsets
// in place; otherwise their cuBLASLt and unfused paths read them back.
func (b *Backend) ReadsGroupOffsets(n, k, groups int) bool {
	_, ok := b.expertKernels()
	return ok && b.OperandType() == backend.BFloat16 && groups >= 1 && groups <= ggMaxExperts && ggWidthOK(n) && ggWidthOK(k)
}

// groupedKernel runs out = alpha·a·op(bG)ᵀ per group on the grouped GEMM
// when the call is one it serves, and reports whether it did.
func (b *Backend) groupedKernel(ot, at, bt *Tensor, groups backend.Groups, n, k int, transB bool, alpha, beta float64) bool {
	if !transB || beta != 0 || at.dt != backend.BFloat16 || bt.dt != backend.BFloat16 || n%8 != 0 || k%8 != 0 {
		return false
	}
	G := groups.Len()
	x, ok := b.expertKernels()
	if !ok || G > ggMaxExperts {
		return false
	}
	ps, ok := devicePtrs(ot, at, bt)
	if !ok {
		return false
	}
	// The kernel's own checks (sizes, alignment), made before committing
	// to it; staged offsets' address is not known yet and is any aligned
	// one.
	if checkGroupedGemm(ps[0], ps[1], ps[2], 16, at.shape[0], n, k, G, 0) != nil {
		return false
	}
	gg := x.floatOut
	if ot.dt == backend.BFloat16 {
		gg = x.bf16Out
	}
	return b.withGroupOffsets(x, groups, at.shape[0], func(offsets driver.DevicePtr, rows int) error {
		return gg.Run(ps[0], ps[1], ps[2], offsets, rows, n, k, G, ot.dt == backend.BFloat16, float32(alpha), 0)
	})
}

// withGroupOffsets runs run on the group offsets of groups over operands
// of opRows rows and the rows the groups hold: Offsets where given (the
// kernels read them in place; they hold every row), else Rows' prefix sums
// staged under x.mu. A call whose groups hold no rows runs nothing. It
// reports false when the offsets cannot be staged (the call then keeps the
// cuBLASLt path); staging and launch errors go to b.fail.
func (b *Backend) withGroupOffsets(x *expertGemm, groups backend.Groups, opRows int, run func(offsets driver.DevicePtr, rows int) error) bool {
	rows := groups.Held(opRows)
	if groups.Offsets != nil {
		offs, ok := tensorOf("grouped product", "offsets", groups.Offsets).ptr()
		if ok && rows > 0 {
			b.fail(run(offs, rows))
		}
		runtime.KeepAlive(groups.Offsets)
		return true
	}
	if rows == 0 {
		return true
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if staged, err := x.stageOffsets(b.dev, groups.Rows); !staged {
		return false
	} else if err != nil {
		b.fail(err)
		return true
	}
	b.fail(run(x.offsets.Ptr(), rows))
	return true
}

// ggTNMinFill is the least fill of the TN kernel's last wave at which it
// takes the weight gradients from the cuBLASLt loop (experts.go's
// measurements: even per full wave; 0.89 lost 11%).
const ggTNMinFill = 0.95

// ggTNFill is how full the last of the waves of tiles (tiles over sms
// resident blocks, one a multiprocessor) runs: tiles / (waves * sms).
func ggTNFill(tiles int64, sms int) float64 {
	if tiles <= 0 || sms <= 0 {
		return 0
	}
	waves := (tiles + int64(sms) - 1) / int64(sms)
	return float64(tiles) / float64(waves*int64(sms))
}

// groupedKernelTN runs out[g] = alpha·a[rows of g]ᵀ·b[rows of g] +
// beta·out[g] on the weight-gradient kernel (GroupedGemm.RunTN) when the
// call is one it serves (bf16 operands, float32 out, sizes and addresses
// the kernel takes, some rows) and its tiles fill their waves (ggTNFill
// at least x.tnMinFill), and reports whether it did.
func (b *Backend) groupedKernelTN(ot, at, bt *Tensor, groups backend.Groups, m, n int, alpha, beta float64) bool {
	if ot.dt != backend.Float32 || at.dt != backend.BFloat16 || bt.dt != backend.BFloat16 {
		return false
	}
	G := groups.Len()
	x, ok := b.expertKernels()
	if !ok || ggTNFill(ggTNTiles(m, n, G), b.dev.info.SMs) < x.tnMinFill {
		return false
	}
	ps, ok := devicePtrs(ot, at, bt)
	if !ok {
		return false
	}
	rows := groups.Held(at.shape[0])
	// The kernel's own checks (sizes, alignment), made before committing
	// to it; staged offsets' address is not known yet and is any aligned
	// one. No rows (no K at all) is left to cuBLASLt's scaling path.
	if rows == 0 || checkGroupedGemmTN(ps[0], ps[1], ps[2], 16, rows, m, n, G) != nil {
		return false
	}
	return b.withGroupOffsets(x, groups, at.shape[0], func(offsets driver.DevicePtr, rows int) error {
		return x.floatOut.RunTN(ps[0], ps[1], ps[2], offsets, rows, m, n, G, float32(alpha), float32(beta))
	})
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
	var err error
	for _, g := range []*GroupedGemm{x.bf16Out, x.floatOut} {
		if g != nil {
			err = errors.Join(err, d.Do(func() error { return g.dgrad.close(d.drv) }))
		}
	}
	if x.offsets == nil {
		return err
	}
	err = errors.Join(err, d.Free(x.offsets))
	x.offsets = nil
	return err
}
