package checkpoint

import (
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A step directory without MANIFEST.json is damage, never made by a save:
// ListIncomplete names it, Verify fails on it saying so, and FindResumable
// skips it with a warning, or fails (not ErrNoCheckpoint, which would start
// the run over) when nothing else is there.
func TestStepDirWithoutManifestIsReported(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(7, 1))
	root := t.TempDir()
	good := save(t, root, 100, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{})
	bad := save(t, root, 200, rankTensors(rng, ""), rankTensors(rng, "m."), TensorOptions{})
	if err := os.Remove(filepath.Join(bad, manifestName)); err != nil {
		t.Fatal(err)
	}
	inc, err := ListIncomplete(root)
	if err != nil || len(inc) != 1 || inc[0].Dir != bad || inc[0].Step != 200 {
		t.Fatalf("ListIncomplete: %v, %v; want %s", inc, err, bad)
	}
	if !IsStepDir(bad) || !IsStepDir(bad+"/") || IsStepDir(root) {
		t.Fatal("IsStepDir misjudges a step directory's name")
	}
	if err := Verify(bad); !errors.Is(err, ErrNoManifest) || !strings.Contains(err.Error(), bad) {
		t.Fatalf("Verify without a manifest: %v", err)
	}
	var warned []string
	found, err := FindResumable(root, func(msg string) { warned = append(warned, msg) })
	if err != nil || found != good {
		t.Fatalf("FindResumable: %q, %v; want %s", found, err, good)
	}
	if len(warned) != 1 || !strings.Contains(warned[0], bad) || !strings.Contains(warned[0], "no MANIFEST.json") {
		t.Fatalf("want one warning naming %s, got %q", bad, warned)
	}
	if err := os.Remove(filepath.Join(good, manifestName)); err != nil {
		t.Fatal(err)
	}
	if _, err := FindResumable(root, nil); err == nil || errors.Is(err, ErrNoCheckpoint) || !strings.Contains(err.Error(), good) {
		t.Fatalf("a root of damaged checkpoints only: want an error naming %s, got %v", good, err)
	}
}
