package cuda

// Tensor parallelism's fused kernels (tp_fused.go) against their unfused
// sequences on the same GPU (backend.AllGatherMatMulBySteps,
// MatMulScatterBySteps), on fresh random inputs: blocks that start on
// m-tile boundaries (the walk rotated to the caller's block) and blocks
// that do not, partial tiles, weights read transposed and as stored, and
// every landing, the atomic one with every rank adding in turn.

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
)

type tpFusedCase struct {
	ranks, block, k, n int
}

func (c tpFusedCase) String() string {
	return fmt.Sprintf("W%d_B%d_K%d_N%d", c.ranks, c.block, c.k, c.n)
}

func tpFusedCases() []tpFusedCase {
	return []tpFusedCase{
		{ranks: 2, block: 256, k: 512, n: 384},
		{ranks: 4, block: 100, k: 264, n: 136},
		{ranks: 3, block: 128, k: 1024, n: 2048},
		{ranks: 8, block: 64, k: 128, n: 520},
		// 25 n-tiles: tp_gather's grouped walk (tpGroupM), 17 m-tiles
		// in two groups, the last partial.
		{ranks: 2, block: 1088, k: 192, n: 6400},
		// 6 m-tiles, rank 1's walk starting at the odd m-tile 3 (the
		// kernels pair m-tiles of the walk before its rotation).
		{ranks: 2, block: 384, k: 256, n: 264},
	}
}

// tpClustersInUse fails t where the tensor-parallel kernels cannot run:
// a Hopper GPU whose driver (CUDA 12.0 on) launches clusters must hold
// clusters of two of their blocks.
func tpClustersInUse(t *testing.T, b *Backend) {
	t.Helper()
	x, ok := b.expertKernels()
	if !ok {
		t.Fatal("the grouped GEMM kernels are not loaded")
	}
	if x.bf16Out.moe.tpClusters == 0 {
		v, _ := b.dev.drv.Version()
		t.Fatalf("the GPU holds no cluster of two tensor-parallel blocks (driver %d)", v)
	}
	figure(t, "tp kernels' active clusters", float64(x.bf16Out.moe.tpClusters), "clusters")
}

func tpRandom(b *Backend, rng *rand.Rand, shape ...int) backend.Tensor {
	t := b.New(backend.Float32, shape...)
	v := make([]float32, t.Len())
	for i := range v {
		v[i] = float32(rng.NormFloat64())
	}
	backend.UploadSlice(b, t, v)
	return t
}

