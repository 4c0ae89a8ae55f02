package engine

import (
	"context"
	"fmt"
	"slices"

	"github.com/mktrain/mktrain/attention"
	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/profile"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
	"github.com/mktrain/mktrain/tensorpar"
	"github.com/mktrain/mktrain/tune"
)

// model is one rank's replica of the decoder with the activations of one
// micro-batch of batch sequences of seq tokens. Under context parallelism
// the rank holds tokens = batch*seq/cp of them: per sequence, the positions
// attention.ZigzagPositions gives its cp rank. Forward saves what Backward
// needs, as in llm.c: there is no autograd.
type model struct {
	cfg        ModelConfig
	b          backend.Backend
	batch, seq int
	tokens     int     // local tokens T of a micro-batch
	keep       []int32 // cp > 1: the row of the full batch each local row holds; nil otherwise
	w, g       *modelParams
	attn       []*attention.Layer
	moe        []*moe.Layer

	// Inputs of the micro-batch: local tokens, targets and their positions
	// in their sequences.
	idsT, targetsT, posT backend.Tensor

	// Saved activations, per layer l: residL[l] is the residual stream
	// entering layer l (residL[Layers] leaves the last one), midL[l] the
	// stream after attention, rstd1L/rstd2L the inverse RMS of the
	// normalised inputs of attention and MoE.
	residL, midL        []backend.Tensor
	rstd1L, rstd2L      []backend.Tensor
	finalTD, rstdFinalT backend.Tensor
	// The normalised inputs of attention (h1L) and MoE (h2L) per layer,
	// which the blocks' Backward reads by reference. Keeping them costs two
	// [T, D] tensors a layer; making them again in backward cost about 1%
	// of moe-small's step on an H200. Under train.recompute: full every
	// layer's entries are the same two tensors, refilled by reforward.
	// They and finalTD are of normType.
	h1L, h2L []backend.Tensor
	// normType is the type of the normalised inputs, which only products
	// and row gathers read (attention's projections, the router, the
	// experts' dispatch, the LM head): the backend's operand type, so that
	// the norm writes them rounded once and the products read them as
	// they are, without tensor parallelism, whose collectives gather them
	// in the float type first.
	normType backend.DType

	// full is train.recompute: full: the layers keep their activations
	// in the shared scratch (attention.RecomputeLayer,
	// moe.RecomputeLayer) and backwardNotify reruns each layer's forward
	// (reforward) right before its backward. biasE is the last training
	// forward's MoE selection biases, which the rerun routes with again.
	full  bool
	biasE []backend.Tensor

	// Scratch: the gradient streams.
	dResidTD, dBlockTD backend.Tensor
	dFinalTD           backend.Tensor
	// LM head in chunks of rows, so [T, V] logits never exist whole.
	logitsCV, lossT backend.Tensor
	moeStats        backend.Tensor // [Layers*moe.StatsLen(E)]: each MoE layer's statistics (moe.WithStats)
	// dlogitsCV is the logits' gradient rounded once to the operand type
	// for the head's two backward products; nil where that is the float
	// type.
	dlogitsCV backend.Tensor
	chunkRows int

	// Tensor parallelism (tp Enabled; see the package doc of tensorpar):
	// the residual stream holds rows of the T tokens: this rank's T/tp
	// under sequence parallelism, all T otherwise (rows = T without tp).
	// The MoE layers take this rank's share of the T rows either way;
	// the LM head holds the vocabulary ids [vocabLo, vocabLo+V/tp).
	tp      *tensorpar.Parallel
	rows    int
	vocabLo int
	// finalFullTD and dFullTD are the final hidden states gathered over
	// tp and their gradient's partial sums (sequence parallelism; the
	// latter is dFinalTD itself without it); lseC, lseRC and targetC the
	// sharded cross-entropy's per-slice log-sum-exps, all slices' and
	// the target logits of one chunk.
	finalFullTD, dFullTD backend.Tensor
	lseC, lseRC, targetC backend.Tensor
}

// lmHeadChunkRows bounds the logits buffer of the fused LM head and loss.
const lmHeadChunkRows = 2048

