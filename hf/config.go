package hf

// config.json: written from a Model (configFor), and compared with the
// Model a reader expects (checkConfig).

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"

	"github.com/mktrain/mktrain/checkpoint/safetensors"
)

// DType is how Write stores the tensors: BF16 (rounded to nearest even)
// or FP32.
type DType string

const (
	BF16 DType = "bf16"
	FP32 DType = "fp32"
)

// ParseDType reads a DType from its name, "bf16" or "fp32".
func ParseDType(name string) (DType, error) {
	switch d := DType(name); d {
	case BF16, FP32:
		return d, nil
	}
	return "", fmt.Errorf("dtype %q: want bf16 or fp32", name)
}

// encodings returns the dtype of the tensors in model.safetensors and the
// torch_dtype config.json names.
func (d DType) encodings() (st safetensors.DType, torch string, err error) {
	switch d {
	case BF16:
		return safetensors.BF16, "bfloat16", nil
	case FP32:
		return safetensors.F32, "float32", nil
	}
	_, err = ParseDType(string(d))
	return "", "", err
}

// config is config.json: the fields of transformers' MixtralConfig.
type config struct {
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

func configFor(m Model, torchDType string) config {
	c := config{
		Architectures: []string{"MixtralForCausalLM"}, ModelType: "mixtral",
		VocabSize: m.Vocab, HiddenSize: m.Dim, IntermediateSize: m.FFN, NumHiddenLayers: m.Layers,
		NumAttentionHeads: m.Heads, NumKeyValueHeads: m.KVHeads, HeadDim: m.HeadDim,
		NumLocalExperts: m.Experts, NumExpertsPerTok: m.TopK,
		RopeTheta: jsonFloat(m.RopeTheta), RMSNormEps: jsonFloat(m.NormEps), MaxPositionEmbeddings: m.MaxPositions,
		HiddenAct: "silu", RouterAuxLossCoef: jsonFloat(m.AuxLossCoef), InitializerRange: jsonFloat(m.InitStd),
		TorchDType: torchDType, UseCache: true,
	}
	// generate() stops at eos_token_id; without a tokenizer (byte-level)
	// there is none.
	if t := m.Tokenizer; t != nil {
		if t.BOS != "" {
			c.BOSTokenID = &t.BOSID
		}
		if t.EOS != "" {
			c.EOSTokenID = &t.EOSID
		}
	}
	return c
}

// checkConfig compares the config.json at path with want and names every
// field that differs, by its key and the recipe's field. It returns
// tie_word_embeddings.
func checkConfig(path string, want Model) (tied bool, err error) {
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
		{"vocab_size", "model.vocab", want.Vocab, nil},
		{"hidden_size", "model.dim", want.Dim, nil},
		{"num_hidden_layers", "model.layers", want.Layers, nil},
		{"num_attention_heads", "model.heads", want.Heads, nil},
		{"num_key_value_heads", "model.kv_heads", want.KVHeads, &heads},
		{"head_dim", "model.dim/model.heads", want.HeadDim, &want.HeadDim},
		{"intermediate_size", "model.moe.ffn", want.FFN, nil},
		{"num_local_experts", "model.moe.experts", want.Experts, nil},
		{"num_experts_per_tok", "model.moe.top_k", want.TopK, nil},
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
		{"rope_theta", "model.rope_theta", want.RopeTheta, 1e6},
		{"rms_norm_eps", "model.norm_eps", want.NormEps, 1e-5},
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
