package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/mktrain/mktrain/internal/atomicfile"
)

// FormatVersion is the version of the on-disk format this package writes.
// It reads this version and older ones.
const FormatVersion = 1

// formatName identifies a checkpoint's MANIFEST.json and state.json.
const formatName = "mktrain-checkpoint"

// Reserved names inside a checkpoint root and a step directory.
const (
	manifestName = "MANIFEST.json"
	stateName    = "state.json"
	latestName   = "latest"
	tmpPrefix    = atomicfile.TempPrefix // also what the latest pointer's temporary file starts with
	stepPrefix   = "step_"
	modelPrefix  = "model-"
	optimPrefix  = "optim-"
	tensorSuffix = ".safetensors"
	zstdSuffix   = ".zst"
)

// ErrNoCheckpoint is returned (wrapped) by Latest and FindResumable when a
// root holds no complete checkpoint at all.
var ErrNoCheckpoint = errors.New("no checkpoint")

// StepDirName is the name of step's directory: "step_00000100".
func StepDirName(step int) string { return fmt.Sprintf("%s%08d", stepPrefix, step) }

// parseStepDirName is the inverse of StepDirName; it rejects any other
// spelling of the number so that a name maps to exactly one step.
func parseStepDirName(name string) (int, bool) {
	digits, ok := strings.CutPrefix(name, stepPrefix)
	if !ok {
		return 0, false
	}
	step, err := strconv.Atoi(digits)
	if err != nil || step < 0 || StepDirName(step) != name {
		return 0, false
	}
	return step, true
}

// ModelFile is the conventional name of rank's model shard file.
func ModelFile(rank int) string { return fmt.Sprintf("%srank%05d%s", modelPrefix, rank, tensorSuffix) }

// OptimFile is the conventional name of rank's optimizer shard file.
func OptimFile(rank int) string { return fmt.Sprintf("%srank%05d%s", optimPrefix, rank, tensorSuffix) }

// Info describes one complete checkpoint.
type Info struct {
	Step int
	Dir  string // <root>/step_%08d
}

// List returns root's complete checkpoints, newest (highest step) first.
// A step directory is complete once it holds MANIFEST.json, which Commit
// writes before the rename that makes the directory appear. A missing root
// holds no checkpoints. List does not read the files; see Verify.
func List(root string) ([]Info, error) { return listSteps(root, true) }

// ListIncomplete returns the step directories under root that lack
// MANIFEST.json, newest first. A save never leaves one (Commit renames a
// directory that already holds its manifest), so each is damage: a manifest
// deleted, or a copy cut short. List leaves them out; FindResumable and
// mktrain ckpt verify report them. A missing root holds none.
func ListIncomplete(root string) ([]Info, error) { return listSteps(root, false) }

// listSteps returns root's step directories whose completeness (a
// MANIFEST.json in it) is complete, newest first.
func listSteps(root string, complete bool) ([]Info, error) {
	entries, err := os.ReadDir(root)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("checkpoint: listing %s: %w", root, err)
	}
	var infos []Info
	for _, e := range entries {
		step, ok := parseStepDirName(e.Name())
		if !ok || !e.IsDir() {
			continue
		}
		dir := filepath.Join(root, e.Name())
		if isComplete(dir) == complete {
			infos = append(infos, Info{Step: step, Dir: dir})
		}
	}
	sort.Slice(infos, func(i, j int) bool { return infos[i].Step > infos[j].Step })
	return infos, nil
}

// IsStepDir reports whether dir's name is a step directory's
// (StepDirName): one checkpoint, whether or not it is complete.
func IsStepDir(dir string) bool {
	_, ok := parseStepDirName(filepath.Base(filepath.Clean(dir)))
	return ok
}

// ErrNoManifest is returned (wrapped) for a step directory without
// MANIFEST.json.
var ErrNoManifest = errors.New("no " + manifestName + ": the checkpoint is incomplete or damaged (a save writes the manifest before the step directory appears)")

func isComplete(dir string) bool {
	st, err := os.Stat(filepath.Join(dir, manifestName))
	return err == nil && st.Mode().IsRegular()
}

