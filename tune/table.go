package tune

// The dispatch table on disk: dispatch.json in $MKTRAIN_CACHE_DIR when that
// is set, else in os.UserCacheDir()/mktrain. Deleting it makes the next
// run measure again.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/mktrain/mktrain/internal/atomicfile"
	"github.com/mktrain/mktrain/moe"
)

// DispatchEntry is one row of the dispatch table: a key, the dispatcher
// chosen for it and the times it was chosen on (milliseconds per step).
type DispatchEntry struct {
	DispatchKey
	Choice           string    `json:"choice"`
	FusedMS          float64   `json:"fused_forward_backward_ms"`
	UnfusedMS        float64   `json:"unfused_forward_backward_ms"`
	FusedForwardMS   float64   `json:"fused_forward_ms"`
	UnfusedForwardMS float64   `json:"unfused_forward_ms"`
	Iters            int       `json:"iters"`
	MeasuredAt       time.Time `json:"measured_at"`
}

// dispatchTable is the file's content.
type dispatchTable struct {
	Version int             `json:"version"`
	Entries []DispatchEntry `json:"entries"`
}

// dispatchTableVersion is the file format; a file of another version is
// ignored (and replaced by the next Store).
const dispatchTableVersion = 3

// DispatchCache is the dispatch table file at Path.
type DispatchCache struct{ Path string }

// DefaultDispatchCache is the table of this user: dispatch.json in
// $MKTRAIN_CACHE_DIR when it is set, else in os.UserCacheDir()/mktrain.
func DefaultDispatchCache() (DispatchCache, error) {
	dir := os.Getenv("MKTRAIN_CACHE_DIR")
	if dir == "" {
		base, err := os.UserCacheDir()
		if err != nil {
			return DispatchCache{}, fmt.Errorf("moe: no cache directory for the dispatch table (set MKTRAIN_CACHE_DIR): %w", err)
		}
		dir = filepath.Join(base, "mktrain")
	}
	return DispatchCache{Path: filepath.Join(dir, "dispatch.json")}, nil
}

// read returns the table's entries: none when the file does not exist or
// is of another version.
func (c DispatchCache) read() ([]DispatchEntry, error) {
	buf, err := os.ReadFile(c.Path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("moe: dispatch table: %w", err)
	}
	var t dispatchTable
	if err := json.Unmarshal(buf, &t); err != nil {
		return nil, fmt.Errorf("moe: dispatch table %s: %w", c.Path, err)
	}
	if t.Version != dispatchTableVersion {
		return nil, nil
	}
	return t.Entries, nil
}

// Lookup returns the entry for k, and whether there is one.
func (c DispatchCache) Lookup(k DispatchKey) (DispatchEntry, bool, error) {
	entries, err := c.read()
	if err != nil {
		return DispatchEntry{}, false, err
	}
	for _, e := range entries {
		if e.DispatchKey == k && (e.Choice == moe.DispatcherFused || e.Choice == moe.DispatcherUnfused) {
			return e, true, nil
		}
	}
	return DispatchEntry{}, false, nil
}

// Store records t's choice for k, replacing any entry for k, and returns
// the entry. The file is replaced whole (internal/atomicfile: a temporary
// file renamed over it), its directory made when missing, so a reader
// never sees half of it; of two processes storing at
// once, the last one's table wins. A file that cannot be parsed is
// replaced.
func (c DispatchCache) Store(k DispatchKey, t moe.Timing) (DispatchEntry, error) {
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	e := DispatchEntry{
		DispatchKey: k, Choice: t.Faster(),
		FusedMS: ms(t.FusedStep), UnfusedMS: ms(t.UnfusedStep),
		FusedForwardMS: ms(t.FusedForward), UnfusedForwardMS: ms(t.UnfusedForward),
		Iters: t.Iters, MeasuredAt: time.Now().UTC().Truncate(time.Second),
	}
	entries, _ := c.read() // an unreadable table is replaced
	entries = slices.DeleteFunc(entries, func(o DispatchEntry) bool { return o.DispatchKey == k })
	entries = append(entries, e)
	slices.SortFunc(entries, func(a, b DispatchEntry) int { return a.DispatchKey.compare(b.DispatchKey) })
	buf, err := json.MarshalIndent(dispatchTable{Version: dispatchTableVersion, Entries: entries}, "", "  ")
	if err != nil {
		return e, err
	}
	buf = append(buf, '\n')
	err = os.MkdirAll(filepath.Dir(c.Path), 0o755)
	if err == nil {
		err = atomicfile.WriteFile(c.Path, func(w io.Writer) error {
			_, err := w.Write(buf)
			return err
		})
	}
	if err != nil {
		return e, fmt.Errorf("moe: dispatch table: %w", err)
	}
	return e, nil
}
