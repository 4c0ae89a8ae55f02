package cpu

// Zigzag context-parallel attention read straight from the peers' tensors:
// the CPU twin of the CUDA backend's fused ring kernels (see
// backend.ZigzagShape for the layout and backend.Backend for the ops).
//
// The arithmetic is attention.go's, in the same order, on the keys and
// queries of the whole sequence: the forward and dq of a query see its
// keys in position order, and dk, dv of a key sum each rank's queries in
// the order that rank's own attention calls would (heads of the group,
// then positions), the ranks in rank order. So the results are bitwise
// those of the context-parallel path that all-gathers k and v, runs the
// per-chunk calls and reduce-scatters dk and dv in rank order.

import (
	"fmt"
	"math"

	"github.com/mktrain/mktrain/backend"
)

// zigzag is a ZigzagShape with the row arithmetic the three ops share.
type zigzag struct{ backend.ZigzagShape }

// keyRow returns the rank and local row that hold position pos of
// sequence bi.
func (z zigzag) keyRow(bi, pos int) (rank, row int) {
	c := pos / z.Chunk
	rank, row0 := z.Owner(c)
	return rank, bi*2*z.Chunk + row0 + pos%z.Chunk
}

// lseIndex is the index in a [B, 2, H, C] tensor of local chunk n, head h,
// row l of the chunk.
func (z zigzag) lseIndex(bi, n, h, l int) int {
	return ((bi*2+n)*z.Heads+h)*z.Chunk + l
}

// checkZigzag panics unless s is well formed and every tensor, every
// rank's of the lists included, has the length s gives it.
func checkZigzag(op string, s backend.ZigzagShape, single []attnArg, lists map[string][]backend.Tensor) {
	if err := s.Check(); err != nil {
		panic(fmt.Sprintf("cpu: %s: %v", op, err))
	}
	rows := s.Batch * 2 * s.Chunk
	want := func(name string, t backend.Tensor, n int) {
		if t == nil || t.Len() != n {
			got := -1
			if t != nil {
				got = t.Len()
			}
			panic(fmt.Sprintf("cpu: %s: %s has %d elements, want %d for %+v", op, name, got, n, s))
		}
	}
	for _, a := range single {
		n := rows * a.heads * s.HeadDim
		if a.heads == 0 { // lse-shaped
			n = s.Batch * 2 * s.Heads * s.Chunk
		}
		want(a.name, a.t, n)
	}
	for name, ts := range lists {
		if len(ts) != s.Ranks {
			panic(fmt.Sprintf("cpu: %s: %d %s tensors for %d ranks", op, len(ts), name, s.Ranks))
		}
		n := rows * s.KVHeads * s.HeadDim
		switch name {
		case "q", "dout", "dq":
			n = rows * s.Heads * s.HeadDim
		case "lse", "delta":
			n = s.Batch * 2 * s.Heads * s.Chunk
		}
		for r, t := range ts {
			want(fmt.Sprintf("%s[%d]", name, r), t, n)
		}
	}
}

// ZigzagAttentionSupports takes every valid shape.
func (b *Backend) ZigzagAttentionSupports(s backend.ZigzagShape) error { return s.Check() }

func (b *Backend) ZigzagAttentionForward(outTQ, lseBHS, qTQ backend.Tensor, kTK, vTK []backend.Tensor, s backend.ZigzagShape) {
	checkZigzag("ZigzagAttentionForward", s,
		[]attnArg{{"out", outTQ, s.Heads, false}, {"lse", lseBHS, 0, false}, {"q", qTQ, s.Heads, false}},
		map[string][]backend.Tensor{"k": kTK, "v": vTK})
	if b.dt == backend.Float32 {
		zigzagForward[float32](b, outTQ, lseBHS, qTQ, kTK, vTK, zigzag{s})
	} else {
		zigzagForward[float64](b, outTQ, lseBHS, qTQ, kTK, vTK, zigzag{s})
	}
}

