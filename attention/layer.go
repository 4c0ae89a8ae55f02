package attention

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/tensorpar"
)

// Shape is the attention block's size. HeadDim is Dim/Heads.
type Shape struct {
	Dim       int     // model width D
	Heads     int     // query heads H
	KVHeads   int     // key/value heads KV; divides Heads
	RopeTheta float64 // RoPE base (Mixtral: 1e6)
}

// HeadDim is the width of one head, Dh = Dim/Heads.
func (s Shape) HeadDim() int { return s.Dim / s.Heads }

// Validate says in a sentence what is wrong with s, or returns nil.
func (s Shape) Validate() error {
	switch {
	case s.Dim < 1 || s.Heads < 1 || s.KVHeads < 1:
		return fmt.Errorf("attention: dim (%d), heads (%d) and kv_heads (%d) must be positive", s.Dim, s.Heads, s.KVHeads)
	case s.Dim%s.Heads != 0:
		return fmt.Errorf("attention: dim %d is not a multiple of heads %d", s.Dim, s.Heads)
	case s.Heads%s.KVHeads != 0:
		return fmt.Errorf("attention: heads %d is not a multiple of kv_heads %d", s.Heads, s.KVHeads)
	case s.HeadDim()%2 != 0:
		return fmt.Errorf("attention: head dim %d (dim/heads) must be even for rotary embeddings", s.HeadDim())
	case !(s.RopeTheta > 0):
		return fmt.Errorf("attention: rope_theta %g must be positive", s.RopeTheta)
	}
	return nil
}

// Params are the block's four projection weights in Hugging Face's Linear
// layout [out, in]. The same struct holds their gradients.
type Params struct {
	WqQD backend.Tensor // q_proj [H*Dh, D]
	WkKD backend.Tensor // k_proj [KV*Dh, D]
	WvKD backend.Tensor // v_proj [KV*Dh, D]
	WoDQ backend.Tensor // o_proj [D, H*Dh]
}

// NewParams allocates zeroed weights (or gradients) of shape s in b's float
// type. s must be valid (see Shape.Validate).
func NewParams(b backend.Backend, s Shape) *Params {
	mustValid(s)
	ft, q, kd := b.FloatType(), s.Heads*s.HeadDim(), s.KVHeads*s.HeadDim()
	return &Params{
		WqQD: b.New(ft, q, s.Dim),
		WkKD: b.New(ft, kd, s.Dim),
		WvKD: b.New(ft, kd, s.Dim),
		WoDQ: b.New(ft, s.Dim, q),
	}
}

// Layer runs the block for micro-batches of a fixed batch x seq and keeps
// what Backward needs from the last Forward. See the package doc.
type Layer struct {
	b backend.Backend
	// s is the shape of this rank's heads: the model's, or under tensor
	// parallelism its share of them, with Dim their width (Heads*HeadDim),
	// so HeadDim is the model's. dim is the model width D of x and out.
	s      Shape
	dim    int
	attn   backend.AttnShape
	tokens int // rows of q, k, v: the micro-batch's (gathered over tp)
	rows   int // rows of x and out: tokens, or tokens/tp under sequence parallelism

	// tp is set on a tensor-parallel Layer (WithTensorParallel); kvRow is
	// then the first row of k_proj and v_proj it multiplies by (nonzero
	// where the ranks keep every kv head and use one, kvHeads < tp).
	tp      *tensorpar.Parallel
	kvRow   int
	kvWhole bool // k_proj and v_proj are the model's whole matrices

	// Saved by Forward. xTD and posT are the caller's tensors; xTD is nil
	// before a Forward succeeds.
	xTD, posT backend.Tensor
	qTQ       backend.Tensor // q after RoPE, of type qkvType
	kTK       backend.Tensor // k after RoPE, of type qkvType
	vTK       backend.Tensor // of type qkvType
	// qkvType is the type q, k and v are kept in: the backend's operand
	// type (bf16 on the GPU, which the attention core reads as it is) on a
	// Layer whose core is the backend's attention, on a context-parallel
	// one its ContextCore's QKVType (bf16 for the fused ring in one pass;
	// the float type where collectives move float keys and values).
	// Where it is not the float type, the projections of q and k write
	// float32 into the backward's dq and dk scratch (free during Forward)
	// and RoPE rounds them once into qTQ and kTK.
	qkvType backend.DType
	aTQ     backend.Tensor // attention output, the input of o_proj (bf16 beside bf16 q, k, v on one rank without tensor parallelism)
	lseBHS  backend.Tensor
	// recompute is set by RecomputeCore: aTQ and lseBHS are then the
	// shared Scratch's (core), overwritten by the next layer's Forward,
	// and Backward reruns the core to refill them.
	recompute bool
	// Under RecomputeLayer qTQ, kTK, vTK, aTQ and lseBHS are all the
	// shared Scratch's (layer, core): valid from this Layer's Forward
	// until the next Forward of any Layer sharing the Scratch.

	// outBeta is 1 when Forward adds to out (AddToOutput), else 0.
	outBeta float64

	// Backward scratch: the tensors of sc, which other Layers may share.
	sc                     *Scratch
	daTQ, dqTQ, dkTK, dvTK backend.Tensor

	// cp is set on a Layer of a context-parallel group of more than one
	// rank (NewContextParallel); lseBHS is then laid out [B, 2, H, C].
	cp *ContextCore
}

