package cuda

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// The optimizer's kernels against the variants of kernels/dev/adamw_lab.cu
// (MKTRAIN_GG_VARIANTS names them; the production figures run always).
// AdamW moves 28 bytes per weight (split masters 4 read and written,
// gradient 4 read, moments 8 read and written each) and is the longest
// pass of the fine-grained model's step; its figure is read against a
// device copy's 4.1 TB/s (TestFigures).

// adamWLabBuild is one build of the optimizer's three kernels.
type adamWLabBuild struct {
	name                string
	exact               bool
	f32, f32x4, split32 *Kernel
}

// adamWLabBuilds returns production's build and each named variant's.
func adamWLabBuilds(t *testing.T, d *Device) []adamWLabBuild {
	t.Helper()
	builds := []adamWLabBuild{{name: "production", exact: true,
		f32: kernel(t, d, "adamw.cu", "adamw_f32"), f32x4: kernel(t, d, "adamw.cu", "adamw_f32_x4"), split32: kernel(t, d, "adamw.cu", "adamw_split")}}
	lab, vs := labVariants(t, "adamw_lab.cu", false)
	src, _ := kernelSource(t, "adamw.cu")
	for _, v := range vs {
		m, err := d.load(src, lab.File+"+"+v.Name, lab.Text, v.Defines...)
		if err != nil {
			t.Fatalf("%s: %v", v.Name, err)
		}
		b := adamWLabBuild{name: v.Name, exact: v.Exact}
		for _, k := range []struct {
			name string
			ref  **Kernel
		}{{"adamw_f32", &b.f32}, {"adamw_f32_x4", &b.f32x4}, {"adamw_split", &b.split32}} {
			if *k.ref, err = m.Kernel(k.name); err != nil {
				t.Fatalf("%s: %v", v.Name, err)
			}
		}
		builds = append(builds, b)
	}
	return builds
}

// adamWLabArgs are the update's scalar arguments as the backend passes
// them (AdamWUpdate): lr, beta1, beta2, eps, decay, bc1, bc2, gscale, and
// where the blocks' sums of the gradient's squares go (sq, nil for none).
func adamWLabArgs(h backend.AdamW, sq *Buffer) []any {
	bc1, bc2, decay := adamWFactors("AdamW lab", h)
	return []any{h.LR, h.Beta1, h.Beta2, h.Eps, decay, bc1, bc2, h.GradFactor(), sq}
}

