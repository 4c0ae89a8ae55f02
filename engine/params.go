package engine

import (
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"sync"

	"github.com/mktrain/mktrain/attention"
	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/moe"
)

// Parameter names are Hugging Face Mixtral's, so they do not depend on the
// parallel layout and an export needs no renaming. Options beyond Mixtral
// (shared experts) get names in the same style.
const (
	nameEmbed     = "model.embed_tokens.weight"
	nameFinalNorm = "model.norm.weight"
	nameLMHead    = "lm_head.weight"
)

func layerName(l int, suffix string) string { return fmt.Sprintf("model.layers.%d.%s", l, suffix) }

// expertName is the name of expert j's matrix w ("w1", "w2", "w3") in layer l.
func expertName(l, j int, w string) string {
	return fmt.Sprintf("model.layers.%d.block_sparse_moe.experts.%d.%s.weight", l, j, w)
}

// layerParams holds one decoder layer's tensors (weights, or their gradients).
type layerParams struct {
	attnNormD, ffnNormD backend.Tensor
	attn                *attention.Params
	moe                 *moe.Params
}

// modelParams holds every tensor of one rank's model replica. The same
// struct holds weights and gradients.
type modelParams struct {
	embedVD, finalNormD, lmHeadVD backend.Tensor
	layers                        []layerParams
}

// paramStore is one kind of per-parameter state of a rank (the weights,
// their gradients, or an AdamW moment): one contiguous tensor, every
// parameter a view into it at the offsets of a flatLayout. Whole-model
// passes (zeroing the gradients, their norm, clipping, the cross-rank
// reductions, AdamW) then cost a call or two over long ranges rather than
// one per tensor.
type paramStore struct {
	flat backend.Tensor // [layout.total]
	p    *modelParams   // views into flat
}

// newParamStore allocates a zeroed store laid out by lay.
func newParamStore(b backend.Backend, m ModelConfig, lay *flatLayout) paramStore {
	flat := b.New(b.FloatType(), lay.total)
	p := newModelParams(m)
	for i, s := range lay.slots {
		*s.pick(p) = b.View(flat, lay.offset[i], lay.shape[i]...)
	}
	return paramStore{flat: flat, p: p}
}

// newModelParams returns a modelParams of m's layers with every tensor nil.
func newModelParams(m ModelConfig) *modelParams {
	p := &modelParams{layers: make([]layerParams, m.Layers)}
	for l := range p.layers {
		p.layers[l] = layerParams{attn: &attention.Params{}, moe: &moe.Params{}}
	}
	return p
}

// view returns the store's elements [r.lo, r.hi).
func (ps paramStore) view(b backend.Backend, r span) backend.Tensor {
	return b.View(ps.flat, r.lo, r.hi-r.lo)
}

// operandStore is the weights as the layers multiply by them: in the
// backend's operand type (bf16 on the GPU), rounded from the float32 masters
// once per step instead of inside every product that reads them. Norm
// weights and the embedding table, which no product reads, are the masters
// themselves. Where the operand type is the float type (the CPU), the
// store is the masters and refresh does nothing.
type operandStore struct {
	p    *modelParams   // what the model reads
	flat backend.Tensor // the operand copy of the masters' flat store; nil when they are the operands
	src  backend.Tensor // the masters' flat store
}

func newOperandStore(b backend.Backend, m ModelConfig, lay *flatLayout, w paramStore) operandStore {
	ot := b.OperandType()
	if ot == b.FloatType() {
		return operandStore{p: w.p}
	}
	flat := b.New(ot, lay.total)
	p := newModelParams(m)
	for i, s := range lay.slots {
		if keepsFloat32(s) {
			*s.pick(p) = *s.pick(w.p)
			continue
		}
		*s.pick(p) = b.View(flat, lay.offset[i], lay.shape[i]...)
	}
	return operandStore{p: p, flat: flat, src: w.flat}
}

// refresh rounds the masters into the operand copy: after every change of
// the weights (an optimizer step, a restore) and before the model reads
// them. The norms and the embedding table are rounded too, unread: one
// pass over the whole store is cheaper than one per tensor.
func (o operandStore) refresh(b backend.Backend) {
	if o.flat != nil {
		b.Copy(o.flat, o.src)
	}
}

// span is a range [lo, hi) of a flat store.
type span struct{ lo, hi int }

func (r span) empty() bool { return r.hi <= r.lo }

