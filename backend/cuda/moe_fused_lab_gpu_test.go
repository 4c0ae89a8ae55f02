package cuda

// The experiments of kernels/dev on the GPU: lab builds of the fused MoE
// kernels (kernels/dev/moe_fused_lab.cu) swapped in for the production
// ones, the exact ones checked against the unfused sequence and every one
// timed on the figure shapes. Each build is an NVRTC compilation of its
// own, so a run takes only the variants MKTRAIN_GG_VARIANTS names
// (kernels/dev/README.md).

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/kernels/dev"
)

// labVariantsEnv names the lab variants a run takes, comma-separated, or
// "all"; unset or empty, none (the suite tests the kernels as trained).
const labVariantsEnv = "MKTRAIN_GG_VARIANTS"

// labVariants are the lab source file and the variants of it
// labVariantsEnv names (exact ones only when exact is set); a name no lab
// source has fails t.
func labVariants(t *testing.T, file string, exact bool) (dev.Source, []dev.Variant) {
	t.Helper()
	lab, err := dev.Lookup(file)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	if list := os.Getenv(labVariantsEnv); list != "" {
		names = strings.Split(list, ",")
	}
	var vs []dev.Variant
	for _, v := range lab.Variants {
		if (v.Exact || !exact) && (slices.Contains(names, "all") || slices.Contains(names, v.Name)) {
			vs = append(vs, v)
		}
	}
	for _, n := range names {
		known := n == "all"
		for _, src := range dev.Sources() {
			if _, err := src.Variant(n); err == nil {
				known = true
			}
		}
		if !known {
			t.Fatalf("%s: no lab source has a variant %q", labVariantsEnv, n)
		}
	}
	return lab, vs
}

// withLabVariant runs b's fused MoE kernels from lab's variant v until
// the returned restore is called, and logs each kernel's local memory.
func withLabVariant(t *testing.T, b *Backend, lab dev.Source, v dev.Variant) (restore func()) {
	t.Helper()
	restore = withMoEKernels(t, b, lab.File+"+"+v.Name, lab.Text, nil, v.Defines...)
	x := b.experts.bf16Out.moe
	for _, k := range []*Kernel{x.dispatchSwiGLU, x.dispatchSwiGLUBF16, x.dispatchDgrad, x.dispatchDgradFirst, x.downCombine, x.dgradCombine} {
		figure(t, fmt.Sprintf("%s_%s_local_bytes", k.Desc.Name, strings.ReplaceAll(v.Name, "-", "_")), float64(k.LocalBytes), "B")
	}
	return restore
}

// TestMoELabVariantsMatchUnfused runs the fused cases with each exact lab
// variant (one that computes what the production kernels do, faster or
// slower), with both builds of the dgrad kernel.
func TestMoELabVariantsMatchUnfused(t *testing.T) {
	testGroupedGemm(t)
	lab, vs := labVariants(t, "moe_fused_lab.cu", true)
	if len(vs) == 0 {
		t.Skipf("%s names no exact variant", labVariantsEnv)
	}
	b := testBackend(t)
	for _, v := range vs {
		t.Run(v.Name, func(t *testing.T) {
			defer withLabVariant(t, b, lab, v)()
			for _, build := range []int{dgradBeside, dgradFirst} {
				restore := forceDgrad(t, b, build)
				for i, c := range fusedCases() {
					t.Run(fmt.Sprintf("%s/dgrad build %d", c.name, build), func(t *testing.T) { c.testAgainstUnfused(t, b, uint64(300+i)) })
				}
				restore()
			}
		})
	}
}

// TestMoELabFigures times each lab variant on the figure shapes
// (TestMoEFusedFigures' blocks): the gate/up kernel from float32 and
// bf16 sources, single and back to back, the products alone on the rows
// it gathered (a timing-only variant's rows are not the sources' values,
// and the products' speed depends on the data), the down kernel, the pair
// from bf16 sources, and each build of the dgrad kernel. Figures are
// moe_fused_<shape>_<call>_<variant>_ms, beside TestMoEFusedFigures'
// production ones.
func TestMoELabFigures(t *testing.T) {
	testGroupedGemm(t)
	lab, vs := labVariants(t, "moe_fused_lab.cu", false)
	if len(vs) == 0 {
		t.Skipf("%s names no variant", labVariantsEnv)
	}
	b := testBackend(t)
	for _, sh := range moeFigureShapes() {
		for _, w := range sh.worlds {
			t.Run(fmt.Sprintf("%sW%d", sh.prefix, w), func(t *testing.T) {
				m := newMoEBench(t, b, sh, w)
				for _, v := range vs {
					// A variant without the gather (GG_MODE bit 1)
					// multiplies whatever xRD and dy hold: the production
					// kernels first put the sources' rows there.
					for _, run := range []func() error{m.gateUpFused, m.dgradFused} {
						if err := run(); err != nil {
							t.Fatal(err)
						}
					}
					restore := withLabVariant(t, b, lab, v)
					x := strings.ReplaceAll(v.Name, "-", "_")
					m.timed("gateup_fused_"+x, m.gateUpFused)
					m.timed("gateup_gemm_after_"+x, m.gateUpGemm)
					m.timed("gateup_fused_bf16src_"+x, m.gateUpFusedBF16)
					m.sustained("gateup_fused_bf16src_"+x, m.gateUpFusedBF16)
					m.timed("down_fused_"+x, m.downFused)
					m.timed("fused_bf16src_"+x, m.fusedBF16)
					m.sustained("fused_bf16src_"+x, m.fusedBF16)
					for _, build := range []struct {
						name  string
						build int
					}{{"bwd_dgrad_fused_beside_" + x, dgradBeside}, {"bwd_dgrad_fused_first_" + x, dgradFirst}} {
						restoreBuild := forceDgrad(t, b, build.build)
						m.timed(build.name, m.dgradFused)
						restoreBuild()
					}
					restore()
				}
			})
		}
	}
}
