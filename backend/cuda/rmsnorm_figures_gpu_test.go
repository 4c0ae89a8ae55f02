package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// TestRMSNormBackwardRowsFigures times rmsnorm_backward_warps_f32 (and the
// reduce of its partial sums) at moe-small's shape, 16384 rows of 1024,
// accumulating into dx as the model does (beta 1), for several rows per
// block: each block ends with its warps' column sums added through shared
// memory and written as a row of partial, a fixed cost that more rows
// spread thinner, while fewer blocks fill the GPU less evenly. Production
// launches rmsWarpRowsPerBlock, timed first; the log names the fastest
// setting. Every setting must give the same dx bits (the rows' grouping
// does not enter dx) and a dw within float32 rounding of production's.
// Figures "rmsnorm backward production rows <n>" in µs and TB/s (bytes:
// dout and x read, dx read and written).
func TestRMSNormBackwardRowsFigures(t *testing.T) {
	b := testBackend(t)
	if testing.Short() {
		t.Skip("figures; not in -short")
	}
	d := b.dev
	rng := rand.New(rand.NewPCG(5, 8))
	const T, D = 16384, 1024
	up := func(n int, scale float64) backend.Tensor {
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(rng.NormFloat64() * scale)
		}
		t := b.New(backend.Float32, n)
		backend.UploadSlice(b, t, x)
		return t
	}
	x, dout, w, dx0 := up(T*D, 1), up(T*D, 1e-3), up(D, 1), up(T*D, 1e-3)
	out, rstd := b.New(backend.Float32, T*D), b.New(backend.Float32, T)
	b.RMSNormForward(b.View(out, 0, T, D), rstd, nil, b.View(x, 0, T, D), w, 1e-5)
	tensors, _ := devicePtrs(tensorOf("figures", "x", x), tensorOf("figures", "dout", dout), tensorOf("figures", "w", w), tensorOf("figures", "rstd", rstd))
	px, pdout, pw, prstd := tensors[0], tensors[1], tensors[2], tensors[3]

	// Production's setting first: the others' dx and dw are checked
	// against its.
	settings := []int{rmsWarpRowsPerBlock}
	for _, rows := range []int{16, 32, 64, 128, 256} {
		if rows != rmsWarpRowsPerBlock {
			settings = append(settings, rows)
		}
	}
	var wantDX, wantDW []float32
	fastest, fastestMS := 0, math.Inf(1)
	for _, rows := range settings {
		blockRows := (T + rows - 1) / rows
		partial, err := d.Alloc(int64(4 * blockRows * D))
		if err != nil {
			t.Fatal(err)
		}
		dx, dw := b.New(backend.Float32, T*D), b.New(backend.Float32, D)
		b.Copy(dx, dx0)
		ptrs, _ := devicePtrs(tensorOf("figures", "dx", dx), tensorOf("figures", "dw", dw))
		pdx, pdw := ptrs[0], ptrs[1]
		run := func() error {
			if err := d.Launch(b.k.rmsBwdWarps, Grid1D(blockRows, 256), pdx, partial, pdout, px, pw, prstd, int32(T), int32(D), int32(rows), float32(1)); err != nil {
				return err
			}
			return d.Launch(b.k.rmsDwReduce, b.strideGrid(D), pdw, partial, int32(blockRows), int32(D))
		}
		// Once from the same start for the results, then timed (dx
		// keeps accumulating; the time does not depend on its values).
		if err := run(); err != nil {
			t.Fatal(err)
		}
		gotDX, gotDW := backend.DownloadFloat32(b, dx), backend.DownloadFloat32(b, dw)
		if wantDX == nil {
			wantDX, wantDW = gotDX, gotDW
		}
		for i := range wantDX {
			if math.Float32bits(gotDX[i]) != math.Float32bits(wantDX[i]) {
				t.Fatalf("rows %d: dx[%d] is %v, %v with %d rows a block", rows, i, gotDX[i], wantDX[i], rmsWarpRowsPerBlock)
			}
		}
		for i, want := range wantDW {
			if diff := math.Abs(float64(gotDW[i] - want)); diff > 1e-4*math.Abs(float64(want))+1e-6 {
				t.Errorf("rows %d: dw[%d] is %v, %v with %d rows a block", rows, i, gotDW[i], want, rmsWarpRowsPerBlock)
				break
			}
		}
		ms := eventMS(t, d, 20, run)
		if ms < fastestMS {
			fastest, fastestMS = rows, ms
		}
		name := fmt.Sprintf("rmsnorm backward production rows %d", rows)
		figure(t, name, ms*1e3, "µs")
		figure(t, name+" bandwidth", float64(4*4*T*D)/ms/1e9, "TB/s")
		d.Free(partial)
		runtime.KeepAlive(dx) // the kernels ran on raw addresses
		runtime.KeepAlive(dw)
	}
	t.Logf("fastest: %d rows a block (%.1f µs); production launches %d", fastest, fastestMS*1e3, rmsWarpRowsPerBlock)
	runtime.KeepAlive([]backend.Tensor{x, dout, w, rstd})
}
