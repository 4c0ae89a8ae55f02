package checkpoint

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"github.com/klauspost/compress/zstd"

	"github.com/mktrain/mktrain/checkpoint/safetensors"
)

// Checkpoint is a checkpoint directory open for reading. Its methods are
// safe for concurrent use.
type Checkpoint struct {
	dir          string
	manifest     *Manifest
	model, optim *TensorSet
}

// Open reads dir's manifest and the headers of its tensor files, and
// checks that the files have their manifest sizes and that every tensor's
// blocks fit together. It does not hash the files: call Verify first for
// that (FindResumable does).
func Open(dir string) (*Checkpoint, error) {
	m, err := ReadManifest(dir)
	if err != nil {
		return nil, err
	}
	c := &Checkpoint{dir: dir, manifest: m, model: &TensorSet{}, optim: &TensorSet{}}
	for _, e := range m.Files {
		path := filepath.Join(dir, e.Name)
		if err := checkSize(path, e); err != nil {
			c.Close()
			return nil, err
		}
		set := c.model
		switch {
		case strings.HasPrefix(e.Name, optimPrefix):
			set = c.optim
		case !strings.HasPrefix(e.Name, modelPrefix):
			continue
		}
		if !strings.HasSuffix(e.Name, tensorSuffix) && !strings.HasSuffix(e.Name, tensorSuffix+zstdSuffix) {
			continue
		}
		sf, err := openShard(path)
		if err != nil {
			c.Close()
			return nil, err
		}
		set.files = append(set.files, sf)
	}
	for _, set := range []*TensorSet{c.model, c.optim} {
		if err := set.index(); err != nil {
			c.Close()
			return nil, fmt.Errorf("checkpoint %s: %w", dir, err)
		}
	}
	return c, nil
}

// Dir is the checkpoint's directory.
func (c *Checkpoint) Dir() string { return c.dir }

// Step is the training step the checkpoint was saved at.
func (c *Checkpoint) Step() int { return c.manifest.Step }

// Manifest is the parsed MANIFEST.json; callers must not modify it.
func (c *Checkpoint) Manifest() *Manifest { return c.manifest }

// Model is the set of tensors in the model-* files.
func (c *Checkpoint) Model() *TensorSet { return c.model }

// Optim is the set of tensors in the optim-* files.
func (c *Checkpoint) Optim() *TensorSet { return c.optim }

// ReadState decodes the caller's payload of state.json into payload.
func (c *Checkpoint) ReadState(payload any) error {
	path := filepath.Join(c.dir, stateName)
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("checkpoint %s: %w", path, err)
	}
	var st state
	if err := json.Unmarshal(b, &st); err != nil {
		return fmt.Errorf("checkpoint %s: %w", path, err)
	}
	switch {
	case st.Format != formatName || st.FormatVersion < 1 || st.FormatVersion > FormatVersion:
		return fmt.Errorf("checkpoint %s: format %q version %d; this build reads %q versions 1 to %d",
			path, st.Format, st.FormatVersion, formatName, FormatVersion)
	case st.Step != c.manifest.Step:
		return fmt.Errorf("checkpoint %s: step %d, but %s says %d", path, st.Step, manifestName, c.manifest.Step)
	}
	if err := json.Unmarshal(st.Payload, payload); err != nil {
		return fmt.Errorf("checkpoint %s: payload: %w", path, err)
	}
	return nil
}

// ReadJSON decodes the extra JSON file name (written by Save.WriteJSON).
func (c *Checkpoint) ReadJSON(name string, v any) error {
	if err := checkPlainName(name); err != nil {
		return fmt.Errorf("checkpoint %s: ReadJSON: %w", c.dir, err)
	}
	path := filepath.Join(c.dir, name)
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("checkpoint %s: %w", path, err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("checkpoint %s: %w", path, err)
	}
	return nil
}

