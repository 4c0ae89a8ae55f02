package atomicfile

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// leftovers lists the temporary names left in dir.
func leftovers(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var tmp []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), TempPrefix) {
			tmp = append(tmp, e.Name())
		}
	}
	return tmp
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestWriteFileReplaces(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "latest")
	for _, want := range []string{"one\n", "two\n"} {
		if err := WriteFile(path, func(w io.Writer) error {
			_, err := io.WriteString(w, want)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if got := readFile(t, path); got != want {
			t.Fatalf("content %q, want %q", got, want)
		}
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != filePerm {
		t.Errorf("mode %v, want %v", st.Mode().Perm(), filePerm)
	}
	if tmp := leftovers(t, dir); len(tmp) != 0 {
		t.Errorf("temporary files left: %v", tmp)
	}
}

func TestWriteFileFailureKeepsOld(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "table.json")
	if err := os.WriteFile(path, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("boom")
	err := WriteFile(path, func(w io.Writer) error {
		io.WriteString(w, strings.Repeat("x", 3<<20)) // past the buffer: reaches the file
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("error %v, want %v", err, boom)
	}
	if got := readFile(t, path); got != "old" {
		t.Fatalf("a failed write changed the file to %d bytes", len(got))
	}
	if tmp := leftovers(t, dir); len(tmp) != 0 {
		t.Errorf("temporary files left: %v", tmp)
	}
}

func TestWriteFileMissingDir(t *testing.T) {
	err := WriteFile(filepath.Join(t.TempDir(), "no", "such"), func(io.Writer) error { return nil })
	if err == nil {
		t.Fatal("writing into a missing directory succeeded")
	}
}

func TestFileCommitAndAbort(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "shard.bin")

	f, err := Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write([]byte("....body")); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("head"), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the file is visible before Commit (%v)", err)
	}
	if err := f.Commit(); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, path); got != "headbody" {
		t.Fatalf("content %q", got)
	}
	if err := f.Commit(); err == nil {
		t.Error("a second Commit succeeded")
	}
	if err := f.Abort(); err != nil {
		t.Errorf("Abort after Commit: %v", err)
	}
	if got := readFile(t, path); got != "headbody" {
		t.Fatalf("Abort after Commit changed the file: %q", got)
	}

	g, err := Create(path)
	if err != nil {
		t.Fatal(err)
	}
	g.Write([]byte("other"))
	if err := g.Abort(); err != nil {
		t.Fatal(err)
	}
	if err := g.Commit(); err == nil {
		t.Error("Commit after Abort succeeded")
	}
	if got := readFile(t, path); got != "headbody" {
		t.Fatalf("an aborted file replaced the committed one: %q", got)
	}
	if tmp := leftovers(t, dir); len(tmp) != 0 {
		t.Errorf("temporary files left: %v", tmp)
	}
}

func TestWriteSyncedRefusesExisting(t *testing.T) {
	path := filepath.Join(t.TempDir(), "config.json")
	write := func(w io.Writer) error { _, err := io.WriteString(w, "{}"); return err }
	if err := WriteSynced(path, write); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, path); got != "{}" {
		t.Fatalf("content %q", got)
	}
	if err := WriteSynced(path, write); !errors.Is(err, os.ErrExist) {
		t.Fatalf("writing over an existing file: %v, want ErrExist", err)
	}
}

func TestWriteDir(t *testing.T) {
	parent := t.TempDir()
	fill := func(tmp string) error {
		return WriteSynced(filepath.Join(tmp, "a"), func(w io.Writer) error {
			_, err := io.WriteString(w, "A")
			return err
		})
	}

	// A new directory, in a parent that does not exist yet.
	out := filepath.Join(parent, "sub", "export")
	if err := WriteDir(out, fill); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(out, "a")); got != "A" {
		t.Fatalf("content %q", got)
	}
	st, err := os.Stat(out)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o755 {
		t.Fatalf("directory mode %v, want 0755", st.Mode().Perm())
	}

	// A non-empty directory is refused and left alone.
	if err := WriteDir(out, fill); err == nil || !strings.Contains(err.Error(), "not empty") {
		t.Fatalf("writing over a non-empty directory: %v", err)
	}

	// An empty directory is replaced.
	empty := filepath.Join(parent, "empty")
	if err := os.Mkdir(empty, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := WriteDir(empty, fill); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(empty, "a")); got != "A" {
		t.Fatalf("content %q", got)
	}

	// A file in the way is refused.
	file := filepath.Join(parent, "file")
	os.WriteFile(file, nil, 0o644)
	if err := WriteDir(file, fill); err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Fatalf("writing over a file: %v", err)
	}

	// A failing fill leaves nothing, not even its temporary directory.
	boom := errors.New("boom")
	failed := filepath.Join(parent, "failed")
	if err := WriteDir(failed, func(tmp string) error { fill(tmp); return boom }); !errors.Is(err, boom) {
		t.Fatalf("error %v, want %v", err, boom)
	}
	if _, err := os.Stat(failed); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a failed WriteDir left %s (%v)", failed, err)
	}
	if tmp := leftovers(t, parent); len(tmp) != 0 {
		t.Errorf("temporary directories left: %v", tmp)
	}
}

