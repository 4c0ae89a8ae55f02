// Package hf reads and writes Hugging Face Mixtral model directories, the
// form in which transformers' MixtralForCausalLM saves and loads a model:
// config.json and safetensors weights under Mixtral's tensor names. mktrain
// exports a checkpoint with it (infer.ExportHF, `mktrain export --format
// hf`) and starts a run from such a directory (checkpoint.init_from, in
// package engine).
//
// Write a directory from any source of float32 tensors:
//
//	m := hf.Model{Vocab: 256, Dim: 64, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16,
//		FFN: 128, Experts: 4, TopK: 2, RopeTheta: 1e6, NormEps: 1e-5, MaxPositions: 64}
//	err := hf.Write("out/hf", m, hf.BF16, func(name string, dst []float32) error {
//		return ck.Model().ReadInto(name, dst) // every tensor of hf.Tensors(m), in order
//	})
//
// Read one back, checking that it holds a model of that shape:
//
//	w, err := hf.Open("out/hf", m) // config.json must describe m
//	defer w.Close()
//	err = w.Read("model.layers.0.self_attn.q_proj.weight", []int{64, 64}, dst)
//
// A written directory:
//
//	config.json            model_type mixtral, the shape, rope_theta, rms_norm_eps, torch_dtype,
//	                       bos_token_id and eos_token_id (null without a tokenizer)
//	model.safetensors      every tensor of Tensors(m) in F32 or BF16, metadata {"format": "pt"}
//	tokenizer.json         with Model.Tokenizer: the tokenizer, byte for byte
//	tokenizer_config.json  with it: tokenizer_class PreTrainedTokenizerFast, bos, eos and
//	                       unk tokens, model_max_length (TokenizerConfig)
//
// so that AutoTokenizer.from_pretrained loads the tokenizer beside the
// model (TokenizerFor describes a package tokenizer Tokenizer for it).
// A directory read may instead be sharded: model-0000i-of-0000n.safetensors
// files listed by model.safetensors.index.json's weight_map; tensors may be
// F32, BF16, F16 or F64, and a config with tie_word_embeddings may omit
// lm_head.weight (the embedding is read in its place).
//
// Open's errors name the recipe's fields (model.dim, model.moe.experts,
// ...) beside config.json's keys: mktrain's models come from recipes
// (engine.HFModel maps one to a Model). scripts/hf_check.py loads an fp32
// export in transformers and compares its loss with `mktrain eval --json`
// on the same windows.
//
// The package knows the format only: which mktrain checkpoint or rank the
// tensors come from or go to is its callers' business (package infer for
// the export, package engine for checkpoint.init_from), so it imports
// neither.
package hf