// TestAdamWLab holds each variant to production's results on random
// state (exact variants to the bit, the others within a few float32
// rounding errors) and times every build: adamw_split over the
// fine-grained model's experts of one layer (553.6M weights, updated in
// the backward one layer at a time), adamw_f32_x4 over 256M float32
// masters. Figures "adamw <kernel> <build>" in TB/s.
func TestAdamWLab(t *testing.T) {
	d := testDevice(t)
	if testing.Short() {
		t.Skip("the optimizer's figures move tens of GB; not in -short")
	}
	builds := adamWLabBuilds(t, d)
	h := backend.AdamW{LR: 3e-4, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, WeightDecay: 0.01, Step: 7, GradScale: 0.37}
	args := adamWLabArgs(h, nil)

	// Agreement, on an odd number of pairs (the wide loop's tail runs)
	// and an element count that is not a multiple of four.
	k := newKT(t, 21)
	const pairs = 1<<20 + 1
	const n = 2 * pairs
	hi, lo := make([]uint16, n), make([]uint32, pairs)
	for i := range hi {
		hi[i] = bf16Nearest(float32(k.rng.NormFloat64() * 0.02))
	}
	for i := range lo {
		lo[i] = k.rng.Uint32()
	}
	g, m, v := k.randn(n, 1e-3), k.randn(n, 1e-4), make([]float32, n)
	for i := range v {
		v[i] = float32(math.Abs(k.rng.NormFloat64()) * 1e-6)
	}
	p0 := make([]float32, n) // adamw_f32_x4's masters
	for i, b := range hi {
		p0[i] = math.Float32frombits(uint32(b) << 16)
	}
	type state struct {
		p, m, v []float32
		squares float64 // the blocks' sums of the gradient's squares, added in order
	}
	// squared is the kernels' sq buffer and the total it holds once they
	// have run on grid.
	squared := func(grid Grid) (*Buffer, func() float64) {
		buf := k.poisoned(2 * int(grid.Grid.X))
		return buf, func() float64 {
			sums := make([]float64, grid.Grid.X)
			if err := d.CopyFromDevice(Bytes(sums), buf, 0); err != nil {
				t.Fatal(err)
			}
			total := 0.0
			for _, s := range sums {
				total += s
			}
			d.Free(buf)
			return total
		}
	}
	results := map[string][2]state{} // per build: split, x4
	for _, b := range builds {
		dh, dl, dg, dm, dv := upload(k, hi), upload(k, lo), upload(k, g), upload(k, m), upload(k, v)
		grid := d.StrideGrid(pairs, 256, strideBlocksPerSM)
		sq, total := squared(grid)
		mustLaunch(t, d, b.split32, grid, append([]any{dh, dl, dg, dm, dv, int64(pairs)}, adamWLabArgs(h, sq)...)...)
		bits, lows := make([]uint16, n), make([]uint32, pairs)
		if err := d.Sync(); err != nil {
			t.Fatal(err)
		}
		if err := d.CopyFromDevice(Bytes(bits), dh, 0); err != nil {
			t.Fatal(err)
		}
		if err := d.CopyFromDevice(Bytes(lows), dl, 0); err != nil {
			t.Fatal(err)
		}
		joined := make([]float32, n)
		for i := range joined {
			joined[i] = math.Float32frombits(uint32(bits[i])<<16 + uint32(int32(int16(lows[i/2]>>(16*(i%2))))))
		}
		split := state{joined, k.download(dm, n), k.download(dv, n), total()}

		const n4 = n - 1
		dp, dg4, dm4, dv4 := upload(k, p0[:n4]), upload(k, g[:n4]), upload(k, m[:n4]), upload(k, v[:n4])
		grid4 := d.StrideGrid(n4, 256, strideBlocksPerSM)
		sq4, total4 := squared(grid4)
		mustLaunch(t, d, b.f32x4, grid4, append([]any{dp, dg4, dm4, dv4, int64(n4)}, adamWLabArgs(h, sq4)...)...)
		x4 := state{k.download(dp, n4), k.download(dm4, n4), k.download(dv4, n4), total4()}
		results[b.name] = [2]state{split, x4}
		for _, buf := range []*Buffer{dh, dl, dg, dm, dv, dp, dg4, dm4, dv4} {
			d.Free(buf)
		}
	}
	prod := results["production"]
	hostSquares := func(x []float32) float64 {
		s := 0.0
		for _, v := range x {
			s += float64(v) * float64(v)
		}
		return s
	}
	for i, want := range []float64{hostSquares(g), hostSquares(g[:n-1])} {
		if got := prod[i].squares; !(math.Abs(got-want) <= 1e-12*want) {
			t.Errorf("production's kernel %d: the gradient's squares came to %v, the host's sum to %v", i, got, want)
		}
	}
	for _, b := range builds[1:] {
		got := results[b.name]
		for i, kernel := range []string{"adamw_split", "adamw_f32_x4"} {
			for _, c := range []struct {
				what      string
				got, want []float32
			}{{"weights", got[i].p, prod[i].p}, {"m", got[i].m, prod[i].m}, {"v", got[i].v, prod[i].v}} {
				if err := agree(c.got, c.want, b.exact); err != nil {
					t.Errorf("%s %s %s: %v", b.name, kernel, c.what, err)
				}
			}
			if a, w := got[i].squares, prod[i].squares; !(math.Abs(a-w) <= 1e-12*w) {
				t.Errorf("%s %s: the gradient's squares came to %v, production's to %v", b.name, kernel, a, w)
			}
		}
	}

	// Figures.
	const fine = 64 * 3 * 2048 * 1408 // the fine-grained model's experts in one layer
	const finePairs = fine / 2
	const bytesPerWeight = 28
	fill := kernel(t, d, "elementwise.cu", "fill_f32")
	alloc := func(words int64, value float32) *Buffer {
		t.Helper()
		buf, err := d.Alloc(4 * words)
		if err != nil {
			t.Fatal(err)
		}
		mustLaunch(t, d, fill, d.StrideGrid(words, 256, strideBlocksPerSM), buf, value, words)
		return buf
	}
	timeBuild := func(name string, weights int64, run func() error) {
		t.Helper()
		ms := eventMS(t, d, 5, run)
		figure(t, name+" ms", ms, "ms")
		figure(t, name, float64(bytesPerWeight*weights)/ms/1e9, "TB/s")
	}
	{
		// A weight of about 0.0078 in both halves of every hi word.
		hiW, loW := alloc(finePairs, math.Float32frombits(0x3c003c00)), alloc(finePairs, 0)
		gW, mW, vW := alloc(fine, 1e-3), alloc(fine, 1e-4), alloc(fine, 1e-6)
		for _, b := range builds {
			grid := d.StrideGrid(finePairs, 256, strideBlocksPerSM)
			a := append([]any{hiW, loW, gW, mW, vW, int64(finePairs)}, args...)
			timeBuild(fmt.Sprintf("adamw adamw_split %s (553.6M weights)", b.name), fine, func() error { return d.Launch(b.split32, grid, a...) })
		}
		for _, buf := range []*Buffer{hiW, loW, gW, mW, vW} {
			d.Free(buf)
		}
	}
	{
		const n = 256 << 20
		pW, gW, mW, vW := alloc(n, 0.01), alloc(n, 1e-3), alloc(n, 1e-4), alloc(n, 1e-6)
		for _, b := range builds {
			grid := d.StrideGrid(n, 256, strideBlocksPerSM)
			a := append([]any{pW, gW, mW, vW, int64(n)}, args...)
			timeBuild(fmt.Sprintf("adamw adamw_f32_x4 %s (268.4M weights)", b.name), n, func() error { return d.Launch(b.f32x4, grid, a...) })
		}
		for _, buf := range []*Buffer{pW, gW, mW, vW} {
			d.Free(buf)
		}
	}
	if len(builds) == 1 {
		lab, _ := labVariants(t, "adamw_lab.cu", false)
		var names []string
		for _, v := range lab.Variants {
			names = append(names, v.Name)
		}
		t.Logf("production only: %s names no variant of adamw_lab.cu (%s)", labVariantsEnv, strings.Join(names, ", "))
	}
}

// mustLaunch queues k and fails t on a refused launch.
func mustLaunch(t *testing.T, d *Device, k *Kernel, g Grid, args ...any) {
	t.Helper()
	if err := d.Launch(k, g, args...); err != nil {
		t.Fatal(err)
	}
}

// agree compares a variant's float32 results with production's: bit for
// bit where exact, else within 8 float32 rounding errors of the larger
// magnitude (float32 arithmetic against float64), NaNs alike.
func agree(got, want []float32, exact bool) error {
	if len(got) != len(want) {
		return fmt.Errorf("%d values, want %d", len(got), len(want))
	}
	for i := range got {
		a, b := got[i], want[i]
		if math.Float32bits(a) == math.Float32bits(b) {
			continue
		}
		if exact {
			return fmt.Errorf("element %d is %x, production %x", i, math.Float32bits(a), math.Float32bits(b))
		}
		mag := math.Max(math.Abs(float64(a)), math.Abs(float64(b)))
		if diff := math.Abs(float64(a) - float64(b)); !(diff <= 8*mag*0x1p-24) {
			return fmt.Errorf("element %d is %g, production %g (%.2g apart, %.2g relative)", i, a, b, diff, diff/mag)
		}
	}
	return nil
}
