package moe

import (
	"errors"
	"fmt"
	"slices"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
)

// Groups are the communicators a Layer uses.
type Groups struct {
	// Expert shards the experts: its size is EP, and rank r owns experts
	// [r*E/EP, (r+1)*E/EP). Tokens move between its ranks.
	Expert comm.Group
	// Data is every rank holding distinct tokens; the load statistics (and
	// so the aux and z losses) are summed over it.
	Data comm.Group
}

// Layer is one MoE block on one rank, sized for a fixed number of local
// tokens per micro-step. It holds the activations of the last Forward until
// Backward. A Layer is used by one goroutine (its rank).
type Layer struct {
	b                  backend.Backend
	cfg                Config
	g                  Groups
	dim, tokens        int  // D, local T
	local, firstExpert int  // experts on this rank, and the first one's global index
	sharedFFN          int  // Fs = SharedExperts*FFN, 0 when off
	addToOut           bool // Forward adds to out (AddToOutput)
	// peers is the expert group's peer access when the dispatcher is
	// fused (see fused.go), nil when unfused.
	peers comm.PeerAccess

	// The activations a Forward leaves for Backward: the Layer's own, or
	// under RecomputeLayer the Scratch's (see activations, exchanged).
	*activations
	*exchanged
	// Per layer always: what the statistics and losses of the last
	// training Forward need, which a rerun (Reforward) does not redo.
	onesT backend.Tensor // [1, T] ones: column sums of probs by MatMul
	// statsE1 receives, per Forward, Σ_t probs[t,e] (E values), Σ_t
	// lse[t]², the assignments per expert and those dropped on the device
	// (StatsLen); they are read once the step is done (FinishStats,
	// Layer.ReadStats), not in the middle of the layer.
	statsE1, zeroRow backend.Tensor // float [StatsLen(E)]; Int32 [1] holding 0 (the row RowDots reads)
	// countsE is statsE1's view of the assignments per expert (before
	// capacity): RouteByExpert writes them there, or the host uploads them
	// with a capacity.
	countsE   backend.Tensor
	pending   *pendingStats  // the last training Forward's global tokens, for FinishStats
	auxDProbE backend.Tensor // [E] aux-loss gradient on every row of probs
	zScale    float64        // the last Forward's z-loss gradient scale, for Reforward

	// recompute (RecomputeExperts): h1, h3 and silu(h1)*h3 live in the
	// Scratch instead of h1RF, h3RF and actRF, and Backward makes them
	// again from the kept expert inputs xRD.
	recompute bool
	// full (RecomputeLayer): activations (and, with the unfused
	// dispatcher, exchanged) are the Scratch's, and the caller runs
	// Reforward before Backward.
	full bool
	// overwriteGrads (OverwriteExpertGrads): Backward writes the experts'
	// weight gradients instead of adding to them.
	overwriteGrads bool
	// updater (UpdateExpertsInBackward): Backward hands it the experts'
	// weight-gradient products instead of writing them into the gradients.
	updater ExpertUpdater
	scratch *Scratch

	step *step // the last successful Forward, nil before
	// deviceGroups: the backend's products and fused ops read the
	// experts' group offsets on the device (ReadsGroupOffsets), so one
	// expert rank's forward leaves the counts to a queued download.
	deviceGroups bool
	// tokensChecked: the first Forward has checked that every rank of
	// the data group runs micro-steps of this many tokens (checkTokens).
	tokensChecked bool

	onPhase func(Phase) // WithPhaseHook; nil when off
}

// activations are the tensors a Layer's Forward writes for its Backward
// that only this rank's own ops touch: the router's outputs, the routed
// rows' indices and expert-side rows, the experts' hidden activations and
// the shared experts'. Under RecomputeLayer every layer of the rank uses
// the Scratch's one set.
type activations struct {
	// Router, per local token.
	logitsTE, probsTE, lseT, idxTK, gatesTK backend.Tensor
	dlogitsTE, dgatesTK                     backend.Tensor
	offsetsE1                               backend.Tensor // Int32 [E+1]: the assignments' prefix sums by expert (RouteByExpert): dropless, the expert groups' offsets
	// sendPosTK (Int32 [T, K]) is where each assignment went in the send
	// order, -1 where it was dropped: the combines (GatherSumRows) read a
	// token's rows from there.
	sendPosTK backend.Tensor

	// Shared experts, [T, Fs]; nil when off.
	sharedH1TF, sharedH3TF, sharedActTF, sharedDActTF, sharedDH1TF, sharedDH3TF backend.Tensor

	// Routed rows. Their number changes every step, so these grow on
	// demand and each step views the prefix it needs. S = rows this rank
	// sends, R = rows its experts process.
	sendSlotS, permR, invPermR rowBuf // Int32 index vectors
	refsR2                     rowBuf // Int32 [R, 2]: the fused dispatcher's row references
	refsIdentity               int    // one expert rank: rows of refsR2 holding (0, i), written once
	dgateS                     rowBuf // per sent row
	xRD                        rowBuf // saved: expert inputs (expert-major, operand type)
	h1RF, h3RF, actRF          rowBuf // saved: expert hidden activations before and after SwiGLU (operand type)
}

// exchanged are the tensors of a Forward that the fused dispatcher's
// peers read or write in place (fused.go): the send order's token rows
// and gates, the expert outputs, and the operand-type input. The fused
// dispatcher keeps them per layer even under RecomputeLayer, since peers
// on other GPUs may still read a layer's after this rank has moved on;
// the unfused dispatcher's peers touch none of them, so under
// RecomputeLayer its layers share the Scratch's.
type exchanged struct {
	sendTokS rowBuf // Int32: the token of each sent row
	gateS    rowBuf // per sent row
	ySD      rowBuf // saved: expert outputs (send order): the operand type on one expert rank (bf16 on the GPU), else the float type
	// xoTD is the input in the operand type where that is not the float
	// type (bf16 on the GPU): the router's product reads it, and the fused
	// dispatcher's gather (half the bytes of the float rows). Forward
	// only. The fused dispatcher keeps one per layer, since peers on other
	// GPUs may read it after this rank has moved on to the next layer;
	// the unfused one, whose peers never read it, the Scratch's. An input
	// given in the operand type already (the engine's norm writes it so)
	// is its own, and neither is allocated.
	xoTD rowBuf
}

