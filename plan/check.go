package plan

// The verdict: whether a run fits, and if not, one sentence that says by
// how much and which recipe fields to change.

import (
	"fmt"
	"strings"
)

// MaxMicroBatches bounds the micro-batches one rank runs per optimizer
// step (train.global_batch / (train.micro_batch * dp*ep)). Far more than
// any real run accumulates, it turns a global batch typed with too many
// zeros into a refusal instead of a first step that never ends.
const MaxMicroBatches = 1 << 16

// Refusal is the plan's reason a run cannot start: Msg is one sentence
// that names the recipe fields to change, Fields their paths.
type Refusal struct {
	Fields []string
	Msg    string
}

func (r *Refusal) Error() string { return r.Msg }

// Check returns nil when the run fits, else a *Refusal: a step whose
// tokens do not fit in an int64 or that takes more than MaxMicroBatches
// micro-batches per rank; or a device (on the CPU backend, the host)
// whose memory is known and smaller than the plan's peak. With balanced
// routing within the memory but the routing bound beyond it, the run
// is not refused (Warning says so).
func (p Plan) Check() error {
	c := p.Config
	if p.TokensPerStep == Saturated {
		return &Refusal{Fields: []string{"train.global_batch", "train.seq"},
			Msg: fmt.Sprintf("train.global_batch (%d) x train.seq (%d) tokens per optimizer step do not fit in a 64-bit count; lower train.global_batch",
				c.GlobalBatch, c.Seq)}
	}
	if p.MicroBatches > MaxMicroBatches {
		return &Refusal{Fields: []string{"train.global_batch", "train.micro_batch"},
			Msg: fmt.Sprintf("train.global_batch (%d) is %d micro-batches of train.micro_batch (%d) per optimizer step on each of the %d data-parallel ranks, more than the %d a step may take; lower train.global_batch or raise train.micro_batch",
				c.GlobalBatch, p.MicroBatches, c.MicroBatch, c.DP*c.EP, MaxMicroBatches)}
	}
	need, where := p.need(), "memory on each "+p.Device.Name
	if p.Device.Backend == BackendCPU {
		where = "host memory"
	}
	if p.Device.Memory <= 0 || need <= p.Device.Memory {
		return nil
	}
	fields, advice := p.advice()
	return &Refusal{Fields: fields, Msg: fmt.Sprintf("the run needs %s of %s, which has %s (%s); %s",
		FormatBytes(need), where, FormatBytes(p.Device.Memory), p.breakdown(), advice)}
}

// Warning is a sentence for a run that fits with balanced routing but
// not when routing sends a rank the most rows it can (several expert
// ranks, dropless), or whose host transients exceed host memory (GPU
// runs; hostMemory 0 skips that); "" otherwise.
func (p Plan) Warning(hostMemory int64) string {
	var w []string
	if p.Device.Backend == BackendCUDA && p.Device.Memory > 0 && p.Peak <= p.Device.Memory && p.Worst > p.Device.Memory {
		w = append(w, fmt.Sprintf("the run fits %s with balanced routing (%s) but not if routing sent one rank's experts the most rows it can (%s); set model.moe.capacity_factor to bound them",
			p.Device.Name, FormatBytes(p.Peak), FormatBytes(p.Worst)))
	}
	if p.Device.Backend == BackendCUDA && hostMemory > 0 && p.HostPeak > hostMemory {
		w = append(w, fmt.Sprintf("the host needs %s at its peak (%s), more than its %s",
			FormatBytes(p.HostPeak), p.hostLargest(), FormatBytes(hostMemory)))
	}
	return strings.Join(w, "; ")
}

// hostLargest names the largest host transient.
func (p Plan) hostLargest() string {
	best := Term{}
	for _, t := range p.Host {
		if t.Bytes > best.Bytes {
			best = t
		}
	}
	return best.What
}

// breakdown is the per-rank bytes by kind, "weights 2.5 GiB, ...".
func (p Plan) breakdown() string {
	var parts []string
	for _, k := range p.Kinds() {
		parts = append(parts, fmt.Sprintf("%s %s", k, FormatBytes(p.Total(k))))
	}
	if p.DeviceRanks > 1 {
		return fmt.Sprintf("per rank, %d ranks on it: %s", p.DeviceRanks, strings.Join(parts, ", "))
	}
	return strings.Join(parts, ", ")
}