// Scratch is the working memory a Layer uses only inside one call: the
// gradients of a, q, k and v in Backward and, on a context-parallel Layer,
// the keys and values in transit and their gradients in natural order. The
// layers of one rank run one after another, so they can share one Scratch
// (see WithScratch); layers that run at the same time (different ranks)
// must not. The first Layer given a Scratch sizes it; the others must have
// the same shape and micro-batch, on the same backend.
type Scratch struct {
	daTQ, dqTQ, dkTK, dvTK backend.Tensor // [T, H*Dh] and [T, KV*Dh], da bf16 beside bf16 q, k, v; nil until sized
	cp                     *cpScratch     // sized by the first all-gather context core
	ring                   *ringScratch   // sized by the first ring context core
	zz                     *zzScratch     // sized by the first fused ring context core
	ops                    *operands      // nil where the operand type is the float type
	tp                     *tpScratch     // sized by the first tensor-parallel Layer
	core                   *coreScratch   // sized by the first Layer built with RecomputeCore or RecomputeLayer
	layer                  *layerScratch  // sized by the first Layer built with RecomputeLayer
}

// layerScratch holds the rotated q, k and v of the layers built with
// RecomputeLayer: one set for all of them, like coreScratch.
type layerScratch struct {
	qTQ      backend.Tensor // [T, H*Dh]
	kTK, vTK backend.Tensor // [T, KV*Dh]
}

// coreScratch holds the attention core's output and log-sum-exp for the
// layers built with RecomputeCore: one set for all of them, valid from a
// layer's Forward (or the rerun at the start of its Backward) until the
// next layer's.
type coreScratch struct {
	aTQ    backend.Tensor // [T, H*Dh]
	lseBHS backend.Tensor // [B, H, S] ([B, 2, H, C] under context parallelism)
}

// tpScratch is a tensor-parallel Layer's working memory: the gathered
// rows of x (and, in Backward, of dout before them), the partial sums of
// a row-parallel product over its [T, D] rows, and one rank's rows of
// o_proj's output before they join the residual stream.
type tpScratch struct {
	fullTD, partialTD backend.Tensor // [T, D]
	outTD             backend.Tensor // [rows, D]
}

// operands are the layer's matrix-product inputs rounded once to the
// backend's operand type (bf16 on the GPU) where it differs from the float
// type: x feeds three products in Forward and three in Backward, dout two,
// and each of dq, dk, dv two, which would otherwise each round their own
// copy.
type operands struct {
	xTD, doutTD backend.Tensor // [T, D]; xTD nil until a float x comes (operandOf)
	dqTQ        backend.Tensor // [T, H*Dh]
	dkTK, dvTK  backend.Tensor // [T, KV*Dh]
}

// operand rounds t into buf and returns buf.
func (l *Layer) operand(t, buf backend.Tensor) backend.Tensor {
	l.b.Copy(buf, t)
	return buf
}

