package cuda

// The Backend ops that call the device-pointer functions of this package
// rather than one kernel: MatMul (Gemm, cuBLASLt in bf16 with fp32
// accumulation), RoPE and attention.

import (
	"runtime"

	"github.com/mktrain/mktrain/backend"
)

// MatMul computes out = alpha*op(a)*op(b) + beta*out for 2-D tensors. out
// must not overlap a or b. With beta = 0 out is not read, and with
// alpha = 0 (or an empty inner dimension) neither are a and b. a, b and
// out may each be bfloat16 (out only with beta = 0): a bf16 operand goes
// to cuBLASLt as it is, a float32 one is rounded to bf16 first, and a bf16
// out is rounded from the fp32 accumulators (Gemm.MatMulTypes).
func (b *Backend) MatMul(out, a, bb backend.Tensor, transA, transB bool, alpha, beta float64) {
	const op = "MatMul"
	at, _, _ := operandMatrix(op, "a", a)
	bt, _, _ := operandMatrix(op, "b", bb)
	ot, _, _ := operandMatrix(op, "out", out)
	m, n, k, err := backend.MatMulDims(out, a, bb, transA, transB)
	if err != nil {
		fail(op, "%v", err)
	}
	if ot.dt == backend.BFloat16 && beta != 0 {
		fail(op, "out is bfloat16, which needs beta = 0 (got %v)", beta)
	}
	if overlaps(ot, at) || overlaps(ot, bt) {
		fail(op, "out (%s) overlaps an input (a %s, b %s)", ot.describe(), at.describe(), bt.describe())
	}
	ps, ok := devicePtrs(ot, at, bt)
	if !ok {
		return
	}
	types := GemmTypes{Out: ot.dt, A: at.dt, B: bt.dt}
	b.fail(b.gemm.MatMulTypes(types, ps[0], ps[1], ps[2], m, n, k, transA, transB, float32(alpha), float32(beta)))
	runtime.KeepAlive(ot)
	runtime.KeepAlive(at)
	runtime.KeepAlive(bt)
}

// RoPE writes outTQ = xTQ rotated at the positions posT (rotate-half
// convention); inverse rotates back. out is x (in place) or a float32 or
// bf16 tensor that does not overlap it.
func (b *Backend) RoPE(outTQ, xTQ, posT backend.Tensor, headDim int, theta float64, inverse bool) {
	const op = "RoPE"
	x, t, q := matrix(op, "x", xTQ)
	out := wantOperandMatrix(op, "out", outTQ, t, q)
	if headDim <= 0 || headDim%2 != 0 || q%headDim != 0 {
		fail(op, "head dim %d must be even and positive and divide the row width %d of x %v", headDim, q, x.shape)
	}
	if theta <= 0 {
		fail(op, "theta %v must be positive", theta)
	}
	pos := indices(op, "pos", posT, t)
	if overlaps(out, x) && (out.off != x.off || out.dt != x.dt) {
		fail(op, "out (%s) overlaps x (%s) without being x itself", out.describe(), x.describe())
	}
	if t == 0 || q == 0 {
		return
	}
	ps, ok := devicePtrs(out, x, pos)
	if !ok {
		return
	}
	b.fail(RoPE(b.dev, ps[0], ps[1], ps[2], t, q, headDim, theta, inverse, out.dt == backend.BFloat16))
	runtime.KeepAlive(out)
	runtime.KeepAlive(x)
	runtime.KeepAlive(pos)
}

// attnArg is a token-major attention argument and the number of heads of
// width HeadDim in each of its rows.
type attnArg struct {
	name    string
	t       backend.Tensor
	heads   int
	keys    bool // k, v and their gradients: Batch*Keys() rows, not Batch*Seq
	operand bool // q, k and v: float32 or bfloat16
}

