package cuda

// Lab builds of tensor parallelism's fused kernels (kernels/dev/
// moe_fused_lab.cu, which holds them beside the MoE ones) on the shapes
// of bench tp's AllGather+GEMM bar: each named variant checked against
// the production kernels' output and timed beside them and the product
// alone, in one process.

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// TestTPLabFigures runs the Llama-70B-like layer's gathered up projection
// (8192 tokens a rank, hidden 8192, ffn 28672 split over tp) at tp 2, 4
// and 8 virtual ranks: the product alone on the gathered rows, the
// production AllGather+GEMM (keeping the float32 rows, as tensorpar
// does) and each variant MKTRAIN_GG_VARIANTS names: an exact one's
// output must equal production's bit for bit (the variants change how
// rows move, not what is multiplied); the others are cost probes (what a
// gather of bf16 sources would take, say), timed only.
func TestTPLabFigures(t *testing.T) {
	testGroupedGemm(t)
	lab, vs := labVariants(t, "moe_fused_lab.cu", false)
	if len(vs) == 0 {
		t.Skipf("%s names no variant of %s", labVariantsEnv, lab.File)
	}
	b := testBackend(t)
	const block, hidden, ffnAll = 8192, 8192, 28672
	time1 := func(run func()) float64 { return tpTimeMS(t, b, run) }
	for _, w := range []int{2, 4, 8} {
		t.Run(fmt.Sprintf("tp%d", w), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(w), 29))
			ffn, rows := ffnAll/w, w*block
			shards := make([]backend.Tensor, w)
			for s := range shards {
				shards[s] = tpRandom(b, rng, block, hidden)
			}
			wUp := tpRandom(b, rng, ffn, hidden)
			full, out := b.New(backend.Float32, rows, hidden), b.New(backend.Float32, rows, ffn)
			fused := func() { b.AllGatherMatMul(full, []backend.Tensor{out}, shards, []backend.Tensor{wUp}, true, 0) }
			name := fmt.Sprintf("tp lab W%d up", w)
			prodMS := time1(fused)
			want := backend.DownloadFloat32(b, out)
			productMS := time1(func() { b.MatMul(out, full, wUp, false, true, 1, 0) })
			figure(t, name+" product", productMS, "ms")
			figure(t, name+" fused production", prodMS, "ms")
			figure(t, name+" fused production over product", prodMS/productMS, "x")
			for _, v := range vs {
				restore := withLabVariant(t, b, lab, v)
				ms := time1(fused)
				got := backend.DownloadFloat32(b, out)
				restore()
				x := strings.ReplaceAll(v.Name, "-", "_")
				figure(t, name+" fused "+x, ms, "ms")
				figure(t, name+" fused "+x+" over product", ms/productMS, "x")
				if !v.Exact {
					continue
				}
				for i := range want {
					if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
						t.Errorf("%s: out[%d] = %g, production's %g", v.Name, i, got[i], want[i])
						break
					}
				}
			}
		})
		runtime.GC() // the tensors of this tp go before the next's
	}
}