// operandOf is the Layer's input x as the projections read it: x itself
// where it is of the operand type already (the engine's norm writes it
// so) or the operand type is the float type, else rounded into the
// Scratch, whose buffer for it is made at the first such call.
func (l *Layer) operandOf(xTD backend.Tensor) backend.Tensor {
	ops := l.sc.ops
	if ops == nil || xTD.DType() == l.b.OperandType() {
		return xTD
	}
	if ops.xTD == nil {
		ops.xTD = l.b.New(l.b.OperandType(), xTD.Shape()...)
	}
	return l.operand(xTD, ops.xTD)
}

// NewScratch returns an empty Scratch; the first Layer built with it
// (WithScratch) allocates its tensors.
func NewScratch() *Scratch { return &Scratch{} }

// Option configures New and NewContextParallel.
type Option func(*options)

type options struct {
	scratch   *Scratch
	addToOut  bool
	recompute bool
	layer     bool // RecomputeLayer
	cpMode    CPMode
	tp        *tensorpar.Parallel
}

func outBeta(add bool) float64 {
	if add {
		return 1
	}
	return 0
}

// AddToOutput makes Forward add its output to out (a residual stream)
// instead of overwriting it: the output projection accumulates, and the
// caller needs no separate addition.
func AddToOutput() Option { return func(o *options) { o.addToOut = true } }

// RecomputeCore makes the Layer keep the attention core's output a and
// its log-sum-exp in the shared Scratch instead of per layer, and rerun
// the core (the attention forward on the kept, rotated q, k and v, or the
// context-parallel core's Forward with its collectives) at the start of
// Backward to refill them: selective activation recomputation
// (train.recompute: selective). It saves [T, H*Dh] + [B, H, S] floats a
// layer (one set stays, in the Scratch) for one more attention forward in
// each Backward. The rerun is the same call on the same inputs, so the
// gradients are those of a Layer without it, bit for bit on a
// deterministic backend.
func RecomputeCore() Option { return func(o *options) { o.recompute = true } }

// RecomputeLayer makes the Layer keep none of its activations per layer:
// the rotated q, k and v, the core's output a and its log-sum-exp (and
// a context-parallel all-gather core's keys and values in natural order)
// live in the shared Scratch, one set for all the layers built with it,
// and are the last Forward's of any of them. The caller must run this
// Layer's Forward again, on the same input, positions and weights, right
// before its Backward (full activation recomputation, train.recompute:
// full: the engine reruns the whole transformer layer from its kept
// input). The rerun is the same calls on the same inputs, so the
// gradients are those of a Layer without it, bit for bit on a
// deterministic backend. It takes the place of RecomputeCore, which it
// makes unnecessary: Backward reruns nothing itself.
func RecomputeLayer() Option { return func(o *options) { o.layer = true } }

// WithContextMode makes a context-parallel Layer (NewContextParallel) bring
// keys and values to its queries in mode m instead of CPAllGather.
func WithContextMode(m CPMode) Option { return func(o *options) { o.cpMode = m } }

// WithScratch makes the Layer use s, shared with the other layers of its
// rank, instead of a Scratch of its own.
func WithScratch(s *Scratch) Option { return func(o *options) { o.scratch = s } }

// WithTensorParallel makes the Layer one rank's share of a
// tensor-parallel block (package tensorpar): its query heads are
// Heads/tp of the model's, its key/value heads KVHeads/tp of them, or,
// when KVHeads < tp, the one head its queries use; Params hold this
// rank's rows of q_proj (and of k_proj and v_proj when they are split),
// the whole k_proj and v_proj when they are not, and its columns of
// o_proj (TensorParallelShape). Forward and Backward then take x and out
// of p.Rows(T) rows: this rank's shard under sequence parallelism, all T
// otherwise. A p that is not Enabled changes nothing.
func WithTensorParallel(p *tensorpar.Parallel) Option { return func(o *options) { o.tp = p } }

// TensorParallelShape is the part of the model's shape s that tensor
// rank r of tp holds: its query heads, its key/value heads (1 when
// KVHeads < tp), and the first row of k_proj and v_proj it multiplies by
// (KVHeads < tp: the head its queries share, every rank holding the whole
// matrices; otherwise 0, each rank holding its own rows). s.Heads must be
// a multiple of tp, and KVHeads a multiple or a divisor of it.
func TensorParallelShape(s Shape, tp, r int) (heads, kvHeads, kvRow int) {
	heads = s.Heads / tp
	if s.KVHeads%tp == 0 {
		return heads, s.KVHeads / tp, 0
	}
	group := s.Heads / s.KVHeads // query heads per kv head
	return heads, 1, (r * heads / group) * s.HeadDim()
}

