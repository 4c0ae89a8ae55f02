// Package infer uses a trained mktrain checkpoint outside training: it
// scores a model's loss on token data, samples continuations from it, and
// exports it as a Hugging Face Mixtral directory. The mktrain commands
// eval, sample and export are thin shells over it.
//
// Load a checkpoint (a step_* directory, or a run directory or checkpoints
// root: its newest checkpoint that verifies) and use it:
//
//	m, err := infer.Load("runs/tiny",
//		engine.WithDrivers(all.Drivers()...)) // the GPU, if any; else the CPU
//	defer m.Close()
//	res, err := m.Evaluate(ctx, "", 0)        // the run's own validation data, one pass
//	fmt.Println(res.Loss, res.Perplexity)
//	next, err := m.Sample(ctx, prompt, 100, 0.8, 0, 1) // 100 tokens at temperature 0.8, seed 1
//
// Export for transformers' MixtralForCausalLM.from_pretrained:
//
//	err := infer.ExportHF(ctx, "runs/tiny", "out/hf", "bf16") // or "fp32" to compare losses exactly
//
// Evaluate reads windows exactly as training's validation does, so on the
// run's own validation data it reproduces the run's validation loss. Sample
// draws from a seeded PCG generator: a seed reproduces a sample. A Model
// serves several goroutines at once (a service's requests): their forward
// passes take turns.
//
// Text goes in and out through the tokenizer the checkpoint holds (the
// run's data.tokenizer, which package engine copies into every checkpoint
// and whose SHA-256 state.json records; Load checks the copy against it),
// or byte by byte when the run had none (text.go): Encode and Decode,
// SampleText (which stops after the tokenizer's end-of-document token, as
// transformers' generate stops at eos_token_id) and EvaluateText (a text
// encoded as data prepare encodes a document). ExportHF writes the
// tokenizer beside the weights, so AutoTokenizer loads the export:
//
//	text, ids, err := m.SampleText(ctx, "Once upon a time", 100, 0, 0, 1) // greedy, up to 100 tokens
//	res, err := m.EvaluateText(ctx, "book.txt", book, 0)
//
// The model runs on one rank whatever parallel layout trained it: package
// engine loads it (engine.LoadReplica) and runs its forward pass
// (engine.Forward); this package decides what to feed it and what to do
// with the losses and logits. The Hugging Face format is package hf's.
package infer
