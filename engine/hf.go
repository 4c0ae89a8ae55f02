package engine

// Hugging Face Mixtral export and import. The model computes what
// transformers' MixtralForCausalLM computes and its parameters already have
// Mixtral's names (params.go), so an export is config.json plus the
// checkpoint's model tensors minus mktrain's own (expert biases), and an
// import reads tensors by name into each rank, experts by global index.
//
// An exported directory:
//
//	config.json         model_type mixtral, the shape, rope_theta, rms_norm_eps, torch_dtype
//	model.safetensors   every tensor in F32 or BF16, metadata {"format": "pt"}
//
// An imported one may instead be sharded: model-0000i-of-0000n.safetensors
// files listed by model.safetensors.index.json's weight_map; tensors may be
// F32, BF16, F16 or F64.
//
// scripts/hf_check.py loads an fp32 export in transformers and compares its
// loss with `mktrain eval --json` on the same windows.

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/checkpoint/safetensors"
)

// File names of a Hugging Face model directory.
const (
	hfConfigName  = "config.json"
	hfWeightsName = "model.safetensors"
	hfIndexName   = "model.safetensors.index.json"
)

// hfConfig is the config.json of an exported model: the fields of
// transformers' MixtralConfig.
type hfConfig struct {
	Architectures         []string  `json:"architectures"`
	ModelType             string    `json:"model_type"`
	VocabSize             int       `json:"vocab_size"`
	HiddenSize            int       `json:"hidden_size"`
	IntermediateSize      int       `json:"intermediate_size"`
	NumHiddenLayers       int       `json:"num_hidden_layers"`
	NumAttentionHeads     int       `json:"num_attention_heads"`
	NumKeyValueHeads      int       `json:"num_key_value_heads"`
	HeadDim               int       `json:"head_dim"`
	NumLocalExperts       int       `json:"num_local_experts"`
	NumExpertsPerTok      int       `json:"num_experts_per_tok"`
	RopeTheta             jsonFloat `json:"rope_theta"`
	RMSNormEps            jsonFloat `json:"rms_norm_eps"`
	MaxPositionEmbeddings int       `json:"max_position_embeddings"`
	TieWordEmbeddings     bool      `json:"tie_word_embeddings"`
	HiddenAct             string    `json:"hidden_act"`
	RouterAuxLossCoef     jsonFloat `json:"router_aux_loss_coef"`
	RouterJitterNoise     jsonFloat `json:"router_jitter_noise"`
	OutputRouterLogits    bool      `json:"output_router_logits"`
	SlidingWindow         *int      `json:"sliding_window"` // null: full attention
	AttentionDropout      jsonFloat `json:"attention_dropout"`
	InitializerRange      jsonFloat `json:"initializer_range"`
	TorchDType            string    `json:"torch_dtype"`
	BOSTokenID            *int      `json:"bos_token_id"` // null: the byte-level tokenizer has no special tokens
	EOSTokenID            *int      `json:"eos_token_id"`
	PadTokenID            *int      `json:"pad_token_id"`
	UseCache              bool      `json:"use_cache"`
}

// jsonFloat is a float64 that is written with a decimal point or an
// exponent, as Python reads floats: transformers' config classes refuse an
// integer (0) where they declare a float.
type jsonFloat float64

func (f jsonFloat) MarshalJSON() ([]byte, error) {
	v := float64(f)
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return nil, fmt.Errorf("config.json: %v is not a JSON number", v)
	}
	b := strconv.AppendFloat(nil, v, 'g', -1, 64)
	if !bytes.ContainsAny(b, ".e") {
		b = append(b, ".0"...)
	}
	return b, nil
}

