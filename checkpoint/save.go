package checkpoint

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/klauspost/compress/zstd"

	"github.com/mktrain/mktrain/checkpoint/safetensors"
	"github.com/mktrain/mktrain/internal/atomicfile"
)

// NamedTensor is one tensor handed to Save.WriteTensors. Name must not
// depend on the parallel layout ("layers.3.moe.experts.5.w1"), so that
// another layout can find it by name.
type NamedTensor struct {
	Name  string
	Shape []int
	Data  []float32 // row-major, len = product of Shape
	// Slice, when not nil, says Data is only a block of the tensor Name,
	// which several files hold between them.
	Slice *Slice
}

// Slice places a block of Shape elements at Offset inside a tensor of
// GlobalShape; all three have the same rank. The blocks of one name across
// the files of a checkpoint must tile GlobalShape exactly.
type Slice struct {
	Offset      []int
	GlobalShape []int
}

// TensorOptions chooses how WriteTensors stores a file.
type TensorOptions struct {
	// DType is safetensors.F32 (the default, for "") or safetensors.BF16.
	DType safetensors.DType
	// Compress writes the file through zstd and appends ".zst" to its name.
	Compress bool
}

// sliceMetaPrefix starts the safetensors metadata key that records a
// tensor's Slice: "mktrain.slice.<name>" -> {"offset":[..],"global_shape":[..]}.
const sliceMetaPrefix = "mktrain.slice."

// sliceMeta is the JSON value of a slice metadata entry.
type sliceMeta struct {
	Offset      []int `json:"offset"`
	GlobalShape []int `json:"global_shape"`
}

// state is the content of state.json.
type state struct {
	Format        string          `json:"format"`
	FormatVersion int             `json:"format_version"`
	Step          int             `json:"step"`
	Payload       json.RawMessage `json:"payload"`
}

// Save is one checkpoint being written into a temporary directory under
// its root. All methods are safe for concurrent use, so every (virtual)
// rank can write its own shard files at once, and a Save may run in a
// background goroutine while training continues. Save reads the tensors
// only during WriteTensors: for an asynchronous save the caller first
// copies device tensors into host memory it will not touch until
// WriteTensors returns.
//
// Use it as:
//
//	s, err := checkpoint.BeginSave(root, step)
//	defer s.Abort() // removes the temporary directory unless committed
//	... s.WriteTensors(checkpoint.ModelFile(rank), ...) from each rank ...
//	s.WriteState(payload)
//	err = s.Commit()
type Save struct {
	root, tmpDir, dir string
	step              int

	mu        sync.Mutex
	files     map[string]*fileRecord // by name without ".zst", to forbid both
	failed    []error                // writes that failed; Commit refuses then
	state     bool                   // state.json written
	finished  bool                   // Commit started or Abort called
	committed bool
}

type fileRecord struct {
	entry FileEntry
	done  bool
}

// BeginSave starts the checkpoint of step under root (created if needed)
// in a fresh temporary directory <root>/.tmp-step_%08d-<random>, which
// List and Latest never report.
func BeginSave(root string, step int) (*Save, error) {
	if step < 0 {
		return nil, fmt.Errorf("checkpoint: negative step %d", step)
	}
	if err := os.MkdirAll(root, 0o777); err != nil {
		return nil, fmt.Errorf("checkpoint: %w", err)
	}
	var rnd [8]byte
	_, _ = rand.Read(rnd[:]) // never fails (crypto/rand crashes the program instead)
	tmp := filepath.Join(root, tmpPrefix+StepDirName(step)+"-"+hex.EncodeToString(rnd[:]))
	if err := os.Mkdir(tmp, 0o777); err != nil {
		return nil, fmt.Errorf("checkpoint: %w", err)
	}
	return &Save{
		root: root, tmpDir: tmp, dir: filepath.Join(root, StepDirName(step)), step: step,
		files: map[string]*fileRecord{},
	}, nil
}

// Step is the step being saved.
func (s *Save) Step() int { return s.step }

// Dir is where the checkpoint appears once Commit succeeds.
func (s *Save) Dir() string { return s.dir }

