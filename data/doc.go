// Package data feeds training and evaluation with token sequences: it reads
// and writes llm.c token shards, samples fixed-length windows from them
// deterministically for any number of data-parallel ranks, turns text files
// into shards with a byte-level tokenizer, and embeds a generated default
// corpus so that a first run needs no files and no network.
//
// # Where things are
//
//	shard.go       the shard format, OpenShard, TokenSource, MemorySource
//	write.go       WriteShard (atomic: temporary file, fsync, rename)
//	loader.go      Loader (training), EvalLoader (validation), Cursor
//	rng.go         SplitMix64 and the seeded window permutation
//	bytes.go       the byte-level tokenizer
//	prepare.go     Prepare: text files -> train/val shards
//	corpus.go      DefaultCorpus, DefaultSources; handwritten.go its prose
//
// # Shard format
//
// A shard is the format of Karpathy's llm.c: a header of 256 little-endian
// int32 values, then the tokens, little-endian.
//
//	header[0]  magic    20240520: tokens are uint16    20240801: tokens are uint32
//	header[1]  version  1 with magic 20240520          7 with magic 20240801
//	header[2]  number of tokens (int32, so at most 2^31-1 per shard)
//	header[3:] zero, ignored on read
//
// OpenShard checks the magic, that the version is the one that goes with it,
// and that the file is exactly 1024 + tokens*2 (or *4) bytes; every error
// names the file, and a size error gives the expected and the actual size.
// WriteShard picks uint16 when the vocabulary has at most 65536 ids and
// uint32 otherwise, so shards written here load in llm.c and its Python
// tools, and theirs load here.
//
// A shard whose tokens take at most MaxMemoryShardBytes (64 MiB) is read into
// memory when opened. A larger one stays on disk: each window is one ReadAt
// of (seqLen+1) tokens, and the operating system's page cache keeps what is
// hot, so a dataset of hundreds of 200 MB shards costs no resident memory.
//
// # Windows and sampling
//
// A loader cuts each source (shard or in-memory slice) into windows of
// seqLen+1 tokens at stride seqLen: window i of a source covers tokens
// [i*seqLen, i*seqLen+seqLen]. Its first seqLen tokens are a sequence's
// inputs and its last seqLen the targets, so consecutive windows overlap by
// the one token that is the last target of one and the first input of the
// next, and every token is predicted once per epoch. Windows never cross
// from one source into the next; the tail of a source too short for a
// window is not used. Windows are numbered across sources in path order.
//
// An epoch of Loader visits every window once, in the order of a permutation
// of [0, windows) drawn from (seed, epoch). The permutation is a keyed
// Feistel network with cycle walking (rng.go): it needs no table however
// large the dataset, gives element i in constant time, and is defined here
// bit for bit, so the same seed gives the same batches on every platform and
// Go release. Each epoch has a fresh order.
//
// Token ids are checked against the model's vocabulary as each window is
// read, not when a shard is opened (which would read every shard in full);
// the error names the source and the token's position in it, e.g.
//
//	data/train_000.bin: token 70000 at position 123 is >= model.vocab 32768
//
// # Ranks
//
// rank and ranks are a loader's place among the ranks that read different
// data (the data-parallel ranks). Ranks that must see the same batch, such
// as those that split one sequence for context or tensor parallelism, pass
// the same rank. Rank r reads positions r, r+ranks, r+2*ranks, ... of each
// epoch's order, so the ranks' windows are disjoint and together cover the
// epoch. When ranks does not divide the number of windows, the last
// windows%ranks positions of each epoch are skipped, so that every rank
// reads the same number of windows per epoch and the ranks stay in the same
// epoch; the skipped windows differ from epoch to epoch.
//
// # Cursor
//
// A Cursor {Epoch, Index} is a loader's position: Index is where, in the
// epoch's order, the next group of ranks windows starts, and every Next(b)
// advances it by b*ranks. Ranks in lock step have equal cursors, so a
// checkpoint stores one; Seek(cursor) on a fresh loader with the same data,
// sequence length and seed continues the batch sequence exactly. A cursor
// saved with one number of ranks is valid with another: the new ranks
// continue from the same position of the same order. Next never moves the
// cursor when it returns an error.
//
// # Evaluation
//
// EvalLoader reads windows in file order, without shuffling: rank r reads
// windows r, r+ranks, ... Calling Reset before each evaluation makes every
// evaluation see the same batches, so validation losses compare across a
// run. Reading past the last window wraps to the first; EpochBatches says
// how many micro-batches one pass holds.
//
// # Preparing text
//
// The byte-level tokenizer maps each byte to the token of the same value
// (ByteVocab = 256); it takes any file, text or not. Prepare reads files and
// globs (a glob's matches in name order, each file once) and writes
//
//	outDir/train_000000.bin, train_000001.bin, ...
//	outDir/val_000000.bin, ...
//
// as uint16 shards of shardTokens tokens (the last one shorter). The last
// valFraction of each file's bytes, rounded up, goes to val, so any
// non-empty input gives a val shard when valFraction > 0; files are
// concatenated with nothing between them. Prepare refuses an outDir that
// already holds shards, since an old train_000009.bin would silently join a
// new dataset of nine shards, and removes what it wrote if it fails.
//
// # Default corpus
//
// DefaultCorpus(seed) generates about 1 MiB of English-like text in
// milliseconds: a few dozen words in fixed templates ("The quick fox sees
// the small dog."), true arithmetic ("12 + 7 = 19.", word problems), dates
// with their true weekdays, counting and calendar order, mixed with a few
// hand-written paragraphs about training models. A byte bigram model
// already reaches about 2.1 nats on its held-out tail (uniform is
// ln 256 = 5.55), so a tiny transformer visibly learns it within a few
// hundred steps. DefaultSources builds a training Loader over its first 90%
// and an EvalLoader over the last 10%, in memory. The text is always that of
// DefaultCorpusSeed; the seed argument drives only the sampling, so runs
// with different seeds are measured on the same validation text.
//
// # Concurrency
//
// A Loader or EvalLoader belongs to one goroutine. A Shard may be read
// concurrently.
package data