func (b *Backend) ZigzagAttentionBackwardDQ(dqTQ, deltaBHS, doutTQ, qTQ, outTQ, lseBHS backend.Tensor, kTK, vTK []backend.Tensor, s backend.ZigzagShape) {
	checkZigzag("ZigzagAttentionBackwardDQ", s,
		[]attnArg{{"dq", dqTQ, s.Heads, false}, {"delta", deltaBHS, 0, false}, {"dout", doutTQ, s.Heads, false},
			{"q", qTQ, s.Heads, false}, {"out", outTQ, s.Heads, false}, {"lse", lseBHS, 0, false}},
		map[string][]backend.Tensor{"k": kTK, "v": vTK})
	if b.dt == backend.Float32 {
		zigzagDQ[float32](b, dqTQ, deltaBHS, doutTQ, qTQ, outTQ, lseBHS, kTK, vTK, zigzag{s})
	} else {
		zigzagDQ[float64](b, dqTQ, deltaBHS, doutTQ, qTQ, outTQ, lseBHS, kTK, vTK, zigzag{s})
	}
}

func (b *Backend) ZigzagAttentionBackwardDKDV(dkTK, dvTK, kTK, vTK backend.Tensor, qTQ, doutTQ, lseBHS, deltaBHS []backend.Tensor, s backend.ZigzagShape) {
	checkZigzag("ZigzagAttentionBackwardDKDV", s,
		[]attnArg{{"dk", dkTK, s.KVHeads, true}, {"dv", dvTK, s.KVHeads, true}, {"k", kTK, s.KVHeads, true}, {"v", vTK, s.KVHeads, true}},
		map[string][]backend.Tensor{"q": qTQ, "dout": doutTQ, "lse": lseBHS, "delta": deltaBHS})
	if b.dt == backend.Float32 {
		zigzagDKDV[float32](b, dkTK, dvTK, kTK, vTK, qTQ, doutTQ, lseBHS, deltaBHS, zigzag{s})
	} else {
		zigzagDKDV[float64](b, dkTK, dvTK, kTK, vTK, qTQ, doutTQ, lseBHS, deltaBHS, zigzag{s})
	}
}

func floatsOf[T Float](ts []backend.Tensor) [][]T {
	out := make([][]T, len(ts))
	for i, t := range ts {
		out[i] = floats[T](t)
	}
	return out
}

// zigzagForward runs one (sequence, local chunk, head) per work item; a
// query at position pos sees positions 0..pos, as attnForward's row with
// QOffset = its chunk's first position.
func zigzagForward[T Float](b *Backend, outTQ, lseBHS, qTQ backend.Tensor, kTK, vTK []backend.Tensor, z zigzag) {
	out, lse, q := floats[T](outTQ), floats[T](lseBHS), floats[T](qTQ)
	k, v := floatsOf[T](kTK), floatsOf[T](vTK)
	C, H, Dh := z.Chunk, z.Heads, z.HeadDim
	group := H / z.KVHeads
	qStride, kStride := H*Dh, z.KVHeads*Dh
	scale := 1 / math.Sqrt(float64(Dh))

	b.parallelFor(z.Batch*2*H, 1, func(lo, hi int) {
		scores := make([]T, z.Seq())
		for item := lo; item < hi; item++ {
			bi, n, h := item/(2*H), item/H%2, item%H
			qOff, kOff := h*Dh, (h/group)*Dh
			pos0 := z.LocalChunk(z.Rank, n) * C
			for l := range C {
				ti := bi*2*C + n*C + l
				at := func(t [][]T, j int) []T {
					r, row := z.keyRow(bi, j)
					return t[r][row*kStride+kOff : row*kStride+kOff+Dh]
				}
				lse[z.lseIndex(bi, n, h, l)] = attnRow(out[ti*qStride+qOff:ti*qStride+qOff+Dh], q[ti*qStride+qOff:ti*qStride+qOff+Dh],
					scores, pos0+l, scale, func(j int) []T { return at(k, j) }, func(j int) []T { return at(v, j) })
			}
		}
	})
}

