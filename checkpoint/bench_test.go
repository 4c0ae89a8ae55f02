package checkpoint

import (
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"testing"

	"github.com/mktrain/mktrain/checkpoint/safetensors"
)

// BenchmarkSaveLoad measures save (write, fsync, commit) and load (open
// and read every tensor back, from the page cache) throughput for 100 MB of
// float32 weights in 4 rank files, stored plain or through zstd. Run with
//
//	go test -run '^$' -bench SaveLoad -benchtime 3x ./checkpoint/
func BenchmarkSaveLoad(b *testing.B) {
	const ranks, perRank, tensorLen = 4, 25, 250_000 // 4*25*250k floats = 100 MB
	rng := rand.New(rand.NewPCG(1, 1))
	model := make([][]NamedTensor, ranks)
	for r := range model {
		for i := range perRank {
			nt := randTensor(rng, fmt.Sprintf("layers.%d.moe.experts.%d.w1", i, r), tensorLen)
			for j := range nt.Data {
				nt.Data[j] *= 0.02 // the scale of initialized weights
			}
			model[r] = append(model[r], nt)
		}
	}
	bytes := int64(ranks * perRank * tensorLen * 4)
	for _, opts := range []TensorOptions{
		{DType: safetensors.F32},
		{DType: safetensors.F32, Compress: true},
		{DType: safetensors.BF16},
	} {
		name := string(opts.DType)
		if opts.Compress {
			name += "-zstd"
		}
		root := b.TempDir()
		saveOnce := func(b *testing.B) string {
			s, err := BeginSave(root, 1)
			if err != nil {
				b.Fatal(err)
			}
			defer s.Abort()
			var wg sync.WaitGroup
			errs := make([]error, ranks)
			for r := range ranks {
				wg.Go(func() { errs[r] = s.WriteTensors(ModelFile(r), model[r], opts) })
			}
			wg.Wait()
			for _, err := range errs {
				if err != nil {
					b.Fatal(err)
				}
			}
			if err := s.Commit(); err != nil {
				b.Fatal(err)
			}
			return s.Dir()
		}
		b.Run("save/"+name, func(b *testing.B) {
			b.SetBytes(bytes)
			for b.Loop() {
				saveOnce(b)
			}
		})
		dir := saveOnce(b)
		if m, err := ReadManifest(dir); err == nil {
			size := int64(0)
			for _, f := range m.Files {
				size += f.Size
			}
			b.Logf("%s: %d bytes on disk for %d bytes of float32", name, size, bytes)
		}
		b.Run("load/"+name, func(b *testing.B) {
			b.SetBytes(bytes)
			for b.Loop() {
				c, err := Open(dir)
				if err != nil {
					b.Fatal(err)
				}
				var wg sync.WaitGroup
				for _, names := range chunk(c.Model().Names(), ranks) {
					wg.Go(func() {
						for _, n := range names {
							if _, _, err := c.Model().Tensor(n); err != nil {
								b.Error(err)
							}
						}
					})
				}
				wg.Wait()
				c.Close()
			}
		})
		os.RemoveAll(root)
	}
}

// chunk splits names into n nearly equal parts, one per reading goroutine.
func chunk(names []string, n int) [][]string {
	parts := make([][]string, n)
	for i, name := range names {
		parts[i%n] = append(parts[i%n], name)
	}
	return parts
}
