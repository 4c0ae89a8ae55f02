package main

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/data"
)

// badShard writes a copy of the uint16 shard at src with id put at token
// position pos, and returns its path.
func badShard(t *testing.T, src, dst string, pos int, id uint16) string {
	t.Helper()
	raw := readFile(t, src)
	binary.LittleEndian.PutUint16(raw[data.HeaderBytes+2*pos:], id)
	writeFile(t, dst, string(raw))
	return dst
}

func TestDataVerify(t *testing.T) {
	dir := t.TempDir()
	train, val := shards(t, dir, 256) // 4096 tokens each, ids < 256

	code, stdout, stderr := runCLI(t, "data", "verify", "--vocab", "256", filepath.Join(dir, "*_000000.bin"))
	if code != exitOK {
		t.Fatalf("good shards: exit %d\n%s", code, stderr)
	}
	for _, want := range []string{
		train + ": uint16, 4096 tokens, 9216 bytes, largest id ",
		val + ": uint16, 4096 tokens, 9216 bytes",
		"ok: 2 shards, 8192 tokens, 18432 bytes, largest id 255, every id < 256",
	} {
		if !strings.Contains(stdout, want) {
			t.Errorf("output lacks %q:\n%s", want, stdout)
		}
	}
	// A recipe gives the vocabulary, and with no GLOB its shards.
	recipe := writeFile(t, filepath.Join(dir, "r.yaml"), fmt.Sprintf("model:\n  vocab: 256\ndata:\n  train: %s\n  val: %s\n", train, val))
	if code, stdout, stderr := runCLI(t, "data", "verify", "--recipe", recipe); code != exitOK || !strings.Contains(stdout, "ok: 2 shards") {
		t.Fatalf("--recipe: exit %d\n%s%s", code, stdout, stderr)
	}

	const pos = 2000 // in the middle of the shard
	bad := badShard(t, train, filepath.Join(dir, "bad.bin"), pos, 256)
	truncated := writeFile(t, filepath.Join(dir, "truncated.bin"), string(readFile(t, train)[:9000]))
	header := readFile(t, train)
	binary.LittleEndian.PutUint32(header[4:], 3) // a version magic 20240520 does not have
	badHeader := writeFile(t, filepath.Join(dir, "header.bin"), string(header))
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"bad id", []string{"--vocab", "256", val, bad},
			fmt.Sprintf("mktrain: %s: token id 256 at position %d (byte offset %d) is >= vocab 256\n", bad, pos, data.HeaderBytes+2*pos)},
		{"bad id by recipe", []string{"--recipe", recipe, bad}, bad + ": token id 256 at position 2000"},
		{"truncated", []string{truncated}, truncated + ": truncated: the header says 4096 tokens of 2 bytes, so the file should be 9216 bytes, but it is 9000 bytes"},
		{"bad header", []string{badHeader}, badHeader + ": magic 20240520 (uint16 tokens) comes with version 1, found version 3"},
		{"missing", []string{filepath.Join(dir, "none.bin")}, "none.bin: no such file"},
		{"glob without match", []string{filepath.Join(dir, "none_*.bin")}, "matches no files"},
		{"no shards", nil, "data verify needs at least one shard"},
		{"vocab and recipe", []string{"--vocab", "5", "--recipe", recipe, train}, "not both"},
	}
	for _, c := range cases {
		code, stdout, stderr := runCLI(t, append([]string{"data", "verify"}, c.args...)...)
		if code != exitFailure || !strings.Contains(stderr, c.want) {
			t.Errorf("%s: exit %d, want %d and an error with %q\n%s", c.name, code, exitFailure, c.want, stderr)
		}
		if strings.Contains(stdout, "ok:") {
			t.Errorf("%s: reports ok:\n%s", c.name, stdout)
		}
	}
}

// TestRunRefusesBadTokenBeforeStepOne: a run whose shard holds one bad id
// in the middle fails before step 1, naming the file and position, and
// writes no metrics line and no checkpoint; so does its resume.
func TestRunRefusesBadTokenBeforeStepOne(t *testing.T) {
	dir := t.TempDir()
	train, val := shards(t, dir, 256)
	const pos = 3001
	bad := badShard(t, train, filepath.Join(dir, "train_000001.bin"), pos, 300)
	runDir := t.TempDir()
	args := append([]string{"run", "tiny", "--run-dir", runDir}, quick...)
	args = append(args, "--set", "data.train="+filepath.Join(dir, "train_*.bin"), "--set", "data.val="+val,
		"--set", "train.steps=20", "--set", "checkpoint.every=1")
	for attempt := range 2 { // the first run, and a retry as after a resume
		code, stdout, stderr := runCLI(t, args...)
		want := fmt.Sprintf("mktrain: data.train: %s: token id 300 at position %d (byte offset %d) is >= vocab 256 (model.vocab)",
			bad, pos, data.HeaderBytes+2*pos)
		if code != exitFailure || !strings.Contains(stderr, want) {
			t.Fatalf("attempt %d: exit %d, want %d and %q\n%s%s", attempt, code, exitFailure, want, stdout, stderr)
		}
		if m, err := os.ReadFile(filepath.Join(runDir, "metrics.jsonl")); err == nil && len(m) > 0 {
			t.Errorf("attempt %d: metrics.jsonl holds steps:\n%s", attempt, m)
		}
		if entries, _ := os.ReadDir(filepath.Join(runDir, "checkpoints")); len(entries) > 0 {
			t.Errorf("attempt %d: checkpoints written: %v", attempt, entries)
		}
	}
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
