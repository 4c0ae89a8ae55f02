package engine

// Validation of a whole Config. Every rule here is listed, with its field, in
// docs/recipes.md; the messages are sentences a user can act on without
// reading code, and each names the recipe path of the value at fault.

import (
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"strings"

	"github.com/mktrain/mktrain/attention"
	"github.com/mktrain/mktrain/moe"
	"github.com/mktrain/mktrain/tune"
)

// MaxVocab is the largest vocabulary a model may have: token ids are int32.
const MaxVocab = 1 << 31

// A FieldError is one problem Validate found. Field is the recipe path of the
// value at fault ("model.heads"); the message is a whole sentence that names
// it, and any other field the rule involves.
type FieldError struct {
	Field string
	Msg   string
}

func (e *FieldError) Error() string { return e.Msg }

// Validate checks every field and the rules between fields. It reports all
// problems at once, joined with errors.Join, each a *FieldError; nil means
// the configuration can be run.
func (c Config) Validate() error {
	var v validator
	v.model(c.Model, c.Data)
	v.data(c.Data)
	v.train(c.Train, c.Parallel)
	v.parallel(c.Parallel, c.Model.MoE.Experts)
	v.tensorParallel(c)
	v.checkpoint(c.Checkpoint)
	v.log(c.Log)
	if len(v.errs) == 0 && c.Train.MasterWeights == MasterWeightsSplit && c.Parallel.Zero == 1 {
		v.fail("train.master_weights", "train.master_weights is split, but parallel.zero is 1, whose all-gathers move float32 masters; set it to auto or fp32")
	}
	if len(v.errs) == 0 && c.Train.OptimizerInBackward == OptimizerInBackwardOn {
		if why := c.optimizerInBackwardBlocker(); why != "" {
			v.fail("train.optimizer_in_backward", "train.optimizer_in_backward is on, but %s; set it to auto or off", why)
		}
	}
	return errors.Join(v.errs...)
}

// DataParallelRanks is the number of ranks that each take a different slice
// of the global batch: dp*ep, because expert-parallel ranks hold different
// tokens too (context- and tensor-parallel ranks share theirs).
func (c Config) DataParallelRanks() int { return c.Parallel.DP * c.Parallel.EP }

// AccumSteps is the number of micro-batches each rank runs per optimizer
// step: global_batch / (micro_batch * dp*ep). It is meaningful for a Config
// that passed Validate, and 0 for one whose batch sizes are not positive.
func (c Config) AccumSteps() int {
	per := c.Train.MicroBatch * c.DataParallelRanks()
	if per <= 0 {
		return 0
	}
	return c.Train.GlobalBatch / per
}

// WSDDecaySteps is the length of the wsd schedule's final decay:
// train.decay_steps, or 20% of train.steps (at least 1) when that is 0.
func (t TrainConfig) WSDDecaySteps() int {
	if t.DecaySteps > 0 {
		return t.DecaySteps
	}
	return max(1, t.Steps/5)
}

// validator collects the problems; its helpers report and return whether the
// value was good, so that rules between fields run only on good operands and
// one mistake gives one message.
type validator struct{ errs []error }

func (v *validator) fail(field, format string, args ...any) bool {
	v.errs = append(v.errs, &FieldError{Field: field, Msg: fmt.Sprintf(format, args...)})
	return false
}

func (v *validator) positiveInt(field string, x int) bool {
	if x <= 0 {
		return v.fail(field, "%s must be positive, got %d", field, x)
	}
	return true
}

func (v *validator) nonNegativeInt(field string, x int, zeroMeans string) bool {
	if x < 0 {
		return v.fail(field, "%s must be 0 (%s) or positive, got %d", field, zeroMeans, x)
	}
	return true
}

func (v *validator) atLeast(field string, x, least int) bool {
	if x < least {
		return v.fail(field, "%s must be at least %d, got %d", field, least, x)
	}
	return true
}

func (v *validator) finite(field string, x float64) bool {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return v.fail(field, "%s must be a finite number, got %v", field, x)
	}
	return true
}

func (v *validator) positive(field string, x float64) bool {
	if !v.finite(field, x) {
		return false
	}
	if x <= 0 {
		return v.fail(field, "%s must be positive, got %v", field, x)
	}
	return true
}

func (v *validator) nonNegative(field string, x float64, zeroMeans string) bool {
	if !v.finite(field, x) {
		return false
	}
	if x < 0 {
		return v.fail(field, "%s must be 0 (%s) or positive, got %v", field, zeroMeans, x)
	}
	return true
}