// flatLayout places every parameter of one rank in a flat store: norms
// first, then the other replicated matrices, then this rank's experts, each
// tensor starting on a flatAlign boundary. So the replicated tensors are
// one range (reduced over the data group), the experts another (reduced
// over the ranks holding the same experts), and the norms, which take no
// weight decay, a prefix. The padding between tensors stays zero in every
// store, and AdamW keeps zero weights with zero gradients at zero. Under
// ZeRO-1 the replicated range ends in more such padding (padReplicated).
//
// Under tensor parallelism (tp above 1) the matrices are ordered further:
// the embedding, then the matrices every tp rank holds whole and computes
// gradients for on its own rows (the router, shared experts, k_proj and
// v_proj when they are not split), then the matrices split over tp
// (tpSplit), each rank's block; so the gradients summed over the tensor
// group (tpSummed) and the split ones (tpSharded) are each one range.
type flatLayout struct {
	slots  []paramSlot // in slots() order
	offset []int       // per slot, elements into the store
	shape  [][]int     // per slot, the local tensor's shape
	split  []tpSplit   // per slot, its cut over the tensor-parallel ranks
	total  int

	norms, replicated, experts span
	// tpSummed is the range whose gradients are summed over the tensor
	// group, tpSharded the range of the tp ranks' own blocks; both empty
	// with tp 1.
	tpSummed, tpSharded span
}

// padded is slot i's length in the store: its elements, padded to
// flatAlign.
func (lay *flatLayout) padded(i int) int {
	return (shapeLen(lay.shape[i]) + flatAlign - 1) / flatAlign * flatAlign
}

// flatAlign keeps every view 256-byte aligned (64 float32s), as the
// allocator's own tensors are: the vectorised kernels and cuBLASLt's
// fastest algorithms need it.
const flatAlign = 64

// tpRank is a rank's place in its tensor-parallel group and the mode.
type tpRank struct {
	n, r int
	sp   bool // sequence parallelism
}

// noTP is a rank without tensor parallelism.
var noTP = tpRank{n: 1}

func newFlatLayout(m ModelConfig, localExperts int) *flatLayout {
	return newFlatLayoutTP(m, localExperts, noTP)
}

// layoutClass orders the slots in the store (see flatLayout).
func layoutClass(m ModelConfig, s paramSlot, tp tpRank) int {
	switch {
	case s.role == roleNorm:
		return 0
	case s.role == roleExpert:
		return 4
	case tp.n == 1:
		return 3
	case s.name == nameEmbed:
		return 1
	case slotSplit(m, s, tp).n > 1:
		return 3
	}
	return 2
}

func newFlatLayoutTP(m ModelConfig, localExperts int, tp tpRank) *flatLayout {
	ss := slots(m)
	lay := &flatLayout{slots: ss, offset: make([]int, len(ss)), shape: make([][]int, len(ss)), split: make([]tpSplit, len(ss))}
	for i, s := range ss {
		lay.split[i] = slotSplit(m, s, tp)
		lay.shape[i] = lay.split[i].local(slotShape(m, s))
		if s.role == roleExpert {
			lay.shape[i] = append([]int{localExperts}, lay.shape[i]...)
		}
	}
	off := 0
	var classes [5]span
	for class := range classes {
		lo := off
		for i, s := range ss {
			if layoutClass(m, s, tp) != class {
				continue
			}
			lay.offset[i] = off
			off += lay.padded(i)
		}
		classes[class] = span{lo, off}
	}
	lay.norms, lay.experts = classes[0], classes[4]
	lay.replicated = span{0, lay.experts.lo}
	lay.total = off
	if tp.n > 1 {
		lay.tpSharded = classes[3]
		lay.tpSummed = span{classes[2].lo, classes[2].hi}
		if tp.sp {
			// The norms and the embedding see this rank's rows only.
			lay.tpSummed.lo = 0
		}
	}
	return lay
}

// tpSplit is how tensor parallelism cuts one parameter: along dim (0: rows,
// 1: columns) into n blocks, of which the rank holds block r; n is 1 for a
// parameter every rank holds whole.
type tpSplit struct{ dim, n, r int }

