package tune

// The dispatch table on disk: dispatch.json in $MKTRAIN_CACHE_DIR when that
// is set, else in os.UserCacheDir()/mktrain. Deleting it makes the next
// run measure again.

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

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
	return readTable[DispatchEntry](c.Path, "moe: dispatch table", dispatchTableVersion)
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
	err := storeEntry(c.Path, "moe: dispatch table", dispatchTableVersion, e,
		func(o DispatchEntry) bool { return o.DispatchKey == k },
		func(a, b DispatchEntry) int { return a.DispatchKey.compare(b.DispatchKey) })
	if err != nil {
		return e, err
	}
	return e, nil
}
