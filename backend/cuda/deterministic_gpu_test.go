package cuda

// SetDeterministic's ordered scatter-add against the CPU backend, bit for
// bit: both add each output row's contributions in increasing index with
// every product and sum rounded on its own.

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
)

// deterministicBackend is a Backend of its own on the shared device, so
// its setting does not reach the other tests.
func deterministicBackend(t *testing.T) *Backend {
	t.Helper()
	b, err := NewBackend(testDevice(t))
	if err != nil {
		t.Fatal(err)
	}
	b.SetDeterministic(true)
	return b
}

func randomFloats(rng *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(rng.NormFloat64())
	}
	return v
}

// sameBits reports the first element where got and want differ in any bit.
func sameBits(t *testing.T, what string, got, want []float32) {
	t.Helper()
	for i := range want {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Errorf("%s: element %d is %v, the CPU's %v (not the same bits)", what, i, got[i], want[i])
			return
		}
	}
}

func TestDeterministicScatterMatchesCPUBits(t *testing.T) {
	g := deterministicBackend(t)
	c := cpu.New(backend.Float32)
	rng := rand.New(rand.NewPCG(7, 11))
	for _, tc := range []struct{ t, n, d int }{{1, 1, 1}, {7, 300, 33}, {64, 5000, 256}, {1000, 40000, 96}, {3, 2000, 512}} {
		rows := make([]int32, tc.n)
		for i := range rows {
			rows[i] = int32(rng.IntN(tc.t))
		}
		out0, in, scale := randomFloats(rng, tc.t*tc.d), randomFloats(rng, tc.n*tc.d), randomFloats(rng, tc.n)
		for _, scaled := range []bool{false, true} {
			name := fmt.Sprintf("ScatterAddRows t=%d n=%d d=%d scaled=%v", tc.t, tc.n, tc.d, scaled)
			var want, got []float32
			for _, b := range []backend.Backend{c, g} {
				out, inT, rowsT := b.New(backend.Float32, tc.t, tc.d), b.New(backend.Float32, tc.n, tc.d), b.New(backend.Int32, tc.n)
				backend.UploadSlice(b, out, out0)
				backend.UploadSlice(b, inT, in)
				backend.UploadSlice(b, rowsT, rows)
				var s backend.Tensor
				if scaled {
					s = b.New(backend.Float32, tc.n)
					backend.UploadSlice(b, s, scale)
				}
				b.ScatterAddRows(out, inT, rowsT, s)
				res := backend.DownloadFloat32(b, out)
				if b == backend.Backend(c) {
					want = res
				} else {
					got = res
				}
			}
			sameBits(t, name, got, want)
			// The embedding's gradient is the same sum, unscaled.
			if !scaled {
				var wantE, gotE []float32
				for _, b := range []backend.Backend{c, g} {
					table, dOut, ids := b.New(backend.Float32, tc.t, tc.d), b.New(backend.Float32, tc.n, tc.d), b.New(backend.Int32, tc.n)
					backend.UploadSlice(b, table, out0)
					backend.UploadSlice(b, dOut, in)
					backend.UploadSlice(b, ids, rows)
					b.EmbeddingBackward(table, dOut, ids)
					if res := backend.DownloadFloat32(b, table); b == backend.Backend(c) {
						wantE = res
					} else {
						gotE = res
					}
				}
				sameBits(t, fmt.Sprintf("EmbeddingBackward v=%d t=%d d=%d", tc.t, tc.n, tc.d), gotE, wantE)
			}
		}
	}
	if err := g.Sync(); err != nil {
		t.Fatal(err)
	}
}

// TestDeterministicEmbeddingSkipsBadIDs: ids outside the table (negative,
// or V and above) add nothing, as in the atomic kernel; the rest add as
// the CPU does, bit for bit.
func TestDeterministicEmbeddingSkipsBadIDs(t *testing.T) {
	g := deterministicBackend(t)
	c := cpu.New(backend.Float32)
	rng := rand.New(rand.NewPCG(5, 8))
	const v, n, d = 50, 3000, 64
	ids := make([]int32, n)
	var goodIDs []int32
	dOut := randomFloats(rng, n*d)
	var goodRows []float32
	for i := range ids {
		switch rng.IntN(10) {
		case 0:
			ids[i] = -1 - int32(rng.IntN(1000))
		case 1:
			ids[i] = v + int32(rng.IntN(1000))
		default:
			ids[i] = int32(rng.IntN(v))
			goodIDs = append(goodIDs, ids[i])
			goodRows = append(goodRows, dOut[i*d:(i+1)*d]...)
		}
	}
	table0 := randomFloats(rng, v*d)
	want := func() []float32 {
		table, rows, idsT := c.New(backend.Float32, v, d), c.New(backend.Float32, len(goodIDs), d), c.New(backend.Int32, len(goodIDs))
		backend.UploadSlice(c, table, table0)
		backend.UploadSlice(c, rows, goodRows)
		backend.UploadSlice(c, idsT, goodIDs)
		c.EmbeddingBackward(table, rows, idsT)
		return backend.DownloadFloat32(c, table)
	}()
	table, rows, idsT := g.New(backend.Float32, v, d), g.New(backend.Float32, n, d), g.New(backend.Int32, n)
	backend.UploadSlice(g, table, table0)
	backend.UploadSlice(g, rows, dOut)
	backend.UploadSlice(g, idsT, ids)
	g.EmbeddingBackward(table, rows, idsT)
	sameBits(t, "EmbeddingBackward with ids outside the table", backend.DownloadFloat32(g, table), want)
	if err := g.Sync(); err != nil {
		t.Fatal(err)
	}
}

