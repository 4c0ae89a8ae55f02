package attention_test

import (
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/mktrain/mktrain/attention"
	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
)

// twoLayers runs two layers the way the engine does (forward 0, forward 1,
// backward 1, backward 0, layer 1 reading layer 0's output) on one rank
// and returns everything they wrote.
func twoLayers(b backend.Backend, ls [2]*attention.Layer, s attention.Shape, ps [2]*attention.Params, x []float64, pos []int32, dout []float64, rerun bool) ([][]float64, error) {
	T, ft := len(pos), b.FloatType()
	xT, posT := b.New(ft, T, s.Dim), b.New(backend.Int32, T)
	backend.UploadSlice(b, xT, x)
	backend.UploadSlice(b, posT, pos)
	h, out, dh, dx, doutT := b.New(ft, T, s.Dim), b.New(ft, T, s.Dim), b.New(ft, T, s.Dim), b.New(ft, T, s.Dim), b.New(ft, T, s.Dim)
	backend.UploadSlice(b, doutT, dout)
	gs := [2]*attention.Params{attention.NewParams(b, s), attention.NewParams(b, s)}
	if err := ls[0].Forward(h, xT, posT, ps[0]); err != nil {
		return nil, err
	}
	if err := ls[1].Forward(out, h, posT, ps[1]); err != nil {
		return nil, err
	}
	// rerun (RecomputeLayer): each Forward again right before its
	// Backward, into an output of its own (h and out are compared).
	if err := forwardAgain(b, rerun, ls[1], h, posT, ps[1]); err != nil {
		return nil, err
	}
	if err := ls[1].Backward(dh, doutT, ps[1], gs[1]); err != nil {
		return nil, err
	}
	if err := forwardAgain(b, rerun, ls[0], xT, posT, ps[0]); err != nil {
		return nil, err
	}
	if err := ls[0].Backward(dx, dh, ps[0], gs[0]); err != nil {
		return nil, err
	}
	var res [][]float64
	for _, t := range []backend.Tensor{h, out, dh, dx, gs[0].WqQD, gs[0].WkKD, gs[0].WvKD, gs[0].WoDQ, gs[1].WqQD, gs[1].WkKD, gs[1].WvKD, gs[1].WoDQ} {
		res = append(res, backend.DownloadFloat64(b, t))
	}
	return res, nil
}

// forwardAgain runs l's Forward on x again into a discarded output when
// rerun is set.
func forwardAgain(b backend.Backend, rerun bool, l *attention.Layer, x, posT backend.Tensor, p *attention.Params) error {
	if !rerun {
		return nil
	}
	return l.Forward(b.New(b.FloatType(), x.Shape()...), x, posT, p)
}

// TestSharedScratch: two layers sharing one Scratch, on one rank and on
// each rank of a cp=2 group, write bitwise what two layers with their own
// scratch write; and so do two layers that keep their core's output in
// the shared Scratch and recompute it in Backward (RecomputeCore), and
// two that keep all their activations there and run Forward again before
// Backward (RecomputeLayer).
func TestSharedScratch(t *testing.T) {
	s := attention.Shape{Dim: 16, Heads: 4, KVHeads: 2, RopeTheta: 10000}
	const batch, seq = 2, 8
	for _, c := range []struct {
		cp   int
		mode attention.CPMode
	}{{1, attention.CPAllGather}, {2, attention.CPAllGather}, {2, attention.CPRing}} {
		cp, mode := c.cp, c.mode
		b := cpu.New(backend.Float64)
		rng := rand.New(rand.NewPCG(21, uint64(cp)))
		randParams := func() *attention.Params {
			return uploadParams(b, s, hostParams{
				wq: randn(rng, s.Dim*s.Dim, 0.4), wk: randn(rng, s.KVHeads*s.HeadDim()*s.Dim, 0.4),
				wv: randn(rng, s.KVHeads*s.HeadDim()*s.Dim, 0.4), wo: randn(rng, s.Dim*s.Dim, 0.4),
			})
		}
		ps := [2]*attention.Params{randParams(), randParams()}
		ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: cp, TP: 1}, b)
		if err != nil {
			t.Fatal(err)
		}
		T := batch * seq / cp
		inputs := make([][2][]float64, cp)
		poss := make([][]int32, cp)
		for r := range cp {
			inputs[r] = [2][]float64{randn(rng, T*s.Dim, 1), randn(rng, T*s.Dim, 1)}
			local, err := attention.ZigzagPositions(seq, cp, r)
			if err != nil {
				t.Fatal(err)
			}
			for range batch {
				poss[r] = append(poss[r], local...)
			}
		}
		run := func(shared bool, recompute string) [][][]float64 {
			out := make([][][]float64, cp)
			errs := make([]error, cp)
			var wg sync.WaitGroup
			for r, rk := range ranks {
				opts := []attention.Option{attention.WithContextMode(mode)}
				if shared {
					opts = append(opts, attention.WithScratch(attention.NewScratch()))
				}
				switch recompute {
				case "selective":
					opts = append(opts, attention.RecomputeCore())
				case "full":
					opts = append(opts, attention.RecomputeLayer())
				}
				var ls [2]*attention.Layer
				for i := range ls {
					if ls[i], err = attention.NewContextParallel(b, s, batch, seq, rk.Context, opts...); err != nil {
						t.Fatal(err)
					}
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					if out[r], errs[r] = twoLayers(b, ls, s, ps, inputs[r][0], poss[r], inputs[r][1], recompute == "full"); errs[r] != nil {
						rk.Abort(errs[r])
					}
				}()
			}
			wg.Wait()
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
			return out
		}
		own, shared, recomputed, full := run(false, ""), run(true, ""), run(true, "selective"), run(true, "full")
		for r := range cp {
			for i := range own[r] {
				if !slices.Equal(own[r][i], shared[r][i]) {
					t.Errorf("cp=%d %s rank %d: result %d differs with a shared scratch", cp, mode, r, i)
				}
				if !slices.Equal(own[r][i], recomputed[r][i]) {
					t.Errorf("cp=%d %s rank %d: result %d differs with the core recomputed", cp, mode, r, i)
				}
				if !slices.Equal(own[r][i], full[r][i]) {
					t.Errorf("cp=%d %s rank %d: result %d differs with the layer recomputed", cp, mode, r, i)
				}
			}
		}
	}
}

