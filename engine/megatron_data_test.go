package engine

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/mktrain/mktrain/data"
)

// TestRunTrainsOnMegatronData: data.train and data.val may name Megatron
// indexed datasets by their prefix; the run verifies and trains on them.
func TestRunTrainsOnMegatronData(t *testing.T) {
	cfg := equivalenceConfig()
	cfg.Train.Steps = 3
	dir := t.TempDir()
	for _, name := range []string{"train_text_document", "val_text_document"} {
		var docs [][]uint32
		for d := range 40 {
			doc := make([]uint32, 30+d)
			for i := range doc {
				doc[i] = uint32(d*13+i*7) % uint32(cfg.Model.Vocab-1)
			}
			doc[len(doc)-1] = uint32(cfg.Model.Vocab - 1) // the end-of-document token
			docs = append(docs, doc)
		}
		if err := data.WriteIndexed(filepath.Join(dir, name), docs, cfg.Model.Vocab); err != nil {
			t.Fatal(err)
		}
	}
	cfg.Data.Train, cfg.Data.Val = filepath.Join(dir, "train_text_document"), filepath.Join(dir, "val_text_document")
	eng, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	res, err := eng.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if res.Steps != 3 || !(res.ValLoss > 0) {
		t.Fatalf("result %+v", res)
	}
}