// tpTimeMS is run's mean time in ms over five calls after one untimed,
// each group waited for on the host.
func tpTimeMS(t *testing.T, b *Backend, run func()) float64 {
	t.Helper()
	run()
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	const reps = 5
	start := time.Now()
	for range reps {
		run()
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	return float64(time.Since(start).Microseconds()) / 1e3 / reps
}

// tpClone is a copy of t.
func tpClone(b *Backend, t backend.Tensor) backend.Tensor {
	c := b.New(t.DType(), t.Shape()...)
	b.Copy(c, t)
	return c
}

func TestTPFusedMatchesUnfused(t *testing.T) {
	testGroupedGemm(t) // the canary and the Hopper check
	b := testBackend(t)
	tpClustersInUse(t, b)
	for i, c := range tpFusedCases() {
		for _, transW := range []bool{true, false} {
			name := fmt.Sprintf("%v_transW=%v", c, transW)
			t.Run(name, func(t *testing.T) { c.test(t, b, transW, uint64(300+i)) })
		}
	}
}

func (c tpFusedCase) weight(b *Backend, rng *rand.Rand, n int, transW bool) backend.Tensor {
	if transW {
		return tpRandom(b, rng, n, c.k)
	}
	return tpRandom(b, rng, c.k, n)
}

func (c tpFusedCase) test(t *testing.T, b *Backend, transW bool, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 11))
	rows := c.ranks * c.block
	shards := make([]backend.Tensor, c.ranks)
	for s := range shards {
		shards[s] = tpRandom(b, rng, c.block, c.k)
	}
	// Two outputs: the first is the kernel's, the second a product of the
	// gathered bf16 rows.
	ws := []backend.Tensor{c.weight(b, rng, c.n, transW), c.weight(b, rng, 24, transW)}
	newOuts := func() []backend.Tensor {
		return []backend.Tensor{b.New(backend.Float32, rows, c.n), b.New(backend.Float32, rows, 24)}
	}
	rank := c.ranks - 1
	full, outs := b.New(backend.Float32, rows, c.k), newOuts()
	// The kernel must take the call (the op would fall back to the
	// sequence and compare it with itself).
	if !b.allGatherMatMulKernel(full, outs, shards, ws, transW, rank) {
		t.Fatal("tp_gather did not take the call")
	}
	fullW, outsW := b.New(backend.Float32, rows, c.k), newOuts()
	backend.AllGatherMatMulBySteps(b, fullW, outsW, shards, ws, transW)

	// MatMulScatter: every rank's product lands in the owners' tensors,
	// from row 3 of tensors of block+5 rows.
	const row0 = 3
	as := make([]backend.Tensor, c.ranks)
	for q := range as {
		as[q] = tpRandom(b, rng, rows, c.k)
	}
	wS := c.weight(b, rng, c.n, transW)
	base := make([]backend.Tensor, c.ranks)
	for s := range base {
		base[s] = tpRandom(b, rng, c.block+5, c.n)
	}
	landed := map[backend.ScatterLanding][2][]backend.Tensor{}
	for _, l := range []backend.ScatterLanding{backend.ScatterStore, backend.ScatterAdd, backend.ScatterAtomic} {
		var got, want []backend.Tensor
		for s := range base {
			got, want = append(got, tpClone(b, base[s])), append(want, tpClone(b, base[s]))
		}
		// Store and Add: one rank's call; Atomic: every rank adds in turn.
		callers := []int{1 % c.ranks}
		if l == backend.ScatterAtomic {
			callers = callers[:0]
			for q := range c.ranks {
				callers = append(callers, q)
			}
		}
		for _, q := range callers {
			if !b.matMulScatterKernel(got, row0, as[q], wS, transW, l, q) {
				t.Fatalf("tp_scatter did not take the call (%v)", l)
			}
			backend.MatMulScatterBySteps(b, b.New(backend.Float32, rows, c.n), want, row0, as[q], wS, transW, l)
		}
		landed[l] = [2][]backend.Tensor{got, want}
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}

	gotFull, wantFull := backend.DownloadFloat32(b, full), backend.DownloadFloat32(b, fullW)
	for i := range wantFull {
		if gotFull[i] != wantFull[i] {
			t.Fatalf("full[%d] = %v, the copies give %v (the gather is exact)", i, gotFull[i], wantFull[i])
		}
	}
	for i := range outs {
		if e := relL2(backend.DownloadFloat32(b, outs[i]), backend.DownloadFloat32(b, outsW[i])); !(e < 1e-4) {
			t.Errorf("AllGatherMatMul output %d: rel L2 %.3g against the unfused sequence", i, e)
		}
	}
	for l, gw := range landed {
		for s := range gw[0] {
			got, want := backend.DownloadFloat32(b, gw[0][s]), backend.DownloadFloat32(b, gw[1][s])
			// Rows outside [row0, row0+block) are the base's, untouched.
			for i := range want {
				r := i / c.n
				if (r < row0 || r >= row0+c.block) && got[i] != want[i] {
					t.Fatalf("%v: owner %d row %d (outside the landing rows) changed: %v, want %v", l, s, r, got[i], want[i])
				}
			}
			if e := relL2(got, want); !(e < 1e-4) {
				t.Errorf("MatMulScatter %v: owner %d's rows: rel L2 %.3g against the unfused sequence", l, s, e)
			}
		}
	}
}