// slotSplit is s's cut over tp: q_proj by rows (query heads), k_proj and
// v_proj by rows when the kv heads divide over tp (else whole), o_proj by
// columns, the LM head by rows (the vocabulary). Everything else is whole.
func slotSplit(m ModelConfig, s paramSlot, tp tpRank) tpSplit {
	whole := tpSplit{n: 1}
	if tp.n == 1 || s.role != roleMatrix {
		return whole
	}
	switch {
	case s.name == nameLMHead, strings.HasSuffix(s.name, "q_proj.weight"):
		return tpSplit{dim: 0, n: tp.n, r: tp.r}
	case strings.HasSuffix(s.name, "k_proj.weight"), strings.HasSuffix(s.name, "v_proj.weight"):
		if m.KVHeads%tp.n == 0 {
			return tpSplit{dim: 0, n: tp.n, r: tp.r}
		}
	case strings.HasSuffix(s.name, "o_proj.weight"):
		return tpSplit{dim: 1, n: tp.n, r: tp.r}
	}
	return whole
}

// local is the shape of the rank's block of a tensor of shape global.
func (sp tpSplit) local(global []int) []int {
	out := slices.Clone(global)
	if sp.n > 1 {
		out[sp.dim] /= sp.n
	}
	return out
}

// tpSegment is a run of a rank's block that is contiguous in the whole
// tensor: n elements at local in the block and at global in the tensor
// (both flat, row-major).
type tpSegment struct{ local, global, n int }

// segments lists the rank's block of a tensor of shape global as runs
// contiguous in both: one for a row cut, one per row for a column cut.
func (sp tpSplit) segments(global []int) []tpSegment {
	n := shapeLen(global)
	if sp.n == 1 {
		return []tpSegment{{0, 0, n}}
	}
	rows, cols := global[0], n/global[0]
	if sp.dim == 0 {
		size := rows / sp.n * cols
		return []tpSegment{{0, sp.r * size, size}}
	}
	bc := cols / sp.n
	out := make([]tpSegment, rows)
	for i := range out {
		out[i] = tpSegment{i * bc, i*cols + sp.r*bc, bc}
	}
	return out
}

// block copies the rank's block out of whole, a tensor of shape global.
func (sp tpSplit) block(whole []float32, global []int) []float32 {
	if sp.n == 1 {
		return whole
	}
	out := make([]float32, shapeLen(sp.local(global)))
	for _, sg := range sp.segments(global) {
		copy(out[sg.local:sg.local+sg.n], whole[sg.global:sg.global+sg.n])
	}
	return out
}

// padReplicated lengthens the replicated span to n elements (at least its
// length), moving the experts after it: ZeRO-1 cuts the span into equal
// pieces, one per rank and round (zero.go). The padding is zero in every
// store, as the padding between tensors is.
func (lay *flatLayout) padReplicated(n int) {
	delta := n - (lay.replicated.hi - lay.replicated.lo)
	if delta <= 0 {
		return
	}
	for i, s := range lay.slots {
		if s.role == roleExpert {
			lay.offset[i] += delta
		}
	}
	lay.replicated.hi += delta
	lay.experts = span{lay.experts.lo + delta, lay.experts.hi + delta}
	lay.total += delta
}

func attentionShape(m ModelConfig) attention.Shape {
	return attention.Shape{Dim: m.Dim, Heads: m.Heads, KVHeads: m.KVHeads, RopeTheta: m.RopeTheta}
}

// rankAttentionShape is the attention one rank computes: the model's, or
// under tensor parallelism its share of the heads (as attention's
// WithTensorParallel cuts them), which is what context parallelism's
// attention runs on and so what its mode is measured and planned for.
func rankAttentionShape(c Config) attention.Shape {
	s := attentionShape(c.Model)
	if tp := c.Parallel.TP; tp > 1 {
		h, kv, _ := attention.TensorParallelShape(s, tp, 0)
		s = attention.Shape{Dim: h * s.HeadDim(), Heads: h, KVHeads: kv, RopeTheta: s.RopeTheta}
	}
	return s
}

// tensorRole says how a parameter is initialised, decayed and reduced.
type tensorRole int

const (
	roleNorm   tensorRole = iota // RMSNorm weight: init 1, no weight decay
	roleMatrix                   // dense weight replicated on every rank
	roleExpert                   // stacked [E_local, ...] expert weights, sharded over EP
)

// paramSlot describes one tensor of modelParams.
type paramSlot struct {
	name string // for experts: a fmt pattern taking the global expert index
	role tensorRole
	pick func(*modelParams) *backend.Tensor
}

