package cuda

// The grouped GEMM on the GPU against the float64 reference
// (grouped_gemm_test.go) on fresh random bf16 inputs. Outputs are
// poisoned with NaN before each run; every element is checked (owned
// rows within tolerance, unowned rows still poisoned), plus the relative
// L2 error. TestGroupedGemmDebug isolates the mainloop on one tile;
// TestGroupedGemmFigures times the shapes of scripts/peer/torch_kernels.py.

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/kernels"
)

// ggProbe remembers the outcome of the canary child process
// (testGroupedGemm).
var ggProbe struct {
	once sync.Once
	err  error
}

// ggCanaryTests run in the child process before any grouped GEMM kernel
// runs in this one.
const ggCanaryTests = "^(TestGroupedGemmCompileProbe|TestGroupedGemmDebug|TestGroupedGemmDebugPatterns|TestGroupedGemmCases|TestGroupedGemmTN|TestMoEFusedMatchesUnfused)$"

// testGroupedGemm returns a GroupedGemm on the test device, or skips.
func testGroupedGemm(t *testing.T) *GroupedGemm {
	t.Helper()
	d := testDevice(t)
	if d.Info().Arch != "sm_90a" {
		t.Skipf("cuda: grouped GEMM needs sm_90a, this GPU is %s", d.Info().Arch)
	}
	// NVRTC has been seen to crash the process on wgmma code
	// (../shared/gpu/NOTES.md), and a kernel that faults or traps (the
	// bounded mbarrier waits) leaves the context unusable for every later
	// test. So the compile and the small cases run first in a child
	// process; if it fails, these tests fail with its output and nothing
	// runs here.
	if os.Getenv("MKTRAIN_GG_PROBE") != "1" {
		first := false
		ggProbe.once.Do(func() {
			first = true
			ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, os.Args[0], "-test.run="+ggCanaryTests, "-test.v", "-test.count=1", "-test.timeout=5m")
			cmd.Env = append(os.Environ(), "MKTRAIN_GG_PROBE=1")
			out, err := cmd.CombinedOutput()
			if err != nil || !strings.Contains(string(out), "--- PASS: TestGroupedGemmCompileProbe") {
				ggProbe.err = fmt.Errorf("the grouped GEMM canary (a child process running %s) failed (%v):\n%s", ggCanaryTests, err, out)
			}
		})
		if ggProbe.err != nil {
			if first {
				t.Fatal(ggProbe.err)
			}
			t.Fatal("the grouped GEMM canary failed; its output is in the first grouped GEMM test's failure")
		}
	}
	g, err := NewGroupedGemm(d)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

// TestGroupedGemmCompileProbe compiles grouped_gemm.cu and moe_fused.cu
// with NVRTC; it runs only in testGroupedGemm's child process, first.
func TestGroupedGemmCompileProbe(t *testing.T) {
	if os.Getenv("MKTRAIN_GG_PROBE") != "1" {
		t.Skip("runs as the child process of the grouped GEMM tests")
	}
	if gpu.rt == nil {
		t.Fatalf("no CUDA runtime: %v %s", gpu.err, gpu.skip)
	}
	for _, file := range []string{"grouped_gemm.cu", "moe_fused.cu"} {
		src, text := kernelSource(t, file)
		_, info, err := gpu.rt.Compile(src.File, text, "sm_90a")
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s compiled in %v; NVRTC log: %q", file, info.Elapsed, info.Log)
	}
}

// ggRandBF16 is n bf16 values uniform in [-1, 1), drawn in parallel
// chunks from seed; vals gets their float32 values (exact).
func ggRandBF16(seed uint64, n int) (bits []uint16, vals []float32) {
	bits, vals = make([]uint16, n), make([]float32, n)
	const chunk = 1 << 20
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	for c := 0; c*chunk < n; c++ {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			rng := rand.New(rand.NewPCG(seed, uint64(c)))
			for i := c * chunk; i < min(n, (c+1)*chunk); i++ {
				h := bf16Bits(2*rng.Float32() - 1)
				bits[i], vals[i] = h, bf16Value(h)
			}
		}()
	}
	wg.Wait()
	return bits, vals
}

// ggUpload copies xs to a new device buffer.
func ggUpload[T any](t *testing.T, d *Device, xs []T) *Buffer {
	t.Helper()
	b := Bytes(xs)
	buf, err := d.Alloc(int64(max(len(b), 16)))
	if err != nil {
		t.Fatal(err)
	}
	if err := d.CopyToDevice(buf, 0, b); err != nil {
		t.Fatal(err)
	}
	return buf
}