// New allocates a Layer for micro-batches of batch sequences of seq tokens.
// s must be valid (see Shape.Validate), batch and seq positive, and a
// shared Scratch sized for the same shape and tokens; the engine validates
// its config before building layers, so New panics on a violation.
func New(b backend.Backend, s Shape, batch, seq int, opts ...Option) *Layer {
	l, err := newLayer(b, s, batch, seq, opts, nil)
	if err != nil {
		panic(err.Error())
	}
	return l
}

// NewTensorParallel is New for a Layer built with WithTensorParallel (or
// any options), returning an error instead of panicking on a shape the
// tensor-parallel group cannot split.
func NewTensorParallel(b backend.Backend, s Shape, batch, seq int, opts ...Option) (*Layer, error) {
	return newLayer(b, s, batch, seq, opts, nil)
}

// contextGroup is what newLayer needs to build a Layer's ContextCore: the
// group and the full sequence (seq is then the rank's local rows a
// sequence, 2C).
type contextGroup struct {
	group   comm.Group
	fullSeq int
}

// newLayer is New and NewTensorParallel, and with cp set
// NewContextParallel's Layer, whose ContextCore it builds once the
// backward's scratch fits (the core says what type q, k and v are kept
// in).
func newLayer(b backend.Backend, s Shape, batch, seq int, opts []Option, cp *contextGroup) (*Layer, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	if batch < 1 || seq < 1 {
		return nil, fmt.Errorf("attention: batch %d and seq %d must be positive", batch, seq)
	}
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	if o.scratch == nil {
		o.scratch = NewScratch()
	}
	ft, T, D, s0 := b.FloatType(), batch*seq, s.Dim, s
	rows, kvRow := T, 0
	if o.tp.Enabled() {
		n := o.tp.Size()
		if s.Heads%n != 0 || s.KVHeads%n != 0 && n%s.KVHeads != 0 {
			return nil, fmt.Errorf("attention: heads (%d) must be a multiple of tp (%d), and kv_heads (%d) a multiple or a divisor of it", s.Heads, n, s.KVHeads)
		}
		if rows = o.tp.Rows(T); rows*n != T && o.tp.SequenceParallel() {
			return nil, fmt.Errorf("attention: %d rows of a micro-batch do not split over %d tensor-parallel ranks", T, n)
		}
		var h, kv int
		h, kv, kvRow = TensorParallelShape(s, n, o.tp.Rank())
		s = Shape{Dim: h * s.HeadDim(), Heads: h, KVHeads: kv, RopeTheta: s.RopeTheta}
	}
	q, kd := s.Heads*s.HeadDim(), s.KVHeads*s.HeadDim()
	// The core's output a and its gradient da: in the operand type on one
	// rank (the core writes a so and reads da so, o_proj's forward reads a
	// and its backward writes da so), else of the float type, which the
	// context-parallel cores and tensor parallelism's products take.
	daType := b.OperandType()
	if o.tp.Enabled() || cp != nil {
		daType = ft
	}
	if err := o.scratch.fit(b, daType, T, D, q, kd); err != nil {
		return nil, err
	}
	if o.tp.Enabled() {
		if err := o.scratch.fitTP(b, T, rows, D); err != nil {
			return nil, err
		}
	}
	qkvType := b.OperandType()
	var core *ContextCore
	if cp != nil {
		mode := o.cpMode
		if mode == "" {
			mode = CPAllGather
		}
		var err error
		if core, err = newContextCore(b, s, batch, cp.fullSeq, cp.group, mode, o.scratch, o.layer); err != nil {
			return nil, err
		}
		qkvType = core.QKVType()
	}
	sc := o.scratch
	var aTQ, lseBHS backend.Tensor
	if o.recompute || o.layer {
		if err := sc.fitCore(b, daType, T, q, batch*s.Heads*seq); err != nil {
			return nil, err
		}
		aTQ, lseBHS = sc.core.aTQ, sc.core.lseBHS
	} else {
		aTQ, lseBHS = b.New(daType, T, q), b.New(ft, batch, s.Heads, seq)
	}
	var qTQ, kTK, vTK backend.Tensor
	if o.layer {
		if err := sc.fitLayer(b, qkvType, T, q, kd); err != nil {
			return nil, err
		}
		qTQ, kTK, vTK = sc.layer.qTQ, sc.layer.kTK, sc.layer.vTK
	} else {
		qTQ, kTK, vTK = b.New(qkvType, T, q), b.New(qkvType, T, kd), b.New(qkvType, T, kd)
	}
	return &Layer{
		b:         b,
		s:         s,
		dim:       D,
		rows:      rows,
		tp:        o.tp,
		kvRow:     kvRow,
		kvWhole:   o.tp.Enabled() && s0.KVHeads%o.tp.Size() != 0,
		attn:      backend.AttnShape{Batch: batch, Seq: seq, Heads: s.Heads, KVHeads: s.KVHeads, HeadDim: s.HeadDim()},
		tokens:    T,
		qTQ:       qTQ,
		kTK:       kTK,
		vTK:       vTK,
		qkvType:   qkvType,
		aTQ:       aTQ,
		lseBHS:    lseBHS,
		recompute: o.recompute && !o.layer,
		cp:        core,
		sc:        sc,
		outBeta:   outBeta(o.addToOut),
		daTQ:      sc.daTQ,
		dqTQ:      sc.dqTQ,
		dkTK:      sc.dkTK,
		dvTK:      sc.dvTK,
	}, nil
}