// TestDeterministicCombineRowsMatchesCPUBits: CombineRows with every row
// flagged is ScatterAddRows, in the same bits as the CPU's, and clears the
// flags.
func TestDeterministicCombineRowsMatchesCPUBits(t *testing.T) {
	g := deterministicBackend(t)
	c := cpu.New(backend.Float32)
	rng := rand.New(rand.NewPCG(3, 5))
	const tokens, n, d = 512, 1024, 128
	rows := make([]int32, n)
	for i := range rows {
		rows[i] = int32(rng.IntN(tokens))
	}
	in, scale := randomFloats(rng, n*d), randomFloats(rng, n)
	var want []float32
	{
		out, inT, rowsT, s := c.New(backend.Float32, tokens, d), c.New(backend.Float32, n, d), c.New(backend.Int32, n), c.New(backend.Float32, n)
		backend.UploadSlice(c, inT, in)
		backend.UploadSlice(c, rowsT, rows)
		backend.UploadSlice(c, s, scale)
		c.ScatterAddRows(out, inT, rowsT, s)
		want = backend.DownloadFloat32(c, out)
	}
	out, inT, rowsT, s, done := g.New(backend.Float32, tokens, d), g.New(backend.Float32, n, d), g.New(backend.Int32, n), g.New(backend.Float32, n), g.New(backend.Int32, n)
	backend.UploadSlice(g, inT, in)
	backend.UploadSlice(g, rowsT, rows)
	backend.UploadSlice(g, s, scale)
	flags := make([]int32, n)
	for i := range flags {
		flags[i] = 1
	}
	backend.UploadSlice(g, done, flags)
	g.CombineRows(out, inT, rowsT, s, done, []int{n})
	sameBits(t, "CombineRows", backend.DownloadFloat32(g, out), want)
	for i, f := range backend.DownloadInt32(g, done) {
		if f != 0 {
			t.Fatalf("CombineRows left send row %d's flag at %d, want 0", i, f)
		}
	}
	if err := g.Sync(); err != nil {
		t.Fatal(err)
	}
}

