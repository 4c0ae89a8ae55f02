package infer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/checkpoint/safetensors"
	"github.com/mktrain/mktrain/engine"
)

// readSafetensors reads every tensor of one file, with its dtype.
func readSafetensors(t *testing.T, path string) (map[string][]float32, map[string]safetensors.DType, map[string]string) {
	t.Helper()
	f, err := safetensors.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	vals, dtypes := map[string][]float32{}, map[string]safetensors.DType{}
	for _, info := range f.Header().Tensors {
		if vals[info.Name], err = f.Float32(info.Name); err != nil {
			t.Fatal(err)
		}
		dtypes[info.Name] = info.DType
	}
	return vals, dtypes, f.Header().Metadata
}

// checkpointTensors reads the model tensors of the newest checkpoint under
// runDir.
func checkpointTensors(t *testing.T, runDir string) map[string][]float32 {
	t.Helper()
	dir, err := checkpoint.Latest(filepath.Join(runDir, "checkpoints"))
	if err != nil {
		t.Fatal(err)
	}
	ck, err := checkpoint.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	out := map[string][]float32{}
	for _, name := range ck.Model().Names() {
		if out[name], _, err = ck.Model().Tensor(name); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// mixtralNames lists the tensors of a Mixtral model of shape m, in
// checkpoint order.
func mixtralNames(m engine.ModelConfig) []string {
	var names []string
	for _, t := range engine.ParamShapes(m) {
		names = append(names, t.Name)
	}
	return names
}

// closeToBF16 reports whether y is x rounded to bfloat16: its low 16 bits
// are zero and it is within half a unit of bf16's 8-bit mantissa.
func closeToBF16(x, y float32) bool {
	return math.Float32bits(y)&0xffff == 0 && math.Abs(float64(y-x)) <= math.Abs(float64(x))*(1.0/256)
}

// TestExportHF: the export holds exactly Mixtral's tensors with the
// checkpoint's values (exact in fp32, rounded in bf16) and a config.json
// describing the model.
func TestExportHF(t *testing.T) {
	cfg := testConfig()
	run := t.TempDir()
	trainRun(t, cfg, run)
	want := checkpointTensors(t, run)
	m := cfg.Model
	for _, dtype := range []string{"fp32", "bf16"} {
		t.Run(dtype, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "hf")
			if err := ExportHF(context.Background(), run, out, dtype); err != nil {
				t.Fatal(err)
			}
			got, dtypes, meta := readSafetensors(t, filepath.Join(out, "model.safetensors"))
			if meta["format"] != "pt" {
				t.Errorf("metadata %v lacks format pt", meta)
			}
			wantNames := mixtralNames(m)
			if len(wantNames) != len(got) || len(wantNames) != 2+1+m.Layers*(7+3*m.MoE.Experts) {
				t.Fatalf("%d tensors, want %d", len(got), len(wantNames))
			}
			for _, name := range wantNames {
				g, ok := got[name]
				w := want[name]
				if !ok || len(g) != len(w) {
					t.Fatalf("%s: exported %v with %d values, checkpoint %d", name, ok, len(g), len(w))
				}
				for i := range w {
					if dtype == "fp32" && g[i] != w[i] || dtype == "bf16" && !closeToBF16(w[i], g[i]) {
						t.Fatalf("%s[%d]: exported %v, checkpoint %v (%s)", name, i, g[i], w[i], dtype)
					}
				}
				if wantDT := map[string]safetensors.DType{"fp32": safetensors.F32, "bf16": safetensors.BF16}[dtype]; dtypes[name] != wantDT {
					t.Errorf("%s: dtype %s", name, dtypes[name])
				}
			}
			raw, err := os.ReadFile(filepath.Join(out, "config.json"))
			if err != nil {
				t.Fatal(err)
			}
			var c map[string]any
			if err := json.Unmarshal(raw, &c); err != nil {
				t.Fatal(err)
			}
			wantConfig := map[string]any{
				"model_type": "mixtral", "vocab_size": 256.0, "hidden_size": 32.0, "intermediate_size": 32.0,
				"num_hidden_layers": 2.0, "num_attention_heads": 4.0, "num_key_value_heads": 2.0, "head_dim": 8.0,
				"num_local_experts": 4.0, "num_experts_per_tok": 2.0, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
				"max_position_embeddings": 16.0, "tie_word_embeddings": false, "hidden_act": "silu",
				"router_aux_loss_coef": 0.01, "output_router_logits": false, "sliding_window": nil,
				"attention_dropout": 0.0, "initializer_range": 0.02,
				"torch_dtype": map[string]string{"fp32": "float32", "bf16": "bfloat16"}[dtype],
			}
			for k, v := range wantConfig {
				if got, ok := c[k]; !ok || got != v {
					t.Errorf("config.json %s = %v (present %v), want %v", k, got, ok, v)
				}
			}
			if a, ok := c["architectures"].([]any); !ok || len(a) != 1 || a[0] != "MixtralForCausalLM" {
				t.Errorf("architectures %v", c["architectures"])
			}
			// transformers refuses an integer where its config declares a float.
			dec := json.NewDecoder(bytes.NewReader(raw))
			dec.UseNumber()
			var numbers map[string]any
			if err := dec.Decode(&numbers); err != nil {
				t.Fatal(err)
			}
			for _, k := range []string{"rope_theta", "rms_norm_eps", "router_aux_loss_coef", "router_jitter_noise", "attention_dropout", "initializer_range"} {
				if n, ok := numbers[k].(json.Number); !ok || !strings.ContainsAny(string(n), ".e") {
					t.Errorf("config.json %s is %v, not written as a float", k, numbers[k])
				}
			}
		})
	}
}

