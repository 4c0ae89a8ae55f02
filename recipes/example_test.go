package recipes_test

import (
	"fmt"
	"log"

	"github.com/mktrain/mktrain/recipes"
)

// Load a shipped recipe by name, with one field overridden as
// `mktrain run tiny --set train.lr=3e-4` does.
func ExampleLoad() {
	cfg, snapshot, err := recipes.Load("tiny", []string{"train.lr=3e-4"})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(cfg.Model.Dim, cfg.Train.LR, len(recipes.Hash(cfg)))
	fmt.Println(len(snapshot) > 0)
	// Output:
	// 64 0.0003 16
	// true
}

// Problems are reported each naming the file, the line (or the override)
// and the field; all the problems of a stage come at once.
func ExampleParse() {
	_, _, err := recipes.Parse("x.yaml", []byte("model:\n  moe:\n    topk: 1\n"), nil)
	fmt.Println(err)
	_, _, err = recipes.Parse("y.yaml", []byte("model:\n  dim: 64\n  heads: 6\n"), []string{"train.lr=-1"})
	fmt.Println(err)
	// Output:
	// x.yaml:3: unknown field "topk" in section model.moe; did you mean "top_k"?
	// y.yaml:3: model.heads (6) must divide model.dim (64)
	// y.yaml: --set train.lr=-1: train.lr must be positive, got -1
}