// newActivations allocates a Layer's activations for tokens local tokens.
func newActivations(b backend.Backend, cfg Config, dim, tokens int) *activations {
	E, K, F, ft, ot := cfg.Experts, cfg.TopK, cfg.FFN, b.FloatType(), b.OperandType()
	a := &activations{
		logitsTE: b.New(ft, tokens, E), probsTE: b.New(ft, tokens, E), lseT: b.New(ft, tokens),
		idxTK: b.New(backend.Int32, tokens, K), gatesTK: b.New(ft, tokens, K),
		dlogitsTE: b.New(ft, tokens, E), dgatesTK: b.New(ft, tokens, K),
		offsetsE1: b.New(backend.Int32, E+1), sendPosTK: b.New(backend.Int32, tokens, K),
	}
	if fs := cfg.SharedExperts * F; fs > 0 {
		a.sharedH1TF, a.sharedH3TF, a.sharedActTF = b.New(ft, tokens, fs), b.New(ft, tokens, fs), b.New(ft, tokens, fs)
		a.sharedDActTF, a.sharedDH1TF, a.sharedDH3TF = b.New(ft, tokens, fs), b.New(ft, tokens, fs), b.New(ft, tokens, fs)
	}
	for _, r := range []*rowBuf{&a.sendSlotS, &a.permR, &a.invPermR} {
		*r = rowBuf{dt: backend.Int32, cols: 1}
	}
	a.refsR2 = rowBuf{dt: backend.Int32, cols: 2}
	a.dgateS = rowBuf{dt: ft, cols: 1}
	a.xRD = rowBuf{dt: ot, cols: dim}
	a.h1RF, a.h3RF, a.actRF = rowBuf{dt: ot, cols: F}, rowBuf{dt: ot, cols: F}, rowBuf{dt: ot, cols: F}
	return a
}

// newExchanged returns empty exchanged buffers for width dim, the expert
// outputs of type yType; they grow on first use.
func newExchanged(b backend.Backend, dim int, yType backend.DType) *exchanged {
	return &exchanged{sendTokS: rowBuf{dt: backend.Int32, cols: 1}, gateS: rowBuf{dt: b.FloatType(), cols: 1},
		ySD: rowBuf{dt: yType, cols: dim}, xoTD: rowBuf{dt: b.OperandType(), cols: dim}}
}

// outputType is the type of the expert outputs y: on one expert rank the
// operand type, which the products round into once (half the bytes to
// keep for the backward, to write and to read back in the combine and
// the gates' gradient, on the GPU); across expert ranks the float type
// the exchange moves.
func (l *Layer) outputType() backend.DType {
	if l.g.Expert.Size() == 1 {
		return l.b.OperandType()
	}
	return l.b.FloatType()
}

// Scratch is the working memory a Layer uses only inside one Forward or
// Backward call: rows in transit and the experts' activation gradients,
// which for moe-small are a large part of a layer's memory. The layers of
// one rank run one after another, so they can share one Scratch (see
// WithScratch); layers that run at the same time (different ranks) must
// not. With the fused dispatcher, the expert group's peers write this
// rank's dx rows into its Scratch during Backward (fused.go).
//
// The tensors the expert products read (the expert inputs, the hidden
// activations and their gradients, the SwiGLU output, the output gradient
// rows on one rank) are kept in the backend's operand type (bf16 on the
// GPU: backend.Backend.OperandType), so the products read them as they are.
type Scratch struct {
	rowsSD, rowsR1D, rowsR2D rowBuf // rows of width D
	dyRD                     rowBuf // output gradient rows, operand type (one expert rank)
	dActRF                   rowBuf // the SwiGLU output's gradient
	dh1RF, dh3RF             rowBuf // the hidden activations' gradients (operand type)
	// doneS are the fused dispatcher's row flags (Int32, one per send
	// row): raised by the peers as they write this rank's rows, cleared
	// by its combine, so all zero between layers (fused.go).
	doneS rowBuf
	// xoTD is the unfused dispatcher's operand-type input (Layer.xoTD).
	xoTD rowBuf
	// h1RF, h3RF and actRF are the experts' hidden activations of the
	// layers built with RecomputeExperts (operand type): the last
	// Forward's, or the Backward's that recomputed them. Unused, they
	// allocate nothing.
	h1RF, h3RF, actRF rowBuf
	// layer and exch are the activations of the layers built with
	// RecomputeLayer (exch: with the unfused dispatcher), one set for all
	// of them: the last Forward's or Reforward's. Nil until such a layer
	// is built.
	layer       *activations
	layerTokens int // the tokens layer is sized for
	exch        *exchanged
}

// NewScratch returns an empty Scratch for layers of width dim and expert
// hidden size ffn; its buffers grow on first use.
func NewScratch(b backend.Backend, dim, ffn int) *Scratch {
	ft, ot := b.FloatType(), b.OperandType()
	s := &Scratch{dyRD: rowBuf{dt: ot, cols: dim}, dActRF: rowBuf{dt: ft, cols: ffn}, doneS: rowBuf{dt: backend.Int32, cols: 1},
		xoTD: rowBuf{dt: ot, cols: dim}}
	for _, r := range []*rowBuf{&s.rowsSD, &s.rowsR1D, &s.rowsR2D} {
		*r = rowBuf{dt: ft, cols: dim}
	}
	for _, r := range []*rowBuf{&s.dh1RF, &s.dh3RF, &s.h1RF, &s.h3RF, &s.actRF} {
		*r = rowBuf{dt: ot, cols: ffn}
	}
	return s
}

// Option configures New.
type Option func(*Layer)

// AddToOutput makes Forward add its output to out (a residual stream)
// instead of overwriting it: the combine scatters onto it directly.
func AddToOutput() Option { return func(l *Layer) { l.addToOut = true } }

// WithStats makes the Layer leave its per-Forward statistics in t, a float
// tensor of StatsLen(E) elements (a view of a buffer that holds every
// layer's, so that one download reads them all: see FinishStats).
func WithStats(t backend.Tensor) Option { return func(l *Layer) { l.statsE1 = t } }

// WithScratch makes the Layer use s, shared with the other layers of its
// rank, instead of a Scratch of its own. s must be of the Layer's width and
// expert hidden size.
func WithScratch(s *Scratch) Option { return func(l *Layer) { l.scratch = s } }

// RecomputeExperts makes the Layer keep its experts' hidden activations
// h1 = x·W1ᵀ, h3 = x·W3ᵀ and silu(h1)*h3 ([R, F] each, the operand type,
// the largest of a layer's activations) in the shared Scratch instead of
// per layer, and make them again at the start of the experts' backward
// from the expert inputs xRD it keeps (two grouped products and SwiGLU):
// selective activation recomputation (train.recompute: selective). Both
// dispatchers keep xRD (the fused one's DispatchSwiGLU writes it), and
// both recompute with the unfused calls, GroupedMatMul and SwiGLUForward;
// the CPU's fused op is that very sequence, so the gradients are a
// Layer's without the option bit for bit there. A GPU's fused kernel may
// round h1 and h3 differently from its grouped product, and the backward
// then reads the unfused rounding of what the forward computed fused.
func RecomputeExperts() Option { return func(l *Layer) { l.recompute = true } }

