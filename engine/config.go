package engine

import (
	"github.com/mktrain/mktrain/moe"
	"github.com/mktrain/mktrain/tune"
)

// Config is a whole run's configuration: the typed form of a recipe. Each
// section is owned here and validated in sentences by Validate; the recipes
// package decodes YAML into it. Every field's default is given by
// DefaultConfig and documented in docs/recipes.md.
type Config struct {
	Model      ModelConfig      `yaml:"model"`
	Data       DataConfig       `yaml:"data"`
	Train      TrainConfig      `yaml:"train"`
	Parallel   ParallelConfig   `yaml:"parallel"`
	Checkpoint CheckpointConfig `yaml:"checkpoint"`
	Log        LogConfig        `yaml:"log"`
}

// ModelConfig is the Mixtral-style decoder's shape.
type ModelConfig struct {
	Vocab     int        `yaml:"vocab"`      // vocabulary size (256 for the byte-level tokenizer)
	Dim       int        `yaml:"dim"`        // model width D
	Layers    int        `yaml:"layers"`     // decoder layers
	Heads     int        `yaml:"heads"`      // query heads H; head dim is Dim/Heads
	KVHeads   int        `yaml:"kv_heads"`   // key/value heads (GQA); divides Heads
	RopeTheta float64    `yaml:"rope_theta"` // RoPE base
	NormEps   float64    `yaml:"norm_eps"`   // RMSNorm epsilon
	InitStd   float64    `yaml:"init_std"`   // std of the normal init of linear and embedding weights
	MoE       moe.Config `yaml:"moe"`        // the sparse MoE block
}

// DataConfig names the token shards and their tokenizer. Empty globs
// select the embedded corpus.
type DataConfig struct {
	Train string `yaml:"train"` // glob of llm.c .bin shards (or Megatron .bin/.idx datasets) for training
	Val   string `yaml:"val"`   // glob of shards for validation
	// Tokenizer is the tokenizer the shards were made with (a Hugging Face
	// tokenizer.json or a tiktoken file); "" for byte-level (tokenizer.go).
	Tokenizer string `yaml:"tokenizer"`
}

// TrainConfig is the optimisation.
type TrainConfig struct {
	Backend     string  `yaml:"backend"`      // auto | cpu | cuda
	GlobalBatch int     `yaml:"global_batch"` // sequences per optimizer step, over all ranks
	MicroBatch  int     `yaml:"micro_batch"`  // sequences per rank per forward/backward
	Seq         int     `yaml:"seq"`          // tokens per sequence
	Steps       int     `yaml:"steps"`        // optimizer steps
	LR          float64 `yaml:"lr"`           // peak learning rate
	MinLR       float64 `yaml:"min_lr"`       // floor of the decay
	Schedule    string  `yaml:"schedule"`     // cosine | constant | wsd
	WarmupSteps int     `yaml:"warmup_steps"` // linear warmup from 0
	DecaySteps  int     `yaml:"decay_steps"`  // wsd: length of the final decay (0 = 20% of steps)
	WeightDecay float64 `yaml:"weight_decay"` // decoupled; never applied to norm weights
	Beta1       float64 `yaml:"beta1"`
	Beta2       float64 `yaml:"beta2"`
	Eps         float64 `yaml:"eps"`
	GradClip    float64 `yaml:"grad_clip"`    // global-norm clip (0 = off)
	Seed        uint64  `yaml:"seed"`         // drives init and data sampling
	EvalEvery   int     `yaml:"eval_every"`   // steps between validation runs (0 = only at the end)
	EvalBatches int     `yaml:"eval_batches"` // micro-batches per validation run
	// Deterministic makes a GPU add in a fixed order where it would use
	// float atomics (backend.Deterministic), so the same command gives the
	// same losses bit for bit on the same GPU; the CPU always does.
	Deterministic bool `yaml:"deterministic"`
	// Recompute is activation recomputation: none keeps every layer's
	// activations from its forward to its backward; selective keeps the
	// attention core's output and log-sum-exp and the experts' hidden
	// activations once per rank instead of per layer and remakes them in
	// each layer's backward (attention.RecomputeCore,
	// moe.RecomputeExperts); full keeps only the residual stream entering
	// and leaving each layer's blocks and one layer's activations per
	// rank, and reruns each layer's forward from its kept input right
	// before its backward (attention.RecomputeLayer,
	// moe.RecomputeLayer). Both give the same losses bit for bit. Default
	// none; "" is none too (configurations saved before the field
	// existed).
	Recompute string `yaml:"recompute"`
	// OptimizerInBackward is where the experts' AdamW update runs: on,
	// in the backward, each expert tensor as soon as its layer's backward
	// no longer reads it, so the gradient store holds one expert tensor's
	// gradient instead of every layer's experts' (expert_update.go); off, after
	// the backward with every other tensor; auto (the default, and ""),
	// on wherever nothing else needs those gradients after the layer's
	// backward (Config.ExpertsUpdatedInBackward). The same weights bit for
	// bit either way.
	OptimizerInBackward string `yaml:"optimizer_in_backward"`
	// MasterWeights is how a training rank whose products multiply in
	// bf16 (the GPU) holds the float32 master weights of the tensors the
	// products read: split, as the bf16 operands themselves and their
	// low 16 bits (backend.SplitMaster: 4 bytes a weight, and no pass per
	// step to round the masters into the operands); fp32, as float32
	// masters and a bf16 copy (6 bytes); auto (the default), split except
	// under parallel.zero 1, whose all-gathers move float32 pieces. "" is
	// fp32 (configurations saved before the field existed). The masters
	// are the same bits either way; the operands differ from the copy's
	// round-to-nearest-even only at exact ties, which round away from
	// zero. The CPU multiplies in float32 and keeps float32 masters under
	// every setting.
	MasterWeights string `yaml:"master_weights"`
}

