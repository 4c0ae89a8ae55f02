package engine

import (
	"context"
	"fmt"
	"math"
	"sync"

	"github.com/mktrain/mktrain/attention"
	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/profile"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
	"github.com/mktrain/mktrain/tensorpar"
	"github.com/mktrain/mktrain/tune"
)

// batchSource yields micro-batches of token ids and their next-token targets,
// batch sequences at a time.
type batchSource interface {
	Next(batch int) (inputs, targets []int32, err error)
}

// evalSource is a batchSource that restarts at the same place for every
// evaluation, so validation losses are comparable.
type evalSource interface {
	batchSource
	Reset()
}

// rank is one rank of the run: its model replica (non-expert weights
// replicated, its share of the experts), optimizer state, data and groups.
// Virtual ranks are goroutines of one process, each driving its own rank.
type rank struct {
	cfg    Config
	b      backend.Backend
	groups *comm.Ranks
	w, g   *modelParams
	params []param
	// The flat stores behind w and g, and where each role lies.
	layout         *flatLayout
	wStore, gStore paramStore
	op             operandStore // the weights the model multiplies by
	// AdamW's moments, flat (nil on ranks that do not train): laid out
	// as the weights, or with ZeRO-1 (zero.go) this rank's pieces of the
	// replicated span, then the experts. adam is a step's AdamW calls:
	// which spans of the weights, and where their moments are.
	m, v  backend.Tensor
	adam  []adamPart
	biasE []backend.Tensor // per layer, nil when bias balancing is off
	// biasHost is biasE's values as the last moe.UpdateBias left them, per
	// layer (nil: not known on the host, read them from biasE).
	biasHost [][]float64
	// shards cuts the replicated span over the data-context group: the
	// pieces whose moments each rank keeps when zero is set (parallel.zero
	// 1 on a group of several ranks), and the order in which the
	// gradient norm sums the span's squares either way (zero.go).
	shards shardPlan
	zero   bool
	model  *model
	train  batchSource
	val    evalSource
	// grads is how the gradients are summed across ranks, overlapped with
	// the last backward of a step (grad_overlap.go); with syncGrads they
	// are summed after it instead, in gradBucket pieces
	// (reduceGradients: the tests compare the two).
	grads     gradPlan
	syncGrads bool
	// tp is the rank's tensor-parallel group and mode (not Enabled with
	// tp 1), tpRank its place in it.
	tp     *tensorpar.Parallel
	tpRank tpRank
	// With expertsInBackward the layers' backward updates their experts
	// (expert_update.go): expertTensors are the experts' spans of the
	// weight store per layer and tensor, expertGrads the one tensor's
	// gradient buffer they take in turn, expertMomentsAt the element of m
	// and v where the experts' moments begin, and experts the update of
	// the step in progress (nil between steps).
	expertsInBackward bool
	expertTensors     [][3]span
	expertGrads       backend.Tensor
	expertMomentsAt   int
	experts           *expertUpdate
	// split holds the halves of the product weights' masters where they
	// are split (master_split.go; hi nil otherwise): wStore.flat is then
	// the float32 norms and embedding alone.
	split splitWeights
}

// newRank builds a rank with initialised weights. A rank without training
// data (evaluation, sampling, gradient checks) gets no AdamW moments.
// When ctx ends while the weights are initialised it returns ErrStopped.
func newRank(ctx context.Context, cfg Config, b backend.Backend, groups *comm.Ranks, train batchSource, val evalSource) (*rank, error) {
	return newRankRounds(ctx, cfg, b, groups, train, val, gradBucket)
}

