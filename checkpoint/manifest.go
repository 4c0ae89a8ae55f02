package checkpoint

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"sync"
)

// Manifest is the content of MANIFEST.json: every other file of the
// checkpoint with its size and SHA-256.
type Manifest struct {
	Format        string      `json:"format"` // always "mktrain-checkpoint"
	FormatVersion int         `json:"format_version"`
	Step          int         `json:"step"`
	Files         []FileEntry `json:"files"` // sorted by name
}

// FileEntry describes one file of a checkpoint.
type FileEntry struct {
	Name   string `json:"name"` // relative to the step directory
	Size   int64  `json:"size"` // bytes on disk (compressed, for .zst)
	SHA256 string `json:"sha256"`
}

// ReadManifest reads and validates dir's MANIFEST.json.
func ReadManifest(dir string) (*Manifest, error) {
	path := filepath.Join(dir, manifestName)
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("checkpoint %s: %w", dir, ErrNoManifest)
	}
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w (incomplete or not a checkpoint)", path, err)
	}
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", path, err)
	}
	switch {
	case m.Format != formatName:
		return nil, fmt.Errorf("checkpoint %s: format is %q, want %q", path, m.Format, formatName)
	case m.FormatVersion < 1 || m.FormatVersion > FormatVersion:
		return nil, fmt.Errorf("checkpoint %s: format version %d; this build reads versions 1 to %d",
			path, m.FormatVersion, FormatVersion)
	}
	seen := map[string]bool{}
	for _, f := range m.Files {
		if err := checkPlainName(f.Name); err != nil || f.Name == manifestName || seen[f.Name] {
			return nil, fmt.Errorf("checkpoint %s: bad or repeated file name %q", path, f.Name)
		}
		if _, err := hex.DecodeString(f.SHA256); err != nil || len(f.SHA256) != 2*sha256.Size || f.Size < 0 {
			return nil, fmt.Errorf("checkpoint %s: file %q: bad size or sha256", path, f.Name)
		}
		seen[f.Name] = true
	}
	return &m, nil
}

// checkPlainName accepts a file name that stays inside its directory.
func checkPlainName(name string) error {
	if name == "" || name == "." || name == ".." || filepath.Base(name) != name || filepath.IsAbs(name) {
		return fmt.Errorf("%q is not a plain file name", name)
	}
	return nil
}

// Verify checks every file the manifest of dir lists: that it exists, has
// the recorded size and the recorded SHA-256. Files are hashed in parallel.
// The error names each bad file, e.g.
//
//	checkpoint runs/x/step_00000100/model-rank00000.safetensors: checksum mismatch (manifest sha256 ab12..., file cd34...)
func Verify(dir string) error { return VerifyContext(context.Background(), dir) }

// VerifyContext is Verify that stops hashing when ctx ends (between two
// blocks of a file) and then returns an error wrapping ctx's cause.
func VerifyContext(ctx context.Context, dir string) error {
	m, err := ReadManifest(dir)
	if err != nil {
		return err
	}
	errs := make([]error, len(m.Files))
	work := make(chan int)
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), len(m.Files)) {
		wg.Go(func() {
			for i := range work {
				errs[i] = verifyFile(ctx, dir, m.Files[i])
			}
		})
	}
	for i := range m.Files {
		work <- i
	}
	close(work)
	wg.Wait()
	if ctx.Err() != nil {
		return fmt.Errorf("checkpoint %s: verification stopped: %w", dir, context.Cause(ctx))
	}
	return errors.Join(errs...)
}

func verifyFile(ctx context.Context, dir string, e FileEntry) error {
	path := filepath.Join(dir, e.Name)
	if err := checkSize(path, e); err != nil {
		return err
	}
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("checkpoint %s: %w", path, err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, contextReader{ctx, f}); err != nil {
		return fmt.Errorf("checkpoint %s: %w", path, err)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != e.SHA256 {
		return fmt.Errorf("checkpoint %s: checksum mismatch (manifest sha256 %s..., file %s...)",
			path, e.SHA256[:16], got[:16])
	}
	return nil
}

// contextReader reads r until ctx ends.
type contextReader struct {
	ctx context.Context
	r   io.Reader
}

func (c contextReader) Read(p []byte) (int, error) {
	if c.ctx.Err() != nil {
		return 0, context.Cause(c.ctx)
	}
	return c.r.Read(p)
}

// checkSize is the cheap part of Verify: the file exists with its size.
func checkSize(path string, e FileEntry) error {
	st, err := os.Stat(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("checkpoint %s: missing (listed in %s)", path, manifestName)
	case err != nil:
		return fmt.Errorf("checkpoint %s: %w", path, err)
	case !st.Mode().IsRegular():
		return fmt.Errorf("checkpoint %s: not a regular file", path)
	case st.Size() != e.Size:
		return fmt.Errorf("checkpoint %s: size mismatch (manifest %d bytes, file %d bytes)", path, e.Size, st.Size())
	}
	return nil
}

// checkSizes runs checkSize on every file of dir's manifest.
func checkSizes(dir string) error {
	m, err := ReadManifest(dir)
	if err != nil {
		return err
	}
	for _, e := range m.Files {
		if err := checkSize(filepath.Join(dir, e.Name), e); err != nil {
			return err
		}
	}
	return nil
}
