package checkpoint

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/klauspost/compress/zstd"

	"github.com/mktrain/mktrain/checkpoint/safetensors"
)

// randTensor is a tensor of fresh normal values.
func randTensor(rng *rand.Rand, name string, shape ...int) NamedTensor {
	n := 1
	for _, d := range shape {
		n *= d
	}
	data := make([]float32, n)
	for i := range data {
		data[i] = float32(rng.NormFloat64())
	}
	return NamedTensor{Name: name, Shape: shape, Data: data}
}

// rankTensors is what each of two ranks owns in the tests: experts split
// by rank, the rest on rank 0.
func rankTensors(rng *rand.Rand, prefix string) [][]NamedTensor {
	return [][]NamedTensor{
		{
			randTensor(rng, prefix+"embed", 16, 8),
			randTensor(rng, prefix+"layers.0.moe.experts.0.w1", 8, 12),
			randTensor(rng, prefix+"layers.0.moe.experts.1.w1", 8, 12),
			randTensor(rng, prefix+"norm", 8),
			randTensor(rng, prefix+"scalar"),
		},
		{
			randTensor(rng, prefix+"layers.0.moe.experts.2.w1", 8, 12),
			randTensor(rng, prefix+"layers.0.moe.experts.3.w1", 8, 12),
			randTensor(rng, prefix+"empty", 0, 3),
		},
	}
}

type testState struct {
	TokensSeen int64
	RNG        []uint64
	Recipe     string
}

