package tune

// The file under every table of this package: a version and a list of
// entries in JSON, read whole and replaced whole.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"

	"github.com/mktrain/mktrain/internal/atomicfile"
)

// tableFile is a table's JSON: its format version and its entries.
type tableFile[E any] struct {
	Version int `json:"version"`
	Entries []E `json:"entries"`
}

// readTable returns the entries of the table at path: none when the file
// does not exist or is of another version than version. what names the
// table in errors ("moe: dispatch table").
func readTable[E any](path, what string, version int) ([]E, error) {
	buf, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	var t tableFile[E]
	if err := json.Unmarshal(buf, &t); err != nil {
		return nil, fmt.Errorf("%s %s: %w", what, path, err)
	}
	if t.Version != version {
		return nil, nil
	}
	return t.Entries, nil
}

// storeEntry puts e into the table at path in place of every entry same
// says it replaces, in the order cmp gives, and writes the table: the file
// replaced whole (internal/atomicfile: a temporary file renamed over it),
// its directory made when missing, so a reader never sees half of it; of
// two processes storing at once, the last one's table wins. A file that
// cannot be read or parsed is replaced.
func storeEntry[E any](path, what string, version int, e E, same func(E) bool, cmp func(a, b E) int) error {
	entries, _ := readTable[E](path, what, version) // an unreadable table is replaced
	entries = slices.DeleteFunc(entries, same)
	entries = append(entries, e)
	slices.SortFunc(entries, cmp)
	buf, err := json.MarshalIndent(tableFile[E]{Version: version, Entries: entries}, "", "  ")
	if err != nil {
		return err
	}
	buf = append(buf, '\n')
	err = os.MkdirAll(filepath.Dir(path), 0o755)
	if err == nil {
		err = atomicfile.WriteFile(path, func(w io.Writer) error {
			_, err := w.Write(buf)
			return err
		})
	}
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	return nil
}