// zigzagDQ is attnBackward's dq half for this rank's queries, and their
// D_i.
func zigzagDQ[T Float](b *Backend, dqTQ, deltaBHS, doutTQ, qTQ, outTQ, lseBHS backend.Tensor, kTK, vTK []backend.Tensor, z zigzag) {
	dq, delta, dout, q, out, lse := floats[T](dqTQ), floats[T](deltaBHS), floats[T](doutTQ), floats[T](qTQ), floats[T](outTQ), floats[T](lseBHS)
	k, v := floatsOf[T](kTK), floatsOf[T](vTK)
	C, H, Dh := z.Chunk, z.Heads, z.HeadDim
	group := H / z.KVHeads
	qStride, kStride := H*Dh, z.KVHeads*Dh
	scale := 1 / math.Sqrt(float64(Dh))
	tscale := T(scale)

	b.parallelFor(z.Batch*2*H, 1, func(lo, hi int) {
		for item := lo; item < hi; item++ {
			bi, n, h := item/(2*H), item/H%2, item%H
			qOff, kOff := h*Dh, (h/group)*Dh
			pos0 := z.LocalChunk(z.Rank, n) * C
			for l := range C {
				row := (bi*2*C+n*C+l)*qStride + qOff
				qi, doi, dqi := q[row:row+Dh], dout[row:row+Dh], dq[row:row+Dh]
				di := attnDot(doi, out[row:row+Dh])
				li := z.lseIndex(bi, n, h, l)
				delta[li] = di
				lseI := float64(lse[li])
				clear(dqi)
				for j := 0; j <= pos0+l; j++ {
					r, kr := z.keyRow(bi, j)
					col := kr*kStride + kOff
					kj, vj := k[r][col:col+Dh], v[r][col:col+Dh]
					p := T(math.Exp(float64(attnDot(qi, kj))*scale - lseI))
					ds := p * (attnDot(doi, vj) - di) * tscale
					attnAxpy(dqi, ds, kj)
				}
			}
		}
	})
}

// zigzagDKDV runs one (sequence, local chunk, kv head) of this rank's keys
// per work item. Each rank's queries are summed apart, call by call (its
// local chunks in order, each over the group's heads and the chunk's
// positions), and the ranks' sums are added in rank order: the order of
// the all-gather path's per-chunk calls and reduce-scatter.
func zigzagDKDV[T Float](b *Backend, dkTK, dvTK, kTK, vTK backend.Tensor, qTQ, doutTQ, lseBHS, deltaBHS []backend.Tensor, z zigzag) {
	dk, dv, k, v := floats[T](dkTK), floats[T](dvTK), floats[T](kTK), floats[T](vTK)
	q, dout, lse, delta := floatsOf[T](qTQ), floatsOf[T](doutTQ), floatsOf[T](lseBHS), floatsOf[T](deltaBHS)
	C, H, KV, Dh := z.Chunk, z.Heads, z.KVHeads, z.HeadDim
	group := H / KV
	qStride, kStride := H*Dh, KV*Dh
	scale := 1 / math.Sqrt(float64(Dh))
	tscale := T(scale)

	b.parallelFor(z.Batch*2*KV, 1, func(lo, hi int) {
		// Per key row of the item: the current call's sums, the current
		// rank's, and the total.
		callK, callV := make([]T, C*Dh), make([]T, C*Dh)
		rankK, rankV := make([]T, C*Dh), make([]T, C*Dh)
		for item := lo; item < hi; item++ {
			bi, nk, g := item/(2*KV), item/KV%2, item%KV
			kOff := g * Dh
			kpos0 := z.LocalChunk(z.Rank, nk) * C
			krow0 := bi*2*C + nk*C
			for p := range z.Ranks {
				clear(rankK)
				clear(rankV)
				for nq := range 2 {
					qpos0 := z.LocalChunk(p, nq) * C
					if qpos0+C-1 < kpos0 {
						continue // no query of this call sees these keys
					}
					clear(callK)
					clear(callV)
					for h := g * group; h < (g+1)*group; h++ {
						qOff := h * Dh
						for l := range C {
							qpos := qpos0 + l
							row := (bi*2*C+nq*C+l)*qStride + qOff
							qi, doi := q[p][row:row+Dh], dout[p][row:row+Dh]
							li := z.lseIndex(bi, nq, h, l)
							di, lseI := delta[p][li], float64(lse[p][li])
							for j := range min(C, qpos-kpos0+1) {
								col := (krow0+j)*kStride + kOff
								kj, vj := k[col:col+Dh], v[col:col+Dh]
								pr := T(math.Exp(float64(attnDot(qi, kj))*scale - lseI))
								attnAxpy(callV[j*Dh:(j+1)*Dh], pr, doi)
								ds := pr * (attnDot(doi, vj) - di) * tscale
								attnAxpy(callK[j*Dh:(j+1)*Dh], ds, qi)
							}
						}
					}
					attnAxpy(rankK, 1, callK)
					attnAxpy(rankV, 1, callV)
				}
				for j := range C {
					col := (krow0+j)*kStride + kOff
					if p == 0 {
						copy(dk[col:col+Dh], rankK[j*Dh:(j+1)*Dh])
						copy(dv[col:col+Dh], rankV[j*Dh:(j+1)*Dh])
					} else {
						attnAxpy(dk[col:col+Dh], 1, rankK[j*Dh:(j+1)*Dh])
						attnAxpy(dv[col:col+Dh], 1, rankV[j*Dh:(j+1)*Dh])
					}
				}
			}
		}
	})
}