// ReadFile returns the extra file name (written by Save.WriteFile), which
// must be listed in the manifest; ok is false when the checkpoint has no
// such file. It checks the size, not the checksum (see Verify).
func (c *Checkpoint) ReadFile(name string) (data []byte, ok bool, err error) {
	if err := checkPlainName(name); err != nil {
		return nil, false, fmt.Errorf("checkpoint %s: ReadFile: %w", c.dir, err)
	}
	i := slices.IndexFunc(c.manifest.Files, func(e FileEntry) bool { return e.Name == name })
	if i < 0 {
		return nil, false, nil
	}
	path := filepath.Join(c.dir, name)
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, false, fmt.Errorf("checkpoint %s: %w", path, err)
	}
	if int64(len(b)) != c.manifest.Files[i].Size {
		return nil, false, fmt.Errorf("checkpoint %s: size mismatch (manifest %d bytes, file %d bytes)", path, c.manifest.Files[i].Size, len(b))
	}
	return b, true, nil
}

// Close releases open files and decompressed data. Reads fail afterwards.
func (c *Checkpoint) Close() error {
	var errs []error
	for _, set := range []*TensorSet{c.model, c.optim} {
		for _, f := range set.files {
			errs = append(errs, f.close())
		}
	}
	return errors.Join(errs...)
}

// TensorSet is the tensors of one kind (model or optimizer) across all the
// shard files of a checkpoint, found by name whatever file, or files, hold
// them: a checkpoint written by 4 ranks reads the same under any layout.
type TensorSet struct {
	files   []*shardFile
	tensors map[string]*tensorEntry
	names   []string
}

// tensorEntry is one logical tensor: a whole tensor in one file, or blocks
// (see Slice) spread over several.
type tensorEntry struct {
	shape  []int
	pieces []piece
}

type piece struct {
	file   *shardFile
	info   safetensors.TensorInfo
	offset []int // nil for a whole tensor
}

// Names lists the tensor names, sorted.
func (t *TensorSet) Names() []string { return slices.Clone(t.names) }

// Shape is the (global) shape of the named tensor.
func (t *TensorSet) Shape(name string) ([]int, bool) {
	e, ok := t.tensors[name]
	if !ok {
		return nil, false
	}
	return slices.Clone(e.shape), true
}

// Files lists the paths of the set's shard files.
func (t *TensorSet) Files() []string {
	paths := make([]string, len(t.files))
	for i, f := range t.files {
		paths[i] = f.path
	}
	return paths
}

// Tensor reads the named tensor as float32 (whatever dtype it is stored
// in), assembling it from its blocks when several files hold parts of it.
func (t *TensorSet) Tensor(name string) ([]float32, []int, error) {
	e, ok := t.tensors[name]
	if !ok {
		return nil, nil, fmt.Errorf("checkpoint: no tensor %q in %d files", name, len(t.files))
	}
	// Load the files first: a .zst file's header is only trusted once the
	// decompressed file has been checked against it, and the allocation
	// below relies on the header.
	for _, p := range e.pieces {
		if _, err := p.file.reader(); err != nil {
			return nil, nil, err
		}
	}
	n := 1
	for _, d := range e.shape {
		n *= d
	}
	out := make([]float32, n)
	if err := t.ReadInto(name, out); err != nil {
		return nil, nil, err
	}
	return out, slices.Clone(e.shape), nil
}

// ReadInto is Tensor into the caller's buffer (a host staging buffer, say),
// which must hold exactly the tensor's number of elements.
func (t *TensorSet) ReadInto(name string, dst []float32) error {
	e, ok := t.tensors[name]
	if !ok {
		return fmt.Errorf("checkpoint: no tensor %q in %d files", name, len(t.files))
	}
	n := 1
	for _, d := range e.shape {
		n *= d
	}
	if len(dst) != n {
		return fmt.Errorf("checkpoint: tensor %q %v: destination holds %d values, want %d", name, e.shape, len(dst), n)
	}
	if p := e.pieces[0]; p.offset == nil {
		return p.file.read(p.info, dst)
	}
	for _, p := range e.pieces {
		block := make([]float32, p.info.NumElements())
		if err := p.file.read(p.info, block); err != nil {
			return err
		}
		scatterBlock(dst, e.shape, block, p.info.Shape, p.offset)
	}
	return nil
}

