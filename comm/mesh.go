package comm

import "fmt"

// Rank layout. A world rank is the mesh coordinate read as a mixed-radix
// number with tp varying fastest:
//
//	rank = ((dp*EP + ep)*CP + cp)*TP + tp
//
// so with CP = TP = 1, rank = dp*EP + ep: the EP ranks of one data-parallel
// replica are neighbours. The groups cut from the mesh are
//
//	World          every rank                                  size DP*EP*CP*TP
//	Data           same cp, tp     (rank dp*EP + ep)           size DP*EP
//	Expert         same dp, cp     (rank ep*TP + tp)           size EP*TP
//	ExpertReplica  same ep, cp, tp (rank dp)                   size DP
//	Context        same dp, ep, tp (rank cp)                   size CP
//	DataContext    same tp         (rank (dp*EP + ep)*CP + cp) size DP*EP*CP
//	Tensor         same dp, ep, cp (rank tp)                   size TP
//
// The rank of a member within a group is its coordinate on the group's
// axes, read the same way (so Data's group rank orders dp before ep).
// Data holds one rank per data replica's share of the tokens at one cp
// position; DataContext holds every rank with distinct tokens, which is
// what sums of per-token quantities (the loss, the MoE load statistics,
// the gradients of replicated weights) run over under context parallelism.
// Tensor holds the ranks that split the same tokens' projections (tensor
// parallelism). The experts are folded over it: the expert group spans
// the ep x tp ranks of one data and context position, each holding
// experts/(EP*TP) whole experts, so with TP = 1 it is the ep ranks alone.

// Coord is one rank's position in the mesh; each index counts from 0.
type Coord struct {
	DP, EP, CP, TP int
}

// Validate reports a mesh with a dimension below 1.
func (m Mesh) Validate() error {
	for _, d := range []struct {
		name string
		v    int
	}{{"dp", m.DP}, {"ep", m.EP}, {"cp", m.CP}, {"tp", m.TP}} {
		if d.v < 1 {
			return fmt.Errorf("comm: mesh %s is %d; every mesh dimension must be at least 1", d.name, d.v)
		}
	}
	return nil
}

// Rank is the world rank at c.
func (m Mesh) Rank(c Coord) int {
	return ((c.DP*m.EP+c.EP)*m.CP+c.CP)*m.TP + c.TP
}

// Coord is the mesh position of a world rank; the inverse of Rank.
func (m Mesh) Coord(rank int) Coord {
	var c Coord
	c.TP, rank = rank%m.TP, rank/m.TP
	c.CP, rank = rank%m.CP, rank/m.CP
	c.EP, rank = rank%m.EP, rank/m.EP
	c.DP = rank
	return c
}

// Ranks is one world rank's view of the mesh: where it sits and the groups
// it belongs to (see the rank layout above).
type Ranks struct {
	Mesh  Mesh
	Coord Coord
	Rank  int // world rank

	World, Data, Expert, ExpertReplica Group
	// Context is the context-parallel group: the ranks that hold the
	// chunks of the same sequences (see attention.NewContextParallel).
	Context Group
	// DataContext is Data and Context together: every rank that holds
	// distinct tokens (with CP = 1 it has Data's members and ranks).
	DataContext Group
	// Tensor is the tensor-parallel group: the ranks that hold the same
	// tokens and split the attention heads and the vocabulary between
	// them (package tensorpar).
	Tensor Group
}

// Abort aborts every group of this rank, so that a failing rank releases
// every peer waiting on it whichever group they wait in. A rank woken by the
// resulting error should call Abort too, which passes the failure on to the
// groups it shares with ranks that never met the failed one.
func (r *Ranks) Abort(err error) {
	for _, g := range []Group{r.World, r.Data, r.Expert, r.ExpertReplica, r.Context, r.DataContext, r.Tensor} {
		g.Abort(err)
	}
}
