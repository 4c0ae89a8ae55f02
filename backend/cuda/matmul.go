package cuda

// Row-major matrix products on raw device pointers, through cuBLASLt.
//
// cuBLASLt is column-major, and a row-major [r, c] matrix read column-major
// is its transpose, [c, r]. So out[m,n] = op(a)·op(b) (row-major) is asked
// of cuBLASLt as outᵀ[n,m] = op(b)ᵀ·op(a)ᵀ: the operands swap places, and
// each keeps its own transpose flag (planRowMajor spells it out).
//
// In the default precision a and b are first rounded to bfloat16 into two
// scratch buffers the Gemm owns (kernels/convert_vec.cu, or convert.cu for
// unaligned views), then multiplied on the tensor cores with fp32
// accumulation into the fp32 out. Operands already stored in bf16
// (MatMulTypes) skip their conversion, and a bf16 out is written by
// cuBLASLt directly. cuBLASLt picks an algorithm per problem with a
// heuristic query, which costs far more than a product of moderate size;
// the answer is cached per shape, transposes, types and pointer alignment.

import (
	"errors"
	"fmt"
	"math/bits"
	"sync"
	"sync/atomic"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/kernels"
)

// GemmPrecision says what a Gemm's MatMul multiplies.
type GemmPrecision int

const (
	// GemmBF16 rounds a and b to bfloat16 (to nearest, ties to even), then
	// multiplies on the tensor cores with fp32 products and accumulation,
	// fp32 alpha and beta, and an fp32 out. The default.
	GemmBF16 GemmPrecision = iota
	// GemmFP32 multiplies the fp32 inputs as they are, with fp32 products
	// and accumulation and no TF32 rounding: many times slower, exact up to
	// fp32 rounding. Tests use it to tell conversion error from GEMM bugs.
	GemmFP32
)

func (p GemmPrecision) String() string {
	switch p {
	case GemmBF16:
		return "bf16"
	case GemmFP32:
		return "fp32"
	}
	return fmt.Sprintf("GemmPrecision(%d)", int(p))
}

// DefaultGemmWorkspace is the cuBLASLt workspace a Gemm allocates unless
// told otherwise: 32 MiB, NVIDIA's recommendation for Hopper.
const DefaultGemmWorkspace = 32 << 20

// maxGemmShapes bounds the algorithm cache. Training uses a few dozen
// shapes; token-count-dependent shapes (one per expert load) could
// otherwise grow it without end.
const maxGemmShapes = 4096

// GemmOptions configures NewGemmWith. The zero value is NewGemm's default.
type GemmOptions struct {
	// Precision is GemmBF16 (the zero value) or GemmFP32.
	Precision GemmPrecision
	// WorkspaceBytes is cuBLASLt's scratch memory; 0 means
	// DefaultGemmWorkspace. Algorithms that need more are not chosen.
	WorkspaceBytes int64
	// Search says where libcublasLt is looked for (see package driver);
	// the zero value searches the process environment.
	Search driver.Search
	// NoAutotune takes cuBLASLt's first choice for every product. By
	// default a product of at least autotuneMinFLOPs whose sizes are all
	// multiples of autotuneMultiple times cuBLASLt's best few candidates
	// the first time it comes and keeps the fastest for those exact sizes,
	// so two runs may pick different algorithms for a shape (and round
	// differently); set it for runs that must repeat bit for bit.
	NoAutotune bool
}

// autotuneCandidates is how many of cuBLASLt's algorithms an autotuned
// product times; autotuneMinFLOPs the least work (2mnk) worth timing;
// autotuneRuns how many products each candidate's time averages.
const (
	autotuneCandidates = 8
	autotuneMinFLOPs   = 1 << 31
	autotuneRuns       = 3
	autotuneMultiple   = 128
)

// Gemm runs row-major matrix products on one Device's stream. It owns a
// cuBLASLt handle, a workspace, the bf16 copies of its inputs (grown to the
// largest operands seen) and the cache of chosen algorithms. Its methods are
// safe for concurrent use. Close it before its Device.
type Gemm struct {
	d       *Device
	lt      *cublasLt
	opts    GemmOptions
	version int

	toBF16   *Kernel // f32_to_bf16, for any alignment
	toBF16x4 *Kernel // f32_to_bf16_x4: the same bits, 16 bytes a load
	toF32    *Kernel // bf16_to_f32: a bf16 operand beside an fp32 one, in GemmFP32
	scale    *Kernel // scale_f32

	// mu is held while a call queues its work, so the scratch buffers are
	// used by one call after another in queue order; it also guards the
	// fields below.
	mu                 sync.Mutex
	closed             bool
	workspace          *Buffer
	scratchA, scratchB *Buffer
	tuneOut            *Buffer // where autotuning's trial products write
	algos              algoCache
	// noTune turns autotuning off after construction, as
	// GemmOptions.NoAutotune does (Backend.SetDeterministic).
	noTune atomic.Bool

	// cuBLASLt objects, touched only on the device thread. The layouts and
	// the operation descriptor are set afresh for every call.
	handle           ltHandle
	desc             ltMatmulDesc
	layA, layB, layC ltLayout
	pref             ltPreference
}