// WriteTensors writes one safetensors file of tensors, named fileName
// ("model-…" or "optim-…" ending ".safetensors", see ModelFile and
// OptimFile), plus ".zst" when opts.Compress. Tensors are stored in the
// given order; the file is fsynced before WriteTensors returns.
func (s *Save) WriteTensors(fileName string, tensors []NamedTensor, opts TensorOptions) error {
	if err := checkTensorFileName(fileName); err != nil {
		return fmt.Errorf("checkpoint: WriteTensors: %w", err)
	}
	dtype := opts.DType
	if dtype == "" {
		dtype = safetensors.F32
	}
	if dtype != safetensors.F32 && dtype != safetensors.BF16 {
		return fmt.Errorf("checkpoint: WriteTensors %s: dtype %q is not F32 or BF16", fileName, dtype)
	}
	specs := make([]safetensors.TensorSpec, len(tensors))
	meta := map[string]string{
		"format":                 "pt", // lets Hugging Face tools load the file
		"mktrain.format_version": strconv.Itoa(FormatVersion),
		"mktrain.step":           strconv.Itoa(s.step),
	}
	seen := make(map[string]bool, len(tensors))
	for i, t := range tensors {
		err := checkTensor(t)
		if seen[t.Name] {
			err = errors.New("appears twice")
		}
		if err != nil {
			return fmt.Errorf("checkpoint: WriteTensors %s: tensor %q: %w", fileName, t.Name, err)
		}
		seen[t.Name] = true
		specs[i] = safetensors.TensorSpec{Name: t.Name, DType: dtype, Shape: t.Shape}
		if t.Slice != nil {
			b, _ := json.Marshal(sliceMeta{Offset: t.Slice.Offset, GlobalShape: t.Slice.GlobalShape}) // ints always marshal
			meta[sliceMetaPrefix+t.Name] = string(b)
		}
	}
	name := fileName
	if opts.Compress {
		name += zstdSuffix
	}
	return s.writeFile(fileName, name, opts.Compress, func(w io.Writer) error {
		sw, err := safetensors.NewWriter(w, specs, meta)
		if err != nil {
			return err
		}
		for _, t := range tensors {
			if err := sw.WriteFloat32(t.Data); err != nil {
				return err
			}
		}
		return sw.Close()
	})
}

func checkTensorFileName(name string) error {
	if err := checkPlainName(name); err != nil {
		return err
	}
	if !strings.HasSuffix(name, tensorSuffix) ||
		!(strings.HasPrefix(name, modelPrefix) || strings.HasPrefix(name, optimPrefix)) {
		return fmt.Errorf("file name %q must be model-*%s or optim-*%s", name, tensorSuffix, tensorSuffix)
	}
	return nil
}

func checkTensor(t NamedTensor) error {
	if t.Name == "" || t.Name == "__metadata__" || !utf8.ValidString(t.Name) {
		return errors.New("bad tensor name")
	}
	n := 1
	for _, d := range t.Shape {
		if d < 0 {
			return fmt.Errorf("negative dimension in shape %v", t.Shape)
		}
		n *= d
	}
	if len(t.Data) != n {
		return fmt.Errorf("shape %v holds %d values, data has %d", t.Shape, n, len(t.Data))
	}
	if t.Slice != nil {
		return checkSlice(t.Shape, *t.Slice)
	}
	return nil
}

// checkSlice checks that a block of shape fits where sl puts it.
func checkSlice(shape []int, sl Slice) error {
	if len(sl.Offset) != len(shape) || len(sl.GlobalShape) != len(shape) {
		return fmt.Errorf("slice offset %v and global shape %v must have the rank of shape %v",
			sl.Offset, sl.GlobalShape, shape)
	}
	for i := range shape {
		if sl.Offset[i] < 0 || sl.Offset[i] > sl.GlobalShape[i]-shape[i] {
			return fmt.Errorf("block %v at offset %v does not fit in global shape %v",
				shape, sl.Offset, sl.GlobalShape)
		}
	}
	return nil
}

// WriteState writes state.json: the package's own fields (format version,
// step) and payload, the caller's JSON-marshalable state (data cursor, RNG
// states, schedule, recipe...). Commit writes one with a null payload if
// WriteState was never called. Read it back with Checkpoint.ReadState.
func (s *Save) WriteState(payload any) error {
	raw, err := json.Marshal(payload)
	if err != nil {
		return fmt.Errorf("checkpoint: state.json payload: %w", err)
	}
	b, err := json.MarshalIndent(state{Format: formatName, FormatVersion: FormatVersion, Step: s.step, Payload: raw}, "", "  ")
	if err != nil {
		return fmt.Errorf("checkpoint: state.json: %w", err)
	}
	if err := s.writeBytes(stateName, append(b, '\n')); err != nil {
		return err
	}
	s.mu.Lock()
	s.state = true
	s.mu.Unlock()
	return nil
}