// newModel builds a rank's model for micro-batches of batch sequences of
// seq tokens. w are the weights it reads (a rank's operandStore: bf16
// copies of the matrices on the GPU), g the gradients it accumulates into.
// groups are the MoE layers' (Data: every rank with distinct
// tokens); context is the context-parallel group the sequences are split
// over, nil for none, and cpMode how its attention reaches the other
// ranks' keys and values (parallel.cp_attention, settled).
//
// tp is the tensor-parallel group and mode (nil, or not Enabled, for
// none): w and g then hold this rank's blocks of the split matrices.
// recompute is train.recompute: under selective the layers keep their
// attention core's output and their experts' hidden activations once, in
// the shared scratch, and remake them in Backward; under full they keep
// all their activations there, and backward reruns each layer's forward
// from its kept input (residL, midL) before its backward; none or ""
// keeps every layer's. writeExpertGrads says every step runs one
// micro-batch: the backward writes the experts' gradients rather than
// adding to them (moe.OverwriteExpertGrads), and the step need not zero
// them. updaters, one per layer or nil, update the experts in the
// backward (moe.UpdateExpertsInBackward), which then writes no expert
// gradients into g.
func newModel(ctx context.Context, b backend.Backend, cfg ModelConfig, w, g *modelParams, batch, seq int, groups moe.Groups, context comm.Group, cpMode attention.CPMode, tp *tensorpar.Parallel, recompute string, writeExpertGrads bool, updaters []moe.ExpertUpdater) (*model, error) {
	cp, cpRank := 1, 0
	if context != nil {
		cp, cpRank = context.Size(), context.Rank()
	}
	local, err := attention.ZigzagPositions(seq, cp, cpRank)
	if err != nil {
		return nil, err
	}
	T, D, ft := batch*len(local), cfg.Dim, b.FloatType()
	m := &model{cfg: cfg, b: b, batch: batch, seq: seq, tokens: T, w: w, g: g, tp: tp, rows: T, full: recompute == RecomputeFull}
	moeTokens, V := T, cfg.Vocab
	if tp.Enabled() {
		n := tp.Size()
		if T%n != 0 || cfg.Vocab%n != 0 {
			return nil, fmt.Errorf("tensor parallelism over %d ranks: %d rows of a micro-batch and model.vocab %d must divide by it", n, T, cfg.Vocab)
		}
		m.rows, moeTokens = tp.Rows(T), T/n
		V = cfg.Vocab / n
		m.vocabLo = tp.Rank() * V
	}
	m.idsT, m.targetsT, m.posT = b.New(backend.Int32, T), b.New(backend.Int32, T), b.New(backend.Int32, T)
	pos := make([]int32, 0, T)
	for bi := range batch {
		pos = append(pos, local...)
		if cp > 1 {
			for _, p := range local {
				m.keep = append(m.keep, int32(bi*seq)+p)
			}
		}
	}
	backend.UploadSlice(b, m.posT, pos)
	L := cfg.Layers
	// The attention and MoE layers run one after another, so they share
	// their working memory.
	moeScratch := moe.NewScratch(b, D, cfg.MoE.FFN)
	// Every MoE layer's load statistics in one buffer, read with one
	// download per micro-batch (queueStats).
	E1 := moe.StatsLen(cfg.MoE.Experts)
	m.moeStats = b.New(ft, cfg.Layers*E1)
	attnScratch := attention.NewScratch()
	R := m.rows
	for l := 0; l <= L; l++ {
		m.residL = append(m.residL, b.New(ft, R, D))
	}
	m.normType = b.OperandType()
	if tp.Enabled() {
		m.normType = ft
	}
	for l := range cfg.Layers {
		if m.full && l > 0 {
			m.h1L, m.h2L = append(m.h1L, m.h1L[0]), append(m.h2L, m.h2L[0])
			continue
		}
		m.h1L, m.h2L = append(m.h1L, b.New(m.normType, R, D)), append(m.h2L, b.New(m.normType, R, D))
	}
	attnOpts := []attention.Option{attention.WithScratch(attnScratch), attention.AddToOutput(), attention.WithTensorParallel(tp)}
	moeOpts := []moe.Option{moe.WithScratch(moeScratch), moe.AddToOutput()}
	if writeExpertGrads {
		moeOpts = append(moeOpts, moe.OverwriteExpertGrads())
	}
	switch recompute {
	case RecomputeSelective:
		attnOpts = append(attnOpts, attention.RecomputeCore())
		moeOpts = append(moeOpts, moe.RecomputeExperts())
	case RecomputeFull:
		attnOpts = append(attnOpts, attention.RecomputeLayer())
		moeOpts = append(moeOpts, moe.RecomputeLayer())
	}
	for l := 0; l < L; l++ {
		if ctx.Err() != nil {
			return nil, ErrStopped // a cancelled run stops between two layers
		}
		m.midL = append(m.midL, b.New(ft, R, D))
		m.rstd1L = append(m.rstd1L, b.New(ft, R))
		m.rstd2L = append(m.rstd2L, b.New(ft, R))
		var attn *attention.Layer
		if cp > 1 {
			attn, err = attention.NewContextParallel(b, attentionShape(cfg), batch, seq, context, append(attnOpts, attention.WithContextMode(cpMode))...)
			if err != nil {
				return nil, fmt.Errorf("layer %d: %w", l, err)
			}
		} else if tp.Enabled() {
			attn, err = attention.NewTensorParallel(b, attentionShape(cfg), batch, seq, attnOpts...)
			if err != nil {
				return nil, fmt.Errorf("layer %d: %w", l, err)
			}
		} else {
			attn = attention.New(b, attentionShape(cfg), batch, seq, attnOpts...)
		}
		m.attn = append(m.attn, attn)
		opts := append(slices.Clip(moeOpts), moe.WithStats(b.View(m.moeStats, l*E1, E1)))
		if updaters != nil {
			opts = append(opts, moe.UpdateExpertsInBackward(updaters[l]))
		}
		layer, err := moe.New(b, cfg.MoE, D, moeTokens, groups, opts...)
		if err != nil {
			return nil, fmt.Errorf("layer %d: %w", l, err)
		}
		m.moe = append(m.moe, layer)
	}
	m.finalTD, m.rstdFinalT = b.New(m.normType, R, D), b.New(ft, R)
	m.dResidTD, m.dBlockTD = b.New(ft, R, D), b.New(ft, R, D)
	m.dFinalTD = b.New(ft, R, D)
	m.chunkRows = min(T, lmHeadChunkRows)
	m.logitsCV, m.lossT = b.New(ft, m.chunkRows, V), b.New(ft, T)
	if ot := b.OperandType(); ot != ft {
		m.dlogitsCV = b.New(ot, m.chunkRows, V)
	}
	if tp.Enabled() {
		m.dFullTD = m.dFinalTD
		if tp.SequenceParallel() {
			m.finalFullTD, m.dFullTD = b.New(ft, T, D), b.New(ft, T, D)
		}
		m.lseC, m.targetC = b.New(ft, m.chunkRows), b.New(ft, m.chunkRows)
		m.lseRC = b.New(ft, tp.Size()*m.chunkRows)
	}
	return m, nil
}

