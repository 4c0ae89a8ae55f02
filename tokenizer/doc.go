// Package tokenizer encodes text into token ids and decodes them, exactly
// as the Hugging Face tokenizers library does, for BPE tokenizers in the
// tokenizer.json format (byte-level ones such as GPT-2's, Llama 3's and
// Qwen's; SentencePiece-style ones such as Mistral's and Llama 2's) and for
// tiktoken rank files (cl100k_base, o200k_base).
//
//	tok, err := tokenizer.Load("tokenizer.json") // or a .tiktoken file
//	ids := tok.Encode("Hello world")             // no BOS/EOS added
//	ids = tok.EncodeWithSpecial("Hello world")   // the post-processor's BOS etc.
//	text, err := tok.Decode(ids)
//	eos, ok := tok.EOS()                         // the document separator
//
// A Tokenizer is immutable and safe for concurrent use.
package tokenizer