// TestRMSNormWeightGradRepeats: the weight gradient (partial sums per
// block row, then an ordered reduce) has the same bits on every call.
func TestRMSNormWeightGradRepeats(t *testing.T) {
	b := testBackend(t)
	rng := rand.New(rand.NewPCG(1, 2))
	const tokens, d = 8192, 1024
	x, dout, w := b.New(backend.Float32, tokens, d), b.New(backend.Float32, tokens, d), b.New(backend.Float32, d)
	backend.UploadSlice(b, x, randomFloats(rng, tokens*d))
	backend.UploadSlice(b, dout, randomFloats(rng, tokens*d))
	backend.UploadSlice(b, w, randomFloats(rng, d))
	out, rstd, dx := b.New(backend.Float32, tokens, d), b.New(backend.Float32, tokens), b.New(backend.Float32, tokens, d)
	b.RMSNormForward(out, rstd, nil, x, w, 1e-5)
	var first []float32
	for range 5 {
		dw := b.New(backend.Float32, d)
		b.RMSNormBackward(dx, dw, dout, x, w, rstd, 0)
		got := backend.DownloadFloat32(b, dw)
		if first == nil {
			first = got
			continue
		}
		for i := range first {
			if math.Float32bits(got[i]) != math.Float32bits(first[i]) {
				t.Fatalf("dw[%d] is %v, %v on the first call", i, got[i], first[i])
			}
		}
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
}

// TestDeterministicScatterCost logs what the ordered scatter-add costs
// against the atomic one at moe-small's shapes: the combine (32768 send
// rows into 16384 tokens of width 1024) and the embedding's gradient
// (16384 tokens into 32768 rows, byte-level ids, so long runs of one id).
func TestDeterministicScatterCost(t *testing.T) {
	det, atomic := deterministicBackend(t), testBackend(t)
	rng := rand.New(rand.NewPCG(9, 9))
	const d = 1024
	for _, c := range []struct {
		name    string
		n, rows int
		key     func() int32
	}{
		{"combine", 32768, 16384, func() int32 { return int32(rng.IntN(16384)) }},
		{"embedding", 16384, 32768, func() int32 { return int32(min(rng.ExpFloat64()*20, 255)) }},
	} {
		keys := make([]int32, c.n)
		for i := range keys {
			keys[i] = c.key()
		}
		var ms [2]float64
		for k, b := range []*Backend{atomic, det} {
			out, in, rows := b.New(backend.Float32, c.rows, d), b.New(backend.Float32, c.n, d), b.New(backend.Int32, c.n)
			backend.UploadSlice(b, in, randomFloats(rng, c.n*d))
			backend.UploadSlice(b, rows, keys)
			const warmup, iters = 3, 20
			for range warmup {
				b.ScatterAddRows(out, in, rows, nil)
			}
			if err := b.Sync(); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			for range iters {
				b.ScatterAddRows(out, in, rows, nil)
			}
			if err := b.Sync(); err != nil {
				t.Fatal(err)
			}
			ms[k] = float64(time.Since(start).Microseconds()) / 1000 / iters
		}
		t.Logf("figure: ScatterAddRows %s n=%d d=%d atomic = %.4g ms", c.name, c.n, d, ms[0])
		t.Logf("figure: ScatterAddRows %s n=%d d=%d deterministic = %.4g ms", c.name, c.n, d, ms[1])
	}
}

// TestGatherSumRowsMatchesCPUBits: the combine as a gather adds each
// token's rows in increasing position with every product and sum rounded
// on its own, so the GPU gives the CPU backend's bits on every call, from
// float32 and from bf16 rows, scaled and not, at widths the vector path
// takes and at others; on float32 rows those are ScatterAddRows' bits on
// the CPU too (the sum the MoE combine made before).
func TestGatherSumRowsMatchesCPUBits(t *testing.T) {
	g, err := NewBackend(testDevice(t))
	if err != nil {
		t.Fatal(err)
	}
	c := cpu.New(backend.Float32)
	rng := rand.New(rand.NewPCG(3, 5))
	for _, tc := range []struct{ t, k, d int }{{2, 1, 1}, {37, 2, 33}, {300, 6, 1024}, {64, 8, 2048}, {5, 3, 4}} {
		n := tc.t * tc.k * 3 / 4 // a quarter of the assignments dropped
		pos := make([]int32, tc.t*tc.k)
		for i := range pos {
			pos[i] = -1
		}
		tok := make([]int32, n) // the scatter's view: the token of each row
		for r, a := range rng.Perm(tc.t * tc.k)[:n] {
			pos[a], tok[r] = int32(r), int32(a/tc.k)
		}
		out0, in, scale := randomFloats(rng, tc.t*tc.d), roundBF16(randomFloats(rng, n*tc.d)), randomFloats(rng, tc.t*tc.k)
		for _, bf16 := range []bool{false, true} {
			for _, scaled := range []bool{false, true} {
				name := fmt.Sprintf("GatherSumRows t=%d k=%d d=%d bf16=%v scaled=%v", tc.t, tc.k, tc.d, bf16, scaled)
				var want, got []float32
				for _, b := range []backend.Backend{c, g} {
					dt := backend.Float32
					if bf16 {
						dt = backend.BFloat16
					}
					out, inT, posT := b.New(backend.Float32, tc.t, tc.d), b.New(dt, n, tc.d), b.New(backend.Int32, tc.t, tc.k)
					backend.UploadSlice(b, out, out0)
					backend.UploadSlice(b, inT, in)
					backend.UploadSlice(b, posT, pos)
					var s backend.Tensor
					if scaled {
						s = b.New(backend.Float32, tc.t, tc.k)
						backend.UploadSlice(b, s, scale)
					}
					b.GatherSumRows(out, inT, posT, s)
					if res := backend.DownloadFloat32(b, out); b == backend.Backend(c) {
						want = res
					} else {
						got = res
					}
				}
				sameBits(t, name, got, want)
				if bf16 {
					continue
				}
				// The same sums by the CPU's scatter over the rows.
				out, inT, rows := c.New(backend.Float32, tc.t, tc.d), c.New(backend.Float32, n, tc.d), c.New(backend.Int32, n)
				backend.UploadSlice(c, out, out0)
				backend.UploadSlice(c, inT, in)
				backend.UploadSlice(c, rows, tok)
				var s backend.Tensor
				if scaled {
					perRow := make([]float32, n)
					for a, p := range pos {
						if p >= 0 {
							perRow[p] = scale[a]
						}
					}
					s = c.New(backend.Float32, n)
					backend.UploadSlice(c, s, perRow)
				}
				c.ScatterAddRows(out, inT, rows, s)
				sameBits(t, name+" against the CPU's ScatterAddRows", got, backend.DownloadFloat32(c, out))
			}
		}
	}
	if err := g.Sync(); err != nil {
		t.Fatal(err)
	}
}
