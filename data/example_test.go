package data_test

import (
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/mktrain/mktrain/data"
)

// A shard of 100 tokens read as windows of 8+1 tokens by rank 0 of 2
// data-parallel ranks; a second loader seeked to the first one's cursor
// continues the same batch sequence.
func Example() {
	dir, err := os.MkdirTemp("", "data-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	tokens := make([]uint32, 100)
	for i := range tokens {
		tokens[i] = uint32(i)
	}
	if err := data.WriteShard(filepath.Join(dir, "train_000000.bin"), tokens, data.ByteVocab); err != nil {
		log.Fatal(err)
	}

	const seqLen, seed, rank, ranks = 8, 1, 0, 2
	l, err := data.NewLoader(filepath.Join(dir, "train_*.bin"), seqLen, data.ByteVocab, seed, rank, ranks)
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	inputs, targets, err := l.Next(1)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("windows", l.Windows(), "cursor", l.Cursor())
	fmt.Println("inputs ", inputs)
	fmt.Println("targets", targets)

	resumed, err := data.NewLoader(filepath.Join(dir, "train_*.bin"), seqLen, data.ByteVocab, seed, rank, ranks)
	if err != nil {
		log.Fatal(err)
	}
	defer resumed.Close()
	if err := resumed.Seek(l.Cursor()); err != nil {
		log.Fatal(err)
	}
	a, _, _ := l.Next(1)
	b, _, _ := resumed.Next(1)
	fmt.Println("same next batch after Seek:", fmt.Sprint(a) == fmt.Sprint(b))
	// Output:
	// windows 12 cursor {0 2}
	// inputs  [48 49 50 51 52 53 54 55]
	// targets [49 50 51 52 53 54 55 56]
	// same next batch after Seek: true
}
