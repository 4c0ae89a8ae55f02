package main

import (
	"bufio"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/checkpoint"
	"github.com/mktrain/mktrain/checkpoint/safetensors"
)

// trainQuick trains the shortened tiny recipe into a new run directory.
func trainQuick(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if code, _, stderr := runCLI(t, append([]string{"run", "tiny", "--run-dir", dir}, quick...)...); code != exitOK {
		t.Fatalf("training: exit %d\n%s", code, stderr)
	}
	return dir
}

// lastValLoss is the val_loss of the last line of metrics.jsonl.
func lastValLoss(t *testing.T, runDir string) float64 {
	t.Helper()
	f, err := os.Open(filepath.Join(runDir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var last struct {
		ValLoss *float64 `json:"val_loss"`
	}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if err := json.Unmarshal(sc.Bytes(), &last); err != nil {
			t.Fatal(err)
		}
	}
	if last.ValLoss == nil {
		t.Fatal("metrics.jsonl: the last line has no val_loss")
	}
	return *last.ValLoss
}

func TestTools(t *testing.T) {
	run := trainQuick(t)
	step := filepath.Join(run, "checkpoints", checkpoint.StepDirName(2))

	t.Run("ckpt verify", func(t *testing.T) {
		for _, dir := range []string{run, filepath.Join(run, "checkpoints"), step} {
			code, stdout, stderr := runCLI(t, "ckpt", "verify", dir)
			if code != exitOK || !strings.HasPrefix(stdout, "OK   "+step) {
				t.Errorf("verify %s: exit %d\n%s%s", dir, code, stdout, stderr)
			}
		}
	})
	t.Run("ckpt inspect", func(t *testing.T) {
		code, stdout, stderr := runCLI(t, "ckpt", "inspect", run)
		if code != exitOK {
			t.Fatalf("exit %d\n%s", code, stderr)
		}
		for _, want := range []string{"step           2", "tokens         64", "mktrain 0.1.0", "dp=1 ep=1 cp=1 tp=1", "recipe hash",
			"model.embed_tokens.weight", "F32", "[256 64]", "model-rank00000.safetensors",
			"model.layers.1.block_sparse_moe.experts.3.w2.weight.exp_avg_sq", "[64 128]", "optim-rank00000.safetensors",
			"bytes", "recipe\n", "  model:\n", "steps: 2", "tokenizer      byte-level (none)"} {
			if !strings.Contains(stdout, want) {
				t.Errorf("inspect output lacks %q:\n%s", want, stdout)
			}
		}
	})
	t.Run("eval", func(t *testing.T) {
		code, stdout, stderr := runCLI(t, "eval", "--checkpoint", run, "--batches", "1", "--json")
		if code != exitOK {
			t.Fatalf("exit %d\n%s", code, stderr)
		}
		var got evalJSON
		if err := json.Unmarshal([]byte(stdout), &got); err != nil {
			t.Fatalf("%v: %q", err, stdout)
		}
		// quick's validation is one micro-batch of 2 sequences of 16.
		if want := lastValLoss(t, run); got.Loss != want || got.Step != 2 || got.Tokens != 32 || got.Seq != 16 || got.Windows != 2 {
			t.Errorf("eval %+v; the run's final val_loss %v", got, want)
		}
		code, stdout, _ = runCLI(t, "eval", "--checkpoint", step, "--batches", "1")
		if code != exitOK || !strings.Contains(stdout, "loss ") || !strings.Contains(stdout, "perplexity ") {
			t.Errorf("text output: exit %d, %q", code, stdout)
		}
	})
	t.Run("sample", func(t *testing.T) {
		args := []string{"sample", "--checkpoint", run, "--prompt", "The quick ", "--tokens", "12", "--temperature", "0.9", "--top-k", "5", "--seed", "3"}
		code, first, stderr := runCLI(t, args...)
		if code != exitOK {
			t.Fatalf("exit %d\n%s", code, stderr)
		}
		if !strings.HasPrefix(first, "The quick ") || len(first) != len("The quick ")+12+1 {
			t.Errorf("output %q: want the prompt, 12 bytes and a newline", first)
		}
		if _, again, _ := runCLI(t, args...); again != first {
			t.Errorf("the same seed gave %q, then %q", first, again)
		}
	})
	t.Run("export", func(t *testing.T) {
		out := filepath.Join(t.TempDir(), "hf")
		code, stdout, stderr := runCLI(t, "export", "--format", "hf", "--dtype", "fp32", run, out)
		if code != exitOK || !strings.Contains(stdout, "exported step 2") {
			t.Fatalf("exit %d\n%s%s", code, stdout, stderr)
		}
		var cfg map[string]any
		raw, err := os.ReadFile(filepath.Join(out, "config.json"))
		if err != nil || json.Unmarshal(raw, &cfg) != nil || cfg["model_type"] != "mixtral" || cfg["hidden_size"] != 64.0 {
			t.Errorf("config.json: %v %s", err, raw)
		}
		f, err := safetensors.Open(filepath.Join(out, "model.safetensors"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if info, ok := f.Header().Lookup("model.layers.1.block_sparse_moe.experts.3.w2.weight"); !ok || info.DType != safetensors.F32 {
			t.Errorf("model.safetensors: expert tensor %+v, %v", info, ok)
		}
	})
}

func TestToolsHelp(t *testing.T) {
	for _, args := range [][]string{{"ckpt", "--help"}, {"ckpt", "verify", "--help"}, {"ckpt", "inspect", "-h"},
		{"export", "--help"}, {"eval", "--help"}, {"sample", "--help"}} {
		if code, _, stderr := runCLI(t, args...); code != exitOK {
			t.Errorf("%v: exit %d\n%s", args, code, stderr)
		}
	}
}

// TestToolsBadInput: missing directories, a corrupt checkpoint and bad
// flags exit 2 with a message naming the path, file or flag.
func TestToolsBadInput(t *testing.T) {
	run := trainQuick(t)
	step := filepath.Join(run, "checkpoints", checkpoint.StepDirName(2))
	missing := filepath.Join(t.TempDir(), "nowhere")
	empty := t.TempDir()
	full := t.TempDir()
	writeFile(t, filepath.Join(full, "x"), "x")

	cases := []struct {
		name string
		args []string
		want []string
	}{
		{"verify missing dir", []string{"ckpt", "verify", missing}, []string{"nowhere"}},
		{"verify empty dir", []string{"ckpt", "verify", empty}, []string{empty, "no checkpoint"}},
		{"inspect missing dir", []string{"ckpt", "inspect", missing}, []string{"nowhere"}},
		{"ckpt no subcommand", []string{"ckpt"}, []string{"verify or inspect"}},
		{"ckpt bad subcommand", []string{"ckpt", "fix", run}, []string{"fix"}},
		{"verify two dirs", []string{"ckpt", "verify", run, run}, []string{"exactly one directory"}},
		{"eval missing dir", []string{"eval", "--checkpoint", missing}, []string{"nowhere"}},
		{"eval no checkpoint flag", []string{"eval"}, []string{"--checkpoint"}},
		{"eval missing data", []string{"eval", "--checkpoint", run, "--data", filepath.Join(empty, "val_*.bin")}, []string{"val_*.bin"}},
		{"eval negative batches", []string{"eval", "--checkpoint", run, "--batches", "-1"}, []string{"--batches"}},
		{"sample no prompt", []string{"sample", "--checkpoint", run}, []string{"--prompt"}},
		{"sample bad temperature", []string{"sample", "--checkpoint", run, "--prompt", "a", "--temperature", "-1"}, []string{"--temperature"}},
		{"sample missing dir", []string{"sample", "--checkpoint", missing, "--prompt", "a"}, []string{"nowhere"}},
		{"export bad format", []string{"export", "--format", "gguf", run, filepath.Join(empty, "o")}, []string{"gguf"}},
		{"export bad dtype", []string{"export", "--dtype", "fp16", run, filepath.Join(empty, "o")}, []string{"fp16"}},
		{"export one arg", []string{"export", run}, []string{"output directory"}},
		{"export into full dir", []string{"export", run, full}, []string{full, "not empty"}},
		{"export missing checkpoint", []string{"export", missing, filepath.Join(empty, "o")}, []string{"nowhere"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			code, _, stderr := runCLI(t, c.args...)
			if code != exitFailure {
				t.Fatalf("exit %d, want %d\n%s", code, exitFailure, stderr)
			}
			for _, w := range c.want {
				if !strings.Contains(stderr, w) {
					t.Errorf("error does not mention %q:\n%s", w, stderr)
				}
			}
		})
	}

	// A corrupt model file: every command that reads it names it.
	victim := filepath.Join(step, checkpoint.ModelFile(0))
	raw, err := os.ReadFile(victim)
	if err != nil {
		t.Fatal(err)
	}
	raw[len(raw)/2] ^= 0x10
	writeFile(t, victim, string(raw))
	for _, args := range [][]string{
		{"ckpt", "verify", run},
		{"ckpt", "verify", step},
		{"eval", "--checkpoint", run},
		{"sample", "--checkpoint", step, "--prompt", "a"},
		{"export", run, filepath.Join(empty, "o")},
	} {
		code, stdout, stderr := runCLI(t, args...)
		if code != exitFailure || !strings.Contains(stderr, "model-rank00000.safetensors") {
			t.Errorf("%v on a corrupt checkpoint: exit %d\n%s", args, code, stderr)
		}
		if args[1] == "verify" && !strings.Contains(stdout, "FAIL "+step) {
			t.Errorf("%v: no FAIL line:\n%s", args, stdout)
		}
	}
	if _, err := os.Stat(filepath.Join(empty, "o")); !os.IsNotExist(err) {
		t.Errorf("a failed export left %s behind: %v", filepath.Join(empty, "o"), err)
	}
	if entries, _ := os.ReadDir(empty); len(entries) != 0 {
		t.Errorf("a failed export left files in %s: %v", empty, entries)
	}
}
