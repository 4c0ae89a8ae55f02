package checkpoint

import (
	"math"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// block cuts the block [offset, offset+shape) out of a row-major tensor of
// shape global, by plain index arithmetic over every element.
func block(t NamedTensor, offset, shape []int) NamedTensor {
	n := 1
	for _, d := range shape {
		n *= d
	}
	out := make([]float32, n)
	idx := make([]int, len(shape))
	for i := range out {
		rem := i
		for d := len(shape) - 1; d >= 0; d-- {
			idx[d] = rem % shape[d]
			rem /= shape[d]
		}
		flat := 0
		for d := range shape {
			flat = flat*t.Shape[d] + offset[d] + idx[d]
		}
		out[i] = t.Data[flat]
	}
	return NamedTensor{Name: t.Name, Shape: shape, Data: out,
		Slice: &Slice{Offset: offset, GlobalShape: t.Shape}}
}

func TestTensorSpreadAcrossFiles(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(10, 1))
	wq := randTensor(rng, "layers.0.attn.wq", 6, 10)
	w3 := randTensor(rng, "layers.0.w3d", 4, 5, 3)
	experts := []NamedTensor{
		randTensor(rng, "layers.0.moe.experts.0.w1", 3, 2),
		randTensor(rng, "layers.0.moe.experts.1.w1", 3, 2),
		randTensor(rng, "layers.0.moe.experts.2.w1", 3, 2),
		randTensor(rng, "layers.0.moe.experts.3.w1", 3, 2),
	}
	scalar := randTensor(rng, "scale")
	all := append([]NamedTensor{wq, w3, scalar}, experts...)

	// One rank holding everything whole.
	root := t.TempDir()
	one := save(t, root, 1, [][]NamedTensor{all}, [][]NamedTensor{{}}, TensorOptions{})

	// Four ranks: wq cut into an uneven 2x2 grid, w3 cut along its middle
	// dimension, the scalar as a block of itself, one expert per rank.
	four := [][]NamedTensor{
		{block(wq, []int{0, 0}, []int{4, 3}), experts[0], block(scalar, []int{}, []int{})},
		{block(wq, []int{0, 3}, []int{4, 7}), block(w3, []int{0, 0, 0}, []int{4, 2, 3}), experts[1]},
		{block(wq, []int{4, 0}, []int{2, 3}), experts[2]},
		{block(wq, []int{4, 3}, []int{2, 7}), block(w3, []int{0, 2, 0}, []int{4, 3, 3}), experts[3]},
	}
	optim := [][]NamedTensor{{}, {}, {}, {}}
	for _, compress := range []bool{false, true} {
		dir := save(t, filepath.Join(root, "four"), map[bool]int{false: 1, true: 2}[compress], four, optim, TensorOptions{Compress: compress})
		for _, d := range []string{one, dir} {
			c, err := Open(d)
			if err != nil {
				t.Fatal(err)
			}
			var names []string
			for _, want := range all {
				names = append(names, want.Name)
				got, shape, err := c.Model().Tensor(want.Name)
				if err != nil {
					t.Fatal(err)
				}
				if s, _ := c.Model().Shape(want.Name); !slices.Equal(shape, want.Shape) || !slices.Equal(s, want.Shape) {
					t.Fatalf("%s: shape %v / %v, want %v", want.Name, shape, s, want.Shape)
				}
				into := make([]float32, len(want.Data))
				if err := c.Model().ReadInto(want.Name, into); err != nil {
					t.Fatal(err)
				}
				for i := range got {
					if math.Float32bits(got[i]) != math.Float32bits(want.Data[i]) || into[i] != got[i] {
						t.Fatalf("%s in %s: element %d = %v, want %v", want.Name, d, i, got[i], want.Data[i])
					}
				}
			}
			if err := c.Model().ReadInto(wq.Name, make([]float32, 5)); err == nil {
				t.Fatal("ReadInto a buffer of the wrong size succeeded")
			}
			slices.Sort(names)
			if !slices.Equal(c.Model().Names(), names) {
				t.Fatalf("names %v, want %v", c.Model().Names(), names)
			}
			c.Close()
		}
	}
}

func TestBlocksMustTile(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(11, 1))
	v := randTensor(rng, "v", 6)
	other := NamedTensor{Name: "v", Shape: []int{2}, Data: []float32{1, 2}, Slice: &Slice{Offset: []int{0}, GlobalShape: []int{7}}}
	for _, c := range []struct {
		name  string
		ranks [][]NamedTensor
		want  string
	}{
		{"overlap", [][]NamedTensor{{block(v, []int{0}, []int{4})}, {block(v, []int{2}, []int{4})}}, `tensor "v": block at [2] in model-rank00001.safetensors overlaps block at [0]`},
		{"missing block", [][]NamedTensor{{block(v, []int{0}, []int{4})}, {}}, `tensor "v" of shape [6]: blocks cover 4 of 6 elements (1 blocks found`},
		{"whole twice", [][]NamedTensor{{v}, {v}}, `tensor "v" is in both model-rank00000.safetensors and model-rank00001.safetensors`},
		{"whole and block", [][]NamedTensor{{v}, {block(v, []int{0}, []int{4})}}, `tensor "v" is in both`},
		{"global shapes differ", [][]NamedTensor{{block(v, []int{0}, []int{4})}, {other}}, `global shape [7]`},
	} {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			dir := save(t, root, 1, c.ranks, [][]NamedTensor{{}, {}}, TensorOptions{})
			_, err := Open(dir)
			if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), dir) {
				t.Fatalf("Open: %v\nwant an error naming %s and containing %q", err, dir, c.want)
			}
		})
	}
}
