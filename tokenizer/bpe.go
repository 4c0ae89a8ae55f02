package tokenizer

import (
	"fmt"
	"hash/maphash"
	"math"
	"strings"
	"sync/atomic"
	"unicode/utf8"
)

// bpeModel is a BPE model: a vocabulary and ranked merges. A word starts as
// one symbol per character (per byte for a byte-level model), and the
// adjacent pair with the lowest merge rank is merged, leftmost first, until
// no pair has a merge: exactly Hugging Face's BPE (models/bpe/word.rs) and,
// with ranks taken from the merged token, tiktoken's byte_pair_merge.
type bpeModel struct {
	vocab map[string]int32 // stored token string -> id (byte-level tokens in the byte alphabet)

	// byteLevel: words are raw bytes and the vocabulary's strings are in
	// GPT-2's byte alphabet (a ByteLevel pre-tokenizer or tiktoken).
	byteLevel bool
	byteIDs   [256]int32 // byte-level: id of each byte's one-character token, -1 if none

	runeIDs map[rune]int32 // one-character tokens (not byte-level)

	merges       *pairTable       // pairKey(left, right) -> rank<<32 | merged id
	ignoreMerges bool             // a word that is a token is that token (Llama 3; tiktoken)
	wordIDs      map[string]int32 // ignore_merges: word as the model sees it -> id

	unk          int32 // -1: unknown characters are dropped, as HF does
	fuseUnk      bool
	byteFallback bool
	fallbackIDs  [256]int32 // <0xNN> tokens, -1 if absent
	prefix       string     // continuing_subword_prefix
	suffix       string     // end_of_word_suffix

	cache *wordCache
}

const noMerge = math.MaxUint64

func pairKey(a, b int32) uint64 { return uint64(uint32(a))<<32 | uint64(uint32(b)) }

// maxCachedWord is the longest word (in bytes) the cache keeps, as HF.
const maxCachedWord = 256

// encodeWord appends the ids of word to st.out.
func (m *bpeModel) encodeWord(st *encodeState, word string) {
	if word == "" {
		return
	}
	if m.ignoreMerges {
		if id, ok := m.wordIDs[word]; ok {
			st.out = append(st.out, int(id))
			return
		}
	}
	cacheable := len(word) < maxCachedWord
	if cacheable {
		if ids, ok := m.cache.get(word); ok {
			for _, id := range ids {
				st.out = append(st.out, int(id))
			}
			return
		}
	}
	syms := m.symbols(st.syms[:0], word)
	syms = m.mergeAll(st, syms)
	st.syms = syms
	for _, id := range syms {
		st.out = append(st.out, int(id))
	}
	if cacheable {
		m.cache.put(word, syms)
	}
}

// symbols appends the initial symbols of word: one per character, with
// HF's unknown-character handling (byte fallback, then unk, fused or not).
func (m *bpeModel) symbols(dst []int32, word string) []int32 {
	if m.byteLevel && m.prefix == "" && m.suffix == "" {
		for i := 0; i < len(word); i++ {
			if id := m.byteIDs[word[i]]; id >= 0 {
				dst = append(dst, id)
				continue
			}
			dst = m.appendUnknown(dst, string(byteLevelChar[word[i]]), len(dst) > 0 && m.isUnk(dst))
		}
		return dst
	}
	s := word
	if m.byteLevel {
		s = toByteAlphabet(word)
	}
	pendingUnk := false // the last symbol is an unk that a fused unk may extend
	for i := 0; i < len(s); {
		r, w := utf8.DecodeRuneInString(s[i:])
		ch := s[i : i+w]
		first, last := i == 0, i+w == len(s)
		i += w
		var id int32 = -1
		if m.prefix == "" && m.suffix == "" {
			if r != utf8.RuneError || w > 1 {
				if v, ok := m.runeIDs[r]; ok {
					id = v
				}
			} else if v, ok := m.vocab[ch]; ok {
				id = v
			}
		} else {
			key := ch
			if !first && m.prefix != "" {
				key = m.prefix + key
			}
			if last && m.suffix != "" {
				key += m.suffix
			}
			ch = key
			if v, ok := m.vocab[key]; ok {
				id = v
			}
		}
		if id >= 0 {
			dst = append(dst, id)
			pendingUnk = false
			continue
		}
		dst = m.appendUnknown(dst, ch, pendingUnk)
		pendingUnk = m.unk >= 0 && !m.allFallback(ch)
	}
	return dst
}

func (m *bpeModel) isUnk(dst []int32) bool { return m.unk >= 0 && dst[len(dst)-1] == m.unk }

// allFallback says whether every byte of ch has a <0xNN> token.
func (m *bpeModel) allFallback(ch string) bool {
	if !m.byteFallback {
		return false
	}
	for i := 0; i < len(ch); i++ {
		if m.fallbackIDs[ch[i]] < 0 {
			return false
		}
	}
	return true
}