// unitInterval checks x in [0, 1), the range of Adam's betas.
func (v *validator) unitInterval(field string, x float64) bool {
	if !v.finite(field, x) {
		return false
	}
	if x < 0 || x >= 1 {
		return v.fail(field, "%s must be in [0, 1), got %v", field, x)
	}
	return true
}

func (v *validator) oneOf(field, x string, allowed ...string) bool {
	for _, a := range allowed {
		if x == a {
			return true
		}
	}
	return v.fail(field, "%s must be one of %s; got %q", field, strings.Join(allowed, ", "), x)
}

func (v *validator) model(m ModelConfig, d DataConfig) {
	if v.positiveInt("model.vocab", m.Vocab) {
		if m.Vocab > MaxVocab {
			v.fail("model.vocab", "model.vocab (%d) must be at most %d (2^31): token ids are int32", m.Vocab, MaxVocab)
		} else if d.Train == "" && m.Vocab < 256 {
			v.fail("model.vocab", "model.vocab (%d) must be at least 256 when data.train is empty: the embedded corpus is byte-level", m.Vocab)
		}
	}
	dimOK := v.positiveInt("model.dim", m.Dim)
	v.positiveInt("model.layers", m.Layers)
	headsOK := v.positiveInt("model.heads", m.Heads)
	kvOK := v.positiveInt("model.kv_heads", m.KVHeads)
	if dimOK && headsOK {
		if m.Dim%m.Heads != 0 {
			v.fail("model.heads", "model.heads (%d) must divide model.dim (%d)", m.Heads, m.Dim)
		} else if hd := m.Dim / m.Heads; hd%2 != 0 {
			v.fail("model.heads", "the head dim model.dim/model.heads (%d/%d = %d) must be even: RoPE rotates pairs of dimensions", m.Dim, m.Heads, hd)
		}
	}
	if headsOK && kvOK && m.Heads%m.KVHeads != 0 {
		v.fail("model.kv_heads", "model.kv_heads (%d) must divide model.heads (%d)", m.KVHeads, m.Heads)
	}
	v.positive("model.rope_theta", m.RopeTheta)
	v.positive("model.norm_eps", m.NormEps)
	v.positive("model.init_std", m.InitStd)

	e := m.MoE
	expertsOK := v.positiveInt("model.moe.experts", e.Experts)
	if v.positiveInt("model.moe.top_k", e.TopK) && expertsOK && e.TopK > e.Experts {
		v.fail("model.moe.top_k", "model.moe.top_k (%d) cannot exceed model.moe.experts (%d)", e.TopK, e.Experts)
	}
	v.positiveInt("model.moe.ffn", e.FFN)
	v.nonNegative("model.moe.aux_loss_coef", e.AuxLossCoef, "off")
	v.nonNegative("model.moe.z_loss_coef", e.ZLossCoef, "off")
	v.nonNegative("model.moe.bias_update_rate", e.BiasUpdateRate, "off")
	v.nonNegativeInt("model.moe.shared_experts", e.SharedExperts, "none")
	v.nonNegative("model.moe.capacity_factor", e.CapacityFactor, "dropless")
	if e.Dispatcher != "" { // "" is auto (configurations saved before the field existed)
		v.oneOf("model.moe.dispatcher", e.Dispatcher, moe.DispatcherAuto, moe.DispatcherFused, moe.DispatcherUnfused)
	}
}

func (v *validator) data(d DataConfig) {
	for _, g := range []struct{ field, pattern string }{{"data.train", d.Train}, {"data.val", d.Val}} {
		if _, err := filepath.Match(g.pattern, ""); err != nil {
			v.fail(g.field, "%s is not a valid glob pattern: %q", g.field, g.pattern)
		}
	}
	// Shards are for both or neither: the embedded corpus has its own
	// held-out part, and shards from elsewhere would not be held out from it.
	switch {
	case d.Tokenizer != "" && d.Train == "":
		v.fail("data.tokenizer", "data.tokenizer is set but data.train is empty: the embedded corpus is byte-level; name the shards made with the tokenizer (data.train, data.val), or leave data.tokenizer empty")
	}
	switch {
	case d.Train == "" && d.Val != "":
		v.fail("data.val", "data.val is set but data.train is empty; set both (shards) or neither (the embedded corpus)")
	case d.Train != "" && d.Val == "":
		v.fail("data.val", "data.train is set but data.val is empty; set both (shards) or neither (the embedded corpus)")
	}
}

