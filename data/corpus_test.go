package data

import (
	"bytes"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestDefaultCorpusDeterministicAndASCII(t *testing.T) {
	start := time.Now()
	a := DefaultCorpus(7)
	if d := time.Since(start); d > time.Second {
		t.Errorf("DefaultCorpus took %v, want under a second", d)
	}
	if !bytes.Equal(a, DefaultCorpus(7)) {
		t.Fatal("the same seed gave different corpora")
	}
	if bytes.Equal(a[:DefaultCorpusBytes/2], DefaultCorpus(8)[:DefaultCorpusBytes/2]) {
		t.Fatal("seeds 7 and 8 gave the same corpus")
	}
	if len(a) > DefaultCorpusBytes || len(a) < DefaultCorpusBytes*99/100 || a[len(a)-1] != '\n' {
		t.Fatalf("corpus is %d bytes ending in %q, want about %d ending in a line break", len(a), a[len(a)-1], DefaultCorpusBytes)
	}
	for i, c := range a {
		if (c < ' ' || c > '~') && c != '\n' {
			t.Fatalf("byte %d is %#x, not printable ASCII or a line break", i, c)
		}
	}
	first, _, _ := strings.Cut(strings.TrimSpace(handwrittenText), "\n")
	if !bytes.Contains(a, []byte(first)) {
		t.Fatal("the hand-written text is not mixed in")
	}
}

// TestDefaultCorpusFacts checks that the facts in the text are true: a
// model can only learn arithmetic and calendars from a corpus that states
// them correctly.
func TestDefaultCorpusFacts(t *testing.T) {
	c := string(DefaultCorpus(3))
	atoi := func(s string) int {
		n, err := strconv.Atoi(s)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	for _, tc := range []struct {
		re string
		op func(a, b int) int
	}{
		{`(\d+) \+ (\d+) = (\d+)\.`, func(a, b int) int { return a + b }},
		{`(\d+) - (\d+) = (\d+)\.`, func(a, b int) int { return a - b }},
		{`(\d+) times (\d+) is (\d+)\.`, func(a, b int) int { return a * b }},
		{`has (\d+) \w+\. The \w+ gives the \w+ (\d+) more\. Now the \w+ has (\d+)`, func(a, b int) int { return a + b }},
	} {
		ms := regexp.MustCompile(tc.re).FindAllStringSubmatch(c, -1)
		if len(ms) < 1000 {
			t.Fatalf("%s: %d matches, want many", tc.re, len(ms))
		}
		for _, m := range ms {
			if got, want := atoi(m[3]), tc.op(atoi(m[1]), atoi(m[2])); got != want {
				t.Fatalf("%q: %d, want %d", m[0], got, want)
			}
		}
	}
	dates := regexp.MustCompile(`On (\w+), (\w+) (\d+), (\d+),`).FindAllStringSubmatch(c, -1)
	if len(dates) < 1000 {
		t.Fatalf("%d dates, want many", len(dates))
	}
	for _, m := range dates {
		d, err := time.Parse("January 2 2006", m[2]+" "+m[3]+" "+m[4])
		if err != nil {
			t.Fatal(err)
		}
		if d.Weekday().String() != m[1] {
			t.Fatalf("%q: that day is a %s", m[0], d.Weekday())
		}
	}
	comparisons := regexp.MustCompile(`(\d+) is (more than|less than|equal to) (\d+)\.`).FindAllStringSubmatch(c, -1)
	for _, m := range comparisons {
		a, b := atoi(m[1]), atoi(m[3])
		if (m[2] == "more than") != (a > b) || (m[2] == "less than") != (a < b) {
			t.Fatalf("%q is false", m[0])
		}
	}
}

// TestDefaultCorpusIsLearnable fits a byte bigram model on the train split
// and measures its cross-entropy on the val split: even this weak model
// must sit far below the uniform ln(256) = 5.55 nats, which a transformer
// then improves on.
func TestDefaultCorpusIsLearnable(t *testing.T) {
	c := DefaultCorpus(DefaultCorpusSeed)
	split := len(c) - int(float64(len(c))*DefaultValFraction)
	train, val := c[:split], c[split:]
	var counts [256][256]float64
	var rows [256]float64
	for i := 1; i < len(train); i++ {
		counts[train[i-1]][train[i]]++
		rows[train[i-1]]++
	}
	const alpha = 0.01 // add-alpha smoothing
	var nll float64
	for i := 1; i < len(val); i++ {
		p := (counts[val[i-1]][val[i]] + alpha) / (rows[val[i-1]] + 256*alpha)
		nll -= math.Log(p)
	}
	ce := nll / float64(len(val)-1)
	t.Logf("bigram cross-entropy on val: %.3f nats (uniform %.3f)", ce, math.Log(256))
	if ce > 2.6 {
		t.Fatalf("bigram cross-entropy %.3f nats: the corpus is not regular enough to learn quickly", ce)
	}
}

func TestDefaultSources(t *testing.T) {
	const seqLen = 32
	if _, _, err := DefaultSources(seqLen, 255, 1, 0, 1); err == nil || !strings.Contains(err.Error(), "model.vocab >= 256") {
		t.Fatalf("vocab 255: error %v", err)
	}
	c := DefaultCorpus(DefaultCorpusSeed)
	split := len(c) - int(float64(len(c))*DefaultValFraction)
	train, val, err := DefaultSources(seqLen, 256, 1, 1, 2)
	if err != nil {
		t.Fatal(err)
	}
	if want := int64((split-1)/seqLen) + int64((len(c)-split-1)/seqLen); train.Windows()+val.Windows() != want {
		t.Fatalf("train %d + val %d windows, want %d", train.Windows(), val.Windows(), want)
	}
	in, tg, err := train.Next(4)
	if err != nil {
		t.Fatal(err)
	}
	for b := range 4 {
		row := append(slices.Clone(in[b*seqLen:(b+1)*seqLen]), tg[(b+1)*seqLen-1])
		text := make([]byte, len(row))
		for i, tok := range row {
			text[i] = byte(tok)
		}
		// Hand-written paragraphs repeat, so look for an aligned occurrence.
		aligned := false
		for from := 0; !aligned; {
			at := bytes.Index(c[from:split], text)
			if at < 0 {
				break
			}
			aligned = (from+at)%seqLen == 0
			from += at + 1
		}
		if !aligned || !slices.Equal(tg[b*seqLen:(b+1)*seqLen-1], in[b*seqLen+1:(b+1)*seqLen]) {
			t.Fatalf("train row %d is not a window of the train split", b)
		}
	}
	// Rank 1's first val batch is the val split's second window.
	in, _, err = val.Next(1)
	if err != nil {
		t.Fatal(err)
	}
	for i, tok := range in {
		if byte(tok) != c[split+seqLen+i] {
			t.Fatalf("val token %d is %q, want %q", i, byte(tok), c[split+seqLen+i])
		}
	}
}
