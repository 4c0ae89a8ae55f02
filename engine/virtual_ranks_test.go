package engine

import (
	"context"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/cuda"
)

// withCUDA makes the CUDA backend available to train.backend, as the
// mktrain command does (package backend/all).
func withCUDA() Option { return WithDrivers(cuda.NewDriver(cuda.Options{})) }

// otherBackend is the CPU backend under another type and name, so nothing
// in the engine can treat it as the CPU backend.
type otherBackend struct{ *cpu.Backend }

func (otherBackend) Name() string { return "other" }

// TestVirtualRanksOnAnyBackend trains a dp=2 x ep=2 layout on a backend
// that is not *cpu.Backend: the engine accepts it and its ranks, which share
// the backend, make bitwise the same steps as on the CPU backend itself.
func TestVirtualRanksOnAnyBackend(t *testing.T) {
	// model.moe.dispatcher auto measures on a backend other than the
	// CPU's; its table goes to a temporary directory.
	t.Setenv("MKTRAIN_CACHE_DIR", t.TempDir())
	cfg := equivalenceConfig()
	cfg.Parallel.DP, cfg.Parallel.EP, cfg.Train.MicroBatch = 2, 2, 2
	cfg.Train.Steps = 3
	want := trainLosses(t, cfg)
	var got []float64
	eng, err := New(cfg, WithBackend(otherBackend{cpu.New(backend.Float32)}), WithHook(func(ev StepEvent) { got = append(got, ev.Loss) }))
	if err != nil {
		t.Fatalf("4 ranks on another backend: %v", err)
	}
	if _, err := eng.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("%d losses, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("step %d: loss %.9g on the other backend, %.9g on the CPU backend", i+1, got[i], want[i])
		}
	}
}

// TestCUDATakesLayouts: layouts of several ranks are no reason to leave the
// GPU; the kernels' size limits still are.
func TestCUDATakesLayouts(t *testing.T) {
	cfg := equivalenceConfig()
	cfg.Parallel.DP, cfg.Parallel.EP, cfg.Train.MicroBatch = 2, 2, 2
	if err := unsupported(cuda.NewDriver(cuda.Options{}), cfg); err != nil {
		t.Errorf("dp=2 x ep=2: %v", err)
	}
	cfg.Train.Backend = "cuda"
	eng, err := New(cfg, withCUDA())
	switch {
	case err == nil:
		defer eng.Close()
		if eng.BackendName() != "cuda" {
			t.Errorf("train.backend: cuda chose %s", eng.BackendName())
		}
	case strings.Contains(err.Error(), "parallel"):
		t.Errorf("dp=2 x ep=2 on cuda refused for its layout: %v", err)
	}
	big := equivalenceConfig()
	big.Model.MoE.Experts, big.Model.MoE.TopK = cuda.RouterMaxExperts+4, 2
	if err := unsupported(cuda.NewDriver(cuda.Options{}), big); err == nil || !strings.Contains(err.Error(), "model.moe.experts") {
		t.Errorf("%d experts: %v", big.Model.MoE.Experts, err)
	}
}