// save writes model and optimizer files for each rank concurrently, as
// the engine's virtual ranks do, plus state, and commits.
func save(t *testing.T, root string, step int, model, optim [][]NamedTensor, opts TensorOptions) string {
	t.Helper()
	s, err := BeginSave(root, step)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Abort()
	var wg sync.WaitGroup
	errs := make([]error, 2*len(model))
	for r := range model {
		wg.Go(func() { errs[2*r] = s.WriteTensors(ModelFile(r), model[r], TensorOptions{DType: opts.DType}) })
		wg.Go(func() { errs[2*r+1] = s.WriteTensors(OptimFile(r), optim[r], opts) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	if err := s.WriteState(testState{TokensSeen: int64(step) * 1000, RNG: []uint64{1, 1 << 63}, Recipe: "tiny"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(); err != nil {
		t.Fatal(err)
	}
	return s.Dir()
}

// wantValue is what a stored value reads back as: itself for F32, and for
// BF16 a bfloat16 (low 16 bits zero) within half a bfloat16 step.
func checkValue(t *testing.T, name string, i int, got, want float32, dtype safetensors.DType) {
	t.Helper()
	if dtype != safetensors.BF16 {
		if math.Float32bits(got) != math.Float32bits(want) {
			t.Fatalf("%s[%d] = %v, want %v", name, i, got, want)
		}
		return
	}
	halfStep := math.Abs(float64(want)) * math.Ldexp(1, -8)
	if math.Float32bits(got)&0xffff != 0 || math.Abs(float64(got-want)) > halfStep {
		t.Fatalf("%s[%d] = %v, want bf16 of %v", name, i, got, want)
	}
}

func checkSet(t *testing.T, set *TensorSet, ranks [][]NamedTensor, dtype safetensors.DType) {
	t.Helper()
	var names []string
	for _, r := range ranks {
		for _, nt := range r {
			names = append(names, nt.Name)
			got, shape, err := set.Tensor(nt.Name)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(shape, nt.Shape) || len(got) != len(nt.Data) {
				t.Fatalf("%s: shape %v (%d values), want %v", nt.Name, shape, len(got), nt.Shape)
			}
			for i := range got {
				checkValue(t, nt.Name, i, got[i], nt.Data[i], dtype)
			}
		}
	}
	slices.Sort(names)
	if got := set.Names(); !slices.Equal(got, names) {
		t.Fatalf("names %v, want %v", got, names)
	}
}

func TestSaveOpenRoundTrip(t *testing.T) {
	t.Parallel()
	for _, opts := range []TensorOptions{
		{DType: safetensors.F32},
		{DType: safetensors.BF16},
		{DType: safetensors.F32, Compress: true},
		{DType: safetensors.BF16, Compress: true},
	} {
		t.Run(fmt.Sprintf("%s-zstd=%v", opts.DType, opts.Compress), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(7, 1))
			root := filepath.Join(t.TempDir(), "run")
			model, optim := rankTensors(rng, ""), rankTensors(rng, "adam_m.")
			dir := save(t, root, 100, model, optim, opts)
			if dir != filepath.Join(root, "step_00000100") {
				t.Fatalf("dir %s", dir)
			}
			if err := Verify(dir); err != nil {
				t.Fatal(err)
			}
			// The files on disk are the ones the format promises.
			optimName := OptimFile(1)
			if opts.Compress {
				optimName += ".zst"
				b, _ := os.ReadFile(filepath.Join(dir, optimName))
				if !bytes.HasPrefix(b, []byte{0x28, 0xb5, 0x2f, 0xfd}) {
					t.Fatalf("%s is not a zstd frame", optimName)
				}
			}
			m, err := ReadManifest(dir)
			if err != nil {
				t.Fatal(err)
			}
			var listed []string
			for _, f := range m.Files {
				listed = append(listed, f.Name)
			}
			want := []string{ModelFile(0), ModelFile(1), OptimFile(0), OptimFile(1), "state.json"}
			if opts.Compress {
				want[2] += ".zst"
				want[3] += ".zst"
			}
			if !slices.Equal(listed, want) || m.Step != 100 || m.FormatVersion != FormatVersion {
				t.Fatalf("manifest %+v, want files %v", m, want)
			}

			c, err := Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			checkSet(t, c.Model(), model, opts.DType)
			checkSet(t, c.Optim(), optim, opts.DType)
			var st testState
			if err := c.ReadState(&st); err != nil {
				t.Fatal(err)
			}
			if st.TokensSeen != 100000 || !slices.Equal(st.RNG, []uint64{1, 1 << 63}) || st.Recipe != "tiny" || c.Step() != 100 {
				t.Fatalf("state %+v step %d", st, c.Step())
			}
			if err := c.Close(); err != nil {
				t.Fatal(err)
			}
			if _, _, err := c.Optim().Tensor("adam_m.embed"); err == nil {
				t.Fatal("read after Close succeeded")
			}
		})
	}
}

func TestTempDirIsNeverACheckpoint(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	rng := rand.New(rand.NewPCG(1, 1))
	s, err := BeginSave(root, 5)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.WriteTensors(ModelFile(0), rankTensors(rng, "")[0], TensorOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := s.WriteState(nil); err != nil {
		t.Fatal(err)
	}
	infos, err := List(root)
	if err != nil || len(infos) != 0 {
		t.Fatalf("List during a save: %v, %v", infos, err)
	}
	if _, err := Latest(root); !errors.Is(err, ErrNoCheckpoint) {
		t.Fatalf("Latest during a save: %v", err)
	}
	if _, err := FindResumable(root, nil); !errors.Is(err, ErrNoCheckpoint) {
		t.Fatalf("FindResumable during a save: %v", err)
	}
	if err := s.Commit(); err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(root)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if !slices.Equal(names, []string{"latest", "step_00000005"}) {
		t.Fatalf("root holds %v after Commit", names)
	}
	if b, _ := os.ReadFile(filepath.Join(root, "latest")); string(b) != "step_00000005\n" {
		t.Fatalf("latest = %q", b)
	}
	if err := s.WriteState(nil); err == nil {
		t.Fatal("write after Commit accepted")
	}
	if err := s.Commit(); err == nil {
		t.Fatal("second Commit accepted")
	}
	if err := s.Abort(); err != nil || !isComplete(s.Dir()) {
		t.Fatalf("Abort after Commit: %v", err)
	}
}

func TestAbandonedSaveKeepsPreviousLatest(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	rng := rand.New(rand.NewPCG(2, 1))
	good := save(t, root, 100, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{})

	// A crash halfway through the next save: files written, no Commit.
	s, err := BeginSave(root, 200)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.WriteTensors(ModelFile(0), rankTensors(rng, "")[0], TensorOptions{}); err != nil {
		t.Fatal(err)
	}
	if dir, err := Latest(root); err != nil || dir != good {
		t.Fatalf("Latest = %s, %v; want %s", dir, err, good)
	}
	dir, err := FindResumable(root, func(w string) { t.Errorf("unexpected warning: %s", w) })
	if err != nil || dir != good {
		t.Fatalf("FindResumable = %s, %v; want %s", dir, err, good)
	}
	// Prune sweeps the leftover.
	if err := Prune(root, 3); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.tmpDir); !os.IsNotExist(err) {
		t.Fatalf("abandoned temp dir survived Prune: %v", err)
	}
	// An explicit Abort removes its own temp dir.
	s2, _ := BeginSave(root, 300)
	_ = s2.WriteState(nil)
	if err := s2.Abort(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s2.tmpDir); !os.IsNotExist(err) {
		t.Fatalf("Abort left %s", s2.tmpDir)
	}
	if err := s2.Commit(); err == nil {
		t.Fatal("Commit after Abort accepted")
	}
	if infos, _ := List(root); len(infos) != 1 || infos[0].Dir != good {
		t.Fatalf("List = %v", infos)
	}
}

// corrupt damages one file of a checkpoint.
func flipByte(t *testing.T, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 0x40
	if err := os.WriteFile(path, b, 0o666); err != nil {
		t.Fatal(err)
	}
}

func truncate(t *testing.T, path string) {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, st.Size()-3); err != nil {
		t.Fatal(err)
	}
}

func TestVerifyNamesTheBadFile(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(3, 1))
	for _, c := range []struct {
		name   string
		damage func(t *testing.T, path string)
		want   string
	}{
		{"flipped byte", flipByte, "checksum mismatch (manifest sha256 "},
		{"truncated", truncate, "size mismatch (manifest "},
		{"missing", func(t *testing.T, path string) { os.Remove(path) }, "missing"},
	} {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			dir := save(t, root, 100, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{Compress: true})
			bad := filepath.Join(dir, OptimFile(1)+".zst")
			c.damage(t, bad)
			err := Verify(dir)
			if err == nil {
				t.Fatal("Verify passed a damaged checkpoint")
			}
			if msg := err.Error(); !strings.Contains(msg, "checkpoint "+bad+": "+c.want) {
				t.Fatalf("error %q should name %s and say %q", msg, bad, c.want)
			}
			// Other files are not blamed.
			if strings.Contains(err.Error(), ModelFile(0)) {
				t.Fatalf("error blames an intact file: %v", err)
			}
		})
	}
	// A truncated file is caught by Open without hashing too.
	root := t.TempDir()
	dir := save(t, root, 1, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{})
	truncate(t, filepath.Join(dir, ModelFile(1)))
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), ModelFile(1)) {
		t.Fatalf("Open of a truncated checkpoint: %v", err)
	}
	// A missing manifest is not a checkpoint.
	os.Remove(filepath.Join(dir, "MANIFEST.json"))
	if err := Verify(dir); err == nil || !strings.Contains(err.Error(), "MANIFEST.json") {
		t.Fatalf("Verify without manifest: %v", err)
	}
}

