package cuda

// The grouped GEMM lab (kernels/dev/grouped_gemm_lab.cu) on the GPU: the
// NT product on 2-block clusters multicasting the weight tile
// (gemm_nt_c2_bn256_f32), checked bit for bit against the production
// bn256 float32 kernel and timed beside it and cuBLASLt at tensor
// parallelism's shapes.

import (
	"fmt"
	"math"
	"runtime"
	"slices"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
	"github.com/mktrain/mktrain/kernels"
	"github.com/mktrain/mktrain/kernels/dev"
)

// ggClusterSmem is gemm_nt_c2_bn256_f32's dynamic shared memory: the
// alignment slack, four stages of 48 KiB and eight mbarriers.
const ggClusterSmem = 1024 + 4*49152 + 64

// ggClusterKernel loads variant v's cluster kernel, opted in to its shared
// memory, and returns it with the most 2-block clusters the GPU holds at
// once.
func ggClusterKernel(t *testing.T, d *Device, lab dev.Source, v dev.Variant) (*Kernel, int) {
	t.Helper()
	src, _ := kernelSource(t, "grouped_gemm.cu")
	src.Kernels = append(slices.Clone(src.Kernels), kernels.Kernel{Name: "gemm_nt_c2_bn256_f32"})
	m, err := d.load(src, lab.File+"+"+v.Name, lab.Text, v.Defines...)
	if err != nil {
		t.Fatal(err)
	}
	logCompiler(t, v, m)
	k, err := m.Kernel("gemm_nt_c2_bn256_f32")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s (%s): %d registers, %d bytes of local memory", k.Desc.Name, v.Name, k.Registers, k.LocalBytes)
	var clusters int
	err = d.Do(func() error {
		if err := d.drv.FuncSetAttribute(k.fn, driver.FuncMaxDynamicSharedSizeOpt, ggClusterSmem); err != nil {
			return err
		}
		two := driver.Dim3{X: 2, Y: 1, Z: 1}
		grid := driver.Dim3{X: 2 * d.info.SMs, Y: 1, Z: 1}
		clusters, err = d.drv.MaxActiveClusters(k.fn, grid, driver.Dim3{X: ggThreads, Y: 1, Z: 1}, two, ggClusterSmem)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if clusters < 1 {
		t.Fatalf("%s: the GPU holds no cluster of two blocks of %d bytes", k.Desc.Name, ggClusterSmem)
	}
	figure(t, "gemm lab cluster2 active clusters", float64(clusters), "clusters")
	return k, clusters
}

// ggRunCluster queues out [rows, n] float32 = a [rows, k] . w [n, k]^T
// (bf16) on the cluster kernel k, on a persistent grid of at most
// clusters clusters.
func ggRunCluster(g *GroupedGemm, k *Kernel, clusters int, out, a, w driver.DevicePtr, rows, n, kk int) error {
	mapA := rowsMap(a, rows, kk)
	mapWh := expertsMap(w, 1, n, kk, 128)
	maps := []driver.TiledMap{mapA, mapWh}
	for _, m := range maps {
		if err := m.Check(); err != nil {
			return err
		}
	}
	pairs := (rows + 2*ggBM - 1) / (2 * ggBM) * ((n + 255) / 256)
	grid := driver.Dim3{X: 2 * min(clusters, pairs), Y: 1, Z: 1}
	slots := []uint64{uint64(out), uint64(uint32(rows)), uint64(uint32(n)), uint64(uint32(kk))}
	d := g.d
	return d.Submit(func() error {
		var pin runtime.Pinner
		defer pin.Unpin()
		params, err := mappedParams(g.enc, maps, slots, &pin, func(i int) string { return fmt.Sprintf("map %d", i) })
		if err != nil {
			return err
		}
		return d.drv.LaunchKernelCluster(k.fn, grid, driver.Dim3{X: ggThreads, Y: 1, Z: 1}, driver.Dim3{X: 2, Y: 1, Z: 1},
			ggClusterSmem, d.stream, params)
	})
}

// TestGemmClusterLab runs the lab's cluster kernel on small shapes with
// tails (a partial m-tile, N and K tails; last, an odd m-tile count) and
// on bench tp's
// Llama-70B-like products (8192 tokens a rank, hidden 8192, ffn 28672
// split over tp 2, 4 and 8; the up projection, K 8192, and the down one,
// N 8192): its output must be the production bn256 kernel's, bit for bit
// (the same wgmmas in the same order; only how the weight tile reaches
// shared memory differs), and both are timed beside cuBLASLt on the same
// bf16 operands, in two passes in opposite orders (a call's time depends
// on what ran before it under the power cap).
func TestGemmClusterLab(t *testing.T) {
	g := testGroupedGemm(t)
	lab, vs := labVariants(t, "grouped_gemm_lab.cu", true)
	if len(vs) == 0 {
		t.Skipf("%s names no variant of %s", labVariantsEnv, lab.File)
	}
	b := testBackend(t)
	d := g.d
	for _, v := range vs {
		k, clusters := ggClusterKernel(t, d, lab, v)
		type shape struct {
			name        string
			rows, n, kk int
			timed       bool
		}
		shapes := []shape{{"one_pair", 256, 256, 64, false}, {"rows_1000", 1000, 776, 520, false}}
		for _, w := range []int{2, 4, 8} {
			shapes = append(shapes,
				shape{fmt.Sprintf("tp%d_up", w), 8192 * w, 28672 / w, 8192, true},
				shape{fmt.Sprintf("tp%d_down", w), 8192 * w, 8192, 28672 / w, true})
		}
		// Last: an odd m-tile count, whose last block loads a box wholly
		// past the rows (a kernel that traps there leaves the context
		// unusable, and the figures are in by then).
		shapes = append(shapes, shape{"tails", 300, 264, 200, false})
		for i, s := range shapes {
			aBits, _ := ggRandBF16(uint64(40+i), s.rows*s.kk)
			wBits, _ := ggRandBF16(uint64(60+i), s.n*s.kk)
			aBuf, wBuf := ggUpload(t, d, aBits), ggUpload(t, d, wBits)
			offBuf := ggUpload(t, d, []int32{0, int32(s.rows)})
			outP, err := d.Alloc(int64(s.rows * s.n * 4))
			if err != nil {
				t.Fatal(err)
			}
			outC, err := d.Alloc(int64(s.rows * s.n * 4))
			if err != nil {
				t.Fatal(err)
			}
			prod := func() error {
				return g.runNT(ggNT256, outP.Ptr(), aBuf.Ptr(), wBuf.Ptr(), offBuf.Ptr(), s.rows, s.n, s.kk, 1, 1, 0)
			}
			clus := func() error {
				return ggRunCluster(g, k, clusters, outC.Ptr(), aBuf.Ptr(), wBuf.Ptr(), s.rows, s.n, s.kk)
			}
			cublas := func() error {
				types := GemmTypes{Out: backend.Float32, A: backend.BFloat16, B: backend.BFloat16}
				return b.gemm.MatMulTypes(types, outP.Ptr(), aBuf.Ptr(), wBuf.Ptr(), s.rows, s.n, s.kk, false, true, 1, 0)
			}
			// The check first: NaN in both outputs, one call each.
			for _, o := range []*Buffer{outP, outC} {
				if err := d.Memset32(o, 0, int64(s.rows*s.n), 0x7fc00000); err != nil {
					t.Fatal(err)
				}
			}
			for _, run := range []func() error{prod, clus} {
				if err := run(); err != nil {
					t.Fatal(err)
				}
			}
			if err := d.Sync(); err != nil {
				t.Fatalf("%s %s: %v", v.Name, s.name, err)
			}
			want, got := make([]float32, s.rows*s.n), make([]float32, s.rows*s.n)
			if err := d.CopyFromDevice(Bytes(want), outP, 0); err != nil {
				t.Fatal(err)
			}
			if err := d.CopyFromDevice(Bytes(got), outC, 0); err != nil {
				t.Fatal(err)
			}
			bad := 0
			for j := range want {
				if math.Float32bits(got[j]) != math.Float32bits(want[j]) || math.IsNaN(float64(want[j])) {
					if bad == 0 {
						t.Errorf("%s %s: out[%d] (row %d, column %d) = %g, production's %g", v.Name, s.name, j, j/s.n, j%s.n, got[j], want[j])
					}
					bad++
				}
			}
			if bad > 0 {
				t.Errorf("%s %s: %d of %d elements differ from production's", v.Name, s.name, bad, len(want))
			}
			if s.timed && bad == 0 {
				flop := 2 * float64(s.rows) * float64(s.n) * float64(s.kk)
				ms := map[string]float64{}
				for _, name := range []string{"production", "cluster2", "cublaslt", "cublaslt", "cluster2", "production"} {
					run := map[string]func() error{"production": prod, "cluster2": clus, "cublaslt": cublas}[name]
					x, err := ggTime(d, run)
					if err != nil {
						t.Fatal(err)
					}
					ms[name] += x / 2
				}
				prefix := fmt.Sprintf("gemm lab %s [%d,%d]x[%d,%d]^T", s.name, s.rows, s.kk, s.n, s.kk)
				for _, name := range []string{"production", "cluster2", "cublaslt"} {
					figure(t, prefix+" "+name, ms[name], fmt.Sprintf("ms (%.1f TFLOP/s)", flop/ms[name]/1e9))
				}
				figure(t, prefix+" cluster2 over production", ms["cluster2"]/ms["production"], "x")
				figure(t, prefix+" cluster2 over cublaslt", ms["cluster2"]/ms["cublaslt"], "x")
				figure(t, prefix+" production over cublaslt", ms["production"]/ms["cublaslt"], "x")
			}
			for _, buf := range []*Buffer{aBuf, wBuf, offBuf, outP, outC} {
				d.Free(buf)
			}
		}
	}
}