// scatterBlock copies the row-major block of shape blockShape into the
// row-major dst of shape shape at offset, one innermost row at a time.
func scatterBlock(dst []float32, shape []int, block []float32, blockShape, offset []int) {
	rank := len(shape)
	if rank == 0 {
		copy(dst, block)
		return
	}
	rowLen := blockShape[rank-1]
	if len(block) == 0 {
		return
	}
	idx := make([]int, rank-1) // position within the block, outer dims
	for src := 0; src < len(block); src += rowLen {
		at := 0
		for d := range rank - 1 {
			at = at*shape[d] + offset[d] + idx[d]
		}
		at = at*shape[rank-1] + offset[rank-1]
		copy(dst[at:at+rowLen], block[src:src+rowLen])
		for d := rank - 2; d >= 0; d-- { // odometer over the outer dims
			if idx[d]++; idx[d] < blockShape[d] {
				break
			}
			idx[d] = 0
		}
	}
}

// index builds the name -> tensor map and checks that blocks tile their
// tensors: same global shape, no overlap, nothing missing.
func (t *TensorSet) index() error {
	t.tensors = map[string]*tensorEntry{}
	for _, f := range t.files {
		for _, info := range f.header.Tensors {
			offset, global, err := f.slice(info)
			if err != nil {
				return err
			}
			e := t.tensors[info.Name]
			if e == nil {
				e = &tensorEntry{shape: global}
				t.tensors[info.Name] = e
				t.names = append(t.names, info.Name)
			}
			other := e.pieces[0:min(1, len(e.pieces))]
			switch {
			case len(other) > 0 && (offset == nil || other[0].offset == nil):
				return fmt.Errorf("tensor %q is in both %s and %s (and not as blocks of one tensor)",
					info.Name, filepath.Base(other[0].file.path), filepath.Base(f.path))
			case !slices.Equal(global, e.shape):
				return fmt.Errorf("tensor %q: %s has a block of global shape %v, %s one of %v",
					info.Name, filepath.Base(f.path), global, filepath.Base(other[0].file.path), e.shape)
			}
			e.pieces = append(e.pieces, piece{file: f, info: info, offset: offset})
		}
	}
	slices.Sort(t.names)
	for _, name := range t.names {
		if err := checkTiling(name, t.tensors[name]); err != nil {
			return err
		}
	}
	return nil
}

// checkTiling checks that the blocks of a sliced tensor cover it exactly:
// pairwise disjoint and, together, as many elements as the tensor.
func checkTiling(name string, e *tensorEntry) error {
	if e.pieces[0].offset == nil {
		return nil
	}
	total := int64(1)
	for _, d := range e.shape {
		if d != 0 && total > math.MaxInt64/int64(d) {
			return fmt.Errorf("tensor %q: global shape %v is too large", name, e.shape)
		}
		total *= int64(d)
	}
	covered := int64(0)
	for i, a := range e.pieces {
		covered += a.info.NumElements()
		for _, b := range e.pieces[:i] {
			if boxesOverlap(a, b) {
				return fmt.Errorf("tensor %q: block at %v in %s overlaps block at %v in %s",
					name, a.offset, filepath.Base(a.file.path), b.offset, filepath.Base(b.file.path))
			}
		}
	}
	if covered != total {
		return fmt.Errorf("tensor %q of shape %v: blocks cover %d of %d elements (%d blocks found; a shard file missing?)",
			name, e.shape, covered, total, len(e.pieces))
	}
	return nil
}

func boxesOverlap(a, b piece) bool {
	for d := range a.offset {
		if a.info.Shape[d] == 0 || b.info.Shape[d] == 0 ||
			a.offset[d]+a.info.Shape[d] <= b.offset[d] || b.offset[d]+b.info.Shape[d] <= a.offset[d] {
			return false
		}
	}
	return true
}

// shardFile is one tensor file of a checkpoint. An uncompressed file is
// read in place; a .zst file is decompressed into memory on first read and
// kept until close, since zstd streams cannot be read at random.
type shardFile struct {
	path       string
	compressed bool
	header     *safetensors.Header

	mu     sync.Mutex // guards r and closed; held while decompressing
	r      io.ReaderAt
	file   *os.File
	closed bool
}