// ggCase is one call to check.
type ggCase struct {
	name          string
	rows, n, k, e int
	off           []int32 // nil: ggRandOffsets
	outBF16       bool
	alpha, beta   float32
	// kernel is the NT kernel the case runs (ggNTKernelList's name less
	// its grouped_gemm_nt_ prefix and type: bn128, bn256, bn256s), whose
	// output type must be outBF16's; "" runs Run's choice.
	kernel string
	// shared, when set, keeps the problem (and its memoized reference)
	// across runs of the same inputs with other kernels.
	shared *ggShared
	// a and w, when set, are the inputs (bf16 values) instead of random
	// ones.
	a, w []float32
}

// ggShared carries one problem from a case's first run to the next ones.
type ggShared struct{ p *ggProblem }

// ggOffsets turns counts into E+1 offsets starting at row start.
func ggOffsets(start int, counts ...int) []int32 {
	off := make([]int32, len(counts)+1)
	off[0] = int32(start)
	for i, c := range counts {
		off[i+1] = off[i] + int32(c)
	}
	return off
}

// run draws inputs, runs the kernel on poisoned (beta 0) or random (beta
// != 0) outputs, and checks every element (rowsToCheck nil) or the rows
// given.
func (c ggCase) run(t *testing.T, g *GroupedGemm, seed uint64, rowsToCheck []int) ggCheckResult {
	t.Helper()
	d := g.d
	rng := rand.New(rand.NewPCG(seed, 99))
	off := c.off
	if off == nil {
		off = ggRandOffsets(rng, c.e, c.rows)
	}
	aBits, a := ggRandBF16(seed*3+1, c.rows*c.k)
	wBits, w := ggRandBF16(seed*3+2, c.e*c.n*c.k)
	if c.a != nil {
		a, aBits = c.a, bf16Slice(c.a)
	}
	if c.w != nil {
		w, wBits = c.w, bf16Slice(c.w)
	}
	p := &ggProblem{rows: c.rows, n: c.n, k: c.k, e: c.e, a: a, w: w, off: off, alpha: c.alpha, beta: c.beta, outBF16: c.outBF16}
	if c.shared != nil {
		// The same seed and offsets draw the same inputs: keep the first
		// run's problem, whose reference rows are memoized.
		if c.shared.p == nil {
			p.memo = true
			c.shared.p = p
		}
		p = c.shared.p
	}
	size := c.rows * c.n
	elem := 4
	if c.outBF16 {
		elem = 2
	}
	out, err := d.Alloc(int64(max(size*elem, 16)))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(out)
	if c.beta != 0 {
		// Old outputs: random values (a NaN poison would make every
		// result NaN); unowned rows are checked to be untouched by
		// poisoning them anyway.
		oldBits, old := ggRandBF16(seed*3+3, size)
		owned := make([]bool, c.rows)
		for x := range c.e {
			for r := max(int(off[x]), 0); r < min(int(off[x+1]), c.rows); r++ {
				owned[r] = true
			}
		}
		for r := range c.rows {
			if !owned[r] {
				for i := r * c.n; i < (r+1)*c.n; i++ {
					oldBits[i], old[i] = 0x7fc0, float32(math.NaN())
				}
			}
		}
		if p.old == nil {
			p.old = old
		}
		if c.outBF16 {
			if err := d.CopyToDevice(out, 0, Bytes(oldBits)); err != nil {
				t.Fatal(err)
			}
		} else if err := d.CopyToDevice(out, 0, Bytes(old)); err != nil {
			t.Fatal(err)
		}
	} else if err := d.Memset32(out, 0, int64(size*elem/4), 0x7fc07fc0); err != nil {
		// 0x7fc07fc0 is a float32 NaN and two bf16 NaNs.
		t.Fatal(err)
	}
	aBuf, wBuf, offBuf := ggUpload(t, d, aBits), ggUpload(t, d, wBits), ggUpload(t, d, off)
	defer d.Free(aBuf)
	defer d.Free(wBuf)
	defer d.Free(offBuf)
	if err := c.launch(g, out.Ptr(), aBuf.Ptr(), wBuf.Ptr(), offBuf.Ptr(), c.alpha, c.beta); err != nil {
		t.Fatal(err)
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	got := make([]float32, size)
	var poisoned func(i int) bool
	if c.outBF16 {
		bits := make([]uint16, size)
		if err := d.CopyFromDevice(Bytes(bits), out, 0); err != nil {
			t.Fatal(err)
		}
		for i, h := range bits {
			got[i] = bf16Value(h)
		}
		poisoned = func(i int) bool { return bits[i] == 0x7fc0 }
	} else {
		if err := d.CopyFromDevice(Bytes(got), out, 0); err != nil {
			t.Fatal(err)
		}
		poisoned = func(i int) bool {
			return math.Float32bits(got[i]) == 0x7fc07fc0 || math.Float32bits(got[i]) == 0x7fc00000
		}
	}
	res := p.check(got, poisoned, rowsToCheck)
	if res.bad > 0 || !(res.relL2 < 1e-2) {
		t.Errorf("%s (rows %d n %d k %d E %d bf16out %v alpha %g beta %g kernel %s, offsets %v): %d of %d elements bad, rel L2 %.3g; e.g. %v",
			c.name, c.rows, c.n, c.k, c.e, c.outBF16, c.alpha, c.beta, c.kernelName(), ggShort(off), res.bad, res.checkedEl, res.relL2, res.examples)
	} else {
		t.Logf("%s: kernel %s bf16out %v beta %g: rel L2 %.3g over %d elements", c.name, c.kernelName(), c.outBF16, c.beta, res.relL2, res.checkedEl)
	}
	return res
}

// launch queues c on g: its kernel (runNT), or Run's choice.
func (c ggCase) launch(g *GroupedGemm, out, a, w, off driver.DevicePtr, alpha, beta float32) error {
	if c.kernel == "" {
		return g.Run(out, a, w, off, c.rows, c.n, c.k, c.e, c.outBF16, alpha, beta)
	}
	kern := ggKernelNamed(c.kernel)
	if kern < 0 || ggNTKernelList()[kern].outBF16 != c.outBF16 {
		return fmt.Errorf("case %q: kernel %q with bf16 out %v: no such kernel", c.name, c.kernel, c.outBF16)
	}
	return g.runNT(kern, out, a, w, off, c.rows, c.n, c.k, c.e, alpha, beta)
}

// kernelName names c's kernel as the figures do: bn128, bn256, bn256s,
// or auto (Run's choice).
func (c ggCase) kernelName() string {
	if c.kernel == "" {
		return "auto"
	}
	return c.kernel
}

// ggKernelNamed is the NT kernel called name (bn128, bn256, bn256s), or -1.
func ggKernelNamed(name string) int {
	for kern, k := range ggNTKernelList() {
		if strings.TrimSuffix(strings.TrimSuffix(strings.TrimPrefix(k.name, "grouped_gemm_nt_"), "_f32"), "_bf16") == name {
			return kern
		}
	}
	return -1
}

// onEveryKernel is c on every NT kernel of its output type: the kernels
// Run picks among.
func (c ggCase) onEveryKernel() []ggCase {
	var cs []ggCase
	for _, name := range []string{"bn256", "bn128", "bn256s"} {
		if ggNTKernelList()[ggKernelNamed(name)].outBF16 == c.outBF16 {
			c.kernel = name
			cs = append(cs, c)
		}
	}
	return cs
}

// ggTestKernels are the kernels the correctness tests run, each with its
// output type: every NT kernel training runs.
var ggTestKernels = []struct {
	name    string
	outBF16 bool
}{{"bn256", false}, {"bn128", false}, {"bn256s", true}}

// ggShort prints long offset lists by their ends.
func ggShort(off []int32) string {
	if len(off) <= 17 {
		return fmt.Sprint(off)
	}
	return fmt.Sprintf("%v ... %v", off[:8], off[len(off)-8:])
}

// TestGroupedGemmDebug isolates the mainloop: one expert, one tile, then
// one tile with several k-blocks, for each n tile. A failure here is in
// the descriptors, the swizzle or the pipeline, not the schedule.
func TestGroupedGemmDebug(t *testing.T) {
	g := testGroupedGemm(t)
	// Registers and local memory (spills) per kernel, and NVRTC's log:
	// the consumers hold BN/2 accumulators under a 168-register cap.
	for _, k := range append(g.nt[:], g.tn) {
		t.Logf("%s: %d registers, %d bytes of local memory", k.Desc.Name, k.Registers, k.LocalBytes)
	}
	for _, file := range []string{"grouped_gemm.cu", "moe_fused.cu"} {
		if src, err := kernels.Lookup(file); err == nil {
			if m, err := g.d.Load(src); err == nil && m.Info.Log != "" {
				t.Logf("%s: NVRTC log:\n%s", file, m.Info.Log)
			}
		}
	}
	for _, c := range []ggCase{
		{name: "one tile 128x128x64", rows: 128, n: 128, k: 64, e: 1, off: ggOffsets(0, 128), alpha: 1, kernel: "bn128"},
		{name: "one tile 128x256x64", rows: 128, n: 256, k: 64, e: 1, off: ggOffsets(0, 128), alpha: 1, kernel: "bn256"},
		{name: "one tile, k 16 (one k-step, TMA zero fill past it)", rows: 128, n: 128, k: 16, e: 1, off: ggOffsets(0, 128), alpha: 1, kernel: "bn128"},
		{name: "one tile, 9 k-blocks (ring wraps)", rows: 128, n: 128, k: 576, e: 1, off: ggOffsets(0, 128), alpha: 1, kernel: "bn128"},
		{name: "one tile 128x256, 9 k-blocks", rows: 128, n: 256, k: 576, e: 1, off: ggOffsets(0, 128), alpha: 1, kernel: "bn256"},
		{name: "two experts, one tile each", rows: 256, n: 128, k: 128, e: 2, off: ggOffsets(0, 128, 128), alpha: 1, kernel: "bn128"},
		// Over 4 tiles per CTA on 132 SMs: the ring wraps within and
		// across tiles (9 k-blocks, 6 stages).
		{name: "cooperative, 600 tiles", rows: 128 * 600, n: 128, k: 576, e: 1, off: ggOffsets(0, 128*600), alpha: 1, kernel: "bn128"},
		// The setmaxnreg kernel with the TMA-store epilogue (bf16 out): one
		// full tile, the ring wrapping, then 600 tiles (the staging buffers
		// reused while earlier stores drain), an N tail inside a box and a
		// box past N, a last expert ending at the tensor's end (TMA clips
		// rows), and a block holding the next expert's rows (the register
		// path inside the kernel).
		{name: "TMA store, one tile 128x256x64", rows: 128, n: 256, k: 64, e: 1, off: ggOffsets(0, 128), alpha: 1, outBF16: true, kernel: "bn256s"},
		{name: "setmaxnreg and TMA store, one tile, 9 k-blocks", rows: 128, n: 256, k: 576, e: 1, off: ggOffsets(0, 128), alpha: 1, outBF16: true, kernel: "bn256s"},
		{name: "TMA store, 600 tiles", rows: 128 * 600, n: 256, k: 576, e: 1, off: ggOffsets(0, 128*600), alpha: 1, outBF16: true, kernel: "bn256s"},
		{name: "TMA store, n 328 (tail box, box past N), rows 200 of one expert", rows: 200, n: 328, k: 128, e: 1, off: ggOffsets(0, 200), alpha: 0.5, outBF16: true, kernel: "bn256s"},
		{name: "TMA store, two experts 70 + 130", rows: 200, n: 256, k: 128, e: 2, off: ggOffsets(0, 70, 130), alpha: 1, outBF16: true, kernel: "bn256s"},
	} {
		c.run(t, g, 7, nil)
	}
}

// TestGroupedGemmDebugPatterns runs one 128x128x64 tile on inputs whose
// products name the operand element they read: A row r is one-hot at
// k = r%64, so out[r, c] = W[c, r%64]; with W[c, k] = k the output shows
// the k each row picked up (A's or W's swizzle along K), with W[c, k] =
// c%128 the column (W's rows). All values are small integers, exact in
// bf16. Mismatches are logged as a map to read the bug from.
func TestGroupedGemmDebugPatterns(t *testing.T) {
	g := testGroupedGemm(t)
	const rows, n, k = 128, 128, 64
	a := make([]float32, rows*k)
	for r := range rows {
		a[r*k+r%k] = 1
	}
	for _, pat := range []struct {
		name string
		w    func(c, kk int) float32
		want func(r, c int) float32
	}{
		{"W[c,k] = k: out[r,c] = r%64", func(c, kk int) float32 { return float32(kk) }, func(r, c int) float32 { return float32(r % k) }},
		{"W[c,k] = c: out[r,c] = c", func(c, kk int) float32 { return float32(c) }, func(r, c int) float32 { return float32(c) }},
	} {
		w := make([]float32, n*k)
		for c := range n {
			for kk := range k {
				w[c*k+kk] = pat.w(c, kk)
			}
		}
		for _, v := range ggTestKernels {
			// The values are small integers, exact in bf16.
			c := ggCase{name: pat.name, rows: rows, n: n, k: k, e: 1, off: ggOffsets(0, rows), alpha: 1, a: a, w: w,
				outBF16: v.outBF16, kernel: v.name}
			if res := c.run(t, g, 1, nil); res.bad == 0 {
				continue
			}
			// Print rows of got values for the first rows that differ.
			got := ggRunRaw(t, g, c)
			shown := 0
			for r := 0; r < rows && shown < 12; r++ {
				var line []string
				for col := range n {
					if got[r*n+col] != pat.want(r, col) {
						line = append(line, fmt.Sprintf("c%d=%g", col, got[r*n+col]))
					}
				}
				if len(line) > 0 {
					shown++
					t.Logf("%s row %d (want %g at c0): %d wrong: %v", v.name, r, pat.want(r, 0), len(line), line[:min(len(line), 12)])
				}
			}
		}
	}
}

// ggRunRaw runs c (float32 out poisoned with NaN, beta 0) and returns the
// output.
func ggRunRaw(t *testing.T, g *GroupedGemm, c ggCase) []float32 {
	t.Helper()
	d := g.d
	aBuf, wBuf, offBuf := ggUpload(t, d, bf16Slice(c.a)), ggUpload(t, d, bf16Slice(c.w)), ggUpload(t, d, c.off)
	defer d.Free(aBuf)
	defer d.Free(wBuf)
	defer d.Free(offBuf)
	out, err := d.Alloc(int64(4 * c.rows * c.n))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(out)
	poison := uint32(0x7fc00000) // a float32 NaN
	if c.outBF16 {
		poison = 0x7fc07fc0 // two bf16 NaNs
	}
	if err := d.Memset32(out, 0, int64(c.rows*c.n), poison); err != nil {
		t.Fatal(err)
	}
	if err := c.launch(g, out.Ptr(), aBuf.Ptr(), wBuf.Ptr(), offBuf.Ptr(), 1, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]float32, c.rows*c.n)
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	if !c.outBF16 {
		if err := d.CopyFromDevice(Bytes(got), out, 0); err != nil {
			t.Fatal(err)
		}
		return got
	}
	bits := make([]uint16, c.rows*c.n)
	if err := d.CopyFromDevice(Bytes(bits), out, 0); err != nil {
		t.Fatal(err)
	}
	for i, h := range bits {
		got[i] = bf16Value(h)
	}
	return got
}

