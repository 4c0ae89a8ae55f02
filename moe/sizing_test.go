package moe_test

import (
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
	}{
		{"unfused", moe.DispatcherUnfused, 0},
		{"fused", moe.DispatcherFused, 0},
		{"capacity", moe.DispatcherUnfused, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := moe.Config{Experts: 4, TopK: 2, FFN: 6, AuxLossCoef: 0.01, ZLossCoef: 0.001, Dispatcher: c.dispatcher, CapacityFactor: c.capacity}
			const D, T = 8, 24
			rc := &readCounter{Backend: cpu.New(backend.Float64)}
			ranks, err := comm.NewLocal(oneRank(), rc)
			if err != nil {
				t.Fatal(err)
			}
			layer, err := moe.New(rc, cfg, D, T, moe.Groups{Expert: ranks[0].Expert, Data: ranks[0].Data})
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
			switch {
			case c.capacity > 0 && rc.downloads == 0:
				t.Errorf("with a capacity the forward read nothing; it plans from the router's choices on the host")
			case c.capacity == 0 && (rc.downloads != 0 || rc.started != 1 || rc.waited != 0):
				t.Errorf("the forward made %d downloads and queued %d (%d waited for); want none, one queued and not waited for",
					rc.downloads, rc.started, rc.waited)
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
			if c.capacity == 0 && rc.started != rc.waited+1 {
				t.Errorf("after two more forwards %d downloads queued, %d waited for; want all but the last waited for", rc.started, rc.waited)
			}
		})
	}
}
