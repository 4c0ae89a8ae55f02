package moe_test

import (
	"math"
	"strings"
	"sync"
	"testing"

	"gorgonia.org/tensor"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
)

// readCounter counts the host's reads of a backend: Download (which waits
// for everything queued), the queued downloads started, and those waited
// for.
type readCounter struct {
	backend.Backend
	downloads, started, waited int
	hostGroups                 bool // say the grouped products read offsets back (ReadsGroupOffsets false)
}

func (c *readCounter) ReadsGroupOffsets(n, k, groups int) bool {
	return !c.hostGroups && c.Backend.ReadsGroupOffsets(n, k, groups)
}

func (c *readCounter) Download(t backend.Tensor) *tensor.Dense {
	c.downloads++
	return c.Backend.Download(t)
}

func (c *readCounter) StartDownload(t backend.Tensor) backend.PendingDownload {
	c.started++
	wait := c.Backend.StartDownload(t)
	return func() *tensor.Dense {
		c.waited++
		return wait()
	}
}

// TestOneRankForwardReadsNothing checks the dropless forward on one expert
// rank, with either dispatcher: it reads nothing back from the backend
// (the experts' products are sized by the device's offsets), and queues
// one download of the counts, which the backward waits for; a Forward
// with no Backward after it (evaluation) has its download waited for by
// the next Forward, so none is left behind. With a capacity the host
// reads the router's choices, as before.
func TestOneRankForwardReadsNothing(t *testing.T) {
	for _, c := range []struct {
		name       string
		dispatcher string
		capacity   float64
		hostGroups bool
		full       bool // RecomputeLayer: Reforward before Backward
	}{
		{"unfused", moe.DispatcherUnfused, 0, false, false},
		{"fused", moe.DispatcherFused, 0, false, false},
		{"capacity", moe.DispatcherUnfused, 1, false, false},
		{"host groups", moe.DispatcherFused, 0, true, false},
		{"recompute full", moe.DispatcherUnfused, 0, false, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := moe.Config{Experts: 4, TopK: 2, FFN: 6, AuxLossCoef: 0.01, ZLossCoef: 0.001, Dispatcher: c.dispatcher, CapacityFactor: c.capacity}
			const D, T = 8, 24
			rc := &readCounter{Backend: cpu.New(backend.Float64), hostGroups: c.hostGroups}
			ranks, err := comm.NewLocal(oneRank(), rc)
			if err != nil {
				t.Fatal(err)
			}
			var opts []moe.Option
			if c.full {
				opts = append(opts, moe.RecomputeLayer())
			}
			layer, err := moe.New(rc, cfg, D, T, moe.Groups{Expert: ranks[0].Expert, Data: ranks[0].Data}, opts...)
			if err != nil {
				t.Fatal(err)
			}
			pr := newProblem(5, cfg, D, T, false)
			p := moe.NewParams(rc, cfg, D, cfg.Experts)
			p.GateED, p.W1EFD, p.W3EFD, p.W2EDF = upload(rc, pr.gate, cfg.Experts, D), upload(rc, pr.w1, cfg.Experts, cfg.FFN, D),
				upload(rc, pr.w3, cfg.Experts, cfg.FFN, D), upload(rc, pr.w2, cfg.Experts, D, cfg.FFN)
			g := moe.NewParams(rc, cfg, D, cfg.Experts)
			x, out, dx := upload(rc, pr.x, T, D), rc.New(backend.Float64, T, D), rc.New(backend.Float64, T, D)
			dout := upload(rc, pr.dout, T, D)

			if _, err := layer.Forward(out, x, p, nil, 1); err != nil {
				t.Fatal(err)
			}
			want := [3]int{0, 1, 0} // downloads, queued, waited for
			switch {
			case c.capacity > 0:
				if rc.downloads == 0 {
					t.Errorf("with a capacity the forward read nothing; it plans from the router's choices on the host")
				}
				want = [3]int{rc.downloads, 0, 0}
			case c.hostGroups:
				want = [3]int{0, 1, 1} // the queued download, waited for at once
			}
			if got := [3]int{rc.downloads, rc.started, rc.waited}; got != want {
				t.Errorf("the forward made %d downloads and queued %d (%d waited for); want %v", got[0], got[1], got[2], want)
			}
			if c.full {
				// The rerun takes over the Forward's download.
				if err := layer.Reforward(out, x, p, nil); err != nil {
					t.Fatal(err)
				}
				if rc.downloads != 0 || rc.started != 1 {
					t.Errorf("the rerun made %d downloads and %d queued in all; want none and the Forward's one", rc.downloads, rc.started)
				}
			}
			if err := layer.Backward(dx, dout, p, g); err != nil {
				t.Fatal(err)
			}
			if rc.started != rc.waited {
				t.Errorf("after the backward %d downloads queued, %d waited for", rc.started, rc.waited)
			}
			// Evaluation: two forwards, no backward.
			for range 2 {
				if _, err := layer.Forward(out, x, p, nil, 1); err != nil {
					t.Fatal(err)
				}
			}
			if c.capacity == 0 && !c.hostGroups && rc.started != rc.waited+1 {
				t.Errorf("after two more forwards %d downloads queued, %d waited for; want all but the last waited for", rc.started, rc.waited)
			}
		})
	}
}