// RecomputeLayer makes the Layer keep none of its activations per layer:
// the router's outputs, the routed rows, the expert inputs and hidden
// activations and the shared experts' (with the unfused dispatcher the
// expert outputs and send order too) live in the shared Scratch, one set
// for all the layers built with it, and are the last Forward's of any of
// them. The caller must call Reforward, on the same input, weights and
// bias, right before Backward: full activation recomputation
// (train.recompute: full), where the engine reruns the whole transformer
// layer from its kept input. Reforward is Forward's computation without
// its bookkeeping, so the gradients are a Layer's without the option,
// bit for bit on a deterministic backend. It takes the place of
// RecomputeExperts, which it makes unnecessary.
func RecomputeLayer() Option { return func(l *Layer) { l.full = true } }

// OverwriteExpertGrads makes Backward write the local experts' weight
// gradients (g's W1EFD, W3EFD, W2EDF) instead of adding to them, the
// products running with beta 0: for a caller whose step holds one
// micro-batch, so that nothing else adds to those gradients in the step
// and they need no zeroing first. Experts without rows get zeros. The
// router's and the shared experts' gradients are still added to. Besides
// the zeroing pass it saves, the weight-gradient products then never read
// their output (the CUDA backend's grouped kernel measured 1.36x slower
// with beta 1: kernels/grouped_gemm.cu).
func OverwriteExpertGrads() Option { return func(l *Layer) { l.overwriteGrads = true } }

// ExpertWeight names one of a layer's stacked expert tensors.
type ExpertWeight int

// The local experts' tensors, in Params: W1EFD, W3EFD and W2EDF.
const (
	ExpertW1 ExpertWeight = iota
	ExpertW3
	ExpertW2
)

func (w ExpertWeight) String() string {
	switch w {
	case ExpertW1:
		return "w1"
	case ExpertW3:
		return "w3"
	case ExpertW2:
		return "w2"
	}
	return fmt.Sprintf("ExpertWeight(%d)", int(w))
}

// ExpertUpdater applies an optimizer step to a layer's local experts from
// inside its Backward (UpdateExpertsInBackward).
type ExpertUpdater interface {
	// UpdateExperts is handed the product that gives tensor w's gradient,
	// dW[e] = dyRN[rows of e]ᵀ · xRM[rows of e] for each local expert e
	// (Backend.GroupedMatMulTN with alpha 1 and beta 0: an expert without
	// rows has a zero gradient), or nil dyRN and xRM when no expert has a
	// row. Backward calls it once per tensor and step, once nothing later
	// in the Backward reads w's weights; the tensors dyRN and xRM hold
	// their values only until it returns.
	UpdateExperts(w ExpertWeight, dyRN, xRM backend.Tensor, groups backend.Groups) error
}

// UpdateExpertsInBackward makes Backward hand the local experts'
// weight-gradient products to u (ExpertUpdater) instead of writing or
// adding them into the gradients, which it then leaves alone: for a
// caller that updates the experts in the backward (train.optimizer_in_backward),
// so that it can apply each tensor's update as soon as the tensor is no
// longer read, and compute its gradient in whatever memory (or product)
// it likes.
func UpdateExpertsInBackward(u ExpertUpdater) Option { return func(l *Layer) { l.updater = u } }

// weightGrad gives tensor w's weight gradient, dyRN ᵀ· xRM per expert: to
// the updater (UpdateExpertsInBackward), else into dW with the products'
// beta.
func (l *Layer) weightGrad(w ExpertWeight, dW, dyRN, xRM backend.Tensor, groups backend.Groups) error {
	if l.updater != nil {
		if err := l.updater.UpdateExperts(w, dyRN, xRM, groups); err != nil {
			return fmt.Errorf("moe: updating the experts' %v: %w", w, err)
		}
		return nil
	}
	l.b.GroupedMatMulTN(dW, dyRN, xRM, groups, 1, l.expertGradBeta())
	return nil
}

// gateUpGrads is weightGrad for w1 and w3, whose products share their
// input xRD.
func (l *Layer) gateUpGrads(dw1, dw3, dh1RF, dh3RF, xRD backend.Tensor, groups backend.Groups) error {
	if err := l.weightGrad(ExpertW1, dw1, dh1RF, xRD, groups); err != nil {
		return err
	}
	return l.weightGrad(ExpertW3, dw3, dh3RF, xRD, groups)
}

// expertGradBeta is the weight-gradient products' beta: 0 when they
// overwrite (OverwriteExpertGrads), else 1.
func (l *Layer) expertGradBeta() float64 {
	if l.overwriteGrads {
		return 0
	}
	return 1
}

// noExpertRows is the experts' backward when they processed no rows: with
// OverwriteExpertGrads their gradients are zero, else nothing is added;
// the updater (UpdateExpertsInBackward) is told so for each tensor.
func (l *Layer) noExpertRows(g *Params) error {
	if l.updater != nil {
		for _, w := range []ExpertWeight{ExpertW2, ExpertW1, ExpertW3} {
			if err := l.weightGrad(w, nil, nil, nil, backend.Groups{}); err != nil {
				return err
			}
		}
		return nil
	}
	if l.overwriteGrads {
		dw1, dw3, dw2 := l.stacked(g)
		l.b.Zero(dw1)
		l.b.Zero(dw3)
		l.b.Zero(dw2)
	}
	return nil
}

// step is what Forward leaves for Backward.
type step struct {
	xTD                 backend.Tensor
	xoTD                backend.Tensor // the fused dispatcher's sources: xTD, or its operand-type copy (Layer.xoTD); Forward only
	plan                *plan
	zScale              float64
	sendTokS, sendSlotS backend.Tensor
	sendPosTK           backend.Tensor // where each assignment went in the send order (-1: dropped)
	permR, invPermR     backend.Tensor
	gateS               backend.Tensor
	xRD, h1RF, h3RF     backend.Tensor
	actRF               backend.Tensor
	ySD                 backend.Tensor
	refsR2              backend.Tensor // fused: expert-major row -> (source rank, send position)
	doneS               backend.Tensor // fused: this rank's row flags (Int32 [S]), raised by the peers
}

