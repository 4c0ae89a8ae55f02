// Package tokenizer encodes text into token ids and decodes them, exactly
// as the Hugging Face tokenizers library does, for BPE tokenizers in the
// tokenizer.json format (byte-level ones such as GPT-2's, Llama 3's and
// Qwen's; SentencePiece-style ones such as Mistral's, Mixtral's and Llama
// 2's) and for tiktoken rank files (cl100k_base, o200k_base).
//
// # Use
//
//	tok, err := tokenizer.Load("tokenizer.json") // or a .tiktoken rank file
//	ids := tok.Encode("Hello world")             // HF's add_special_tokens=False
//	ids = tok.EncodeWithSpecial("Hello world")   // =True: the post-processor's BOS etc.
//	ids = tok.AppendEncode(ids[:0], doc)         // Encode into a reused slice
//	text, err := tok.Decode(ids)                 // an id that names no token is an error
//	eos, ok := tok.EOS()                         // the document separator
//	raw, sum := tok.JSON(), tok.Hash()           // tokenizer.json form, its sha256
//
// A Tokenizer is immutable once loaded and safe for concurrent use: data
// ingestion encodes on every core with one Tokenizer. Errors name the file
// and the field ("tokenizer t.json: model: merges[12]: ...").
//
// Special tokens written in the text (<|endoftext|>, </s>, ...) are always
// recognised and become their ids, as with HF's default
// (encode_special_tokens=False). EOS is tokenizer_config.json's eos_token
// when Load finds that file beside the tokenizer.json, else the first
// present of <|endoftext|>, <|end_of_text|>, </s>, <eos>, <|im_end|>; BOS is
// its bos_token, else the first token the post-processor puts before a
// sequence, else the first present of <s>, <|begin_of_text|>, <bos>,
// <|startoftext|>. VocabSize is the largest id + 1, added tokens included.
//
// # The pipeline
//
// Encode runs Hugging Face's steps in its order (encode.go):
//
//  1. added tokens (added.go): the leftmost-longest matches of the added
//     tokens with normalized=false are cut out of the raw text; single_word,
//     lstrip and rstrip as in HF;
//  2. the normalizer runs on each other piece, and the added tokens with
//     normalized=true are cut out of the result;
//  3. the pre-tokenizer cuts each piece into words (pipeline.go, split.go);
//  4. the BPE model turns each word into ids (bpe.go): one symbol per
//     character (per byte for a byte-level model), then the adjacent pair
//     with the lowest merge rank is merged, leftmost first, until none has
//     a merge. Short words are merged by rescanning, long ones through a
//     min-heap over a linked list; both give HF's Word::merge_all result.
//     Words under 256 bytes are cached (a lock-free direct-mapped table of
//     65,536 entries shared by all goroutines).
//
// A byte-level model works on raw bytes: the GPT-2 byte alphabet
// ("Ġ" for a space) is how its vocabulary is stored, and the ByteLevel
// step's mapping is implicit, so text that is not valid UTF-8 also round
// trips.
//
// # Supported
//
//   - model: BPE, with unk_token, fuse_unk, byte_fallback (<0xNN> tokens),
//     ignore_merges, continuing_subword_prefix, end_of_word_suffix; merges
//     as "a b" strings or ["a", "b"] pairs.
//   - normalizer: Sequence, Prepend, Replace (String or Regex), NFC, NFD,
//     NFKC, NFKD, Lowercase, Strip.
//   - pre_tokenizer: Sequence, ByteLevel (add_prefix_space, use_regex;
//     trim_offsets only moves offsets, which this package does not report),
//     Split (String or Regex pattern; behavior Removed, Isolated,
//     MergedWithPrevious, MergedWithNext, Contiguous; invert), Metaspace
//     (replacement, prepend_scheme always/first/never or the older
//     add_prefix_space, split), Digits (individual_digits).
//   - post_processor (for a single sequence): TemplateProcessing,
//     ByteLevel, RobertaProcessing, BertProcessing, Sequence.
//   - decoder: Sequence, ByteLevel, Metaspace, Replace, ByteFallback, Fuse,
//     Strip, BPEDecoder.
//   - added_tokens: special or not, single_word, lstrip, rstrip,
//     normalized. As in HF, an added token takes the model's id when the
//     model has it, else the next id after the model's vocabulary.
//
// Split's regexes: GPT-2's, cl100k's (Llama 3; also Qwen 2's one-digit
// variant and tiktoken's possessive spelling) and o200k's have hand-written
// matchers (split.go), fuzzed against regexp2 (split_test.go) and checked
// against HF's own cuts (testdata/pretokenized.json). Any other regex runs
// on github.com/dlclark/regexp2, a backtracking engine with lookaround,
// whose .NET semantics agree with HF's Oniguruma on such patterns.
//
// # tiktoken rank files
//
// A file named *.tiktoken, or whose first line is "<base64> <rank>", is a
// rank file: the rank is the id, every single byte must have one, a piece
// that is a token is that token, and otherwise the pair whose concatenation
// has the lowest rank merges first (tiktoken's byte_pair_merge). The split
// pattern is o200k's when the file name contains "o200k", else cl100k's;
// the special tokens are cl100k_base's or o200k_base's when the file is
// one of those (by name and number of ranks), else <|endoftext|> after the
// last rank. ParseTiktoken takes other choices (TiktokenOptions). JSON
// gives an equivalent tokenizer.json (Split, ByteLevel, BPE with every
// two-token split of each token as a merge, ignore_merges), which this
// package and HF load with the same ids in all but contrived cases (two
// overlapping pairs that make the same token).
//
// # Not supported
//
// Refused at load with an error naming the field and the type:
// WordPiece, Unigram and WordLevel models (BERT, T5, older SentencePiece
// Unigram exports), BPE dropout, the BertNormalizer, Precompiled, NMT,
// StripAccents and ByteLevel normalizers, the Whitespace, WhitespaceSplit,
// BertPreTokenizer, Punctuation, CharDelimiterSplit, UnicodeScripts and
// FixedLength pre-tokenizers, a ByteLevel pre-tokenizer that is not the
// last step, and the WordPiece and CTC decoders. Also:
//
//   - truncation and padding in tokenizer.json are ignored (ingestion wants
//     whole documents); pair sequences are not encoded;
//   - HF's decode skips ids it does not know; Decode reports them;
//   - Lowercase uses Go's per-character mapping, which differs from Rust's
//     for a few characters (İ); character classes use Go's Unicode tables;
//   - with byte_fallback and an unknown character missing some <0xNN>
//     token, HF puts the pending unk after the following byte tokens; here
//     it comes in text order.
//
// # Speed
//
// Encoding, one core, MB of text per second (BenchmarkEncode, 4 MB of
// documents; scripts/tokenizer_bench.js times the Rust tokenizers library
// through its Node binding on the same text, one document per call,
// single-threaded), measured on the 2-core development machine while other
// work ran on it (load average 5 to 8, hence the ranges):
//
//	fixture          this package   HF tokenizers (Rust)
//	gpt2             30-50          1.0-2.2
//	llama3           32-40          0.7-1.6
//	tiny_cl100k      36-42          -
//	llama2, mistral  13-15          1.6-2.4
//
// The SentencePiece-style ones are slower because, as in HF, a piece
// without a splitting pre-tokenizer is one word: BPE runs over whole
// documents and the word cache does not help. Decoding runs at 10 to 20
// MB/s. Merge lookups go through an open-addressing table (pairTable), the
// hottest path.
//
//	go test ./tokenizer -run XXX -bench Encode -cpu 1
//	go test ./tokenizer -run TestBenchText -benchtext /tmp/bench.txt
//	NODE_PATH=... node scripts/tokenizer_bench.js /tmp/bench.txt tokenizer/testdata/gpt2.json
//
// # Tests
//
// testdata holds small tokenizers trained and saved by the HF library, a
// text set (code, CJK, emoji, combining marks, runs of spaces, special
// tokens in text, the empty string, random strings over the characters the
// rules care about) and the library's ids, ids with special tokens,
// decoded strings and pre-tokenizer cuts for each, plus a tiktoken rank file
// with tiktoken's ids; scripts/tokenizer_fixtures.js writes them
// (testdata/README.md).
package tokenizer
