package cuda

// The peer-row kernels on the GPU, beyond the conformance suite: results
// bit for bit (a gathered value is a copy or one float32 product, rounded
// once to bf16) on the four-wide and the scalar paths, and the documented
// handling of bad references (NaN rows, skipped rows, no fault).

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/mktrain/mktrain/backend"
)

// peerUp makes a tensor of dt holding xs (float32 or int32).
func peerUp[T float32 | int32](b *Backend, dt backend.DType, xs []T, shape ...int) backend.Tensor {
	t := b.New(dt, shape...)
	if len(xs) > 0 {
		backend.UploadSlice(b, t, xs)
	}
	return t
}

func TestPeerRowsExact(t *testing.T) {
	b := testBackend(t)
	rng := rand.New(rand.NewPCG(71, 1))
	send, rows := []int{40, 0, 25}, []int{30, 1, 20}
	const R = 77
	var refs []int32
	for range R {
		s := []int32{0, 2}[rng.IntN(2)]
		refs = append(refs, s, int32(rng.IntN(send[s])))
	}
	refsT := peerUp(b, backend.Int32, refs, R, 2)
	// d = 64 takes the four-wide path, d = 63 the scalar one.
	for _, d := range []int{64, 63} {
		var src [][]float32
		var tok [][]int32
		var scale [][]float32
		var srcT, tokT, scaleT []backend.Tensor
		for s := range send {
			x := make([]float32, rows[s]*d)
			for i := range x {
				x[i] = float32(rng.NormFloat64())
			}
			tk := make([]int32, send[s])
			sc := make([]float32, send[s])
			for i := range tk {
				tk[i], sc[i] = int32(rng.IntN(rows[s])), float32(rng.NormFloat64())
			}
			src, tok, scale = append(src, x), append(tok, tk), append(scale, sc)
			srcT = append(srcT, peerUp(b, backend.Float32, x, rows[s], d))
			tokT = append(tokT, peerUp(b, backend.Int32, tk, send[s]))
			scaleT = append(scaleT, peerUp(b, backend.Float32, sc, send[s]))
		}
		for _, dt := range []backend.DType{backend.Float32, backend.BFloat16} {
			for _, scaled := range []bool{false, true} {
				out := b.New(dt, R, d)
				sc := scaleT
				if !scaled {
					sc = nil
				}
				b.GatherPeerRows(out, srcT, tokT, sc, refsT)
				got := backend.DownloadFloat32(b, out)
				for r := range R {
					s, p := refs[2*r], refs[2*r+1]
					k := float32(1)
					if scaled {
						k = scale[s][p]
					}
					t0 := int(tok[s][p]) * d
					for j := range d {
						want := k * src[s][t0+j]
						if dt == backend.BFloat16 {
							want = bf16Value(bf16Nearest(want))
						}
						if math.Float32bits(got[r*d+j]) != math.Float32bits(want) {
							t.Fatalf("d=%d %v scaled=%v: out[%d, %d] = %v, want %v", d, dt, scaled, r, j, got[r*d+j], want)
						}
					}
				}
			}
		}
		// Scatter the float rows back: distinct references, rank 1 empty.
		in := make([]float32, (send[0]+send[2])*d)
		for i := range in {
			in[i] = float32(rng.NormFloat64())
		}
		var sref []int32
		for _, s := range []int32{2, 0} {
			for p := range send[s] {
				sref = append(sref, s, int32(p))
			}
		}
		outs := []backend.Tensor{b.New(backend.Float32, send[0], d), b.New(backend.Float32, 0, d), b.New(backend.Float32, send[2], d)}
		b.ScatterPeerRows(outs, peerUp(b, backend.Float32, in, len(sref)/2, d), peerUp(b, backend.Int32, sref, len(sref)/2, 2))
		got := [][]float32{backend.DownloadFloat32(b, outs[0]), nil, backend.DownloadFloat32(b, outs[2])}
		for r := range len(sref) / 2 {
			s, p := sref[2*r], int(sref[2*r+1])
			for j := range d {
				if got[s][p*d+j] != in[r*d+j] {
					t.Fatalf("d=%d: scatter out%d[%d, %d] = %v, want %v", d, s, p, j, got[s][p*d+j], in[r*d+j])
				}
			}
		}
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
}

// TestPeerRowsBadReferences: a gather row whose rank, position or token is
// out of range comes out NaN and a scatter row with a bad reference is
// skipped, the good rows are right, and nothing faults.
func TestPeerRowsBadReferences(t *testing.T) {
	b := testBackend(t)
	const d = 8
	x0, x1 := make([]float32, 4*d), make([]float32, 2*d)
	for i := range x0 {
		x0[i] = float32(i)
	}
	for i := range x1 {
		x1[i] = float32(-i)
	}
	src := []backend.Tensor{peerUp(b, backend.Float32, x0, 4, d), peerUp(b, backend.Float32, x1, 2, d)}
	// Rank 0's third token is past its source's 4 rows.
	tok := []backend.Tensor{peerUp(b, backend.Int32, []int32{1, 3, 4}, 3), peerUp(b, backend.Int32, []int32{0}, 1)}
	refs := []int32{0, 0, 2, 0, 0, 3, 1, 0, 0, 2, -1, 0, 1, -1, 0, 1}
	good := map[int][]float32{0: x0[1*d : 2*d], 3: x1[0:d], 7: x0[3*d : 4*d]}
	out := b.New(backend.Float32, len(refs)/2, d)
	b.GatherPeerRows(out, src, tok, nil, peerUp(b, backend.Int32, refs, len(refs)/2, 2))
	got := backend.DownloadFloat32(b, out)
	for r := range len(refs) / 2 {
		for j := range d {
			v := got[r*d+j]
			if want, ok := good[r]; ok && v != want[j] || !ok && !math.IsNaN(float64(v)) {
				t.Fatalf("gather row %d (ref %d, %d): element %d is %v", r, refs[2*r], refs[2*r+1], j, v)
			}
		}
	}

	const fill = 7
	full := func(n int) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = fill
		}
		return x
	}
	outs := []backend.Tensor{peerUp(b, backend.Float32, full(3*d), 3, d), peerUp(b, backend.Float32, full(d), 1, d)}
	sref := []int32{0, 1, 2, 0, 1, 1, 0, -1, 1, 0}
	in := make([]float32, len(sref)/2*d)
	for i := range in {
		in[i] = float32(100 + i)
	}
	b.ScatterPeerRows(outs, peerUp(b, backend.Float32, in, len(sref)/2, d), peerUp(b, backend.Int32, sref, len(sref)/2, 2))
	want0, want1 := full(3*d), full(d)
	copy(want0[1*d:2*d], in[0:d])
	copy(want1, in[4*d:5*d])
	for s, want := range [][]float32{want0, want1} {
		g := backend.DownloadFloat32(b, outs[s])
		for i := range want {
			if g[i] != want[i] {
				t.Fatalf("scatter out%d element %d is %v, want %v", s, i, g[i], want[i])
			}
		}
	}
	if err := b.Sync(); err != nil {
		t.Fatalf("bad references faulted: %v", err)
	}
}
