package moe_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
)

// runBoth runs Forward and Backward of pr on mesh with the unfused and then
// the fused dispatcher.
func runBoth(t *testing.T, pr *problem, mesh comm.Mesh) (unfused, fused result) {
	t.Helper()
	cfg := pr.cfg
	defer func() { pr.cfg = cfg }()
	pr.cfg.Dispatcher = moe.DispatcherUnfused
	unfused = pr.run(t, mesh, 0.7, true)
	pr.cfg.Dispatcher = moe.DispatcherFused
	fused = pr.run(t, mesh, 0.7, true)
	return unfused, fused
}

// assertSameResult compares two runs: outputs, every gradient and every
// rank's statistics, within tol (relative, as assertClose).
func assertSameResult(t *testing.T, what string, pr *problem, got, want result, tol float64) {
	t.Helper()
	assertClose(t, what+" out", got.out, want.out, tol)
	for j, g := range got.grads() {
		assertClose(t, fmt.Sprintf("%s d%s", what, pr.gradParams()[j].name), g, want.grads()[j], tol)
	}
	for r, st := range got.stats {
		w := want.stats[r]
		assertClose(t, fmt.Sprintf("%s rank %d TokensPerExpert", what, r), st.TokensPerExpert, w.TokensPerExpert, 0)
		if st.Tokens != w.Tokens || st.Dropped != w.Dropped {
			t.Fatalf("%s rank %d: tokens %d dropped %d, unfused %d and %d", what, r, st.Tokens, st.Dropped, w.Tokens, w.Dropped)
		}
		assertClose(t, fmt.Sprintf("%s rank %d losses", what, r), []float64{st.AuxLoss, st.ZLoss}, []float64{w.AuxLoss, w.ZLoss}, tol)
	}
}

func epMesh(ep int) comm.Mesh { return comm.Mesh{DP: 1, EP: ep, CP: 1, TP: 1} }

// TestFusedMatchesUnfused runs the fused and the unfused dispatcher on the
// same problems and layouts: they process the same expert-major rows in the
// same order, so on the CPU every output, gradient and statistic agrees to
// the bit, in float64 and float32. The routings cover fresh random choices,
// every token on one expert (one rank receives every row, the others'
// experts are empty), every token on two experts of the last ranks, and
// capacity drops (random and skewed); tokens per rank are not multiples of
// 128; shared experts are on in some cases.
func TestFusedMatchesUnfused(t *testing.T) {
	const D, Tl = 6, 37
	random := moe.Config{Experts: 8, TopK: 2, FFN: 5, AuxLossCoef: 0.1, ZLossCoef: 0.01}
	shared := random
	shared.SharedExperts = 1
	top1 := random
	top1.TopK = 1
	capped := shared
	capped.CapacityFactor = 0.6
	cappedSkew := top1
	cappedSkew.CapacityFactor = 1
	oneExpert := make([]float64, 8)
	oneExpert[7] = 100 // top-1: every token to expert 7, on the last rank
	twoExperts := make([]float64, 8)
	twoExperts[6], twoExperts[7] = 50, 100
	cases := []struct {
		name string
		cfg  moe.Config
		bias []float64 // nil: none
		dt   backend.DType
	}{
		{"random", random, nil, backend.Float64},
		{"random shared float32", shared, nil, backend.Float32},
		{"one expert", top1, oneExpert, backend.Float64},
		{"two experts shared", shared, twoExperts, backend.Float64},
		{"capacity", capped, nil, backend.Float64},
		{"capacity one expert float32", cappedSkew, oneExpert, backend.Float32},
	}
	for i, c := range cases {
		for _, mesh := range []comm.Mesh{epMesh(1), epMesh(2), epMesh(4), epMesh(8), {DP: 2, EP: 2, CP: 1, TP: 1}} {
			W := mesh.World()
			pr := newProblem(uint64(300+10*i+W), c.cfg, D, W*Tl, false)
			pr.bias, pr.dt = c.bias, c.dt
			unfused, fused := runBoth(t, pr, mesh)
			what := fmt.Sprintf("%s %+v", c.name, mesh)
			assertSameResult(t, what, pr, fused, unfused, 0)
			if c.cfg.CapacityFactor > 0 && fused.stats[0].Dropped == 0 {
				t.Fatalf("%s: nothing dropped; the capacity case tests nothing", what)
			}
			if c.bias != nil {
				// The skew happened: every token on the biased experts.
				for e, n := range fused.stats[0].TokensPerExpert {
					if (c.bias[e] == 0) != (n == 0) {
						t.Fatalf("%s: expert %d has %v assignments with bias %v", what, e, n, c.bias[e])
					}
				}
			}
		}
	}
}

