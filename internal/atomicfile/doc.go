// Package atomicfile writes files and directories so that a reader, or a
// process started after a crash, sees either the complete new content or
// what was there before, never a part.
//
// Pick the call by the shape of the write. WriteFile replaces a file whose
// content one function writes:
//
//	err := atomicfile.WriteFile("runs/x/latest", func(w io.Writer) error {
//		_, err := io.WriteString(w, "step_00000100\n")
//		return err
//	})
//
// Create starts a file streamed in pieces, possibly patched with WriteAt
// (a header whose count is known only at the end); Commit moves it into
// place, Abort drops it:
//
//	f, err := atomicfile.Create("data/train_000000.bin")
//	if err != nil {
//		return err
//	}
//	defer f.Abort() // a no-op after Commit
//	bw := bufio.NewWriter(f)
//	// ... write through bw ...
//	if err := bw.Flush(); err != nil {
//		return err
//	}
//	return f.Commit()
//
// WriteDir makes a directory appear whole: fill writes the files into a
// temporary directory beside it, each with WriteSynced, and WriteDir
// renames it into place. SyncDir fsyncs a directory, for callers that
// rename by hand (a checkpoint moves an existing step directory aside
// before renaming its new one in).
//
// # Guarantees
//
// Every temporary name begins with TempPrefix and sits in the directory of
// its final path, so that the rename is atomic and a leftover from a crash
// is easy to find and remove (checkpoint.Prune removes them). File data is
// fsynced before the rename and the directory after it. A file system that
// cannot fsync a directory at all (some network and FUSE mounts answer
// EINVAL or ENOTSUP) is tolerated; any other error is returned.
//
// On an error before the rename the target is as it was and no temporary
// name is left. The one error after the rename is a failed fsync of the
// directory: the new content is then in place, but a crash could still
// undo the rename, so the write is reported as failed and the caller
// decides whether to remove it.
package atomicfile
