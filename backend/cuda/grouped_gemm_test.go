package cuda

// Host-side parts of the grouped GEMM, no GPU: argument validation, tensor
// map checks, the n-tile choice, and the Go twin of the kernel's tile
// schedule (every owned output element covered exactly once, nothing
// else). Also the float64 reference the GPU tests compare against.

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/mktrain/mktrain/backend/cuda/driver"
)

func TestGroupedGemmCheck(t *testing.T) {
	const p = driver.DevicePtr(1 << 20)
	ok := func() (driver.DevicePtr, driver.DevicePtr, driver.DevicePtr, driver.DevicePtr, int, int, int, int, int) {
		return p, p, p, p, 1000, 2816, 1024, 8, 0
	}
	out, a, w, off, rows, n, k, e, bn := ok()
	if err := checkGroupedGemm(out, a, w, off, rows, n, k, e, bn); err != nil {
		t.Fatalf("valid call refused: %v", err)
	}
	if err := checkGroupedGemm(out, a, w, off, 0, n, k, e, 256); err != nil {
		t.Fatalf("rows 0 refused: %v", err)
	}
	cases := []struct {
		want string
		mod  func(o, a, w, f *driver.DevicePtr, rows, n, k, e, bn *int)
	}{
		{"rows", func(o, a, w, f *driver.DevicePtr, rows, n, k, e, bn *int) { *rows = -1 }},
		{"n 0", func(o, a, w, f *driver.DevicePtr, rows, n, k, e, bn *int) { *n = 0 }},
		{"n 12", func(o, a, w, f *driver.DevicePtr, rows, n, k, e, bn *int) { *n = 12 }},
		{"k 1020", func(o, a, w, f *driver.DevicePtr, rows, n, k, e, bn *int) { *k = 1020 }},
		{"k 0", func(o, a, w, f *driver.DevicePtr, rows, n, k, e, bn *int) { *k = 0 }},
		{"experts 0", func(o, a, w, f *driver.DevicePtr, rows, n, k, e, bn *int) { *e = 0 }},
		{"experts 1025", func(o, a, w, f *driver.DevicePtr, rows, n, k, e, bn *int) { *e = 1025 }},
		{"BN 64", func(o, a, w, f *driver.DevicePtr, rows, n, k, e, bn *int) { *bn = 64 }},
		{"outRN is null", func(o, a, w, f *driver.DevicePtr, rows, n, k, e, bn *int) { *o = 0 }},
		{"aRK", func(o, a, w, f *driver.DevicePtr, rows, n, k, e, bn *int) { *a += 8 }},
		{"wENK", func(o, a, w, f *driver.DevicePtr, rows, n, k, e, bn *int) { *w += 2 }},
		{"offsetsE1", func(o, a, w, f *driver.DevicePtr, rows, n, k, e, bn *int) { *f += 2 }},
		{"tiles", func(o, a, w, f *driver.DevicePtr, rows, n, k, e, bn *int) { *rows, *n = math.MaxInt32, 1<<20 }},
	}
	for _, c := range cases {
		out, a, w, off, rows, n, k, e, bn := ok()
		c.mod(&out, &a, &w, &off, &rows, &n, &k, &e, &bn)
		err := checkGroupedGemm(out, a, w, off, rows, n, k, e, bn)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %v, want an error naming %q", c.want, err, c.want)
		}
	}
}

func TestGroupedGemmRunChecks(t *testing.T) {
	// Run validates before it touches the device (nil here).
	const p = driver.DevicePtr(1 << 20)
	g := &GroupedGemm{}
	if err := g.Run(p, p+4, p, p, 100, 64, 64, 2, false, 1, 0); err == nil || !strings.Contains(err.Error(), "aRK") {
		t.Errorf("misaligned A: %v", err)
	}
	if err := g.Run(p, p, p, p, 0, 64, 64, 2, false, 1, 0); err != nil {
		t.Errorf("rows 0 is a no-op, got %v", err)
	}
	for kern := range ggNTKernels {
		if err := g.runNT(kern, p, p, p+2, p, 100, 64, 64, 2, 1, 0); err == nil || !strings.Contains(err.Error(), "wENK") {
			t.Errorf("%s, misaligned W: %v", ggNTKernelList()[kern].name, err)
		}
	}
}

