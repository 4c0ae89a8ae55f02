package cuda

import (
	"strings"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
)

// NCCLPeerGroup's checks, which need no GPU: a group made without peer
// access says so, and a rank that passes a tensor of another backend
// fails with it named and aborts the group, so that the rank waiting in
// the exchange fails too instead of waiting out its bound.
func TestNCCLPeerGroupChecks(t *testing.T) {
	plain := NCCLPeerGroup{&NCCLGroup{name: "expert", size: 2, state: &ncclState{name: "expert"}}}
	if _, err := plain.PeerTensors(); err == nil || !strings.Contains(err.Error(), "made without NCCLOptions.PeerAccess") {
		t.Errorf("a group without peer access: %v", err)
	}

	state := &ncclState{name: "expert"}
	var err error
	if state.exchange, err = comm.NewExchange("expert", 2, time.Minute); err != nil {
		t.Fatal(err)
	}
	ranks := []NCCLPeerGroup{
		{&NCCLGroup{name: "expert", rank: 0, size: 2, state: state}},
		{&NCCLGroup{name: "expert", rank: 1, size: 2, state: state}},
	}
	waiting := make(chan error, 1)
	go func() {
		_, err := ranks[0].PeerTensors(&Tensor{shape: []int{1}, dt: backend.Float32})
		waiting <- err
	}()
	host := cpu.New(backend.Float32).New(backend.Float32, 1)
	if _, err := ranks[1].PeerTensors(host); err == nil || !strings.Contains(err.Error(), "rank 1's tensor 0 is a *cpu.Tensor, not a CUDA tensor") {
		t.Errorf("a CPU tensor: %v", err)
	}
	select {
	case err := <-waiting:
		if err == nil || !strings.Contains(err.Error(), "not a CUDA tensor") {
			t.Errorf("the waiting rank: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the waiting rank was not released by the abort")
	}
	if _, err := ranks[0].PeerTensors(); err == nil || !strings.Contains(err.Error(), "group aborted") {
		t.Errorf("a call after the abort: %v", err)
	}
}
