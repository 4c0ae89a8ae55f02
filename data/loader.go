package data

// This file holds the loaders: Loader samples training windows in a seeded
// order, EvalLoader walks validation windows in file order. Both share the
// window arithmetic in windowSet.

import (
	"fmt"
	"io"
	"math"
	"sort"
)

// Cursor is a loader's position: Index is where, in epoch Epoch's window
// order, the next group of `ranks` windows starts (rank r reads window
// Index+r). Every rank of a lock-stepped run has the same Cursor, so a
// checkpoint stores one, and it stays meaningful when the run resumes with
// another number of ranks.
type Cursor struct {
	Epoch int64 `json:"epoch"`
	Index int64 `json:"index"`
}

// windowSet is the concatenation of sources cut into windows of seqLen+1
// tokens at stride seqLen; a window never crosses from one source into the
// next. Window w of the set is window w-starts[s] of source s.
type windowSet struct {
	sources []TokenSource
	starts  []int64 // starts[s] is the first window of source s; starts[len(sources)] is the total
	seqLen  int
	vocab   int
	buf     []uint32 // seqLen+1 tokens
}

func newWindowSet(sources []TokenSource, seqLen, vocab int) windowSet {
	ws := windowSet{sources: sources, starts: make([]int64, len(sources)+1), seqLen: seqLen, vocab: vocab,
		buf: make([]uint32, seqLen+1)}
	for i, src := range sources {
		ws.starts[i+1] = ws.starts[i] + windowsIn(src.Len(), seqLen)
	}
	return ws
}

// windowsIn is the number of windows of seqLen+1 tokens, at stride seqLen,
// in n tokens.
func windowsIn(n int64, seqLen int) int64 {
	if n < int64(seqLen)+1 {
		return 0
	}
	return (n - 1) / int64(seqLen)
}

func (ws *windowSet) total() int64 { return ws.starts[len(ws.sources)] }

func (ws *windowSet) tokens() int64 {
	var n int64
	for _, s := range ws.sources {
		n += s.Len()
	}
	return n
}

// read puts window w's first seqLen tokens in inputs and its last seqLen in
// targets, checking every token against the vocabulary.
func (ws *windowSet) read(w int64, inputs, targets []int32) error {
	s := sort.Search(len(ws.sources), func(i int) bool { return ws.starts[i+1] > w })
	src := ws.sources[s]
	off := (w - ws.starts[s]) * int64(ws.seqLen)
	if err := src.ReadTokens(ws.buf, off); err != nil {
		return err
	}
	for j, t := range ws.buf {
		if int64(t) >= int64(ws.vocab) {
			return fmt.Errorf("%s: token %d at position %d is >= model.vocab %d", src.Name(), t, off+int64(j), ws.vocab)
		}
	}
	for j := range inputs {
		inputs[j] = int32(ws.buf[j])
		targets[j] = int32(ws.buf[j+1])
	}
	return nil
}

// Loader hands out this rank's training micro-batches. Each epoch visits
// every window of the data once, in an order drawn from (seed, epoch); rank
// r of ranks reads positions r, r+ranks, r+2*ranks, ... of that order, so
// the ranks' parts are disjoint and together cover the epoch (less its last
// windows%ranks positions, different windows each epoch). A Loader is not
// safe for concurrent use.
type Loader struct {
	name        string // the glob, or a description of the sources, for errors
	ws          windowSet
	seed        uint64
	rank, ranks int
	shuffle     bool
	cur         Cursor
	perm        permutation
	permEpoch   int64 // the epoch perm was built for; -1 before the first
	closers     []io.Closer
}

// NewLoader opens every shard matching glob and returns a training loader
// for rank of ranks. Tokens are checked against vocab as windows are read.
func NewLoader(glob string, seqLen, vocab int, seed uint64, rank, ranks int) (*Loader, error) {
	return openLoader(glob, seqLen, vocab, seed, rank, ranks, true)
}