// checkAttn panics unless s is well formed and every tensor holds exactly
// what s says, and returns the tensors in argument order, lse last.
func checkAttn(op string, s backend.AttnShape, lseBHS backend.Tensor, args ...attnArg) []*Tensor {
	if s.Batch < 1 || s.Seq < 1 || s.Heads < 1 || s.KVHeads < 1 || s.HeadDim < 1 || s.Heads%s.KVHeads != 0 {
		fail(op, "attention shape %+v: all sizes must be positive and KVHeads must divide Heads", s)
	}
	if s.KVSeq < 0 || s.QOffset < 0 || s.QOffset+s.Seq > s.Keys() {
		fail(op, "attention shape %+v: need 0 <= QOffset and QOffset+Seq <= KVSeq", s)
	}
	var ts []*Tensor
	for _, a := range args {
		rows := s.Batch * s.Seq
		if a.keys {
			rows = s.Batch * s.Keys()
		}
		if !a.operand {
			ts = append(ts, vector(op, a.name, a.t, rows*a.heads*s.HeadDim))
			continue
		}
		ct := operand(op, a.name, a.t)
		if n := rows * a.heads * s.HeadDim; ct.Len() != n {
			fail(op, "%s has shape %v (%d elements), want %d elements", a.name, ct.shape, ct.Len(), n)
		}
		ts = append(ts, ct)
	}
	return append(ts, vector(op, "lse", lseBHS, s.Batch*s.Heads*s.Seq))
}

// AttentionForward computes causal GQA attention (see backend.Backend).
func (b *Backend) AttentionForward(outTQ, lseBHS, qTQ, kTK, vTK backend.Tensor, s backend.AttnShape) {
	const op = "AttentionForward"
	ts := checkAttn(op, s, lseBHS, attnArg{"out", outTQ, s.Heads, false, true},
		attnArg{"q", qTQ, s.Heads, false, true}, attnArg{"k", kTK, s.KVHeads, true, true}, attnArg{"v", vTK, s.KVHeads, true, true})
	sameDType(op, "q", ts[1], "k", ts[2])
	sameDType(op, "q", ts[1], "v", ts[3])
	outBF16 := ts[0].dt == backend.BFloat16
	if outBF16 && ts[1].dt != backend.BFloat16 {
		fail(op, "out is bfloat16 but q is %v; a bf16 out goes with bf16 q, k and v", ts[1].dt)
	}
	ps, ok := devicePtrs(ts...)
	if !ok {
		return
	}
	out, q, k, v, lse := ps[0], ps[1], ps[2], ps[3], ps[4]
	if ts[1].dt == backend.BFloat16 {
		b.fail(AttentionForwardBF16(b.dev, out, lse, q, k, v, s, outBF16))
	} else {
		b.fail(AttentionForward(b.dev, out, lse, q, k, v, s))
	}
	runtime.KeepAlive(ts)
}

// AttentionBackward writes dq, dk and dv (see backend.Backend).
func (b *Backend) AttentionBackward(dqTQ, dkTK, dvTK, doutTQ, qTQ, kTK, vTK, outTQ, lseBHS backend.Tensor, s backend.AttnShape) {
	const op = "AttentionBackward"
	ts := checkAttn(op, s, lseBHS,
		attnArg{"dq", dqTQ, s.Heads, false, false}, attnArg{"dk", dkTK, s.KVHeads, true, false}, attnArg{"dv", dvTK, s.KVHeads, true, false},
		attnArg{"dout", doutTQ, s.Heads, false, true}, attnArg{"q", qTQ, s.Heads, false, true}, attnArg{"k", kTK, s.KVHeads, true, true},
		attnArg{"v", vTK, s.KVHeads, true, true}, attnArg{"out", outTQ, s.Heads, false, true})
	sameDType(op, "q", ts[4], "k", ts[5])
	sameDType(op, "q", ts[4], "v", ts[6])
	in := attnBwdInputs{dout: ts[3].dt == backend.BFloat16, out: ts[7].dt == backend.BFloat16}
	if (in.dout || in.out) && ts[4].dt != backend.BFloat16 {
		fail(op, "dout is %v and out %v but q is %v; a bf16 dout or out goes with bf16 q, k and v", ts[3].dt, ts[7].dt, ts[4].dt)
	}
	if in.out && !in.dout {
		fail(op, "out is bfloat16 but dout is %v; a bf16 out goes with a bf16 dout", ts[3].dt)
	}
	ps, ok := devicePtrs(ts...)
	if !ok {
		return
	}
	dq, dk, dv, dout, q, k, v, out, lse := ps[0], ps[1], ps[2], ps[3], ps[4], ps[5], ps[6], ps[7], ps[8]
	if ts[4].dt == backend.BFloat16 {
		b.fail(AttentionBackwardBF16(b.dev, dq, dk, dv, dout, q, k, v, out, lse, s, b.deterministic.Load(), in))
	} else if b.deterministic.Load() {
		b.fail(AttentionBackwardOrdered(b.dev, dq, dk, dv, dout, q, k, v, out, lse, s))
	} else {
		b.fail(AttentionBackward(b.dev, dq, dk, dv, dout, q, k, v, out, lse, s))
	}
	runtime.KeepAlive(ts)
}