// streamIDs is the token ids of the residual stream's rows: all of them,
// or this rank's block under sequence parallelism.
func (m *model) streamIDs() backend.Tensor {
	if m.rows == m.tokens {
		return m.idsT
	}
	return m.b.View(m.idsT, m.tp.Rank()*m.rows, m.rows)
}

// moeRows is the rows of a [rows, D] stream tensor the MoE layers take:
// all of them, or without sequence parallelism this rank's share of the
// replicated rows (gathered back after the layer, allGatherRows).
func (m *model) moeRows(t backend.Tensor) backend.Tensor {
	if !m.tp.Enabled() || m.tp.SequenceParallel() {
		return t
	}
	D, n := m.cfg.Dim, m.tokens/m.tp.Size()
	return m.b.View(t, m.tp.Rank()*n*D, n, D)
}

// allGatherRows hands every tp rank's share of t's rows (moeRows) to the
// others, in place; nothing to do where the MoE took all of t.
func (m *model) allGatherRows(t backend.Tensor) error {
	if !m.tp.Enabled() || m.tp.SequenceParallel() {
		return nil
	}
	return m.tp.Group().AllGather(t, m.moeRows(t))
}

// resolveDispatcher settles model.moe.dispatcher for the ranks of world
// (tune.ResolveDispatcher: auto is the faster dispatcher for this machine
// and layer shape, from a measured table) and returns cfg with the value.
// It runs once per run, before any rank builds its layers, since every
// rank must use the same dispatcher. The fused dispatcher needs the expert
// groups to offer peer access (comm.PeerAccess): virtual ranks do, and so
// do ranks on the GPUs of one process under an explicit fused (see
// placeOnDevices); ranks in separate processes (NCCL across nodes, TCP) do
// not yet.
func (e *Engine) resolveDispatcher(cfg Config, world []*comm.Ranks) (Config, error) {
	canPeer := true
	for _, r := range world {
		if _, ok := r.Expert.(comm.PeerAccess); !ok {
			canPeer = false
		}
	}
	// auto picks by timing, which can differ from run to run: a run that
	// must repeat bit for bit takes the unfused dispatcher.
	if m := cfg.Model.MoE.Dispatcher; cfg.Train.Deterministic && (m == moe.DispatcherAuto || m == "") {
		e.log.Info().Msg("model.moe.dispatcher auto: unfused, unmeasured, as train.deterministic asks")
		cfg.Model.MoE.Dispatcher = moe.DispatcherUnfused
		return cfg, nil
	}
	// The layer's shape on one rank: its local tokens per micro-batch.
	tokens := cfg.Train.MicroBatch * cfg.Train.Seq / cfg.Parallel.CP / cfg.Parallel.TP
	d, err := tune.ResolveDispatcher(e.backend, cfg.Model.MoE, cfg.Model.Dim, tokens, cfg.Parallel.EP, canPeer,
		func(msg string) { e.log.Info().Msg(msg) })
	if err != nil {
		return cfg, err
	}
	cfg.Model.MoE.Dispatcher = d
	return cfg, nil
}