// fit allocates the scratch for T tokens of width D and of q and kd
// columns, da of type daType, or checks that it has that size and type.
func (sc *Scratch) fit(b backend.Backend, daType backend.DType, T, D, q, kd int) error {
	ft := b.FloatType()
	if sc.daTQ == nil {
		sc.daTQ, sc.dqTQ = b.New(daType, T, q), b.New(ft, T, q)
		sc.dkTK, sc.dvTK = b.New(ft, T, kd), b.New(ft, T, kd)
		if ot := b.OperandType(); ot != ft {
			sc.ops = &operands{doutTD: b.New(ot, T, D), dqTQ: b.New(ot, T, q),
				dkTK: b.New(ot, T, kd), dvTK: b.New(ot, T, kd)}
		}
		return nil
	}
	if sc.daTQ.DType() != daType || sc.daTQ.Len() != T*q || sc.dkTK.Len() != T*kd {
		return fmt.Errorf("attention: the shared scratch is for %v [%d, %d] and [%d, %d]; this layer needs %v [%d, %d] and [%d, %d]",
			sc.daTQ.DType(), sc.daTQ.Shape()[0], sc.daTQ.Shape()[1], sc.dkTK.Shape()[0], sc.dkTK.Shape()[1], daType, T, q, T, kd)
	}
	return nil
}

// fitCore allocates the shared core output [T, q] of type aType and
// log-sum-exp (lse elements, laid out [B, H, S/cp]) of the layers built
// with RecomputeCore, or checks that they have that size and type.
func (sc *Scratch) fitCore(b backend.Backend, aType backend.DType, T, q, lse int) error {
	if sc.core == nil {
		sc.core = &coreScratch{aTQ: b.New(aType, T, q), lseBHS: b.New(b.FloatType(), lse)}
		return nil
	}
	if sc.core.aTQ.Len() != T*q || sc.core.lseBHS.Len() != lse || sc.core.aTQ.DType() != aType {
		return fmt.Errorf("attention: the shared recomputed core is %v %v and %d lse values; this layer needs %v [%d, %d] and %d",
			sc.core.aTQ.DType(), sc.core.aTQ.Shape(), sc.core.lseBHS.Len(), aType, T, q, lse)
	}
	return nil
}

