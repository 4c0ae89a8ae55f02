package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/data"
)

// TestRunRefusesBadTokenBeforeStepOne: one id >= model.vocab in the middle
// of a training shard fails Run before the first step, naming the file and
// the position, with no step reported, no metrics line and no checkpoint;
// the same data without that id trains.
func TestRunRefusesBadTokenBeforeStepOne(t *testing.T) {
	cfg := equivalenceConfig()
	cfg.Train.Steps = 4
	cfg.Checkpoint.Every = 1
	dir := t.TempDir()
	tokens := make([]uint32, 20000)
	for i := range tokens {
		tokens[i] = uint32(i*7) % uint32(cfg.Model.Vocab)
	}
	cfg.Data.Train, cfg.Data.Val = filepath.Join(dir, "train_*.bin"), filepath.Join(dir, "val_*.bin")
	for _, name := range []string{"train_000000.bin", "train_000001.bin", "val_000000.bin"} {
		if err := data.WriteShard(filepath.Join(dir, name), tokens, cfg.Model.Vocab); err != nil {
			t.Fatal(err)
		}
	}
	const badPos = 12345
	bad := append([]uint32(nil), tokens...)
	bad[badPos] = uint32(cfg.Model.Vocab) // the first id out of range
	badPath := filepath.Join(dir, "train_000001.bin")
	if err := data.WriteShard(badPath, bad, 65536); err != nil { // uint16 like the others
		t.Fatal(err)
	}

	runDir := t.TempDir()
	var metrics bytes.Buffer
	steps := 0
	eng, err := New(cfg, WithRunDir(runDir), WithMetrics(&metrics), WithHook(func(StepEvent) { steps++ }))
	if err != nil {
		t.Fatal(err)
	}
	_, err = eng.Run(context.Background())
	want := fmt.Sprintf("data.train: %s: token id %d at position %d (byte offset %d) is >= vocab %d (model.vocab)",
		badPath, cfg.Model.Vocab, badPos, data.HeaderBytes+2*badPos, cfg.Model.Vocab)
	if err == nil || err.Error() != want {
		t.Fatalf("got %v\nwant %s", err, want)
	}
	if steps != 0 || metrics.Len() != 0 {
		t.Errorf("the run reported %d steps and wrote metrics %q before failing", steps, metrics.String())
	}
	if entries, _ := os.ReadDir(filepath.Join(runDir, "checkpoints")); len(entries) != 0 {
		t.Errorf("the run left checkpoints: %v", entries)
	}

	// A bad validation shard is refused too, under its own field.
	cfg.Data.Train, cfg.Data.Val = filepath.Join(dir, "train_000000.bin"), badPath
	eng, err = New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Run(context.Background()); err == nil || !strings.HasPrefix(err.Error(), "data.val: "+badPath+": token id") {
		t.Fatalf("bad val shard: got %v", err)
	}

	// A truncated shard is refused before step 1 as well.
	raw, err := os.ReadFile(badPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(badPath, raw[:len(raw)-3], 0o644); err != nil {
		t.Fatal(err)
	}
	cfg.Data.Train, cfg.Data.Val = filepath.Join(dir, "train_*.bin"), filepath.Join(dir, "val_*.bin")
	eng, err = New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Run(context.Background()); err == nil || !strings.Contains(err.Error(), badPath+": truncated") {
		t.Fatalf("truncated shard: got %v", err)
	}

	// Without the bad shard the same data trains.
	if err := os.Remove(badPath); err != nil {
		t.Fatal(err)
	}
	eng, err = New(cfg, WithHook(func(StepEvent) { steps++ }))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := eng.Run(context.Background()); err != nil || steps != cfg.Train.Steps {
		t.Fatalf("good data: %d steps, %v", steps, err)
	}
}

// TestVerifyDataStopsOnCancel: a cancelled context during the check is a
// stop, not a data error.
func TestVerifyDataStopsOnCancel(t *testing.T) {
	cfg := equivalenceConfig()
	dir := t.TempDir()
	tokens := make([]uint32, 4096)
	cfg.Data.Train, cfg.Data.Val = filepath.Join(dir, "t.bin"), filepath.Join(dir, "t.bin")
	if err := data.WriteShard(cfg.Data.Train, tokens, cfg.Model.Vocab); err != nil {
		t.Fatal(err)
	}
	eng, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := eng.verifyData(ctx); !errors.Is(err, ErrStopped) {
		t.Fatalf("got %v, want ErrStopped", err)
	}
}