// newRankRounds is newRank with ZeRO-1's rounds of at most about
// roundElems elements (gradBucket; less in tests, for several rounds).
func newRankRounds(ctx context.Context, cfg Config, b backend.Backend, groups *comm.Ranks, train batchSource, val evalSource, roundElems int) (*rank, error) {
	m := cfg.Model
	// The expert group spans ep x tp ranks (experts folded over tp).
	localExperts := m.MoE.Experts / groups.Expert.Size()
	firstExpert := groups.Expert.Rank() * localExperts
	r := &rank{cfg: cfg, b: b, groups: groups, train: train, val: val}
	// parallel.tp_overlap is settled by now (resolveTPOverlap): auto and
	// "" are unfused here, for ranks built outside a run.
	r.tp = tensorpar.NewWith(b, groups.Tensor, tensorpar.Options{
		SequenceParallel: cfg.Parallel.SequenceParallel,
		Fused:            cfg.Parallel.TPOverlap == tune.TPOverlapFused,
		Deterministic:    cfg.Train.Deterministic,
	})
	if r.tp.Enabled() {
		r.tpRank = tpRank{n: r.tp.Size(), r: r.tp.Rank(), sp: r.tp.SequenceParallel()}
	} else {
		r.tpRank = noTP
	}
	r.layout = newFlatLayoutTP(m, localExperts, r.tpRank)
	r.shards = newShardPlan(groups.DataContext, r.layout.replicated, roundElems)
	r.zero = cfg.Parallel.Zero == 1 && train != nil && groups.DataContext.Size() > 1
	if r.zero {
		r.layout.padReplicated(r.shards.padded())
	}
	r.grads = newGradPlan(m, r.layout, groups)
	if r.zero {
		r.grads = r.grads.without(r.layout.replicated) // reduce-scattered after the backward
	}
	if g := groups.Tensor; g != nil && g.Size() > 1 && !r.layout.tpSummed.empty() {
		// Replicated over tp but computed on different rows: summed over
		// the tensor group after the backward, before anything reads them.
		r.grads.after = append(r.grads.after, gradPart{g: g, buckets: cutBuckets(m, r.layout, r.layout.tpSummed, gradBucket)})
	}
	if train != nil && cfg.SplitsMasters(b) {
		r.wStore, r.split = newSplitWeightStore(b, m, r.layout)
	} else {
		r.wStore = newParamStore(b, m, r.layout)
	}
	if r.expertsInBackward = train != nil && cfg.ExpertsUpdatedInBackward(); r.expertsInBackward {
		r.expertTensors = r.layout.expertTensors(m)
		r.gStore, r.expertGrads = newLayerExpertGradStore(b, m, r.layout)
	} else {
		r.gStore = newParamStore(b, m, r.layout)
	}
	r.w, r.g = r.wStore.p, r.gStore.p
	if ctx.Err() != nil {
		return nil, ErrStopped // between the large allocations too
	}
	if r.split.hi != nil {
		r.op = operandStore{p: r.w} // the products read the masters' bf16 halves
	} else {
		r.op = newOperandStore(b, m, r.layout, r.wStore)
	}
	var mp, vp *modelParams
	if train != nil {
		mp, vp = r.newMoments()
	}
	for i, s := range r.layout.slots {
		// A large model takes a while to initialise: a cancelled run stops
		// between two tensors.
		if ctx.Err() != nil {
			return nil, ErrStopped
		}
		p := param{slot: s, w: *s.pick(r.w), g: *s.pick(r.g), firstExpert: firstExpert,
			split: r.layout.split[i], global: slotShape(m, s)}
		if mp != nil {
			p.m, p.v = *s.pick(mp), *s.pick(vp)
		}
		if r.split.hi != nil && r.layout.offset[i] >= r.split.at {
			p.lo = r.split.loView(b, r.layout.offset[i], p.w.Len())
		}
		initParam(b, &p, cfg.Train.Seed, m.InitStd)
		r.params = append(r.params, p)
	}
	if m.MoE.BiasUpdateRate > 0 {
		for l := 0; l < m.Layers; l++ {
			r.biasE = append(r.biasE, b.New(b.FloatType(), m.MoE.Experts))
		}
		r.biasHost = make([][]float64, m.Layers)
	}
	var err error
	// The MoE load statistics are summed over every rank with distinct
	// tokens: data and context parallel, and tensor parallel too, since
	// the MoE layers take one tp rank's share of the rows.
	moeData := groups.DataContext
	if r.tp.Enabled() {
		moeData = groups.World
	}
	var updaters []moe.ExpertUpdater
	if r.expertsInBackward {
		for l := range m.Layers {
			updaters = append(updaters, layerExperts{r: r, layer: l})
		}
	}
	r.model, err = newModel(ctx, b, m, r.op.p, r.g, cfg.Train.MicroBatch, cfg.Train.Seq,
		moe.Groups{Expert: groups.Expert, Data: moeData}, groups.Context, attention.CPMode(cfg.Parallel.CPAttention), r.tp,
		cfg.Train.Recompute, r.writesExpertGrads(), updaters)
	if err != nil {
		return nil, err
	}
	return r, nil
}

// stepResult is one optimizer step, identical on every rank.
type stepResult struct {
	loss, auxLoss, zLoss float64
	gradNorm, lr         float64
	expertLoad           [][]float64 // [layer][expert] token assignments this step
	dropped              []int       // per layer
}

// writesExpertGrads says the backward writes the experts' gradients
// rather than adding to them (moe.OverwriteExpertGrads): every step runs
// one micro-batch on each rank, so nothing else adds to them in a step.
func (r *rank) writesExpertGrads() bool { return r.cfg.AccumSteps() == 1 }