// ZigzagAttentionOnePass refuses every shape: the context-parallel layers
// on the CPU keep the two-pass ops, whose results are bitwise the
// all-gather path's. The one-pass ops below run all the same, as the twin
// of the CUDA kernels that backendtest compares them with.
func (b *Backend) ZigzagAttentionOnePass(s backend.ZigzagShape) error {
	if err := s.Check(); err != nil {
		return err
	}
	return fmt.Errorf("the CPU backend runs the fused ring in two passes, which give the all-gather path's bits")
}

// ZigzagAttentionPrepare takes delta from the float dout, as
// ZigzagAttentionBackwardDQ does (the CUDA kernel from dout rounded to bf16,
// as its products see it: within the conformance tolerance).
func (b *Backend) ZigzagAttentionPrepare(deltaBHS, doutBF16TQ, dqTQ, doutTQ, outTQ backend.Tensor, s backend.ZigzagShape) {
	checkZigzag("ZigzagAttentionPrepare", s,
		[]attnArg{{"delta", deltaBHS, 0, false}, {"dout (bf16)", doutBF16TQ, s.Heads, false}, {"dq", dqTQ, s.Heads, false},
			{"dout", doutTQ, s.Heads, false}, {"out", outTQ, s.Heads, false}}, nil)
	if dt := doutBF16TQ.DType(); dt != backend.BFloat16 {
		panic(fmt.Sprintf("cpu: ZigzagAttentionPrepare: dout's rounding must be BFloat16, not %v", dt))
	}
	if b.dt == backend.Float32 {
		zigzagDelta[float32](deltaBHS, doutTQ, outTQ, zigzag{s})
	} else {
		zigzagDelta[float64](deltaBHS, doutTQ, outTQ, zigzag{s})
	}
	b.Copy(doutBF16TQ, doutTQ)
	b.Zero(dqTQ)
}

