package cuda

// The weight-gradient kernel's lab builds (kernels/dev/grouped_gemm_lab.cu)
// in place of production's grouped_gemm_tn: the same launch, so a build
// runs through GroupedGemm.RunTN once its kernel is swapped in.

import (
	"fmt"
	"math"
	"testing"
)

// TestGroupedGemmTNLab runs each variant of grouped_gemm_lab.cu that
// MKTRAIN_GG_VARIANTS names: TestGroupedGemmTN's cases against the
// float64 reference, then TestGroupedGemmTNFigures' shapes timed beside
// production's kernel with beta 0 and beta 1 (training's), after checking
// that an exact variant gives production's bits from the same old values
// (figures "grouped_gemm_tn <shape> beta <b> production|<variant>").
func TestGroupedGemmTNLab(t *testing.T) {
	g := testGroupedGemm(t)
	lab, vs := labVariants(t, "grouped_gemm_lab.cu", false)
	if len(vs) == 0 {
		t.Skipf("%s names no variant of %s", labVariantsEnv, lab.File)
	}
	d := g.d
	src, _ := kernelSource(t, "grouped_gemm.cu")
	prod := g.tn
	defer func() { g.tn = prod }()
	for _, v := range vs {
		t.Run(v.Name, func(t *testing.T) {
			m, err := d.load(src, lab.File+"+"+v.Name, lab.Text, v.Defines...)
			if err != nil {
				t.Fatal(err)
			}
			k, err := g.optIn(m, "grouped_gemm_tn", ggTNSmemBytes)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("grouped_gemm_tn (%s): %d registers, %d bytes of local memory", v.Name, k.Registers, k.LocalBytes)
			g.tn = k
			defer func() { g.tn = prod }()
			for _, c := range []ggTNCase{
				{"ragged", 0, []int{100, 0, 257, 64, 1, 130}, 136, 264, 1, 1},
				{"all-to-one-beta0", 0, []int{0, 0, 0, 700, 0, 0, 0, 0}, 256, 512, 1, 0},
				{"scaled-empty", 0, []int{0, 33, 0}, 64, 8, 0.5, -2},
				{"single-rows", 0, []int{1, 1, 1}, 128, 256, 1, 1},
				{"offset-start", 5, []int{63, 65, 128}, 200, 72, -1, 0.25},
				{"wide", 0, []int{1500, 700, 0, 800}, 512, 704, 1, 1},
				{"tail-rows-beta0", 0, []int{90, 300}, 200, 264, 1, 0},
			} {
				t.Run(c.name, func(t *testing.T) { c.check(t, g, 7) })
			}
			for _, s := range []struct {
				name          string
				rows, e, m, n int
			}{
				{"moe-small dW1", 32768, 8, 2816, 1024}, {"moe-small dW2", 32768, 8, 1024, 2816},
				{"fine dW1", 98304, 64, 1408, 2048}, {"fine dW2", 98304, 64, 2048, 1408},
			} {
				counts := make([]int, s.e)
				for i := range counts {
					counts[i] = s.rows / s.e
				}
				aBits, _ := ggRandBF16(21, s.rows*s.m)
				bBits, _ := ggRandBF16(22, s.rows*s.n)
				old := make([]float32, s.e*s.m*s.n)
				for i := range old {
					old[i] = float32(math.Sin(float64(i)))
				}
				aBuf, bBuf, offBuf := ggUpload(t, d, aBits), ggUpload(t, d, bBits), ggUpload(t, d, ggOffsets(0, counts...))
				outP, outL := ggUpload(t, d, old), ggUpload(t, d, old)
				run := func(kern *Kernel, out *Buffer, beta float32) func() error {
					return func() error {
						g.tn = kern
						return g.RunTN(out.Ptr(), aBuf.Ptr(), bBuf.Ptr(), offBuf.Ptr(), s.rows, s.m, s.n, s.e, 1, beta)
					}
				}
				for _, beta := range []float32{0, 1} {
					if v.Exact {
						// One call each from the same old values.
						for _, o := range []*Buffer{outP, outL} {
							if err := d.CopyToDevice(o, 0, Bytes(old)); err != nil {
								t.Fatal(err)
							}
						}
						if err := run(prod, outP, beta)(); err != nil {
							t.Fatal(err)
						}
						if err := run(k, outL, beta)(); err != nil {
							t.Fatal(err)
						}
						gotP, gotL := make([]float32, len(old)), make([]float32, len(old))
						if err := d.CopyFromDevice(Bytes(gotP), outP, 0); err != nil {
							t.Fatal(err)
						}
						if err := d.CopyFromDevice(Bytes(gotL), outL, 0); err != nil {
							t.Fatal(err)
						}
						for i := range gotP {
							if math.Float32bits(gotP[i]) != math.Float32bits(gotL[i]) {
								t.Errorf("%s beta %g: element %d is %g, production's %g (want the same bits)", s.name, beta, i, gotL[i], gotP[i])
								break
							}
						}
					}
					msP, err := ggTime(d, run(prod, outP, beta))
					if err != nil {
						t.Fatal(err)
					}
					msL, err := ggTime(d, run(k, outL, beta))
					if err != nil {
						t.Fatal(err)
					}
					flop := 2 * float64(s.rows) * float64(s.m) * float64(s.n)
					name := fmt.Sprintf("grouped_gemm_tn %s E%d M%d N%d beta %g", s.name, s.e, s.m, s.n, beta)
					figure(t, name+" production", msP, fmt.Sprintf("ms (%.1f TFLOP/s)", flop/msP/1e9))
					figure(t, name+" "+v.Name, msL, fmt.Sprintf("ms (%.1f TFLOP/s)", flop/msL/1e9))
					figure(t, name+" "+v.Name+" over production", msL/msP, "x")
				}
				for _, buf := range []*Buffer{aBuf, bBuf, offBuf, outP, outL} {
					d.Free(buf)
				}
			}
		})
	}
}
