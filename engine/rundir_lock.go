package engine

// The run directory's lock: one process at a time writes a run directory.
// Two runs in one directory would interleave metrics.jsonl and replace each
// other's checkpoints, so a run takes an exclusive flock(2) on a lock file
// there for its whole life; the kernel drops it when the process ends, even
// by SIGKILL, so a crashed run leaves no stale lock to clear by hand. The
// file records the holder's pid and host for the refusal. flock locks
// belong to an open file, not to a process: two engines of one process
// that each open the lock file conflict like two processes.
//
// Each node of a multi-node run locks its own file (lockFileName), since
// the nodes may share one run directory by design: node 0 writes the
// checkpoints and metrics, node K only its train.node<K>.log.

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
)

// RunDirLock is a run directory held by this process (LockRunDir); Unlock
// lets it go.
type RunDirLock struct {
	dir string
	f   *os.File
}

// RunDirBusyError is LockRunDir's error when another run (another process,
// or another engine of this one) holds the directory.
type RunDirBusyError struct {
	Dir      string // the run directory
	LockFile string // the lock file in it
	PID      int    // the holder's process id; 0 when it has not written it yet
	Host     string // the holder's host name
}

func (e *RunDirBusyError) Error() string {
	who := "another run"
	if e.PID != 0 {
		who = fmt.Sprintf("the run of pid %d on host %s", e.PID, e.Host)
		if host, _ := os.Hostname(); e.PID == os.Getpid() && e.Host == host {
			who += " (another engine of this process)"
		}
	}
	return fmt.Sprintf("run directory %s is in use by %s (lock %s): two runs in one directory would mix their metrics and checkpoints; wait for it to end, or choose another run directory",
		e.Dir, who, e.LockFile)
}

// lockHolder is the lock file's content.
type lockHolder struct {
	PID  int    `json:"pid"`
	Host string `json:"host"`
}

// lockFileName is the lock file of node nodeRank of a run (0 for a run of
// one process): ".lock", or ".lock.node<K>" for node K > 0.
func lockFileName(nodeRank int) string {
	if nodeRank == 0 {
		return ".lock"
	}
	return fmt.Sprintf(".lock.node%d", nodeRank)
}

// LockRunDir takes run directory dir for node nodeRank of a run (0 for a
// run of one process), creating dir if needed, or fails at once with a
// *RunDirBusyError naming the holder. The lock lasts until Unlock or the
// end of the process. Run and RunDistributed take it themselves; a caller
// that writes its own files in the run directory before training (as the
// mktrain command writes recipe.yaml) takes it first and hands it to the
// engine with WithRunDirLock.
func LockRunDir(dir string, nodeRank int) (*RunDirLock, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("run directory: %w", err)
	}
	path := filepath.Join(dir, lockFileName(nodeRank))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("run directory: %w", err)
	}
	held, err := tryLockFile(f)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("run directory: locking %s: %w", path, err)
	}
	if !held {
		busy := &RunDirBusyError{Dir: dir, LockFile: path}
		var h lockHolder
		if b, err := os.ReadFile(path); err == nil && json.Unmarshal(b, &h) == nil {
			busy.PID, busy.Host = h.PID, h.Host
		}
		f.Close()
		return nil, busy
	}
	host, _ := os.Hostname()
	b, _ := json.Marshal(lockHolder{PID: os.Getpid(), Host: host})
	// The holder's name is for the refusal's message only: a failure to
	// write it leaves the lock held.
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt(append(b, '\n'), 0)
	}
	return &RunDirLock{dir: dir, f: f}, nil
}

// Dir is the run directory held.
func (l *RunDirLock) Dir() string { return l.dir }

// Unlock lets the run directory go. The lock file stays (removing it would
// let a third run lock a new file while a second holds the old one).
func (l *RunDirLock) Unlock() error {
	if l == nil || l.f == nil {
		return nil
	}
	_ = l.f.Truncate(0)
	err := l.f.Close() // closing the file drops the lock
	l.f = nil
	return err
}

// holdRunDir takes the run directory for this engine's run, unless it has
// none or its caller holds it (WithRunDirLock); release lets it go.
func (e *Engine) holdRunDir(nodeRank int) (release func(), err error) {
	if e.runDir == "" || e.runDirLock != nil {
		return func() {}, nil
	}
	l, err := LockRunDir(e.runDir, nodeRank)
	if err != nil {
		return nil, inputError(err) // another run holds it, or it cannot be made
	}
	return func() {
		if err := l.Unlock(); err != nil {
			e.log.Warn().Err(err).Msg("releasing the run directory's lock")
		}
	}, nil
}
