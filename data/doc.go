// Package data feeds training and evaluation with token sequences. It reads
// and writes llm.c token shards, reads Megatron-LM indexed datasets, samples
// fixed-length windows from them deterministically for any number of
// data-parallel ranks, turns a corpus (text, JSON Lines, Parquet) into
// shards with a real tokenizer or the byte-level one, and embeds a
// generated corpus so that a first run needs no files and no network.
//
// # Use
//
// Training reads a Loader, validation an EvalLoader, both over the shards a
// glob names (or over TokenSources: NewLoaderFromSources, NewMemorySource):
//
//	l, err := data.NewLoader("data/train_*.bin", seqLen, vocab, seed, rank, ranks)
//	inputs, targets, err := l.Next(microBatch) // [microBatch*seqLen] each; targets shifted by one
//	cur := l.Cursor()                          // store in a checkpoint; Seek(cur) resumes
//	v, err := data.NewEvalLoader("data/val_*.bin", seqLen, vocab, rank, ranks)
//	v.Reset()                                  // before each evaluation: the same batches every time
//
// With no data configured, DefaultSources gives both over the embedded
// corpus. PrepareTokenized (the command `mktrain data prepare --tokenizer
// FILE --out DIR FILE...`) tokenizes a corpus into shards
// DIR/train_000000.bin, ... and DIR/val_000000.bin, ...; Prepare (without
// --tokenizer) writes byte-level ones. WriteShard writes one shard;
// OpenShard reads one; OpenIndexed reads a Megatron dataset, WriteIndexed
// writes one. The package example
// writes a shard, reads a batch and resumes from a cursor. A Loader or
// EvalLoader belongs to one goroutine; a Shard may be read concurrently.
//
// # Shard format
//
// Karpathy's llm.c format: a header of HeaderInts (256) little-endian int32
// values, then the tokens, little-endian.
//
//	header[0]  magic    20240520: tokens are uint16    20240801: tokens are uint32
//	header[1]  version  1 with magic 20240520          7 with magic 20240801
//	header[2]  number of tokens (int32, so at most 2^31-1 per shard)
//	header[3:] zero, ignored on read
//
// OpenShard checks the magic, its version, and that the file is exactly
// 1024 + tokens*2 (or *4) bytes, with errors that name the file. WriteShard
// picks uint16 when the vocabulary has at most 65536 ids, so shards load
// both here and in llm.c's tools. A shard of at most MaxMemoryShardBytes is
// read into memory; a larger one stays on disk and each window is one
// ReadAt, leaving the caching to the page cache.
//
// # Megatron indexed datasets
//
// A glob may also name Megatron-LM's indexed datasets (the MMIDIDX format
// of its preprocess_data.py): a .bin of raw tokens (uint8, int8, int16,
// int32, int64 or uint16) and an .idx that cuts it into sequences and
// documents (indexed.go gives the layout). Glob lists a dataset by its .bin
// whether the pattern matches its .bin or its .idx, or is its prefix
// ("data/corpus_text_document"); a .bin with an .idx beside it that starts
// with MMIDIDX is a Megatron dataset, any other .bin an llm.c shard. The
// loaders read a dataset as one source, its sequences back to back (they
// end with the end-of-document token when Megatron appended one); OpenIndexed
// checks the index (version, an integer token type, document indices from
// 0 to the sequence count, sequences back to back) and that the .bin has
// exactly the tokens the index gives; a negative id is an error at its
// position. Multimodal indexes are refused.
//
// # Windows, sampling and ranks
//
// Each source is cut into windows of seqLen+1 tokens at stride seqLen: the
// first seqLen tokens are inputs, the last seqLen the targets, so every
// token is predicted once per epoch. Windows never cross sources; a tail too
// short for a window is unused. An epoch visits every window once, in a
// permutation drawn from (seed, epoch) by a keyed Feistel network with cycle
// walking (rng.go): no table however large the data, and the same batches
// on every platform and Go release. Token ids are checked against the
// vocabulary as windows are read (opening would read every shard in full:
// that is Verify's job, below); the error names the source and the
// position.
//
// rank and ranks are the loader's place among the ranks that read different
// data (data parallelism); ranks that share a batch (context parallelism)
// pass the same rank. Rank r reads positions r, r+ranks, ... of each
// epoch's order, so the ranks' windows are disjoint; when ranks does not
// divide the windows, each epoch's last windows%ranks positions are skipped
// so that all ranks stay in the same epoch.
//
// A Cursor {Epoch, Index} is where the next group of ranks windows starts;
// Next(b) advances it by b*ranks and never moves it on an error. Ranks in
// lock step share one cursor, so a checkpoint stores one, and it stays valid
// under another number of ranks. EvalLoader reads windows in file order
// without shuffling and wraps at the end.
//
// # Checking shards up front
//
// Verify (the command `mktrain data verify`; the engine calls it on a
// run's data.train and data.val before step 1) reads shards in full: each
// header (or Megatron index), each file's size, and, given a vocabulary,
// every token id. It reads chunks of 4 MiB on one worker per core, so its
// memory is bounded
// whatever the data's size, and it returns a Summary (shards, tokens,
// bytes, largest id) or the first problem in path order, then position
// order: a bad id is a *TokenError with the file, position and byte
// offset. Glob gives a glob's files in the loaders' order.
//
// # Preparing a corpus
//
// PrepareTokenized reads files and globs (a glob's matches in name order)
// and takes their documents in order: a text file is one document (read
// whole), a JSON Lines file (.jsonl, .ndjson, .json) one per non-blank line
// (the string field PrepareOptions.TextKey, by default "text"), a Parquet
// file one per row (the string column TextKey); .gz and .zst mean gzip and
// zstd (InputKind). It runs in two passes (tokenize.go). First a reader
// cuts the files into batches of about a MiB of text, a worker per core
// parses and encodes them (an Encoder: the tokenizer package's, with the
// post-processor's special tokens), and the batches, put back in reading
// order, append their tokens to a spill file beside the shards, each
// document followed by the end-of-document token, while the start of each
// document is kept (8 bytes per document). Then the documents are visited
// in a seeded permutation (the Feistel network below, no table) and copied
// into the shards: the last ceil(ValFraction * tokens) of the shuffled
// stream go to val (the document at the cut may be split), the rest to
// train; uint16 ids for vocabularies of at most 65536, else uint32. The
// output depends on the inputs, the tokenizer and the seed only, not on
// the number of workers, and so does the error reported: the first bad
// document in reading order (file and line, or row), whichever worker met
// it. Memory: a few MiB per worker, the largest document, and 8 bytes per
// document.
//
// The byte-level tokenizer (EncodeBytes, DecodeBytes) maps each byte to the
// token of the same value (ByteVocab = 256). Prepare reads files and globs
// in name order and sends the last valFraction of each file's bytes to val.
// Both refuse an output directory that already holds shards (a stale
// train_000009.bin would silently join a new dataset) and remove what they
// wrote if they fail or ctx ends.
//
// # The default corpus
//
// DefaultCorpus generates about 1 MiB of English-like text in milliseconds:
// fixed sentence templates, true arithmetic, dates with their weekdays, and
// a few hand-written paragraphs (handwritten.go). A byte bigram model
// reaches about 2.1 nats on it (uniform: 5.55), so a tiny model visibly
// learns within a few hundred steps. DefaultSources always uses the text of
// DefaultCorpusSeed and holds out its last 10%; its seed drives only the
// sampling, so validation losses compare across seeds.
package data
