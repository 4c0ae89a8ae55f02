package engine

// ZeRO-1 (parallel.zero: 1): the AdamW moments of the replicated
// parameters sharded over the data-context group.
//
// Without it every rank keeps m and v for its whole flat store, although
// the replicated span (flatLayout.replicated: the norms and the dense
// matrices, identical on the dp*ep*cp ranks of the data-context group) is
// updated identically everywhere. With it each of the group's N ranks
// keeps the moments of 1/N of that span, updates only that part of the
// weights, and hands the result to the others. Expert parameters, which
// each rank holds a share of already, keep their moments and their path.
//
// # The cut
//
// shardPlan cuts the replicated span into rounds of N equal pieces of c
// elements: round k is [k*N*c, (k+1)*N*c), and group rank q owns the
// piece [k*N*c + q*c, k*N*c + (q+1)*c) of every round. A round holds at
// most about gradBucket elements, so that the communicators' scratch grows
// with the round and not with the model, as for the all-reduce buckets;
// a model whose replicated weights fit in gradBucket has one round, and
// each rank's share is then one block. c is a multiple of flatAlign, and
// the span is padded with zeros to rounds*N*c (flatLayout.padReplicated),
// so every piece is aligned. Padding stays zero: AdamW keeps zero weights
// with zero gradients at zero.
//
// # A step
//
//  1. The backward, as without ZeRO. The replicated span is no part of
//     the overlapped reduction (grad_overlap.go), which keeps the
//     experts' sums: comm has no asynchronous reduce-scatter, and a
//     round's pieces are not the tensors of one layer. Instead, after the
//     last micro-batch, one reduce-scatter per round
//     (comm.Group.ReduceScatterSum, in place) leaves in each rank's
//     pieces of the gradient store their sum over the group. The rest of
//     that span of the store is left unsummed and unread.
//  2. The global gradient norm: each rank sums the squares of its pieces,
//     and the sums travel with the step's loss (one AllReduceFloat64 over
//     the group, which adds in rank order). Without ZeRO the replicated
//     squares are summed the same way, piece by piece in rank order, on
//     every rank (shardPlan.allSquares), so that the norm, and so the
//     clipping, has the same bits with and without ZeRO.
//  3. AdamW on the rank's pieces (the norms without weight decay) and on
//     its experts (rank.adam).
//  4. One all-gather per round (in place) puts every rank's updated
//     pieces into every rank's weight store.
//
// The in-process and TCP groups sum every element in rank order in
// AllReduceSum and ReduceScatterSum alike, AdamW is elementwise, and the
// all-gather copies bits, so a run with zero: 1 makes bitwise the steps
// of zero: 0 on the CPU. NCCL sums along its rings, which may differ
// between the two collectives in the last bits.
//
// # Checkpoints
//
// A checkpoint is the same with and without ZeRO. A rank's snapshot
// carries its parts of the replicated moments as blocks of the flattened
// tensors (momentPieces: a checkpoint.Slice of one dimension); the saver
// joins them into whole tensors in world rank 0's optimizer file, in the
// order a run without ZeRO writes them (joinMoments), before anything is
// written. On resume a rank reads every moment tensor that meets its
// pieces and keeps its parts (restoreMomentPieces). So a checkpoint
// resumes with either setting, under any layout.

import (
	"cmp"
	"fmt"
	"slices"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/comm"
)

// shardPlan is the cut of the replicated span over the data-context group
// (see the file comment).
type shardPlan struct {
	g       comm.Group
	ranks   int  // N, the group's size
	tensors span // the replicated span, without ZeRO's padding
	piece   int  // c: elements per rank and round
	rounds  int
}