// NewGemm is NewGemmWith(d, GemmOptions{}): bf16 inputs, a 32 MiB
// workspace, cuBLASLt found in the process environment.
func NewGemm(d *Device) (*Gemm, error) { return NewGemmWith(d, GemmOptions{}) }

// NewGemmWith loads cuBLASLt, compiles the conversion kernels and sets up
// a Gemm on d.
func NewGemmWith(d *Device, o GemmOptions) (*Gemm, error) {
	if o.Precision != GemmBF16 && o.Precision != GemmFP32 {
		return nil, fmt.Errorf("cuda: GemmOptions.Precision is %v; use GemmBF16 or GemmFP32", o.Precision)
	}
	if o.WorkspaceBytes < 0 {
		return nil, fmt.Errorf("cuda: GemmOptions.WorkspaceBytes is %d; it must be 0 (the default, %d) or positive", o.WorkspaceBytes, DefaultGemmWorkspace)
	}
	if o.WorkspaceBytes == 0 {
		o.WorkspaceBytes = DefaultGemmWorkspace
	}
	lt, err := loadCublasLt(o.Search)
	if err != nil {
		return nil, err
	}
	g := &Gemm{d: d, lt: lt, opts: o, version: lt.Version(), algos: algoCache{limit: maxGemmShapes}}
	if g.toBF16, err = gemmKernel(d, "convert.cu", "f32_to_bf16"); err != nil {
		return nil, err
	}
	if g.toBF16x4, err = gemmKernel(d, "convert_vec.cu", "f32_to_bf16_x4"); err != nil {
		return nil, err
	}
	if g.toF32, err = gemmKernel(d, "convert.cu", "bf16_to_f32"); err != nil {
		return nil, err
	}
	if g.scale, err = gemmKernel(d, "elementwise.cu", "scale_f32"); err != nil {
		return nil, err
	}
	if g.workspace, err = d.Alloc(o.WorkspaceBytes); err != nil {
		return nil, err
	}
	if err := d.Do(g.create); err != nil {
		return nil, errors.Join(err, d.Free(g.workspace), d.Do(g.destroy))
	}
	return g, nil
}

func gemmKernel(d *Device, file, name string) (*Kernel, error) {
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

// create runs on the device thread. On failure the caller runs destroy,
// which skips what was not made.
func (g *Gemm) create() error {
	lt := g.lt
	var err error
	if g.handle, err = lt.Create(); err != nil {
		return err
	}
	if g.desc, err = lt.MatmulDescCreate(cublasCompute32F, cudaR32F); err != nil {
		return err
	}
	for _, l := range []*ltLayout{&g.layA, &g.layB, &g.layC} {
		if *l, err = lt.LayoutCreate(cudaR32F, 1, 1, 1); err != nil {
			return err
		}
	}
	if g.pref, err = lt.PreferenceCreate(); err != nil {
		return err
	}
	return lt.PreferenceSetUint64(g.pref, ltPrefMaxWorkspaceBytes, uint64(g.opts.WorkspaceBytes))
}

// destroy runs on the device thread.
func (g *Gemm) destroy() error {
	lt := g.lt
	var errs []error
	if g.pref != 0 {
		errs = append(errs, lt.PreferenceDestroy(g.pref))
	}
	for _, l := range []ltLayout{g.layA, g.layB, g.layC} {
		if l != 0 {
			errs = append(errs, lt.LayoutDestroy(l))
		}
	}
	if g.desc != 0 {
		errs = append(errs, lt.MatmulDescDestroy(g.desc))
	}
	if g.handle != 0 {
		errs = append(errs, lt.Destroy(g.handle))
	}
	g.pref, g.layA, g.layB, g.layC, g.desc, g.handle = 0, 0, 0, 0, 0, 0
	return errors.Join(errs...)
}

// Close frees the Gemm's memory and cuBLASLt objects once the work queued
// before it has run. Closing twice does nothing.
func (g *Gemm) Close() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil
	}
	g.closed = true
	var errs []error
	for _, b := range []*Buffer{g.scratchA, g.scratchB, g.tuneOut, g.workspace} {
		if b != nil {
			errs = append(errs, g.d.Free(b))
		}
	}
	g.scratchA, g.scratchB, g.tuneOut, g.workspace = nil, nil, nil, nil
	errs = append(errs, g.d.Do(g.destroy))
	return errors.Join(errs...)
}

// Precision is what MatMul multiplies.
func (g *Gemm) Precision() GemmPrecision { return g.opts.Precision }

// CublasLtVersion is the loaded cuBLASLt's version, major*10000 +
// minor*100 + patch (e.g. 130100).
func (g *Gemm) CublasLtVersion() int { return g.version }

