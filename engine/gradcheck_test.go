package engine

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
)

// gradCheckConfig is a model small enough for finite differences in float64
// yet with every part switched on: GQA, several layers, top-2 routing,
// shared experts, the aux and z losses.
func gradCheckConfig() Config {
	cfg := DefaultConfig()
	cfg.Model = ModelConfig{
		Vocab: 23, Dim: 16, Layers: 2, Heads: 4, KVHeads: 2, RopeTheta: 10000, NormEps: 1e-5, InitStd: 0.3,
		MoE: moe.Config{Experts: 4, TopK: 2, FFN: 8, AuxLossCoef: 0.1, ZLossCoef: 0.05, SharedExperts: 1, Dispatcher: moe.DispatcherUnfused},
	}
	cfg.Train.Seq, cfg.Train.GlobalBatch, cfg.Train.MicroBatch = 5, 2, 2
	cfg.Train.Backend = "cpu"
	return cfg
}

// objective is what training minimises for one micro-batch: mean
// cross-entropy plus the weighted auxiliary losses of every layer.
func objective(cfg Config, st microStats, tokens int) float64 {
	loss := st.lossSum / float64(tokens)
	for _, s := range st.moe {
		loss += cfg.Model.MoE.AuxLossCoef*s.AuxLoss + cfg.Model.MoE.ZLossCoef*s.ZLoss
	}
	return loss
}

// TestModelGradient checks the whole model's analytic gradient, router and
// auxiliary losses included, against central finite differences at random
// coordinates of every parameter.
func TestModelGradient(t *testing.T) {
	cfg := gradCheckConfig()
	b := cpu.New(backend.Float64)
	world, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: 1, TP: 1}, b)
	if err != nil {
		t.Fatal(err)
	}
	r, err := newRank(context.Background(), cfg, b, world[0], nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(7, 11))
	T := cfg.Train.MicroBatch * cfg.Train.Seq
	ids, targets := make([]int32, T), make([]int32, T)
	for i := range ids {
		ids[i], targets[i] = int32(rng.IntN(cfg.Model.Vocab)), int32(rng.IntN(cfg.Model.Vocab))
	}
	r.model.setBatch(ids, targets)

	for _, p := range r.params {
		b.Zero(p.g)
	}
	st, err := r.model.forward(true, 1/float64(T), 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.model.backward(); err != nil {
		t.Fatal(err)
	}
	if err := r.model.finishStep(&st); err != nil {
		t.Fatal(err)
	}
	lossAt := func() float64 {
		st, err := r.model.forward(false, 0, 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		return objective(cfg, st, T)
	}
	if base := objective(cfg, st, T); math.Abs(base-lossAt()) > 1e-12 {
		t.Fatalf("forward is not deterministic: %v vs %v", base, lossAt())
	}
	const eps = 1e-6
	for _, p := range r.params {
		w, g := p.w.(*cpu.Tensor).Float64s(), p.g.(*cpu.Tensor).Float64s()
		for trial := 0; trial < 4; trial++ {
			i := rng.IntN(len(w))
			orig := w[i]
			w[i] = orig + eps
			up := lossAt()
			w[i] = orig - eps
			down := lossAt()
			w[i] = orig
			numeric := (up - down) / (2 * eps)
			if diff := math.Abs(numeric - g[i]); diff > 1e-6+1e-4*math.Abs(numeric) {
				t.Errorf("%s[%d]: analytic %.10g, finite difference %.10g", p.slot.name, i, g[i], numeric)
			}
		}
	}
}

// TestParamShapesMatchTensors: the exported shape list names exactly the
// tensors a rank allocates.
func TestParamShapesMatchTensors(t *testing.T) {
	cfg := gradCheckConfig()
	b := cpu.New(backend.Float32)
	world, err := comm.NewLocal(comm.Mesh{DP: 1, EP: 1, CP: 1, TP: 1}, b)
	if err != nil {
		t.Fatal(err)
	}
	r, err := newRank(context.Background(), cfg, b, world[0], nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]int{}
	for _, p := range r.params {
		for _, piece := range p.pieces() {
			want[piece.name] = piece.shape
		}
	}
	got := ParamShapes(cfg.Model)
	if len(got) != len(want) {
		t.Fatalf("%d shapes, %d tensors", len(got), len(want))
	}
	for _, ns := range got {
		if fmt.Sprint(want[ns.Name]) != fmt.Sprint(ns.Shape) {
			t.Errorf("%s: listed %v, allocated %v", ns.Name, ns.Shape, want[ns.Name])
		}
	}
}