// zeroGrads clears the gradients a step's backward adds to: the whole
// store, or where the backward writes the experts' (writesExpertGrads)
// all but their range, which it overwrites (the padding between their
// tensors is never written, so it stays zero).
func (r *rank) zeroGrads() {
	b, flat := r.b, r.gStore.flat
	if !r.writesExpertGrads() {
		b.Zero(flat)
		return
	}
	n := flat.Len() // the experts' range is past the store under optimizer_in_backward
	lo, hi := min(r.layout.experts.lo, n), min(r.layout.experts.hi, n)
	if lo > 0 {
		b.Zero(b.View(flat, 0, lo))
	}
	if hi < n {
		b.Zero(b.View(flat, hi, n-hi))
	}
}

// trainStep runs the micro-batches of one optimizer step, reduces the
// gradients across ranks, clips and applies AdamW.
func (r *rank) trainStep(step int) (stepResult, error) {
	b, cfg := r.b, r.cfg
	accum := cfg.AccumSteps()
	globalTokens := float64(cfg.Train.GlobalBatch * cfg.Train.Seq)
	res := stepResult{expertLoad: make([][]float64, cfg.Model.Layers), dropped: make([]int, cfg.Model.Layers)}
	for l := range res.expertLoad {
		res.expertLoad[l] = make([]float64, cfg.Model.MoE.Experts)
	}
	r.op.refresh(b) // the weights may have changed since the last forward: an optimizer step, a restore
	r.zeroGrads()
	res.lr = learningRate(cfg.Train, step)
	var experts *expertUpdate // the experts' AdamW, run by the layers' backward
	if r.expertsInBackward {
		experts = r.newExpertUpdate(step, res.lr)
		r.experts = experts
		defer func() {
			r.experts = nil
			experts.drain() // a step that fails before reading them
		}()
	}
	lossSum := 0.0
	var early *queuedSquares
	// Each micro-batch's loss sum and MoE statistics are queued behind its
	// backward and read after the last one's: one wait a step, and the
	// device goes from one micro-batch to the next without waiting for
	// the host. (moe.FinishStats completes each from the layers' token
	// count, which every micro-batch shares.)
	sts := make([]microStats, 0, accum)
	pending := make([]pendingStats, 0, accum)
	read := 0      // of pending
	defer func() { // a step that fails before reading them
		for _, p := range pending[read:] {
			p.drain()
		}
	}()
	for a := 0; a < accum; a++ {
		ids, targets, err := r.train.Next(cfg.Train.MicroBatch)
		if err != nil {
			return res, fmt.Errorf("training data: %w", err)
		}
		r.model.setBatch(ids, targets)
		st, err := r.model.forward(true, 1/globalTokens, 1/float64(accum), r.biasE)
		if err != nil {
			return res, err
		}
		// The last micro-batch's backward starts the gradients'
		// reduction as they become final; it is done before finishStats,
		// whose load statistics travel over the data group too.
		var red *gradReduction
		if a == accum-1 && !r.syncGrads {
			red = r.newGradReduction()
		}
		if err := r.model.backwardNotify(red.notify()); err != nil {
			return res, err
		}
		if err := red.finish(); err != nil {
			return res, err
		}
		if a == accum-1 && r.squaresFinalEarly() {
			// The gradients are final: their square sums are queued before
			// the host waits for the losses, one wait for all of them.
			early = r.queueSquares(experts)
			defer early.drain() // a step that fails before reading them
		}
		sts = append(sts, st)
		pending = append(pending, r.model.queueStats())
	}
	for i := range sts {
		st := &sts[i]
		err := r.model.finishStats(st, pending[i])
		read++
		if err != nil {
			return res, err
		}
		lossSum += st.lossSum
		for l, s := range st.moe {
			res.auxLoss += s.AuxLoss / float64(accum)
			res.zLoss += s.ZLoss / float64(accum)
			res.dropped[l] += s.Dropped
			for e, c := range s.TokensPerExpert {
				res.expertLoad[l][e] += c
			}
		}
	}
	// The loss sums have waited for the device, so this costs no wait: the
	// errors of the step's forward and backward surface here, before its
	// loss is trusted.
	if err := b.Sync(); err != nil {
		return res, err
	}
	// Every rank with distinct tokens (data and context parallel) holds a
	// part of the global batch's loss. With ZeRO-1 each holds the sums of
	// its pieces of the replicated gradients too, whose squares travel
	// with the loss.
	sums := []float64{lossSum}
	if r.zero {
		if err := r.reduceScatterGrads(); err != nil {
			return res, err
		}
		if r.tp.Enabled() {
			q, lay := r.shards.g.Rank(), r.layout
			sums = append(sums, r.shards.squaresWithin(b, r.gStore, q, span{0, lay.tpSharded.lo}),
				r.shards.squaresWithin(b, r.gStore, q, lay.tpSharded))
		} else {
			sums = append(sums, r.shards.squares(b, r.gStore, r.shards.g.Rank()))
		}
	}
	if err := r.groups.DataContext.AllReduceFloat64(sums); err != nil {
		return res, err
	}
	res.loss = sums[0] / globalTokens
	if math.IsNaN(res.loss) || math.IsInf(res.loss, 0) {
		return res, fmt.Errorf("step %d: the loss is %v; lower train.lr, set train.grad_clip (now %g) or check the data", step, res.loss, cfg.Train.GradClip)
	}
	if r.syncGrads {
		if err := r.reduceGradients(); err != nil {
			return res, err
		}
	}
	profile.Scope(r.b, profile.ScopeOptimizer)
	var replicated float64 // the replicated gradients' squares, summed over the span
	switch {
	case r.tp.Enabled():
		// The tp ranks' blocks differ: their squares are summed over the
		// tensor group, the rest (the same on every tp rank) counted once.
		var rest, blocks []float64
		if r.zero {
			rest, blocks = sums[1:2], sums[2:3]
		} else {
			rest = []float64{r.shards.allSquaresWithin(b, r.gStore, span{0, r.layout.tpSharded.lo})}
			blocks = []float64{r.shards.allSquaresWithin(b, r.gStore, r.layout.tpSharded)}
		}
		if err := r.groups.Tensor.AllReduceFloat64(blocks); err != nil {
			return res, err
		}
		replicated = rest[0] + blocks[0]
	case r.zero:
		replicated = sums[1]
	case early != nil:
		replicated = early.replicated()
	default:
		replicated = r.shards.allSquares(b, r.gStore)
	}
	var expertSquares float64
	switch {
	case early != nil && early.experts != nil:
		expertSquares = early.experts()
	case experts != nil:
		expertSquares = experts.sumSquares()
	case !r.layout.experts.empty():
		expertSquares = b.SumSquares(r.gStore.view(b, r.layout.experts))
	}
	norm, err := r.gradNorm(replicated, expertSquares)
	if err != nil {
		return res, err
	}
	res.gradNorm = norm
	// Clipping scales the gradients inside the AdamW pass.
	gradScale := 1.0
	if clip := cfg.Train.GradClip; clip > 0 && norm > clip {
		gradScale = clip / (norm + 1e-6)
	}
	t := cfg.Train
	// A few long AdamW calls: the norms (no weight decay) and the rest of
	// the flat stores; with ZeRO-1 only this rank's pieces of the
	// replicated span, whose updates the all-gather then hands to every
	// rank.
	for _, part := range r.adam {
		wd := 0.0
		if part.decay {
			wd = t.WeightDecay
		}
		n := part.r.hi - part.r.lo
		h := backend.AdamW{LR: res.lr, Beta1: t.Beta1, Beta2: t.Beta2, Eps: t.Eps, WeightDecay: wd, Step: step, GradScale: gradScale}
		r.adamW(part.r, r.gStore.view(b, part.r), b.View(r.m, part.at, n), b.View(r.v, part.at, n), h)
	}
	if r.zero {
		if err := r.gatherWeights(); err != nil {
			return res, err
		}
	}
	profile.Scope(r.b, "")
	for l, bias := range r.biasE {
		r.biasHost[l] = moe.UpdateBias(b, bias, r.biasHost[l], res.expertLoad[l], cfg.Model.MoE.BiasUpdateRate)
	}
	// No wait for the optimizer: the host reads and uploads the next batch
	// and queues its forward while the device runs AdamW. Its errors
	// surface at the next step's Sync, or at the checkpoint's or the run's
	// end (session.loop).
	return res, nil
}