// CublasLtPath is the libcublasLt file that was loaded.
func (g *Gemm) CublasLtPath() string { return g.lt.lib.Path }

// MatMul queues out = alpha*op(a)*op(b) + beta*out on the device's stream,
// for row-major float32 matrices: out is [m,n]; a is [m,k], or [k,m] read
// transposed when transA; b is [k,n], or [n,k] read transposed when transB.
// As in BLAS (and backend/cpu), beta = 0 does not read out, and alpha = 0 or
// k = 0 reads neither a nor b (out = beta*out). With GemmBF16, out may
// overlap a or b (they are copied first); with GemmFP32 it must not.
//
// Argument errors and cuBLASLt's refusal of a shape return at once;
// failures while the product runs return from the next Sync.
func (g *Gemm) MatMul(out, a, b driver.DevicePtr, m, n, k int, transA, transB bool, alpha, beta float32) error {
	return g.MatMulTypes(GemmTypes{}, out, a, b, m, n, k, transA, transB, alpha, beta)
}

// MatMulBF16 is MatMul on operands already in bfloat16 (a and b point at
// 16-bit words, e.g. weights rounded once per step), whatever the Gemm's
// precision: no conversion and no scratch. out must not overlap a or b.
func (g *Gemm) MatMulBF16(out, a, b driver.DevicePtr, m, n, k int, transA, transB bool, alpha, beta float32) error {
	t := GemmTypes{A: backend.BFloat16, B: backend.BFloat16}
	return g.MatMulTypes(t, out, a, b, m, n, k, transA, transB, alpha, beta)
}

// GemmTypes says how each matrix of a product is stored: backend.Float32
// or backend.BFloat16 (16-bit words); the zero value means Float32 for
// all three.
type GemmTypes struct {
	Out, A, B backend.DType
}

func (t GemmTypes) bf16() (out, a, b bool) {
	return t.Out == backend.BFloat16, t.A == backend.BFloat16, t.B == backend.BFloat16
}

func (t GemmTypes) check() error {
	for _, x := range []struct {
		name string
		dt   backend.DType
	}{{"out", t.Out}, {"a", t.A}, {"b", t.B}} {
		if x.dt != 0 && x.dt != backend.Float32 && x.dt != backend.BFloat16 {
			return fmt.Errorf("cuda: MatMul: %s is stored as %v; the GPU multiplies float32 and bfloat16", x.name, x.dt)
		}
	}
	return nil
}

// MatMulTypes is MatMul on matrices stored as t says. What cuBLASLt reads
// is bf16 in GemmBF16 precision (a float32 operand is rounded into
// scratch, a bf16 one read as it is) and in GemmFP32 precision when both
// operands are bf16; else float32 (a bf16 operand is widened into scratch,
// exactly). A bf16 out is written by cuBLASLt from its fp32 accumulators,
// rounded to nearest even; it needs bf16 reads and beta = 0. out may
// overlap an operand that is converted, not one read as it is.
func (g *Gemm) MatMulTypes(t GemmTypes, out, a, b driver.DevicePtr, m, n, k int, transA, transB bool, alpha, beta float32) error {
	if err := t.check(); err != nil {
		return err
	}
	return g.matmul(g.typedCall(t, out, a, b, m, n, k, transA, transB, alpha, beta))
}

// GroupedMatMul runs one product per group of rows (backend.Backend's
// GroupedMatMul on device pointers): group g is the rows [o_g,
// o_g+groupRows[g]) of a ([R, k]) and out ([R, n]), times block g of b
// ([G*n, k] read transposed when transB, else [G*k, n]). The products are
// ragged: their algorithms are cuBLASLt's heuristic choices per size
// bucket, never autotuned (see autotunes).
func (g *Gemm) GroupedMatMul(t GemmTypes, out, a, b driver.DevicePtr, groupRows []int, n, k int, transB bool, alpha, beta float32) error {
	if err := t.check(); err != nil {
		return err
	}
	outB, aB, bB := int64(dtypeBytes(t.Out)), int64(dtypeBytes(t.A)), int64(dtypeBytes(t.B))
	off := int64(0)
	for gi, rows := range groupRows {
		if rows > 0 {
			c := g.typedCall(t, out+driver.DevicePtr(off*int64(n)*outB), a+driver.DevicePtr(off*int64(k)*aB),
				b+driver.DevicePtr(int64(gi)*int64(n)*int64(k)*bB), rows, n, k, false, transB, alpha, beta)
			c.ragged = true
			if err := g.matmul(c); err != nil {
				return fmt.Errorf("group %d: %w", gi, err)
			}
		}
		off += int64(rows)
	}
	return nil
}