// TestGroupedGemmCases covers the schedule and the edges on small shapes,
// each on every NT kernel (both n tiles with float32 out, bn256s with
// bf16), beta 0 and 1.
func TestGroupedGemmCases(t *testing.T) {
	g := testGroupedGemm(t)
	cases := []ggCase{
		{name: "random counts", rows: 1000, n: 256, k: 192, e: 8, off: ggOffsets(0, 100, 37, 200, 1, 129, 300, 33, 200)},
		{name: "skewed: every row to one expert", rows: 700, n: 384, k: 128, e: 8, off: ggOffsets(0, 0, 0, 0, 700, 0, 0, 0, 0)},
		{name: "empty experts first, last and between", rows: 500, n: 128, k: 64, e: 6, off: ggOffsets(0, 0, 250, 0, 0, 250, 0)},
		{name: "counts 1, 127, 129, 255, 257", rows: 769, n: 136, k: 72, e: 5, off: ggOffsets(0, 1, 127, 129, 255, 257)},
		{name: "k tail (k 200), n tail (n 392)", rows: 300, n: 392, k: 200, e: 3, off: ggOffsets(0, 100, 100, 100)},
		{name: "unowned rows before and after", rows: 600, n: 256, k: 128, e: 4, off: ggOffsets(50, 100, 0, 200, 150)},
		{name: "all experts empty", rows: 256, n: 128, k: 64, e: 4, off: ggOffsets(0, 0, 0, 0, 0)},
		{name: "tiny n and k", rows: 130, n: 8, k: 8, e: 2, off: ggOffsets(0, 65, 65)},
		// Several tiles per CTA (132 SMs): the persistent loop, ring
		// phases across tiles.
		{name: "many tiles, k 320", rows: 20000, n: 512, k: 320, e: 8, off: ggOffsets(0, 3000, 1, 0, 7000, 2500, 127, 4372, 2999)},
		{name: "many tiles, k 1000", rows: 9000, n: 520, k: 1000, e: 3, off: ggOffsets(10, 4000, 0, 4900)},
	}
	seed := uint64(100)
	for _, c := range cases {
		for _, v := range ggTestKernels {
			for _, beta := range []float32{0, 1} {
				c.kernel, c.outBF16, c.beta, c.alpha = v.name, v.outBF16, beta, 1
				if beta != 0 {
					c.alpha = 0.5
				}
				seed++
				c.run(t, g, seed, nil)
			}
		}
	}
	// Random offsets (random, skewed or half empty; unowned ends) and
	// sizes, on Run's choice of kernel.
	rng := rand.New(rand.NewPCG(5, 6))
	for i := range 12 {
		c := ggCase{name: fmt.Sprintf("random %d", i), rows: rng.IntN(1500), n: 8 * (1 + rng.IntN(64)),
			k: 8 * (1 + rng.IntN(40)), e: 1 + rng.IntN(20), outBF16: rng.IntN(2) == 0, alpha: 1}
		if rng.IntN(2) == 0 {
			c.beta = 1
		}
		if c.rows > 0 {
			c.run(t, g, uint64(1000+i), nil)
		}
	}
}