func TestSyncDir(t *testing.T) {
	if err := SyncDir(t.TempDir()); err != nil {
		t.Fatal(err)
	}
	if err := SyncDir(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Fatal("syncing a missing directory succeeded")
	}
}

// syncRecorder stands in for SyncDir: it records the directories fsynced
// and fails those listed in fail.
type syncRecorder struct {
	synced []string
	fail   map[string]bool
}

var errSync = errors.New("fsync refused")

func (r *syncRecorder) sync(dir string) error {
	r.synced = append(r.synced, dir)
	if r.fail[dir] {
		return errSync
	}
	return SyncDir(dir)
}

func TestCommitSyncsTheDirectory(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "latest")
	rec := &syncRecorder{}
	if err := writeFile(path, func(w io.Writer) error {
		_, err := io.WriteString(w, "new")
		return err
	}, rec.sync); err != nil {
		t.Fatal(err)
	}
	if len(rec.synced) != 1 || rec.synced[0] != dir {
		t.Fatalf("directories fsynced %v, want [%s]", rec.synced, dir)
	}
}

// A directory fsync that fails after the rename is an error, though the
// new content is in place: the caller must not believe it durable.
func TestCommitReportsFailedDirectorySync(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "train_000000.bin")
	rec := &syncRecorder{fail: map[string]bool{dir: true}}
	f, err := create(path, rec.sync)
	if err != nil {
		t.Fatal(err)
	}
	f.Write([]byte("shard"))
	if err := f.Commit(); !errors.Is(err, errSync) {
		t.Fatalf("Commit with a failing directory fsync: %v, want %v", err, errSync)
	}
	if got := readFile(t, path); got != "shard" {
		t.Fatalf("content %q after the rename", got)
	}
	if tmp := leftovers(t, dir); len(tmp) != 0 {
		t.Errorf("temporary files left: %v", tmp)
	}
}

func TestWriteDirSyncs(t *testing.T) {
	parent := t.TempDir()
	out := filepath.Join(parent, "export")
	var tmpDir string
	fill := func(tmp string) error {
		tmpDir = tmp
		return WriteSynced(filepath.Join(tmp, "a"), func(w io.Writer) error {
			_, err := io.WriteString(w, "A")
			return err
		})
	}
	rec := &syncRecorder{}
	if err := writeDir(out, fill, rec.sync); err != nil {
		t.Fatal(err)
	}
	// The new directory before the rename (its entries), the parent after.
	if want := []string{tmpDir, parent}; len(rec.synced) != 2 || rec.synced[0] != want[0] || rec.synced[1] != want[1] {
		t.Fatalf("directories fsynced %v, want %v", rec.synced, want)
	}

	// A failing fsync of the new directory stops before the rename.
	failed := filepath.Join(parent, "failed")
	rec = &syncRecorder{fail: map[string]bool{}}
	err := writeDir(failed, func(tmp string) error {
		rec.fail[tmp] = true
		return fill(tmp)
	}, rec.sync)
	if !errors.Is(err, errSync) {
		t.Fatalf("WriteDir with a failing fsync: %v, want %v", err, errSync)
	}
	if _, err := os.Stat(failed); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("an unsynced directory was renamed into place (%v)", err)
	}
	if tmp := leftovers(t, parent); len(tmp) != 0 {
		t.Errorf("temporary directories left: %v", tmp)
	}

	// A failing fsync of the parent is reported after the rename.
	late := filepath.Join(parent, "late")
	rec = &syncRecorder{fail: map[string]bool{parent: true}}
	if err := writeDir(late, fill, rec.sync); !errors.Is(err, errSync) {
		t.Fatalf("WriteDir with a failing parent fsync: %v, want %v", err, errSync)
	}
	if got := readFile(t, filepath.Join(late, "a")); got != "A" {
		t.Fatalf("content %q", got)
	}
}
