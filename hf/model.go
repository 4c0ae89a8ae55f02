package hf

import "fmt"

// File names of a Hugging Face model directory.
const (
	ConfigFile  = "config.json"
	WeightsFile = "model.safetensors"
	IndexFile   = "model.safetensors.index.json" // of a sharded directory
)

// Names of the tensors outside the decoder layers.
const (
	EmbedName     = "model.embed_tokens.weight"
	FinalNormName = "model.norm.weight"
	LMHeadName    = "lm_head.weight"
)

// Model is the shape of a Mixtral model and the hyperparameters its
// config.json records. The experts are SwiGLU (silu), the LM head untied.
type Model struct {
	Vocab   int // vocab_size
	Dim     int // hidden_size
	Layers  int // num_hidden_layers
	Heads   int // num_attention_heads
	KVHeads int // num_key_value_heads
	HeadDim int // head_dim

	FFN     int // intermediate_size: one expert's hidden width
	Experts int // num_local_experts
	TopK    int // num_experts_per_tok

	RopeTheta float64 // rope_theta
	NormEps   float64 // rms_norm_eps

	// Recorded in config.json but not compared by Open: they do not change
	// the function the weights compute.
	MaxPositions int     // max_position_embeddings: the training sequence length
	AuxLossCoef  float64 // router_aux_loss_coef
	InitStd      float64 // initializer_range

	// Tokenizer, when not nil, is written beside the weights
	// (tokenizer.json, tokenizer_config.json), and config.json records its
	// bos_token_id and eos_token_id. Open ignores it.
	Tokenizer *Tokenizer
}

// Tensor is one tensor of a model directory.
type Tensor struct {
	Name  string
	Shape []int
}

// layerName is the name of tensor suffix of decoder layer l, for example
// layerName(0, "self_attn.q_proj.weight").
func layerName(l int, suffix string) string { return fmt.Sprintf("model.layers.%d.%s", l, suffix) }

// expertName is the name of expert j's matrix w ("w1", "w2" or "w3") in
// layer l.
func expertName(l, j int, w string) string {
	return fmt.Sprintf("model.layers.%d.block_sparse_moe.experts.%d.%s.weight", l, j, w)
}

// Tensors lists every tensor of a Mixtral model of shape m, in the order
// mktrain writes them (its checkpoints' order): the embedding; per layer
// the attention norm and projections, the MoE norm, the router, then w1,
// w2 and w3 of every expert; the final norm and the LM head.
func Tensors(m Model) []Tensor {
	D, Q, KV, F := m.Dim, m.Heads*m.HeadDim, m.KVHeads*m.HeadDim, m.FFN
	out := []Tensor{{EmbedName, []int{m.Vocab, D}}}
	for l := range m.Layers {
		out = append(out,
			Tensor{layerName(l, "input_layernorm.weight"), []int{D}},
			Tensor{layerName(l, "self_attn.q_proj.weight"), []int{Q, D}},
			Tensor{layerName(l, "self_attn.k_proj.weight"), []int{KV, D}},
			Tensor{layerName(l, "self_attn.v_proj.weight"), []int{KV, D}},
			Tensor{layerName(l, "self_attn.o_proj.weight"), []int{D, Q}},
			Tensor{layerName(l, "post_attention_layernorm.weight"), []int{D}},
			Tensor{layerName(l, "block_sparse_moe.gate.weight"), []int{m.Experts, D}},
		)
		for _, w := range []struct {
			name  string
			shape []int
		}{{"w1", []int{F, D}}, {"w2", []int{D, F}}, {"w3", []int{F, D}}} {
			for j := range m.Experts {
				out = append(out, Tensor{expertName(l, j, w.name), w.shape})
			}
		}
	}
	return append(out, Tensor{FinalNormName, []int{D}}, Tensor{LMHeadName, []int{m.Vocab, D}})
}

func numElements(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}