// GroupedMatMulTN is backend.Backend's GroupedMatMulTN on device
// pointers: for every group g, block g of out ([G*m, n]) = alpha *
// a[o_g:o_g+n_g]ᵀ·b[o_g:o_g+n_g] + beta*block g, with a [R, m] and b [R,
// n]; an empty group's block is scaled by beta. Ragged, like
// GroupedMatMul.
func (g *Gemm) GroupedMatMulTN(t GemmTypes, out, a, b driver.DevicePtr, groupRows []int, m, n int, alpha, beta float32) error {
	if err := t.check(); err != nil {
		return err
	}
	outB, aB, bB := int64(dtypeBytes(t.Out)), int64(dtypeBytes(t.A)), int64(dtypeBytes(t.B))
	off := int64(0)
	for gi, rows := range groupRows {
		c := g.typedCall(t, out+driver.DevicePtr(int64(gi)*int64(m)*int64(n)*outB), a+driver.DevicePtr(off*int64(m)*aB),
			b+driver.DevicePtr(off*int64(n)*bB), m, n, rows, true, false, alpha, beta)
		c.ragged = true
		if err := g.matmul(c); err != nil {
			return fmt.Errorf("group %d: %w", gi, err)
		}
		off += int64(rows)
	}
	return nil
}

// typedCall is the gemmCall of one product on matrices stored as t says.
func (g *Gemm) typedCall(t GemmTypes, out, a, b driver.DevicePtr, m, n, k int, transA, transB bool, alpha, beta float32) gemmCall {
	c := gemmCall{out: out, a: a, b: b, m: m, n: n, k: k, transA: transA, transB: transB, alpha: alpha, beta: beta}
	c.outBF16, c.aBF16, c.bBF16 = t.bf16()
	c.bf16 = g.opts.Precision == GemmBF16 || (c.aBF16 && c.bBF16)
	return c
}

func (g *Gemm) matmul(c gemmCall) error {
	if err := c.validate(); err != nil {
		return err
	}
	if c.m == 0 || c.n == 0 {
		return nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return fmt.Errorf("cuda: MatMul on a closed Gemm")
	}
	if c.k == 0 || c.alpha == 0 {
		return g.scaleOut(c)
	}
	if c.convA() {
		p, err := g.convertInto(&g.scratchA, c.a, int64(c.m)*int64(c.k), c.bf16)
		if err != nil {
			return err
		}
		c.a = p
	}
	if c.convB() {
		p, err := g.convertInto(&g.scratchB, c.b, int64(c.k)*int64(c.n), c.bf16)
		if err != nil {
			return err
		}
		c.b = p
	}
	return g.run(c)
}

// convertInto converts n elements at src into the scratch buffer *buf
// (grown to fit) and returns its address: rounding float32 to bf16 when
// toBF16, else widening bf16 to float32.
func (g *Gemm) convertInto(buf **Buffer, src driver.DevicePtr, n int64, toBF16 bool) (driver.DevicePtr, error) {
	size := int64(4)
	if toBF16 {
		size = 2
	}
	if err := g.grow(buf, size*n); err != nil {
		return 0, err
	}
	dst := *buf
	if !toBF16 {
		return dst.ptr, g.d.Launch(g.toF32, g.d.StrideGrid(n, 256, 4), dst, src, n)
	}
	return dst.ptr, g.convert(dst, src, n)
}

// scaleOut is the product without a term of a and b: out = beta*out. A
// bf16 out has beta = 0 (validate).
func (g *Gemm) scaleOut(c gemmCall) error {
	n := int64(c.m) * int64(c.n)
	switch {
	case c.outBF16:
		d, out := g.d, c.out
		return d.Submit(func() error { return d.drv.MemsetD8Async(out, 0, int(2*n), d.stream) })
	case c.beta == 1:
		return nil
	case c.beta == 0:
		d, out := g.d, c.out
		return d.Submit(func() error { return d.drv.MemsetD32Async(out, 0, int(n), d.stream) })
	}
	return g.d.Launch(g.scale, g.d.StrideGrid(n, 256, 4), c.out, c.beta, n)
}

// grow makes *buf hold at least bytes. The old buffer is freed in queue
// order, after the work that used it.
func (g *Gemm) grow(buf **Buffer, bytes int64) error {
	if *buf != nil && (*buf).Size() >= bytes {
		return nil
	}
	if *buf != nil {
		if err := g.d.Free(*buf); err != nil {
			return err
		}
		*buf = nil
	}
	b, err := g.d.Alloc(bytes)
	if err != nil {
		return err
	}
	*buf = b
	return nil
}

// convert rounds n float32s at src into dst (a scratch buffer, so 256-byte
// aligned): four at a time when src is 16-byte aligned, which tensors from
// the allocator are, else one at a time (views at odd offsets). Both
// kernels round the same way, bit for bit.
func (g *Gemm) convert(dst *Buffer, src driver.DevicePtr, n int64) error {
	return g.roundToBF16(dst.ptr, src, n)
}