// WriteJSON writes v as an extra JSON file name (ending ".json"; not
// state.json or MANIFEST.json), read back with Checkpoint.ReadJSON.
func (s *Save) WriteJSON(name string, v any) error {
	if err := checkPlainName(name); err != nil || !strings.HasSuffix(name, ".json") ||
		name == stateName || name == manifestName {
		return fmt.Errorf("checkpoint: WriteJSON: bad file name %q (want NAME.json, not %s or %s)",
			name, stateName, manifestName)
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("checkpoint: WriteJSON %s: %w", name, err)
	}
	return s.writeBytes(name, append(b, '\n'))
}

// WriteFile writes data as the extra file name, byte for byte (a
// tokenizer.json, say), listed and hashed in the manifest like every other
// file; Checkpoint.ReadFile reads it back. name must be a plain file name
// that is not state.json, MANIFEST.json or a tensor file's.
func (s *Save) WriteFile(name string, data []byte) error {
	if err := checkPlainName(name); err != nil || name == stateName || name == manifestName ||
		strings.HasPrefix(name, modelPrefix) || strings.HasPrefix(name, optimPrefix) || strings.HasPrefix(name, tmpPrefix) {
		return fmt.Errorf("checkpoint: WriteFile: bad file name %q (not %s, %s, %s*, %s* or %s*)",
			name, stateName, manifestName, modelPrefix, optimPrefix, tmpPrefix)
	}
	return s.writeBytes(name, data)
}

func (s *Save) writeBytes(name string, b []byte) error {
	return s.writeFile(name, name, false, func(w io.Writer) error {
		_, err := w.Write(b)
		return err
	})
}

// writeFile creates name in the temporary directory, passes write a writer
// that hashes, counts and optionally compresses, fsyncs the file and
// records it for the manifest. key is the name without ".zst".
func (s *Save) writeFile(key, name string, compress bool, write func(io.Writer) error) error {
	s.mu.Lock()
	switch {
	case s.finished:
		s.mu.Unlock()
		return fmt.Errorf("checkpoint %s: write of %s after Commit or Abort", s.dir, name)
	case s.files[key] != nil:
		s.mu.Unlock()
		return fmt.Errorf("checkpoint %s: %s written twice", s.dir, name)
	}
	rec := &fileRecord{entry: FileEntry{Name: name}}
	s.files[key] = rec
	s.mu.Unlock()

	path := filepath.Join(s.tmpDir, name)
	entry, err := writeSynced(path, compress, write)
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		err = fmt.Errorf("checkpoint %s: %w", path, err)
		s.failed = append(s.failed, err)
		return err
	}
	entry.Name = name
	rec.entry, rec.done = entry, true
	return nil
}

// countingWriter counts the bytes that reach the file.
type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// writeSynced writes a new file at path and fsyncs it, returning its size
// and SHA-256 (of the bytes on disk, compressed or not).
func writeSynced(path string, compress bool, write func(io.Writer) error) (FileEntry, error) {
	h := sha256.New()
	var size int64
	err := atomicfile.WriteSynced(path, func(w io.Writer) error {
		cw := &countingWriter{w: io.MultiWriter(w, h)}
		defer func() { size = cw.n }()
		if !compress {
			return write(cw)
		}
		enc, err := zstd.NewWriter(cw, zstd.WithEncoderLevel(zstd.SpeedDefault))
		if err != nil {
			return err
		}
		if err := write(enc); err != nil {
			enc.Close()
			return err
		}
		return enc.Close()
	})
	if err != nil {
		return FileEntry{}, err
	}
	return FileEntry{Size: size, SHA256: hex.EncodeToString(h.Sum(nil))}, nil
}

// Commit makes the checkpoint durable and visible, in an order that leaves
// either the old state or the new one after a crash at any point:
//
//  1. write MANIFEST.json (every file, its size and SHA-256) and fsync it;
//     the data files were fsynced as they were written;
//  2. fsync the temporary directory and rename it to <root>/step_%08d,
//     replacing an existing checkpoint of the same step; fsync root;
//  3. write the `latest` pointer to a temporary file, fsync it, rename it
//     over <root>/latest and fsync root.
//
// (The one exception: when step 2 replaces a checkpoint of the same step,
// a crash between its two renames leaves neither in place, the old one
// under a .tmp- name.) Every write must have returned before Commit is
// called, and none may have failed. An error after step 2 leaves a
// complete checkpoint with a stale `latest`, which FindResumable still
// finds.
func (s *Save) Commit() error {
	s.mu.Lock()
	if err := s.commitCheck(); err != nil {
		s.mu.Unlock()
		return err
	}
	needState := !s.state
	s.mu.Unlock()
	if needState {
		if err := s.WriteState(nil); err != nil {
			return err
		}
	}

	s.mu.Lock()
	if err := s.commitCheck(); err != nil {
		s.mu.Unlock()
		return err
	}
	s.finished = true
	m := Manifest{Format: formatName, FormatVersion: FormatVersion, Step: s.step}
	for _, rec := range s.files {
		m.Files = append(m.Files, rec.entry)
	}
	s.mu.Unlock()
	slices.SortFunc(m.Files, func(a, b FileEntry) int { return strings.Compare(a.Name, b.Name) })

	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return fmt.Errorf("checkpoint %s: manifest: %w", s.dir, err)
	}
	manifestPath := filepath.Join(s.tmpDir, manifestName)
	if _, err := writeSynced(manifestPath, false, func(w io.Writer) error {
		_, err := w.Write(append(b, '\n'))
		return err
	}); err != nil {
		return fmt.Errorf("checkpoint %s: %w", manifestPath, err)
	}
	if err := syncDir(s.tmpDir); err != nil {
		return err
	}
	if err := s.moveIntoPlace(); err != nil {
		return err
	}
	s.mu.Lock()
	s.committed = true
	s.mu.Unlock()
	return writePointer(s.root, StepDirName(s.step))
}

