package tokenizer

import (
	"flag"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
)

// The speed benchmarks: MB of text per second on one core,
//
//	go test ./tokenizer -run XXX -bench Encode -cpu 1
//
// over benchText, which scripts/tokenizer_bench.js also reads (write it
// with -benchtext FILE) to time the Rust library on the same text.

var benchTextOut = flag.String("benchtext", "", "write the benchmark text to this file")

// benchText is about 4 MB of documents: Zipf-distributed words from a
// 30,000-word made-up vocabulary (so the word cache misses as on real
// text), punctuation, numbers, newlines, and the fixture texts (code, CJK,
// emoji) mixed in.
func benchText(t testing.TB) string {
	r := rand.New(rand.NewPCG(5, 6))
	syllables := strings.Fields("ka ri to na mu se lo pe de vi an ex in th er on re at st ou sh ch qu gr pl str ion ing ed ly al")
	words := make([]string, 30000)
	for i := range words {
		var sb strings.Builder
		for n := 1 + r.IntN(4); n > 0; n-- {
			sb.WriteString(syllables[r.IntN(len(syllables))])
		}
		words[i] = sb.String()
	}
	zipf := rand.NewZipf(r, 1.1, 1, uint64(len(words)-1))
	texts := fixtureTexts(t)
	var sb strings.Builder
	for sb.Len() < 4<<20 {
		for n := 20 + r.IntN(200); n > 0; n-- {
			w := words[zipf.Uint64()]
			switch x := r.Float64(); {
			case x < 0.05:
				w = strings.ToUpper(w[:1]) + w[1:]
			case x < 0.07:
				w = strings.Repeat("1234567890", 2)[:1+r.IntN(8)]
			}
			sb.WriteString(w)
			switch x := r.Float64(); {
			case x < 0.08:
				sb.WriteString(", ")
			case x < 0.14:
				sb.WriteString(". ")
			case x < 0.15:
				sb.WriteString("'s ")
			default:
				sb.WriteString(" ")
			}
		}
		sb.WriteString("\n\n")
		if r.Float64() < 0.3 {
			sb.WriteString(texts[r.IntN(len(texts))])
			sb.WriteString("\n")
		}
	}
	return sb.String()
}

func TestBenchText(t *testing.T) {
	a, b := benchText(t), benchText(t)
	if a != b || len(a) < 4<<20 {
		t.Fatalf("benchText is not deterministic or short: %d and %d bytes", len(a), len(b))
	}
	if *benchTextOut != "" {
		if err := os.WriteFile(*benchTextOut, []byte(a), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func BenchmarkEncode(b *testing.B) {
	text := benchText(b)
	docs := strings.SplitAfter(text, "\n\n")
	for _, name := range []string{"gpt2", "llama3", "tiny_cl100k.tiktoken", "llama2", "mistral"} {
		b.Run(strings.TrimSuffix(name, ".tiktoken"), func(b *testing.B) {
			tok, _ := loadFixture(b, name)
			b.SetBytes(int64(len(text)))
			var ids []int
			for b.Loop() {
				n := 0
				for _, d := range docs {
					ids = tok.AppendEncode(ids[:0], d)
					n += len(ids)
				}
				b.ReportMetric(float64(len(text))/float64(n), "bytes/token")
			}
		})
	}
}

func BenchmarkDecode(b *testing.B) {
	text := benchText(b)
	tok, _ := loadFixture(b, "llama3")
	ids := tok.Encode(text)
	b.SetBytes(int64(len(text)))
	for b.Loop() {
		if _, err := tok.Decode(ids); err != nil {
			b.Fatal(err)
		}
	}
}