// resolveCPAttention settles parallel.cp_attention for the run
// (tune.ResolveCPAttention: auto is the faster mode for this machine and
// shape, measured on virtual ranks and kept in a table, or allgather by
// rule on the CPU, with a rank per GPU or node and under
// train.deterministic) and returns cfg with the value. Like the dispatcher
// it runs once per run, before any rank builds its layers; oneDevice says
// the ranks are virtual ranks of the engine's one device.
func (e *Engine) resolveCPAttention(cfg Config, oneDevice bool) (Config, error) {
	mode, err := tune.ResolveCPAttention(e.backend, tune.CPAttentionCase{
		Mode: cfg.Parallel.CPAttention, Shape: rankAttentionShape(cfg),
		Batch: cfg.Train.MicroBatch, Seq: cfg.Train.Seq, CP: cfg.Parallel.CP,
		OneDevice: oneDevice, Deterministic: cfg.Train.Deterministic,
	}, func(msg string) { e.log.Info().Msg(msg) })
	if err != nil {
		return cfg, err
	}
	cfg.Parallel.CPAttention = mode
	return cfg, nil
}

// resolveTPOverlap settles parallel.tp_overlap for the run
// (tune.ResolveTPOverlap: auto is the faster path for this machine and
// shape, measured on virtual ranks and kept in a table, or unfused by
// rule with tp 1, on the CPU, with a rank per GPU or node and under
// train.deterministic) and returns cfg with the value. Like the
// dispatcher it runs once per run, before any rank builds its layers;
// oneDevice says the ranks are virtual ranks of the engine's one device.
func (e *Engine) resolveTPOverlap(cfg Config, oneDevice bool) (Config, error) {
	mode, err := tune.ResolveTPOverlap(e.backend, tpOverlapCase(cfg, oneDevice), func(msg string) { e.log.Info().Msg(msg) })
	if err != nil {
		return cfg, err
	}
	cfg.Parallel.TPOverlap = mode
	return cfg, nil
}