func hfConfigFor(cfg Config, torchDType string) hfConfig {
	m := cfg.Model
	return hfConfig{
		Architectures: []string{"MixtralForCausalLM"}, ModelType: "mixtral",
		VocabSize: m.Vocab, HiddenSize: m.Dim, IntermediateSize: m.MoE.FFN, NumHiddenLayers: m.Layers,
		NumAttentionHeads: m.Heads, NumKeyValueHeads: m.KVHeads, HeadDim: m.HeadDim(),
		NumLocalExperts: m.MoE.Experts, NumExpertsPerTok: m.MoE.TopK,
		RopeTheta: jsonFloat(m.RopeTheta), RMSNormEps: jsonFloat(m.NormEps), MaxPositionEmbeddings: cfg.Train.Seq,
		HiddenAct: "silu", RouterAuxLossCoef: jsonFloat(m.MoE.AuxLossCoef), InitializerRange: jsonFloat(m.InitStd),
		TorchDType: torchDType, UseCache: true,
	}
}

// mixtralNames lists the tensors of a Mixtral model of shape m (one
// without shared experts), in checkpoint order, experts by global index.
func mixtralNames(m ModelConfig) []string {
	var names []string
	for _, t := range ParamShapes(m) {
		names = append(names, t.Name)
	}
	return names
}

// ExportHF writes the model of a checkpoint as a Hugging Face Mixtral
// directory that transformers' MixtralForCausalLM.from_pretrained loads:
// outDir/config.json and outDir/model.safetensors, its tensors in dtype
// "fp32" or "bf16" (rounded to nearest even). ckptDir is a checkpoint, or a
// run directory or checkpoints root whose newest verified checkpoint is
// taken (see ResolveCheckpoint); its checksums are verified first.
//
// Mixtral has no shared experts and routes without a bias, so a model with
// model.moe.shared_experts or a nonzero expert bias (bias_update_rate) is
// refused. A model trained with a capacity factor exports, but transformers
// routes without a capacity: its outputs differ wherever tokens were dropped.
//
// The directory appears whole or not at all: it is written under a
// temporary name beside outDir and renamed. outDir must not exist, or be an
// empty directory.
func ExportHF(ckptDir, outDir, dtype string) error {
	var dt safetensors.DType
	var torchDType string
	switch dtype {
	case "bf16":
		dt, torchDType = safetensors.BF16, "bfloat16"
	case "fp32":
		dt, torchDType = safetensors.F32, "float32"
	default:
		return fmt.Errorf("export: dtype %q: want bf16 or fp32", dtype)
	}
	dir, err := ResolveCheckpoint(ckptDir, nil)
	if err != nil {
		return err
	}
	ck, err := checkpoint.Open(dir)
	if err != nil {
		return err
	}
	defer ck.Close()
	var st trainState
	if err := ck.ReadState(&st); err != nil {
		return err
	}
	m := st.Config.Model
	if err := checkExportable(ck, m); err != nil {
		return fmt.Errorf("export of %s: %w", dir, err)
	}
	want := ParamShapes(m)
	specs := make([]safetensors.TensorSpec, len(want))
	largest := 0
	for i, t := range want {
		shape, ok := ck.Model().Shape(t.Name)
		switch {
		case !ok:
			return fmt.Errorf("export of %s: the checkpoint has no tensor %q", dir, t.Name)
		case !slices.Equal(shape, t.Shape):
			return fmt.Errorf("export of %s: tensor %q has shape %v, but the checkpoint's model section makes it %v", dir, t.Name, shape, t.Shape)
		}
		specs[i] = safetensors.TensorSpec{Name: t.Name, DType: dt, Shape: shape}
		largest = max(largest, numElements(shape))
	}
	config, err := json.MarshalIndent(hfConfigFor(st.Config, torchDType), "", "  ")
	if err != nil {
		return err
	}
	return writeDirAtomic(outDir, func(tmp string) error {
		if err := writeFileSynced(filepath.Join(tmp, hfConfigName), func(w *bufio.Writer) error {
			_, err := w.Write(append(config, '\n'))
			return err
		}); err != nil {
			return err
		}
		buf := make([]float32, largest)
		return writeFileSynced(filepath.Join(tmp, hfWeightsName), func(w *bufio.Writer) error {
			sw, err := safetensors.NewWriter(w, specs, map[string]string{"format": "pt"})
			if err != nil {
				return err
			}
			for _, s := range specs {
				part := buf[:numElements(s.Shape)]
				if err := ck.Model().ReadInto(s.Name, part); err != nil {
					return err
				}
				if err := sw.WriteFloat32(part); err != nil {
					return err
				}
			}
			return sw.Close()
		})
	})
}