func (v *validator) train(t TrainConfig, p ParallelConfig) {
	v.oneOf("train.backend", t.Backend, "auto", "cpu", "cuda")
	globalOK := v.positiveInt("train.global_batch", t.GlobalBatch)
	microOK := v.positiveInt("train.micro_batch", t.MicroBatch)
	if globalOK && microOK && p.DP >= 1 && p.EP >= 1 {
		// A product that overflows is larger than global_batch, so it cannot divide it.
		ranks, ok := mul(p.DP, p.EP)
		per := 0
		if ok {
			per, ok = mul(t.MicroBatch, ranks)
		}
		if !ok || t.GlobalBatch%per != 0 {
			ranksText := fmt.Sprint(ranks)
			if ranks == 0 {
				ranksText = fmt.Sprintf("%d*%d", p.DP, p.EP)
			}
			v.fail("train.global_batch", "train.global_batch (%d) must be a multiple of train.micro_batch (%d) x data-parallel ranks (dp*ep = %s)",
				t.GlobalBatch, t.MicroBatch, ranksText)
		}
	}
	if v.atLeast("train.seq", t.Seq, 2) && p.CP > 1 && t.Seq%(2*p.CP) != 0 {
		// Zigzag sharding cuts every sequence into 2*cp equal chunks.
		v.fail("train.seq", "train.seq (%d) must be a multiple of 2 x parallel.cp (2*%d = %d): context parallelism cuts each sequence into 2*cp equal chunks",
			t.Seq, p.CP, 2*p.CP)
	}
	stepsOK := v.positiveInt("train.steps", t.Steps)
	if v.positive("train.lr", t.LR) && v.nonNegative("train.min_lr", t.MinLR, "decay to zero") && t.MinLR > t.LR {
		v.fail("train.min_lr", "train.min_lr (%v) must not exceed train.lr (%v)", t.MinLR, t.LR)
	}
	wsd := t.Schedule == "wsd"
	v.oneOf("train.schedule", t.Schedule, "cosine", "constant", "wsd")
	warmupOK := v.nonNegativeInt("train.warmup_steps", t.WarmupSteps, "no warmup")
	if warmupOK && stepsOK && t.WarmupSteps >= t.Steps {
		warmupOK = v.fail("train.warmup_steps", "train.warmup_steps (%d) must be less than train.steps (%d)", t.WarmupSteps, t.Steps)
	}
	if v.nonNegativeInt("train.decay_steps", t.DecaySteps, "20% of train.steps") && wsd && warmupOK && stepsOK {
		decay := t.WSDDecaySteps()
		switch {
		case decay <= t.Steps-t.WarmupSteps:
		case t.DecaySteps > 0:
			v.fail("train.decay_steps", "train.warmup_steps (%d) + train.decay_steps (%d) must not exceed train.steps (%d)",
				t.WarmupSteps, decay, t.Steps)
		default:
			v.fail("train.warmup_steps", "train.warmup_steps (%d) + the wsd decay (train.decay_steps 0: 20%% of train.steps = %d) must not exceed train.steps (%d)",
				t.WarmupSteps, decay, t.Steps)
		}
	}
	v.nonNegative("train.weight_decay", t.WeightDecay, "off")
	v.unitInterval("train.beta1", t.Beta1)
	v.unitInterval("train.beta2", t.Beta2)
	v.positive("train.eps", t.Eps)
	v.nonNegative("train.grad_clip", t.GradClip, "off")
	v.nonNegativeInt("train.eval_every", t.EvalEvery, "only at the end")
	v.positiveInt("train.eval_batches", t.EvalBatches)
	if t.Recompute != "" { // "": none (configurations saved before the field existed)
		v.oneOf("train.recompute", t.Recompute, RecomputeNone, RecomputeSelective, RecomputeFull)
	}
	if t.MasterWeights != "" { // "": fp32 (configurations saved before the field existed)
		v.oneOf("train.master_weights", t.MasterWeights, MasterWeightsAuto, MasterWeightsFP32, MasterWeightsSplit)
	}
	if t.OptimizerInBackward != "" { // "": auto (configurations saved before the field existed)
		v.oneOf("train.optimizer_in_backward", t.OptimizerInBackward, OptimizerInBackwardAuto, OptimizerInBackwardOn, OptimizerInBackwardOff)
	}
}

