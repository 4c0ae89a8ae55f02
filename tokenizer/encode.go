package tokenizer

// The encoding pipeline, in Hugging Face's order: split out the added tokens
// that match the raw text, normalize each other piece, split out the added
// tokens that match normalized text, pre-tokenize each remaining piece into
// words, and run the BPE model on each word.

// piece is a stretch of text on its way through the pipeline.
type piece struct {
	s       string
	atStart bool // begins at the start of the original text (Metaspace's prepend_scheme first)
}

// encodeState is one Encode call's working memory, pooled.
type encodeState struct {
	out        []int
	pieces     []piece // pre-tokenizer stages ping-pong between these two
	next       []piece
	spans      []span
	syms       []int32 // BPE symbols of the current word
	ranks      []uint64
	links      []int32 // heap merge: prev/next per symbol
	heap       []uint64
	normalized []string
}

func (t *Tokenizer) state() *encodeState {
	if st, ok := t.scratch.Get().(*encodeState); ok {
		return st
	}
	return &encodeState{}
}

// AppendEncode appends the ids of text (as Encode) to dst.
func (t *Tokenizer) AppendEncode(dst []int, text string) []int {
	st := t.state()
	st.out = dst
	t.added.eachSegment(text, t.added.raw, func(seg string, id int, start int) {
		if id >= 0 {
			st.out = append(st.out, id)
			return
		}
		norm := seg
		if t.normalizer != nil {
			norm = t.normalizer.normalize(seg)
		}
		if norm == "" {
			return
		}
		if t.added.norm == nil {
			t.encodePiece(st, piece{norm, start == 0})
			return
		}
		t.added.eachSegment(norm, t.added.norm, func(seg2 string, id2 int, start2 int) {
			if id2 >= 0 {
				st.out = append(st.out, id2)
				return
			}
			t.encodePiece(st, piece{seg2, start == 0 && start2 == 0})
		})
	})
	out := st.out
	st.out = nil
	t.scratch.Put(st)
	return out
}

// encodePiece pre-tokenizes p and encodes each word.
func (t *Tokenizer) encodePiece(st *encodeState, p piece) {
	if t.preTokenizer == nil {
		t.model.encodeWord(st, p.s)
		return
	}
	st.pieces = t.preTokenizer.split(st, st.pieces[:0], p)
	for _, w := range st.pieces {
		t.model.encodeWord(st, w.s)
	}
}
