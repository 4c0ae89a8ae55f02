package tokenizer

import (
	"slices"
	"unicode"
	"unicode/utf8"
)

// Added tokens (special tokens among them) are cut out of the text before
// the model sees it, as HF's AddedVocabulary does: leftmost-longest matches,
// first of the tokens with normalized=false on the raw text, then of those
// with normalized=true on each normalized piece; single_word, lstrip and
// rstrip as there.

type addedToken struct {
	id                                              int
	content                                         string
	singleWord, lstrip, rstrip, normalized, special bool
}

type addedVocab struct {
	tokens    []addedToken // id order
	raw, norm *tokenTrie   // nil when there is no such token
}

func (a *addedVocab) specialContents() []string {
	var out []string
	for _, t := range a.tokens {
		if t.special {
			out = append(out, t.content)
		}
	}
	return out
}

// build makes the two tries; normalize gives the normalized form of a
// normalized token's content (HF matches that form).
func (a *addedVocab) build(normalize func(string) string) {
	slices.SortFunc(a.tokens, func(x, y addedToken) int { return x.id - y.id })
	var raw, norm []trieEntry
	for i, t := range a.tokens {
		if t.normalized {
			norm = append(norm, trieEntry{normalize(t.content), i})
		} else {
			raw = append(raw, trieEntry{t.content, i})
		}
	}
	a.raw, a.norm = newTokenTrie(raw), newTokenTrie(norm)
}

// eachSegment calls f for each segment of s in order: an added token
// (id >= 0) or the non-empty text between them (id -1); start is the
// segment's byte offset in s.
func (a *addedVocab) eachSegment(s string, trie *tokenTrie, f func(seg string, id int, start int)) {
	if trie == nil {
		if s != "" {
			f(s, -1, 0)
		}
		return
	}
	prev := 0
	for i := 0; i < len(s); {
		end, which := trie.longestAt(s, i)
		if which < 0 {
			i++
			continue
		}
		start, stop := i, end
		i = end
		t := &a.tokens[which]
		if t.singleWord && (start > 0 && endsWithWord(s[:start]) || stop < len(s) && startsWithWord(s[stop:])) {
			continue
		}
		if t.lstrip {
			start = max(spaceStartAtEnd(s[:start]), prev)
		}
		if t.rstrip {
			stop += spaceEndAtStart(s[stop:])
			i = max(i, stop)
		}
		if prev < start {
			f(s[prev:start], -1, prev)
		}
		f(s[start:stop], t.id, start)
		prev = stop
	}
	if prev < len(s) {
		f(s[prev:], -1, prev)
	}
}

// isWordChar is Rust regex's \w: alphabetic, marks, decimal digits,
// connector punctuation, joiners.
func isWordChar(r rune) bool {
	return unicode.IsLetter(r) || unicode.In(r, unicode.M, unicode.Nd, unicode.Pc, unicode.Nl, unicode.Other_Alphabetic, unicode.Join_Control)
}

func endsWithWord(s string) bool {
	r, _ := utf8.DecodeLastRuneInString(s)
	return isWordChar(r)
}

func startsWithWord(s string) bool {
	r, _ := utf8.DecodeRuneInString(s)
	return isWordChar(r)
}

// spaceStartAtEnd is where the whitespace at the end of s begins.
func spaceStartAtEnd(s string) int {
	for len(s) > 0 {
		r, w := utf8.DecodeLastRuneInString(s)
		if !unicode.IsSpace(r) {
			break
		}
		s = s[:len(s)-w]
	}
	return len(s)
}

// spaceEndAtStart is the length of the whitespace at the start of s.
func spaceEndAtStart(s string) int {
	n := 0
	for n < len(s) {
		r, w := utf8.DecodeRuneInString(s[n:])
		if !unicode.IsSpace(r) {
			break
		}
		n += w
	}
	return n
}

// tokenTrie is a byte trie of token contents for leftmost-longest matching.
type tokenTrie struct {
	first [256]bool // bytes that start some token
	nodes []trieNode
}

type trieNode struct {
	edges []trieEdge // sorted by byte
	token int        // index into addedVocab.tokens, -1 if none ends here
}

type trieEdge struct {
	b    byte
	node int32
}

type trieEntry struct {
	s     string
	token int
}

func newTokenTrie(entries []trieEntry) *tokenTrie {
	if len(entries) == 0 {
		return nil
	}
	t := &tokenTrie{nodes: []trieNode{{token: -1}}}
	for _, e := range entries {
		if e.s == "" {
			continue
		}
		t.first[e.s[0]] = true
		n := 0
		for i := 0; i < len(e.s); i++ {
			n = t.child(n, e.s[i])
		}
		if t.nodes[n].token < 0 { // the first of equal contents wins
			t.nodes[n].token = e.token
		}
	}
	return t
}

func (t *tokenTrie) child(n int, b byte) int {
	edges := t.nodes[n].edges
	k, found := slices.BinarySearchFunc(edges, b, func(e trieEdge, b byte) int { return int(e.b) - int(b) })
	if found {
		return int(edges[k].node)
	}
	t.nodes = append(t.nodes, trieNode{token: -1})
	id := len(t.nodes) - 1
	t.nodes[n].edges = slices.Insert(edges, k, trieEdge{b, int32(id)})
	return id
}

// longestAt is the end and token of the longest token starting at i.
func (t *tokenTrie) longestAt(s string, i int) (end, token int) {
	token = -1
	if !t.first[s[i]] {
		return 0, -1
	}
	n := 0
	for j := i; j < len(s); j++ {
		edges := t.nodes[n].edges
		next := -1
		for _, e := range edges {
			if e.b == s[j] {
				next = int(e.node)
				break
			}
			if e.b > s[j] {
				break
			}
		}
		if next < 0 {
			break
		}
		n = next
		if t.nodes[n].token >= 0 {
			end, token = j+1, t.nodes[n].token
		}
	}
	return end, token
}
