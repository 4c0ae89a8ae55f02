package engine

import (
	"errors"
	"math"
	"sort"
	"strings"
	"testing"
)

func TestDefaultConfigValidates(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatalf("DefaultConfig does not validate:\n%v", err)
	}
	// An empty dispatcher is auto: configurations saved before the field
	// existed have it.
	c := DefaultConfig()
	c.Model.MoE.Dispatcher = ""
	if err := c.Validate(); err != nil {
		t.Errorf("an empty model.moe.dispatcher does not validate: %v", err)
	}
}

// TestValidateRules breaks one rule per case, starting from the default, and
// wants exactly that one problem, on that field, in those words.
func TestValidateRules(t *testing.T) {
	nan, inf := math.NaN(), math.Inf(1)
	cases := []struct {
		name  string
		edit  func(c *Config)
		field string
		msg   string
	}{
		// model
		{"vocab zero", func(c *Config) { c.Model.Vocab = 0 }, "model.vocab", "model.vocab must be positive, got 0"},
		{"vocab huge", func(c *Config) { c.Model.Vocab = MaxVocab + 1; c.Data.Train, c.Data.Val = "d/t*.bin", "d/v*.bin" }, "model.vocab",
			"model.vocab (2147483649) must be at most 2147483648 (2^31): token ids are int32"},
		{"vocab below bytes", func(c *Config) { c.Model.Vocab = 100 }, "model.vocab",
			"model.vocab (100) must be at least 256 when data.train is empty: the embedded corpus is byte-level"},
		{"dim zero", func(c *Config) { c.Model.Dim = 0 }, "model.dim", "model.dim must be positive, got 0"},
		{"layers negative", func(c *Config) { c.Model.Layers = -1 }, "model.layers", "model.layers must be positive, got -1"},
		{"heads zero", func(c *Config) { c.Model.Heads = 0 }, "model.heads", "model.heads must be positive, got 0"},
		{"kv_heads zero", func(c *Config) { c.Model.KVHeads = 0 }, "model.kv_heads", "model.kv_heads must be positive, got 0"},
		{"heads divide dim", func(c *Config) { c.Model.Heads = 6; c.Model.KVHeads = 1 }, "model.heads",
			"model.heads (6) must divide model.dim (64)"},
		{"head dim even", func(c *Config) { c.Model.Dim = 60; c.Model.Heads = 4 }, "model.heads",
			"the head dim model.dim/model.heads (60/4 = 15) must be even: RoPE rotates pairs of dimensions"},
		{"kv_heads divide heads", func(c *Config) { c.Model.KVHeads = 3 }, "model.kv_heads",
			"model.kv_heads (3) must divide model.heads (4)"},
		{"rope_theta zero", func(c *Config) { c.Model.RopeTheta = 0 }, "model.rope_theta", "model.rope_theta must be positive, got 0"},
		{"norm_eps NaN", func(c *Config) { c.Model.NormEps = nan }, "model.norm_eps", "model.norm_eps must be a finite number, got NaN"},
		{"init_std negative", func(c *Config) { c.Model.InitStd = -0.02 }, "model.init_std", "model.init_std must be positive, got -0.02"},
		{"experts zero", func(c *Config) { c.Model.MoE.Experts = 0 }, "model.moe.experts", "model.moe.experts must be positive, got 0"},
		{"top_k zero", func(c *Config) { c.Model.MoE.TopK = 0 }, "model.moe.top_k", "model.moe.top_k must be positive, got 0"},
		{"top_k above experts", func(c *Config) { c.Model.MoE.Experts = 2; c.Model.MoE.TopK = 3 }, "model.moe.top_k",
			"model.moe.top_k (3) cannot exceed model.moe.experts (2)"},
		{"ffn zero", func(c *Config) { c.Model.MoE.FFN = 0 }, "model.moe.ffn", "model.moe.ffn must be positive, got 0"},
		{"aux negative", func(c *Config) { c.Model.MoE.AuxLossCoef = -1 }, "model.moe.aux_loss_coef",
			"model.moe.aux_loss_coef must be 0 (off) or positive, got -1"},
		{"z loss inf", func(c *Config) { c.Model.MoE.ZLossCoef = inf }, "model.moe.z_loss_coef",
			"model.moe.z_loss_coef must be a finite number, got +Inf"},
		{"bias rate negative", func(c *Config) { c.Model.MoE.BiasUpdateRate = -0.001 }, "model.moe.bias_update_rate",
			"model.moe.bias_update_rate must be 0 (off) or positive, got -0.001"},
		{"shared negative", func(c *Config) { c.Model.MoE.SharedExperts = -1 }, "model.moe.shared_experts",
			"model.moe.shared_experts must be 0 (none) or positive, got -1"},
		{"capacity negative", func(c *Config) { c.Model.MoE.CapacityFactor = -1.5 }, "model.moe.capacity_factor",
			"model.moe.capacity_factor must be 0 (dropless) or positive, got -1.5"},
		{"dispatcher", func(c *Config) { c.Model.MoE.Dispatcher = "fast" }, "model.moe.dispatcher",
			`model.moe.dispatcher must be one of auto, fused, unfused; got "fast"`},
		// data
		{"bad train glob", func(c *Config) { c.Data.Train, c.Data.Val = "data/[.bin", "data/val_*.bin" }, "data.train",
			`data.train is not a valid glob pattern: "data/[.bin"`},
		{"bad val glob", func(c *Config) { c.Data.Train, c.Data.Val = "data/train_*.bin", `data/\` }, "data.val", `data.val is not a valid glob pattern: "data/\\"`},
		{"val without train", func(c *Config) { c.Data.Val = "data/val_*.bin" }, "data.val",
			"data.val is set but data.train is empty; set both (shards) or neither (the embedded corpus)"},
		{"train without val", func(c *Config) { c.Data.Train = "data/train_*.bin" }, "data.val",
			"data.train is set but data.val is empty; set both (shards) or neither (the embedded corpus)"},
		// train
		{"backend", func(c *Config) { c.Train.Backend = "gpu" }, "train.backend",
			`train.backend must be one of auto, cpu, cuda; got "gpu"`},
		{"global batch zero", func(c *Config) { c.Train.GlobalBatch = 0 }, "train.global_batch", "train.global_batch must be positive, got 0"},
		{"micro batch zero", func(c *Config) { c.Train.MicroBatch = 0 }, "train.micro_batch", "train.micro_batch must be positive, got 0"},
		{"batch multiple", func(c *Config) { c.Train.GlobalBatch = 8; c.Train.MicroBatch = 3; c.Parallel.DP = 2 }, "train.global_batch",
			"train.global_batch (8) must be a multiple of train.micro_batch (3) x data-parallel ranks (dp*ep = 2)"},
		{"batch multiple ep", func(c *Config) { c.Train.GlobalBatch = 8; c.Train.MicroBatch = 4; c.Parallel.EP = 4 }, "train.global_batch",
			"train.global_batch (8) must be a multiple of train.micro_batch (4) x data-parallel ranks (dp*ep = 4)"},
		{"batch product overflows", func(c *Config) { c.Parallel.DP = math.MaxInt / 2; c.Parallel.EP = 4 }, "train.global_batch",
			"train.global_batch (8) must be a multiple of train.micro_batch (8) x data-parallel ranks (dp*ep = 4611686018427387903*4)"},
		{"seq", func(c *Config) { c.Train.Seq = 1 }, "train.seq", "train.seq must be at least 2, got 1"},
		{"steps", func(c *Config) { c.Train.Steps = 0; c.Train.WarmupSteps = 0 }, "train.steps", "train.steps must be positive, got 0"},
		{"lr negative", func(c *Config) { c.Train.LR = -0.001 }, "train.lr", "train.lr must be positive, got -0.001"},
		{"lr inf", func(c *Config) { c.Train.LR = inf }, "train.lr", "train.lr must be a finite number, got +Inf"},
		{"min_lr negative", func(c *Config) { c.Train.MinLR = -1 }, "train.min_lr", "train.min_lr must be 0 (decay to zero) or positive, got -1"},
		{"min_lr above lr", func(c *Config) { c.Train.MinLR = 0.01 }, "train.min_lr", "train.min_lr (0.01) must not exceed train.lr (0.001)"},
		{"schedule", func(c *Config) { c.Train.Schedule = "linear" }, "train.schedule",
			`train.schedule must be one of cosine, constant, wsd; got "linear"`},
		{"warmup negative", func(c *Config) { c.Train.WarmupSteps = -1 }, "train.warmup_steps",
			"train.warmup_steps must be 0 (no warmup) or positive, got -1"},
		{"warmup too long", func(c *Config) { c.Train.WarmupSteps = 200 }, "train.warmup_steps",
			"train.warmup_steps (200) must be less than train.steps (200)"},
		{"decay negative", func(c *Config) { c.Train.DecaySteps = -5 }, "train.decay_steps",
			"train.decay_steps must be 0 (20% of train.steps) or positive, got -5"},
		{"wsd too long", func(c *Config) { c.Train.Schedule = "wsd"; c.Train.DecaySteps = 191 }, "train.decay_steps",
			"train.warmup_steps (10) + train.decay_steps (191) must not exceed train.steps (200)"},
		{"wsd default decay too long", func(c *Config) { c.Train.Schedule = "wsd"; c.Train.WarmupSteps = 161 }, "train.warmup_steps",
			"train.warmup_steps (161) + the wsd decay (train.decay_steps 0: 20% of train.steps = 40) must not exceed train.steps (200)"},
		{"weight decay", func(c *Config) { c.Train.WeightDecay = -0.1 }, "train.weight_decay",
			"train.weight_decay must be 0 (off) or positive, got -0.1"},
		{"beta1 one", func(c *Config) { c.Train.Beta1 = 1 }, "train.beta1", "train.beta1 must be in [0, 1), got 1"},
		{"beta2 negative", func(c *Config) { c.Train.Beta2 = -0.5 }, "train.beta2", "train.beta2 must be in [0, 1), got -0.5"},
		{"eps zero", func(c *Config) { c.Train.Eps = 0 }, "train.eps", "train.eps must be positive, got 0"},
		{"grad clip", func(c *Config) { c.Train.GradClip = -1 }, "train.grad_clip", "train.grad_clip must be 0 (off) or positive, got -1"},
		{"eval every", func(c *Config) { c.Train.EvalEvery = -1 }, "train.eval_every",
			"train.eval_every must be 0 (only at the end) or positive, got -1"},
		{"eval batches", func(c *Config) { c.Train.EvalBatches = 0 }, "train.eval_batches", "train.eval_batches must be positive, got 0"},
		{"recompute", func(c *Config) { c.Train.Recompute = "some" }, "train.recompute",
			`train.recompute must be one of none, selective, full; got "some"`},
		// parallel
		{"dp zero", func(c *Config) { c.Parallel.DP = 0 }, "parallel.dp", "parallel.dp must be at least 1, got 0"},
		{"ep zero", func(c *Config) { c.Parallel.EP = 0 }, "parallel.ep", "parallel.ep must be at least 1, got 0"},
		{"experts by ep", func(c *Config) { c.Model.MoE.Experts = 6; c.Parallel.EP = 4; c.Train.GlobalBatch = 32 }, "parallel.ep",
			"model.moe.experts (6) must be divisible by parallel.ep (4)"},
		{"seq by cp", func(c *Config) { c.Parallel.CP = 3 }, "train.seq",
			"train.seq (64) must be a multiple of 2 x parallel.cp (2*3 = 6): context parallelism cuts each sequence into 2*cp equal chunks"},
		{"cp zero", func(c *Config) { c.Parallel.CP = 0 }, "parallel.cp", "parallel.cp must be at least 1, got 0"},
		{"cp attention", func(c *Config) { c.Parallel.CPAttention = "star" }, "parallel.cp_attention",
			`parallel.cp_attention must be one of auto, ring, allgather; got "star"`},
		{"tp overlap", func(c *Config) { c.Parallel.TPOverlap = "overlapped" }, "parallel.tp_overlap",
			`parallel.tp_overlap must be one of auto, fused, unfused; got "overlapped"`},
		{"tp zero", func(c *Config) { c.Parallel.TP = 0 }, "parallel.tp", "parallel.tp must be at least 1, got 0"},
		{"heads by tp", func(c *Config) { c.Model.Heads, c.Model.KVHeads, c.Model.MoE.Experts, c.Parallel.TP = 4, 4, 8, 8 }, "parallel.tp",
			"model.heads (4) must be divisible by parallel.tp (8): tensor parallelism splits the query heads"},
		{"kv heads by tp", func(c *Config) { c.Model.Dim, c.Model.Heads, c.Model.KVHeads, c.Parallel.TP = 96, 12, 3, 4 }, "parallel.tp",
			"model.kv_heads (3) must be divisible by parallel.tp (4), or divide it (each kv head then replicated on tp/kv_heads ranks)"},
		{"vocab by tp", func(c *Config) { c.Model.Vocab = 258; c.Parallel.TP = 4 }, "parallel.tp",
			"model.vocab (258) must be divisible by parallel.tp (4): the LM head splits the vocabulary"},
		{"experts by ep x tp", func(c *Config) { c.Parallel.EP, c.Parallel.TP = 2, 4; c.Train.GlobalBatch = 16 }, "parallel.tp",
			"model.moe.experts (4) must be divisible by parallel.ep x parallel.tp (2*4 = 8): the experts are spread over the ep x tp ranks, whole"},
		{"seq by cp x tp", func(c *Config) { c.Train.Seq, c.Parallel.CP, c.Parallel.TP = 20, 2, 4 }, "train.seq",
			"train.seq / parallel.cp (20/2 = 10) must be a multiple of parallel.tp (4): the tensor-parallel ranks split each rank's rows (sequence parallelism and the MoE layers)"},
		{"zero", func(c *Config) { c.Parallel.Zero = 2 }, "parallel.zero",
			"parallel.zero must be 0 (off) or 1 (AdamW moments of the replicated weights sharded over the data-parallel ranks), got 2"},
		{"zero negative", func(c *Config) { c.Parallel.Zero = -1 }, "parallel.zero",
			"parallel.zero must be 0 (off) or 1 (AdamW moments of the replicated weights sharded over the data-parallel ranks), got -1"},
		// checkpoint
		{"every", func(c *Config) { c.Checkpoint.Every = -1 }, "checkpoint.every",
			"checkpoint.every must be 0 (only on stop and at the end) or positive, got -1"},
		{"keep_last", func(c *Config) { c.Checkpoint.KeepLast = -2 }, "checkpoint.keep_last",
			"checkpoint.keep_last must be 0 (keep all) or positive, got -2"},
		{"resume empty", func(c *Config) { c.Checkpoint.Resume = " " }, "checkpoint.resume",
			`checkpoint.resume must be auto, never, or the path of a checkpoint; got " "`},
		{"compress", func(c *Config) { c.Checkpoint.Compress = "gzip" }, "checkpoint.compress",
			`checkpoint.compress must be one of none, zstd; got "gzip"`},
		// log
		{"log every", func(c *Config) { c.Log.Every = -1 }, "log.every",
			"log.every must be 0 (only the first and last steps and evaluations) or positive, got -1"},
		{"log level", func(c *Config) { c.Log.Level = "trace" }, "log.level",
			`log.level must be one of debug, info, warn, error; got "trace"`},
		{"log progress", func(c *Config) { c.Log.Progress = "yes" }, "log.progress",
			`log.progress must be one of auto, on, off; got "yes"`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			tc.edit(&cfg)
			problems := fieldErrors(t, cfg.Validate())
			if len(problems) != 1 {
				t.Fatalf("want one problem, got %d:\n%v", len(problems), cfg.Validate())
			}
			if problems[0].Field != tc.field || problems[0].Msg != tc.msg {
				t.Errorf("got  %s: %q\nwant %s: %q", problems[0].Field, problems[0].Msg, tc.field, tc.msg)
			}
		})
	}
}

// TestValidateAcceptsEdges keeps the boundaries of the rules open where the
// rules say they are.
func TestValidateAcceptsEdges(t *testing.T) {
	edits := map[string]func(c *Config){
		"vocab 2^31 with shards":  func(c *Config) { c.Model.Vocab = MaxVocab; c.Data.Train, c.Data.Val = "d/t*.bin", "d/v*.bin" },
		"small vocab with shards": func(c *Config) { c.Model.Vocab = 2; c.Data.Train, c.Data.Val = "d/t*.bin", "d/v*.bin" },
		"top_k equals experts":    func(c *Config) { c.Model.MoE.TopK = c.Model.MoE.Experts },
		"kv_heads equals heads":   func(c *Config) { c.Model.KVHeads = c.Model.Heads },
		"capacity zero":           func(c *Config) { c.Model.MoE.CapacityFactor = 0 },
		"capacity below one":      func(c *Config) { c.Model.MoE.CapacityFactor = 0.5 },
		"seq 2":                   func(c *Config) { c.Train.Seq = 2 },
		"min_lr equals lr":        func(c *Config) { c.Train.MinLR = c.Train.LR },
		"warmup steps-1":          func(c *Config) { c.Train.WarmupSteps = c.Train.Steps - 1 },
		"wsd exact":               func(c *Config) { c.Train.Schedule = "wsd"; c.Train.WarmupSteps = 50; c.Train.DecaySteps = 150 },
		"wsd default exact":       func(c *Config) { c.Train.Schedule = "wsd"; c.Train.WarmupSteps = 160 },
		"wsd one step":            func(c *Config) { c.Train.Schedule = "wsd"; c.Train.Steps = 1; c.Train.WarmupSteps = 0 },
		"log every zero":          func(c *Config) { c.Log.Every = 0 },
		"decay ignored by cosine": func(c *Config) { c.Train.DecaySteps = 10000 },
		"beta zero":               func(c *Config) { c.Train.Beta1 = 0 },
		"no clip":                 func(c *Config) { c.Train.GradClip = 0 },
		"resume path":             func(c *Config) { c.Checkpoint.Resume = "runs/a/step-100" },
		"dp and ep":               func(c *Config) { c.Parallel.DP = 2; c.Parallel.EP = 2; c.Train.GlobalBatch = 64 },
		"cp 2":                    func(c *Config) { c.Parallel.CP = 2 },
		"cp seq/2":                func(c *Config) { c.Parallel.CP = 32 }, // chunks of one token
		"dp ep cp":                func(c *Config) { c.Parallel.DP, c.Parallel.EP, c.Parallel.CP, c.Train.GlobalBatch = 2, 2, 4, 32 },
	}
	for name, edit := range edits {
		cfg := DefaultConfig()
		edit(&cfg)
		if err := cfg.Validate(); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// TestValidateReportsAll wants every problem of a config with several, not
// just the first.
func TestValidateReportsAll(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Model.Heads = 6
	cfg.Train.LR = -1
	cfg.Log.Level = "loud"
	cfg.Parallel.TP = 2
	cfg.Model.MoE.Experts = 5 // not divisible by ep x tp
	var fields []string
	for _, p := range fieldErrors(t, cfg.Validate()) {
		fields = append(fields, p.Field)
	}
	sort.Strings(fields)
	want := "log.level model.heads parallel.tp train.lr"
	if got := strings.Join(fields, " "); got != want {
		t.Errorf("fields at fault: got %q, want %q", got, want)
	}
}

func TestAccumSteps(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Train.GlobalBatch, cfg.Train.MicroBatch = 96, 4
	cfg.Parallel.DP, cfg.Parallel.EP = 3, 2
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if got := cfg.DataParallelRanks(); got != 6 {
		t.Errorf("DataParallelRanks = %d, want 6", got)
	}
	if got := cfg.AccumSteps(); got != 4 {
		t.Errorf("AccumSteps = %d, want 4", got)
	}
	cfg.Train.MicroBatch = 0
	if got := cfg.AccumSteps(); got != 0 {
		t.Errorf("AccumSteps with micro_batch 0 = %d, want 0", got)
	}
}

func fieldErrors(t *testing.T, err error) []*FieldError {
	t.Helper()
	if err == nil {
		return nil
	}
	joined, ok := err.(interface{ Unwrap() []error })
	if !ok {
		t.Fatalf("Validate returned %T, want a joined error", err)
	}
	var out []*FieldError
	for _, e := range joined.Unwrap() {
		var fe *FieldError
		if !errors.As(e, &fe) {
			t.Fatalf("problem %q is %T, want *FieldError", e, e)
		}
		out = append(out, fe)
	}
	return out
}
