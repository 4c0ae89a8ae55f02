package comm

import (
	"errors"
	"strings"
	"testing"
)

// fakeGroup is a Group that only knows its members, for NewRanks.
type fakeGroup struct {
	Group
	kind    GroupKind
	members []int
	rank    int
}

func (g *fakeGroup) Rank() int { return g.rank }
func (g *fakeGroup) Size() int { return len(g.members) }

// TestNewRanksMatchesLayout checks that NewRanks cuts the groups of the
// rank layout in mesh.go (each group's rank and size, from the table
// there), with members that agree on them, and that every group is made
// once. NewLocal and the TCP world cut their groups through it.
func TestNewRanksMatchesLayout(t *testing.T) {
	for _, m := range []Mesh{{1, 1, 1, 1}, {2, 1, 1, 1}, {1, 4, 1, 1}, {2, 2, 1, 1}, {2, 1, 2, 1}, {3, 2, 2, 1}, {2, 2, 2, 2}} {
		calls := map[GroupKind]int{}
		ranks, err := NewRanks(m, func(k GroupKind, members []int) ([]Group, error) {
			calls[k]++
			gs := make([]Group, len(members))
			for i := range members {
				gs[i] = &fakeGroup{kind: k, members: members, rank: i}
			}
			return gs, nil
		})
		if err != nil {
			t.Fatalf("%+v: %v", m, err)
		}
		for r, rk := range ranks {
			c := m.Coord(r)
			want := [][2]int{ // rank within the group, size (mesh.go)
				{r, m.World()},
				{c.DP*m.EP + c.EP, m.DP * m.EP},
				{c.EP*m.TP + c.TP, m.EP * m.TP},
				{c.DP, m.DP},
				{c.CP, m.CP},
				{(c.DP*m.EP+c.EP)*m.CP + c.CP, m.DP * m.EP * m.CP},
				{c.TP, m.TP},
			}
			for i, gr := range []Group{rk.World, rk.Data, rk.Expert, rk.ExpertReplica, rk.Context, rk.DataContext, rk.Tensor} {
				g := gr.(*fakeGroup)
				if g.kind != GroupKinds()[i] || g.Rank() != want[i][0] || g.Size() != want[i][1] || g.members[g.rank] != r {
					t.Errorf("%+v rank %d %v: rank %d of %v, want rank %d of %d", m, r, GroupKinds()[i], g.rank, g.members, want[i][0], want[i][1])
				}
			}
			if rk.Rank != r || rk.Coord != m.Coord(r) {
				t.Errorf("%+v rank %d: Ranks %d at %+v", m, r, rk.Rank, rk.Coord)
			}
		}
		// One call per distinct group: World once, Data CP*TP times...
		want := map[GroupKind]int{GroupWorld: 1, GroupData: m.CP * m.TP, GroupExpert: m.DP * m.CP,
			GroupExpertReplica: m.EP * m.CP * m.TP, GroupContext: m.DP * m.EP * m.TP, GroupDataContext: m.TP, GroupTensor: m.DP * m.EP * m.CP}
		for k, n := range want {
			if calls[k] != n {
				t.Errorf("%+v: %d %v groups made, want %d", m, calls[k], k, n)
			}
		}
	}
}

func TestNewRanksErrors(t *testing.T) {
	boom := errors.New("boom")
	_, err := NewRanks(Mesh{2, 1, 1, 1}, func(k GroupKind, members []int) ([]Group, error) {
		if k == GroupData {
			return nil, boom
		}
		return make([]Group, len(members)), nil
	})
	if !errors.Is(err, boom) || !strings.Contains(err.Error(), "data group of ranks [0 1]") {
		t.Errorf("error %v", err)
	}
	_, err = NewRanks(Mesh{2, 1, 1, 1}, func(k GroupKind, members []int) ([]Group, error) { return nil, nil })
	if err == nil || !strings.Contains(err.Error(), "0 handles for 2 members") {
		t.Errorf("error %v", err)
	}
	if _, err := NewRanks(Mesh{0, 1, 1, 1}, nil); err == nil {
		t.Error("a mesh with dp 0 was accepted")
	}
	var names []string
	for _, k := range GroupKinds() {
		names = append(names, k.String())
	}
	if got := strings.Join(names, ","); got != "world,data,expert,expert-replica,context,data-context,tensor" {
		t.Errorf("kind names %v", got)
	}
}