// commitCheck refuses a Commit that would record an incomplete save.
// Callers hold s.mu.
func (s *Save) commitCheck() error {
	if s.finished {
		return fmt.Errorf("checkpoint %s: Commit after Commit or Abort", s.dir)
	}
	if len(s.failed) > 0 {
		return fmt.Errorf("checkpoint %s: not committing, a write failed: %w", s.dir, errors.Join(s.failed...))
	}
	for _, rec := range s.files {
		if !rec.done {
			return fmt.Errorf("checkpoint %s: Commit while %s is still being written", s.dir, rec.entry.Name)
		}
	}
	return nil
}

// moveIntoPlace renames the temporary directory to the step directory.
// A checkpoint of the same step already there (a run resumed from an
// earlier step) is first moved aside and deleted after; a crash in between
// leaves it under a .tmp- name for Prune.
func (s *Save) moveIntoPlace() error {
	old := ""
	if _, err := os.Stat(s.dir); err == nil {
		old = s.tmpDir + "-replaced"
		if err := os.Rename(s.dir, old); err != nil {
			return fmt.Errorf("checkpoint %s: moving the existing checkpoint aside: %w", s.dir, err)
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("checkpoint %s: %w", s.dir, err)
	}
	if err := os.Rename(s.tmpDir, s.dir); err != nil {
		if old != "" {
			_ = os.Rename(old, s.dir) // put the previous checkpoint back
		}
		return fmt.Errorf("checkpoint %s: %w", s.dir, err)
	}
	if err := syncDir(s.root); err != nil {
		return err
	}
	if old != "" {
		return removeAll(old)
	}
	return nil
}

// SetLatest points root's `latest` at dir, a complete checkpoint directly
// under root, atomically as a save does. A save stopped between renaming its
// directory into place and moving the pointer leaves the pointer one
// checkpoint behind; resuming from the newer one calls SetLatest so that
// Latest names what the run continued from.
func SetLatest(root, dir string) error {
	if filepath.Clean(filepath.Dir(dir)) != filepath.Clean(root) {
		return fmt.Errorf("checkpoint: %s is not a checkpoint directly under %s", dir, root)
	}
	if _, ok := parseStepDirName(filepath.Base(dir)); !ok || !isComplete(dir) {
		return fmt.Errorf("checkpoint: %s is not a complete checkpoint", dir)
	}
	if cur, ok := readPointer(root); ok && cur == filepath.Join(root, filepath.Base(dir)) {
		return nil
	}
	return writePointer(root, filepath.Base(dir))
}

// writePointer atomically replaces root/latest with name. A temporary
// file a crash leaves behind starts with tmpPrefix, which Prune removes.
func writePointer(root, name string) error {
	path := filepath.Join(root, latestName)
	if err := atomicfile.WriteFile(path, func(w io.Writer) error {
		_, err := io.WriteString(w, name+"\n")
		return err
	}); err != nil {
		return fmt.Errorf("checkpoint: updating %s: %w", path, err)
	}
	return nil
}

// syncDir fsyncs a directory so that the entries created or renamed in it
// survive a crash.
func syncDir(dir string) error {
	if err := atomicfile.SyncDir(dir); err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	return nil
}

// Abort deletes the temporary directory of a Save that was not committed;
// after a successful Commit it does nothing, so it suits a defer. Call it
// after every write has returned.
func (s *Save) Abort() error {
	s.mu.Lock()
	committed := s.committed
	s.finished = true
	s.mu.Unlock()
	if committed {
		return nil
	}
	return removeAll(s.tmpDir)
}