// NewLoaderFromSources is NewLoader over sources the caller owns (and
// closes); name stands for them in error messages.
func NewLoaderFromSources(name string, sources []TokenSource, seqLen, vocab int, seed uint64, rank, ranks int) (*Loader, error) {
	return newLoader(name, sources, nil, seqLen, vocab, seed, rank, ranks, true)
}

func openLoader(glob string, seqLen, vocab int, seed uint64, rank, ranks int, shuffle bool) (*Loader, error) {
	if err := checkLoaderArgs(glob, seqLen, vocab, rank, ranks); err != nil {
		return nil, err
	}
	paths, err := Glob(glob)
	if err != nil {
		return nil, err
	}
	sources := make([]TokenSource, 0, len(paths))
	closers := make([]io.Closer, 0, len(paths))
	for _, p := range paths {
		s, c, err := openSource(p)
		if err != nil {
			closeAll(closers)
			return nil, err
		}
		sources = append(sources, s)
		closers = append(closers, c)
	}
	l, err := newLoader(glob, sources, closers, seqLen, vocab, seed, rank, ranks, shuffle)
	if err != nil {
		closeAll(closers)
		return nil, err
	}
	return l, nil
}

func checkLoaderArgs(name string, seqLen, vocab, rank, ranks int) error {
	switch {
	case seqLen <= 0 || seqLen >= math.MaxInt32:
		return fmt.Errorf("data %q: sequence length %d must be positive and below 2^31-1", name, seqLen)
	case vocab <= 0 || int64(vocab) > math.MaxInt32:
		return fmt.Errorf("data %q: vocab %d must be between 1 and 2^31-1 (tokens are int32)", name, vocab)
	case ranks <= 0:
		return fmt.Errorf("data %q: ranks %d must be positive", name, ranks)
	case rank < 0 || rank >= ranks:
		return fmt.Errorf("data %q: rank %d is outside 0..%d", name, rank, ranks-1)
	}
	return nil
}

func newLoader(name string, sources []TokenSource, closers []io.Closer, seqLen, vocab int, seed uint64, rank, ranks int, shuffle bool) (*Loader, error) {
	if err := checkLoaderArgs(name, seqLen, vocab, rank, ranks); err != nil {
		return nil, err
	}
	ws := newWindowSet(sources, seqLen, vocab)
	if ws.total() < int64(ranks) {
		return nil, fmt.Errorf("data %q: %d tokens make %d windows of %d tokens (sequence length %d plus one), fewer than the number of ranks, %d",
			name, ws.tokens(), ws.total(), seqLen+1, seqLen, ranks)
	}
	return &Loader{name: name, ws: ws, seed: seed, rank: rank, ranks: ranks, shuffle: shuffle,
		permEpoch: -1, closers: closers}, nil
}

// Next returns this rank's next micro-batch of batch sequences: inputs and
// targets of batch*seqLen tokens each, row-major, where targets are inputs
// shifted by one position. On error the cursor does not move.
func (l *Loader) Next(batch int) (inputs, targets []int32, err error) {
	if batch <= 0 {
		return nil, nil, fmt.Errorf("data %q: batch %d must be positive", l.name, batch)
	}
	T := l.ws.seqLen
	inputs = make([]int32, batch*T)
	targets = make([]int32, batch*T)
	cur := l.normalize(l.cur)
	for b := range batch {
		w := l.window(cur.Epoch, cur.Index+int64(l.rank))
		if err := l.ws.read(w, inputs[b*T:(b+1)*T], targets[b*T:(b+1)*T]); err != nil {
			return nil, nil, err
		}
		cur.Index += int64(l.ranks)
		cur = l.normalize(cur)
	}
	l.cur = cur
	return inputs, targets, nil
}

// normalize moves a cursor whose epoch has no full group of ranks left to
// the start of the next epoch.
func (l *Loader) normalize(c Cursor) Cursor {
	if c.Index+int64(l.ranks) > l.ws.total() {
		return Cursor{Epoch: c.Epoch + 1}
	}
	return c
}

// window is the window at position pos of epoch's order.
func (l *Loader) window(epoch, pos int64) int64 {
	if !l.shuffle {
		return pos
	}
	if l.permEpoch != epoch {
		l.perm = newPermutation(uint64(l.ws.total()), l.seed, uint64(epoch))
		l.permEpoch = epoch
	}
	return int64(l.perm.at(uint64(pos)))
}