// ZigzagAttentionBackward is the one-pass backward: dk and dv as
// ZigzagAttentionBackwardDKDV computes them, and this rank's keys' share
// of every rank's dq, summed per query row in key position order into a
// buffer and then added to the owner's dq under scatterMu (the virtual
// ranks of one backend run their calls side by side).
func (b *Backend) ZigzagAttentionBackward(dqTQ []backend.Tensor, dkTK, dvTK, kTK, vTK backend.Tensor, qTQ, doutTQ, lseBHS, deltaBHS []backend.Tensor, s backend.ZigzagShape) {
	checkZigzag("ZigzagAttentionBackward", s,
		[]attnArg{{"dk", dkTK, s.KVHeads, true}, {"dv", dvTK, s.KVHeads, true}, {"k", kTK, s.KVHeads, true}, {"v", vTK, s.KVHeads, true}},
		map[string][]backend.Tensor{"dq": dqTQ, "q": qTQ, "dout": doutTQ, "lse": lseBHS, "delta": deltaBHS})
	if b.dt == backend.Float32 {
		zigzagDKDV[float32](b, dkTK, dvTK, kTK, vTK, qTQ, doutTQ, lseBHS, deltaBHS, zigzag{s})
		zigzagDQShares[float32](b, dqTQ, kTK, vTK, qTQ, doutTQ, lseBHS, deltaBHS, zigzag{s})
	} else {
		zigzagDKDV[float64](b, dkTK, dvTK, kTK, vTK, qTQ, doutTQ, lseBHS, deltaBHS, zigzag{s})
		zigzagDQShares[float64](b, dqTQ, kTK, vTK, qTQ, doutTQ, lseBHS, deltaBHS, zigzag{s})
	}
}

// zigzagDelta is D_i = rowsum(dout_i * out_i) per local row and head, as
// zigzagDQ computes it.
func zigzagDelta[T Float](deltaBHS, doutTQ, outTQ backend.Tensor, z zigzag) {
	delta, dout, out := floats[T](deltaBHS), floats[T](doutTQ), floats[T](outTQ)
	C, H, Dh := z.Chunk, z.Heads, z.HeadDim
	for bi := range z.Batch {
		for n := range 2 {
			for h := range H {
				for l := range C {
					row := (bi*2*C+n*C+l)*H*Dh + h*Dh
					delta[z.lseIndex(bi, n, h, l)] = attnDot(dout[row:row+Dh], out[row:row+Dh])
				}
			}
		}
	}
}

// zigzagDQShares adds into dq[p] of every rank p the share of this rank's
// keys: per query row (sequence, local chunk, head of rank p), the keys of
// this rank's two chunks that the row sees, in position order.
func zigzagDQShares[T Float](b *Backend, dqTQ []backend.Tensor, kTK, vTK backend.Tensor, qTQ, doutTQ, lseBHS, deltaBHS []backend.Tensor, z zigzag) {
	k, v := floats[T](kTK), floats[T](vTK)
	C, H, Dh := z.Chunk, z.Heads, z.HeadDim
	group := H / z.KVHeads
	qStride, kStride := H*Dh, z.KVHeads*Dh
	scale := 1 / math.Sqrt(float64(Dh))
	tscale := T(scale)
	share := make([]T, z.Batch*2*C*qStride)
	for p := range z.Ranks {
		q, dout, lse, delta := floats[T](qTQ[p]), floats[T](doutTQ[p]), floats[T](lseBHS[p]), floats[T](deltaBHS[p])
		clear(share)
		b.parallelFor(z.Batch*2*H, 1, func(lo, hi int) {
			for item := lo; item < hi; item++ {
				bi, nq, h := item/(2*H), item/H%2, item%H
				qOff, kOff := h*Dh, (h/group)*Dh
				qpos0 := z.LocalChunk(p, nq) * C
				for l := range C {
					row := (bi*2*C+nq*C+l)*qStride + qOff
					qi, doi, dqi := q[row:row+Dh], dout[row:row+Dh], share[row:row+Dh]
					li := z.lseIndex(bi, nq, h, l)
					di, lseI := delta[li], float64(lse[li])
					for nk := range 2 {
						kpos0 := z.LocalChunk(z.Rank, nk) * C
						for j := range min(C, qpos0+l-kpos0+1) {
							col := (bi*2*C+nk*C+j)*kStride + kOff
							kj, vj := k[col:col+Dh], v[col:col+Dh]
							pr := T(math.Exp(float64(attnDot(qi, kj))*scale - lseI))
							ds := pr * (attnDot(doi, vj) - di) * tscale
							attnAxpy(dqi, ds, kj)
						}
					}
				}
			}
		})
		b.scatterMu.Lock()
		attnAxpy(floats[T](dqTQ[p]), 1, share)
		b.scatterMu.Unlock()
	}
}
