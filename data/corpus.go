package data

// This file generates the embedded default corpus: procedural English-like
// text with a small vocabulary, fixed sentence templates, correct
// arithmetic, dates and counting, mixed with the hand-written paragraphs in
// handwritten.go. A byte-level model of a few hundred thousand parameters
// learns its spelling, templates and some of its arithmetic within a few
// hundred steps, so its loss falls far below ln(256) = 5.55 and a user sees
// training work without downloading anything.

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

const (
	// DefaultCorpusBytes is the size DefaultCorpus aims for; the text ends
	// at the last line break at or before it.
	DefaultCorpusBytes = 1 << 20

	// DefaultCorpusSeed is the corpus DefaultSources trains on. It is fixed
	// apart from the sampling seed, so runs with different seeds train and
	// validate on the same text and their losses compare.
	DefaultCorpusSeed = 1

	// DefaultValFraction is the tail of the default corpus held out for
	// validation.
	DefaultValFraction = 0.1

	// handwrittenEvery is how many generated paragraphs come between two
	// hand-written ones.
	handwrittenEvery = 24
)

// The word lists, space-separated; objects are singular/plural pairs.
const (
	corpusAdjectives   = "quick small big old young happy quiet brown lazy bright little clever tired gentle brave noisy"
	corpusAnimals      = "fox dog cat bird horse mouse rabbit owl goat duck"
	corpusPeople       = "farmer teacher child baker doctor sailor painter robot"
	corpusPlaces       = "garden river market forest kitchen school village hill barn library"
	corpusPreps        = "in near behind under beside"
	corpusTransitive   = "sees finds follows helps watches likes chases calls meets hears"
	corpusIntransitive = "runs sleeps sings waits jumps walks rests plays"
	corpusPast         = "visited left cleaned painted explored reached"
	corpusObjects      = "apple/apples pear/pears book/books stone/stones coin/coins cup/cups egg/eggs box/boxes"
	corpusDays         = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday"
	corpusMonths       = "January February March April May June July August September October November December"
	corpusNumberWords  = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen " +
		"fifteen sixteen seventeen eighteen nineteen twenty"
)

// corpusWords is the word lists split into slices, built per call so the
// package holds no mutable tables.
type corpusWords struct {
	adjectives, animals, people, places, preps  []string
	transitive, intransitive, past              []string
	singular, plural, days, months, numberWords []string
}

func newCorpusWords() corpusWords {
	w := corpusWords{
		adjectives: strings.Fields(corpusAdjectives), animals: strings.Fields(corpusAnimals),
		people: strings.Fields(corpusPeople), places: strings.Fields(corpusPlaces),
		preps: strings.Fields(corpusPreps), transitive: strings.Fields(corpusTransitive),
		intransitive: strings.Fields(corpusIntransitive), past: strings.Fields(corpusPast),
		days: strings.Fields(corpusDays), months: strings.Fields(corpusMonths),
		numberWords: strings.Fields(corpusNumberWords),
	}
	for _, pair := range strings.Fields(corpusObjects) {
		one, many, _ := strings.Cut(pair, "/")
		w.singular = append(w.singular, one)
		w.plural = append(w.plural, many)
	}
	return w
}

// DefaultCorpus generates about DefaultCorpusBytes of text from seed, in
// well under a second. It is printable ASCII and line breaks; the same seed
// gives the same bytes on every platform and Go release.
func DefaultCorpus(seed uint64) []byte {
	g := corpusGen{rng: SplitMix64{State: seed}, w: newCorpusWords(), out: make([]byte, 0, DefaultCorpusBytes+4096)}
	handwritten := strings.SplitAfter(strings.TrimSpace(handwrittenText)+"\n", "\n")
	handwritten = handwritten[:len(handwritten)-1] // the empty string after the last line break
	for p := 0; len(g.out) < DefaultCorpusBytes; p++ {
		if p%handwrittenEvery == 0 {
			g.out = append(g.out, handwritten[(p/handwrittenEvery)%len(handwritten)]...)
			continue
		}
		g.paragraph()
	}
	end := DefaultCorpusBytes
	for end > 0 && g.out[end-1] != '\n' {
		end--
	}
	return g.out[:end]
}

// DefaultSources returns loaders over the default corpus (DefaultCorpusSeed)
// held in memory: the first 90% of its bytes for training, sampled with
// seed, and the last 10% for validation. vocab must be at least ByteVocab.
func DefaultSources(seqLen, vocab int, seed uint64, rank, ranks int) (train *Loader, val *EvalLoader, err error) {
	if vocab < ByteVocab {
		return nil, nil, fmt.Errorf("the default corpus is byte-level and needs model.vocab >= %d, got %d", ByteVocab, vocab)
	}
	tokens := EncodeBytes(DefaultCorpus(DefaultCorpusSeed))
	split := len(tokens) - int(float64(len(tokens))*DefaultValFraction)
	trainSrc := NewMemorySource("default-corpus/train", tokens[:split])
	valSrc := NewMemorySource("default-corpus/val", tokens[split:])
	train, err = NewLoaderFromSources("default-corpus/train", []TokenSource{trainSrc}, seqLen, vocab, seed, rank, ranks)
	if err != nil {
		return nil, nil, err
	}
	val, err = NewEvalLoaderFromSources("default-corpus/val", []TokenSource{valSrc}, seqLen, vocab, rank, ranks)
	if err != nil {
		return nil, nil, err
	}
	return train, val, nil
}