// TestFusedMatchesReference checks the fused path on its own against the
// Hugging Face reference (so that both dispatchers being wrong the same
// way would not pass), on 1 and 4 expert ranks, dropless and with capacity.
func TestFusedMatchesReference(t *testing.T) {
	cfg := moe.Config{Experts: 8, TopK: 2, FFN: 5, SharedExperts: 1, Dispatcher: moe.DispatcherFused}
	for _, cf := range []float64{0, 0.6} {
		cfg.CapacityFactor = cf
		for _, ep := range []int{1, 4} {
			pr := newProblem(uint64(400+ep), cfg, 6, 4*29, true)
			res := pr.run(t, epMesh(ep), 1, false)
			want, _ := pr.globalReference(ep)
			assertClose(t, fmt.Sprintf("cf %g ep %d out", cf, ep), res.out, want, 1e-12)
		}
	}
}

// TestFusedBF16Operands runs the fused path with bf16 expert activations:
// within bf16's error of the float run, as TestBF16Operands checks the
// unfused one, and on one rank bitwise the unfused bf16 run (the same rows
// rounded at the same places).
func TestFusedBF16Operands(t *testing.T) {
	for _, ep := range []int{1, 2} {
		pr := newProblem(78, baseCfg, 16, 24, false)
		pr.cfg.Dispatcher = moe.DispatcherFused
		want := pr.run(t, epMesh(ep), 1, true)
		pr.bf16Operands = true
		unfused, got := runBoth(t, pr, epMesh(ep))
		if ep == 1 {
			assertSameResult(t, "bf16 one rank", pr, got, unfused, 0)
		}
		w := append([][]float64{want.out}, want.grads()...)
		for i, g := range append([][]float64{got.out}, got.grads()...) {
			var d2, w2 float64
			for j := range w[i] {
				d2 += (g[j] - w[i][j]) * (g[j] - w[i][j])
				w2 += w[i][j] * w[i][j]
			}
			if w2 == 0 {
				continue
			}
			if rel := (d2 / w2); !(rel <= 4e-4) || rel == 0 {
				t.Errorf("ep %d, tensor %d: squared relative L2 difference %.3g from the float run, want (0, 4e-4]", ep, i, rel)
			}
		}
	}
}

// noPeers hides a group's PeerAccess, as a group across processes lacks it.
type noPeers struct{ comm.Group }

// TestDispatcherErrors checks New's dispatcher values: fused needs peer
// access, auto must be resolved first, and unknown values are named.
func TestDispatcherErrors(t *testing.T) {
	b := cpu.New(backend.Float64)
	ranks, err := comm.NewLocal(epMesh(2), b)
	if err != nil {
		t.Fatal(err)
	}
	g := moe.Groups{Expert: ranks[0].Expert, Data: ranks[0].Data}
	for _, c := range []struct {
		dispatcher string
		g          moe.Groups
		want       string
	}{
		{moe.DispatcherFused, moe.Groups{Expert: noPeers{g.Expert}, Data: g.Data}, "has no peer access"},
		{"", g, `dispatcher is ""; resolve it`},
		{moe.DispatcherAuto, g, `dispatcher is "auto"; resolve it`},
		{"fast", g, `model.moe.dispatcher is "fast"; want "auto", "fused" or "unfused"`},
	} {
		cfg := baseCfg
		cfg.Dispatcher = c.dispatcher
		if _, err := moe.New(b, cfg, 4, 4, c.g); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("dispatcher %q: error %v, want %q", c.dispatcher, err, c.want)
		}
	}
	for _, d := range []string{moe.DispatcherFused, moe.DispatcherUnfused} {
		cfg := baseCfg
		cfg.Dispatcher = d
		if _, err := moe.New(b, cfg, 4, 4, g); err != nil {
			t.Errorf("dispatcher %q on the local group: %v", d, err)
		}
	}
}

