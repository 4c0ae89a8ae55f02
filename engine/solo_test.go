package engine

import (
	"context"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
)

// otherBackend is the CPU backend under another type, so the engine treats
// it as it treats a GPU backend: one rank, collectives through soloGroup.
type otherBackend struct{ *cpu.Backend }

func (otherBackend) Name() string { return "other" }

// TestSoloGroupTrainsLikeLocal trains the same steps through the in-process
// communicator and through soloGroup (a backend that is not *cpu.Backend):
// a group of one is the identity, so the losses agree to the bit.
func TestSoloGroupTrainsLikeLocal(t *testing.T) {
	cfg := equivalenceConfig()
	cfg.Train.Steps = 3
	want := trainLosses(t, cfg)
	var got []float64
	eng, err := New(cfg, WithBackend(otherBackend{cpu.New(backend.Float32)}), WithHook(func(ev StepEvent) { got = append(got, ev.Loss) }))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("%d losses, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("step %d: loss %.9g through soloGroup, %.9g through the in-process communicator", i+1, got[i], want[i])
		}
	}
}

func TestSoloGroupCollectives(t *testing.T) {
	b := cpu.New(backend.Float32)
	g := &soloGroup{b: b}
	send := b.New(backend.Float32, 3, 2)
	backend.UploadSlice(b, send, []float32{1, 2, 3, 4, 5, 6})
	recv := b.New(backend.Float32, 4, 2)
	if err := g.AllToAllRows(recv, send, []int{2}, []int{2}); err != nil {
		t.Fatal(err)
	}
	if got := backend.DownloadFloat32(b, recv); !equalF32(got, []float32{1, 2, 3, 4, 0, 0, 0, 0}) {
		t.Errorf("AllToAllRows copied %v", got)
	}
	for _, c := range []struct{ recv, send []int }{{[]int{2}, []int{3}}, {[]int{5}, []int{5}}, {[]int{1, 1}, []int{1, 1}}} {
		if err := g.AllToAllRows(recv, send, c.recv, c.send); err == nil {
			t.Errorf("counts %v/%v accepted", c.recv, c.send)
		}
	}
	if got, err := g.AllToAllInts([]int{7}); err != nil || len(got) != 1 || got[0] != 7 {
		t.Errorf("AllToAllInts: %v, %v", got, err)
	}
	vals := []float64{1.5}
	if err := g.AllReduceFloat64(vals); err != nil || vals[0] != 1.5 {
		t.Errorf("AllReduceFloat64: %v, %v", vals, err)
	}
	g.Abort(context.Canceled)
	if err := g.AllReduceSum(send); err != context.Canceled {
		t.Errorf("after Abort: %v", err)
	}
	if err := g.AllToAllRows(recv, send, []int{1}, []int{1}); err != context.Canceled {
		t.Errorf("AllToAllRows after Abort: %v", err)
	}
}

func equalF32(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestLayoutsNeedTheCPU: several ranks on a backend other than the CPU are
// refused, with train.backend: cuda before any GPU is looked for.
func TestLayoutsNeedTheCPU(t *testing.T) {
	cfg := equivalenceConfig()
	cfg.Parallel.EP = 2
	cfg.Train.MicroBatch = 4
	if _, err := New(cfg, WithBackend(otherBackend{cpu.New(backend.Float32)})); err == nil || !strings.Contains(err.Error(), "CPU backend only") {
		t.Errorf("2 ranks on another backend: %v", err)
	}
	cfg.Train.Backend = "cuda"
	if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), "parallel.ep > 1 on the CUDA backend is not available yet") {
		t.Errorf("parallel.ep = 2 on cuda: %v", err)
	}
	// auto falls back to the CPU, where the layout runs.
	cfg.Train.Backend = "auto"
	eng, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if eng.backend.Name() != "cpu" {
		t.Errorf("auto with parallel.ep = 2 chose %s", eng.backend.Name())
	}
}
