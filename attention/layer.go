package attention

import (
	"fmt"

	"github.com/mktrain/mktrain/backend"
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
	b      backend.Backend
	s      Shape
	attn   backend.AttnShape
	tokens int

	// Saved by Forward. xTD and posT are the caller's tensors.
	xTD, posT backend.Tensor
	qTQ       backend.Tensor // q after RoPE
	kTK       backend.Tensor // k after RoPE
	vTK       backend.Tensor
	aTQ       backend.Tensor // attention output, the input of o_proj
	lseBHS    backend.Tensor

	// Backward scratch.
	daTQ, dqTQ, dkTK, dvTK backend.Tensor

	// cp is set on a Layer of a context-parallel group of more than one
	// rank (NewContextParallel); lseBHS is then laid out [B, 2, H, C].
	cp *contextParallel
}

// New allocates a Layer for micro-batches of batch sequences of seq tokens.
// s must be valid (see Shape.Validate); the engine validates its config
// before building layers.
func New(b backend.Backend, s Shape, batch, seq int) *Layer {
	mustValid(s)
	if batch < 1 || seq < 1 {
		panic(fmt.Sprintf("attention: batch %d and seq %d must be positive", batch, seq))
	}
	ft, T := b.FloatType(), batch*seq
	q, kd := s.Heads*s.HeadDim(), s.KVHeads*s.HeadDim()
	return &Layer{
		b:      b,
		s:      s,
		attn:   backend.AttnShape{Batch: batch, Seq: seq, Heads: s.Heads, KVHeads: s.KVHeads, HeadDim: s.HeadDim()},
		tokens: T,
		qTQ:    b.New(ft, T, q),
		kTK:    b.New(ft, T, kd),
		vTK:    b.New(ft, T, kd),
		aTQ:    b.New(ft, T, q),
		lseBHS: b.New(ft, batch, s.Heads, seq),
		daTQ:   b.New(ft, T, q),
		dqTQ:   b.New(ft, T, q),
		dkTK:   b.New(ft, T, kd),
		dvTK:   b.New(ft, T, kd),
	}
}

func mustValid(s Shape) {
	if err := s.Validate(); err != nil {
		panic(err.Error())
	}
}

// Forward writes outTD = o_proj(attention(rope(q_proj x), rope(k_proj x),
// v_proj x)) for the normalised input xTD [T, D] at positions posT (Int32
// [T]). It keeps xTD and posT by reference until Backward.
func (l *Layer) Forward(outTD, xTD, posT backend.Tensor, p *Params) {
	l.checkTD("Forward", "out", outTD)
	l.checkTD("Forward", "x", xTD)
	if posT.Len() != l.tokens || posT.DType() != backend.Int32 {
		panic(fmt.Sprintf("attention: Forward: pos is %v %v, want int32 [%d]", posT.DType(), posT.Shape(), l.tokens))
	}
	b, dh, theta := l.b, l.s.HeadDim(), l.s.RopeTheta
	b.MatMul(l.qTQ, xTD, p.WqQD, false, true, 1, 0)
	b.MatMul(l.kTK, xTD, p.WkKD, false, true, 1, 0)
	b.MatMul(l.vTK, xTD, p.WvKD, false, true, 1, 0)
	b.RoPE(l.qTQ, posT, dh, theta, false)
	b.RoPE(l.kTK, posT, dh, theta, false)
	if l.cp != nil {
		l.cp.forward(l)
	} else {
		b.AttentionForward(l.aTQ, l.lseBHS, l.qTQ, l.kTK, l.vTK, l.attn)
	}
	b.MatMul(outTD, l.aTQ, p.WoDQ, false, true, 1, 0)
	l.xTD, l.posT = xTD, posT
}

// Backward writes dxTD, the gradient of the last Forward's input, from
// doutTD, and adds the weight gradients into g. p must be the weights that
// Forward used.
func (l *Layer) Backward(dxTD, doutTD backend.Tensor, p, g *Params) {
	if l.xTD == nil {
		panic("attention: Backward called before Forward")
	}
	l.checkTD("Backward", "dx", dxTD)
	l.checkTD("Backward", "dout", doutTD)
	b, dh, theta := l.b, l.s.HeadDim(), l.s.RopeTheta

	// o_proj: out = a·Woᵀ.
	b.MatMul(l.daTQ, doutTD, p.WoDQ, false, false, 1, 0)
	b.MatMul(g.WoDQ, doutTD, l.aTQ, true, false, 1, 1)

	if l.cp != nil {
		l.cp.backward(l)
	} else {
		b.AttentionBackward(l.dqTQ, l.dkTK, l.dvTK, l.daTQ, l.qTQ, l.kTK, l.vTK, l.aTQ, l.lseBHS, l.attn)
	}

	// RoPE is a rotation, so its backward rotates the gradient back.
	b.RoPE(l.dqTQ, l.posT, dh, theta, true)
	b.RoPE(l.dkTK, l.posT, dh, theta, true)

	// q/k/v projections: each reads x, so dx sums three terms.
	b.MatMul(g.WqQD, l.dqTQ, l.xTD, true, false, 1, 1)
	b.MatMul(g.WkKD, l.dkTK, l.xTD, true, false, 1, 1)
	b.MatMul(g.WvKD, l.dvTK, l.xTD, true, false, 1, 1)
	b.MatMul(dxTD, l.dqTQ, p.WqQD, false, false, 1, 0)
	b.MatMul(dxTD, l.dkTK, p.WkKD, false, false, 1, 1)
	b.MatMul(dxTD, l.dvTK, p.WvKD, false, false, 1, 1)
}

// checkTD panics unless t is [T, D] for the micro-batch the Layer was built
// for.
func (l *Layer) checkTD(op, name string, t backend.Tensor) {
	if t.Len() != l.tokens*l.s.Dim {
		panic(fmt.Sprintf("attention: %s: %s has shape %v, want [%d, %d]", op, name, t.Shape(), l.tokens, l.s.Dim))
	}
}