// TestGroupedGemmTileOrder pins the tile order on a small case: 5
// m-tiles (one expert), 3 n-tiles, m-tile major.
func TestGroupedGemmTileOrder(t *testing.T) {
	beg, end, cum := ggSchedule([]int32{0, 5 * ggBM}, 5*ggBM)
	type mn struct{ m, n int }
	var got []mn
	for tile := range 15 {
		tl := ggTileOf(tile, 3, 128, beg, end, cum)
		got = append(got, mn{tl.Row0 / ggBM, tl.N0 / 128})
	}
	want := []mn{{0, 0}, {0, 1}, {0, 2}, {1, 0}, {1, 1}, {1, 2}, {2, 0}, {2, 1}, {2, 2}, {3, 0}, {3, 1}, {3, 2}, {4, 0}, {4, 1}, {4, 2}}
	if !slices.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
}

func TestTiledMapCheck(t *testing.T) {
	good := func() driver.TiledMap {
		return driver.TiledMap{Type: driver.TensorMapBfloat16, Addr: 1 << 20,
			Dims: []uint64{1024, 3000, 8}, Strides: []uint64{2048, 2048 * 3000},
			Box: []uint32{64, 256, 1}, Swizzle: driver.Swizzle128B}
	}
	if err := good().Check(); err != nil {
		t.Fatalf("valid map refused: %v", err)
	}
	cases := []struct {
		want string
		mod  func(m *driver.TiledMap)
	}{
		{"data type", func(m *driver.TiledMap) { m.Type = 42 }},
		{"rank", func(m *driver.TiledMap) { m.Dims = nil }},
		{"strides", func(m *driver.TiledMap) { m.Strides = m.Strides[:1] }},
		{"box has", func(m *driver.TiledMap) { m.Box = m.Box[:2] }},
		{"aligned", func(m *driver.TiledMap) { m.Addr += 8 }},
		{"dim 1", func(m *driver.TiledMap) { m.Dims[1] = 0 }},
		{"stride 1", func(m *driver.TiledMap) { m.Strides[0] = 2040 }},
		{"box dim 1", func(m *driver.TiledMap) { m.Box[1] = 512 }},
		{"multiple of 16", func(m *driver.TiledMap) { m.Box[0] = 4 }},
		{"swizzle", func(m *driver.TiledMap) { m.Box[0] = 128 }},
	}
	for _, c := range cases {
		m := good()
		c.mod(&m)
		err := m.Check()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %v", c.want, err)
		}
	}
}

func TestGroupedGemmPickBN(t *testing.T) {
	for _, c := range []struct{ n, bn int }{{2816, 256}, {1024, 256}, {5632, 256}, {1408, 128}, {136, 256}, {8, 128}, {384, 128}, {512, 256}} {
		if got := ggPickBN(c.n); got != c.bn {
			t.Errorf("ggPickBN(%d) = %d, want %d", c.n, got, c.bn)
		}
	}
	// The largest schedule fits the shared memory Hopper lets a block opt
	// in to (227 KiB), for every kernel a GroupedGemm launches.
	const hopper = 227 * 1024
	for kern, k := range ggNTKernelList() {
		if b := ggSmemBytes(kern, ggMaxExperts); b > hopper {
			t.Errorf("%s: %d bytes of shared memory", k.name, b)
		}
	}
	for name, b := range map[string]int{"gathering kernels": fusedGatherSmem(ggMaxExperts),
		"combining kernels": fusedCombineSmem(ggMaxExperts), "grouped_gemm_tn": ggTNSmemBytes} {
		if b > hopper {
			t.Errorf("%s: %d bytes of shared memory", name, b)
		}
	}
	// The staging buffer (1024-byte aligned, right after the ring) holds
	// two warpgroups' 64x256 bf16 blocks.
	if b := ggNTKernelList()[ggNT256S].stagingBytes; b != 2*64*256*2 {
		t.Errorf("bn256s staging: %d bytes", b)
	}
}