// need is the bytes the verdict compares with the device's memory: one
// device's peak, or on the CPU the host's.
func (p Plan) need() int64 {
	if p.Device.Backend == BackendCPU {
		return p.HostPeak
	}
	return p.Peak
}

// fitsWith reports whether the run fits with c instead of p's config.
func (p Plan) fitsWith(c Config) bool {
	q, err := New(c, p.Device)
	return err == nil && q.need() <= p.Device.Memory
}

// largestFitting is the largest v in [lo, hi] for which fits holds, by
// bisection (memory grows with v), or 0 when none does.
func largestFitting(lo, hi int, fits func(int) bool) int {
	if hi < lo || !fits(lo) {
		return 0
	}
	for lo < hi {
		mid := lo + (hi-lo+1)/2
		if fits(mid) {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	return lo
}

// advice names the fields to change: those of sizeAdvice, and
// train.recompute: selective where the run fits with it alone, else full
// where that fits (it reruns more: each layer's whole forward), and
// train.grad_clip: 0 where clipping alone keeps the experts' update out of
// the backward and the run fits with it there.
func (p Plan) advice() ([]string, string) {
	fields, text := p.recomputeAdvice()
	if c := p.Config; !c.ExpertsInBackward && c.ExpertsInBackwardUnclipped {
		c.ExpertsInBackward = true
		if p.fitsWith(c) {
			fields = append(fields, "train.grad_clip")
			text += ", or set train.grad_clip: 0 (without clipping AdamW updates each layer's experts in the backward, and one layer's expert gradients are held instead of every layer's)"
		}
	}
	return fields, text
}

// recomputeAdvice is sizeAdvice and the train.recompute part of advice.
func (p Plan) recomputeAdvice() ([]string, string) {
	fields, text := p.sizeAdvice()
	if p.Config.Recompute == RecomputeFull {
		return fields, text
	}
	if c := p.Config; c.Recompute != RecomputeSelective {
		c.Recompute = RecomputeSelective
		if p.fitsWith(c) {
			return append(fields, "train.recompute"), text +
				", or set train.recompute: selective (the attention core and the experts' hidden activations remade in the backward instead of kept per layer)"
		}
	}
	if c := p.Config; p.fitsWith(func() Config { c.Recompute = RecomputeFull; return c }()) {
		return append(fields, "train.recompute"), text +
			", or set train.recompute: full (each layer's forward rerun before its backward: one layer's activations kept instead of every layer's)"
	}
	return fields, text
}

// sizeAdvice names the sizes to change: a smaller train.micro_batch when
// one fits, else a shorter train.seq at micro-batch 1, else what spreads
// or shrinks the parameters' state: parallel.ep, parallel.zero, and the
// model fields of its largest part.
func (p Plan) sizeAdvice() ([]string, string) {
	c := p.Config
	if c.MicroBatch > 1 {
		// Several micro-batches per step add into the experts' gradients,
		// which then cannot be updated in the backward.
		b := largestFitting(1, c.MicroBatch-1, func(b int) bool {
			c2 := c
			c2.MicroBatch, c2.ExpertsInBackward = b, false
			return p.fitsWith(c2)
		})
		if b > 0 {
			// train.global_batch must stay a multiple of micro_batch x
			// dp*ep: the largest divisor of a rank's share that fits.
			perRank := c.GlobalBatch / (c.DP * c.EP)
			for d := b; d >= 1 && b-d < 1<<20; d-- {
				if perRank%d == 0 {
					return []string{"train.micro_batch"}, fmt.Sprintf(
						"lower train.micro_batch (%d) to %d (train.global_batch %d then takes %d micro-batches per step)",
						c.MicroBatch, d, c.GlobalBatch, perRank/d)
				}
			}
			return []string{"train.micro_batch", "train.global_batch"}, fmt.Sprintf(
				"lower train.micro_batch (%d) to %d or less, with train.global_batch (%d) a multiple of it times the %d data-parallel ranks",
				c.MicroBatch, b, c.GlobalBatch, c.DP*c.EP)
		}
	}
	one := c
	if one.MicroBatch > 1 {
		one.MicroBatch, one.ExpertsInBackward = 1, false // micro-batches add up, as above
	}
	step := 2 * c.CP // seq stays a multiple of 2*cp (one rank: of 2)
	if m := largestFitting(1, (c.Seq-1)/step, func(m int) bool { c2 := one; c2.Seq = m * step; return p.fitsWith(c2) }); m > 0 {
		fields, text := []string{"train.seq"}, fmt.Sprintf("lower train.seq (%d) to %d or less", c.Seq, m*step)
		if c.MicroBatch > 1 {
			fields, text = []string{"train.micro_batch", "train.seq"}, fmt.Sprintf("lower train.micro_batch (%d) to 1 and train.seq (%d) to %d or less", c.MicroBatch, c.Seq, m*step)
		}
		return fields, text
	}
	var fields, texts []string
	if ep := p.fittingEP(); ep > 0 {
		fields = append(fields, "parallel.ep")
		texts = append(texts, fmt.Sprintf("spread the experts over more ranks with parallel.ep (%d) of %d", c.EP, ep))
	}
	if zero := c; c.Zero == 0 && c.DP*c.EP*c.CP > 1 {
		// ZeRO-1 keeps float32 masters (engine/master_split.go).
		zero.Zero, zero.SplitMasters = 1, false
		if p.fitsWith(zero) {
			fields = append(fields, "parallel.zero")
			texts = append(texts, "shard the optimizer moments with parallel.zero: 1")
		}
	}
	model := p.largestPart()
	fields = append(fields, model...)
	var named []string
	for _, f := range model {
		named = append(named, fmt.Sprintf("%s (%d)", f, c.field(f)))
	}
	texts = append(texts, "make the model smaller: "+strings.Join(named, ", "))
	lead := ""
	if c.MicroBatch > 1 || c.Seq > step {
		lead = "no smaller batch fits; "
	}
	return fields, lead + strings.Join(texts, ", or ")
}

// fittingEP is the smallest parallel.ep above the recipe's, with ep x tp
// a divisor of the experts (they are folded over both), with which the
// run fits, each new rank on a device of
// its own where the ranks have one (else all on the one device, where
// spreading the experts cannot help); 0 when none does.
func (p Plan) fittingEP() int {
	c := p.Config
	tries := 0
	tp := max(1, c.TP)
	for ep := c.EP + 1; ep*tp <= c.Experts && tries < 64; ep++ {
		if c.Experts%(ep*tp) != 0 {
			continue
		}
		tries++
		next := c
		next.EP = ep
		world := next.DP * next.EP * next.CP * next.TP
		if c.DeviceRanks == 1 {
			next.ProcessRanks = world
		} else {
			next.ProcessRanks, next.DeviceRanks = world, world
		}
		if p.fitsWith(next) {
			return ep
		}
	}
	return 0
}

// largestPart names the fields that size the part of the model with the
// most parameters: the embedding and LM head, the experts, or the rest of
// the layers (attention, router, norms).
func (p Plan) largestPart() []string {
	c := p.Config
	V, D, L := int64(c.Vocab), int64(c.Dim), int64(c.Layers)
	embed := mul(2, V, D)
	experts := mul(L, 3, int64(c.Experts), int64(c.FFN), D)
	rest := p.Params.Total - embed - experts
	switch {
	case embed >= experts && embed >= rest:
		return []string{"model.vocab", "model.dim"}
	case experts >= rest:
		return []string{"model.layers", "model.moe.experts", "model.moe.ffn"}
	default:
		return []string{"model.layers", "model.dim"}
	}
}

// field is the value of a recipe path the advice names.
func (c Config) field(path string) int {
	switch path {
	case "model.vocab":
		return c.Vocab
	case "model.dim":
		return c.Dim
	case "model.layers":
		return c.Layers
	case "model.moe.experts":
		return c.Experts
	case "model.moe.ffn":
		return c.FFN
	}
	return 0
}