// newShardPlan cuts replicated over g in rounds of at most about
// roundElems elements. A group of one rank gets one piece, the span.
func newShardPlan(g comm.Group, replicated span, roundElems int) shardPlan {
	n, length := g.Size(), replicated.hi-replicated.lo
	p := shardPlan{g: g, ranks: n, tensors: replicated, piece: length, rounds: 1}
	if n == 1 || length <= 0 {
		return p
	}
	p.rounds = max(1, ceilDiv(length, roundElems))
	p.piece = ceilDiv(ceilDiv(length, p.rounds*n), flatAlign) * flatAlign
	return p
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// padded is the length of the cut span: rounds*N*c.
func (p shardPlan) padded() int { return p.rounds * p.ranks * p.piece }

// moments is how many elements of each replicated moment one rank keeps
// under ZeRO-1.
func (p shardPlan) moments() int { return p.rounds * p.piece }

// round is round k's span of the store.
func (p shardPlan) round(k int) span {
	lo := p.tensors.lo + k*p.ranks*p.piece
	return span{lo, lo + p.ranks*p.piece}
}

// own is group rank q's piece of round k.
func (p shardPlan) own(k, q int) span {
	lo := p.round(k).lo + q*p.piece
	return span{lo, lo + p.piece}
}

// at is where the piece of round k begins in a rank's moments.
func (p shardPlan) at(k int) int { return k * p.piece }

func intersect(a, b span) span { return span{max(a.lo, b.lo), min(a.hi, b.hi)} }

// squares is the sum of the squares of group rank q's pieces of g, round
// by round, the tensors' part only (the padding adds nothing).
func (p shardPlan) squares(b backend.Backend, g paramStore, q int) float64 {
	s := 0.0
	for k := range p.rounds {
		if c := intersect(p.own(k, q), p.tensors); !c.empty() {
			s += b.SumSquares(g.view(b, c))
		}
	}
	return s
}

// squaresWithin is squares restricted to the range within.
func (p shardPlan) squaresWithin(b backend.Backend, g paramStore, q int, within span) float64 {
	s := 0.0
	for k := range p.rounds {
		if c := intersect(intersect(p.own(k, q), p.tensors), within); !c.empty() {
			s += b.SumSquares(g.view(b, c))
		}
	}
	return s
}

// allSquaresWithin is allSquares restricted to the range within.
func (p shardPlan) allSquaresWithin(b backend.Backend, g paramStore, within span) float64 {
	s := 0.0
	for q := range p.ranks {
		s += p.squaresWithin(b, g, q, within)
	}
	return s
}

// allSquares is the sum of the squares of the whole replicated span of g,
// added as ZeRO-1 adds them: every rank's pieces, then the ranks in order,
// as AllReduceFloat64 does.
func (p shardPlan) allSquares(b backend.Backend, g paramStore) float64 {
	return p.allSquaresLater(b, g)()
}

// allSquaresLater is allSquares with the reductions queued now and read
// (all under one wait, with the same adds in the same order) when the
// returned function is called, once.
func (p shardPlan) allSquaresLater(b backend.Backend, g paramStore) func() float64 {
	pieces := make([][]func() float64, max(p.ranks, 1))
	for q := range pieces {
		for k := range p.rounds {
			if c := intersect(p.own(k, q), p.tensors); !c.empty() {
				pieces[q] = append(pieces[q], backend.SumSquaresLater(b, g.view(b, c)))
			}
		}
	}
	return func() float64 {
		s := 0.0
		for _, fs := range pieces {
			sq := 0.0
			for _, f := range fs {
				sq += f()
			}
			s += sq // rank by rank, as AllReduceFloat64 adds (0 + sq is sq)
		}
		return s
	}
}

// adamPart is one AdamW call of a step: the span r of the weight and
// gradient stores, whose moments begin at element at of rank.m and rank.v.
type adamPart struct {
	r     span
	at    int
	decay bool // weight decay applies (not to the norms)
}

// newMoments allocates the rank's AdamW moments and plans its AdamW calls
// (r.adam). It returns views of m and v per parameter: of every tensor
// without ZeRO, of the experts only with it, whose replicated moments are
// spread over the ranks (those views stay nil).
func (r *rank) newMoments() (mp, vp *modelParams) {
	b, lay, m := r.b, r.layout, r.cfg.Model
	if !r.zero {
		ms, vs := newParamStore(b, m, lay), newParamStore(b, m, lay)
		r.m, r.v = ms.flat, vs.flat
		r.adam = []adamPart{{r: lay.norms, at: lay.norms.lo}}
		r.expertMomentsAt = lay.experts.lo
		rest := span{lay.norms.hi, lay.total}
		if r.expertsInBackward {
			rest.hi = lay.experts.lo // the backward updates the experts (expert_update.go)
		}
		if !rest.empty() {
			r.adam = append(r.adam, adamPart{r: rest, at: rest.lo, decay: true})
		}
		return ms.p, vs.p
	}
	p, q := r.shards, r.shards.g.Rank()
	own := p.moments()
	r.m, r.v = b.New(b.FloatType(), own+lay.experts.hi-lay.experts.lo), b.New(b.FloatType(), own+lay.experts.hi-lay.experts.lo)
	for k := range p.rounds {
		piece := p.own(k, q)
		for _, part := range []struct {
			r     span
			decay bool
		}{{intersect(piece, lay.norms), false}, {intersect(piece, span{lay.norms.hi, lay.replicated.hi}), true}} {
			if !part.r.empty() {
				r.adam = append(r.adam, adamPart{r: part.r, at: p.at(k) + part.r.lo - piece.lo, decay: part.decay})
			}
		}
	}
	r.expertMomentsAt = own
	if !lay.experts.empty() && !r.expertsInBackward {
		r.adam = append(r.adam, adamPart{r: lay.experts, at: own, decay: true})
	}
	mp, vp = newModelParams(m), newModelParams(m)
	for i, s := range lay.slots {
		if s.role == roleExpert {
			at := own + lay.offset[i] - lay.experts.lo
			*s.pick(mp) = b.View(r.m, at, lay.shape[i]...)
			*s.pick(vp) = b.View(r.v, at, lay.shape[i]...)
		}
	}
	return mp, vp
}

// without drops the parts of p that sum the span s: ZeRO-1 reduce-scatters
// the replicated span after the backward instead of all-reducing it.
func (p gradPlan) without(s span) gradPlan {
	keep := func(parts []gradPart) []gradPart {
		var out []gradPart
		for _, part := range parts {
			if lo := part.buckets[0].r.lo; lo >= s.lo && lo < s.hi {
				continue
			}
			out = append(out, part)
		}
		return out
	}
	return gradPlan{overlap: keep(p.overlap), after: keep(p.after)}
}

// reduceScatterGrads sums the replicated gradients over the group into
// each rank's pieces, one round at a time.
func (r *rank) reduceScatterGrads() error {
	p, q := r.shards, r.shards.g.Rank()
	for k := range p.rounds {
		if err := p.g.ReduceScatterSum(r.gStore.view(r.b, p.own(k, q)), r.gStore.view(r.b, p.round(k))); err != nil {
			return err
		}
	}
	return nil
}

// gatherWeights hands every rank's updated pieces of the replicated
// weights to every rank, one round at a time.
func (r *rank) gatherWeights() error {
	p, q := r.shards, r.shards.g.Rank()
	for k := range p.rounds {
		if err := p.g.AllGather(r.wStore.view(r.b, p.round(k)), r.wStore.view(r.b, p.own(k, q))); err != nil {
			return err
		}
	}
	return nil
}

// Moment tensor names: "<parameter>.exp_avg" (m) and ".exp_avg_sq" (v).
const (
	suffixAvg   = ".exp_avg"
	suffixAvgSq = ".exp_avg_sq"
)

// momentPieces is this rank's parts of the replicated moments, for its
// snapshot: per tensor and piece, a block of the flattened tensor.
func (r *rank) momentPieces() []checkpoint.NamedTensor {
	p, q := r.shards, r.shards.g.Rank()
	own := p.moments()
	hostM := backend.DownloadFloat32(r.b, r.b.View(r.m, 0, own))
	hostV := backend.DownloadFloat32(r.b, r.b.View(r.v, 0, own))
	var out []checkpoint.NamedTensor
	for i, prm := range r.params {
		// Under tensor parallelism every tp rank has a data-context group
		// of its own: tensors the tp ranks hold whole come from tp rank 0's.
		if prm.slot.role == roleExpert || prm.split.n == 1 && r.tp.Rank() != 0 {
			continue
		}
		off, n := r.layout.offset[i], prm.w.Len()
		for k := range p.rounds {
			piece := p.own(k, q)
			c := intersect(piece, span{off, off + n})
			if c.empty() {
				continue
			}
			at, size := p.at(k)+c.lo-piece.lo, c.hi-c.lo
			if prm.split.n > 1 {
				// A tp block: its runs in the whole tensor.
				out = append(out, prm.blocks(prm.slot.name+suffixAvg, hostM[at:at+size], c.lo-off, c.hi-off)...)
				out = append(out, prm.blocks(prm.slot.name+suffixAvgSq, hostV[at:at+size], c.lo-off, c.hi-off)...)
				continue
			}
			slice := &checkpoint.Slice{Offset: []int{c.lo - off}, GlobalShape: []int{n}}
			out = append(out,
				checkpoint.NamedTensor{Name: prm.slot.name + suffixAvg, Shape: []int{size}, Data: hostM[at : at+size], Slice: slice},
				checkpoint.NamedTensor{Name: prm.slot.name + suffixAvgSq, Shape: []int{size}, Data: hostV[at : at+size], Slice: slice})
		}
	}
	return out
}

// restoreMomentPieces reads this rank's parts of the replicated moments
// from ck: every whole tensor that meets one of its pieces, of which it
// keeps the parts.
func (r *rank) restoreMomentPieces(ck *checkpoint.Checkpoint) error {
	p, q := r.shards, r.shards.g.Rank()
	own := p.moments()
	for _, mo := range []struct {
		suffix string
		t      backend.Tensor
	}{{suffixAvg, r.m}, {suffixAvgSq, r.v}} {
		host := make([]float32, own)
		for i, prm := range r.params {
			if prm.slot.role == roleExpert {
				continue
			}
			off, n := r.layout.offset[i], prm.w.Len()
			var whole []float32
			for k := range p.rounds {
				piece := p.own(k, q)
				c := intersect(piece, span{off, off + n})
				if c.empty() {
					continue
				}
				if whole == nil {
					whole = make([]float32, n)
					if err := prm.readBlock(ck.Optim(), prm.slot.name+mo.suffix, whole); err != nil {
						return err
					}
				}
				at := p.at(k) + c.lo - piece.lo
				copy(host[at:at+c.hi-c.lo], whole[c.lo-off:c.hi-off])
			}
		}
		backend.UploadSlice(r.b, r.b.View(mo.t, 0, own), host)
	}
	return nil
}

// joinMoments returns the snapshots with the blocks of flattened moments
// (momentPieces) joined into whole tensors, which go to world rank 0's
// optimizer tensors; that list is then in checkpoint order (ParamShapes,
// m before v), the order a run without ZeRO writes. Snapshots without
// blocks come back as they are. The blocks of a tensor must cover it.
// The blocks of model tensors split over tensor-parallel ranks
// (rank.snapshot) are joined the same way into world rank 0's model
// tensors, so a checkpoint holds whole tensors whatever the layout.
func joinMoments(snaps []rankSnapshot, m ModelConfig) ([]rankSnapshot, error) {
	snaps, err := joinBlocks(snaps, m, true)
	if err != nil {
		return nil, err
	}
	return joinBlocks(snaps, m, false)
}

// joinBlocks is joinMoments over the optimizer tensors (optim) or the
// model's.
func joinBlocks(snaps []rankSnapshot, m ModelConfig, optim bool) ([]rankSnapshot, error) {
	what, kind := "optimizer moments", "a model tensor's moment"
	list := func(s *rankSnapshot) *[]checkpoint.NamedTensor { return &s.optim }
	if !optim {
		what, kind = "model tensors", "a model tensor"
		list = func(s *rankSnapshot) *[]checkpoint.NamedTensor { return &s.model }
	}
	shapes, order := map[string][]int{}, map[string]int{}
	for i, ns := range ParamShapes(m) {
		if optim {
			shapes[ns.Name+suffixAvg], shapes[ns.Name+suffixAvgSq] = ns.Shape, ns.Shape
			order[ns.Name+suffixAvg], order[ns.Name+suffixAvgSq] = 2*i, 2*i+1
		} else {
			shapes[ns.Name], order[ns.Name] = ns.Shape, i
		}
	}
	type whole struct {
		shape  []int
		data   []float32
		filled int
	}
	wholes := map[string]*whole{}
	var names []string // in order of first appearance
	out := slices.Clone(snaps)
	lead := -1
	for i := range out {
		if out[i].worldRank == 0 {
			lead = i
		}
		if !slices.ContainsFunc(*list(&out[i]), func(t checkpoint.NamedTensor) bool { return t.Slice != nil }) {
			continue
		}
		var keep []checkpoint.NamedTensor
		for _, t := range *list(&out[i]) {
			if t.Slice == nil {
				keep = append(keep, t)
				continue
			}
			shape, known := shapes[t.Name]
			n := shapeLen(shape)
			if !known || len(t.Slice.Offset) != 1 || !slices.Equal(t.Slice.GlobalShape, []int{n}) ||
				t.Slice.Offset[0] < 0 || t.Slice.Offset[0]+len(t.Data) > n {
				return nil, fmt.Errorf("rank %d's checkpoint share: the block of %q at %v of %v is no flat range of %s",
					out[i].worldRank, t.Name, t.Slice.Offset, t.Slice.GlobalShape, kind)
			}
			w := wholes[t.Name]
			if w == nil {
				w = &whole{shape: shape, data: make([]float32, n)}
				wholes[t.Name] = w
				names = append(names, t.Name)
			}
			copy(w.data[t.Slice.Offset[0]:], t.Data)
			w.filled += len(t.Data)
		}
		*list(&out[i]) = keep
	}
	if len(wholes) == 0 {
		return snaps, nil
	}
	if lead < 0 {
		return nil, fmt.Errorf("joining the %s: no checkpoint share of world rank 0", what)
	}
	joined := slices.Clone(*list(&out[lead]))
	for _, name := range names {
		w := wholes[name]
		if w.filled != len(w.data) {
			return nil, fmt.Errorf("joining the %s: the ranks' blocks of %q hold %d of its %d elements", what, name, w.filled, len(w.data))
		}
		joined = append(joined, checkpoint.NamedTensor{Name: name, Shape: w.shape, Data: w.data})
	}
	rank := func(name string) int {
		if i, ok := order[name]; ok {
			return i
		}
		return len(order) // unknown names last, in their order
	}
	slices.SortStableFunc(joined, func(a, b checkpoint.NamedTensor) int { return cmp.Compare(rank(a.Name), rank(b.Name)) })
	*list(&out[lead]) = joined
	return out, nil
}

// momentBytes is the memory of one rank's AdamW moments, and what they
// would take without ZeRO.
func (r *rank) momentBytes() (now, without int64) {
	size := int64(4)
	if r.b.FloatType() == backend.Float64 {
		size = 8
	}
	lay := r.layout
	full := (r.shards.tensors.hi - r.shards.tensors.lo) + (lay.experts.hi - lay.experts.lo)
	return 2 * size * int64(r.m.Len()), 2 * size * int64(full)
}

// logOptimizerMemory logs, once at the start of a run with parallel.zero:
// 1, the AdamW moments' memory per rank with and without ZeRO, or why
// ZeRO does nothing. ranks are the ranks this process trains.
func (e *Engine) logOptimizerMemory(ranks []*rank) {
	if e.cfg.Parallel.Zero != 1 || len(ranks) == 0 || ranks[0].m == nil {
		return
	}
	r := ranks[0]
	if !r.zero {
		e.log.Info().Msg("parallel.zero: 1 shards nothing here: the run has one data-parallel rank (dp*ep*cp = 1)")
		return
	}
	now, without := r.momentBytes()
	e.log.Info().Int("ranks", r.shards.ranks).Int("rounds", r.shards.rounds).Int64("moment_bytes", now).Int64("moment_bytes_without_zero", without).
		Msgf("zero-1: the AdamW moments take %.1f MiB per rank instead of %.1f MiB (the replicated weights' moments sharded over %d ranks)",
			float64(now)/(1<<20), float64(without)/(1<<20), r.shards.ranks)
}

// shapeLen is the number of elements of a tensor of shape.
func shapeLen(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}