// New builds a Layer of width dim for tokens local tokens per micro-step.
func New(b backend.Backend, cfg Config, dim, tokens int, g Groups, opts ...Option) (*Layer, error) {
	if err := validate(cfg, dim, tokens, g); err != nil {
		return nil, err
	}
	E, F, ft := cfg.Experts, cfg.FFN, b.FloatType()
	l := &Layer{
		b: b, cfg: cfg, g: g, dim: dim, tokens: tokens,
		local: E / g.Expert.Size(), sharedFFN: cfg.SharedExperts * F,
		onesT: b.New(ft, 1, tokens), auxDProbE: b.New(ft, E), zeroRow: b.New(backend.Int32, 1),
	}
	l.firstExpert = g.Expert.Rank() * l.local
	l.deviceGroups = b.ReadsGroupOffsets(F, dim, l.local) && b.ReadsGroupOffsets(dim, F, l.local)
	ones := make([]float64, tokens)
	for i := range ones {
		ones[i] = 1
	}
	backend.UploadSlice(b, l.onesT, ones)
	if cfg.Dispatcher == DispatcherFused {
		l.peers = g.Expert.(comm.PeerAccess) // validate checked it
	}
	for _, o := range opts {
		o(l)
	}
	if l.statsE1 == nil {
		l.statsE1 = b.New(ft, StatsLen(E))
	} else if l.statsE1.Len() != StatsLen(E) || l.statsE1.DType() != ft {
		return nil, fmt.Errorf("moe: the statistics tensor is %v %v; want %v [%d]", l.statsE1.DType(), l.statsE1.Shape(), ft, StatsLen(E))
	}
	l.countsE = b.View(l.statsE1, E+1, E)
	b.Zero(b.View(l.statsE1, 2*E+1, 1)) // the drops: a dropless layer never writes them
	ot := b.OperandType()
	if l.scratch == nil {
		l.scratch = NewScratch(b, dim, F)
	} else if sc := l.scratch; sc.rowsSD.cols != dim || sc.dh1RF.cols != F || sc.rowsSD.dt != ft || sc.dh1RF.dt != ot {
		return nil, fmt.Errorf("moe: the shared scratch is for width %d, ffn %d, %v; this layer has width %d, ffn %d, %v",
			sc.rowsSD.cols, sc.dh1RF.cols, sc.rowsSD.dt, dim, F, ft)
	}
	if !l.full {
		l.activations, l.exchanged = newActivations(b, cfg, dim, tokens), newExchanged(b, dim, l.outputType())
		return l, nil
	}
	sc := l.scratch
	if sc.layer == nil {
		// The Scratch's width and ffn are checked above; the rest of the
		// shape (experts, top-k, shared experts) is the model's, the same
		// for every layer the engine builds.
		sc.layer, sc.layerTokens = newActivations(b, cfg, dim, tokens), tokens
	} else if sc.layerTokens != tokens || sc.layer.logitsTE.Len() != tokens*E || sc.layer.gatesTK.Len() != tokens*cfg.TopK ||
		(sc.layer.sharedH1TF == nil) != (l.sharedFFN == 0) || (l.sharedFFN > 0 && sc.layer.sharedH1TF.Len() != tokens*l.sharedFFN) {
		return nil, fmt.Errorf("moe: the shared recomputed activations are for %d tokens of %v router logits; this layer has %d tokens, %d experts, top-k %d and %d shared hidden",
			sc.layerTokens, sc.layer.logitsTE.Shape(), tokens, E, cfg.TopK, l.sharedFFN)
	}
	l.activations, l.exchanged = sc.layer, newExchanged(b, dim, l.outputType())
	if l.peers == nil {
		if sc.exch == nil {
			sc.exch = newExchanged(b, dim, l.outputType())
		}
		l.exchanged = sc.exch
	}
	return l, nil
}

func validate(cfg Config, dim, tokens int, g Groups) error {
	switch {
	case cfg.Experts < 1:
		return fmt.Errorf("moe: experts is %d; it must be at least 1", cfg.Experts)
	case cfg.TopK < 1 || cfg.TopK > cfg.Experts:
		return fmt.Errorf("moe: top_k is %d; it must be between 1 and experts (%d)", cfg.TopK, cfg.Experts)
	case cfg.FFN < 1:
		return fmt.Errorf("moe: ffn is %d; it must be at least 1", cfg.FFN)
	case cfg.SharedExperts < 0:
		return fmt.Errorf("moe: shared_experts is %d; it cannot be negative", cfg.SharedExperts)
	case cfg.AuxLossCoef < 0 || cfg.ZLossCoef < 0 || cfg.BiasUpdateRate < 0 || cfg.CapacityFactor < 0:
		return fmt.Errorf("moe: aux_loss_coef, z_loss_coef, bias_update_rate and capacity_factor cannot be negative (%g, %g, %g, %g)",
			cfg.AuxLossCoef, cfg.ZLossCoef, cfg.BiasUpdateRate, cfg.CapacityFactor)
	case dim < 1 || tokens < 1:
		return fmt.Errorf("moe: model width (%d) and tokens per micro-step (%d) must be at least 1", dim, tokens)
	case g.Expert == nil || g.Data == nil:
		return errors.New("moe: both the expert and the data group are required")
	case cfg.Experts%g.Expert.Size() != 0:
		return fmt.Errorf("moe: experts (%d) must be divisible by the expert group size (%d)", cfg.Experts, g.Expert.Size())
	}
	switch cfg.Dispatcher {
	case DispatcherUnfused:
	case DispatcherFused:
		if _, ok := g.Expert.(comm.PeerAccess); !ok {
			return fmt.Errorf("moe: model.moe.dispatcher is %q, but the expert group (%T, %d ranks) has no peer access (comm.PeerAccess): "+
				"the in-process virtual ranks and the NCCL groups of one process with peer access offer it, groups across processes do not yet; use %q",
				DispatcherFused, g.Expert, g.Expert.Size(), DispatcherUnfused)
		}
	case DispatcherAuto, "":
		return fmt.Errorf("moe: model.moe.dispatcher is %q; resolve it to %q or %q before building the layer (tune.ResolveDispatcher)",
			cfg.Dispatcher, DispatcherFused, DispatcherUnfused)
	default:
		return fmt.Errorf("moe: model.moe.dispatcher is %q; want %q, %q or %q", cfg.Dispatcher, DispatcherAuto, DispatcherFused, DispatcherUnfused)
	}
	return nil
}

// Forward computes outTD = MoE(xTD), plus the shared experts when
// configured (or adds it to outTD: AddToOutput). xTD is of the float type
// or the backend's operand type (which the products and the fused
// dispatcher's gather read as it is); it is kept by reference until
// Backward. biasE, when not nil,
// is a float tensor [E] added to the router probs for selection only.
// lossScale multiplies the aux and z loss gradients of the following
// Backward (the engine passes 1/accumulation steps). The Stats it returns
// hold the tokens; FinishStats (or ReadStats) completes them once the
// step's work is queued.
//
// Forward calls collectives on both groups (the load counts' all-reduce
// over the data group, then the count all-reduce and two row
// all-to-alls over the expert group, or with the fused dispatcher a
// PeerTensors exchange and a barrier), so every rank of them must call it
// together. A rank whose Forward or Backward fails should abort its groups
// (comm.Ranks.Abort) so that its peers stop waiting for it.
func (l *Layer) Forward(outTD, xTD backend.Tensor, p *Params, biasE backend.Tensor, lossScale float64) (Stats, error) {
	return l.forward(outTD, xTD, p, biasE, lossScale, false)
}