// roundToBF16 queues the rounding of n float32s at src into bf16 at dst,
// for any alignment (the backend's Copy into a bf16 tensor uses it too).
func (g *Gemm) roundToBF16(dst, src driver.DevicePtr, n int64) error {
	if src%16 == 0 && dst%8 == 0 {
		return g.d.Launch(g.toBF16x4, g.d.StrideGrid((n+3)/4, 256, 8), dst, src, n)
	}
	return g.d.Launch(g.toBF16, g.d.StrideGrid(n, 256, 4), dst, src, n)
}

// run queues the cuBLASLt call, asking for an algorithm first if the
// shape's bucket is new (see gemmCall.key). An algorithm chosen for another
// shape of the bucket that cuBLASLt refuses for this one is replaced by one
// asked for this exact shape, on the device thread, before the product runs.
func (g *Gemm) run(c gemmCall) error {
	p := planRowMajor(c.m, c.n, c.k, c.transA, c.transB)
	key := c.key()
	if g.autotunes(c) {
		key = c.tuneKey()
	}
	algo, ok := g.algos.get(key)
	if !ok {
		var tuneOut driver.DevicePtr
		if key.tuned {
			outBytes := int64(4)
			if c.outBF16 {
				outBytes = 2
			}
			if err := g.grow(&g.tuneOut, outBytes*int64(c.m)*int64(c.n)); err != nil {
				return err
			}
			tuneOut = g.tuneOut.ptr
		}
		err := g.d.Do(func() error {
			var err error
			if tuneOut != 0 {
				algo, err = g.tune(c, p, tuneOut)
			} else {
				algo, err = g.heuristic(c, p)
			}
			return err
		})
		if err != nil {
			return err
		}
		algo.exact = c.exactShape()
		g.algos.put(key, algo)
	}
	d, lt, ws := g.d, g.lt, g.workspace.ptr
	return d.Submit(func() error {
		if err := g.describe(c, p); err != nil {
			return err
		}
		// cuBLASLt's A is the caller's b and its B the caller's a.
		matmul := func(a chosenAlgo) CublasStatus {
			return lt.Matmul(g.handle, g.desc, c.alpha, c.b, g.layA, c.a, g.layB, c.beta, c.out, g.layC,
				&a.algo, ws, a.workspace, d.stream)
		}
		s := matmul(algo)
		if s != CublasSuccess && algo.exact != c.exactShape() {
			exact, err := g.heuristic(c, p)
			if err != nil {
				return err
			}
			if err := g.describe(c, p); err != nil {
				return err
			}
			s = matmul(exact)
		}
		return ltCheck(s, "cublasLtMatmul", c.String)
	})
}

// describe sets the descriptors for c; it runs on the device thread.
func (g *Gemm) describe(c gemmCall, p ltPlan) error {
	lt := g.lt
	in := uint32(cudaR32F)
	if c.bf16 {
		in = cudaR16BF
	}
	if err := lt.MatmulDescSetInt32(g.desc, ltDescTransA, p.a.op()); err != nil {
		return err
	}
	if err := lt.MatmulDescSetInt32(g.desc, ltDescTransB, p.b.op()); err != nil {
		return err
	}
	if err := lt.LayoutSet(g.layA, in, uint64(p.a.rows), uint64(p.a.cols), int64(p.a.ld)); err != nil {
		return err
	}
	if err := lt.LayoutSet(g.layB, in, uint64(p.b.rows), uint64(p.b.cols), int64(p.b.ld)); err != nil {
		return err
	}
	// C and D share one layout (out is both).
	outType := uint32(cudaR32F)
	if c.outBF16 {
		outType = cudaR16BF
	}
	return lt.LayoutSet(g.layC, outType, uint64(p.c.rows), uint64(p.c.cols), int64(p.c.ld))
}

// heuristic asks cuBLASLt for the best algorithm for c; it runs on the
// device thread.
func (g *Gemm) heuristic(c gemmCall, p ltPlan) (chosenAlgo, error) {
	if err := g.describe(c, p); err != nil {
		return chosenAlgo{}, err
	}
	lt := g.lt
	for _, a := range []struct {
		attr int
		ptr  driver.DevicePtr
	}{
		{ltPrefMinAlignmentA, c.b}, {ltPrefMinAlignmentB, c.a},
		{ltPrefMinAlignmentC, c.out}, {ltPrefMinAlignmentD, c.out},
	} {
		if err := lt.PreferenceSetUint32(g.pref, a.attr, ptrAlign(a.ptr)); err != nil {
			return chosenAlgo{}, err
		}
	}
	res, found, err := lt.AlgoGetHeuristic(g.handle, g.desc, g.layA, g.layB, g.layC, g.pref)
	var ce *CublasError
	if errors.As(err, &ce) {
		ce.Detail = c.String()
	}
	switch {
	case err != nil:
		return chosenAlgo{}, err
	case !found:
		return chosenAlgo{}, fmt.Errorf("cuda: cuBLASLt %d has no algorithm for MatMul(%s)", g.version, c)
	case res.state != CublasSuccess:
		return chosenAlgo{}, &CublasError{Call: "cublasLtMatmulAlgoGetHeuristic", Status: res.state, Detail: c.String()}
	case res.workspaceSize > uint64(g.opts.WorkspaceBytes):
		return chosenAlgo{}, fmt.Errorf("cuda: cuBLASLt chose an algorithm needing %d bytes of workspace, over the %d allowed, for MatMul(%s)",
			res.workspaceSize, g.opts.WorkspaceBytes, c)
	}
	return chosenAlgo{algo: res.algo, workspace: res.workspaceSize}, nil
}