// TestTPFusedFigures times one rank's calls at the Llama-70B-like layer of
// mktrain bench tp at tp 8 (8192 rows a rank, hidden 8192, ffn 28672/8),
// each against the product alone (MatMul with its operands' rounding):
// the gather's up projection [65536, 8192]·[3584, 8192]^T and the
// scatter's down projection [65536, 3584]·[8192, 3584]^T with each
// landing (store into slots, add, atomic add). The figures are one rank's
// kernel; mktrain bench tp times the patterns over all ranks.
func TestTPFusedFigures(t *testing.T) {
	testGroupedGemm(t)
	if testing.Short() {
		t.Skip("figures: not in -short")
	}
	b := testBackend(t)
	tpClustersInUse(t, b)
	const w, block, hidden, ffn = 8, 8192, 8192, 28672 / 8
	rows := w * block
	rng := rand.New(rand.NewPCG(5, 5))
	time1 := func(name string, flop float64, run func()) float64 {
		ms := tpTimeMS(t, b, run)
		figure(t, "tp_"+name+"_ms", ms, "ms")
		figure(t, "tp_"+name+"_tflops", flop/ms/1e9, "TFLOP/s")
		return ms
	}
	{
		shards := make([]backend.Tensor, w)
		for s := range shards {
			shards[s] = tpRandom(b, rng, block, hidden)
		}
		wUp := tpRandom(b, rng, ffn, hidden)
		full, out := b.New(backend.Float32, rows, hidden), b.New(backend.Float32, rows, ffn)
		flop := 2 * float64(rows) * hidden * ffn
		prod := time1("up_product", flop, func() { b.MatMul(out, full, wUp, false, true, 1, 0) })
		fused := time1("allgather_gemm_fused", flop, func() {
			b.AllGatherMatMul(full, []backend.Tensor{out}, shards, []backend.Tensor{wUp}, true, 0)
		})
		figure(t, "tp_allgather_gemm_fused_over_product", fused/prod, "x")
		// Without keeping the float32 rows (2 GiB less to write).
		lean := time1("allgather_gemm_fused_unkept", flop, func() {
			b.AllGatherMatMul(nil, []backend.Tensor{out}, shards, []backend.Tensor{wUp}, true, 0)
		})
		figure(t, "tp_allgather_gemm_fused_unkept_over_product", lean/prod, "x")
		// The grouped pipeline's product alone on the gathered bf16 rows
		// (tp_scatter storing to one owner): the fused kernels' own floor.
		xbf := b.New(backend.BFloat16, rows, hidden)
		b.Copy(xbf, full)
		alone := time1("up_pipeline_product", flop, func() {
			b.MatMulScatter([]backend.Tensor{out}, 0, xbf, wUp, true, backend.ScatterStore, 0)
		})
		figure(t, "tp_allgather_gemm_fused_over_pipeline_product", fused/alone, "x")
	}
	{
		a := tpRandom(b, rng, rows, ffn)
		wDown := tpRandom(b, rng, hidden, ffn)
		out := b.New(backend.Float32, rows, hidden)
		flop := 2 * float64(rows) * hidden * ffn
		prod := time1("down_product", flop, func() { b.MatMul(out, a, wDown, false, true, 1, 0) })
		owners := make([]backend.Tensor, w)
		slots := make([]backend.Tensor, w)
		for s := range owners {
			owners[s] = b.New(backend.Float32, block, hidden)
			slots[s] = b.New(backend.Float32, rows, hidden)
		}
		for _, l := range []struct {
			name    string
			dsts    []backend.Tensor
			row0    int
			landing backend.ScatterLanding
		}{
			{"store_slots", slots, 3 * block, backend.ScatterStore},
			{"add", owners, 0, backend.ScatterAdd},
			{"atomic", owners, 0, backend.ScatterAtomic},
		} {
			ms := time1("gemm_scatter_"+l.name, flop, func() { b.MatMulScatter(l.dsts, l.row0, a, wDown, true, l.landing, 3) })
			figure(t, "tp_gemm_scatter_"+l.name+"_over_product", ms/prod, "x")
		}
	}
}
