package engine

// The run's tokenizer travels with it. New reads the tokenizer data.tokenizer
// names (or, when that is empty, the tokenizer.json of the Hugging Face
// directory checkpoint.init_from names) and refuses one with more ids than
// model.vocab. Run copies it into the run directory, every checkpoint holds
// it (tokenizer.json byte for byte and a tokenizer_config.json naming its
// special tokens, both hashed in the manifest), state.json records its
// SHA-256, and a resume under another tokenizer is refused. Package infer
// encodes and decodes with the checkpoint's copy, and exports it.

import (
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/comm"
	"github.com/mktrain/mktrain/hf"
	"github.com/mktrain/mktrain/internal/atomicfile"
	"github.com/mktrain/mktrain/tokenizer"
)

// runTokenizer is the run's tokenizer as it travels.
type runTokenizer struct {
	source string // the file it was read from
	tok    *tokenizer.Tokenizer
	json   []byte // tokenizer.json: tok.JSON()
	config []byte // tokenizer_config.json: its special tokens (hf.TokenizerConfig)
}

// loadTokenizer reads the run's tokenizer: data.tokenizer; else, for a run
// on shards that starts from a Hugging Face directory, that directory's
// tokenizer.json when it has one; else none (byte-level). A tokenizer with
// ids the model has no embedding for is refused.
func loadTokenizer(cfg Config) (*runTokenizer, error) {
	field, path := "data.tokenizer", cfg.Data.Tokenizer
	if path == "" && cfg.Checkpoint.InitFrom != "" && cfg.Data.Train != "" {
		candidate := filepath.Join(cfg.Checkpoint.InitFrom, hf.TokenizerFile)
		if _, err := os.Stat(candidate); err == nil {
			field, path = "checkpoint.init_from", candidate
		}
	}
	if path == "" {
		return nil, nil
	}
	tok, err := tokenizer.Load(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", field, err)
	}
	if n := tok.VocabSize(); n > cfg.Model.Vocab {
		return nil, fmt.Errorf("%s: the tokenizer %s has %d ids, more than model.vocab (%d): the model would have no embedding for ids %d and up; set model.vocab to at least %d",
			field, path, n, cfg.Model.Vocab, cfg.Model.Vocab, n)
	}
	config, err := hf.TokenizerConfig(hf.TokenizerFor(tok), cfg.Train.Seq)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", field, err)
	}
	return &runTokenizer{source: path, tok: tok, json: tok.JSON(), config: config}, nil
}

// hash is the SHA-256 of tokenizer.json that state.json records; "" for
// none (byte-level).
func (t *runTokenizer) hash() string {
	if t == nil {
		return ""
	}
	return t.tok.Hash()
}

// files are the tokenizer's files and their names.
func (t *runTokenizer) files() []struct {
	name string
	data []byte
} {
	return []struct {
		name string
		data []byte
	}{{hf.TokenizerFile, t.json}, {hf.TokenizerConfigFile, t.config}}
}

// writeRunDir copies the tokenizer into the run directory, beside
// recipe.yaml, each file replaced atomically.
func (t *runTokenizer) writeRunDir(dir string) error {
	for _, f := range t.files() {
		path := filepath.Join(dir, f.name)
		if err := atomicfile.WriteFile(path, func(w io.Writer) error {
			_, err := w.Write(f.data)
			return err
		}); err != nil {
			return fmt.Errorf("copying the tokenizer into the run directory: %s: %w", path, err)
		}
	}
	return nil
}

// writeCheckpoint stores the tokenizer in a checkpoint being saved.
func (t *runTokenizer) writeCheckpoint(sv *checkpoint.Save) error {
	for _, f := range t.files() {
		if err := sv.WriteFile(f.name, f.data); err != nil {
			return err
		}
	}
	return nil
}

// describeTokenizer names a tokenizer by its hash for messages.
func describeTokenizer(hash string) string {
	if hash == "" {
		return "the byte-level tokenizer (no tokenizer file)"
	}
	return "the tokenizer of sha256 " + hash[:min(16, len(hash))] + "..."
}

// copyTokenizer copies the run's tokenizer into the run directory when this
// process writes the run's files (it hosts world rank 0).
func (e *Engine) copyTokenizer(world []*comm.Ranks) error {
	writes := false
	for _, g := range world {
		writes = writes || g.Rank == 0
	}
	if e.tokenizer == nil || e.runDir == "" || !writes {
		return nil
	}
	if err := e.tokenizer.writeRunDir(e.runDir); err != nil {
		return err
	}
	e.log.Info().Str("tokenizer", e.tokenizer.source).Int("ids", e.tokenizer.tok.VocabSize()).
		Str("sha256", e.tokenizer.hash()).Msg("tokenizer")
	return nil
}
