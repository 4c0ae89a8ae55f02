package engine

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

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/checkpoint/safetensors"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/hf"
	"github.com/mktrain/mktrain/moe"
)

// closeToBF16 reports whether y is x rounded to bfloat16: its low 16 bits
// are zero and it is within half a unit of bf16's 8-bit mantissa.
func closeToBF16(x, y float32) bool {
	return math.Float32bits(y)&0xffff == 0 && math.Abs(float64(y-x)) <= math.Abs(float64(x))*(1.0/256)
}

// mixtralNames lists the tensors of a Mixtral model of shape m, in
// checkpoint order.
func mixtralNames(m ModelConfig) []string {
	var names []string
	for _, t := range ParamShapes(m) {
		names = append(names, t.Name)
	}
	return names
}

// exportHF writes the newest checkpoint under run as a Mixtral directory
// with hf.Write, as infer.ExportHF does (infer imports this package, so
// its tests cover the exporter itself).
func exportHF(t *testing.T, cfg Config, run, out string, dtype hf.DType) {
	t.Helper()
	vals := checkpointTensors(t, false, run)
	err := hf.Write(out, HFModel(cfg), dtype, func(name string, dst []float32) error {
		v, ok := vals[name]
		if !ok || len(v) != len(dst) {
			return errors.New("the checkpoint has no tensor " + name)
		}
		copy(dst, v)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestParamShapesAreMixtrals: without shared experts the model's
// parameters are exactly Mixtral's tensors, in the same order, so a
// checkpoint's model section exports without renaming.
func TestParamShapesAreMixtrals(t *testing.T) {
	for _, cfg := range []Config{inferenceConfig(), DefaultConfig()} {
		got, want := ParamShapes(cfg.Model), hf.Tensors(HFModel(cfg))
		if len(got) != len(want) {
			t.Fatalf("%d parameters, %d Mixtral tensors", len(got), len(want))
		}
		for i := range got {
			if got[i].Name != want[i].Name || !slices.Equal(got[i].Shape, want[i].Shape) {
				t.Errorf("tensor %d: parameter %s %v, Mixtral %s %v", i, got[i].Name, got[i].Shape, want[i].Name, want[i].Shape)
			}
		}
	}
}

// importedRanks loads an HF directory into fresh ranks (initialised with
// another seed) with ep expert-parallel ranks and returns the weights of
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
		if ranks[i], err = newRank(context.Background(), cfg, b, world[i], nil, nil); err != nil {
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
	for _, dtype := range []hf.DType{hf.FP32, hf.BF16} {
		out := filepath.Join(t.TempDir(), "hf")
		exportHF(t, cfg, run, out, dtype)
		for _, ep := range []int{1, 2} {
			got, err := importedRanks(t, cfg, out, ep)
			if err != nil {
				t.Fatalf("%s, ep %d: %v", dtype, ep, err)
			}
			check(t, got, func(string) bool { return dtype == hf.FP32 })
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
	exportHF(t, cfg, run, exported, hf.FP32)
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

// TestImportHFErrors: what cannot be imported is refused, naming the field
// or tensor. (What cannot be exported: infer's TestExportHFErrors.)
func TestImportHFErrors(t *testing.T) {
	cfg := inferenceConfig()
	run := t.TempDir()
	trainRun(t, cfg, run)
	out := filepath.Join(t.TempDir(), "hf")
	exportHF(t, cfg, run, out, hf.FP32)

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
	vals := checkpointTensors(t, false, run)
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

	// Shared experts have no Mixtral form.
	shared := cfg
	shared.Model.MoE.SharedExperts = 1
	if _, err := importedRanks(t, shared, out, 1); err == nil || !strings.Contains(err.Error(), "shared_experts") {
		t.Errorf("shared experts: %v", err)
	}
}
