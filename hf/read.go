package hf

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"github.com/mktrain/mktrain/checkpoint/safetensors"
)

// Weights are the tensors of a Mixtral directory, found by name across its
// files. They are not safe for concurrent use.
type Weights struct {
	dir    string
	tied   bool // tie_word_embeddings: lm_head.weight may be absent
	files  []*safetensors.File
	byName map[string]located
}

// located is one tensor and the file that holds it.
type located struct {
	file *safetensors.File
	path string
	info safetensors.TensorInfo
}

// Open opens the Mixtral directory dir for reading the tensors of a model
// of shape want. Its config.json must describe want (the error names every
// field that differs); its weights are model.safetensors, or the shards
// that model.safetensors.index.json's weight_map lists. Close releases the
// files.
func Open(dir string, want Model) (_ *Weights, err error) {
	tied, err := checkConfig(filepath.Join(dir, ConfigFile), want)
	if err != nil {
		return nil, err
	}
	w := &Weights{dir: dir, tied: tied, byName: map[string]located{}}
	defer func() {
		if err != nil {
			w.Close()
		}
	}()
	indexPath := filepath.Join(dir, IndexFile)
	raw, err := os.ReadFile(indexPath)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return w, w.openSingle()
	case err != nil:
		return nil, err
	}
	return w, w.openShards(indexPath, raw)
}

// openSingle indexes the one file model.safetensors.
func (w *Weights) openSingle() error {
	path := filepath.Join(w.dir, WeightsFile)
	f, err := safetensors.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%s has neither %s nor %s (only safetensors weights load)", w.dir, WeightsFile, IndexFile)
	}
	if err != nil {
		return err
	}
	w.files = append(w.files, f)
	for _, info := range f.Header().Tensors {
		w.byName[info.Name] = located{file: f, path: path, info: info}
	}
	return nil
}

// openShards indexes the files the index (raw, read from indexPath) lists.
func (w *Weights) openShards(indexPath string, raw []byte) error {
	var index struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	if err := json.Unmarshal(raw, &index); err != nil {
		return fmt.Errorf("%s: %w", indexPath, err)
	}
	if len(index.WeightMap) == 0 {
		return fmt.Errorf("%s: weight_map is missing or empty", indexPath)
	}
	opened := map[string]*safetensors.File{}
	names := make([]string, 0, len(index.WeightMap))
	for name := range index.WeightMap {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		file := index.WeightMap[name]
		if file == "" || filepath.Base(file) != file {
			return fmt.Errorf("%s: tensor %q: %q is not a file name in %s", indexPath, name, file, w.dir)
		}
		path := filepath.Join(w.dir, file)
		f, ok := opened[file]
		if !ok {
			var err error
			if f, err = safetensors.Open(path); err != nil {
				return err
			}
			opened[file] = f
			w.files = append(w.files, f)
		}
		info, ok := f.Header().Lookup(name)
		if !ok {
			return fmt.Errorf("%s: tensor %q is listed in %s, but that file does not hold it", path, name, IndexFile)
		}
		w.byName[name] = located{file: f, path: path, info: info}
	}
	return nil
}

// Read reads the named tensor, which must have the given shape, into dst,
// converting its dtype to float32. With tie_word_embeddings and no
// lm_head.weight, lm_head.weight reads the embedding.
func (w *Weights) Read(name string, shape []int, dst []float32) error {
	t, ok := w.byName[name]
	if !ok && name == LMHeadName && w.tied {
		t, ok = w.byName[EmbedName]
	}
	if !ok {
		return fmt.Errorf("%s has no tensor %q", w.dir, name)
	}
	if !slices.Equal(t.info.Shape, shape) {
		return fmt.Errorf("%s: tensor %q has shape %v, the model needs %v", t.path, name, t.info.Shape, shape)
	}
	return t.file.ReadFloat32(t.info, dst)
}

// Files is the number of safetensors files the weights are spread over.
func (w *Weights) Files() int { return len(w.files) }

// Close closes the files.
func (w *Weights) Close() error {
	var errs []error
	for _, f := range w.files {
		errs = append(errs, f.Close())
	}
	w.files = nil
	return errors.Join(errs...)
}