// fitLayer allocates the shared rotated q [T, q], k and v [T, kd] of
// type ft of the layers built with RecomputeLayer, or checks that they
// have that size and type.
func (sc *Scratch) fitLayer(b backend.Backend, ft backend.DType, T, q, kd int) error {
	if sc.layer == nil {
		sc.layer = &layerScratch{qTQ: b.New(ft, T, q), kTK: b.New(ft, T, kd), vTK: b.New(ft, T, kd)}
		return nil
	}
	if sc.layer.qTQ.Len() != T*q || sc.layer.kTK.Len() != T*kd || sc.layer.qTQ.DType() != ft {
		return fmt.Errorf("attention: the shared recomputed q, k, v are %v %v and %v; this layer needs %v [%d, %d] and [%d, %d]",
			sc.layer.qTQ.DType(), sc.layer.qTQ.Shape(), sc.layer.kTK.Shape(), ft, T, q, T, kd)
	}
	return nil
}

// fitTP allocates the tensor-parallel scratch, or checks its size.
func (sc *Scratch) fitTP(b backend.Backend, T, rows, D int) error {
	if sc.tp == nil {
		ft := b.FloatType()
		sc.tp = &tpScratch{fullTD: b.New(ft, T, D), partialTD: b.New(ft, T, D), outTD: b.New(ft, rows, D)}
		return nil
	}
	if sc.tp.fullTD.Len() != T*D || sc.tp.outTD.Len() != rows*D {
		return fmt.Errorf("attention: the shared tensor-parallel scratch is for %v and %v; this layer needs [%d, %d] and [%d, %d]",
			sc.tp.fullTD.Shape(), sc.tp.outTD.Shape(), T, D, rows, D)
	}
	return nil
}

// kv returns the rows of k_proj or v_proj (weights or gradients) this
// Layer multiplies by: all of w, or under tensor parallelism with fewer
// kv heads than ranks the one head its queries use.
func (l *Layer) kv(w backend.Tensor) backend.Tensor {
	if !l.kvWhole {
		return w
	}
	return l.b.View(w, l.kvRow*l.dim, l.s.KVHeads*l.s.HeadDim(), l.dim)
}

// Forward writes outTD = o_proj(attention(rope(q_proj x), rope(k_proj x),
// v_proj x)) (or adds it to outTD: AddToOutput) for the normalised input
// xTD [T, D] at positions posT (Int32 [T]). x is of the float type or,
// without tensor parallelism, of the backend's operand type, which the
// projections then read as it is. It keeps xTD and posT by reference
// until Backward. It fails on tensors of the wrong shape or type and, on
// a context-parallel Layer, when a collective fails (a peer aborted the
// group); the Layer then has no Forward for Backward to use.
func (l *Layer) Forward(outTD, xTD, posT backend.Tensor, p *Params) error {
	l.xTD, l.posT = nil, nil
	if err := l.checkTD("Forward", "out", outTD); err != nil {
		return err
	}
	if err := l.checkTD("Forward", "x", xTD); err != nil {
		return err
	}
	if posT.Len() != l.tokens || posT.DType() != backend.Int32 {
		return fmt.Errorf("attention: Forward: pos is %v %v, want int32 [%d]", posT.DType(), posT.Shape(), l.tokens)
	}
	b, dh, theta := l.b, l.s.HeadDim(), l.s.RopeTheta
	if err := l.checkWeights(p); err != nil {
		return err
	}
	ops := l.sc.ops
	if ops == nil || l.tp.Enabled() {
		// The float products, and the gathers of tensor parallelism,
		// read x in the float type.
		if xTD.DType() != b.FloatType() {
			return fmt.Errorf("attention: Forward: x is %v, want %v", xTD.DType(), b.FloatType())
		}
	}
	x := xTD
	// The projections' outputs before RoPE: qTQ and kTK themselves (RoPE
	// in place), or where those are kept in another type the backward's
	// float scratch, which RoPE reads into them (see Layer.qkvType).
	qPre, kPre, vPre := l.qTQ, l.kTK, l.vTK
	if l.qkvType != b.FloatType() {
		qPre, kPre = l.dqTQ, l.dkTK
		if l.tp.Enabled() {
			// The tensor-parallel products write float32.
			vPre = l.dvTK
		}
	}
	if l.tp.Enabled() {
		// The backward gathers x again, so the gathered rows are not kept.
		outs, ws := []backend.Tensor{qPre, kPre, vPre}, []backend.Tensor{p.WqQD, l.kv(p.WkKD), l.kv(p.WvKD)}
		if err := l.tp.ColumnProducts(l.sc.tp.fullTD, xTD, outs, ws, true); err != nil {
			return err
		}
		if vPre != l.vTK {
			b.Copy(l.vTK, vPre)
		}
	} else {
		x = l.operandOf(xTD)
		b.MatMul(qPre, x, p.WqQD, false, true, 1, 0)
		b.MatMul(kPre, x, p.WkKD, false, true, 1, 0)
		b.MatMul(l.vTK, x, p.WvKD, false, true, 1, 0)
	}
	b.RoPE(l.qTQ, qPre, posT, dh, theta, false)
	b.RoPE(l.kTK, kPre, posT, dh, theta, false)
	if err := l.coreForward(); err != nil {
		return err
	}
	if l.tp.Enabled() {
		// o_proj is row-parallel: each rank's heads give a partial sum.
		sum := l.sc.tp.outTD
		if !l.tp.SequenceParallel() {
			sum = l.sc.tp.partialTD
		}
		if err := l.tp.RowForward(sum, l.sc.tp.partialTD, []tensorpar.Term{{A: l.aTQ, W: p.WoDQ, TransW: true}}); err != nil {
			return err
		}
		if l.outBeta != 0 {
			b.Axpy(outTD, 1, sum)
		} else {
			b.Copy(outTD, sum)
		}
	} else {
		b.MatMul(outTD, l.aTQ, p.WoDQ, false, true, 1, l.outBeta)
	}
	l.xTD, l.posT = xTD, posT
	return nil
}

