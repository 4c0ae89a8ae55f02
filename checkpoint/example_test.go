package checkpoint_test

import (
	"fmt"
	"log"
	"os"

	"github.com/mktrain/mktrain/checkpoint"
)

// Two ranks each save one half of a 2x4 tensor; a reader finds the newest
// checkpoint that verifies and reads the tensor whole, by name.
func Example() {
	root, err := os.MkdirTemp("", "ckpt-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(root)

	s, err := checkpoint.BeginSave(root, 100)
	if err != nil {
		log.Fatal(err)
	}
	defer s.Abort() // removes the temporary directory unless committed
	for rank := range 2 {
		half := []float32{1, 2, 3, 4}
		if rank == 1 {
			half = []float32{5, 6, 7, 8}
		}
		w := checkpoint.NamedTensor{
			Name: "layers.0.attn.wq", Shape: []int{1, 4}, Data: half,
			Slice: &checkpoint.Slice{Offset: []int{rank, 0}, GlobalShape: []int{2, 4}},
		}
		err := s.WriteTensors(checkpoint.ModelFile(rank), []checkpoint.NamedTensor{w}, checkpoint.TensorOptions{})
		if err != nil {
			log.Fatal(err)
		}
	}
	if err := s.WriteState(map[string]int{"tokens": 4096}); err != nil {
		log.Fatal(err)
	}
	if err := s.Commit(); err != nil {
		log.Fatal(err)
	}

	dir, err := checkpoint.FindResumable(root, func(warning string) { log.Print(warning) })
	if err != nil {
		log.Fatal(err)
	}
	c, err := checkpoint.Open(dir)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	var state struct{ Tokens int }
	if err := c.ReadState(&state); err != nil {
		log.Fatal(err)
	}
	data, shape, err := c.Model().Tensor("layers.0.attn.wq")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("step", c.Step(), "tokens", state.Tokens)
	fmt.Println(shape, data)
	// Output:
	// step 100 tokens 4096
	// [2 4] [1 2 3 4 5 6 7 8]
}