// tpOverlapCase is what parallel.tp_overlap is settled for: the model's
// attention over the rows a tensor group shares, micro_batch*seq/cp.
func tpOverlapCase(cfg Config, oneDevice bool) tune.TPOverlapCase {
	p := cfg.Parallel
	return tune.TPOverlapCase{
		Mode: p.TPOverlap, Shape: attentionShape(cfg.Model), Rows: cfg.Train.MicroBatch * cfg.Train.Seq / p.CP, TP: p.TP,
		SequenceParallel: p.SequenceParallel, OneDevice: oneDevice, Deterministic: cfg.Train.Deterministic,
	}
}

// logTPPaths says which path the tensor-parallel groups of ranks run
// (tensorpar.Parallel.Fused): the backend's fused ops or the collectives
// around the products, and when fused was asked for but a group offers
// no peer access (ranks in separate processes, or GPUs without it), that
// it fell back. One line for all of this process's ranks.
func (e *Engine) logTPPaths(cfg Config, ranks []*rank) {
	if cfg.Parallel.TP < 2 {
		return
	}
	fused := 0
	for _, r := range ranks {
		if r.tp.Fused() {
			fused++
		}
	}
	switch {
	case cfg.Parallel.TPOverlap != tune.TPOverlapFused:
		e.log.Info().Msgf("parallel: tensor parallelism runs unfused: the collectives around the products (parallel.tp_overlap %s)", cfg.Parallel.TPOverlap)
	case fused == len(ranks):
		e.log.Info().Msgf("parallel: tensor parallelism runs fused: the backend's fused ops over the tp groups' peer access (%d ranks)", fused)
	case fused == 0:
		e.log.Warn().Msg("parallel: parallel.tp_overlap is fused, but the tp groups offer no peer access (ranks in separate processes, or devices without it): they fall back to the unfused collectives")
	default:
		e.log.Warn().Msgf("parallel: parallel.tp_overlap is fused, but the tp groups of %d of %d ranks offer no peer access: those fall back to the unfused collectives", len(ranks)-fused, len(ranks))
	}
}

// servingConfig is the configuration a loaded model (evaluation and
// sampling, one rank) builds its layers with: model.moe.dispatcher as
// saved when it names a dispatcher, and unfused for auto; one rank
// exchanges nothing, so a measurement would not pay for itself. The same
// goes for parallel.tp_overlap.
func servingConfig(cfg Config) Config {
	if cfg.Model.MoE.Dispatcher != moe.DispatcherFused {
		cfg.Model.MoE.Dispatcher = moe.DispatcherUnfused
	}
	if cfg.Parallel.TPOverlap != tune.TPOverlapFused {
		cfg.Parallel.TPOverlap = tune.TPOverlapUnfused
	}
	return cfg
}

// setBatch uploads one micro-batch of token ids and next-token targets,
// batch whole sequences of each; a context-parallel rank keeps its share of
// every sequence (see keep).
func (m *model) setBatch(ids, targets []int32) {
	if m.keep != nil {
		localIDs, localTargets := make([]int32, len(m.keep)), make([]int32, len(m.keep))
		for i, row := range m.keep {
			localIDs[i], localTargets[i] = ids[row], targets[row]
		}
		ids, targets = localIDs, localTargets
	}
	backend.UploadSlice(m.b, m.idsT, ids)
	backend.UploadSlice(m.b, m.targetsT, targets)
}

// microStats is what one forward reports: the summed token losses of this
// rank and the MoE statistics of every layer (global over the ranks with
// distinct tokens).
type microStats struct {
	lossSum float64
	moe     []moe.Stats
}