// checkExportable refuses what Mixtral cannot represent.
func checkExportable(ck *checkpoint.Checkpoint, m ModelConfig) error {
	if m.MoE.SharedExperts > 0 {
		return fmt.Errorf("model.moe.shared_experts is %d, but Mixtral has no shared experts: the exported model could not compute this one",
			m.MoE.SharedExperts)
	}
	for l := 0; l < m.Layers; l++ {
		bias, _, err := ck.Model().Tensor(biasName(l))
		if err != nil {
			continue // trained without bias balancing
		}
		for e, v := range bias {
			if v != 0 {
				return fmt.Errorf("%s[%d] is %g (aux-loss-free balancing, model.moe.bias_update_rate %g), but Mixtral routes without a bias: the exported model would route differently",
					biasName(l), e, v, m.MoE.BiasUpdateRate)
			}
		}
	}
	return nil
}

func numElements(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}

// writeDirAtomic makes outDir appear complete or not at all: fill writes
// the files into a temporary directory beside it, which is then synced and
// renamed. outDir may exist only as an empty directory.
func writeDirAtomic(outDir string, fill func(tmp string) error) (err error) {
	outDir = filepath.Clean(outDir)
	replaceEmpty := false
	switch st, statErr := os.Stat(outDir); {
	case statErr == nil && !st.IsDir():
		return fmt.Errorf("export: %s exists and is not a directory", outDir)
	case statErr == nil:
		entries, err := os.ReadDir(outDir)
		if err != nil {
			return fmt.Errorf("export: %w", err)
		}
		if len(entries) > 0 {
			return fmt.Errorf("export: %s already exists and is not empty; choose a new directory", outDir)
		}
		replaceEmpty = true
	case !errors.Is(statErr, fs.ErrNotExist):
		return fmt.Errorf("export: %w", statErr)
	}
	parent := filepath.Dir(outDir)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return fmt.Errorf("export: %w", err)
	}
	tmp, err := os.MkdirTemp(parent, ".tmp-"+filepath.Base(outDir)+"-")
	if err != nil {
		return fmt.Errorf("export: %w", err)
	}
	defer func() {
		if err != nil {
			os.RemoveAll(tmp)
		}
	}()
	if err := fill(tmp); err != nil {
		return err
	}
	if err := os.Chmod(tmp, 0o755); err != nil {
		return fmt.Errorf("export: %w", err)
	}
	if err := syncPath(tmp); err != nil {
		return err
	}
	if replaceEmpty {
		if err := os.Remove(outDir); err != nil {
			return fmt.Errorf("export: %w", err)
		}
	}
	if err := os.Rename(tmp, outDir); err != nil {
		return fmt.Errorf("export: %w", err)
	}
	return syncPath(parent)
}

// writeFileSynced creates path, lets write fill it through a buffer, and
// flushes, fsyncs and closes it.
func writeFileSynced(path string, write func(*bufio.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("export: %w", err)
	}
	w := bufio.NewWriterSize(f, 1<<20)
	err = write(w)
	if err == nil {
		err = w.Flush()
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("export: %s: %w", path, err)
	}
	return nil
}

func syncPath(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("export: %w", err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("export: syncing %s: %w", dir, err)
	}
	return nil
}