func TestSharedScratchMismatch(t *testing.T) {
	b := cpu.New(backend.Float32)
	s := attention.Shape{Dim: 8, Heads: 2, KVHeads: 1, RopeTheta: 100}
	ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: 2, TP: 1}, b)
	if err != nil {
		t.Fatal(err)
	}
	sc := attention.NewScratch()
	attention.New(b, s, 2, 4, attention.WithScratch(sc)) // sizes it for 8 tokens
	if _, err := attention.NewContextParallel(b, s, 2, 4, ranks[0].Context, attention.WithScratch(sc)); err == nil || !strings.Contains(err.Error(), "shared scratch") {
		t.Errorf("4 local tokens on a scratch for 8: %v", err)
	}
	// Same local tokens (8) and natural rows (16), other sequence length.
	if _, err := attention.NewContextParallel(b, s, 2, 8, ranks[0].Context, attention.WithScratch(sc)); err != nil {
		t.Fatal(err)
	}
	if _, err := attention.NewContextParallel(b, s, 1, 16, ranks[0].Context, attention.WithScratch(sc)); err == nil || !strings.Contains(err.Error(), "sequences of 8") {
		t.Errorf("sequences of 16 on a context-parallel scratch for 8: %v", err)
	}
}

// TestContextParallelCollectiveFailure: a failed collective comes back from
// Forward and Backward as an error naming it, and a Backward after a
// failed Forward is refused.
func TestContextParallelCollectiveFailure(t *testing.T) {
	for _, c := range []struct {
		name              string
		mode              attention.CPMode
		portable          bool
		forward, backward string
	}{
		{"allgather", attention.CPAllGather, false, "all-gather k", "reduce-scatter dk"},
		{"fused-ring", attention.CPRing, false, "fused ring: exchange of k and v", "fused ring: exchange of the backward's inputs"},
		{"portable-ring", attention.CPRing, true, "ring step 0: passing k and v", "ring step 0: passing k, v and their gradients"},
	} {
		t.Run(c.name, func(t *testing.T) { collectiveFailure(t, c.mode, c.portable, c.forward, c.backward) })
	}
}

// withoutPeerAccess hides a group's comm.PeerAccess, as a group across
// processes lacks it: mode ring then runs the portable ring.
func withoutPeerAccess(g comm.Group) comm.Group { return struct{ comm.Group }{g} }

func collectiveFailure(t *testing.T, mode attention.CPMode, portable bool, forwardErr, backwardErr string) {
	b := cpu.New(backend.Float32)
	s := attention.Shape{Dim: 8, Heads: 2, KVHeads: 1, RopeTheta: 100}
	const batch, seq = 1, 8
	ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: 2, TP: 1}, b)
	if err != nil {
		t.Fatal(err)
	}
	T, ft := batch*seq/2, b.FloatType()
	type rankState struct {
		l                 *attention.Layer
		x, pos, out, dout backend.Tensor
	}
	st := make([]rankState, 2)
	p, g := attention.NewParams(b, s), attention.NewParams(b, s)
	for r := range st {
		g := ranks[r].Context
		if portable {
			g = withoutPeerAccess(g)
		}
		l, err := attention.NewContextParallel(b, s, batch, seq, g, attention.WithContextMode(mode))
		if err != nil {
			t.Fatal(err)
		}
		pos, _ := attention.ZigzagPositions(seq, 2, r)
		st[r] = rankState{l: l, x: b.New(ft, T, s.Dim), pos: b.New(backend.Int32, T), out: b.New(ft, T, s.Dim), dout: b.New(ft, T, s.Dim)}
		backend.UploadSlice(b, st[r].pos, pos)
	}
	// Both ranks run Forward; then rank 1 fails and rank 0's Backward must
	// not wait for it.
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for r := range st {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = st[r].l.Forward(st[r].out, st[r].x, st[r].pos, p)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	cause := errors.New("rank 1 ran out of memory")
	ranks[1].Abort(cause)
	err = st[0].l.Backward(st[0].out, st[0].dout, p, g)
	if !errors.Is(err, cause) || !strings.Contains(err.Error(), backwardErr) {
		t.Errorf("Backward after a peer's abort: %v", err)
	}
	err = st[0].l.Forward(st[0].out, st[0].x, st[0].pos, p)
	if !errors.Is(err, cause) || !strings.Contains(err.Error(), forwardErr) {
		t.Errorf("Forward after a peer's abort: %v", err)
	}
	if err := st[0].l.Backward(st[0].out, st[0].dout, p, g); err == nil || !strings.Contains(err.Error(), "without a successful Forward") {
		t.Errorf("Backward after a failed Forward: %v", err)
	}
	if err := st[0].l.Forward(st[0].out, b.New(ft, T+1, s.Dim), st[0].pos, p); err == nil || !strings.Contains(err.Error(), "x has shape") {
		t.Errorf("Forward with a wrong x: %v", err)
	}
}