// Latest returns the directory the root's `latest` pointer names, or, when
// the pointer is missing or names no complete checkpoint, the newest
// complete one. It reads no tensor data; FindResumable also verifies
// checksums.
func Latest(root string) (string, error) {
	if dir, ok := readPointer(root); ok {
		return dir, nil
	}
	infos, err := List(root)
	if err != nil {
		return "", err
	}
	if len(infos) == 0 {
		return "", fmt.Errorf("checkpoint: %s: %w", root, ErrNoCheckpoint)
	}
	return infos[0].Dir, nil
}

// readPointer returns the complete step directory that root/latest names.
func readPointer(root string) (string, bool) {
	b, err := os.ReadFile(filepath.Join(root, latestName))
	if err != nil {
		return "", false
	}
	name := strings.TrimSpace(string(b))
	if _, ok := parseStepDirName(name); !ok { // also keeps the pointer inside root
		return "", false
	}
	dir := filepath.Join(root, name)
	return dir, isComplete(dir)
}

// FindResumable returns the newest checkpoint under root that passes
// Verify, calling warn (when not nil) for each newer one it skips and why.
// It returns an error wrapping ErrNoCheckpoint when root has no complete
// checkpoint, and a different error when it has some but none verifies:
// a run should not silently start over from scratch then.
func FindResumable(root string, warn func(string)) (string, error) {
	return FindResumableContext(context.Background(), root, warn)
}

// FindResumableContext is FindResumable that stops hashing when ctx ends
// (VerifyContext), returning an error wrapping ctx's cause: rehashing a large checkpoint
// takes seconds, and a Ctrl-C then must not wait for it.
func FindResumableContext(ctx context.Context, root string, warn func(string)) (string, error) {
	infos, err := List(root)
	if err != nil {
		return "", err
	}
	// A step directory without a manifest is a damaged checkpoint, not
	// an absent one: it is skipped with a warning like a corrupt one, and
	// a root that holds only such directories is an error, not a fresh
	// start.
	incomplete, err := ListIncomplete(root)
	if err != nil {
		return "", err
	}
	infos = append(infos, incomplete...)
	sort.SliceStable(infos, func(i, j int) bool { return infos[i].Step > infos[j].Step })
	if len(infos) == 0 {
		return "", fmt.Errorf("checkpoint: %s: %w", root, ErrNoCheckpoint)
	}
	var errs []error
	for _, info := range infos {
		err := VerifyContext(ctx, info.Dir)
		if err == nil {
			return info.Dir, nil
		}
		if ctx.Err() != nil {
			return "", err // verification stopped: not a verdict on the checkpoint
		}
		errs = append(errs, err)
		if warn != nil {
			warn(fmt.Sprintf("skipping corrupt checkpoint %s: %v", info.Dir, err))
		}
	}
	return "", fmt.Errorf("checkpoint: %s: none of the %d checkpoints verifies: %w", root, len(infos), errors.Join(errs...))
}

// Prune deletes complete checkpoints under root beyond the keepLast newest
// (keepLast <= 0 keeps them all), and every leftover temporary entry
// (.tmp-*) of an abandoned save. It never deletes the checkpoint `latest`
// names, nor the newest one whose files all have their manifest sizes, so
// a corrupt newest checkpoint cannot cost the last usable one.
//
// Prune must not run while a Save under root is in flight: it would delete
// that save's temporary directory. The engine prunes right after Commit.
func Prune(root string, keepLast int) error {
	infos, err := List(root)
	if err != nil {
		return err
	}
	keep := map[string]bool{}
	for i, info := range infos {
		if keepLast <= 0 || i < keepLast {
			keep[info.Dir] = true
		}
	}
	if dir, ok := readPointer(root); ok {
		keep[dir] = true
	}
	for _, info := range infos {
		if checkSizes(info.Dir) == nil {
			keep[info.Dir] = true
			break
		}
	}
	var errs []error
	for i := len(infos) - 1; i >= 0; i-- { // oldest first
		if !keep[infos[i].Dir] {
			errs = append(errs, removeAll(infos[i].Dir))
		}
	}
	entries, err := os.ReadDir(root)
	if err != nil {
		return errors.Join(append(errs, fmt.Errorf("checkpoint: listing %s: %w", root, err))...)
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), tmpPrefix) {
			errs = append(errs, removeAll(filepath.Join(root, e.Name())))
		}
	}
	return errors.Join(errs...)
}

func removeAll(path string) error {
	if err := os.RemoveAll(path); err != nil {
		return fmt.Errorf("checkpoint: removing %s: %w", path, err)
	}
	return nil
}