// forward runs the model on the uploaded batch. When train is set it also
// runs the LM head's backward (fused with the loss, chunk by chunk) with
// gradScale, leaving dFinalTD for backward, and leaves the loss sum and the
// MoE losses of its microStats to queueStats and finishStats, to be read
// once the backward is queued (the host reading them here would leave the
// GPU idle between forward and backward); lossScale weighs the MoE
// auxiliary losses' gradients. Without train it reads them itself
// (finishStep).
func (m *model) forward(train bool, gradScale, lossScale float64, biasE []backend.Tensor) (microStats, error) {
	b, w := m.b, m.w
	st := microStats{moe: make([]moe.Stats, m.cfg.Layers)}
	if train {
		m.biasE = biasE
	}
	// Scopes tell a profiler (package backend/profile) what the ops are
	// part of; on any other backend profile.Scope does nothing.
	profile.Scope(b, "")
	b.EmbeddingForward(m.residL[0], w.embedVD, m.streamIDs())
	for l := 0; l < m.cfg.Layers; l++ {
		lw := &w.layers[l]
		// The blocks add their outputs onto a copy of the stream
		// (AddToOutput), which each norm writes as it reads the stream:
		// midL[l] = residL[l] + attn(...), residL[l+1] = midL[l] + moe(...).
		b.RMSNormForward(m.h1L[l], m.rstd1L[l], m.midL[l], m.residL[l], lw.attnNormD, m.cfg.NormEps)
		profile.Scope(b, profile.ScopeAttention)
		err := m.attn[l].Forward(m.midL[l], m.h1L[l], m.posT, lw.attn)
		profile.Scope(b, "")
		if err != nil {
			return st, fmt.Errorf("layer %d attention: %w", l, err)
		}

		b.RMSNormForward(m.h2L[l], m.rstd2L[l], m.residL[l+1], m.midL[l], lw.ffnNormD, m.cfg.NormEps)
		var bias backend.Tensor
		if biasE != nil {
			bias = biasE[l]
		}
		profile.Scope(b, profile.ScopeMoE)
		s, err := m.moe[l].Forward(m.moeRows(m.residL[l+1]), m.moeRows(m.h2L[l]), lw.moe, bias, lossScale)
		if err == nil {
			err = m.allGatherRows(m.residL[l+1])
		}
		profile.Scope(b, "")
		if err != nil {
			return st, fmt.Errorf("layer %d MoE: %w", l, err)
		}
		st.moe[l] = s
	}
	L := m.cfg.Layers
	b.RMSNormForward(m.finalTD, m.rstdFinalT, nil, m.residL[L], w.finalNormD, m.cfg.NormEps)
	profile.Scope(b, profile.ScopeHead)
	if err := m.lmHeadLoss(train, gradScale); err != nil {
		return st, fmt.Errorf("LM head: %w", err)
	}
	if !train {
		if err := m.finishStep(&st); err != nil {
			return st, err
		}
	}
	profile.Scope(b, "")
	return st, nil
}

// lmHeadLoss computes logits, per-token losses and, when training, the
// gradients of the final hidden states and the LM head, chunk by chunk.
func (m *model) lmHeadLoss(train bool, gradScale float64) error {
	if m.tp.Enabled() {
		return m.lmHeadLossTP(train, gradScale)
	}
	b := m.b
	T, D, V := m.tokens, m.cfg.Dim, m.cfg.Vocab
	if !train {
		gradScale = 0
	}
	for r0 := 0; r0 < T; r0 += m.chunkRows {
		rows := min(m.chunkRows, T-r0)
		logits := b.View(m.logitsCV, 0, rows, V)
		hCD := b.View(m.finalTD, r0*D, rows, D)
		b.MatMul(logits, hCD, m.w.lmHeadVD, false, true, 1, 0)
		// The gradient goes in place, or where the products read another
		// type straight into their operand.
		dlogits := logits
		if train && m.dlogitsCV != nil {
			dlogits = b.View(m.dlogitsCV, 0, rows, V)
		}
		b.CrossEntropy(b.View(m.lossT, r0, rows), dlogits, logits, b.View(m.targetsT, r0, rows), gradScale)
		if train {
			b.MatMul(b.View(m.dFinalTD, r0*D, rows, D), dlogits, m.w.lmHeadVD, false, false, 1, 0)
			b.MatMul(m.g.lmHeadVD, dlogits, hCD, true, false, 1, 1)
		}
	}
	return nil
}