// TestInitFromStartsFromExportedWeights: a run with checkpoint.init_from
// on 2 expert-parallel ranks and a learning rate too small to move a
// float32 weight ends with exactly the exported weights, and its
// validation loss is the exporting checkpoint's.
func TestInitFromStartsFromExportedWeights(t *testing.T) {
	cfg := testConfig()
	runA := t.TempDir()
	trainRun(t, cfg, runA)
	out := filepath.Join(t.TempDir(), "hf")
	if err := ExportHF(context.Background(), runA, out, "fp32"); err != nil {
		t.Fatal(err)
	}
	m, err := Load(runA)
	if err != nil {
		t.Fatal(err)
	}
	wantVal, err := m.Evaluate(context.Background(), "", cfg.Train.EvalBatches)
	if err != nil {
		t.Fatal(err)
	}

	b := cfg
	b.Checkpoint.InitFrom = out
	b.Parallel.EP, b.Train.MicroBatch = 2, 4
	b.Train.Steps, b.Train.WarmupSteps, b.Train.LR, b.Train.MinLR, b.Train.WeightDecay = 1, 0, 1e-30, 0, 0
	// The same 16 windows: 2 micro-batches of 4 on each of 2 ranks.
	b.Train.Seed = 42
	runB := t.TempDir()
	var logBuf bytes.Buffer
	eng, err := engine.New(b, engine.WithRunDir(runB), engine.WithLogger(zerolog.New(zerolog.SyncWriter(&logBuf))))
	if err != nil {
		t.Fatal(err)
	}
	res, err := eng.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logBuf.String(), "init_from") {
		t.Errorf("the log does not mention init_from:\n%s", logBuf.String())
	}
	a, got := checkpointTensors(t, runA), checkpointTensors(t, runB)
	for _, name := range mixtralNames(cfg.Model) {
		if !slices.Equal(a[name], got[name]) {
			t.Fatalf("%s differs from the exported weights", name)
		}
	}
	if math.Abs(res.ValLoss-wantVal.Loss) > 1e-5*wantVal.Loss {
		t.Errorf("validation loss %v, exporting checkpoint's %v", res.ValLoss, wantVal.Loss)
	}
}

// TestExportHFErrors: what cannot be exported is refused, naming the
// field or tensor. (What cannot be imported: engine's TestImportHFErrors.)
func TestExportHFErrors(t *testing.T) {
	cfg := testConfig()
	run := t.TempDir()
	trainRun(t, cfg, run)
	out := filepath.Join(t.TempDir(), "hf")
	if err := ExportHF(context.Background(), run, out, "fp32"); err != nil {
		t.Fatal(err)
	}
	if err := ExportHF(context.Background(), run, out, "fp32"); err == nil || !strings.Contains(err.Error(), "not empty") {
		t.Errorf("export into a full directory: %v", err)
	}
	if err := ExportHF(context.Background(), run, filepath.Join(t.TempDir(), "x"), "fp16"); err == nil || !strings.Contains(err.Error(), "fp16") {
		t.Errorf("export as fp16: %v", err)
	}

	// Shared experts and expert biases have no Mixtral form.
	shared := cfg
	shared.Model.MoE.SharedExperts = 1
	shared.Train.Steps, shared.Train.WarmupSteps = 1, 0
	sharedRun := t.TempDir()
	trainRun(t, shared, sharedRun)
	if err := ExportHF(context.Background(), sharedRun, filepath.Join(t.TempDir(), "x"), "bf16"); err == nil || !strings.Contains(err.Error(), "shared_experts") {
		t.Errorf("shared experts: %v", err)
	}
	biased := cfg
	biased.Model.MoE.BiasUpdateRate = 1e-3
	biasedRun := t.TempDir()
	trainRun(t, biased, biasedRun)
	if err := ExportHF(context.Background(), biasedRun, filepath.Join(t.TempDir(), "x"), "bf16"); err == nil || !strings.Contains(err.Error(), "expert_bias") {
		t.Errorf("expert bias: %v", err)
	}
}

// TestExportHFStopsWhenCancelled: an export whose context has ended fails
// with the cause, whether it stops while verifying a step directory or
// before writing the first tensor (a run directory), and leaves nothing at
// the output path.
func TestExportHFStopsWhenCancelled(t *testing.T) {
	run := t.TempDir()
	trainRun(t, testConfig(), run)
	step, err := engine.ResolveCheckpoint(run, nil)
	if err != nil {
		t.Fatal(err)
	}
	cause := errors.New("stop requested")
	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(cause)
	for _, src := range []string{step, run} {
		out := filepath.Join(t.TempDir(), "hf")
		if err := ExportHF(ctx, src, out, "bf16"); !errors.Is(err, cause) {
			t.Errorf("export of %s after cancel: error %v, want one wrapping %v", src, err, cause)
		}
		if _, err := os.Stat(out); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("export of %s after cancel left %s: %v", src, out, err)
		}
	}
}