// TestGroupedGemmKernelFor: bf16 outputs take bn256s, float32 ones the n
// tile that pads less, bn128 when bn256 spilled.
func TestGroupedGemmKernelFor(t *testing.T) {
	for _, c := range []struct {
		n             int
		bf16, spilled bool
		want          int
	}{
		{n: 2816, want: ggNT256},
		{n: 1408, want: ggNT128},
		{n: 2816, spilled: true, want: ggNT128},
		{n: 2816, bf16: true, want: ggNT256S},
		{n: 1408, bf16: true, want: ggNT256S},
		{n: 2816, bf16: true, spilled: true, want: ggNT256S},
	} {
		g := &GroupedGemm{spills256: c.spilled}
		if got := g.ntKernelFor(c.n, c.bf16); got != c.want {
			t.Errorf("%+v: kernel %d, want %d", c, got, c.want)
		}
	}
	for kern, k := range ggNTKernelList() {
		if want := kern == ggNT256S; k.outBF16 != want || (k.stagingBytes > 0) != want {
			t.Errorf("%s: outBF16 %v, staging %d", k.name, k.outBF16, k.stagingBytes)
		}
	}
}

// ggRandOffsets draws E+1 offsets over rows: counts from one of several
// patterns (random, all to one expert, many empty), sometimes starting
// after row 0 or ending before rows.
func ggRandOffsets(rng *rand.Rand, e, rows int) []int32 {
	lead, tail := 0, 0
	if rng.IntN(3) == 0 {
		lead = rng.IntN(rows/4 + 1)
	}
	if rng.IntN(3) == 0 {
		tail = rng.IntN(rows/4 + 1)
	}
	owned := rows - lead - tail
	counts := make([]int, e)
	switch rng.IntN(3) {
	case 0: // random split
		for range owned {
			counts[rng.IntN(e)]++
		}
	case 1: // all to one
		counts[rng.IntN(e)] = owned
	default: // about half the experts empty
		live := []int{}
		for i := range e {
			if rng.IntN(2) == 0 {
				live = append(live, i)
			}
		}
		if len(live) == 0 {
			live = append(live, e-1)
		}
		for range owned {
			counts[live[rng.IntN(len(live))]]++
		}
	}
	off := make([]int32, e+1)
	off[0] = int32(lead)
	for i, c := range counts {
		off[i+1] = off[i] + int32(c)
	}
	return off
}