func TestFindResumableFallsBack(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(4, 1))
	root := t.TempDir()
	if _, err := FindResumable(root, nil); !errors.Is(err, ErrNoCheckpoint) {
		t.Fatalf("empty root: %v", err)
	}
	if _, err := FindResumable(filepath.Join(root, "absent"), nil); !errors.Is(err, ErrNoCheckpoint) {
		t.Fatalf("missing root: %v", err)
	}
	var dirs []string
	for _, step := range []int{100, 200, 300} {
		dirs = append(dirs, save(t, root, step, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{}))
	}
	flipByte(t, filepath.Join(dirs[2], ModelFile(0)))
	truncate(t, filepath.Join(dirs[1], "state.json"))
	var warnings []string
	dir, err := FindResumable(root, func(w string) { warnings = append(warnings, w) })
	if err != nil || dir != dirs[0] {
		t.Fatalf("FindResumable = %s, %v; want %s", dir, err, dirs[0])
	}
	if len(warnings) != 2 || !strings.Contains(warnings[0], filepath.Join(dirs[2], ModelFile(0))) ||
		!strings.Contains(warnings[1], filepath.Join(dirs[1], "state.json")) {
		t.Fatalf("warnings %q", warnings)
	}
	// Latest does not verify: it still follows the pointer to step 300.
	if d, _ := Latest(root); d != dirs[2] {
		t.Fatalf("Latest = %s", d)
	}
	// With every checkpoint bad the error is not "no checkpoint".
	flipByte(t, filepath.Join(dirs[0], OptimFile(1)))
	_, err = FindResumable(root, nil)
	if err == nil || errors.Is(err, ErrNoCheckpoint) || !strings.Contains(err.Error(), "none of the 3") {
		t.Fatalf("all corrupt: %v", err)
	}
}