// lmHeadLossTP is lmHeadLoss with the vocabulary split over the tp ranks:
// each multiplies the final hidden states of all T rows (gathered under
// sequence parallelism) by its block of the LM head, and the sharded
// cross-entropy joins the slices' log-sum-exps (all-gathered) and the
// target logits (all-reduced), chunk by chunk. Every rank ends with the
// loss of every row; the hidden states' gradient, a partial sum per
// rank, is reduce-scattered (or all-reduced) into dFinalTD.
func (m *model) lmHeadLossTP(train bool, gradScale float64) error {
	b, tp, g := m.b, m.tp, m.tp.Group()
	T, D, V, n := m.tokens, m.cfg.Dim, m.cfg.Vocab/m.tp.Size(), m.tp.Size()
	if !train {
		gradScale = 0
	}
	h, err := tp.GatherRows(m.finalFullTD, m.finalTD)
	if err != nil {
		return err
	}
	for r0 := 0; r0 < T; r0 += m.chunkRows {
		rows := min(m.chunkRows, T-r0)
		logits := b.View(m.logitsCV, 0, rows, V)
		hCD := b.View(h, r0*D, rows, D)
		targets := b.View(m.targetsT, r0, rows)
		lse, target, lseR := b.View(m.lseC, 0, rows), b.View(m.targetC, 0, rows), b.View(m.lseRC, 0, n, rows)
		b.MatMul(logits, hCD, m.w.lmHeadVD, false, true, 1, 0)
		b.CrossEntropyShard(lse, target, logits, targets, m.vocabLo)
		if err := g.AllGather(lseR, lse); err != nil {
			return err
		}
		if err := g.AllReduceSum(target); err != nil {
			return err
		}
		b.CrossEntropyShardFinish(b.View(m.lossT, r0, rows), logits, logits, lseR, target, targets, m.vocabLo, gradScale)
		if train {
			dlogits := logits
			if m.dlogitsCV != nil {
				dlogits = b.View(m.dlogitsCV, 0, rows, V)
				b.Copy(dlogits, logits)
			}
			b.MatMul(b.View(m.dFullTD, r0*D, rows, D), dlogits, m.w.lmHeadVD, false, false, 1, 0)
			b.MatMul(m.g.lmHeadVD, dlogits, hCD, true, false, 1, 1)
		}
	}
	if !train {
		return nil
	}
	// The products are in; what is left of the column-parallel backward
	// is its collective.
	return tp.ColumnBackward(m.dFinalTD, m.dFullTD, nil)
}

// reforward reruns layer l's forward from its kept input residL[l]
// (train.recompute: full), as forward ran it, so that the shared h1L and
// h2L, the attention layer and the MoE layer hold layer l's activations
// again for its backward; rstd1L[l] and rstd2L[l] get the same values
// again. The blocks' outputs go to dBlockTD, free until the MoE backward
// writes it, one after the other, not to midL[l] and residL[l+1], which stay
// as the forward left them: the MoE layer reads the kept midL[l]. The
// MoE rerun (moe.Layer.Reforward) redoes none of the statistics or
// losses, and without sequence parallelism its output's rows need no
// gathering, as nothing reads them.
func (m *model) reforward(l int) error {
	b, lw := m.b, &m.w.layers[l]
	defer profile.Scope(b, "")
	b.RMSNormForward(m.h1L[l], m.rstd1L[l], m.dBlockTD, m.residL[l], lw.attnNormD, m.cfg.NormEps)
	profile.Scope(b, profile.ScopeAttention)
	if err := m.attn[l].Forward(m.dBlockTD, m.h1L[l], m.posT, lw.attn); err != nil {
		return fmt.Errorf("layer %d attention recompute: %w", l, err)
	}
	profile.Scope(b, "")
	b.RMSNormForward(m.h2L[l], m.rstd2L[l], m.dBlockTD, m.midL[l], lw.ffnNormD, m.cfg.NormEps)
	var bias backend.Tensor
	if m.biasE != nil {
		bias = m.biasE[l]
	}
	profile.Scope(b, profile.ScopeMoE)
	if err := m.moe[l].Reforward(m.moeRows(m.dBlockTD), m.moeRows(m.h2L[l]), lw.moe, bias); err != nil {
		return fmt.Errorf("layer %d MoE recompute: %w", l, err)
	}
	return nil
}

