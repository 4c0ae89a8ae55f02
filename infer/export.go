package infer

import (
	"context"
	"fmt"
	"slices"

	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/engine"
	"github.com/mktrain/mktrain/hf"
)

// ExportHF writes the model of a checkpoint as a Hugging Face Mixtral
// directory that transformers' MixtralForCausalLM.from_pretrained loads:
// outDir/config.json and outDir/model.safetensors, its tensors in dtype
// "fp32" or "bf16" (rounded to nearest even); when the run had a tokenizer
// (data.tokenizer), also outDir/tokenizer.json and tokenizer_config.json,
// which transformers' AutoTokenizer.from_pretrained loads, and
// config.json's bos_token_id and eos_token_id. ckptDir is a checkpoint, or a
// run directory or checkpoints root whose newest verified checkpoint is
// taken (see engine.ResolveCheckpoint); its checksums are verified first.
//
// Mixtral has no shared experts and routes without a bias, so a model with
// model.moe.shared_experts or a nonzero expert bias (bias_update_rate) is
// refused. A model trained with a capacity factor exports, but transformers
// routes without a capacity: its outputs differ wherever tokens were dropped.
//
// The directory appears whole or not at all (see hf.Write): outDir must
// not exist, or be an empty directory. When ctx ends (checked while a step
// directory's checksums are verified and before each tensor is written)
// nothing is left at outDir and the error wraps ctx's cause.
func ExportHF(ctx context.Context, ckptDir, outDir, dtype string) error {
	dt, err := hf.ParseDType(dtype)
	if err != nil {
		return fmt.Errorf("export: %w", err)
	}
	dir := ckptDir
	if engine.IsCheckpointDir(dir) {
		err = checkpoint.VerifyContext(ctx, dir)
	} else {
		dir, err = engine.ResolveCheckpointContext(ctx, ckptDir, nil)
	}
	if err != nil {
		return err
	}
	info, err := engine.ReadCheckpointInfo(dir)
	if err != nil {
		return err
	}
	ck, err := checkpoint.Open(dir)
	if err != nil {
		return err
	}
	defer ck.Close()
	m := engine.HFModel(info.Config)
	if err := checkExportable(ck, info.Config.Model, m); err != nil {
		return fmt.Errorf("export of %s: %w", dir, err)
	}
	tok, err := checkpointTokenizer(dir, info.Config.Model.Vocab)
	if err != nil {
		return fmt.Errorf("export of %s: %w", dir, err)
	}
	if tok != nil {
		m.Tokenizer = hf.TokenizerFor(tok)
	}
	return hf.Write(outDir, m, dt, func(name string, dst []float32) error {
		if ctx.Err() != nil {
			return fmt.Errorf("export stopped: %w", context.Cause(ctx))
		}
		return ck.Model().ReadInto(name, dst)
	})
}

// checkExportable refuses what Mixtral cannot represent, and a checkpoint
// whose model section lacks a Mixtral tensor or holds it in another shape.
func checkExportable(ck *checkpoint.Checkpoint, mc engine.ModelConfig, m hf.Model) error {
	if mc.MoE.SharedExperts > 0 {
		return fmt.Errorf("model.moe.shared_experts is %d, but Mixtral has no shared experts: the exported model could not compute this one",
			mc.MoE.SharedExperts)
	}
	for l := 0; l < mc.Layers; l++ {
		name := engine.ExpertBiasName(l)
		bias, _, err := ck.Model().Tensor(name)
		if err != nil {
			continue // trained without bias balancing
		}
		for e, v := range bias {
			if v != 0 {
				return fmt.Errorf("%s[%d] is %g (aux-loss-free balancing, model.moe.bias_update_rate %g), but Mixtral routes without a bias: the exported model would route differently",
					name, e, v, mc.MoE.BiasUpdateRate)
			}
		}
	}
	for _, t := range hf.Tensors(m) {
		shape, ok := ck.Model().Shape(t.Name)
		switch {
		case !ok:
			return fmt.Errorf("the checkpoint has no tensor %q", t.Name)
		case !slices.Equal(shape, t.Shape):
			return fmt.Errorf("tensor %q has shape %v, but the checkpoint's model section makes it %v", t.Name, shape, t.Shape)
		}
	}
	return nil
}