// Cursor is the position of the next micro-batch.
func (l *Loader) Cursor() Cursor { return l.cur }

// Seek moves to c, as saved by Cursor (by any rank, with any rank count).
func (l *Loader) Seek(c Cursor) error {
	if c.Epoch < 0 || c.Index < 0 || c.Index > l.ws.total() {
		return fmt.Errorf("data %q: cursor {epoch %d, index %d} is outside this data's %d windows",
			l.name, c.Epoch, c.Index, l.ws.total())
	}
	l.cur = c
	return nil
}

// Windows is the number of windows in the data, over all ranks.
func (l *Loader) Windows() int64 { return l.ws.total() }

// Tokens is the number of tokens in the sources, windowed or not.
func (l *Loader) Tokens() int64 { return l.ws.tokens() }

// EpochBatches is the number of micro-batches of batch sequences this rank
// reads in one epoch (rounded down).
func (l *Loader) EpochBatches(batch int) int64 {
	if batch <= 0 {
		return 0
	}
	return l.ws.total() / int64(l.ranks) / int64(batch)
}

// SeqLen is the sequence length the loader was built with.
func (l *Loader) SeqLen() int { return l.ws.seqLen }

// Close closes the shards the loader opened (none for in-memory sources).
func (l *Loader) Close() error {
	err := closeAll(l.closers)
	l.closers = nil
	return err
}

func closeAll(cs []io.Closer) error {
	var first error
	for _, c := range cs {
		if err := c.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// EvalLoader hands out this rank's validation micro-batches in a fixed
// order: the windows in file order (shards sorted by path), rank r taking
// windows r, r+ranks, ... Reset before each evaluation makes every
// evaluation read the same batches, so validation losses compare. Reading
// past the last window wraps to the first.
type EvalLoader struct {
	l *Loader
}

// NewEvalLoader opens every shard matching glob and returns a validation
// loader for rank of ranks.
func NewEvalLoader(glob string, seqLen, vocab int, rank, ranks int) (*EvalLoader, error) {
	l, err := openLoader(glob, seqLen, vocab, 0, rank, ranks, false)
	if err != nil {
		return nil, err
	}
	return &EvalLoader{l: l}, nil
}

// NewEvalLoaderFromSources is NewEvalLoader over sources the caller owns.
func NewEvalLoaderFromSources(name string, sources []TokenSource, seqLen, vocab int, rank, ranks int) (*EvalLoader, error) {
	l, err := newLoader(name, sources, nil, seqLen, vocab, 0, rank, ranks, false)
	if err != nil {
		return nil, err
	}
	return &EvalLoader{l: l}, nil
}

// Next returns the next micro-batch, as Loader.Next.
func (e *EvalLoader) Next(batch int) (inputs, targets []int32, err error) { return e.l.Next(batch) }

// Reset goes back to the first window.
func (e *EvalLoader) Reset() { e.l.cur = Cursor{} }

// Cursor is the position of the next micro-batch.
func (e *EvalLoader) Cursor() Cursor { return e.l.Cursor() }

// Seek moves to c, as saved by Cursor.
func (e *EvalLoader) Seek(c Cursor) error { return e.l.Seek(c) }

// Windows is the number of windows in the data, over all ranks.
func (e *EvalLoader) Windows() int64 { return e.l.Windows() }

// Tokens is the number of tokens in the sources, windowed or not.
func (e *EvalLoader) Tokens() int64 { return e.l.Tokens() }

// EpochBatches is the number of micro-batches of batch sequences this rank
// reads in one pass over the data (rounded down).
func (e *EvalLoader) EpochBatches(batch int) int64 { return e.l.EpochBatches(batch) }

// SeqLen is the sequence length the loader was built with.
func (e *EvalLoader) SeqLen() int { return e.l.SeqLen() }

// Close closes the shards the loader opened.
func (e *EvalLoader) Close() error { return e.l.Close() }