// TestGroupedGemmSchedule checks the schedule twin: walking tiles
// 0..cum[E]*nTN-1 with the kernel's masks (rows < RowEnd, columns < n)
// writes every element of every expert's rows exactly once, with that
// expert's weights, and nothing outside them.
func TestGroupedGemmSchedule(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for it := range 300 {
		e := 1 + rng.IntN(70)
		rows := rng.IntN(2000)
		n := 8 * (1 + rng.IntN(80))
		bn := []int{128, 256}[rng.IntN(2)]
		off := ggRandOffsets(rng, e, rows)
		beg, end, cum := ggSchedule(off, rows)
		nTN := (n + bn - 1) / bn
		// owner[r] is the expert owning row r, -1 if none.
		owner := make([]int, rows)
		for r := range owner {
			owner[r] = -1
		}
		for x := range e {
			for r := int(off[x]); r < int(off[x+1]); r++ {
				owner[r] = x
			}
		}
		hits := make([]int, rows*n)
		for tile := range cum[e] * nTN {
			tl := ggTileOf(tile, nTN, bn, beg, end, cum)
			if tl.Row0 >= tl.RowEnd {
				t.Fatalf("case %d: tile %d (%+v) has no row", it, tile, tl)
			}
			for r := tl.Row0; r < min(tl.Row0+ggBM, tl.RowEnd); r++ {
				if owner[r] != tl.Expert {
					t.Fatalf("case %d: tile %d writes row %d with expert %d, owner %d", it, tile, r, tl.Expert, owner[r])
				}
				for c := tl.N0; c < min(tl.N0+bn, n); c++ {
					hits[r*n+c]++
				}
			}
		}
		for r := range rows {
			want := 1
			if owner[r] < 0 {
				want = 0
			}
			for c := range n {
				if hits[r*n+c] != want {
					t.Fatalf("case %d (E %d rows %d n %d bn %d offsets %v): element (%d, %d) written %d times, want %d",
						it, e, rows, n, bn, off, r, c, hits[r*n+c], want)
				}
			}
		}
		if g := ggGrid(132, rows, n, e, bn); g < 1 || g > 132 || (rows > 0 && g < min(132, cum[e]*nTN)) {
			t.Fatalf("case %d: grid %d for %d tiles", it, g, cum[e]*nTN)
		}
	}
	// Offsets out of order or out of range are clamped to [0, rows] and an
	// expert never ends before it begins.
	beg, end, cum := ggSchedule([]int32{-5, 300, 100, 900}, 500)
	if beg[0] != 0 || end[0] != 300 || beg[1] != 300 || end[1] != 300 || beg[2] != 100 || end[2] != 500 || cum[3] != 3+0+4 {
		t.Errorf("clamping: beg %v end %v cum %v", beg, end, cum)
	}
}

// ggProblem is one grouped GEMM on the host: bf16 operands as float32
// (exact), offsets, and the old output for beta != 0.
type ggProblem struct {
	rows, n, k, e int
	a             []float32 // [rows, k]
	w             []float32 // [e, n, k]
	off           []int32   // e+1
	old           []float32 // [rows, n] or nil
	alpha, beta   float32
	outBF16       bool

	wNormOnce sync.Once
	wNorm     []float64 // ||w[e, c, :]||, filled by referenceRow

	// memo keeps each reference row check computes (float32: its rounding
	// is far below the tolerance), for problems checked against several
	// kernels. memoState[r]: 0 not yet, 1 unowned, 2 owned. A row is
	// filled by the one worker that handles it in a check; checks run one
	// at a time.
	memo               bool
	memoState          []uint8
	memoRef, memoScale []float32
}

// row fills ref and scale with reference row r (referenceRow), from the
// memo when p.memo is set.
func (p *ggProblem) row(r int, ref, scale []float64) bool {
	if !p.memo {
		return p.referenceRow(r, ref, scale)
	}
	switch p.memoState[r] {
	case 1:
		return false
	case 2:
		for c := range p.n {
			ref[c], scale[c] = float64(p.memoRef[r*p.n+c]), float64(p.memoScale[r*p.n+c])
		}
		return true
	}
	if !p.referenceRow(r, ref, scale) {
		p.memoState[r] = 1
		return false
	}
	for c := range p.n {
		p.memoRef[r*p.n+c], p.memoScale[r*p.n+c] = float32(ref[c]), float32(scale[c])
	}
	p.memoState[r] = 2
	return true
}

// ggCheckResult is what comparing a result with the reference found.
type ggCheckResult struct {
	relL2     float64 // over owned rows
	bad       int     // elements outside tolerance, NaN, or unowned and touched
	examples  []string
	checkedEl int64
}