// Reforward runs the last Forward again on the same input xTD, weights p
// and bias biasE, to refill the activations of a Layer built with
// RecomputeLayer (which other layers' Forwards have overwritten) right
// before its Backward. It writes the same output into outTD (the caller
// may discard it) and leaves the same state for Backward, but redoes
// none of Forward's bookkeeping: it neither writes the statistics tensor
// nor sums the load statistics over the data group (nor uploads the aux
// loss's gradient), so FinishStats, the losses and the reported Stats
// stay the first Forward's, and the aux and z-loss gradients keep its
// lossScale. The routing is a function of xTD, p and biasE, so it routes
// and exchanges the same rows; like Forward it calls the expert group's
// collectives, which every rank of it must run together.
func (l *Layer) Reforward(outTD, xTD backend.Tensor, p *Params, biasE backend.Tensor) error {
	if l.pending == nil {
		return errors.New("moe: Reforward called without a Forward before it")
	}
	_, err := l.forward(outTD, xTD, p, biasE, 0, true)
	return err
}

// forward is Forward, or with again Reforward.
func (l *Layer) forward(outTD, xTD backend.Tensor, p *Params, biasE backend.Tensor, lossScale float64, again bool) (Stats, error) {
	prev := l.step
	l.step = nil
	var pl *plan
	defer func() {
		// A plan that no step keeps (a failed Forward) or that none took
		// over from prev (a Forward without a Backward before it, as in
		// evaluation) frees its queued count download.
		if prev != nil && (l.step == nil || l.step.plan != prev.plan) {
			prev.plan.release()
		}
		if pl != nil && (l.step == nil || l.step.plan != pl) {
			pl.release()
		}
	}()
	if err := l.checkArgs(p, "out", outTD, "x", xTD); err != nil {
		return Stats{}, err
	}
	if biasE != nil && (biasE.Len() != l.cfg.Experts || biasE.DType() != l.b.FloatType()) {
		return Stats{}, fmt.Errorf("moe: bias is %v %v, want %v [%d]", biasE.DType(), biasE.Shape(), l.b.FloatType(), l.cfg.Experts)
	}
	b, E, K := l.b, l.cfg.Experts, l.cfg.TopK

	l.phase(PhaseRoute)
	// The input in the operand type (see Layer.xoTD), made once for the
	// router's product (a MatMul operand, which a bf16 operand type means
	// it multiplies in bf16 anyway: backend.Backend.OperandType) and the
	// fused dispatcher's gather.
	xoTD := xTD
	if ot := b.OperandType(); ot != b.FloatType() && xTD.DType() != ot {
		buf := &l.scratch.xoTD
		if l.peers != nil {
			buf = &l.xoTD
		}
		xoTD = buf.view(b, l.tokens)
		b.Copy(xoTD, xTD)
	}
	// Route: logits = x·Gateᵀ, then softmax, top-k and renormalised gates.
	b.MatMul(l.logitsTE, xoTD, p.GateED, false, true, 1, 0)
	b.RouterForward(l.probsTE, l.lseT, l.idxTK, l.gatesTK, l.logitsTE, biasE)

	// The load statistics that only the reported losses need stay on the
	// device: Σ_t probs[t,e] and Σ_t lse[t]². A rerun leaves the first
	// Forward's.
	T := l.tokens
	if !again {
		b.MatMul(b.View(l.statsE1, 0, 1, E), l.onesT, l.probsTE, false, false, 1, 0)
		b.RowDots(b.View(l.statsE1, E, 1), b.View(l.lseT, 0, 1, T), l.zeroRow, b.View(l.lseT, 0, 1, T))
	}

	// Plan the dispatch. Dropless (the default), the device sorts the
	// assignments by expert and writes each expert's count and offset. On
	// one expert rank the host needs none of them to queue the forward:
	// the experts' products read the offsets on the device, and the
	// counts come to the host by a queued download, for the backward
	// (plan.settle). Across expert ranks the host needs the counts now,
	// to size the exchange. With a capacity the host decides which
	// assignments to drop, from the router's choices.
	var sendTokS, sendSlotS backend.Tensor
	ep := l.g.Expert.Size()
	capRows := capacity(l.cfg.CapacityFactor, l.tokens, K, E)
	if capRows == 0 {
		n := l.tokens * K
		sendTokS, sendSlotS = l.sendTokS.vec(b, n), l.sendSlotS.vec(b, n)
		b.RouteByExpert(l.countsE, l.offsetsE1, sendTokS, sendSlotS, l.sendPosTK, l.idxTK)
		if ep == 1 {
			var err error
			if pl, err = l.oneRankPlan(n, prev, again); err != nil {
				return Stats{}, err
			}
		} else {
			counts, err := backend.OffsetRows(backend.DownloadInt32(b, l.offsetsE1), n)
			if err != nil {
				return Stats{}, fmt.Errorf("moe: the router's expert offsets: %w", err)
			}
			pl = planCounts(counts, ep)
		}
	} else {
		pl = planSource(backend.DownloadInt32(b, l.idxTK), l.tokens, K, E, ep, capRows)
		sendTokS, sendSlotS = l.sendTokS.uploadInts(b, pl.sendTok), l.sendSlotS.uploadInts(b, pl.sendSlot)
		backend.UploadSlice(b, l.sendPosTK, sendPositions(pl.sendSlot, l.tokens*K))
		if !again {
			// The counts and drops in the statistics, as RouteByExpert
			// leaves them dropless (a rerun keeps the Forward's).
			counts := make([]float64, E+1)
			for e, c := range pl.countsE {
				counts[e] = float64(c)
			}
			counts[E] = float64(pl.dropped)
			backend.UploadSlice(b, b.View(l.statsE1, E+1, E+1), counts)
		}
	}
	stats := Stats{Tokens: l.tokens * l.g.Data.Size()}
	if !l.tokensChecked {
		if err := l.checkTokens(); err != nil {
			return Stats{}, err
		}
	}
	if !again {
		// A rerun keeps the first Forward's statistics, aux-loss gradient
		// (auxDProbE) and z-loss scale: its counts are the same.
		var err error
		if l.zScale, err = l.balance(lossScale); err != nil {
			return Stats{}, err
		}
	}
	zScale := l.zScale
	l.phase(PhaseCountExchange)
	if pl.offsetsE1 == nil { // planOneRank's plans have nothing to exchange
		if err := l.exchangeCounts(pl); err != nil {
			return Stats{}, err
		}
	}

	st := &step{xTD: xTD, xoTD: xoTD, plan: pl, zScale: zScale, sendTokS: sendTokS, sendSlotS: sendSlotS, sendPosTK: l.sendPosTK}
	dispatch := l.dispatchForward
	if l.peers != nil {
		dispatch = l.fusedForward
	}
	if err := dispatch(st, p); err != nil {
		return Stats{}, err
	}

	// Combine: out[t] = Σ_k gate[t,k]·y[t,k] over kept assignments, on top
	// of the shared experts' output (or zero).
	S := pl.sent
	if l.sharedFFN > 0 {
		l.sharedForward(outTD, xTD, p, l.addToOut)
	} else {
		if !l.addToOut {
			b.Zero(outTD)
		}
	}
	st.gateS = l.gateS.vec(b, S)
	if S > 0 {
		b.GatherRows(b.View(st.gateS, 0, S, 1), b.View(l.gatesTK, 0, l.tokens*K, 1), st.sendSlotS, nil)
		if st.doneS != nil {
			// Fused: each row once its expert rank has flagged it.
			b.CombineRows(outTD, st.ySD, st.sendTokS, st.gateS, st.doneS, pl.sendCounts)
		} else {
			// Each token's rows, gathered: no atomics, a fixed order.
			b.GatherSumRows(outTD, st.ySD, st.sendPosTK, l.gatesTK)
		}
	}
	if l.recompute {
		// Not kept: the next layer's Forward overwrites them.
		st.h1RF, st.h3RF, st.actRF = nil, nil, nil
	}
	l.step = st
	l.phase(PhaseEnd)
	return stats, nil
}