// autotunes reports whether c's algorithm is chosen by timing: products of
// at least autotuneMinFLOPs whose sizes are all multiples of
// autotuneMultiple, outside grouped products. Those are the model's own
// dimensions, the same every step (attention projections, LM head). A MoE
// expert's rows change every step, so its products (GroupedMatMul, ragged)
// keep the heuristic's choice per size bucket: timing each count that
// happens to be a multiple of 128 cost a stalled step now and then, with
// candidates that ran for milliseconds, for a shape that may never recur.
func (g *Gemm) autotunes(c gemmCall) bool {
	return !g.opts.NoAutotune && !g.noTune.Load() && !c.ragged && 2*float64(c.m)*float64(c.n)*float64(c.k) >= autotuneMinFLOPs &&
		c.m%autotuneMultiple == 0 && c.n%autotuneMultiple == 0 && c.k%autotuneMultiple == 0
}

// tune asks cuBLASLt for its best autotuneCandidates algorithms for c, times
// each (autotuneRuns products into tuneOut, with beta 0 so that nothing is
// read from it, after one untimed product) and returns the fastest; it runs
// on the device thread and waits for the GPU. It falls back to the
// heuristic's first choice when there is nothing to choose from.
func (g *Gemm) tune(c gemmCall, p ltPlan, tuneOut driver.DevicePtr) (chosenAlgo, error) {
	first, err := g.heuristic(c, p) // also sets the descriptors and preferences
	if err != nil {
		return first, err
	}
	lt, d := g.lt, g.d
	res, err := lt.AlgoGetHeuristics(g.handle, g.desc, g.layA, g.layB, g.layC, g.pref, autotuneCandidates)
	if err != nil || len(res) < 2 {
		return first, nil
	}
	start, err := d.drv.EventCreate(0)
	if err != nil {
		return first, err
	}
	defer d.drv.EventDestroy(start)
	end, err := d.drv.EventCreate(0)
	if err != nil {
		return first, err
	}
	defer d.drv.EventDestroy(end)
	best, bestMS := first, float32(-1)
	for _, r := range res {
		if r.state != CublasSuccess || r.workspaceSize > uint64(g.opts.WorkspaceBytes) {
			continue
		}
		run := func() CublasStatus {
			return lt.Matmul(g.handle, g.desc, c.alpha, c.b, g.layA, c.a, g.layB, 0, tuneOut, g.layC,
				&r.algo, g.workspace.ptr, r.workspaceSize, d.stream)
		}
		if run() != CublasSuccess {
			continue
		}
		if err := d.drv.EventRecord(start, d.stream); err != nil {
			return first, err
		}
		for range autotuneRuns {
			run()
		}
		if err := d.drv.EventRecord(end, d.stream); err != nil {
			return first, err
		}
		if err := d.drv.EventSynchronize(end); err != nil {
			return first, err
		}
		ms, err := d.drv.EventElapsed(start, end)
		if err != nil {
			return first, err
		}
		if bestMS < 0 || ms < bestMS {
			best, bestMS = chosenAlgo{algo: r.algo, workspace: r.workspaceSize}, ms
		}
	}
	return best, nil
}

// gemmCall is one product's arguments.
type gemmCall struct {
	out, a, b      driver.DevicePtr
	m, n, k        int
	transA, transB bool
	alpha, beta    float32
	// bf16: cuBLASLt reads a and b as bfloat16 (else float32).
	bf16 bool
	// aBF16, bBF16, outBF16: how a, b and out are stored (else float32).
	// An operand stored in the other type than cuBLASLt reads is converted
	// into scratch first (convA, convB), so out may overlap it.
	aBF16, bBF16, outBF16 bool
	// ragged: one product of a group whose sizes change from call to call
	// (GroupedMatMul): never autotuned.
	ragged bool
}

func (c gemmCall) convA() bool { return c.aBF16 != c.bf16 }
func (c gemmCall) convB() bool { return c.bBF16 != c.bf16 }

func (c gemmCall) String() string {
	in := "fp32 inputs"
	if c.bf16 {
		in = "bf16 inputs"
	}
	// A lone bf16 operand, and a bf16 out, are named.
	var stored string
	switch {
	case c.aBF16 && !c.bBF16:
		stored = ", a stored bf16"
	case c.bBF16 && !c.aBF16:
		stored = ", b stored bf16"
	}
	if c.outBF16 {
		stored += ", bf16 out"
	}
	return fmt.Sprintf("m=%d, n=%d, k=%d, transA=%v, transB=%v, %s%s", c.m, c.n, c.k, c.transA, c.transB, in, stored)
}

