package hf

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/checkpoint/safetensors"
)

// tinyModel is a Mixtral shape small enough to write in a test.
func tinyModel() Model {
	return Model{Vocab: 8, Dim: 4, Layers: 2, Heads: 2, KVHeads: 1, HeadDim: 2, FFN: 3, Experts: 2, TopK: 1,
		RopeTheta: 1e6, NormEps: 1e-5, MaxPositions: 16, AuxLossCoef: 0.01, InitStd: 0.02}
}

// tensorValues gives every tensor of m distinct values: tensor i holds
// i + k/8 at element k, and some values that bf16 must round.
func tensorValues(m Model) map[string][]float32 {
	out := map[string][]float32{}
	for i, t := range Tensors(m) {
		v := make([]float32, numElements(t.Shape))
		for k := range v {
			v[k] = float32(i) + float32(k)/8 + 1e-4
		}
		out[t.Name] = v
	}
	return out
}

func readFrom(vals map[string][]float32) func(string, []float32) error {
	return func(name string, dst []float32) error {
		v, ok := vals[name]
		if !ok || len(v) != len(dst) {
			return errors.New("no tensor " + name)
		}
		copy(dst, v)
		return nil
	}
}

// TestTensors: a Mixtral model has the embedding, 7 tensors and 3 per
// expert per layer, the final norm and the LM head, with Mixtral's names.
func TestTensors(t *testing.T) {
	m := tinyModel()
	ts := Tensors(m)
	if len(ts) != 2+1+m.Layers*(7+3*m.Experts) {
		t.Fatalf("%d tensors", len(ts))
	}
	byName := map[string][]int{}
	for _, x := range ts {
		byName[x.Name] = x.Shape
	}
	for name, shape := range map[string][]int{
		"model.embed_tokens.weight":                           {8, 4},
		"model.layers.1.self_attn.q_proj.weight":              {4, 4},
		"model.layers.1.self_attn.k_proj.weight":              {2, 4},
		"model.layers.0.self_attn.o_proj.weight":              {4, 4},
		"model.layers.0.block_sparse_moe.gate.weight":         {2, 4},
		"model.layers.1.block_sparse_moe.experts.1.w2.weight": {4, 3},
		"model.layers.1.block_sparse_moe.experts.0.w3.weight": {3, 4},
		"model.layers.0.post_attention_layernorm.weight":      {4},
		"model.norm.weight":                                   {4},
		"lm_head.weight":                                      {8, 4},
	} {
		if !slices.Equal(byName[name], shape) {
			t.Errorf("%s: shape %v, want %v", name, byName[name], shape)
		}
	}
	if ts[0].Name != EmbedName || ts[len(ts)-1].Name != LMHeadName {
		t.Errorf("first %s, last %s", ts[0].Name, ts[len(ts)-1].Name)
	}
}

// TestWriteOpen: what Write writes, Open reads back: exactly in fp32,
// rounded to bf16 in bf16; config.json writes its floats as floats.
func TestWriteOpen(t *testing.T) {
	m := tinyModel()
	vals := tensorValues(m)
	for _, dtype := range []DType{FP32, BF16} {
		dir := filepath.Join(t.TempDir(), "hf")
		if err := Write(dir, m, dtype, readFrom(vals)); err != nil {
			t.Fatal(err)
		}
		w, err := Open(dir, m)
		if err != nil {
			t.Fatal(err)
		}
		if w.Files() != 1 {
			t.Errorf("%s: %d files", dtype, w.Files())
		}
		for _, ts := range Tensors(m) {
			got := make([]float32, numElements(ts.Shape))
			if err := w.Read(ts.Name, ts.Shape, got); err != nil {
				t.Fatal(err)
			}
			for k, want := range vals[ts.Name] {
				if dtype == FP32 && got[k] != want || dtype == BF16 && got[k] != safetensors.Float32FromBF16(safetensors.BF16FromFloat32(want)) {
					t.Fatalf("%s %s[%d]: read %v, wrote %v", dtype, ts.Name, k, got[k], want)
				}
			}
		}
		w.Close()

		raw, err := os.ReadFile(filepath.Join(dir, ConfigFile))
		if err != nil {
			t.Fatal(err)
		}
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.UseNumber()
		var c map[string]any
		if err := dec.Decode(&c); err != nil {
			t.Fatal(err)
		}
		want := map[string]string{"rope_theta": "1e+06", "rms_norm_eps": "1e-05", "router_aux_loss_coef": "0.01",
			"router_jitter_noise": "0.0", "attention_dropout": "0.0", "initializer_range": "0.02",
			"num_local_experts": "2", "head_dim": "2", "max_position_embeddings": "16"}
		for k, v := range want {
			if n, ok := c[k].(json.Number); !ok || string(n) != v {
				t.Errorf("config.json %s = %v, want %s", k, c[k], v)
			}
		}
		if c["torch_dtype"] != map[DType]string{FP32: "float32", BF16: "bfloat16"}[dtype] || c["model_type"] != "mixtral" {
			t.Errorf("config.json: torch_dtype %v, model_type %v", c["torch_dtype"], c["model_type"])
		}
	}
}