func openShard(path string) (*shardFile, error) {
	sf := &shardFile{path: path, compressed: strings.HasSuffix(path, zstdSuffix)}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", path, err)
	}
	if sf.compressed {
		defer f.Close()
		dec, err := zstd.NewReader(f, zstd.WithDecoderConcurrency(1))
		if err != nil {
			return nil, fmt.Errorf("checkpoint %s: %w", path, err)
		}
		defer dec.Close()
		if sf.header, err = safetensors.ReadHeader(path, dec); err != nil {
			return nil, err
		}
		return sf, nil
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("checkpoint %s: %w", path, err)
	}
	file, err := safetensors.NewFile(path, f, st.Size())
	if err != nil {
		f.Close()
		return nil, err
	}
	sf.header, sf.r, sf.file = file.Header(), f, f
	return sf, nil
}

// slice returns the block placement recorded for info, or nil offset and
// info's own shape for a whole tensor.
func (f *shardFile) slice(info safetensors.TensorInfo) (offset, global []int, err error) {
	raw, ok := f.header.Metadata[sliceMetaPrefix+info.Name]
	if !ok {
		return nil, info.Shape, nil
	}
	var sm sliceMeta
	if err := json.Unmarshal([]byte(raw), &sm); err != nil {
		return nil, nil, fmt.Errorf("%s: tensor %q: bad slice metadata %q: %w", f.path, info.Name, raw, err)
	}
	if err := checkSlice(info.Shape, Slice{Offset: sm.Offset, GlobalShape: sm.GlobalShape}); err != nil {
		return nil, nil, fmt.Errorf("%s: tensor %q: %w", f.path, info.Name, err)
	}
	if sm.Offset == nil {
		sm.Offset = []int{} // a scalar block is still a block
	}
	return sm.Offset, sm.GlobalShape, nil
}

func (f *shardFile) read(info safetensors.TensorInfo, dst []float32) error {
	r, err := f.reader()
	if err != nil {
		return err
	}
	return safetensors.ReadFloat32At(f.path, r, f.header.DataStart, info, dst)
}

// reader returns random access to the file's bytes, decompressing a .zst
// file the first time.
func (f *shardFile) reader() (io.ReaderAt, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return nil, fmt.Errorf("checkpoint %s: read after Close", f.path)
	}
	if f.r != nil {
		return f.r, nil
	}
	file, err := os.Open(f.path)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", f.path, err)
	}
	defer file.Close()
	dec, err := zstd.NewReader(file)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", f.path, err)
	}
	defer dec.Close()
	// Trust the header's size up front only when it is plausible for the
	// compressed file (tensor data compresses far less than 16x); otherwise
	// grow with the data, so a corrupt header cannot make us allocate
	// terabytes. Growing by doubling would need up to three times the
	// tensor bytes at once.
	var buf bytes.Buffer
	want := f.header.FileSize()
	if st, err := file.Stat(); err == nil && want <= 16*st.Size() {
		buf.Grow(int(want))
	} else {
		buf.Grow(int(min(want, 64<<20)))
	}
	if n, err := io.CopyN(&buf, dec, f.header.FileSize()); err != nil {
		return nil, fmt.Errorf("checkpoint %s: decompressing: %d of %d bytes: %w", f.path, n, f.header.FileSize(), err)
	}
	// Reading on to the end also checks the zstd frame checksum.
	if n, err := dec.Read(make([]byte, 1)); n > 0 || err != io.EOF {
		return nil, fmt.Errorf("checkpoint %s: decompressing: data after the last tensor (%v)", f.path, err)
	}
	// Validate the decompressed whole, as NewFile does for plain files.
	r := bytes.NewReader(buf.Bytes())
	if _, err := safetensors.NewFile(f.path, r, r.Size()); err != nil {
		return nil, err
	}
	f.r = r
	return f.r, nil
}

func (f *shardFile) close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closed, f.r = true, nil
	if f.file != nil {
		return f.file.Close()
	}
	return nil
}