// ggReferenceRow computes row r of the float64 reference into ref (n
// values) and each element's error scale ||a_r|| ||w_c|| (+|beta old|).
// It returns false when no expert owns r.
func (p *ggProblem) referenceRow(r int, ref, scale []float64) bool {
	x := -1
	for i := range p.e {
		if r >= int(p.off[i]) && r < int(p.off[i+1]) {
			x = i
		}
	}
	if x < 0 {
		return false
	}
	p.wNormOnce.Do(func() {
		p.wNorm = make([]float64, p.e*p.n)
		for i := range p.wNorm {
			var s float64
			for _, v := range p.w[i*p.k : (i+1)*p.k] {
				s += float64(v) * float64(v)
			}
			p.wNorm[i] = math.Sqrt(s)
		}
	})
	ar := p.a[r*p.k : (r+1)*p.k]
	var na float64
	for _, v := range ar {
		na += float64(v) * float64(v)
	}
	na = math.Sqrt(na)
	for c := range p.n {
		wc := p.w[(x*p.n+c)*p.k : (x*p.n+c+1)*p.k]
		// bf16 x bf16 is exact in float32; the sums run in float64.
		wc = wc[:len(ar)]
		var s0, s1, s2, s3 float64
		i := 0
		for ; i+4 <= len(ar); i += 4 {
			s0 += float64(ar[i] * wc[i])
			s1 += float64(ar[i+1] * wc[i+1])
			s2 += float64(ar[i+2] * wc[i+2])
			s3 += float64(ar[i+3] * wc[i+3])
		}
		for ; i < len(ar); i++ {
			s0 += float64(ar[i] * wc[i])
		}
		v := float64(p.alpha) * (s0 + s1 + s2 + s3)
		sc := math.Abs(float64(p.alpha)) * na * p.wNorm[x*p.n+c]
		if p.beta != 0 {
			o := float64(p.beta) * float64(p.old[r*p.n+c])
			v += o
			sc += math.Abs(o)
		}
		ref[c], scale[c] = v, sc
	}
	return true
}

// check compares got ([rows, n], float32 or decoded bf16; gotBits the raw
// bits for the poison check of unowned rows) with the reference for the
// rows listed (nil: all), in parallel. Tolerance per element: 1e-4 of its
// scale (float32 accumulation over k terms), plus 2^-8 of |ref| for bf16
// outputs (one rounding). Unowned rows must still hold the poison.
func (p *ggProblem) check(got []float32, poisoned func(i int) bool, rowsToCheck []int) ggCheckResult {
	if rowsToCheck == nil {
		rowsToCheck = make([]int, p.rows)
		for i := range rowsToCheck {
			rowsToCheck[i] = i
		}
	}
	if p.memo && p.memoState == nil {
		p.memoState = make([]uint8, p.rows)
		p.memoRef, p.memoScale = make([]float32, p.rows*p.n), make([]float32, p.rows*p.n)
	}
	workers := runtime.GOMAXPROCS(0)
	type part struct {
		num, den float64
		bad      int
		ex       []string
		n        int64
	}
	parts := make([]part, workers)
	var wg sync.WaitGroup
	for wi := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pt := &parts[wi]
			ref, scale := make([]float64, p.n), make([]float64, p.n)
			for j := wi; j < len(rowsToCheck); j += workers {
				r := rowsToCheck[j]
				owned := p.row(r, ref, scale)
				for c := range p.n {
					i := r*p.n + c
					pt.n++
					if !owned {
						if !poisoned(i) {
							pt.bad++
							if len(pt.ex) < 4 {
								pt.ex = append(pt.ex, ggWhere(r, c, "unowned row written", got[i], math.NaN()))
							}
						}
						continue
					}
					d := float64(got[i]) - ref[c]
					tol := 1e-4 * scale[c]
					if p.outBF16 {
						tol += 0x1p-8 * math.Abs(ref[c])
					}
					pt.num += d * d
					pt.den += ref[c] * ref[c]
					if !(math.Abs(d) <= tol) { // NaN fails too
						pt.bad++
						if len(pt.ex) < 4 {
							pt.ex = append(pt.ex, ggWhere(r, c, "", got[i], ref[c]))
						}
					}
				}
			}
		}()
	}
	wg.Wait()
	var res ggCheckResult
	var num, den float64
	for _, pt := range parts {
		num += pt.num
		den += pt.den
		res.bad += pt.bad
		res.checkedEl += pt.n
		res.examples = append(res.examples, pt.ex...)
	}
	if den > 0 {
		res.relL2 = math.Sqrt(num / den)
	}
	if math.IsNaN(num) {
		res.relL2 = math.NaN()
	}
	return res
}

