package cuda

import (
	"fmt"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
)

// TestNCCLPeerGroups runs the comm.PeerAccess contract on the GPUs of one
// process (2 to 4): NCCLRanks with PeerAccess hands out expert groups
// that offer it; after PeerTensors each rank's own kernels read every
// peer's tensor on the peer's GPU (the float32-to-bf16 rounding kernel
// of Copy, whose source is the peer's memory) and write a row into every
// peer's inbox; after a Barrier each owner finds every peer's row. Four
// rounds, every tensor rewritten each round.
func TestNCCLPeerGroups(t *testing.T) {
	testDevice(t)
	count, err := gpu.rt.DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	if count < 2 {
		t.Skipf("peer access between GPUs needs 2 GPUs; the driver sees %d", count)
	}
	n := min(count, 4)
	ranks, bs := ncclRanksOnGPUs(t, comm.Mesh{DP: 1, EP: n, CP: 1, TP: 1}, NCCLOptions{PeerAccess: true})
	errs := make(chan error, n)
	for r, rk := range ranks {
		go func() { errs <- peerRounds(bs[r], rk.Expert, r, n) }()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

// peerRounds is one rank's part of TestNCCLPeerGroups. Marks are small
// integers and halves, exact in bf16.
func peerRounds(b *Backend, g comm.Group, r, n int) error {
	pa, ok := g.(comm.PeerAccess)
	if !ok {
		return fmt.Errorf("rank %d: the expert group %T does not offer comm.PeerAccess", r, g)
	}
	mark := func(round, s int) []float32 {
		m := float32(8*round + s)
		return []float32{m, m + 0.5, -m, float32(round)}
	}
	own := b.New(backend.Float32, 4)
	inbox := b.New(backend.BFloat16, n, 4) // row s: written by rank s's kernels
	got := b.New(backend.BFloat16, 4)
	for round := range 4 {
		backend.UploadSlice(b, own, mark(round, r))
		all, err := pa.PeerTensors(own, inbox)
		if err != nil {
			return fmt.Errorf("rank %d, round %d: %w", r, round, err)
		}
		for s := range n {
			b.Copy(got, all[s][0]) // this GPU reads rank s's
			want := mark(round, s)
			if v := backend.DownloadFloat32(b, got); fmt.Sprint(v) != fmt.Sprint(want) {
				return fmt.Errorf("rank %d, round %d: rank %d's tensor reads %v on GPU %d, want %v", r, round, s, v, r, want)
			}
			b.Copy(b.View(all[s][1], 4*r, 4), own) // this GPU writes row r of rank s's inbox
		}
		if err := g.Barrier(); err != nil {
			return fmt.Errorf("rank %d, round %d: %w", r, round, err)
		}
		rows := backend.DownloadFloat32(b, inbox)
		for s := range n {
			if v, want := rows[4*s:4*s+4], mark(round, s); fmt.Sprint(v) != fmt.Sprint(want) {
				return fmt.Errorf("rank %d, round %d: inbox row %d is %v, want rank %d's %v", r, round, s, v, s, want)
			}
		}
		if err := b.Sync(); err != nil {
			return fmt.Errorf("rank %d: %w", r, err)
		}
	}
	return nil
}