func (v *validator) parallel(p ParallelConfig, experts int) {
	v.atLeast("parallel.dp", p.DP, 1)
	if v.atLeast("parallel.ep", p.EP, 1) && experts > 0 && experts%p.EP != 0 {
		v.fail("parallel.ep", "model.moe.experts (%d) must be divisible by parallel.ep (%d)", experts, p.EP)
	}
	v.atLeast("parallel.cp", p.CP, 1)
	if p.CPAttention != "" { // "" is auto (configurations saved before the field existed)
		v.oneOf("parallel.cp_attention", p.CPAttention, tune.CPAttentionAuto, string(attention.CPRing), string(attention.CPAllGather))
	}
	if p.TPOverlap != "" { // "" is auto, as for cp_attention
		v.oneOf("parallel.tp_overlap", p.TPOverlap, tune.TPOverlapAuto, tune.TPOverlapFused, tune.TPOverlapUnfused)
	}
	if p.Zero != 0 && p.Zero != 1 {
		v.fail("parallel.zero", "parallel.zero must be 0 (off) or 1 (AdamW moments of the replicated weights sharded over the data-parallel ranks), got %d", p.Zero)
	}
}

// tensorParallel checks what parallel.tp splits: the query heads, the
// key/value heads (split, or replicated when there are fewer than tp), the
// vocabulary (the LM head), the experts (folded over ep x tp ranks) and
// each rank's rows of a micro-batch (sequence parallelism, and the MoE
// layers, which always take one tp rank's share of the rows).
func (v *validator) tensorParallel(c Config) {
	p, m := c.Parallel, c.Model
	tp := p.TP
	if !v.atLeast("parallel.tp", tp, 1) || tp == 1 {
		return
	}
	if m.Heads > 0 && m.Heads%tp != 0 {
		v.fail("parallel.tp", "model.heads (%d) must be divisible by parallel.tp (%d): tensor parallelism splits the query heads", m.Heads, tp)
	}
	if kv := m.KVHeads; kv > 0 && kv%tp != 0 && tp%kv != 0 {
		v.fail("parallel.tp", "model.kv_heads (%d) must be divisible by parallel.tp (%d), or divide it (each kv head then replicated on tp/kv_heads ranks)", kv, tp)
	}
	if m.Vocab > 0 && m.Vocab%tp != 0 {
		v.fail("parallel.tp", "model.vocab (%d) must be divisible by parallel.tp (%d): the LM head splits the vocabulary", m.Vocab, tp)
	}
	if e := m.MoE.Experts; e > 0 && p.EP >= 1 && e%p.EP == 0 && e%(p.EP*tp) != 0 {
		v.fail("parallel.tp", "model.moe.experts (%d) must be divisible by parallel.ep x parallel.tp (%d*%d = %d): the experts are spread over the ep x tp ranks, whole",
			e, p.EP, tp, p.EP*tp)
	}
	if seq, cp := c.Train.Seq, p.CP; seq >= 2 && cp >= 1 && seq%cp == 0 && (seq/cp)%tp != 0 {
		v.fail("train.seq", "train.seq / parallel.cp (%d/%d = %d) must be a multiple of parallel.tp (%d): the tensor-parallel ranks split each rank's rows (sequence parallelism and the MoE layers)",
			seq, cp, seq/cp, tp)
	}
}

func (v *validator) checkpoint(c CheckpointConfig) {
	v.nonNegativeInt("checkpoint.every", c.Every, "only on stop and at the end")
	v.nonNegativeInt("checkpoint.keep_last", c.KeepLast, "keep all")
	if strings.TrimSpace(c.Resume) == "" {
		v.fail("checkpoint.resume", "checkpoint.resume must be auto, never, or the path of a checkpoint; got %q", c.Resume)
	}
	v.oneOf("checkpoint.compress", c.Compress, "none", "zstd")
}

func (v *validator) log(l LogConfig) {
	v.nonNegativeInt("log.every", l.Every, "only the first and last steps and evaluations")
	v.oneOf("log.level", l.Level, "debug", "info", "warn", "error")
	v.oneOf("log.progress", l.Progress, "auto", "on", "off")
}

// mul is a*b for positive a and b, and false when the product overflows.
func mul(a, b int) (int, bool) {
	if a > math.MaxInt/b {
		return 0, false
	}
	return a * b, true
}
