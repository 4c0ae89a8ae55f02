package main

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/data"
)

// quick shortens the tiny recipe so a CLI test trains in well under a second.
var quick = []string{"--set", "train.steps=2", "--set", "train.seq=16", "--set", "train.global_batch=2",
	"--set", "train.micro_batch=2", "--set", "train.warmup_steps=1", "--set", "train.eval_batches=1", "--set", "train.backend=cpu"}

func runCLI(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(args, &out, &errOut)
	if s := errOut.String(); strings.Contains(s, "goroutine ") || strings.Contains(s, "panic") {
		t.Errorf("stderr shows a panic or stack trace:\n%s", s)
	}
	return code, out.String(), errOut.String()
}

func writeFile(t *testing.T, path, content string) string {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestRunTrainsTinyRecipe(t *testing.T) {
	dir := t.TempDir()
	args := append([]string{"run", "tiny", "--run-dir", dir}, quick...)
	code, stdout, stderr := runCLI(t, args...)
	if code != exitOK {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	if !strings.Contains(stdout, "2 steps") {
		t.Errorf("summary missing: %q", stdout)
	}
	for _, f := range []string{"recipe.yaml", "train.log", "metrics.jsonl"} {
		if st, err := os.Stat(filepath.Join(dir, f)); err != nil || st.Size() == 0 {
			t.Errorf("run directory lacks %s: %v", f, err)
		}
	}
	metrics, _ := os.ReadFile(filepath.Join(dir, "metrics.jsonl"))
	for _, key := range []string{`"step"`, `"loss"`, `"lr"`, `"grad_norm"`, `"tokens_per_s"`, `"val_loss"`, `"experts"`, `"max_over_mean"`, `"dropped"`} {
		if !bytes.Contains(metrics, []byte(key)) {
			t.Errorf("metrics.jsonl lacks %s:\n%s", key, metrics)
		}
	}
}

// shards writes a valid train and val shard and returns their paths.
func shards(t *testing.T, dir string, vocab int) (train, val string) {
	t.Helper()
	tokens := make([]uint32, 4096)
	for i := range tokens {
		tokens[i] = uint32(i*7) % uint32(vocab)
	}
	train, val = filepath.Join(dir, "train_000000.bin"), filepath.Join(dir, "val_000000.bin")
	if err := data.WriteShard(train, tokens, vocab); err != nil {
		t.Fatal(err)
	}
	if err := data.WriteShard(val, tokens, vocab); err != nil {
		t.Fatal(err)
	}
	return train, val
}

func TestBadInputExitsWithClearError(t *testing.T) {
	dir := t.TempDir()
	train, val := shards(t, dir, 256)

	badMagic := filepath.Join(dir, "badmagic.bin")
	raw, _ := os.ReadFile(train)
	corrupt := append([]byte(nil), raw...)
	binary.LittleEndian.PutUint32(corrupt, 12345)
	writeFile(t, badMagic, string(corrupt))
	truncated := writeFile(t, filepath.Join(dir, "truncated.bin"), string(raw[:len(raw)-10]))
	bigTokens := make([]uint32, 4096)
	for i := range bigTokens {
		bigTokens[i] = 300 // >= vocab 256
	}
	big := filepath.Join(dir, "big_000000.bin")
	if err := data.WriteShard(big, bigTokens, 1024); err != nil {
		t.Fatal(err)
	}

	cases := []struct {
		name string
		args []string
		want []string
		code int // exitFailure (bad input) unless set
	}{
		{"missing recipe", []string{"run", filepath.Join(dir, "nope.yaml")}, []string{"nope.yaml"}, 0},
		{"no recipe", []string{"run"}, []string{"exactly one recipe"}, 0},
		{"malformed recipe", []string{"run", writeFile(t, filepath.Join(dir, "bad.yaml"), "model:\n  dim: [1, 2\n")}, []string{"bad.yaml"}, 0},
		{"unknown key", []string{"run", writeFile(t, filepath.Join(dir, "unk.yaml"), "train:\n  lr_max: 1\n")}, []string{"unk.yaml:2", "lr_max"}, 0},
		{"invalid values", []string{"run", writeFile(t, filepath.Join(dir, "inv.yaml"), "model:\n  heads: 5\ntrain:\n  lr: -1\n")}, []string{"model.heads", "train.lr"}, 0},
		{"bad override", []string{"run", "tiny", "--set", "train.nope=1"}, []string{"train.nope"}, 0},
		{"missing data", []string{"run", "tiny", "--set", "data.train=" + filepath.Join(dir, "none_*.bin"), "--set", "data.val=" + val}, []string{"none_*.bin"}, 0},
		{"bad magic", []string{"run", "tiny", "--set", "data.train=" + badMagic, "--set", "data.val=" + val}, []string{"badmagic.bin", "magic"}, 0},
		{"truncated shard", []string{"run", "tiny", "--set", "data.train=" + truncated, "--set", "data.val=" + val}, []string{"truncated.bin"}, 0},
		{"token beyond vocab", []string{"run", "tiny", "--set", "data.train=" + big, "--set", "data.val=" + val}, []string{"big_000000.bin", "model.vocab"}, 0},
		// A NaN loss stops a run that had started: a failed run, exit 1.
		{"nan loss", []string{"run", "tiny", "--set", "train.lr=1e30", "--set", "train.min_lr=0", "--set", "train.grad_clip=0", "--set", "train.steps=6"}, []string{"step", "loss", "train.lr"}, exitRunFailed},
		{"unknown command", []string{"frobnicate"}, []string{"unknown command"}, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			args := c.args
			if len(args) > 1 && args[0] == "run" && len(args) >= 2 {
				args = append(append([]string{}, args...), append([]string{"--run-dir", t.TempDir()}, quick...)...)
				// The case's own --set flags come after quick's and win.
				args = append(args, c.args[2:]...)
			}
			code, _, stderr := runCLI(t, args...)
			want := exitFailure
			if c.code != 0 {
				want = c.code
			}
			if code != want {
				t.Fatalf("exit %d, want %d\n%s", code, want, stderr)
			}
			for _, w := range c.want {
				if !strings.Contains(stderr, w) {
					t.Errorf("error does not mention %q:\n%s", w, stderr)
				}
			}
		})
	}
}

func TestHelpAndVersion(t *testing.T) {
	for _, args := range [][]string{{"run", "--help"}, {"data", "--help"}, {"data", "prepare", "--help"}, {"bench", "train", "--help"}, {"help"}} {
		if code, _, stderr := runCLI(t, args...); code != exitOK {
			t.Errorf("%v: exit %d\n%s", args, code, stderr)
		}
	}
	code, stdout, _ := runCLI(t, "version")
	if code != exitOK || !strings.HasPrefix(stdout, "mktrain ") {
		t.Errorf("version: exit %d, %q", code, stdout)
	}
}

func TestDataPrepare(t *testing.T) {
	dir := t.TempDir()
	text := writeFile(t, filepath.Join(dir, "a.txt"), strings.Repeat("hello mixture of experts. ", 200))
	out := filepath.Join(dir, "shards")
	code, stdout, stderr := runCLI(t, "data", "prepare", "--out", out, text)
	if code != exitOK {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	if !strings.Contains(stdout, "prepared 1 files") {
		t.Errorf("summary: %q", stdout)
	}
	// The shards train.
	args := append([]string{"run", "tiny", "--run-dir", t.TempDir(),
		"--set", "data.train=" + filepath.Join(out, "train_*.bin"), "--set", "data.val=" + filepath.Join(out, "val_*.bin")}, quick...)
	if code, _, stderr := runCLI(t, args...); code != exitOK {
		t.Fatalf("training on prepared shards: exit %d\n%s", code, stderr)
	}
}