type corpusGen struct {
	rng SplitMix64
	w   corpusWords
	out []byte
}

func (g *corpusGen) pick(words []string) string { return words[g.rng.Intn(len(words))] }

// between is a uniform integer in [lo, hi].
func (g *corpusGen) between(lo, hi int) int { return lo + g.rng.Intn(hi-lo+1) }

// paragraph writes three to six sentences and a line break.
func (g *corpusGen) paragraph() {
	n := g.between(3, 6)
	for i := range n {
		if i > 0 {
			g.out = append(g.out, ' ')
		}
		g.sentence()
	}
	g.out = append(g.out, '\n')
}

// sentence writes one template, capitalised.
func (g *corpusGen) sentence() {
	start := len(g.out)
	switch g.rng.Intn(12) {
	case 0, 1:
		g.printf("the %s %s %s the %s %s.", g.pick(g.w.adjectives), g.noun(), g.pick(g.w.transitive),
			g.pick(g.w.adjectives), g.noun())
	case 2:
		g.printf("the %s %s %s the %s.", g.noun(), g.pick(g.w.intransitive), g.pick(g.w.preps), g.pick(g.w.places))
	case 3:
		a, b := g.between(0, 49), g.between(0, 49)
		g.printf("%d + %d = %d.", a, b, a+b)
	case 4:
		a, b := g.between(0, 49), g.between(0, 49)
		a, b = max(a, b), min(a, b)
		g.printf("%d - %d = %d.", a, b, a-b)
	case 5:
		a, b := g.between(1, 12), g.between(1, 12)
		g.printf("%d times %d is %d.", a, b, a*b)
	case 6:
		g.wordProblem()
	case 7:
		// The weekday is the true one for the date.
		y, m, d := g.between(1990, 2030), g.rng.Intn(12), g.between(1, 28)
		wd := (int(time.Date(y, time.Month(m+1), d, 12, 0, 0, 0, time.UTC).Weekday()) + 6) % 7 // Monday = 0
		g.printf("on %s, %s %d, %d, the %s %s the %s.", g.w.days[wd], g.w.months[m], d, y,
			g.noun(), g.pick(g.w.past), g.pick(g.w.places))
	case 8:
		g.counting()
	case 9:
		noun := g.noun()
		g.printf("where is the %s? the %s is %s the %s.", noun, noun, g.pick(g.w.preps), g.pick(g.w.places))
	case 10:
		a, b := g.between(0, 99), g.between(0, 99)
		switch {
		case a > b:
			g.printf("%d is more than %d.", a, b)
		case a < b:
			g.printf("%d is less than %d.", a, b)
		default:
			g.printf("%d is equal to %d.", a, b)
		}
	case 11:
		if g.rng.Intn(2) == 0 {
			d := g.rng.Intn(len(g.w.days))
			g.printf("after %s comes %s.", g.w.days[d], g.w.days[(d+1)%len(g.w.days)])
		} else {
			m := g.rng.Intn(len(g.w.months))
			g.printf("the month after %s is %s.", g.w.months[m], g.w.months[(m+1)%len(g.w.months)])
		}
	}
	capitalize(g.out[start:])
}

// capitalize upper-cases the first letter of s and every letter that
// follows ". " or "? ".
func capitalize(s []byte) {
	for i, c := range s {
		if c >= 'a' && c <= 'z' && (i == 0 || i >= 2 && s[i-1] == ' ' && (s[i-2] == '.' || s[i-2] == '?')) {
			s[i] = c - 'a' + 'A'
		}
	}
}

func (g *corpusGen) printf(format string, args ...any) { g.out = fmt.Appendf(g.out, format, args...) }

func (g *corpusGen) noun() string {
	if g.rng.Intn(3) == 0 {
		return g.pick(g.w.people)
	}
	return g.pick(g.w.animals)
}

// wordProblem is three sentences whose numbers add up.
func (g *corpusGen) wordProblem() {
	i := g.rng.Intn(len(g.w.people))
	j := (i + 1 + g.rng.Intn(len(g.w.people)-1)) % len(g.w.people) // another person
	who, giver := g.w.people[i], g.w.people[j]
	obj := g.rng.Intn(len(g.w.singular))
	n, m := g.between(1, 9), g.between(1, 9)
	g.printf("the %s has %s. the %s gives the %s %d more. now the %s has %s.",
		who, g.count(n, obj), giver, who, m, who, g.count(n+m, obj))
}

// count is "1 apple" or "n apples".
func (g *corpusGen) count(n, obj int) string {
	if n == 1 {
		return "1 " + g.w.singular[obj]
	}
	return strconv.Itoa(n) + " " + g.w.plural[obj]
}

// counting is a run of consecutive number words.
func (g *corpusGen) counting() {
	from := g.between(0, len(g.w.numberWords)-4)
	to := min(from+g.between(2, 5), len(g.w.numberWords)-1)
	g.printf("count from %s to %s:", g.w.numberWords[from], g.w.numberWords[to])
	for i := from; i <= to; i++ {
		sep := ","
		if i == to {
			sep = "."
		}
		g.printf(" %s%s", g.w.numberWords[i], sep)
	}
}