// GroupedMatMul runs one cuBLASLt product per group of rows (see
// backend.Backend and Gemm.GroupedMatMul): the MoE experts' forward and
// input-gradient products, whose row counts change every step.
func (b *Backend) GroupedMatMul(outRN, aRK, bG backend.Tensor, groups backend.Groups, transB bool, alpha, beta float64) {
	const op = "GroupedMatMul"
	at, _, _ := operandMatrix(op, "a", aRK)
	bt, _, _ := operandMatrix(op, "b", bG)
	ot, _, _ := operandMatrix(op, "out", outRN)
	n, k, err := backend.GroupedMatMulDims(outRN, aRK, bG, groups, transB)
	if err != nil {
		fail(op, "%v", err)
	}
	b.checkGroupedOut(op, ot, at, bt, beta)
	if b.groupedKernel(ot, at, bt, groups, n, k, transB, alpha, beta) {
		runtime.KeepAlive(ot)
		runtime.KeepAlive(at)
		runtime.KeepAlive(bt)
		return
	}
	groupRows := b.hostGroupRows(op, groups, at.shape[0])
	ps, ok := devicePtrs(ot, at, bt)
	if !ok {
		return
	}
	types := GemmTypes{Out: ot.dt, A: at.dt, B: bt.dt}
	b.fail(b.gemm.GroupedMatMul(types, ps[0], ps[1], ps[2], groupRows, n, k, transB, float32(alpha), float32(beta)))
	runtime.KeepAlive(ot)
	runtime.KeepAlive(at)
	runtime.KeepAlive(bt)
}

// GroupedMatMulTN runs the experts' weight gradients (see
// backend.Backend): on the TN grouped kernel where experts.go's rule
// picks it (groupedKernelTN), else one cuBLASLt product per group
// (Gemm.GroupedMatMulTN).
func (b *Backend) GroupedMatMulTN(outGMN, aRM, bRN backend.Tensor, groups backend.Groups, alpha, beta float64) {
	const op = "GroupedMatMulTN"
	at, _, _ := operandMatrix(op, "a", aRM)
	bt, _, _ := operandMatrix(op, "b", bRN)
	ot, _, _ := operandMatrix(op, "out", outGMN)
	m, n, err := backend.GroupedMatMulTNDims(outGMN, aRM, bRN, groups)
	if err != nil {
		fail(op, "%v", err)
	}
	if ot.dt == backend.BFloat16 {
		fail(op, "out is bfloat16; the weight gradients it accumulates are float32")
	}
	b.checkGroupedOut(op, ot, at, bt, beta)
	if b.groupedKernelTN(ot, at, bt, groups, m, n, alpha, beta) {
		runtime.KeepAlive(ot)
		runtime.KeepAlive(at)
		runtime.KeepAlive(bt)
		return
	}
	groupRows := b.hostGroupRows(op, groups, at.shape[0])
	ps, ok := devicePtrs(ot, at, bt)
	if !ok {
		return
	}
	types := GemmTypes{Out: ot.dt, A: at.dt, B: bt.dt}
	b.fail(b.gemm.GroupedMatMulTN(types, ps[0], ps[1], ps[2], groupRows, m, n, float32(alpha), float32(beta)))
	runtime.KeepAlive(ot)
	runtime.KeepAlive(at)
	runtime.KeepAlive(bt)
}

// hostGroupRows is groups' row counts on the host, for the paths that
// loop over the groups there: Rows, or Offsets read back, which waits for
// the GPU (backend.GroupRows).
func (b *Backend) hostGroupRows(op string, groups backend.Groups, rows int) []int {
	groupRows, err := backend.GroupRows(b, groups, rows)
	if err != nil {
		fail(op, "%v", err)
	}
	return groupRows
}

// checkGroupedOut applies MatMul's rules on out to a grouped product.
func (b *Backend) checkGroupedOut(op string, ot, at, bt *Tensor, beta float64) {
	if ot.dt == backend.BFloat16 && beta != 0 {
		fail(op, "out is bfloat16, which needs beta = 0 (got %v)", beta)
	}
	if overlaps(ot, at) || overlaps(ot, bt) {
		fail(op, "out (%s) overlaps an input (a %s, b %s)", ot.describe(), at.describe(), bt.describe())
	}
}