// slots lists every parameter in a fixed order: the order of optimizer
// state, gradient reduction and checkpoints.
func slots(m ModelConfig) []paramSlot {
	s := []paramSlot{{nameEmbed, roleMatrix, func(p *modelParams) *backend.Tensor { return &p.embedVD }}}
	for l := 0; l < m.Layers; l++ {
		s = append(s,
			paramSlot{layerName(l, "input_layernorm.weight"), roleNorm, func(p *modelParams) *backend.Tensor { return &p.layers[l].attnNormD }},
			paramSlot{layerName(l, "self_attn.q_proj.weight"), roleMatrix, func(p *modelParams) *backend.Tensor { return &p.layers[l].attn.WqQD }},
			paramSlot{layerName(l, "self_attn.k_proj.weight"), roleMatrix, func(p *modelParams) *backend.Tensor { return &p.layers[l].attn.WkKD }},
			paramSlot{layerName(l, "self_attn.v_proj.weight"), roleMatrix, func(p *modelParams) *backend.Tensor { return &p.layers[l].attn.WvKD }},
			paramSlot{layerName(l, "self_attn.o_proj.weight"), roleMatrix, func(p *modelParams) *backend.Tensor { return &p.layers[l].attn.WoDQ }},
			paramSlot{layerName(l, "post_attention_layernorm.weight"), roleNorm, func(p *modelParams) *backend.Tensor { return &p.layers[l].ffnNormD }},
			paramSlot{layerName(l, "block_sparse_moe.gate.weight"), roleMatrix, func(p *modelParams) *backend.Tensor { return &p.layers[l].moe.GateED }},
			paramSlot{fmt.Sprintf("model.layers.%d.block_sparse_moe.experts.%%d.w1.weight", l), roleExpert, func(p *modelParams) *backend.Tensor { return &p.layers[l].moe.W1EFD }},
			paramSlot{fmt.Sprintf("model.layers.%d.block_sparse_moe.experts.%%d.w2.weight", l), roleExpert, func(p *modelParams) *backend.Tensor { return &p.layers[l].moe.W2EDF }},
			paramSlot{fmt.Sprintf("model.layers.%d.block_sparse_moe.experts.%%d.w3.weight", l), roleExpert, func(p *modelParams) *backend.Tensor { return &p.layers[l].moe.W3EFD }},
		)
		if m.MoE.SharedExperts > 0 {
			s = append(s,
				paramSlot{layerName(l, "block_sparse_moe.shared_experts.w1.weight"), roleMatrix, func(p *modelParams) *backend.Tensor { return &p.layers[l].moe.SharedW1FD }},
				paramSlot{layerName(l, "block_sparse_moe.shared_experts.w2.weight"), roleMatrix, func(p *modelParams) *backend.Tensor { return &p.layers[l].moe.SharedW2DF }},
				paramSlot{layerName(l, "block_sparse_moe.shared_experts.w3.weight"), roleMatrix, func(p *modelParams) *backend.Tensor { return &p.layers[l].moe.SharedW3FD }},
			)
		}
	}
	return append(s,
		paramSlot{nameFinalNorm, roleNorm, func(p *modelParams) *backend.Tensor { return &p.finalNormD }},
		paramSlot{nameLMHead, roleMatrix, func(p *modelParams) *backend.Tensor { return &p.lmHeadVD }},
	)
}

// param binds one parameter's weight, gradient and AdamW moments. m and v
// are nil on a rank that does not train, and for a replicated parameter
// under ZeRO-1, whose moments are spread over the ranks (zero.go).
type param struct {
	slot       paramSlot
	w, g, m, v backend.Tensor
	// lo is the low halves of w's masters where they are split
	// (master_split.go): w is then their bf16 halves. Read and write w's
	// values through download and upload.
	lo          backend.Tensor
	firstExpert int     // roleExpert: global index of the first local expert
	split       tpSplit // the rank's block of the tensor under tensor parallelism
	global      []int   // the whole tensor's shape (of one expert for experts)
}

// tensorRNG returns the random stream that initialises one named tensor. It
// depends only on the seed and the name, so a model initialises identically
// under every parallel layout.
func tensorRNG(seed uint64, name string) *rand.Rand {
	h := fnv.New64a()
	h.Write([]byte(name))
	return rand.New(rand.NewPCG(seed, h.Sum64()))
}