// squaresFinalEarly reports whether the step's gradients are final once
// the last micro-batch's backward and its overlapped reduction are done:
// not where a reduction follows (syncGrads' reduceGradients, ZeRO-1's
// reduce-scatter, tensor parallelism's sums over the tensor group).
func (r *rank) squaresFinalEarly() bool {
	return !r.syncGrads && !r.zero && !r.tp.Enabled()
}

// queuedSquares are the square sums of the step's final gradients for the
// norm, queued by queueSquares: the replicated span's, added as
// shardPlan.allSquares adds them, and the experts' (nil where the experts'
// update in the backward has queued its own). Each reads its reductions
// once (sync.OnceValue), however often it is called.
type queuedSquares struct {
	replicated, experts func() float64
}

// queueSquares queues the square sums the step's gradient norm needs.
func (r *rank) queueSquares(experts *expertUpdate) *queuedSquares {
	q := &queuedSquares{replicated: sync.OnceValue(r.shards.allSquaresLater(r.b, r.gStore))}
	if experts == nil && !r.layout.experts.empty() {
		q.experts = sync.OnceValue(backend.SumSquaresLater(r.b, r.gStore.view(r.b, r.layout.experts)))
	}
	return q
}

// drain reads what a failed step left unread, which frees the
// reductions' device buffers.
func (q *queuedSquares) drain() {
	q.replicated()
	if q.experts != nil {
		q.experts()
	}
}

