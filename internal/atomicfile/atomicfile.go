package atomicfile

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// TempPrefix begins the name of every temporary file and directory the
// package makes.
const TempPrefix = ".tmp-"

// filePerm is the mode of the files the package commits (os.CreateTemp
// makes 0600 files; the final files are ordinary ones).
const filePerm fs.FileMode = 0o644

// bufferBytes is the write buffer of WriteFile and WriteSynced.
const bufferBytes = 1 << 20

// SyncDir fsyncs the directory dir, so that the entries created, renamed
// or removed in it survive a crash. It returns every error except the
// answer of a file system that cannot fsync directories at all (EINVAL,
// ENOTSUP), where there is nothing more to do.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOTSUP) {
		return fmt.Errorf("fsync %s: %w", dir, err)
	}
	return nil
}

// A File is a file being written under a temporary name beside its final
// path. Commit moves it into place; Abort, or a failed Commit, removes it.
// Writes go straight to the file: wrap it in a bufio.Writer for small ones
// and flush before Commit.
type File struct {
	path    string
	tmp     *os.File
	done    bool
	syncDir func(dir string) error // SyncDir; tests observe or fail it
}

// Create starts the file that Commit will place at path. path's directory
// must exist.
func Create(path string) (*File, error) { return create(path, SyncDir) }

func create(path string, syncDir func(string) error) (*File, error) {
	tmp, err := os.CreateTemp(filepath.Dir(path), TempPrefix+filepath.Base(path)+"-*")
	if err != nil {
		return nil, err
	}
	return &File{path: path, tmp: tmp, syncDir: syncDir}, nil
}

// Write appends p.
func (f *File) Write(p []byte) (int, error) { return f.tmp.Write(p) }

// WriteAt writes p at offset off (a header patched once the length is
// known, say).
func (f *File) WriteAt(p []byte, off int64) (int, error) { return f.tmp.WriteAt(p, off) }

// Commit fsyncs the file, renames it over path and fsyncs the directory.
// On an error the temporary file is removed and path is as it was, except
// when only the directory's fsync failed: then path holds the new content,
// but a crash may still undo the rename. A second Commit, or a Commit
// after Abort, is an error.
func (f *File) Commit() error {
	if f.done {
		return fmt.Errorf("%s: Commit after Commit or Abort", f.path)
	}
	f.done = true
	err := f.tmp.Chmod(filePerm)
	if err == nil {
		err = f.tmp.Sync()
	}
	if cerr := f.tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.tmp.Name(), f.path)
	}
	if err != nil {
		os.Remove(f.tmp.Name())
		return err
	}
	return f.syncDir(filepath.Dir(f.path))
}

// Abort drops the file; path is untouched. After Commit it does nothing,
// so it suits a defer.
func (f *File) Abort() error {
	if f.done {
		return nil
	}
	f.done = true
	f.tmp.Close()
	return os.Remove(f.tmp.Name())
}

// WriteFile replaces path with what write writes (through a buffer), or
// leaves it as it was when write or any step fails. path's directory must
// exist.
func WriteFile(path string, write func(w io.Writer) error) error {
	return writeFile(path, write, SyncDir)
}

func writeFile(path string, write func(w io.Writer) error, syncDir func(string) error) error {
	f, err := create(path, syncDir)
	if err != nil {
		return err
	}
	bw := bufio.NewWriterSize(f, bufferBytes)
	err = write(bw)
	if err == nil {
		err = bw.Flush()
	}
	if err != nil {
		f.Abort()
		return err
	}
	return f.Commit()
}

// WriteSynced creates path, which must not exist, lets write fill it
// through a buffer, and fsyncs and closes it. It is for the files inside a
// directory that becomes visible as a whole (WriteDir's fill, a
// checkpoint's temporary directory): the file itself is not renamed, and a
// failure leaves it behind for the directory's cleanup.
func WriteSynced(path string, write func(w io.Writer) error) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, filePerm)
	if err != nil {
		return err
	}
	defer f.Close() // after the explicit Close below, a harmless no-op
	bw := bufio.NewWriterSize(f, bufferBytes)
	if err := write(bw); err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	return f.Close()
}

// WriteDir makes dir appear complete or not at all: fill writes the
// directory's content into tmp, a new directory beside dir, which is then
// fsynced and renamed to dir, and dir's parent fsynced. dir may exist only
// as an empty directory (it is replaced); the parent is created when
// missing. On an error tmp is removed, and dir is as it was unless only
// the parent's fsync failed. fill should write its files with WriteSynced,
// so that their data is on disk before the rename.
func WriteDir(dir string, fill func(tmp string) error) error {
	return writeDir(dir, fill, SyncDir)
}

func writeDir(dir string, fill func(tmp string) error, syncDir func(string) error) (err error) {
	dir = filepath.Clean(dir)
	replaceEmpty := false
	switch st, statErr := os.Stat(dir); {
	case statErr == nil && !st.IsDir():
		return fmt.Errorf("%s exists and is not a directory", dir)
	case statErr == nil:
		entries, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		if len(entries) > 0 {
			return fmt.Errorf("%s already exists and is not empty; choose a new directory", dir)
		}
		replaceEmpty = true
	case !errors.Is(statErr, fs.ErrNotExist):
		return statErr
	}
	parent := filepath.Dir(dir)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return err
	}
	tmp, err := os.MkdirTemp(parent, TempPrefix+filepath.Base(dir)+"-")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			os.RemoveAll(tmp)
		}
	}()
	if err := fill(tmp); err != nil {
		return err
	}
	if err := os.Chmod(tmp, 0o755); err != nil { // MkdirTemp makes 0700 directories
		return err
	}
	if err := syncDir(tmp); err != nil {
		return err
	}
	if replaceEmpty {
		if err := os.Remove(dir); err != nil {
			return err
		}
	}
	if err := os.Rename(tmp, dir); err != nil {
		return err
	}
	return syncDir(parent)
}