// checkTokens checks, once, that every rank of the data group runs
// micro-steps of the same tokens: the load statistics count the global
// tokens as this rank's times the group's size (balance). Every rank of
// the group must call it together (a collective).
func (l *Layer) checkTokens() error {
	v := []float64{float64(l.tokens)}
	if err := l.g.Data.AllReduceFloat64(v); err != nil {
		return fmt.Errorf("moe: load statistics: %w", err)
	}
	if n := l.g.Data.Size(); v[0] != float64(l.tokens*n) {
		return fmt.Errorf("moe: the %d ranks of the data group run micro-steps of %v tokens in all, not %d times this rank's %d; the load statistics need the same tokens on each",
			n, v[0], n, l.tokens)
	}
	l.tokensChecked = true
	return nil
}

// releaseStep frees the queued count download of the last Forward when
// no Backward will wait for it (a layer dropped after a forward-only
// pass).
func (l *Layer) releaseStep() {
	if l.step != nil {
		l.step.plan.release()
	}
}

// oneRankPlan plans a dropless micro-step of n assignments on one expert
// rank (plan.go's planOneRank) from the offsets RouteByExpert has just
// queued. Its counts come by a queued download, or, when the backend's
// products would read the offsets back themselves (ReadsGroupOffsets;
// once per product), by that download waited for now, once. A rerun
// (Reforward, again) takes over the Forward's download, long done,
// instead of queuing another of the same counts.
func (l *Layer) oneRankPlan(n int, prev *step, again bool) (*plan, error) {
	if again && prev != nil && prev.plan.offsetsE1 != nil && prev.plan.sent == n {
		pl := planOneRank(n, l.offsetsE1, prev.plan.counts)
		prev.plan.counts = nil
		pl.setCounts(prev.plan.expertRows) // nil until prev settles: then pl does
		return pl, nil
	}
	pl := planOneRank(n, l.offsetsE1, l.b.StartDownload(l.offsetsE1))
	if !l.deviceGroups {
		if err := pl.settle(); err != nil {
			return nil, err
		}
	}
	return pl, nil
}

// exchangeCounts tells every rank of the expert group how many rows each
// source sends to each expert: each rank fills its row of an [EP, E] matrix
// and one small all-reduce completes it. The destination half of the plan
// is read from it.
func (l *Layer) exchangeCounts(pl *plan) error {
	ep, E := l.g.Expert.Size(), l.cfg.Experts
	m := make([]float64, ep*E)
	for e, n := range pl.keptE {
		m[l.g.Expert.Rank()*E+e] = float64(n)
	}
	if err := l.g.Expert.AllReduceFloat64(m); err != nil {
		return fmt.Errorf("moe: count exchange: %w", err)
	}
	counts := make([]int, len(m))
	for i, v := range m {
		counts[i] = int(v)
	}
	pl.planDest(counts, ep, E, l.firstExpert, l.local)
	return nil
}

// dispatchForward sends each kept assignment's token row to its expert's
// rank, runs the local experts on what arrives and brings the outputs back
// into st.ySD, in send order.
func (l *Layer) dispatchForward(st *step, p *Params) error {
	b, pl := l.b, st.plan
	S, R := pl.sent, pl.rows
	l.phase(PhaseDispatch)
	st.xRD, st.ySD = l.xRD.view(b, R), l.ySD.view(b, S)
	st.h1RF, st.h3RF, st.actRF = l.hidden(R)
	if l.g.Expert.Size() == 1 {
		// One rank: the sent rows are the expert-major rows (nothing is
		// exchanged and perm is the identity), so the tokens are gathered
		// straight into xRD and the experts write straight into ySD.
		if S > 0 {
			b.GatherRows(st.xRD, st.xTD, st.sendTokS, nil)
		}
		l.phase(PhaseExperts)
		if S > 0 {
			l.expertsForward(st, p, st.ySD)
		}
		l.phase(PhaseCombine)
		return nil
	}
	st.permR = l.permR.uploadInts(b, pl.perm)
	st.invPermR = l.invPermR.uploadInts(b, pl.invPerm)

	sc := l.scratch
	sendSD, recvRD := sc.rowsSD.view(b, S), sc.rowsR1D.view(b, R)
	if S > 0 {
		b.GatherRows(sendSD, st.xTD, st.sendTokS, nil)
	}
	if err := l.g.Expert.AllToAllRows(recvRD, sendSD, pl.recvCounts, pl.sendCounts); err != nil {
		return fmt.Errorf("moe: dispatch: %w", err)
	}
	yRD := sc.rowsR2D.view(b, R)
	if R > 0 {
		b.GatherRows(st.xRD, recvRD, st.permR, nil)
	}
	l.phase(PhaseExperts)
	if R > 0 {
		l.expertsForward(st, p, yRD)
	}
	l.phase(PhaseCombine)
	if R > 0 {
		b.GatherRows(recvRD, yRD, st.invPermR, nil) // back to arrival order
	}
	if err := l.g.Expert.AllToAllRows(st.ySD, recvRD, pl.sendCounts, pl.recvCounts); err != nil {
		return fmt.Errorf("moe: combine: %w", err)
	}
	return nil
}

