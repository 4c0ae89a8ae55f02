package moe_test

import (
	"strings"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
)

func selectConfig() moe.Config {
	return moe.Config{Experts: 4, TopK: 2, FFN: 24, Dispatcher: moe.DispatcherAuto}
}

// TestMeasureDispatch measures a small layer on 1 and 2 virtual ranks of
// the CPU: every time is positive (the expert block's too), and the routed rows are every token's
// top_k assignments.
func TestMeasureDispatch(t *testing.T) {
	b := cpu.New(backend.Float32)
	cfg := selectConfig()
	const dim, tokens = 16, 40
	for _, ep := range []int{1, 2} {
		tm, err := moe.MeasureDispatch(b, cfg, dim, tokens, ep, 3)
		if err != nil {
			t.Fatalf("ep %d: %v", ep, err)
		}
		if tm.Iters != 3 || tm.FusedForward <= 0 || tm.FusedStep <= 0 || tm.UnfusedForward <= 0 || tm.UnfusedStep <= 0 || tm.FusedExperts <= 0 {
			t.Errorf("ep %d: %+v", ep, tm)
		}
		sum := 0
		for _, n := range tm.RowsPerExpert {
			sum += n
		}
		if len(tm.RowsPerExpert) != cfg.Experts || sum != tokens*cfg.TopK*ep {
			t.Errorf("ep %d: rows per expert %v, want %d experts and %d rows", ep, tm.RowsPerExpert, cfg.Experts, tokens*cfg.TopK*ep)
		}
		if f := tm.Faster(); f != moe.DispatcherFused && f != moe.DispatcherUnfused {
			t.Errorf("ep %d: Faster %q", ep, f)
		}
	}
	for _, c := range []struct {
		ep, iters int
		cfg       moe.Config
		want      string
	}{
		{0, 3, cfg, "at least 1"},
		{2, 0, cfg, "at least 1"},
		{3, 1, cfg, "do not divide"},
		{1, 1, moe.Config{Experts: 4, TopK: 5, FFN: 8}, "top_k"},
	} {
		if _, err := moe.MeasureDispatch(b, c.cfg, dim, tokens, c.ep, c.iters); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ep %d, %d steps, %+v: %v, want an error containing %q", c.ep, c.iters, c.cfg, err, c.want)
		}
	}
}

// TestMeasureDispatchOn measures on ranks that compute on backends of
// their own (as one rank per GPU does), each allocating its layer on its
// own, and refuses worlds it cannot measure.
func TestMeasureDispatchOn(t *testing.T) {
	cfg := selectConfig()
	const dim, tokens, ep = 16, 40, 2
	bs := []backend.Backend{cpu.New(backend.Float32), cpu.New(backend.Float32)}
	world, err := comm.NewLocal(comm.Mesh{DP: 1, EP: ep, CP: 1, TP: 1}, bs[0])
	if err != nil {
		t.Fatal(err)
	}
	tm, err := moe.MeasureDispatchOn(world, bs, cfg, dim, tokens, 2)
	if err != nil {
		t.Fatal(err)
	}
	if tm.FusedStep <= 0 || tm.UnfusedStep <= 0 || tm.FusedExperts <= 0 || len(tm.RowsPerExpert) != cfg.Experts {
		t.Errorf("%+v", tm)
	}
	dp2, err := comm.NewLocal(comm.Mesh{DP: 2, EP: 1, CP: 1, TP: 1}, bs[0])
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		world []*comm.Ranks
		bs    []backend.Backend
		want  string
	}{
		{world, bs[:1], "1 backends for 2 ranks"},
		{world, []backend.Backend{bs[0], nil}, "rank 1: want a backend"},
		{dp2, bs, "rank 0: want a backend and an expert group of all 2 ranks"},
	} {
		if _, err := moe.MeasureDispatchOn(c.world, c.bs, cfg, dim, tokens, 1); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v, want an error containing %q", err, c.want)
		}
	}
}

func TestTimingFaster(t *testing.T) {
	ms := time.Millisecond
	for _, c := range []struct {
		fused, unfused time.Duration
		want           string
	}{{ms, 2 * ms, moe.DispatcherFused}, {2 * ms, ms, moe.DispatcherUnfused}, {ms, ms, moe.DispatcherUnfused}} {
		// The forward times do not decide.
		tm := moe.Timing{FusedStep: c.fused, UnfusedStep: c.unfused, FusedForward: 9 * ms, UnfusedForward: ms}
		if got := tm.Faster(); got != c.want {
			t.Errorf("%v fused, %v unfused: %q, want %q", c.fused, c.unfused, got, c.want)
		}
	}
}