// TestWriteIsAtomic: a directory that is not empty is refused, an empty
// one replaced, and a failing read leaves nothing behind.
func TestWriteIsAtomic(t *testing.T) {
	m := tinyModel()
	vals := tensorValues(m)
	parent := t.TempDir()
	full := filepath.Join(parent, "full")
	if err := os.MkdirAll(full, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(full, "x"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := Write(full, m, FP32, readFrom(vals)); err == nil || !strings.HasPrefix(err.Error(), "export: ") || !strings.Contains(err.Error(), "not empty") {
		t.Errorf("into a full directory: %v", err)
	}
	empty := filepath.Join(parent, "empty")
	if err := os.MkdirAll(empty, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := Write(empty, m, BF16, readFrom(vals)); err != nil {
		t.Errorf("into an empty directory: %v", err)
	}
	failing := filepath.Join(parent, "failing")
	delete(vals, "model.norm.weight")
	if err := Write(failing, m, FP32, readFrom(vals)); err == nil || !strings.Contains(err.Error(), "model.norm.weight") || !strings.Contains(err.Error(), WeightsFile) {
		t.Errorf("a failing read: %v", err)
	}
	entries, _ := os.ReadDir(parent)
	if len(entries) != 2 {
		t.Errorf("after a failed write %s holds %v", parent, entries)
	}
	if err := Write(filepath.Join(parent, "x"), m, "fp16", readFrom(vals)); err == nil || !strings.Contains(err.Error(), `"fp16"`) {
		t.Errorf("dtype fp16: %v", err)
	}
	if _, err := ParseDType("f32"); err == nil {
		t.Error("ParseDType accepted f32")
	}
}

// writeShard writes the named tensors of m as one safetensors file.
func writeShard(t *testing.T, path string, m Model, dtype safetensors.DType, names []string, vals map[string][]float32) {
	t.Helper()
	shapes := map[string][]int{}
	for _, ts := range Tensors(m) {
		shapes[ts.Name] = ts.Shape
	}
	var specs []safetensors.TensorSpec
	for _, n := range names {
		specs = append(specs, safetensors.TensorSpec{Name: n, DType: dtype, Shape: shapes[n]})
	}
	var buf bytes.Buffer
	w, err := safetensors.NewWriter(&buf, specs, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		if err := w.WriteFloat32(vals[n]); err != nil {
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

// writeConfig writes a config.json for m, with changes applied (a nil
// value deletes the key).
func writeConfig(t *testing.T, dir string, m Model, changes map[string]any) {
	t.Helper()
	raw, err := json.Marshal(configFor(m, "float32"))
	if err != nil {
		t.Fatal(err)
	}
	var c map[string]any
	if err := json.Unmarshal(raw, &c); err != nil {
		t.Fatal(err)
	}
	for k, v := range changes {
		if v == nil {
			delete(c, k)
		} else {
			c[k] = v
		}
	}
	raw, _ = json.Marshal(c)
	if err := os.WriteFile(filepath.Join(dir, ConfigFile), raw, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestOpenSharded: tensors spread over an index's shards, in two dtypes,
// read back; with tie_word_embeddings an absent LM head reads the
// embedding.
func TestOpenSharded(t *testing.T) {
	m := tinyModel()
	vals := tensorValues(m)
	dir := t.TempDir()
	var layers, rest []string
	weightMap := map[string]string{}
	for _, ts := range Tensors(m) {
		switch {
		case ts.Name == LMHeadName:
		case strings.HasPrefix(ts.Name, "model.layers."):
			layers = append(layers, ts.Name)
			weightMap[ts.Name] = "model-00001-of-00002.safetensors"
		default:
			rest = append(rest, ts.Name)
			weightMap[ts.Name] = "model-00002-of-00002.safetensors"
		}
	}
	writeShard(t, filepath.Join(dir, "model-00001-of-00002.safetensors"), m, safetensors.BF16, layers, vals)
	writeShard(t, filepath.Join(dir, "model-00002-of-00002.safetensors"), m, safetensors.F32, rest, vals)
	index, _ := json.Marshal(map[string]any{"weight_map": weightMap})
	if err := os.WriteFile(filepath.Join(dir, IndexFile), index, 0o644); err != nil {
		t.Fatal(err)
	}
	writeConfig(t, dir, m, map[string]any{"tie_word_embeddings": true})
	w, err := Open(dir, m)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if w.Files() != 2 {
		t.Errorf("%d files", w.Files())
	}
	for _, ts := range Tensors(m) {
		got := make([]float32, numElements(ts.Shape))
		if err := w.Read(ts.Name, ts.Shape, got); err != nil {
			t.Fatal(err)
		}
		want := vals[ts.Name]
		if ts.Name == LMHeadName {
			want = vals[EmbedName]
		}
		for k := range want {
			exact := !strings.HasPrefix(ts.Name, "model.layers.")
			if exact && got[k] != want[k] || !exact && got[k] != safetensors.Float32FromBF16(safetensors.BF16FromFloat32(want[k])) {
				t.Fatalf("%s[%d]: read %v, wrote %v", ts.Name, k, got[k], want[k])
			}
		}
	}
}

// TestOpenErrors: what does not describe the expected model, or cannot be
// found, is refused with the field, file or tensor named.
func TestOpenErrors(t *testing.T) {
	m := tinyModel()
	vals := tensorValues(m)
	good := filepath.Join(t.TempDir(), "hf")
	if err := Write(good, m, FP32, readFrom(vals)); err != nil {
		t.Fatal(err)
	}
	weights, err := os.ReadFile(filepath.Join(good, WeightsFile))
	if err != nil {
		t.Fatal(err)
	}
	withWeights := func(t *testing.T, changes map[string]any) string {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, WeightsFile), weights, 0o644); err != nil {
			t.Fatal(err)
		}
		writeConfig(t, dir, m, changes)
		return dir
	}

	bad := withWeights(t, map[string]any{"num_local_experts": 8, "rope_theta": 10000.0, "num_hidden_layers": nil,
		"hidden_act": "gelu", "model_type": "llama", "num_key_value_heads": nil})
	_, err = Open(bad, m)
	for _, want := range []string{ConfigFile, "num_local_experts 8 != model.moe.experts 2", "rope_theta 10000 != model.rope_theta 1e+06",
		"num_hidden_layers is missing (the recipe's model.layers is 2)", `hidden_act is "gelu"`, `model_type is "llama"`,
		"num_key_value_heads 2 != model.kv_heads 1"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("mismatched config: error %v does not mention %q", err, want)
		}
	}
	// Absent keys with transformers' defaults that match are fine.
	if _, err := Open(withWeights(t, map[string]any{"head_dim": nil, "rms_norm_eps": nil, "rope_theta": nil}), m); err != nil {
		t.Errorf("defaults: %v", err)
	}

	if _, err := Open(t.TempDir(), m); err == nil || !strings.Contains(err.Error(), ConfigFile) {
		t.Errorf("empty directory: %v", err)
	}
	noWeights := t.TempDir()
	writeConfig(t, noWeights, m, nil)
	if _, err := Open(noWeights, m); err == nil || !strings.Contains(err.Error(), "neither") {
		t.Errorf("no weights: %v", err)
	}
	for _, c := range []struct {
		weightMap map[string]string
		want      string
	}{
		{map[string]string{}, "weight_map is missing or empty"},
		{map[string]string{EmbedName: "../model.safetensors"}, "is not a file name"},
		{map[string]string{"model.extra": WeightsFile}, `tensor "model.extra" is listed`},
	} {
		dir := withWeights(t, nil)
		index, _ := json.Marshal(map[string]any{"weight_map": c.weightMap})
		if err := os.WriteFile(filepath.Join(dir, IndexFile), index, 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := Open(dir, m); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("index %v: %v", c.weightMap, err)
		}
	}

	w, err := Open(good, m)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	dst := make([]float32, 64)
	if err := w.Read("model.layers.0.self_attn.q_proj.weight", []int{2, 4}, dst[:8]); err == nil || !strings.Contains(err.Error(), "has shape [4 4], the model needs [2 4]") {
		t.Errorf("wrong shape: %v", err)
	}
	if err := w.Read("model.layers.9.input_layernorm.weight", []int{4}, dst[:4]); err == nil || !strings.Contains(err.Error(), "model.layers.9") {
		t.Errorf("missing tensor: %v", err)
	}
	// Untied: an absent LM head is an error, not the embedding.
	untied := t.TempDir()
	writeConfig(t, untied, m, nil)
	writeShard(t, filepath.Join(untied, WeightsFile), m, safetensors.F32, []string{EmbedName}, vals)
	wu, err := Open(untied, m)
	if err != nil {
		t.Fatal(err)
	}
	defer wu.Close()
	if err := wu.Read(LMHeadName, []int{8, 4}, dst[:32]); err == nil || !strings.Contains(err.Error(), LMHeadName) {
		t.Errorf("untied, no LM head: %v", err)
	}
}

// TestJSONFloat: floats are written as Python reads floats, and a value
// JSON cannot hold is an error.
func TestJSONFloat(t *testing.T) {
	for v, want := range map[float64]string{0: "0.0", 1e6: "1e+06", 3: "3.0", 0.25: "0.25", -2: "-2.0"} {
		got, err := json.Marshal(jsonFloat(v))
		if err != nil || string(got) != want {
			t.Errorf("%v: %s, %v; want %s", v, got, err, want)
		}
	}
	if _, err := json.Marshal(jsonFloat(math.NaN())); err == nil {
		t.Error("NaN marshalled")
	}
}
