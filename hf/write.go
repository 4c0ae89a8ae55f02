package hf

import (
	"encoding/json"
	"fmt"
	"io"
	"path/filepath"

	"github.com/mktrain/mktrain/checkpoint/safetensors"
	"github.com/mktrain/mktrain/internal/atomicfile"
)

// Write writes a Mixtral directory at dir that transformers'
// MixtralForCausalLM.from_pretrained loads: config.json describing m, and
// model.safetensors holding every tensor of Tensors(m) in dtype; with
// m.Tokenizer, also tokenizer.json and tokenizer_config.json, which
// AutoTokenizer.from_pretrained loads. read
// fills each tensor's float32 values, in the order of Tensors(m); dst has
// the tensor's element count and is reused between calls.
//
// The directory appears whole or not at all: it is written under a
// temporary name beside dir and renamed (package internal/atomicfile). dir
// must not exist, or be an empty directory. Errors begin "export:".
func Write(dir string, m Model, dtype DType, read func(name string, dst []float32) error) error {
	stType, torchType, err := dtype.encodings()
	if err != nil {
		return fmt.Errorf("export: %w", err)
	}
	tensors := Tensors(m)
	specs := make([]safetensors.TensorSpec, len(tensors))
	largest := 0
	for i, t := range tensors {
		specs[i] = safetensors.TensorSpec{Name: t.Name, DType: stType, Shape: t.Shape}
		largest = max(largest, numElements(t.Shape))
	}
	cfg, err := json.MarshalIndent(configFor(m, torchType), "", "  ")
	if err != nil {
		return err
	}
	files := map[string][]byte{ConfigFile: append(cfg, '\n')}
	if m.Tokenizer != nil {
		tc, err := TokenizerConfig(m.Tokenizer, m.MaxPositions)
		if err != nil {
			return fmt.Errorf("export: %w", err)
		}
		files[TokenizerFile], files[TokenizerConfigFile] = m.Tokenizer.JSON, tc
	}
	err = atomicfile.WriteDir(dir, func(tmp string) error {
		for name, b := range files {
			if err := writeFile(filepath.Join(tmp, name), func(w io.Writer) error {
				_, err := w.Write(b)
				return err
			}); err != nil {
				return err
			}
		}
		buf := make([]float32, largest)
		return writeFile(filepath.Join(tmp, WeightsFile), func(w io.Writer) error {
			sw, err := safetensors.NewWriter(w, specs, map[string]string{"format": "pt"})
			if err != nil {
				return err
			}
			for _, s := range specs {
				part := buf[:numElements(s.Shape)]
				if err := read(s.Name, part); err != nil {
					return err
				}
				if err := sw.WriteFloat32(part); err != nil {
					return err
				}
			}
			return sw.Close()
		})
	})
	if err != nil {
		return fmt.Errorf("export: %w", err)
	}
	return nil
}

// writeFile writes one file of the temporary directory, naming it in the
// error.
func writeFile(path string, write func(io.Writer) error) error {
	if err := atomicfile.WriteSynced(path, write); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}