// TestUnequalTokensRefused checks that ranks of one data group whose
// layers are built for different tokens per micro-step get an error from
// their first Forward: the load statistics count the global tokens as
// one rank's times the group's size.
func TestUnequalTokensRefused(t *testing.T) {
	cfg := moe.Config{Experts: 4, TopK: 2, FFN: 6, Dispatcher: moe.DispatcherUnfused}
	const D = 8
	b := cpu.New(backend.Float64)
	ranks, err := comm.NewLocal(comm.Mesh{DP: 2, EP: 1, CP: 1, TP: 1}, b)
	if err != nil {
		t.Fatal(err)
	}
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for r, rk := range ranks {
		wg.Go(func() {
			T := 8 + 4*r
			layer, err := moe.New(b, cfg, D, T, moe.Groups{Expert: rk.Expert, Data: rk.Data})
			if err != nil {
				errs[r] = err
				return
			}
			pr := newProblem(7, cfg, D, T, false)
			p := moe.NewParams(b, cfg, D, cfg.Experts)
			p.GateED, p.W1EFD, p.W3EFD, p.W2EDF = upload(b, pr.gate, cfg.Experts, D), upload(b, pr.w1, cfg.Experts, cfg.FFN, D),
				upload(b, pr.w3, cfg.Experts, cfg.FFN, D), upload(b, pr.w2, cfg.Experts, D, cfg.FFN)
			_, errs[r] = layer.Forward(b.New(backend.Float64, T, D), upload(b, pr.x, T, D), p, nil, 1)
		})
	}
	wg.Wait()
	for r, err := range errs {
		if err == nil || !strings.Contains(err.Error(), "the same tokens on each") {
			t.Errorf("rank %d: Forward gave %v; want the unequal tokens refused", r, err)
		}
	}
}

// TestOverwriteExpertGrads checks OverwriteExpertGrads: the experts'
// weight gradients come out equal to those added onto zeros, whatever the
// gradient tensors held before (NaN here: beta 0 never reads them), an
// expert rank whose experts got no rows writes zeros, and the router's
// gradient is still added to. Both dispatchers, one and two expert ranks;
// the bias keeps every token off the last two experts, so with two ranks
// the second rank's experts get no rows.
func TestOverwriteExpertGrads(t *testing.T) {
	const D, T, E = 8, 24, 4
	for _, dispatcher := range []string{moe.DispatcherUnfused, moe.DispatcherFused} {
		for _, ep := range []int{1, 2} {
			cfg := moe.Config{Experts: E, TopK: 2, FFN: 6, AuxLossCoef: 0.01, Dispatcher: dispatcher}
			pr := newProblem(11, cfg, D, T, false)
			pr.bias = []float64{0, 0, -1e9, -1e9}
			run := func(overwrite bool, init float64) [][]float64 {
				b := cpu.New(backend.Float64)
				ranks, err := comm.NewLocal(comm.Mesh{DP: 1, EP: ep, CP: 1, TP: 1}, b)
				if err != nil {
					t.Fatal(err)
				}
				local := E / ep
				grads := make([][]float64, ep)
				errs := make([]error, ep)
				var wg sync.WaitGroup
				for r, rk := range ranks {
					wg.Go(func() {
						var opts []moe.Option
						if overwrite {
							opts = append(opts, moe.OverwriteExpertGrads())
						}
						layer, err := moe.New(b, cfg, D, T, moe.Groups{Expert: rk.Expert, Data: rk.Data}, opts...)
						if err != nil {
							errs[r] = err
							rk.Abort(err)
							return
						}
						e0 := r * local
						p := moe.NewParams(b, cfg, D, local)
						p.GateED = upload(b, pr.gate, E, D)
						p.W1EFD = upload(b, pr.w1[e0*cfg.FFN*D:(e0+local)*cfg.FFN*D], local, cfg.FFN, D)
						p.W3EFD = upload(b, pr.w3[e0*cfg.FFN*D:(e0+local)*cfg.FFN*D], local, cfg.FFN, D)
						p.W2EDF = upload(b, pr.w2[e0*D*cfg.FFN:(e0+local)*D*cfg.FFN], local, D, cfg.FFN)
						g := moe.NewParams(b, cfg, D, local)
						for _, gt := range []backend.Tensor{g.W1EFD, g.W3EFD, g.W2EDF} {
							b.Upload(gt, tensor.New(tensor.WithShape(gt.Len()), tensor.WithBacking(constant(gt.Len(), init))))
						}
						x, out := upload(b, pr.x, T, D), b.New(backend.Float64, T, D)
						if _, err := layer.Forward(out, x, p, upload(b, pr.bias, E), 1); err != nil {
							errs[r] = err
							rk.Abort(err)
							return
						}
						if err := layer.Backward(b.New(backend.Float64, T, D), upload(b, pr.dout, T, D), p, g); err != nil {
							errs[r] = err
							rk.Abort(err)
							return
						}
						for _, gt := range []backend.Tensor{g.W1EFD, g.W3EFD, g.W2EDF, g.GateED} {
							grads[r] = append(grads[r], backend.DownloadFloat64(b, gt)...)
						}
					})
				}
				wg.Wait()
				for r, err := range errs {
					if err != nil {
						t.Fatalf("%s ep %d rank %d: %v", dispatcher, ep, r, err)
					}
				}
				return grads
			}
			want, got := run(false, 0), run(true, math.NaN())
			for r := range want {
				if len(got[r]) != len(want[r]) {
					t.Fatalf("%s ep %d rank %d: %d gradient values, want %d", dispatcher, ep, r, len(got[r]), len(want[r]))
				}
				for i := range want[r] {
					if got[r][i] != want[r][i] {
						t.Fatalf("%s ep %d rank %d: gradient value %d is %v overwritten, %v added onto zeros", dispatcher, ep, r, i, got[r][i], want[r][i])
					}
				}
			}
			if ep == 2 {
				nonzero := false
				for _, v := range want[1][:3*E/ep*cfg.FFN*D] {
					nonzero = nonzero || v != 0
				}
				if nonzero {
					t.Errorf("%s: the second rank's experts got rows; the test wants them idle", dispatcher)
				}
			}
		}
	}
}