// hidden returns the views of R rows the experts' hidden activations
// are written into: the Layer's own, or under RecomputeExperts the
// Scratch's.
func (l *Layer) hidden(R int) (h1RF, h3RF, actRF backend.Tensor) {
	b, h1, h3, act := l.b, &l.h1RF, &l.h3RF, &l.actRF
	if l.recompute {
		h1, h3, act = &l.scratch.h1RF, &l.scratch.h3RF, &l.scratch.actRF
	}
	return h1.view(b, R), h3.view(b, R), act.view(b, R)
}

// recomputeHidden makes the hidden activations of st again from its
// expert inputs st.xRD into the Scratch (RecomputeExperts): since the
// Forward, later layers have written theirs there.
func (l *Layer) recomputeHidden(st *step, p *Params) {
	R := st.plan.rows
	st.h1RF, st.h3RF, st.actRF = l.hidden(R)
	if R == 0 {
		return
	}
	b, groups := l.b, st.plan.groups()
	w1, w3, _ := l.stacked(p)
	b.GroupedMatMul(st.h1RF, st.xRD, w1, groups, true, 1, 0)
	b.GroupedMatMul(st.h3RF, st.xRD, w3, groups, true, 1, 0)
	b.SwiGLUForward(st.actRF, st.h1RF, st.h3RF)
}

// expertsForward runs the local experts on the expert-major rows st.xRD:
// yRD = (silu(x·W1ᵀ) * x·W3ᵀ)·W2ᵀ, each expert on its own rows (grouped
// products), keeping the hidden activations h1, h3 and silu(h1)*h3 in st.
func (l *Layer) expertsForward(st *step, p *Params, yRD backend.Tensor) {
	b, groups := l.b, st.plan.groups()
	w1, w3, w2 := l.stacked(p)
	b.GroupedMatMul(st.h1RF, st.xRD, w1, groups, true, 1, 0)
	b.GroupedMatMul(st.h3RF, st.xRD, w3, groups, true, 1, 0)
	b.SwiGLUForward(st.actRF, st.h1RF, st.h3RF)
	b.GroupedMatMul(yRD, st.actRF, w2, groups, true, 1, 0)
}

// stacked returns the local experts' matrices of p as the 2-D stacks the
// grouped products take: w1 and w3 [E_local*F, D], w2 [E_local*D, F].
func (l *Layer) stacked(p *Params) (w1, w3, w2 backend.Tensor) {
	b, E, D, F := l.b, l.local, l.dim, l.cfg.FFN
	return b.View(p.W1EFD, 0, E*F, D), b.View(p.W3EFD, 0, E*F, D), b.View(p.W2EDF, 0, E*D, F)
}

// sharedForward writes (or with add, adds) out = SwiGLU_shared(x) for every
// token.
func (l *Layer) sharedForward(outTD, xTD backend.Tensor, p *Params, add bool) {
	b := l.b
	b.MatMul(l.sharedH1TF, xTD, p.SharedW1FD, false, true, 1, 0)
	b.MatMul(l.sharedH3TF, xTD, p.SharedW3FD, false, true, 1, 0)
	b.SwiGLUForward(l.sharedActTF, l.sharedH1TF, l.sharedH3TF)
	beta := 0.0
	if add {
		beta = 1
	}
	b.MatMul(outTD, l.sharedActTF, p.SharedW2DF, false, true, 1, beta)
}

// Backward writes dxTD from doutTD and accumulates the gradients of the
// router, this rank's experts and the shared experts into g. The aux and
// z-loss gradients (scaled by Forward's lossScale) are included. Like
// Forward it calls collectives on the expert group (two row all-to-alls,
// or fused a PeerTensors exchange and a barrier).
func (l *Layer) Backward(dxTD, doutTD backend.Tensor, p, g *Params) error {
	st := l.step
	if st == nil {
		return errors.New("moe: Backward called without a successful Forward")
	}
	if err := l.checkArgs(p, "dx", dxTD, "dout", doutTD); err != nil {
		return err
	}
	if err := l.checkParams("gradient", g); err != nil {
		return err
	}
	if err := st.plan.settle(); err != nil {
		return err
	}
	b, K, S := l.b, l.cfg.TopK, st.plan.sent

	l.phase(PhaseRouterBackward)
	// Gate gradients: dgate[t,k] = dout[t]·y[t,k] for kept assignments; a
	// dropped assignment contributed nothing and gets 0.
	b.Zero(l.dgatesTK)
	if S > 0 {
		dgS := l.dgateS.vec(b, S)
		b.RowDots(dgS, doutTD, st.sendTokS, st.ySD)
		b.ScatterAddRows(b.View(l.dgatesTK, 0, l.tokens*K, 1), b.View(dgS, 0, S, 1), st.sendSlotS, nil)
	}

	// Router: dlogits, then dx = dlogits·Gate and dGate += dlogitsᵀ·x.
	b.RouterBackward(l.dlogitsTE, l.dgatesTK, l.probsTE, l.lseT, l.idxTK, l.gatesTK, l.auxDProbE, st.zScale)
	b.MatMul(dxTD, l.dlogitsTE, p.GateED, false, false, 1, 0)
	b.MatMul(g.GateED, l.dlogitsTE, st.xTD, true, false, 1, 1)

	if l.sharedFFN > 0 {
		l.sharedBackward(dxTD, doutTD, st.xTD, p, g)
	}
	dispatch := l.dispatchBackward
	if l.peers != nil {
		dispatch = l.fusedBackward
	}
	if err := dispatch(dxTD, doutTD, st, p, g); err != nil {
		return err
	}
	l.phase(PhaseEnd)
	return nil
}