// TestGroupedGemmRepeatable runs one mid-size case five times: every
// element has one owner thread and a fixed summation order, so the bits
// must not move (a moving result is a race: METHOD.md).
func TestGroupedGemmRepeatable(t *testing.T) {
	g := testGroupedGemm(t)
	_, a := ggRandBF16(41, 20000*512)
	_, w := ggRandBF16(42, 8*512*512)
	for _, v := range ggTestKernels {
		c := ggCase{rows: 20000, n: 512, k: 512, e: 8, off: ggOffsets(0, 5000, 0, 381, 10000, 7, 600, 12, 4000), a: a, w: w,
			outBF16: v.outBF16, kernel: v.name}
		first := ggRunRaw(t, g, c)
		for i := range 4 {
			again := ggRunRaw(t, g, c)
			for j := range first {
				if math.Float32bits(first[j]) != math.Float32bits(again[j]) {
					t.Fatalf("%s: run %d differs from the first at row %d col %d: %g vs %g", v.name, i+2, j/c.n, j%c.n, again[j], first[j])
				}
			}
		}
	}
}

// TestGroupedGemmShapes checks the model's shapes in full: moe-small (8
// experts, 32768 routed rows, the gate/up product n 2816 k 1024 and the
// down product n 1024 k 2816) and the fine-grained one (64 experts,
// 16384*6 rows, n 1408 k 2048), on random (uneven) counts.
func TestGroupedGemmShapes(t *testing.T) {
	g := testGroupedGemm(t)
	if testing.Short() {
		t.Skip("the float64 reference takes tens of seconds; not in -short")
	}
	for i, c := range []ggCase{
		{name: "moe-small up", rows: 32768, n: 2816, k: 1024, e: 8, alpha: 1},
		{name: "moe-small down", rows: 32768, n: 1024, k: 2816, e: 8, alpha: 1, beta: 1, outBF16: true},
		{name: "fine-grained", rows: 16384 * 6, n: 1408, k: 2048, e: 64, alpha: 1, outBF16: true},
	} {
		rng := rand.New(rand.NewPCG(uint64(i), 77))
		// Uneven counts over every row: multinomial-ish by random cuts.
		cuts := make([]int, c.e-1)
		for j := range cuts {
			cuts[j] = rng.IntN(c.rows + 1)
		}
		slices.Sort(cuts)
		c.off = make([]int32, c.e+1)
		for j := 1; j < c.e; j++ {
			c.off[j] = int32(cuts[j-1])
		}
		c.off[c.e] = int32(c.rows)
		// One problem for all kernels of the output type: the float64
		// reference (the slow part) is computed on the first run and
		// memoized.
		c.shared = &ggShared{}
		for _, ck := range c.onEveryKernel() {
			ck.run(t, g, uint64(500+i), nil)
		}
	}
}