// The values of train.recompute.
const (
	RecomputeNone      = "none"
	RecomputeSelective = "selective"
	RecomputeFull      = "full"
)

// The values of train.optimizer_in_backward.
const (
	OptimizerInBackwardAuto = "auto"
	OptimizerInBackwardOn   = "on"
	OptimizerInBackwardOff  = "off"
)

// The values of train.master_weights.
const (
	MasterWeightsAuto  = "auto"
	MasterWeightsFP32  = "fp32"
	MasterWeightsSplit = "split"
)

// ParallelConfig is the mesh; dp*ep*cp*tp ranks.
type ParallelConfig struct {
	DP int `yaml:"dp"`
	EP int `yaml:"ep"`
	CP int `yaml:"cp"`
	TP int `yaml:"tp"`
	// SequenceParallel keeps the norms, the router and the residual stream
	// of the tp ranks on shards of the rows (all-gather before the
	// column-parallel products, reduce-scatter after the row-parallel
	// ones); false replicates them and all-reduces after the row-parallel
	// products. No effect with tp 1.
	SequenceParallel bool `yaml:"sequence_parallel"`
	// Zero is the ZeRO stage: 0, or 1 to shard the AdamW moments of the
	// replicated weights over the data-context ranks (zero.go).
	Zero int `yaml:"zero"`
	// CPAttention is how attention reaches the keys and values of the
	// other context-parallel ranks (attention.CPMode): ring (they travel
	// the ring of ranks, only the chunks in flight held), allgather (all
	// gathered, the reference) or auto (the faster on this machine and
	// shape, settled once per run; see resolveCPAttention). Default auto;
	// "" is auto too (configurations saved before the field existed).
	CPAttention string `yaml:"cp_attention"`
	// TPOverlap is how tensor parallelism's collectives meet its matrix
	// products (tensorpar.Options.Fused): fused (the backend's fused ops,
	// the all-gather inside the column-parallel product and the
	// reduce-scatter in the row-parallel product's epilogue, where the
	// tp group offers peer access; the collectives otherwise), unfused
	// (the collectives around the products, the reference) or auto (the
	// faster on this machine and shape, settled once per run; see
	// resolveTPOverlap). Default auto; "" is auto too (configurations
	// saved before the field existed). No effect with tp 1.
	TPOverlap string `yaml:"tp_overlap"`
}

// CheckpointConfig controls saving and resuming.
type CheckpointConfig struct {
	Every    int    `yaml:"every"`     // steps between saves (0 = only on stop and at the end)
	KeepLast int    `yaml:"keep_last"` // checkpoints kept (0 = all)
	Resume   string `yaml:"resume"`    // auto | never | PATH
	Compress string `yaml:"compress"`  // none | zstd (optimizer moments)
	Async    bool   `yaml:"async"`     // write in the background
	InitFrom string `yaml:"init_from"` // start a fresh run from these weights: a Hugging Face Mixtral directory
}

// LogConfig controls metrics and console output.
type LogConfig struct {
	Every    int    `yaml:"every"`    // steps between metrics lines
	Level    string `yaml:"level"`    // debug | info | warn | error
	Progress string `yaml:"progress"` // auto | on | off: progress bar on a terminal
	// TensorBoard writes TensorBoard event files into the run directory
	// (engine/tensorboard.go).
	TensorBoard bool `yaml:"tensorboard"`
}

// DefaultConfig is the configuration a recipe starts from: the tiny model
// that trains on a laptop's CPU.
func DefaultConfig() Config {
	return Config{
		Model: ModelConfig{
			Vocab: 256, Dim: 64, Layers: 2, Heads: 4, KVHeads: 2,
			RopeTheta: 1e6, NormEps: 1e-5, InitStd: 0.02,
			MoE: moe.Config{Experts: 4, TopK: 2, FFN: 128, AuxLossCoef: 0.01, Dispatcher: moe.DispatcherAuto},
		},
		Train: TrainConfig{
			Backend: "auto", GlobalBatch: 8, MicroBatch: 8, Seq: 64, Steps: 200,
			LR: 1e-3, MinLR: 1e-4, Schedule: "cosine", WarmupSteps: 10,
			WeightDecay: 0.1, Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, GradClip: 1.0,
			Seed: 1, EvalEvery: 50, EvalBatches: 4, Recompute: RecomputeNone,
			OptimizerInBackward: OptimizerInBackwardAuto, MasterWeights: MasterWeightsAuto,
		},
		Parallel:   ParallelConfig{DP: 1, EP: 1, CP: 1, TP: 1, CPAttention: tune.CPAttentionAuto, TPOverlap: tune.TPOverlapAuto, SequenceParallel: true},
		Checkpoint: CheckpointConfig{Every: 0, KeepLast: 3, Resume: "auto", Compress: "none"},
		Log:        LogConfig{Every: 10, Level: "info", Progress: "auto"},
	}
}

// HeadDim is Dim/Heads.
func (m ModelConfig) HeadDim() int { return m.Dim / m.Heads }