// coreForward writes aTQ and lseBHS from the rotated q, k and v: the
// attention, or on a context-parallel Layer its core with the collectives
// (which every rank of the group runs together, in Forward and, under
// RecomputeCore, again in Backward).
func (l *Layer) coreForward() error {
	if l.cp != nil {
		return l.cp.Forward(l.aTQ, l.lseBHS, l.qTQ, l.kTK, l.vTK)
	}
	l.b.AttentionForward(l.aTQ, l.lseBHS, l.qTQ, l.kTK, l.vTK, l.attn)
	return nil
}

// checkWeights reports weights of the wrong size for this rank's heads.
func (l *Layer) checkWeights(p *Params) error {
	q, kd := l.s.Heads*l.s.HeadDim(), l.s.KVHeads*l.s.HeadDim()
	kvLen := kd * l.dim
	if l.kvWhole {
		kvLen = p.WkKD.Len() // the model's whole matrix, which must hold the rows used
		if kvLen < (l.kvRow+kd)*l.dim {
			kvLen = -1
		}
	}
	if p.WqQD.Len() != q*l.dim || p.WoDQ.Len() != q*l.dim || p.WkKD.Len() != kvLen || p.WvKD.Len() != kvLen {
		return fmt.Errorf("attention: weights of shapes %v %v %v %v; this layer's heads need q_proj [%d, %d], k_proj and v_proj [%d, %d], o_proj [%d, %d]",
			p.WqQD.Shape(), p.WkKD.Shape(), p.WvKD.Shape(), p.WoDQ.Shape(), q, l.dim, kd, l.dim, l.dim, q)
	}
	return nil
}