// loadHF initialises every rank from the Hugging Face Mixtral directory
// named by checkpoint.init_from: config.json must describe the recipe's
// model, and every parameter is read by name (experts by global index), in
// whatever dtype the files hold. Optimizer moments and expert biases keep
// their zero start.
func (e *Engine) loadHF(dir string, ranks []*rank) error {
	m := e.cfg.Model
	if m.MoE.SharedExperts > 0 {
		return fmt.Errorf("checkpoint.init_from: model.moe.shared_experts is %d, but a Mixtral directory has no shared experts to load",
			m.MoE.SharedExperts)
	}
	tied, err := checkHFConfig(filepath.Join(dir, hfConfigName), m)
	if err != nil {
		return fmt.Errorf("checkpoint.init_from: %w", err)
	}
	ts, err := openHFTensors(dir)
	if err != nil {
		return fmt.Errorf("checkpoint.init_from: %w", err)
	}
	defer ts.close()
	for i, r := range ranks {
		if err := ts.loadRank(r, tied); err != nil {
			return fmt.Errorf("checkpoint.init_from: rank %d: %w", i, err)
		}
	}
	e.log.Info().Str("init_from", dir).Int("files", len(ts.files)).Msg("initialised from Hugging Face weights")
	return nil
}

// checkHFConfig compares a Mixtral config.json with the recipe's model and
// names every field that differs. It returns tie_word_embeddings.
func checkHFConfig(path string, m ModelConfig) (tied bool, err error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return false, err
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil {
		return false, fmt.Errorf("%s: %w", path, err)
	}
	var problems []string
	get := func(key string, dst any) bool {
		v, ok := fields[key]
		if !ok || string(v) == "null" {
			return false
		}
		if err := json.Unmarshal(v, dst); err != nil {
			problems = append(problems, fmt.Sprintf("%s is %s: %v", key, v, err))
			return false
		}
		return true
	}
	var modelType string
	if !get("model_type", &modelType) || modelType != "mixtral" {
		problems = append(problems, fmt.Sprintf("model_type is %q, want \"mixtral\"", modelType))
	}
	heads := 0
	get("num_attention_heads", &heads)
	ints := []struct {
		key, field string
		want       int
		fallback   *int // the value transformers uses when the key is absent; nil: required
	}{
		{"vocab_size", "model.vocab", m.Vocab, nil},
		{"hidden_size", "model.dim", m.Dim, nil},
		{"num_hidden_layers", "model.layers", m.Layers, nil},
		{"num_attention_heads", "model.heads", m.Heads, nil},
		{"num_key_value_heads", "model.kv_heads", m.KVHeads, &heads},
		{"head_dim", "model.dim/model.heads", m.HeadDim(), ptr(m.HeadDim())},
		{"intermediate_size", "model.moe.ffn", m.MoE.FFN, nil},
		{"num_local_experts", "model.moe.experts", m.MoE.Experts, nil},
		{"num_experts_per_tok", "model.moe.top_k", m.MoE.TopK, nil},
	}
	for _, f := range ints {
		var got int
		switch {
		case get(f.key, &got):
		case f.fallback != nil:
			got = *f.fallback
		default:
			problems = append(problems, fmt.Sprintf("%s is missing (the recipe's %s is %d)", f.key, f.field, f.want))
			continue
		}
		if got != f.want {
			problems = append(problems, fmt.Sprintf("%s %d != %s %d", f.key, got, f.field, f.want))
		}
	}
	// Not shapes, but weights trained with other values compute another
	// function.
	floats := []struct {
		key, field     string
		want, fallback float64
	}{
		{"rope_theta", "model.rope_theta", m.RopeTheta, 1e6},
		{"rms_norm_eps", "model.norm_eps", m.NormEps, 1e-5},
	}
	for _, f := range floats {
		got := f.fallback
		get(f.key, &got)
		if math.Abs(got-f.want) > 1e-9*math.Abs(f.want) {
			problems = append(problems, fmt.Sprintf("%s %g != %s %g", f.key, got, f.field, f.want))
		}
	}
	var act string
	if get("hidden_act", &act) && act != "silu" {
		problems = append(problems, fmt.Sprintf("hidden_act is %q; the experts are SwiGLU (silu)", act))
	}
	get("tie_word_embeddings", &tied)
	if len(problems) > 0 {
		return false, fmt.Errorf("%s: %s", path, strings.Join(problems, "; "))
	}
	return tied, nil
}

