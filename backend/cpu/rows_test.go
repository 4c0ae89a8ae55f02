package cpu

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// TestGatherSumRowsIsTheScatter: GatherSumRows adds each token's rows in
// increasing position, so it gives ScatterAddRows' bits over the same
// rows (the MoE combine before it), whatever order the positions come in
// within a token; and it refuses a row that names one position twice.
func TestGatherSumRowsIsTheScatter(t *testing.T) {
	b := New(backend.Float32)
	rng := rand.New(rand.NewPCG(1, 2))
	const T, K, D = 50, 6, 37
	n := T * K * 2 / 3
	pos, tok := make([]int32, T*K), make([]int32, n)
	for i := range pos {
		pos[i] = -1
	}
	for r, a := range rng.Perm(T * K)[:n] {
		pos[a], tok[r] = int32(r), int32(a/K)
	}
	floats := func(m int) []float32 {
		v := make([]float32, m)
		for i := range v {
			v[i] = float32(rng.NormFloat64())
		}
		return v
	}
	out0, in, gates := floats(T*D), floats(n*D), floats(T*K)
	perRow := make([]float32, n)
	for a, p := range pos {
		if p >= 0 {
			perRow[p] = gates[a]
		}
	}
	upload := func(data any, shape ...int) backend.Tensor {
		switch d := data.(type) {
		case []float32:
			x := b.New(backend.Float32, shape...)
			backend.UploadSlice(b, x, d)
			return x
		default:
			x := b.New(backend.Int32, shape...)
			backend.UploadSlice(b, x, d.([]int32))
			return x
		}
	}
	for _, scaled := range []bool{false, true} {
		gathered, scattered := upload(out0, T, D), upload(out0, T, D)
		var sTK, sN backend.Tensor
		if scaled {
			sTK, sN = upload(gates, T, K), upload(perRow, n)
		}
		b.GatherSumRows(gathered, upload(in, n, D), upload(pos, T, K), sTK)
		b.ScatterAddRows(scattered, upload(in, n, D), upload(tok, n), sN)
		got, want := backend.DownloadFloat32(b, gathered), backend.DownloadFloat32(b, scattered)
		for i := range want {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
				t.Fatalf("scaled %v: element %d is %v, the scatter's %v", scaled, i, got[i], want[i])
			}
		}
	}

	twice := append([]int32(nil), pos...)
	twice[0], twice[1] = 3, 3
	defer func() {
		if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "names position 3 twice") {
			t.Errorf("a row naming one position twice: %v", r)
		}
	}()
	b.GatherSumRows(upload(out0, T, D), upload(in, n, D), upload(twice, T, K), nil)
}
