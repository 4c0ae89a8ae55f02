package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/checkpoint/safetensors"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/moe"
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

// closeToBF16 reports whether y is x rounded to bfloat16: its low 16 bits
// are zero and it is within half a unit of bf16's 8-bit mantissa.
func closeToBF16(x, y float32) bool {
	return math.Float32bits(y)&0xffff == 0 && math.Abs(float64(y-x)) <= math.Abs(float64(x))*(1.0/256)
}

// TestExportHF: the export holds exactly Mixtral's tensors with the
// checkpoint's values (exact in fp32, rounded in bf16) and a config.json
// describing the model.
func TestExportHF(t *testing.T) {
	cfg := inferenceConfig()
	run := t.TempDir()
	trainRun(t, cfg, run)
	want := checkpointTensors(t, false, run)
	m := cfg.Model
	for _, dtype := range []string{"fp32", "bf16"} {
		t.Run(dtype, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "hf")
			if err := ExportHF(run, out, dtype); err != nil {
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

// importedRank loads an HF directory into a fresh rank (initialised with
// another seed) with n expert-parallel ranks and returns the weights of
// all ranks by tensor name.
func importedRanks(t *testing.T, cfg Config, hfDir string, ep int) (map[string][]float32, error) {
	t.Helper()
	cfg.Train.Seed = 99
	cfg.Parallel.EP = ep
	cfg.Model.MoE.Dispatcher = moe.DispatcherUnfused // newRank takes a resolved one
	b := cpu.New(backend.Float32)
	world, err := comm.NewLocal(comm.Mesh{DP: 1, EP: ep, CP: 1, TP: 1}, b)
	if err != nil {
		t.Fatal(err)
	}
	ranks := make([]*rank, ep)
	for i := range ranks {
		if ranks[i], err = newRank(cfg, b, world[i], nil, nil); err != nil {
			t.Fatal(err)
		}
	}
	e := &Engine{cfg: cfg, log: zerolog.Nop()}
	if err := e.loadHF(hfDir, ranks); err != nil {
		return nil, err
	}
	out := map[string][]float32{}
	for _, r := range ranks {
		for _, p := range r.params {
			w := backend.DownloadFloat32(r.b, p.w)
			for _, piece := range p.pieces() {
				out[piece.name] = w[piece.offset : piece.offset+piece.size]
			}
		}
	}
	return out, nil
}

// TestImportHF: an export imports back into 1 and 2 expert-parallel ranks
// with the checkpoint's weights (exactly from fp32, rounded from bf16), and
// so does a sharded directory with an index and mixed dtypes.
func TestImportHF(t *testing.T) {
	cfg := inferenceConfig()
	run := t.TempDir()
	trainRun(t, cfg, run)
	want := checkpointTensors(t, false, run)
	check := func(t *testing.T, got map[string][]float32, exact func(name string) bool) {
		t.Helper()
		if len(got) != len(mixtralNames(cfg.Model)) {
			t.Fatalf("%d tensors imported", len(got))
		}
		for name, g := range got {
			for i, w := range want[name] {
				if exact(name) && g[i] != w || !exact(name) && !closeToBF16(w, g[i]) {
					t.Fatalf("%s[%d]: imported %v, checkpoint %v", name, i, g[i], w)
				}
			}
		}
	}
	for _, dtype := range []string{"fp32", "bf16"} {
		out := filepath.Join(t.TempDir(), "hf")
		if err := ExportHF(run, out, dtype); err != nil {
			t.Fatal(err)
		}
		for _, ep := range []int{1, 2} {
			got, err := importedRanks(t, cfg, out, ep)
			if err != nil {
				t.Fatalf("%s, ep %d: %v", dtype, ep, err)
			}
			check(t, got, func(string) bool { return dtype == "fp32" })
		}
	}

	// Sharded: layer tensors in a BF16 file, the rest in an F32 file.
	sharded := t.TempDir()
	shapes := tensorShapes(t, run)
	isLayer := func(name string) bool { return strings.HasPrefix(name, "model.layers.") }
	weightMap := map[string]string{}
	for _, part := range []struct {
		file  string
		dtype safetensors.DType
		pick  func(string) bool
	}{
		{"model-00001-of-00002.safetensors", safetensors.BF16, isLayer},
		{"model-00002-of-00002.safetensors", safetensors.F32, func(n string) bool { return !isLayer(n) }},
	} {
		var specs []safetensors.TensorSpec
		for _, n := range mixtralNames(cfg.Model) {
			if part.pick(n) {
				specs = append(specs, safetensors.TensorSpec{Name: n, DType: part.dtype, Shape: shapes[n]})
				weightMap[n] = part.file
			}
		}
		writeSafetensors(t, filepath.Join(sharded, part.file), specs, want)
	}
	index, _ := json.Marshal(map[string]any{"metadata": map[string]any{"total_size": 0}, "weight_map": weightMap})
	if err := os.WriteFile(filepath.Join(sharded, "model.safetensors.index.json"), index, 0o644); err != nil {
		t.Fatal(err)
	}
	exported := filepath.Join(t.TempDir(), "hf")
	if err := ExportHF(run, exported, "fp32"); err != nil {
		t.Fatal(err)
	}
	copyFile(t, filepath.Join(exported, "config.json"), filepath.Join(sharded, "config.json"))
	got, err := importedRanks(t, cfg, sharded, 2)
	if err != nil {
		t.Fatal(err)
	}
	check(t, got, func(name string) bool { return !isLayer(name) })
}

// tensorShapes reads the model tensors' shapes of the newest checkpoint
// under runDir.
func tensorShapes(t *testing.T, runDir string) map[string][]int {
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
	out := map[string][]int{}
	for _, name := range ck.Model().Names() {
		out[name], _ = ck.Model().Shape(name)
	}
	return out
}

// writeSafetensors writes the tensors specs declares, with values from vals.
func writeSafetensors(t *testing.T, path string, specs []safetensors.TensorSpec, vals map[string][]float32) {
	t.Helper()
	var buf bytes.Buffer
	w, err := safetensors.NewWriter(&buf, specs, map[string]string{"format": "pt"})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range specs {
		if err := w.WriteFloat32(vals[s.Name]); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	raw, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, raw, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestInitFromStartsFromExportedWeights: a run with checkpoint.init_from
// on 2 expert-parallel ranks and a learning rate too small to move a
// float32 weight ends with exactly the exported weights, and its
// validation loss is the exporting checkpoint's.
func TestInitFromStartsFromExportedWeights(t *testing.T) {
	cfg := inferenceConfig()
	runA := t.TempDir()
	trainRun(t, cfg, runA)
	out := filepath.Join(t.TempDir(), "hf")
	if err := ExportHF(runA, out, "fp32"); err != nil {
		t.Fatal(err)
	}
	m, err := LoadModel(runA)
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
	eng, err := New(b, WithRunDir(runB), WithLogger(zerolog.New(zerolog.SyncWriter(&logBuf))))
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
	a, got := checkpointTensors(t, false, runA), checkpointTensors(t, false, runB)
	for _, name := range mixtralNames(cfg.Model) {
		if !slices.Equal(a[name], got[name]) {
			t.Fatalf("%s differs from the exported weights", name)
		}
	}
	if math.Abs(res.ValLoss-wantVal.Loss) > 1e-5*wantVal.Loss {
		t.Errorf("validation loss %v, exporting checkpoint's %v", res.ValLoss, wantVal.Loss)
	}
}

// TestHFErrors: what cannot be exported or imported is refused, naming the
// field or tensor.
func TestHFErrors(t *testing.T) {
	cfg := inferenceConfig()
	run := t.TempDir()
	trainRun(t, cfg, run)
	out := filepath.Join(t.TempDir(), "hf")
	if err := ExportHF(run, out, "fp32"); err != nil {
		t.Fatal(err)
	}
	if err := ExportHF(run, out, "fp32"); err == nil || !strings.Contains(err.Error(), "not empty") {
		t.Errorf("export into a full directory: %v", err)
	}
	if err := ExportHF(run, filepath.Join(t.TempDir(), "x"), "fp16"); err == nil || !strings.Contains(err.Error(), "fp16") {
		t.Errorf("export as fp16: %v", err)
	}

	// Mismatched config.json.
	bad := t.TempDir()
	copyFile(t, filepath.Join(out, "model.safetensors"), filepath.Join(bad, "model.safetensors"))
	raw, err := os.ReadFile(filepath.Join(out, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	var c map[string]any
	if err := json.Unmarshal(raw, &c); err != nil {
		t.Fatal(err)
	}
	c["num_local_experts"], c["rope_theta"] = 8, 10000.0
	delete(c, "num_hidden_layers")
	raw, _ = json.Marshal(c)
	if err := os.WriteFile(filepath.Join(bad, "config.json"), raw, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = importedRanks(t, cfg, bad, 1)
	for _, want := range []string{"config.json", "num_local_experts 8 != model.moe.experts 4", "rope_theta 10000 != model.rope_theta 1e+06", "num_hidden_layers is missing"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("mismatched config: error %v does not mention %q", err, want)
		}
	}

	// A missing tensor.
	missing := t.TempDir()
	copyFile(t, filepath.Join(out, "config.json"), filepath.Join(missing, "config.json"))
	vals, _, _ := readSafetensors(t, filepath.Join(out, "model.safetensors"))
	shapes := tensorShapes(t, run)
	drop := "model.layers.1.block_sparse_moe.experts.3.w2.weight"
	var specs []safetensors.TensorSpec
	for _, name := range mixtralNames(cfg.Model) {
		if name != drop {
			specs = append(specs, safetensors.TensorSpec{Name: name, DType: safetensors.F32, Shape: shapes[name]})
		}
	}
	writeSafetensors(t, filepath.Join(missing, "model.safetensors"), specs, vals)
	if _, err := importedRanks(t, cfg, missing, 2); err == nil || !strings.Contains(err.Error(), drop) {
		t.Errorf("missing tensor: %v", err)
	}
	if _, err := importedRanks(t, cfg, t.TempDir(), 1); err == nil || !strings.Contains(err.Error(), "config.json") {
		t.Errorf("empty directory: %v", err)
	}

	// Shared experts and expert biases have no Mixtral form.
	shared := cfg
	shared.Model.MoE.SharedExperts = 1
	shared.Train.Steps, shared.Train.WarmupSteps = 1, 0
	sharedRun := t.TempDir()
	trainRun(t, shared, sharedRun)
	if err := ExportHF(sharedRun, filepath.Join(t.TempDir(), "x"), "bf16"); err == nil || !strings.Contains(err.Error(), "shared_experts") {
		t.Errorf("shared experts: %v", err)
	}
	biased := cfg
	biased.Model.MoE.BiasUpdateRate = 1e-3
	biasedRun := t.TempDir()
	trainRun(t, biased, biasedRun)
	if err := ExportHF(biasedRun, filepath.Join(t.TempDir(), "x"), "bf16"); err == nil || !strings.Contains(err.Error(), "expert_bias") {
		t.Errorf("expert bias: %v", err)
	}
}