// maxGemmDim is cuBLASLt's limit on a matrix dimension ("usually only
// values that can be expressed as int32_t are supported").
const maxGemmDim = 1<<31 - 1

// validate checks c's arguments before anything is queued.
func (c gemmCall) validate() error {
	for _, d := range []struct {
		name string
		v    int
	}{{"m", c.m}, {"n", c.n}, {"k", c.k}} {
		if d.v < 0 {
			return fmt.Errorf("cuda: MatMul: %s = %d is negative", d.name, d.v)
		}
		if d.v > maxGemmDim {
			return fmt.Errorf("cuda: MatMul: %s = %d is over cuBLASLt's limit of %d", d.name, d.v, maxGemmDim)
		}
	}
	if c.outBF16 && c.beta != 0 {
		return fmt.Errorf("cuda: MatMul: a bf16 out needs beta = 0, not %v (%s)", c.beta, c)
	}
	if c.outBF16 && !c.bf16 {
		return fmt.Errorf("cuda: MatMul: a bf16 out needs bf16 inputs (GemmBF16 precision, or both operands bf16) (%s)", c)
	}
	// What cuBLASLt (or the conversion) reads and writes, in bytes and
	// alignment: the stored types.
	size := func(bf16 bool) int64 {
		if bf16 {
			return 2
		}
		return 4
	}
	reads := c.k > 0 && c.alpha != 0
	type operand struct {
		name  string
		ptr   driver.DevicePtr
		shape [2]int
		elem  int64
		used  bool
		conv  bool
	}
	aShape, bShape := [2]int{c.m, c.k}, [2]int{c.k, c.n}
	if c.transA {
		aShape = [2]int{c.k, c.m}
	}
	if c.transB {
		bShape = [2]int{c.n, c.k}
	}
	ops := []operand{
		{"out", c.out, [2]int{c.m, c.n}, size(c.outBF16), c.m > 0 && c.n > 0, false},
		{"a", c.a, aShape, size(c.aBF16), reads && c.m > 0 && c.n > 0, c.convA()},
		{"b", c.b, bShape, size(c.bBF16), reads && c.m > 0 && c.n > 0, c.convB()},
	}
	for _, o := range ops {
		if !o.used {
			continue
		}
		if o.ptr == 0 {
			return fmt.Errorf("cuda: MatMul: %s is a null pointer but holds a %dx%d matrix (%s)", o.name, o.shape[0], o.shape[1], c)
		}
		if uint64(o.ptr)%uint64(o.elem) != 0 {
			return fmt.Errorf("cuda: MatMul: %s = %#x is not aligned to its %d-byte elements (%s)", o.name, uint64(o.ptr), o.elem, c)
		}
	}
	// cuBLASLt reads the operands it is given as they are while it writes
	// out; a converted operand was copied before.
	outEnd := uint64(c.out) + uint64(c.m)*uint64(c.n)*uint64(ops[0].elem)
	for _, o := range ops[1:] {
		if !o.used || o.conv {
			continue
		}
		end := uint64(o.ptr) + uint64(o.shape[0])*uint64(o.shape[1])*uint64(o.elem)
		if uint64(o.ptr) < outEnd && uint64(c.out) < end {
			return fmt.Errorf("cuda: MatMul: out [%#x, %#x) overlaps %s [%#x, %#x), which cuBLASLt reads while it writes out (%s)",
				uint64(c.out), outEnd, o.name, uint64(o.ptr), end, c)
		}
	}
	return nil
}

// key is c's algorithm cache key. Sizes are rounded up to a multiple of
// gemmBucket: an expert's rows change every step, and asking cuBLASLt's
// heuristic for each new count (a round trip to the device thread and a
// search, far longer than the product) would stall every MoE layer. The
// algorithm chosen for the first shape of a bucket serves the others.
//
// A ragged product's sizes (a grouped product's rows) take coarser
// buckets, a quarter octave wide (raggedBucketDim): its rows are new
// nearly every step, and each new bucket costs a heuristic search on the
// device thread while the GPU waits for the layer's routing anyway.
func (c gemmCall) key() gemmKey {
	bucket := bucketDim
	if c.ragged {
		bucket = raggedBucketDim
	}
	return gemmKey{
		m: bucket(c.m), n: bucket(c.n), k: bucket(c.k), transA: c.transA, transB: c.transB, bf16: c.bf16,
		aBF16: c.aBF16, bBF16: c.bBF16, outBF16: c.outBF16,
		alignA: ptrAlign(c.a), alignB: ptrAlign(c.b), alignOut: ptrAlign(c.out),
	}
}

// tuneKey is the key of an autotuned algorithm: the exact sizes, which
// it serves alone.
func (c gemmCall) tuneKey() gemmKey {
	k := c.key()
	k.m, k.n, k.k = int32(c.m), int32(c.n), int32(c.k)
	k.tuned = true
	return k
}