// ggWhere names an element and its place within a 128x128 tile for a
// failure message.
func ggWhere(r, c int, what string, got float32, want float64) string {
	return fmt.Sprintf("(%d, %d) [row%%128 %d, col%%128 %d] %s: got %g want %g", r, c, r%ggBM, c%128, what, got, want)
}

// TestGroupedGemmReference checks the reference and the checker on a case
// worked by hand, and that the checker catches a wrong element, a NaN and
// a written unowned row.
func TestGroupedGemmReference(t *testing.T) {
	// rows 0..2; expert 0 owns row 0, expert 1 rows 1..2 (n 2, k 2); row 3
	// is owned by no one.
	p := &ggProblem{rows: 4, n: 2, k: 2, e: 2,
		a:     []float32{1, 2, 3, 4, -1, 0.5, 9, 9},
		w:     []float32{1, 0, 0, 1, 2, 1, -1, 1},
		off:   []int32{0, 1, 3},
		old:   []float32{10, 20, 30, 40, 50, 60, 70, 80},
		alpha: 2, beta: 0.5,
	}
	// Row 0, expert 0 (identity): 2*(1,2) + 0.5*(10,20) = (7, 14).
	// Row 1, expert 1 ([2 1; -1 1]): (3,4) -> (10, 1), *2 + (15, 20) = (35, 22).
	// Row 2: (-1, 0.5) -> (-1.5, 1.5), *2 + (25, 30) = (22, 33).
	want := []float32{7, 14, 35, 22, 22, 33, float32(math.NaN()), float32(math.NaN())}
	poison := func(got []float32) func(int) bool {
		return func(i int) bool { return math.IsNaN(float64(got[i])) }
	}
	if res := p.check(want, poison(want), nil); res.bad != 0 || res.relL2 > 1e-12 || res.checkedEl != 8 {
		t.Fatalf("exact answer: %+v", res)
	}
	// The memo gives the same verdicts on a second check (served from it).
	pm := &ggProblem{rows: p.rows, n: p.n, k: p.k, e: p.e, a: p.a, w: p.w, off: p.off, old: p.old, alpha: p.alpha, beta: p.beta, memo: true}
	for range 2 {
		if res := pm.check(want, poison(want), nil); res.bad != 0 || res.relL2 > 1e-6 || res.checkedEl != 8 {
			t.Fatalf("memoized, exact answer: %+v", res)
		}
		bad := append([]float32(nil), want...)
		bad[3] = 21
		if res := pm.check(bad, poison(bad), nil); res.bad != 1 {
			t.Fatalf("memoized, one wrong element: %+v", res)
		}
	}
	for i, v := range []float32{7.01, float32(math.NaN()), 21, 22} {
		got := append([]float32(nil), want...)
		idx := []int{0, 3, 4, 6}[i]
		got[idx] = v
		if res := p.check(got, poison(got), nil); res.bad != 1 {
			t.Errorf("element %d = %v: %d bad, want 1 (%v)", idx, v, res.bad, res.examples)
		}
	}
}