func ptr[T any](v T) *T { return &v }

// hfTensors finds the tensors of a Hugging Face directory by name, across
// its shard files.
type hfTensors struct {
	dir    string
	files  []*safetensors.File
	byName map[string]hfTensor
}

type hfTensor struct {
	file *safetensors.File
	path string
	info safetensors.TensorInfo
}

// openHFTensors opens model.safetensors, or the shards that
// model.safetensors.index.json's weight_map lists.
func openHFTensors(dir string) (_ *hfTensors, err error) {
	ts := &hfTensors{dir: dir, byName: map[string]hfTensor{}}
	defer func() {
		if err != nil {
			ts.close()
		}
	}()
	indexPath := filepath.Join(dir, hfIndexName)
	raw, err := os.ReadFile(indexPath)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		path := filepath.Join(dir, hfWeightsName)
		f, err := safetensors.Open(path)
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%s has neither %s nor %s (only safetensors weights load)", dir, hfWeightsName, hfIndexName)
		}
		if err != nil {
			return nil, err
		}
		ts.files = append(ts.files, f)
		for _, info := range f.Header().Tensors {
			ts.byName[info.Name] = hfTensor{file: f, path: path, info: info}
		}
		return ts, nil
	case err != nil:
		return nil, err
	}
	var index struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	if err := json.Unmarshal(raw, &index); err != nil {
		return nil, fmt.Errorf("%s: %w", indexPath, err)
	}
	if len(index.WeightMap) == 0 {
		return nil, fmt.Errorf("%s: weight_map is missing or empty", indexPath)
	}
	opened := map[string]*safetensors.File{}
	names := make([]string, 0, len(index.WeightMap))
	for name := range index.WeightMap {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		file := index.WeightMap[name]
		if file == "" || filepath.Base(file) != file {
			return nil, fmt.Errorf("%s: tensor %q: %q is not a file name in %s", indexPath, name, file, dir)
		}
		path := filepath.Join(dir, file)
		f, ok := opened[file]
		if !ok {
			if f, err = safetensors.Open(path); err != nil {
				return nil, err
			}
			opened[file] = f
			ts.files = append(ts.files, f)
		}
		info, ok := f.Header().Lookup(name)
		if !ok {
			return nil, fmt.Errorf("%s: tensor %q is listed in %s, but that file does not hold it", path, name, hfIndexName)
		}
		ts.byName[name] = hfTensor{file: f, path: path, info: info}
	}
	return ts, nil
}

// read reads the named tensor, which must have the given shape, into dst.
func (ts *hfTensors) read(name string, shape []int, dst []float32) error {
	t, ok := ts.byName[name]
	if !ok {
		return fmt.Errorf("%s has no tensor %q", ts.dir, name)
	}
	if !slices.Equal(t.info.Shape, shape) {
		return fmt.Errorf("%s: tensor %q has shape %v, the model needs %v", t.path, name, t.info.Shape, shape)
	}
	return t.file.ReadFloat32(t.info, dst)
}

// loadRank reads every parameter of r. With tied embeddings and no
// lm_head.weight, the LM head starts as a copy of the embedding.
func (ts *hfTensors) loadRank(r *rank, tied bool) error {
	for _, p := range r.params {
		host := make([]float32, p.w.Len())
		for _, piece := range p.pieces() {
			name := piece.name
			if _, ok := ts.byName[name]; !ok && name == nameLMHead && tied {
				name = nameEmbed
			}
			if err := ts.read(name, piece.shape, host[piece.offset:piece.offset+piece.size]); err != nil {
				return err
			}
		}
		backend.UploadSlice(r.b, p.w, host)
	}
	return nil
}

func (ts *hfTensors) close() {
	for _, f := range ts.files {
		f.Close()
	}
}