// exactShape is c's sizes, to tell whether a cached algorithm was chosen
// for exactly this problem.
func (c gemmCall) exactShape() [3]int32 { return [3]int32{int32(c.m), int32(c.n), int32(c.k)} }

// gemmBucket is the granularity of sizes in algorithm cache keys.
const gemmBucket = 128

// bucketDim rounds a size up to a multiple of gemmBucket; sizes up to
// gemmBucket keep their own entries (small products pick their algorithm
// by exact size).
func bucketDim(v int) int32 {
	if v <= gemmBucket {
		return int32(v)
	}
	return int32((v + gemmBucket - 1) / gemmBucket * gemmBucket)
}

// raggedBucketDim rounds a size up to a multiple of a quarter of the power
// of two at or below it (at least gemmBucket): 4096 stays, 4097 becomes
// 5120. Sizes up to gemmBucket keep their own entries, as in bucketDim.
func raggedBucketDim(v int) int32 {
	if v <= gemmBucket {
		return int32(v)
	}
	step := max(gemmBucket, 1<<(bits.Len(uint(v))-1)/4)
	return int32((v + step - 1) / step * step)
}

// ptrAlign is the largest power of two up to 256 that divides p: what the
// heuristic is told it may assume (its default is 256, and an algorithm
// chosen under that assumption may fault on a view at an odd offset).
func ptrAlign(p driver.DevicePtr) uint32 {
	if p == 0 {
		return 256
	}
	return uint32(min(uint64(1)<<bits.TrailingZeros64(uint64(p)), 256))
}

// ltMatrix is one matrix as cuBLASLt sees it: column-major, rows x cols in
// memory with leading dimension ld, transposed by the operation when trans.
type ltMatrix struct {
	rows, cols, ld int
	trans          bool
}

func (x ltMatrix) op() int32 {
	if x.trans {
		return cublasOpT
	}
	return cublasOpN
}

// ltPlan is a row-major product restated for cuBLASLt: D[m x n] =
// op(A)[m x k] · op(B)[k x n] + C, column-major, with C = D.
type ltPlan struct {
	m, n, k int
	a, b, c ltMatrix
}

// planRowMajor maps row-major out[m,n] = op(a)[m,k]·op(b)[k,n] onto
// cuBLASLt: outᵀ[n,m] = op(b)ᵀ·op(a)ᵀ. A row-major [r,c] matrix is a
// column-major c x r matrix with ld c, so
//   - cuBLASLt's A is the caller's b: [k,n] is n x k (ld n), used as is;
//     [n,k] (transB) is k x n (ld k), transposed to n x k;
//   - cuBLASLt's B is the caller's a: [m,k] is k x m (ld k), used as is;
//     [k,m] (transA) is m x k (ld m), transposed to k x m;
//   - C = D is out, n x m with ld n.
func planRowMajor(m, n, k int, transA, transB bool) ltPlan {
	p := ltPlan{m: n, n: m, k: k}
	if transB {
		p.a = ltMatrix{rows: k, cols: n, ld: k, trans: true}
	} else {
		p.a = ltMatrix{rows: n, cols: k, ld: n}
	}
	if transA {
		p.b = ltMatrix{rows: m, cols: k, ld: m, trans: true}
	} else {
		p.b = ltMatrix{rows: k, cols: m, ld: k}
	}
	p.c = ltMatrix{rows: n, cols: m, ld: n}
	return p
}

// gemmKey identifies a problem for the algorithm cache: the same shape at a
// coarser alignment, or with another out type, may need another algorithm.
// The operands' stored types are part of it too (a converted operand's
// alignment is its scratch buffer's).
type gemmKey struct {
	m, n, k                  int32
	transA, transB, bf16     bool
	aBF16, bBF16, outBF16    bool
	alignA, alignB, alignOut uint32
	tuned                    bool // an autotuned product's key (tuneKey)
}

// chosenAlgo is the heuristic's answer for one key, and the exact shape it
// was asked for.
type chosenAlgo struct {
	algo      ltAlgo
	workspace uint64
	exact     [3]int32
}

// algoCache maps keys to algorithms, holding at most limit entries; when
// full, an arbitrary entry makes room (asking again costs only time).
type algoCache struct {
	limit int
	m     map[gemmKey]chosenAlgo
}

func (c *algoCache) get(k gemmKey) (chosenAlgo, bool) {
	a, ok := c.m[k]
	return a, ok
}

func (c *algoCache) put(k gemmKey, a chosenAlgo) {
	if c.m == nil {
		c.m = map[gemmKey]chosenAlgo{}
	}
	if _, ok := c.m[k]; !ok && len(c.m) >= c.limit {
		for old := range c.m {
			delete(c.m, old)
			break
		}
	}
	c.m[k] = a
}

func (c *algoCache) len() int { return len(c.m) }