func TestGroupedGemmTNCheck(t *testing.T) {
	const p = driver.DevicePtr(1 << 20)
	if err := checkGroupedGemmTN(p, p, p, p, 4096, 2816, 1024, 8); err != nil {
		t.Fatalf("valid call refused: %v", err)
	}
	for _, c := range []struct {
		want                string
		out, a, b, off      driver.DevicePtr
		rows, m, n, experts int
	}{
		{"rows 0", p, p, p, p, 0, 64, 64, 2},
		{"m 12", p, p, p, p, 10, 12, 64, 2},
		{"n 0", p, p, p, p, 10, 64, 0, 2},
		{"experts 0", p, p, p, p, 10, 64, 64, 0},
		{"experts 1025", p, p, p, p, 10, 64, 64, 1025},
		{"tiles", p, p, p, p, 10, 1 << 24, 1 << 24, 2},
		{"outEMN is null", 0, p, p, p, 10, 64, 64, 2},
		{"aRM", p, p + 8, p, p, 10, 64, 64, 2},
		{"bRN", p, p, p + 2, p, 10, 64, 64, 2},
		{"offsetsE1", p, p, p, p + 2, 10, 64, 64, 2},
	} {
		err := checkGroupedGemmTN(c.out, c.a, c.b, c.off, c.rows, c.m, c.n, c.experts)
		if err == nil || !strings.Contains(err.Error(), strings.Fields(c.want)[0]) {
			t.Errorf("%s: got %v, want an error naming %q", c.want, err, strings.Fields(c.want)[0])
		}
	}
	// RunTN validates before it touches the device (nil here).
	g := &GroupedGemm{}
	if err := g.RunTN(p, p+4, p, p, 100, 64, 64, 2, 1, 1); err == nil || !strings.Contains(err.Error(), "aRM") {
		t.Errorf("misaligned A: %v", err)
	}
}

// TestGroupedGemmTNTiles checks the weight-gradient kernel's tile list
// (ggTNTileOf, the twin of gg_tn_tile): every expert's output block is
// covered once, expert by expert, with m-tiles fastest, including partial
// tiles at the m and n edges.
func TestGroupedGemmTNTiles(t *testing.T) {
	for _, s := range []struct{ m, n, experts int }{{2816, 1024, 2}, {1408, 2048, 2}, {136, 264, 3}, {64, 8, 1}} {
		total := int(ggTNTiles(s.m, s.n, s.experts))
		covered := make([]int, s.experts*s.m*s.n)
		lastExpert := 0
		for tile := range total {
			e, m0, n0 := ggTNTileOf(tile, s.m, s.n)
			if e < lastExpert || e >= s.experts {
				t.Fatalf("%+v: tile %d is expert %d after expert %d", s, tile, e, lastExpert)
			}
			lastExpert = e
			if tile > 0 {
				if pe, pm, _ := ggTNTileOf(tile-1, s.m, s.n); pe == e && m0 != 0 && m0 != pm+ggBM {
					t.Fatalf("%+v: tile %d at m %d after m %d: m-tiles are not fastest", s, tile, m0, pm)
				}
			}
			for i := m0; i < min(m0+ggBM, s.m); i++ {
				for j := n0; j < min(n0+ggTNBN, s.n); j++ {
					covered[(e*s.m+i)*s.n+j]++
				}
			}
		}
		for i, c := range covered {
			if c != 1 {
				t.Fatalf("%+v: element %d covered %d times", s, i, c)
			}
		}
	}
}

// TestGroupedGemmTNFill checks the rule that routes the weight gradients:
// on an H200's 132 SMs the fine-grained shape's tiles fill their waves
// (the TN kernel) and moe-small's leave two thirds of the last one idle
// (the cuBLASLt loop), as measured.
func TestGroupedGemmTNFill(t *testing.T) {
	for _, c := range []struct {
		name          string
		m, n, experts int
		kernel        bool
	}{
		{"moe-small dW1", 2816, 1024, 8, false},
		{"moe-small dW2", 1024, 2816, 8, false},
		{"fine dW1", 1408, 2048, 64, true},
		{"fine dW2", 2048, 1408, 64, true},
		{"one wave exactly", 128 * 11, 256, 12, true},
	} {
		fill := ggTNFill(ggTNTiles(c.m, c.n, c.experts), 132)
		if got := fill >= ggTNMinFill; got != c.kernel {
			t.Errorf("%s: fill %.3f, kernel %v, want %v", c.name, fill, got, c.kernel)
		}
	}
	if f := ggTNFill(704, 132); math.Abs(f-704.0/792) > 1e-12 {
		t.Errorf("ggTNFill(704, 132) = %v, want 704/792", f)
	}
	if ggTNFill(0, 132) != 0 || ggTNFill(10, 0) != 0 {
		t.Error("ggTNFill of no tiles or no SMs is not 0")
	}
}