// pendingStats is what a forward left on the device, on its way to the
// host (model.queueStats): the summed token losses and the MoE layers'
// statistics. Each function must be called once.
type pendingStats struct {
	loss  func() float64
	stats func() []float64
}

// queueStats queues the reads of the last forward's loss sum and MoE
// statistics, each taken as the queue reaches it, so the next
// micro-batch's forward may overwrite their tensors at once.
func (m *model) queueStats() pendingStats {
	profile.Scope(m.b, profile.ScopeMoE)
	stats := backend.StartDownloadFloat64(m.b, m.moeStats)
	profile.Scope(m.b, profile.ScopeHead) // the loss sum is the loss's work
	loss := backend.SumLater(m.b, m.lossT)
	profile.Scope(m.b, "")
	return pendingStats{loss: loss, stats: stats}
}

// finishStats fills st in from p, waiting for the device once (the loss
// sum is queued after the statistics' copy), and sums the MoE statistics
// over the data group (moe.FinishStats, a collective).
func (m *model) finishStats(st *microStats, p pendingStats) error {
	st.lossSum = p.loss()
	return moe.FinishStats(m.moe, st.moe, p.stats())
}

// drain reads what a failed step left unread, which frees the reads'
// device buffers.
func (p pendingStats) drain() {
	p.loss()
	p.stats()
}

// finishStep is queueStats then finishStats: one forward's reads, waited
// for now.
func (m *model) finishStep(st *microStats) error {
	return m.finishStats(st, m.queueStats())
}

// backward propagates from dFinalTD (left by a training forward) to every
// parameter gradient, accumulating into m.g.
func (m *model) backward() error { return m.backwardNotify(nil) }

// backwardNotify is backward telling ready, when not nil, as the gradients
// become final (for the gradient reduction that overlaps it,
// grad_overlap.go): ready(Layers) once the final norm's are (the LM head's
// are since the forward), ready(l) once layer l's are, ready(-1) once the
// embedding's are. An error from ready ends the backward with it.
func (m *model) backwardNotify(ready func(layer int) error) error {
	b, w, g := m.b, m.w, m.g
	L := m.cfg.Layers
	notify := func(layer int) error {
		if ready == nil {
			return nil
		}
		return ready(layer)
	}
	profile.Scope(b, "")
	b.RMSNormBackward(m.dResidTD, g.finalNormD, m.dFinalTD, m.residL[L], w.finalNormD, m.rstdFinalT, 0)
	if err := notify(L); err != nil {
		return err
	}
	for l := L - 1; l >= 0; l-- {
		lw, lg := &w.layers[l], &g.layers[l]
		if m.full {
			if err := m.reforward(l); err != nil {
				return err
			}
		}
		// residL[l+1] = midL[l] + moe(norm(midL[l])): the stream's gradient
		// flows straight through and through the MoE block.
		profile.Scope(b, profile.ScopeMoE)
		err := m.moe[l].Backward(m.moeRows(m.dBlockTD), m.moeRows(m.dResidTD), lw.moe, lg.moe)
		if err == nil {
			err = m.allGatherRows(m.dBlockTD)
		}
		profile.Scope(b, "")
		if err != nil {
			return fmt.Errorf("layer %d MoE backward: %w", l, err)
		}
		// The stream's gradient gets the norm's share in the same pass.
		b.RMSNormBackward(m.dResidTD, lg.ffnNormD, m.dBlockTD, m.midL[l], lw.ffnNormD, m.rstd2L[l], 1)
		// midL[l] = residL[l] + attn(norm(residL[l])).
		profile.Scope(b, profile.ScopeAttention)
		err = m.attn[l].Backward(m.dBlockTD, m.dResidTD, lw.attn, lg.attn)
		profile.Scope(b, "")
		if err != nil {
			return fmt.Errorf("layer %d attention backward: %w", l, err)
		}
		b.RMSNormBackward(m.dResidTD, lg.attnNormD, m.dBlockTD, m.residL[l], lw.attnNormD, m.rstd1L[l], 1)
		if err := notify(l); err != nil {
			return err
		}
	}
	b.EmbeddingBackward(g.embedVD, m.dResidTD, m.streamIDs())
	return notify(-1)
}