// appendUnknown handles a character that is not in the vocabulary: its
// bytes' <0xNN> tokens with byte fallback, else the unk token (merged into
// the previous unk when fuse_unk is set and extendUnk says it is one), else
// nothing.
func (m *bpeModel) appendUnknown(dst []int32, ch string, extendUnk bool) []int32 {
	if m.allFallback(ch) {
		for i := 0; i < len(ch); i++ {
			dst = append(dst, m.fallbackIDs[ch[i]])
		}
		return dst
	}
	if m.unk < 0 {
		return dst
	}
	if extendUnk && m.fuseUnk {
		return dst
	}
	return append(dst, m.unk)
}

// mergeAll applies the merges to syms in place and returns the result.
func (m *bpeModel) mergeAll(st *encodeState, syms []int32) []int32 {
	if len(syms) < 2 {
		return syms
	}
	if len(syms) <= 48 {
		return m.mergeScan(st, syms)
	}
	return m.mergeHeap(st, syms)
}

// mergeScan is mergeAll for short words: find the lowest-ranked pair by a
// scan, merge, repeat. Quadratic, but without a heap's overhead.
func (m *bpeModel) mergeScan(st *encodeState, syms []int32) []int32 {
	ranks := st.ranks[:0]
	for i := 0; i+1 < len(syms); i++ {
		ranks = append(ranks, m.lookup(syms[i], syms[i+1]))
	}
	for {
		best, at := uint64(noMerge), -1
		for i, r := range ranks {
			if r < best {
				best, at = r, i
			}
		}
		if at < 0 {
			break
		}
		syms[at] = int32(uint32(best))
		syms = append(syms[:at+1], syms[at+2:]...)
		ranks = append(ranks[:at], ranks[at+1:]...)
		if at < len(ranks) {
			ranks[at] = m.lookup(syms[at], syms[at+1])
		}
		if at > 0 {
			ranks[at-1] = m.lookup(syms[at-1], syms[at])
		}
	}
	st.ranks = ranks
	return syms
}

func (m *bpeModel) lookup(a, b int32) uint64 {
	return m.merges.get(pairKey(a, b))
}

// pairTable maps pair keys to merges: open addressing with linear probing,
// at most half full, several times faster than a Go map on this hot path.
// ids are below 2^31, so no key is emptyPair.
type pairTable struct {
	keys  []uint64
	vals  []uint64
	n     int
	shift uint
}

const emptyPair = ^uint64(0)

func newPairTable(capacity int) *pairTable {
	size, shift := 16, uint(60)
	for size < 2*capacity {
		size, shift = size*2, shift-1
	}
	p := &pairTable{keys: make([]uint64, size), vals: make([]uint64, size), shift: shift}
	for i := range p.keys {
		p.keys[i] = emptyPair
	}
	return p
}

func (p *pairTable) slot(k uint64) uint64 { return (k * 0x9E3779B97F4A7C15) >> p.shift }

// get is the merge of pair k, or noMerge.
func (p *pairTable) get(k uint64) uint64 {
	mask := uint64(len(p.keys) - 1)
	for i := p.slot(k); ; i = (i + 1) & mask {
		switch p.keys[i] {
		case k:
			return p.vals[i]
		case emptyPair:
			return noMerge
		}
	}
}

// set stores v for k, replacing an earlier value (a repeated merge takes
// its later rank, as HF's map does).
func (p *pairTable) set(k, v uint64) {
	if 2*(p.n+1) > len(p.keys) {
		bigger := newPairTable(2 * (p.n + 1))
		for i, key := range p.keys {
			if key != emptyPair {
				bigger.set(key, p.vals[i])
			}
		}
		*p = *bigger
	}
	mask := uint64(len(p.keys) - 1)
	for i := p.slot(k); ; i = (i + 1) & mask {
		switch p.keys[i] {
		case k:
			p.vals[i] = v
			return
		case emptyPair:
			p.keys[i], p.vals[i] = k, v
			p.n++
			return
		}
	}
}