func TestLatestPointer(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(5, 1))
	root := t.TempDir()
	d1 := save(t, root, 1, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{})
	d2 := save(t, root, 2, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{})
	pointer := filepath.Join(root, "latest")
	for _, c := range []struct {
		content string // "" removes the pointer
		want    string
	}{
		{"step_00000001\n", d1},     // the pointer wins over the newest directory
		{"", d2},                    // no pointer: newest
		{"step_00000009\n", d2},     // dangling pointer: newest
		{"../../etc\n", d2},         // not a step name: ignored
		{"step_0000000001\n", d2},   // not the canonical spelling: ignored
		{"  step_00000001  \n", d1}, // whitespace tolerated
	} {
		os.Remove(pointer)
		if c.content != "" {
			os.WriteFile(pointer, []byte(c.content), 0o666)
		}
		if got, err := Latest(root); err != nil || got != c.want {
			t.Errorf("pointer %q: Latest = %s, %v; want %s", c.content, got, err, c.want)
		}
	}
}

func TestPrune(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(6, 1))
	steps := func(root string) []int {
		infos, err := List(root)
		if err != nil {
			t.Fatal(err)
		}
		var s []int
		for _, i := range infos {
			s = append(s, i.Step)
		}
		return s
	}
	root := t.TempDir()
	var dirs []string
	for step := 1; step <= 5; step++ {
		dirs = append(dirs, save(t, root, step*100, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{}))
	}
	if err := Prune(root, 0); err != nil || !slices.Equal(steps(root), []int{500, 400, 300, 200, 100}) {
		t.Fatalf("keepLast 0 must keep all: %v %v", steps(root), err)
	}
	if err := Prune(root, 3); err != nil || !slices.Equal(steps(root), []int{500, 400, 300}) {
		t.Fatalf("keepLast 3: %v %v", steps(root), err)
	}
	// A truncated newest checkpoint does not cost the newest usable one.
	truncate(t, filepath.Join(dirs[4], ModelFile(1)))
	if err := Prune(root, 1); err != nil || !slices.Equal(steps(root), []int{500, 400}) {
		t.Fatalf("keepLast 1 with step 500 truncated: %v %v", steps(root), err)
	}
	// The checkpoint `latest` names survives even when older.
	os.WriteFile(filepath.Join(root, "latest"), []byte("step_00000400\n"), 0o666)
	os.RemoveAll(dirs[4])
	save(t, root, 600, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{})
	os.WriteFile(filepath.Join(root, "latest"), []byte("step_00000400\n"), 0o666)
	save(t, root, 700, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{})
	os.WriteFile(filepath.Join(root, "latest"), []byte("step_00000400\n"), 0o666)
	if err := Prune(root, 1); err != nil || !slices.Equal(steps(root), []int{700, 400}) {
		t.Fatalf("keepLast 1 with latest -> 400: %v %v", steps(root), err)
	}
	if _, err := os.Stat(filepath.Join(root, "latest")); err != nil {
		t.Fatal(err)
	}
}

func TestSaveSameStepReplaces(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(8, 1))
	root := t.TempDir()
	save(t, root, 100, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{})
	second := rankTensors(rng, "")
	dir := save(t, root, 100, second, rankTensors(rng, "m."), TensorOptions{})
	if err := Verify(dir); err != nil {
		t.Fatal(err)
	}
	c, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	checkSet(t, c.Model(), second, safetensors.F32)
	entries, _ := os.ReadDir(root)
	if len(entries) != 2 {
		t.Fatalf("root holds %d entries, want step dir and latest", len(entries))
	}
}

