package comm

import "fmt"

// GroupKind names one of the groups every rank belongs to (see the rank
// layout in mesh.go).
type GroupKind int

const (
	GroupWorld GroupKind = iota
	GroupData
	GroupExpert
	GroupExpertReplica
	GroupContext
	GroupDataContext
	GroupTensor
)

// GroupKinds lists every kind, in the order of Ranks' fields.
func GroupKinds() []GroupKind {
	return []GroupKind{GroupWorld, GroupData, GroupExpert, GroupExpertReplica, GroupContext, GroupDataContext, GroupTensor}
}

func (k GroupKind) String() string {
	switch k {
	case GroupWorld:
		return "world"
	case GroupData:
		return "data"
	case GroupExpert:
		return "expert"
	case GroupExpertReplica:
		return "expert-replica"
	case GroupContext:
		return "context"
	case GroupDataContext:
		return "data-context"
	case GroupTensor:
		return "tensor"
	}
	return fmt.Sprintf("GroupKind(%d)", int(k))
}

// cut is how a kind of group splits the mesh: members share key, and a
// member's rank within its group is place.
func (m Mesh) cut(k GroupKind) (key func(Coord) Coord, place func(Coord) int) {
	switch k {
	case GroupData:
		return func(c Coord) Coord { return Coord{CP: c.CP, TP: c.TP} }, func(c Coord) int { return c.DP*m.EP + c.EP }
	case GroupExpert:
		// Experts are folded over tp: the expert group spans ep x tp.
		return func(c Coord) Coord { return Coord{DP: c.DP, CP: c.CP} }, func(c Coord) int { return c.EP*m.TP + c.TP }
	case GroupExpertReplica:
		return func(c Coord) Coord { return Coord{EP: c.EP, CP: c.CP, TP: c.TP} }, func(c Coord) int { return c.DP }
	case GroupContext:
		return func(c Coord) Coord { return Coord{DP: c.DP, EP: c.EP, TP: c.TP} }, func(c Coord) int { return c.CP }
	case GroupDataContext:
		return func(c Coord) Coord { return Coord{TP: c.TP} }, func(c Coord) int { return (c.DP*m.EP+c.EP)*m.CP + c.CP }
	case GroupTensor:
		return func(c Coord) Coord { return Coord{DP: c.DP, EP: c.EP, CP: c.CP} }, func(c Coord) int { return c.TP }
	}
	return func(Coord) Coord { return Coord{} }, func(c Coord) int { return m.Rank(c) }
}

// Members returns the world ranks of rank's group of kind k, indexed by
// their rank within the group, and rank's own place in it.
func (m Mesh) Members(k GroupKind, rank int) (members []int, self int) {
	key, place := m.cut(k)
	me := m.Coord(rank)
	for q := range m.World() {
		if c := m.Coord(q); key(c) == key(me) {
			members = append(members, q)
		}
	}
	byPlace := make([]int, len(members))
	for _, q := range members {
		byPlace[place(m.Coord(q))] = q
	}
	return byPlace, place(me)
}

// NewRanks builds every world rank's Ranks from groups that newGroup makes:
// it is called once per group of the mesh, with the group's kind and its
// members (world ranks, indexed by rank within the group), and returns one
// Group handle per member, in the same order. Communicators that are not
// in-process (NCCL over the GPUs of one process, for one) are cut from the
// mesh this way, exactly as NewLocal cuts its own.
func NewRanks(m Mesh, newGroup func(k GroupKind, members []int) ([]Group, error)) ([]*Ranks, error) {
	if err := m.Validate(); err != nil {
		return nil, err
	}
	n := m.World()
	handles := make([][]Group, len(GroupKinds())) // [kind][world rank]
	for _, k := range GroupKinds() {
		handles[k] = make([]Group, n)
		for r := range n {
			if handles[k][r] != nil {
				continue
			}
			members, _ := m.Members(k, r)
			gs, err := newGroup(k, members)
			if err != nil {
				return nil, fmt.Errorf("comm: %s group of ranks %v: %w", k, members, err)
			}
			if len(gs) != len(members) {
				return nil, fmt.Errorf("comm: %s group of ranks %v: %d handles for %d members", k, members, len(gs), len(members))
			}
			for i, q := range members {
				handles[k][q] = gs[i]
			}
		}
	}
	ranks := make([]*Ranks, n)
	for r := range ranks {
		ranks[r] = &Ranks{
			Mesh: m, Coord: m.Coord(r), Rank: r,
			World: handles[GroupWorld][r], Data: handles[GroupData][r], Expert: handles[GroupExpert][r],
			ExpertReplica: handles[GroupExpertReplica][r], Context: handles[GroupContext][r], DataContext: handles[GroupDataContext][r],
			Tensor: handles[GroupTensor][r],
		}
	}
	return ranks, nil
}