// mergeHeap is mergeAll for long words: symbols in a linked list, candidate
// merges in a min-heap keyed by (rank, position), stale entries skipped
// when popped (HF's Word::merge_all).
func (m *bpeModel) mergeHeap(st *encodeState, syms []int32) []int32 {
	n := len(syms)
	links := st.links[:0]
	for i := 0; i < n; i++ {
		links = append(links, int32(i-1), int32(i+1)) // prev, next; next == n: none
	}
	alive := func(i int32) bool { return syms[i] >= 0 }
	h := st.heap[:0]
	push := func(rank uint64, pos int) {
		h = append(h, rank>>32<<32|uint64(pos))
		for i := len(h) - 1; i > 0; {
			p := (i - 1) / 2
			if h[p] <= h[i] {
				break
			}
			h[p], h[i] = h[i], h[p]
			i = p
		}
	}
	pop := func() uint64 {
		top := h[0]
		last := len(h) - 1
		h[0] = h[last]
		h = h[:last]
		for i := 0; ; {
			l, r, small := 2*i+1, 2*i+2, i
			if l < len(h) && h[l] < h[small] {
				small = l
			}
			if r < len(h) && h[r] < h[small] {
				small = r
			}
			if small == i {
				break
			}
			h[i], h[small] = h[small], h[i]
			i = small
		}
		return top
	}
	for i := 0; i+1 < n; i++ {
		if r := m.lookup(syms[i], syms[i+1]); r != noMerge {
			push(r, i)
		}
	}
	for len(h) > 0 {
		top := pop()
		pos := int32(uint32(top))
		if !alive(pos) {
			continue
		}
		next := links[2*pos+1]
		if int(next) >= n {
			continue
		}
		r := m.lookup(syms[pos], syms[next])
		if r == noMerge || r>>32 != top>>32 {
			continue // the pair changed since it was pushed
		}
		syms[pos] = int32(uint32(r))
		syms[next] = -1
		after := links[2*next+1]
		links[2*pos+1] = after
		if int(after) < n {
			links[2*after] = pos
		}
		if prev := links[2*pos]; prev >= 0 {
			if r := m.lookup(syms[prev], syms[pos]); r != noMerge {
				push(r, int(prev))
			}
		}
		if int(after) < n {
			if r := m.lookup(syms[pos], syms[after]); r != noMerge {
				push(r, int(pos))
			}
		}
	}
	out := syms[:0]
	for _, id := range syms {
		if id >= 0 {
			out = append(out, id)
		}
	}
	st.links, st.heap = links, h
	return out
}

// wordCache maps words to their ids: a direct-mapped table of immutable
// entries swapped atomically, so that Encode on many goroutines shares it
// without locks. A collision replaces the older entry.
type wordCache struct {
	seed  maphash.Seed
	slots []atomic.Pointer[cacheEntry]
	mask  uint64
}

type cacheEntry struct {
	word string
	ids  []int32
}

func newWordCache(slots int) *wordCache {
	return &wordCache{seed: maphash.MakeSeed(), slots: make([]atomic.Pointer[cacheEntry], slots), mask: uint64(slots - 1)}
}

func (c *wordCache) get(word string) ([]int32, bool) {
	e := c.slots[maphash.String(c.seed, word)&c.mask].Load()
	if e != nil && e.word == word {
		return e.ids, true
	}
	return nil, false
}

func (c *wordCache) put(word string, ids []int32) {
	e := &cacheEntry{word: strings.Clone(word), ids: append([]int32(nil), ids...)}
	c.slots[maphash.String(c.seed, word)&c.mask].Store(e)
}

// byteLevelChar is GPT-2's byte alphabet: the printable character that
// stands for each byte in a byte-level vocabulary (bytes_to_unicode).
var byteLevelChar = func() (chars [256]rune) {
	n := 0
	for b := 0; b < 256; b++ {
		if b >= '!' && b <= '~' || b >= 0xA1 && b <= 0xAC || b >= 0xAE {
			chars[b] = rune(b)
		} else {
			chars[b] = rune(256 + n)
			n++
		}
	}
	return chars
}()

// fromByteAlphabet turns a token in the byte alphabet back into its bytes;
// ok is false if a character is outside the alphabet.
func fromByteAlphabet(s string) (b []byte, ok bool) {
	b = make([]byte, 0, len(s))
	for _, r := range s {
		v, ok := byteOfChar(r)
		if !ok {
			return nil, false
		}
		b = append(b, v)
	}
	return b, true
}

func byteOfChar(r rune) (byte, bool) {
	switch {
	case r >= '!' && r <= '~' || r >= 0xA1 && r <= 0xAC || r >= 0xAE && r <= 0xFF:
		return byte(r), true
	case r >= 256 && r < 256+68:
		return byteLevelOther[r-256], true
	}
	return 0, false
}

// byteLevelOther lists, in order, the bytes the alphabet maps to 256+n.
var byteLevelOther = func() (b [68]byte) {
	n := 0
	for v := 0; v < 256; v++ {
		if rune(v) != byteLevelChar[v] {
			b[n] = byte(v)
			n++
		}
	}
	return b
}()

func toByteAlphabet(s string) string {
	var sb strings.Builder
	sb.Grow(2 * len(s))
	for i := 0; i < len(s); i++ {
		sb.WriteRune(byteLevelChar[s[i]])
	}
	return sb.String()
}

// fallbackToken is the byte-fallback token of b, "<0x0A>".
func fallbackToken(b byte) string { return fmt.Sprintf("<0x%02X>", b) }