// TestGroupedGemmFigures times the grouped GEMM on the shapes of
// torch_kernels.py's grouped_mm entries (equal counts per expert, as
// there; bf16 out, so bn256s), logging
// "figure: grouped_gemm T.._D.._E.._K.._N.. bn256s = ms ms (TFLOP/s)".
// Each timed run is also checked on sampled rows (every column).
func TestGroupedGemmFigures(t *testing.T) {
	g := testGroupedGemm(t)
	if testing.Short() {
		t.Skip("figures take a while; not in -short")
	}
	d := g.d
	for _, s := range []struct{ T, D, E, K, FF int }{
		{16384, 1024, 8, 2, 2816}, {16384, 2048, 64, 6, 1408}, {16384, 4096, 8, 2, 14336},
		// moe-small's and the fine-grained down products.
		{16384, 2816, 8, 2, 512}, {16384, 1408, 64, 6, 1024},
	} {
		rows, k, n := s.T*s.K, s.D, 2*s.FF
		counts := make([]int, s.E)
		for i := range counts {
			counts[i] = rows / s.E
			if i < rows%s.E {
				counts[i]++
			}
		}
		off := ggOffsets(0, counts...)
		aBits, a := ggRandBF16(11, rows*k)
		wBits, w := ggRandBF16(12, s.E*n*k)
		aBuf, wBuf, offBuf := ggUpload(t, d, aBits), ggUpload(t, d, wBits), ggUpload(t, d, off)
		out, err := d.Alloc(int64(rows * n * 2))
		if err != nil {
			t.Fatal(err)
		}
		shape := fmt.Sprintf("T%d_D%d_E%d_K%d_N%d", s.T, s.D, s.E, s.K, n)
		p := &ggProblem{rows: rows, n: n, k: k, e: s.E, a: a, w: w, off: off, alpha: 1, outBF16: true}
		// Sampled rows: the first and last of every expert and random ones.
		var sample []int
		for x := range s.E {
			sample = append(sample, int(off[x]), int(off[x+1])-1)
		}
		rng := rand.New(rand.NewPCG(3, 4))
		for range 32 {
			sample = append(sample, rng.IntN(rows))
		}
		// Only the sampled rows come back: a full copy of the largest
		// output (1.9 GB) costs more than the timing.
		bits := make([]uint16, rows*n)
		got := make([]float32, rows*n)
		if v := ggNTKernelList()[g.ntKernelFor(n, true)].name; v != "grouped_gemm_nt_bn256s_bf16" {
			t.Fatalf("bf16 out runs %s, not bn256s", v)
		}
		run := func() error {
			return g.Run(out.Ptr(), aBuf.Ptr(), wBuf.Ptr(), offBuf.Ptr(), rows, n, k, s.E, true, 1, 0)
		}
		if err := d.Memset32(out, 0, int64(rows*n/2), 0x7fc07fc0); err != nil {
			t.Fatal(err)
		}
		ms, err := ggTime(d, run)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range sample {
			row := bits[r*n : (r+1)*n]
			if err := d.CopyFromDevice(Bytes(row), out, int64(2*r*n)); err != nil {
				t.Fatal(err)
			}
			for c, h := range row {
				got[r*n+c] = bf16Value(h)
			}
		}
		res := p.check(got, func(i int) bool { return bits[i] == 0x7fc0 }, sample)
		if res.bad > 0 || !(res.relL2 < 1e-2) {
			t.Errorf("%s bn256s: %d of %d sampled elements bad, rel L2 %.3g; e.g. %v", shape, res.bad, res.checkedEl, res.relL2, res.examples)
		} else {
			flop := 2 * float64(rows) * float64(n) * float64(k)
			figure(t, fmt.Sprintf("grouped_gemm %s bn256s", shape), ms, fmt.Sprintf("ms (%.1f TFLOP/s)", flop/ms/1e9))
		}
		for _, b := range []*Buffer{aBuf, wBuf, offBuf, out} {
			d.Free(b)
		}
	}
}

// ggTime is the median of 20 timed runs (timeGPU, one run each) after 3
// warm-up runs, in milliseconds.
func ggTime(d *Device, run func() error) (float64, error) {
	ts := make([]float64, 20)
	for i := range ts {
		warm := 0
		if i == 0 {
			warm = 3
		}
		ms, err := timeGPU(d, warm, 1, run)
		if err != nil {
			return 0, err
		}
		ts[i] = ms
	}
	slices.Sort(ts)
	return ts[len(ts)/2], nil
}