// Backward writes dxTD, the gradient of the last Forward's input, from
// doutTD, and adds the weight gradients into g. p must be the weights that
// Forward used. It fails without a successful Forward before it, on
// tensors of the wrong shape and, on a context-parallel Layer, when a
// collective fails; g may then hold part of the gradients.
func (l *Layer) Backward(dxTD, doutTD backend.Tensor, p, g *Params) error {
	if l.xTD == nil {
		return fmt.Errorf("attention: Backward called without a successful Forward")
	}
	if err := l.checkTD("Backward", "dx", dxTD); err != nil {
		return err
	}
	if err := l.checkTD("Backward", "dout", doutTD); err != nil {
		return err
	}
	b, dh, theta := l.b, l.s.HeadDim(), l.s.RopeTheta
	if l.recompute {
		// a and lse are the shared Scratch's, another layer's by now.
		if err := l.coreForward(); err != nil {
			return err
		}
	}

	// Each product input rounded once to the operand type (see operands).
	ops := l.sc.ops
	dout, x := doutTD, l.xTD
	dq, dk, dv := l.dqTQ, l.dkTK, l.dvTK
	if ops != nil && !l.tp.Enabled() {
		// Under tensor parallelism the gathered rows below are the
		// operand (doutTD may be this rank's shard of them).
		dout = l.operand(doutTD, ops.doutTD)
	}

	// o_proj: out = a·Woᵀ.
	if l.tp.Enabled() {
		// o_proj is row-parallel: its output gradient, gathered, feeds
		// this rank's columns, da = dout·Wo, the gather's own product
		// (AllGather+GEMM when fused, Wo read as stored); the weight
		// gradient reads the gathered rows.
		var err error
		if dout, err = l.tp.ColumnForward(l.sc.tp.fullTD, doutTD, []backend.Tensor{l.daTQ}, []backend.Tensor{p.WoDQ}, false); err != nil {
			return err
		}
	} else {
		b.MatMul(l.daTQ, dout, p.WoDQ, false, false, 1, 0)
	}
	b.MatMul(g.WoDQ, dout, l.aTQ, true, false, 1, 1)

	if l.cp != nil {
		if err := l.cp.Backward(l.dqTQ, l.dkTK, l.dvTK, l.daTQ); err != nil {
			return err
		}
	} else {
		b.AttentionBackward(l.dqTQ, l.dkTK, l.dvTK, l.daTQ, l.qTQ, l.kTK, l.vTK, l.aTQ, l.lseBHS, l.attn)
	}

	// RoPE is a rotation, so its backward rotates the gradient back: in
	// place, or (below) straight into the products' operands.
	if ops == nil || l.tp.Enabled() {
		b.RoPE(l.dqTQ, l.dqTQ, l.posT, dh, theta, true)
		b.RoPE(l.dkTK, l.dkTK, l.posT, dh, theta, true)
	}

	if l.tp.Enabled() {
		// The projections read x gathered again (Megatron's choice: one
		// all-gather rather than a saved [T, D] per layer).
		var err error
		if x, err = l.tp.GatherRows(l.sc.tp.fullTD, l.xTD); err != nil {
			return err
		}
		b.MatMul(g.WqQD, dq, x, true, false, 1, 1)
		b.MatMul(l.kv(g.WkKD), dk, x, true, false, 1, 1)
		b.MatMul(l.kv(g.WvKD), dv, x, true, false, 1, 1)
		return l.tp.ColumnBackward(dxTD, l.sc.tp.partialTD, []tensorpar.Term{
			{A: dq, W: p.WqQD}, {A: dk, W: l.kv(p.WkKD)}, {A: dv, W: l.kv(p.WvKD)}})
	}
	if ops != nil {
		x = l.operandOf(l.xTD)
		b.RoPE(ops.dqTQ, l.dqTQ, l.posT, dh, theta, true)
		b.RoPE(ops.dkTK, l.dkTK, l.posT, dh, theta, true)
		dq, dk, dv = ops.dqTQ, ops.dkTK, l.operand(l.dvTK, ops.dvTK)
	}
	// q/k/v projections: each reads x, so dx sums three terms.
	b.MatMul(g.WqQD, dq, x, true, false, 1, 1)
	b.MatMul(g.WkKD, dk, x, true, false, 1, 1)
	b.MatMul(g.WvKD, dv, x, true, false, 1, 1)
	b.MatMul(dxTD, dq, p.WqQD, false, false, 1, 0)
	b.MatMul(dxTD, dk, p.WkKD, false, false, 1, 1)
	b.MatMul(dxTD, dv, p.WvKD, false, false, 1, 1)
	return nil
}

// ContextPath names what runs a context-parallel Layer's attention
// (ContextCore.Path): "allgather", "fused ring in one pass", "fused ring"
// or "portable ring"; a Layer of one rank says "attention".
func (l *Layer) ContextPath() string {
	if l.cp == nil {
		return "attention"
	}
	return l.cp.Path()
}

// checkTD reports a t that is not [T, D] for the micro-batch the Layer was
// built for.
func (l *Layer) checkTD(op, name string, t backend.Tensor) error {
	if t.Len() != l.rows*l.dim {
		return fmt.Errorf("attention: %s: %s has shape %v, want [%d, %d]", op, name, t.Shape(), l.rows, l.dim)
	}
	return nil
}

func mustValid(s Shape) {
	if err := s.Validate(); err != nil {
		panic(err.Error())
	}
}