// dispatchBackward runs the routed path in reverse: dy = gate·dout travels to
// the experts, their backward produces dx rows and weight gradients, and the
// dx rows travel back and are added to their tokens.
func (l *Layer) dispatchBackward(dxTD, doutTD backend.Tensor, st *step, p, g *Params) error {
	b, pl := l.b, st.plan
	S, R := pl.sent, pl.rows

	sc := l.scratch
	l.phase(PhaseDispatchBackward)
	if l.g.Expert.Size() == 1 {
		// One rank: send order is expert-major order (see dispatchForward),
		// so dy is gathered straight into the experts' operand rows.
		dyRD, dxSD := sc.dyRD.view(b, S), sc.rowsR1D.view(b, S)
		if S > 0 {
			b.GatherRows(dyRD, doutTD, st.sendTokS, st.gateS)
		}
		l.phase(PhaseExpertsBackward)
		var err error
		if S > 0 {
			err = l.expertsBackward(st, p, g, dyRD, dxSD)
		} else {
			err = l.noExpertRows(g)
		}
		if err != nil {
			return err
		}
		l.phase(PhaseCombineBackward)
		if S > 0 {
			b.GatherSumRows(dxTD, dxSD, st.sendPosTK, nil)
		}
		return nil
	}
	dySD := sc.rowsSD.view(b, S)
	if S > 0 {
		b.GatherRows(dySD, doutTD, st.sendTokS, st.gateS)
	}
	dyRecvRD := sc.rowsR1D.view(b, R)
	if err := l.g.Expert.AllToAllRows(dyRecvRD, dySD, pl.recvCounts, pl.sendCounts); err != nil {
		return fmt.Errorf("moe: backward dispatch: %w", err)
	}
	// Scratch rows are reused as their contents die: rowsR2D holds dy, then
	// (once the experts have consumed dy) the dx rows in arrival order;
	// rowsR1D holds dy in arrival order, then the experts' dx.
	dyRD, dxRD, dxRecvRD := sc.rowsR2D.view(b, R), sc.rowsR1D.view(b, R), sc.rowsR2D.view(b, R)
	if R > 0 {
		b.GatherRows(dyRD, dyRecvRD, st.permR, nil)
	}
	l.phase(PhaseExpertsBackward)
	var err error
	if R > 0 {
		err = l.expertsBackward(st, p, g, dyRD, dxRD)
	} else {
		err = l.noExpertRows(g)
	}
	if err != nil {
		return err
	}
	l.phase(PhaseCombineBackward)
	if R > 0 {
		b.GatherRows(dxRecvRD, dxRD, st.invPermR, nil)
	}
	dxSD := sc.rowsSD.view(b, S)
	if err := l.g.Expert.AllToAllRows(dxSD, dxRecvRD, pl.sendCounts, pl.recvCounts); err != nil {
		return fmt.Errorf("moe: backward combine: %w", err)
	}
	if S > 0 {
		b.GatherSumRows(dxTD, dxSD, st.sendPosTK, nil)
	}
	return nil
}

// expertsBackward is expertsForward's backward: from the output gradients
// dyRD (expert-major) it writes the input gradients dxRD and accumulates
// the local experts' weight gradients into g (or hands them to the
// updater, after the last read of each tensor's weights).
func (l *Layer) expertsBackward(st *step, p, g *Params, dyRD, dxRD backend.Tensor) error {
	if l.recompute {
		l.recomputeHidden(st, p)
	}
	b, groups := l.b, st.plan.groups()
	sc, R := l.scratch, st.plan.rows
	dActRF, dh1RF, dh3RF := sc.dActRF.view(b, R), sc.dh1RF.view(b, R), sc.dh3RF.view(b, R)
	w1, w3, w2 := l.stacked(p)
	dw1, dw3, dw2 := l.stacked(g)
	b.GroupedMatMul(dActRF, dyRD, w2, groups, false, 1, 0)
	if err := l.weightGrad(ExpertW2, dw2, dyRD, st.actRF, groups); err != nil {
		return err
	}
	b.SwiGLUBackward(dh1RF, dh3RF, dActRF, st.h1RF, st.h3RF)
	// The input gradient's products read w1 and w3, so their weight
	// gradients come after (an updater changes the weights).
	b.GroupedMatMul(dxRD, dh1RF, w1, groups, false, 1, 0)
	b.GroupedMatMul(dxRD, dh3RF, w3, groups, false, 1, 1)
	return l.gateUpGrads(dw1, dw3, dh1RF, dh3RF, st.xRD, groups)
}

// sharedBackward adds the shared experts' dx to dxTD and accumulates their
// weight gradients.
func (l *Layer) sharedBackward(dxTD, doutTD, xTD backend.Tensor, p, g *Params) {
	b := l.b
	b.MatMul(l.sharedDActTF, doutTD, p.SharedW2DF, false, false, 1, 0)
	b.MatMul(g.SharedW2DF, doutTD, l.sharedActTF, true, false, 1, 1)
	b.SwiGLUBackward(l.sharedDH1TF, l.sharedDH3TF, l.sharedDActTF, l.sharedH1TF, l.sharedH3TF)
	b.MatMul(g.SharedW1FD, l.sharedDH1TF, xTD, true, false, 1, 1)
	b.MatMul(g.SharedW3FD, l.sharedDH3TF, xTD, true, false, 1, 1)
	b.MatMul(dxTD, l.sharedDH1TF, p.SharedW1FD, false, false, 1, 1)
	b.MatMul(dxTD, l.sharedDH3TF, p.SharedW3FD, false, false, 1, 1)
}

// checkArgs checks the activations and weights a call is given.
func (l *Layer) checkArgs(p *Params, outName string, out backend.Tensor, inName string, in backend.Tensor) error {
	for _, a := range []struct {
		name string
		t    backend.Tensor
	}{{outName, out}, {inName, in}} {
		if err := checkShape(a.name, a.t, l.tokens, l.dim); err != nil {
			return err
		}
	}
	return l.checkParams("weight", p)
}

// checkParams checks a Params against the layer's shapes.
func (l *Layer) checkParams(what string, p *Params) error {
	if p == nil {
		return fmt.Errorf("moe: %s params are nil", what)
	}
	E, F, D, fs := l.cfg.Experts, l.cfg.FFN, l.dim, l.sharedFFN
	checks := []struct {
		name  string
		t     backend.Tensor
		shape []int
	}{
		{"gate", p.GateED, []int{E, D}},
		{"w1", p.W1EFD, []int{l.local, F, D}},
		{"w3", p.W3EFD, []int{l.local, F, D}},
		{"w2", p.W2EDF, []int{l.local, D, F}},
	}
	if fs > 0 {
		checks = append(checks, []struct {
			name  string
			t     backend.Tensor
			shape []int
		}{
			{"shared w1", p.SharedW1FD, []int{fs, D}},
			{"shared w3", p.SharedW3FD, []int{fs, D}},
			{"shared w2", p.SharedW2DF, []int{D, fs}},
		}...)
	}
	for _, c := range checks {
		if c.t == nil {
			return fmt.Errorf("moe: %s %s is missing", what, c.name)
		}
		if err := checkShape(what+" "+c.name, c.t, c.shape...); err != nil {
			return err
		}
	}
	return nil
}

func checkShape(name string, t backend.Tensor, want ...int) error {
	if !slices.Equal(t.Shape(), want) {
		return fmt.Errorf("moe: %s has shape %v, want %v", name, t.Shape(), want)
	}
	return nil
}
