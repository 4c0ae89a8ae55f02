package cuda

import (
	"fmt"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
)

// TestNCCLRanks cuts a mesh's groups as NCCL communicators over the GPUs
// there are (one rank per GPU: world 1 on one GPU, dp 2 x ep 2 on four) and
// sums a vector over every group of every rank: each group's sum is its
// size times the value every member contributed, and the group's rank
// and size are comm.NewLocal's.
func TestNCCLRanks(t *testing.T) {
	testDevice(t)
	count, err := gpu.rt.DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	mesh := comm.Mesh{DP: 1, EP: 1, CP: 1, TP: 1}
	switch {
	case count >= 4:
		mesh = comm.Mesh{DP: 2, EP: 2, CP: 1, TP: 1}
	case count >= 2:
		mesh = comm.Mesh{DP: 1, EP: 2, CP: 1, TP: 1}
	}
	n := mesh.World()
	ranks, bs := ncclRanksOnGPUs(t, mesh, NCCLOptions{})
	errs := make(chan error, n)
	for r, rk := range ranks {
		go func() {
			b := bs[r]
			for i, g := range []comm.Group{rk.World, rk.Data, rk.Expert, rk.ExpertReplica, rk.Context, rk.DataContext, rk.Tensor} {
				members, self := mesh.Members(comm.GroupKinds()[i], r)
				if g.Rank() != self || g.Size() != len(members) {
					errs <- fmt.Errorf("rank %d %v group: rank %d of %d, want %d of %d", r, comm.GroupKinds()[i], g.Rank(), g.Size(), self, len(members))
					return
				}
				x := b.New(backend.Float32, 5)
				backend.UploadSlice(b, x, []float32{1, 2, 3, 4, 5})
				if err := g.AllReduceSum(x); err != nil {
					errs <- err
					return
				}
				got := backend.DownloadFloat32(b, x)
				for j, v := range got {
					if v != float32(len(members)*(j+1)) {
						errs <- fmt.Errorf("rank %d %v group: sum %v, want %d x [1..5]", r, comm.GroupKinds()[i], got, len(members))
						return
					}
				}
			}
			errs <- nil
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	t.Logf("NCCL ranks of mesh %+v over %d GPUs", mesh, n)
}

// ncclRanksOnGPUs cuts mesh's groups with opts over GPUs 0..W-1, one rank
// each, closed when the test ends, and returns the ranks and their
// backends; it skips the test where there are fewer GPUs.
func ncclRanksOnGPUs(t *testing.T, mesh comm.Mesh, opts NCCLOptions) ([]*comm.Ranks, []*Backend) {
	t.Helper()
	_, bs := ncclWorld(t, mesh.World(), NCCLOptions{Name: "probe"}) // the backends, one per GPU
	ranks, closeAll, err := NCCLRanks(mesh, bs, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := closeAll(); err != nil {
			t.Errorf("closing the groups: %v", err)
		}
	})
	return ranks, bs
}
