package engine

// Finding a run's checkpoints on disk and reading what one records, for
// the programs that use a trained model (package infer, mktrain ckpt).

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/comm"
)

// CheckpointsRoot is where the checkpoints under dir live: dir/checkpoints
// when dir is a run directory (it has that subdirectory), else dir itself,
// taken to be a checkpoints root.
func CheckpointsRoot(dir string) string {
	if st, err := os.Stat(filepath.Join(dir, "checkpoints")); err == nil && st.IsDir() {
		return filepath.Join(dir, "checkpoints")
	}
	return dir
}

// IsCheckpointDir reports whether dir is one checkpoint (a step directory:
// it holds MANIFEST.json, or is named step_%08d) rather than a run
// directory or a checkpoints root. A step directory without its manifest
// counts as one, so that the missing manifest is reported (by
// checkpoint.Verify or checkpoint.Open) instead of the directory being
// searched for checkpoints.
func IsCheckpointDir(dir string) bool {
	st, err := os.Stat(filepath.Join(dir, "MANIFEST.json"))
	if err == nil && st.Mode().IsRegular() {
		return true
	}
	st, err = os.Stat(dir)
	return err == nil && st.IsDir() && checkpoint.IsStepDir(dir)
}

// ResolveCheckpoint names the verified checkpoint dir stands for: dir itself
// when it is a step directory, otherwise the newest checkpoint that passes
// checkpoint.Verify under CheckpointsRoot(dir). warn, when not nil, hears of
// each newer checkpoint skipped as corrupt. The error of a corrupt step
// directory names the bad file.
func ResolveCheckpoint(dir string, warn func(string)) (string, error) {
	return ResolveCheckpointContext(context.Background(), dir, warn)
}

// ResolveCheckpointContext is ResolveCheckpoint that stops rehashing when
// ctx ends, with an error wrapping its cause.
func ResolveCheckpointContext(ctx context.Context, dir string, warn func(string)) (string, error) {
	if IsCheckpointDir(dir) {
		if err := checkpoint.VerifyContext(ctx, dir); err != nil {
			return "", err
		}
		return dir, nil
	}
	st, err := os.Stat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("%s does not exist", dir)
	}
	if err != nil {
		return "", err
	}
	if !st.IsDir() {
		return "", fmt.Errorf("%s is not a directory: name a checkpoint (step_* directory), a run directory or a checkpoints root", dir)
	}
	found, err := checkpoint.FindResumableContext(ctx, CheckpointsRoot(dir), warn)
	if errors.Is(err, checkpoint.ErrNoCheckpoint) {
		return "", fmt.Errorf("%s holds no checkpoint: it is not a step directory (no MANIFEST.json), and neither it nor %s has step_* directories",
			dir, filepath.Join(dir, "checkpoints"))
	}
	return found, err
}

// CheckpointInfo is what a checkpoint's state.json records about its run.
type CheckpointInfo struct {
	Dir        string
	Step       int
	Tokens     int64   // tokens trained on up to Step
	LR         float64 // the schedule's rate at Step
	Config     Config  // the run's whole configuration
	Recipe     string  // the recipe's YAML snapshot ("" when the run had none)
	RecipeHash string
	// TokenizerSHA256 is the SHA-256 of the checkpoint's tokenizer.json;
	// "" when the run was byte-level.
	TokenizerSHA256 string
	Mesh            comm.Mesh
	Backend         string
	Version         string // mktrain release that wrote it
	SavedAt         time.Time
}

// ReadCheckpointInfo reads the state of the checkpoint in step directory
// dir. It checks file sizes, not checksums (see checkpoint.Verify).
func ReadCheckpointInfo(dir string) (CheckpointInfo, error) {
	ck, err := checkpoint.Open(dir)
	if err != nil {
		return CheckpointInfo{}, err
	}
	defer ck.Close()
	var st trainState
	if err := ck.ReadState(&st); err != nil {
		return CheckpointInfo{}, err
	}
	return CheckpointInfo{
		Dir: dir, Step: st.Step, Tokens: st.Tokens, LR: st.LR, Config: st.Config, Recipe: st.Recipe,
		RecipeHash: st.RecipeHash, TokenizerSHA256: st.Tokenizer, Mesh: st.Mesh, Backend: st.Backend, Version: st.Version, SavedAt: st.SavedAt,
	}, nil
}

// ExpertBiasName is the name, in a checkpoint's model section, of layer l's
// expert biases: present when the run balanced its experts without an aux
// loss (model.moe.bias_update_rate), and not a parameter of the model.
func ExpertBiasName(l int) string { return biasName(l) }