// TestFusedPhases checks that each dispatcher reports the phases Phases
// lists, in order, each Forward and Backward closed by PhaseEnd.
func TestFusedPhases(t *testing.T) {
	b := cpu.New(backend.Float64)
	solo, err := comm.NewLocal(oneRank(), b)
	if err != nil {
		t.Fatal(err)
	}
	const D, T = 6, 10
	for _, d := range []string{moe.DispatcherFused, moe.DispatcherUnfused} {
		cfg := baseCfg
		cfg.Dispatcher = d
		pr := newProblem(5, cfg, D, T, false)
		var seen []moe.Phase
		l, err := moe.New(b, cfg, D, T, moe.Groups{Expert: solo[0].Expert, Data: solo[0].Data},
			moe.WithPhaseHook(func(ph moe.Phase) { seen = append(seen, ph) }))
		if err != nil {
			t.Fatal(err)
		}
		p := moe.NewParams(b, cfg, D, cfg.Experts)
		p.GateED, p.W1EFD, p.W3EFD, p.W2EDF = upload(b, pr.gate, cfg.Experts, D), upload(b, pr.w1, cfg.Experts, cfg.FFN, D),
			upload(b, pr.w3, cfg.Experts, cfg.FFN, D), upload(b, pr.w2, cfg.Experts, D, cfg.FFN)
		if _, err := l.Forward(b.New(backend.Float64, T, D), upload(b, pr.x, T, D), p, nil, 1); err != nil {
			t.Fatal(err)
		}
		if err := l.Backward(b.New(backend.Float64, T, D), upload(b, pr.dout, T, D), p, moe.NewParams(b, cfg, D, cfg.Experts)); err != nil {
			t.Fatal(err)
		}
		want := moe.Phases(d)
		at := slices.Index(want, moe.PhaseRouterBackward)
		want = slices.Concat(want[:at], []moe.Phase{moe.PhaseEnd}, want[at:], []moe.Phase{moe.PhaseEnd})
		if !slices.Equal(seen, want) {
			t.Errorf("%s: phases %q, want %q", d, seen, want)
		}
	}
	if slices.Contains(moe.Phases(moe.DispatcherFused), moe.PhaseDispatch) || !slices.Contains(moe.Phases(moe.DispatcherFused), moe.PhaseDispatchExperts) {
		t.Errorf("fused phases %q: want dispatch+experts in place of dispatch and experts", moe.Phases(moe.DispatcherFused))
	}
}

// TestUpdateExpertsInBackward runs Backward with an ExpertUpdater
// (UpdateExpertsInBackward) on both dispatchers, one and several expert
// ranks, and routings that leave some ranks without rows: the updater,
// handed each tensor's product, adds it into the gradients and then
// overwrites the tensor's weights with NaN (poisoningUpdater), and every
// output and gradient must still equal, to the bit, Backward's without
// the updater. So the updates come after the last read of each tensor's
// weights, the products are the gradients, and an expert rank without
// rows is handed each tensor once too (the run checks the order w2, w1,
// w3 on every rank).
func TestUpdateExpertsInBackward(t *testing.T) {
	const D, Tl = 6, 37
	random := moe.Config{Experts: 8, TopK: 2, FFN: 5, AuxLossCoef: 0.1, ZLossCoef: 0.01, SharedExperts: 1}
	top1 := random
	top1.TopK, top1.SharedExperts = 1, 0
	oneExpert := make([]float64, 8)
	oneExpert[7] = 100 // every token to expert 7: the other expert ranks get no rows
	cases := []struct {
		name string
		cfg  moe.Config
		bias []float64
		dt   backend.DType
	}{
		{"random", random, nil, backend.Float64},
		{"random float32", random, nil, backend.Float32},
		{"one expert", top1, oneExpert, backend.Float64},
	}
	for i, c := range cases {
		for _, dispatcher := range []string{moe.DispatcherUnfused, moe.DispatcherFused} {
			for _, mesh := range []comm.Mesh{epMesh(1), epMesh(2), epMesh(4)} {
				W := mesh.World()
				pr := newProblem(uint64(700+10*i+W), c.cfg, D, W*Tl, false)
				pr.bias, pr.dt, pr.cfg.Dispatcher = c.bias, c.dt, dispatcher
				want := pr.run(t, mesh, 0.7, true)
				pr.updateExperts = true
				got := pr.run(t, mesh, 0.7, true)
				assertSameResult(t, fmt.Sprintf("%s %s %+v", c.name, dispatcher, mesh), pr, got, want, 0)
			}
		}
	}
}