// initParam fills p.w: norms with ones, matrices (and each expert matrix)
// with N(0, std).
func initParam(b backend.Backend, p *param, seed uint64, std float64) {
	if p.lo != nil {
		// Split masters: float32 values, split in place into the bf16
		// halves (no float64 copy: the host holds 8 bytes an element,
		// as plan/host.go counts).
		w := fillParam[float32](p, seed, std)
		lo := backend.SplitMastersInPlace(w)
		backend.UploadSlice(b, p.w, w)
		backend.UploadSlice(b, p.lo, lo)
		return
	}
	backend.UploadSlice(b, p.w, fillParam[float64](p, seed, std))
}

// fillParam is initParam's values of p: norms ones, matrices (and each
// expert matrix) N(0, std) from the tensor's own stream.
func fillParam[T float32 | float64](p *param, seed uint64, std float64) []T {
	n := p.w.Len()
	host := make([]T, n)
	switch p.slot.role {
	case roleNorm:
		for i := range host {
			host[i] = 1
		}
	case roleMatrix:
		if p.split.n > 1 {
			// The whole tensor's stream, kept where it falls in the
			// block: every layout initialises the same model.
			whole := make([]T, shapeLen(p.global))
			fillNormal(whole, tensorRNG(seed, p.slot.name), std)
			for _, sg := range p.split.segments(p.global) {
				copy(host[sg.local:sg.local+sg.n], whole[sg.global:sg.global+sg.n])
			}
			break
		}
		fillNormal(host, tensorRNG(seed, p.slot.name), std)
	case roleExpert:
		// Each expert has its own stream, so the host's cores fill them
		// side by side: the experts are most of the parameters (moe-fine's
		// 4.4 billion draws take over a minute on one core).
		shape := p.w.Shape()
		per := n / shape[0]
		var wg sync.WaitGroup
		next := make(chan int, shape[0])
		for j := range shape[0] {
			next <- j
		}
		close(next)
		for range min(shape[0], runtime.GOMAXPROCS(0)) {
			wg.Go(func() {
				for j := range next {
					name := fmt.Sprintf(p.slot.name, p.firstExpert+j)
					fillNormal(host[j*per:(j+1)*per], tensorRNG(seed, name), std)
				}
			})
		}
		wg.Wait()
	}
	return host
}

// fillNormal fills x with N(0, std) draws, each made in float64 and
// rounded to T: float32 values are those of a float64 fill rounded after.
func fillNormal[T float32 | float64](x []T, rng *rand.Rand, std float64) {
	for i := range x {
		x[i] = T(rng.NormFloat64() * std)
	}
}

// NamedShape is one tensor of a model as it appears in checkpoints and
// exports.
type NamedShape struct {
	Name  string
	Shape []int
}

// ParamShapes lists every model tensor of m by its layout-independent name,
// one entry per expert, in checkpoint order.
func ParamShapes(m ModelConfig) []NamedShape {
	var out []NamedShape
	for _, s := range slots(m) {
		shape := slotShape(m, s)
		if s.role != roleExpert {
			out = append(out, NamedShape{s.name, shape})
			continue
		}
		for j := 0; j < m.MoE.Experts; j++ {
			out = append(out, NamedShape{fmt.Sprintf(s.name, j), shape})
		}
	}
	return out
}

// slotShape is the shape of one tensor of slot s (of one expert, for
// expert slots).
func slotShape(m ModelConfig, s paramSlot) []int {
	D, Q, KD, F, E := m.Dim, m.Heads*m.HeadDim(), m.KVHeads*m.HeadDim(), m.MoE.FFN, m.MoE.Experts
	SF := m.MoE.SharedExperts * F
	switch {
	case s.name == nameEmbed || s.name == nameLMHead:
		return []int{m.Vocab, D}
	case s.role == roleNorm:
		return []int{D}
	case strings.HasSuffix(s.name, "q_proj.weight"):
		return []int{Q, D}
	case strings.HasSuffix(s.name, "k_proj.weight"), strings.HasSuffix(s.name, "v_proj.weight"):
		return []int{KD, D}
	case strings.HasSuffix(s.name, "o_proj.weight"):
		return []int{D, Q}
	case strings.HasSuffix(s.name, "gate.weight"):
		return []int{E, D}
	case strings.HasSuffix(s.name, "shared_experts.w2.weight"):
		return []int{D, SF}
	case strings.Contains(s.name, "shared_experts."):
		return []int{SF, D}
	case strings.HasSuffix(s.name, "w2.weight"):
		return []int{D, F}
	}
	return []int{F, D} // w1, w3
}