func TestSaveMisuse(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	s, err := BeginSave(root, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Abort()
	good := []NamedTensor{{Name: "a", Shape: []int{2}, Data: []float32{1, 2}}}
	for _, c := range []struct {
		file    string
		tensors []NamedTensor
		opts    TensorOptions
		want    string
	}{
		{"weights.safetensors", good, TensorOptions{}, "must be model-"},
		{"model-0.bin", good, TensorOptions{}, "must be model-"},
		{"../model-0.safetensors", good, TensorOptions{}, "plain file name"},
		{"model-0.safetensors", good, TensorOptions{DType: safetensors.F16}, "not F32 or BF16"},
		{"model-0.safetensors", []NamedTensor{{Name: "a", Shape: []int{3}, Data: []float32{1}}}, TensorOptions{}, `tensor "a": shape [3] holds 3 values, data has 1`},
		{"model-0.safetensors", []NamedTensor{{Name: "a", Shape: []int{2}, Data: []float32{1, 2}, Slice: &Slice{Offset: []int{1}, GlobalShape: []int{2}}}}, TensorOptions{}, "does not fit"},
		{"model-0.safetensors", []NamedTensor{{Name: "a", Shape: []int{2}, Data: []float32{1, 2}, Slice: &Slice{Offset: []int{0, 0}, GlobalShape: []int{2, 2}}}}, TensorOptions{}, "rank"},
		{"model-0.safetensors", append(good, good...), TensorOptions{}, `tensor "a": appears twice`},
		{"model-0.safetensors", []NamedTensor{{Name: "__metadata__"}}, TensorOptions{}, "bad tensor name"},
	} {
		if err := s.WriteTensors(c.file, c.tensors, c.opts); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("WriteTensors(%s): %v, want %q", c.file, err, c.want)
		}
	}
	if err := s.WriteTensors(ModelFile(0), good, TensorOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := s.WriteTensors(ModelFile(0), good, TensorOptions{Compress: true}); err == nil {
		t.Error("the same file written plain and compressed")
	}
	for _, name := range []string{"state.json", "MANIFEST.json", "x.txt", "a/b.json"} {
		if err := s.WriteJSON(name, 1); err == nil {
			t.Errorf("WriteJSON(%s) accepted", name)
		}
	}
	// A failed write blocks the Commit. A file in place of the temporary
	// directory makes the next file's creation fail, whoever runs the test.
	aside := s.tmpDir + "-aside"
	if err := os.Rename(s.tmpDir, aside); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(s.tmpDir, nil, 0o666)
	if err := s.WriteTensors(ModelFile(1), good, TensorOptions{}); err == nil {
		t.Fatal("write into a missing directory succeeded")
	}
	os.Remove(s.tmpDir)
	os.Rename(aside, s.tmpDir)
	if len(s.failed) != 1 {
		t.Fatalf("%d failed writes recorded, want the one", len(s.failed))
	}
	if err := s.Commit(); err == nil || !strings.Contains(err.Error(), "a write failed") {
		t.Fatalf("Commit after a failed write: %v", err)
	}
	if _, err := BeginSave(root, -1); err == nil {
		t.Error("negative step accepted")
	}
}

func TestExtraJSON(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	s, _ := BeginSave(root, 3)
	defer s.Abort()
	type recipe struct{ LR float64 }
	if err := s.WriteJSON("recipe.json", recipe{LR: 3e-4}); err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(); err != nil { // no WriteState: a null payload is written
		t.Fatal(err)
	}
	c, err := Open(s.Dir())
	if err != nil {
		t.Fatal(err)
	}
	var r recipe
	if err := c.ReadJSON("recipe.json", &r); err != nil || r.LR != 3e-4 {
		t.Fatalf("recipe %+v, %v", r, err)
	}
	var st *testState
	if err := c.ReadState(&st); err != nil || st != nil {
		t.Fatalf("state %+v, %v", st, err)
	}
	if err := c.ReadJSON("../x.json", &r); err == nil {
		t.Fatal("ReadJSON outside the checkpoint accepted")
	}
	if len(c.Model().Names()) != 0 {
		t.Fatal("phantom tensors")
	}
}

// replaceFile swaps a checkpoint file's content and updates its manifest
// entry to match, as a writer bug (not disk corruption) would.
func replaceFile(t *testing.T, dir, name string, content []byte) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), content, 0o666); err != nil {
		t.Fatal(err)
	}
	m, err := ReadManifest(dir)
	if err != nil {
		t.Fatal(err)
	}
	for i := range m.Files {
		if m.Files[i].Name == name {
			sum := sha256.Sum256(content)
			m.Files[i].Size, m.Files[i].SHA256 = int64(len(content)), hex.EncodeToString(sum[:])
		}
	}
	b, _ := json.Marshal(m)
	if err := os.WriteFile(filepath.Join(dir, "MANIFEST.json"), b, 0o666); err != nil {
		t.Fatal(err)
	}
	if err := Verify(dir); err != nil {
		t.Fatal(err)
	}
}

