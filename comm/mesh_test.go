package comm_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/comm"
)

func TestMeshValidate(t *testing.T) {
	for _, c := range []struct {
		m    comm.Mesh
		want string // "" = valid
	}{
		{comm.Mesh{DP: 1, EP: 1, CP: 1, TP: 1}, ""},
		{comm.Mesh{DP: 2, EP: 3, CP: 1, TP: 2}, ""},
		{comm.Mesh{DP: 0, EP: 1, CP: 1, TP: 1}, "mesh dp is 0"},
		{comm.Mesh{DP: 1, EP: -2, CP: 1, TP: 1}, "mesh ep is -2"},
		{comm.Mesh{DP: 1, EP: 1, CP: 0, TP: 1}, "mesh cp is 0"},
		{comm.Mesh{DP: 1, EP: 1, CP: 1}, "mesh tp is 0"},
	} {
		err := c.m.Validate()
		if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%+v: Validate() = %v, want %q", c.m, err, c.want)
		}
		if _, err := comm.NewLocal(c.m, cpu.New(backend.Float32)); (err == nil) != (c.want == "") {
			t.Errorf("%+v: NewLocal error = %v", c.m, err)
		}
	}
}

func TestMeshRankCoordRoundTrip(t *testing.T) {
	m := comm.Mesh{DP: 2, EP: 3, CP: 2, TP: 2}
	seen := map[comm.Coord]bool{}
	for r := range m.World() {
		c := m.Coord(r)
		if m.Rank(c) != r {
			t.Fatalf("Rank(Coord(%d)) = %d", r, m.Rank(c))
		}
		if c.DP >= m.DP || c.EP >= m.EP || c.CP >= m.CP || c.TP >= m.TP || seen[c] {
			t.Fatalf("Coord(%d) = %+v out of range or repeated", r, c)
		}
		seen[c] = true
	}
	// The documented layout: tp fastest, then cp, ep, dp.
	if got := m.Rank(comm.Coord{DP: 1, EP: 2, CP: 1, TP: 0}); got != ((1*3+2)*2+1)*2+0 {
		t.Fatalf("Rank = %d", got)
	}
	if got := (comm.Mesh{DP: 3, EP: 4, CP: 1, TP: 1}).Rank(comm.Coord{DP: 2, EP: 1}); got != 2*4+1 {
		t.Fatalf("with cp = tp = 1, rank = dp*EP + ep; got %d", got)
	}
}

// Each rank learns its groups' members by all-reducing one-hot vectors of
// world ranks; they must be exactly the ranks the layout names, and the
// group ranks must follow it.
func TestLocalGroupMembership(t *testing.T) {
	m := comm.Mesh{DP: 2, EP: 2, CP: 2, TP: 2}
	ranks, err := comm.NewLocal(m, cpu.New(backend.Float32))
	if err != nil {
		t.Fatal(err)
	}
	W := m.World()
	type groupOf func(r *comm.Ranks) comm.Group
	cases := []struct {
		name    string
		group   groupOf
		member  func(a, b comm.Coord) bool // is b in a's group
		rankOf  func(c comm.Coord) int
		wantLen int
	}{
		{"world", func(r *comm.Ranks) comm.Group { return r.World },
			func(a, b comm.Coord) bool { return true }, func(c comm.Coord) int { return m.Rank(c) }, W},
		{"data", func(r *comm.Ranks) comm.Group { return r.Data },
			func(a, b comm.Coord) bool { return a.CP == b.CP && a.TP == b.TP }, func(c comm.Coord) int { return c.DP*m.EP + c.EP }, m.DP * m.EP},
		{"expert", func(r *comm.Ranks) comm.Group { return r.Expert },
			func(a, b comm.Coord) bool { return a.DP == b.DP && a.CP == b.CP }, func(c comm.Coord) int { return c.EP*m.TP + c.TP }, m.EP * m.TP},
		{"expert-replica", func(r *comm.Ranks) comm.Group { return r.ExpertReplica },
			func(a, b comm.Coord) bool { return a.EP == b.EP && a.CP == b.CP && a.TP == b.TP }, func(c comm.Coord) int { return c.DP }, m.DP},
		{"context", func(r *comm.Ranks) comm.Group { return r.Context },
			func(a, b comm.Coord) bool { return a.DP == b.DP && a.EP == b.EP && a.TP == b.TP }, func(c comm.Coord) int { return c.CP }, m.CP},
		{"data-context", func(r *comm.Ranks) comm.Group { return r.DataContext },
			func(a, b comm.Coord) bool { return a.TP == b.TP }, func(c comm.Coord) int { return (c.DP*m.EP+c.EP)*m.CP + c.CP }, m.DP * m.EP * m.CP},
		{"tensor", func(r *comm.Ranks) comm.Group { return r.Tensor },
			func(a, b comm.Coord) bool { return a.DP == b.DP && a.EP == b.EP && a.CP == b.CP }, func(c comm.Coord) int { return c.TP }, m.TP},
	}
	for _, c := range cases {
		members := make([][]float64, W)
		runRanks(t, ranks, func(r *comm.Ranks) error {
			g := c.group(r)
			if g.Size() != c.wantLen || g.Rank() != c.rankOf(r.Coord) {
				t.Errorf("%s group of rank %d: rank %d size %d, want %d and %d", c.name, r.Rank, g.Rank(), g.Size(), c.rankOf(r.Coord), c.wantLen)
			}
			v := make([]float64, W)
			v[r.Rank] = 1
			members[r.Rank] = v
			return g.AllReduceFloat64(v)
		})
		for r := range W {
			for o := range W {
				want := 0.0
				if c.member(m.Coord(r), m.Coord(o)) {
					want = 1
				}
				if members[r][o] != want {
					t.Fatalf("%s group of rank %d: member %d is %v, want %v", c.name, r, o, members[r][o], want)
				}
			}
		}
	}
	for r, rk := range ranks {
		if rk.Rank != r || rk.Coord != m.Coord(r) || rk.Mesh != m {
			t.Fatalf("ranks[%d] = rank %d at %+v", r, rk.Rank, rk.Coord)
		}
	}
	if !slices.Equal([]int{ranks[5].Coord.DP, ranks[5].Coord.EP, ranks[5].Coord.CP, ranks[5].Coord.TP}, []int{0, 1, 0, 1}) {
		t.Fatalf("rank 5 at %+v", ranks[5].Coord)
	}
}