// reduceGradients sums gradients over the ranks that share each parameter
// and hold distinct tokens: replicated weights over the data and context
// groups together, expert weights over the ranks that hold the same experts
// (the expert replicas, then the context group: a cp rank's tokens reach
// the experts of its own cp position only). It runs after the backward,
// with syncGrads; otherwise the same sums overlap the backward
// (grad_overlap.go). With ZeRO-1 the replicated span is reduce-scattered
// instead (reduceScatterGrads).
func (r *rank) reduceGradients() error {
	for _, part := range []struct {
		r span
		g comm.Group
	}{
		{r.layout.replicated, r.groups.DataContext},
		{r.layout.experts, r.groups.ExpertReplica},
		{r.layout.experts, r.groups.Context},
		{r.layout.tpSummed, r.groups.Tensor},
	} {
		if part.g == nil || part.g.Size() == 1 || part.r.empty() || r.zero && part.r == r.layout.replicated {
			continue
		}
		for lo := part.r.lo; lo < part.r.hi; lo += gradBucket {
			bucket := span{lo, min(lo+gradBucket, part.r.hi)}
			if err := part.g.AllReduceSum(r.gStore.view(r.b, bucket)); err != nil {
				return err
			}
		}
	}
	return nil
}

// gradBucket is the most gradient elements one all-reduce sums (64 MiB of
// float32): the communicators' scratch memory grows with the call, not with
// the model, and a bucket's reduction starts before the backward is done.
const gradBucket = 16 << 20

// gradNorm is the global L2 norm of the reduced gradients, given the sum
// of the squares of the replicated ones (counted once: shardPlan's
// squares) and of the rank's experts: those summed over the expert group
// (after the reduction every data and context rank holds the same sums).
func (r *rank) gradNorm(replicated, expertSquares float64) (float64, error) {
	experts := []float64{expertSquares}
	if err := r.groups.Expert.AllReduceFloat64(experts); err != nil {
		return 0, err
	}
	return math.Sqrt(replicated + experts[0]), nil
}

// evaluate returns the mean validation loss over eval_batches micro-batches
// of every data rank (each split over its context-parallel ranks). Before
// each batch the ranks vote on ctx through vote as the training loop does
// (session.votes), so a stop ends a long validation between two batches
// with ErrStopped, on every rank at the same batch.
func (r *rank) evaluate(ctx context.Context, vote stopVoter) (float64, error) {
	cfg := r.cfg
	r.op.refresh(r.b)
	r.val.Reset()
	sum := 0.0
	for i := 0; i < cfg.Train.EvalBatches; i++ {
		stop := []float64{0}
		if ctx.Err() != nil {
			stop[0] = 1
		}
		if err := vote.AllReduceFloat64(stop); err != nil {
			return 0, err
		}
		if stop[0] > 0 {
			return 0, ErrStopped
		}
		ids, targets, err := r.val.Next(cfg.Train.MicroBatch)
		if err != nil {
			return 0, fmt.Errorf("validation data: %w", err)
		}
		r.model.setBatch(ids, targets)
		st, err := r.model.forward(false, 0, 0, r.biasE)
		if err != nil {
			return 0, err
		}
		sum += st.lossSum
	}
	sums := []float64{sum}
	if err := r.groups.DataContext.AllReduceFloat64(sums); err != nil {
		return 0, err
	}
	if err := r.b.Sync(); err != nil { // the loss sums have waited: no wait
		return 0, err
	}
	tokens := cfg.Train.EvalBatches * cfg.Train.MicroBatch * cfg.Train.Seq * r.groups.Data.Size()
	return sums[0] / float64(tokens), nil
}
