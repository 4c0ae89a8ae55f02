package engine

// The CUDA multi-node path's parts that need no GPU: node 0's blob, the
// GPU-count error, and the refusals, each of which aborts the rendezvous so
// that the other nodes stop instead of waiting for this one in NCCL. The
// runs themselves are in multinode_gpu_test.go.

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/backend/cuda"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/launch"
)

// TestRendezvousBlob: every call has a fresh run id; the CPU backend's
// blob, and that of nodes other than 0, hold no NCCL id; node 0 of a CUDA
// run holds one, or fails saying so where there is no libnccl.
func TestRendezvousBlob(t *testing.T) {
	cfg := equivalenceConfig()
	onCPU, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	a, errA := onCPU.RendezvousBlob(0)
	b, errB := onCPU.RendezvousBlob(0)
	if err := errors.Join(errA, errB); err != nil {
		t.Fatal(err)
	}
	if comm.RunIDFromBlob(a) == comm.RunIDFromBlob(b) || comm.RunIDFromBlob(a) == [comm.RunIDSize]byte{} {
		t.Errorf("run ids %x and %x: want two fresh ones", comm.RunIDFromBlob(a), comm.RunIDFromBlob(b))
	}
	if _, err := cuda.NCCLIDFromBlob(a); err == nil {
		t.Error("the CPU backend's blob holds an NCCL id")
	}

	onCUDA, err := New(cfg, WithBackend(cudaNamed{cpu.New(backend.Float32)}), withCUDA())
	if err != nil {
		t.Fatal(err)
	}
	if blob, err := onCUDA.RendezvousBlob(1); err != nil {
		t.Fatal(err)
	} else if _, err := cuda.NCCLIDFromBlob(blob); err == nil {
		t.Error("node 1's blob holds an NCCL id; only node 0 makes one")
	}
	blob, err := onCUDA.RendezvousBlob(0)
	switch {
	case err != nil && !strings.Contains(err.Error(), "node 0: making the NCCL unique id"):
		t.Errorf("node 0 without libnccl: %v", err)
	case err != nil:
		t.Logf("no libnccl here: %v", err)
	default:
		if _, err := cuda.NCCLIDFromBlob(blob); err != nil {
			t.Errorf("node 0's blob: %v", err)
		}
	}
}

func TestCheckNodeGPUs(t *testing.T) {
	if err := checkNodeGPUs(1, 4, 4, 8, 4, ""); err != nil {
		t.Errorf("4 GPUs for 4 ranks: %v", err)
	}
	for _, c := range []struct {
		node, first, per, world, visible int
		cudaVisible, want                string
	}{
		{1, 4, 4, 8, 2, "", "node 1 hosts world ranks 4-7 of 8 and needs 4 GPUs, one per rank, but sees 2: "},
		{0, 0, 2, 4, 1, "CUDA_VISIBLE_DEVICES=3", "node 0 hosts world ranks 0-1 of 4 and needs 2 GPUs, one per rank, but sees 1 (CUDA_VISIBLE_DEVICES=3): "},
		{3, 3, 1, 4, 0, "", "node 3 hosts world rank 3 of 4 and needs 1 GPU, but sees 0: "},
	} {
		err := checkNodeGPUs(c.node, c.first, c.per, c.world, c.visible, c.cudaVisible)
		if err == nil || !strings.HasPrefix(err.Error(), c.want) {
			t.Errorf("got %v, want %q...", err, c.want)
		}
	}
}

// joinLoopback runs a rendezvous of nnodes in this process.
func joinLoopback(t *testing.T, nnodes int) []*launch.Rendezvous {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	rdvs := make([]*launch.Rendezvous, nnodes)
	errs := make([]error, nnodes)
	var wg sync.WaitGroup
	for node := range nnodes {
		wg.Go(func() {
			rdvs[node], errs[node] = launch.Join(context.Background(), launch.RendezvousConfig{
				Launch:     launch.Launch{NNodes: nnodes, NodeRank: node, MasterAddr: "127.0.0.1", MasterPort: port, Secret: []byte("the tests' shared secret")},
				RecipeHash: "h", Version: "v", Hostname: string(rune('a' + node)), Blob: comm.NewRunBlob(),
				Timeout: 5 * time.Second, Heartbeat: 50 * time.Millisecond, HeartbeatTimeout: time.Second,
			})
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for _, r := range rdvs {
		t.Cleanup(func() { r.Close() })
	}
	return rdvs
}

// TestDistributedCUDARefusals: a CUDA run over processes needs the
// rendezvous and GPUs the engine opened; a node that refuses to start
// closes its data listener and aborts the rendezvous, so that the other
// nodes stop with its reason.
func TestDistributedCUDARefusals(t *testing.T) {
	cfg := equivalenceConfig()
	cfg.Parallel.DP, cfg.Train.MicroBatch = 2, 4
	eng, err := New(cfg, WithBackend(cudaNamed{cpu.New(backend.Float32)}), withCUDA())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eng.RunDistributed(context.Background(), Distributed{TCP: comm.TCPConfig{NodeRank: 0}}); err == nil || !strings.Contains(err.Error(), "needs the rendezvous") {
		t.Errorf("without a rendezvous: %v", err)
	}

	rdvs := joinLoopback(t, 2)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, err = eng.RunDistributed(context.Background(), Distributed{TCP: comm.TCPConfig{NodeRank: 1, Listener: ln}, Rendezvous: rdvs[1]})
	want := "node 1: a run over 2 processes on the cuda backend trains one rank per GPU"
	if err == nil || !strings.HasPrefix(err.Error(), want) || !strings.Contains(err.Error(), "WithBackend") {
		t.Fatalf("a backend given with WithBackend: %v", err)
	}
	if _, aerr := ln.Accept(); aerr == nil {
		t.Error("the data listener is still open")
	}
	select {
	case got, ok := <-rdvs[0].Watch(context.Background()):
		if !ok || !strings.Contains(got.Error(), "node 1 (host b) aborted the run: "+want) {
			t.Errorf("node 0 heard %v (%v), want node 1's reason", got, ok)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("node 0 did not hear of node 1's failure")
	}
}