func TestOpenRejectsMalformedTensorFile(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(9, 1))
	for _, compress := range []bool{false, true} {
		root := t.TempDir()
		dir := save(t, root, 1, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{Compress: compress})
		name := OptimFile(0)
		if compress {
			name += ".zst"
		}
		replaceFile(t, dir, name, []byte("\xff\x00\x00\x00\x00\x00\x01\x00garbage"))
		if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), filepath.Join(dir, name)) {
			t.Fatalf("compress=%v: Open of garbage: %v", compress, err)
		}
	}
}

// A compressed file whose header promises a terabyte of data it does not
// have must fail to read, not allocate the terabyte.
func TestLyingCompressedHeader(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(12, 1))
	dir := save(t, t.TempDir(), 1, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{Compress: true})
	header := `{"huge":{"dtype":"F32","shape":[274877906944],"data_offsets":[0,1099511627776]}}`
	file := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	file = append(append(file, header...), make([]byte, 16)...)
	var zbuf bytes.Buffer
	enc, _ := zstd.NewWriter(&zbuf)
	enc.Write(file)
	enc.Close()
	replaceFile(t, dir, OptimFile(0)+".zst", zbuf.Bytes())
	c, err := Open(dir) // only the header is read here
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, _, err := c.Optim().Tensor("huge"); err == nil || !strings.Contains(err.Error(), OptimFile(0)) {
		t.Fatalf("reading a tensor the file does not hold: %v", err)
	}
}

// TestSetLatest: resuming repoints a pointer left one checkpoint behind, and
// refuses what is not a complete checkpoint under root.
func TestSetLatest(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(9, 1))
	root := t.TempDir()
	d1 := save(t, root, 1, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{})
	d2 := save(t, root, 2, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{})
	// A save stopped before moving the pointer.
	if err := os.WriteFile(filepath.Join(root, "latest"), []byte("step_00000001\n"), 0o666); err != nil {
		t.Fatal(err)
	}
	if got, _ := Latest(root); got != d1 {
		t.Fatalf("Latest = %s before SetLatest, want %s", got, d1)
	}
	if err := SetLatest(root, d2); err != nil {
		t.Fatal(err)
	}
	if got, err := Latest(root); err != nil || got != d2 {
		t.Errorf("Latest = %s, %v after SetLatest, want %s", got, err, d2)
	}
	for _, bad := range []string{filepath.Join(root, "step_00000007"), t.TempDir(), filepath.Join(root, "latest")} {
		if err := SetLatest(root, bad); err == nil {
			t.Errorf("SetLatest(%s) succeeded", bad)
		}
	}
}

// TestFindResumableContextStops: a cancelled context stops the search with
// an error wrapping its cause, not a warning that skips the checkpoint as
// corrupt nor a fall back to an older one.
func TestFindResumableContextStops(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(4, 2))
	root := t.TempDir()
	for _, step := range []int{100, 200} {
		save(t, root, step, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{})
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var warnings []string
	dir, err := FindResumableContext(ctx, root, func(w string) { warnings = append(warnings, w) })
	if !errors.Is(err, context.Canceled) || dir != "" || len(warnings) != 0 {
		t.Fatalf("FindResumableContext after cancel = %q, %v (warnings %q); want an error wrapping context.Canceled and no warning", dir, err, warnings)
	}
}
