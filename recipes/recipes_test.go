package recipes

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/engine"
)

func TestShippedRecipesLoad(t *testing.T) {
	if got, want := Shipped(), []string{"long-context", "moe-fine", "moe-large", "moe-small", "tiny"}; !slices.Equal(got, want) {
		t.Fatalf("Shipped() = %v, want %v", got, want)
	}
	for _, name := range Shipped() {
		cfg, snap, err := Load(name+".yaml", nil) // the file on disk: tests run in recipes/
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := cfg.Validate(); err != nil {
			t.Errorf("%s: Load returned a config that does not validate: %v", name, err)
		}
		again, _, err := Parse("snapshot", snap, nil)
		if err != nil {
			t.Fatalf("%s: the snapshot does not parse: %v\n%s", name, err, snap)
		}
		if !reflect.DeepEqual(again, cfg) {
			t.Errorf("%s: the snapshot parses to\n%+v\nwant\n%+v", name, again, cfg)
		}
	}
}

// TestShippedRecipesSetEveryField keeps the shipped recipes complete, so each
// is a readable list of every knob with its value.
func TestShippedRecipesSetEveryField(t *testing.T) {
	for _, name := range Shipped() {
		data, err := shipped.ReadFile(name + ".yaml")
		if err != nil {
			t.Fatal(err)
		}
		cfg := engine.DefaultConfig()
		d := decoder{file: name, lines: map[string]int{}}
		d.document(data, &cfg)
		if len(d.errs) > 0 {
			t.Fatalf("%s: %v", name, errors.Join(d.errs...))
		}
		for _, l := range leaves() {
			if d.lines[l.path] == 0 {
				t.Errorf("%s does not set %s", name, l.path)
			}
		}
	}
}

func TestShippedRecipeValues(t *testing.T) {
	tiny, _, err := Load("tiny", nil)
	if err != nil {
		t.Fatal(err)
	}
	if tiny.Model.Vocab != 256 || tiny.Data.Train != "" || tiny.Data.Val != "" {
		t.Errorf("tiny must be byte-level on the embedded corpus: vocab %d, data %+v", tiny.Model.Vocab, tiny.Data)
	}
	small, _, err := Load("moe-small", nil)
	if err != nil {
		t.Fatal(err)
	}
	// The defaults of torch_moe_train.py, the PyTorch peer.
	m, tr := small.Model, small.Train
	got := []any{m.Vocab, m.Dim, m.Layers, m.Heads, m.KVHeads, m.MoE.Experts, m.MoE.TopK, m.MoE.FFN,
		tr.Seq, tr.GlobalBatch, tr.MicroBatch, m.RopeTheta, m.NormEps, m.MoE.AuxLossCoef, tr.LR, tr.Backend}
	want := []any{32768, 1024, 8, 16, 4, 8, 2, 2816, 2048, 8, 8, 1e6, 1e-5, 0.01, 3e-4, "cuda"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("moe-small differs from the peer:\n got %v\nwant %v", got, want)
	}
	// moe-fine is the peer run with --dim 2048 --experts 64 --topk 6
	// --ffn 1408 --batch 4, and moe-small in every other field but one:
	// it does not clip, as the peer does not, which lets its experts be
	// updated in the backward (train.optimizer_in_backward: auto).
	fine, _, err := Load("moe-fine", nil)
	if err != nil {
		t.Fatal(err)
	}
	m, tr = fine.Model, fine.Train
	got = []any{m.Vocab, m.Dim, m.Layers, m.Heads, m.KVHeads, m.MoE.Experts, m.MoE.TopK, m.MoE.FFN,
		tr.Seq, tr.GlobalBatch, tr.MicroBatch, m.RopeTheta, m.NormEps, m.MoE.AuxLossCoef, tr.LR, tr.Backend}
	want = []any{32768, 2048, 8, 16, 4, 64, 6, 1408, 2048, 4, 4, 1e6, 1e-5, 0.01, 3e-4, "cuda"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("moe-fine differs from the peer's fine-grained run:\n got %v\nwant %v", got, want)
	}
	asSmall := fine
	asSmall.Model.Dim, asSmall.Model.MoE.Experts, asSmall.Model.MoE.TopK, asSmall.Model.MoE.FFN = 1024, 8, 2, 2816
	asSmall.Train.GlobalBatch, asSmall.Train.MicroBatch = 8, 8
	if fine.Train.GradClip != 0 || !fine.ExpertsUpdatedInBackward() {
		t.Errorf("moe-fine clips at %g, experts updated in the backward %v; want no clipping, as the peer, and the update in the backward",
			fine.Train.GradClip, fine.ExpertsUpdatedInBackward())
	}
	asSmall.Train.GradClip = small.Train.GradClip
	if !reflect.DeepEqual(asSmall, small) {
		t.Errorf("moe-fine differs from moe-small beyond the peer's five flags and clipping:\n%+v\n%+v", asSmall, small)
	}
	if n := engine.ParamCount(fine.Model); n != 4648372224 {
		t.Errorf("moe-fine has %d parameters, want 4648372224 (4.65B)", n)
	}
}

// TestLoadByName runs where no recipes/ directory is, so the shipped recipes
// must come from the binary; a file on disk must still win.
func TestLoadByName(t *testing.T) {
	want, _, err := Parse("recipes/tiny.yaml", mustRead(t, "tiny.yaml"), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Chdir(t.TempDir())
	for _, path := range []string{"tiny", "tiny.yaml", "recipes/tiny.yaml", "./recipes/tiny.yaml"} {
		got, _, err := Load(path, nil)
		if err != nil {
			t.Errorf("Load(%q): %v", path, err)
			continue
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("Load(%q) is not the shipped tiny recipe", path)
		}
	}
	if err := os.WriteFile("tiny.yaml", []byte("train:\n  steps: 77\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	got, _, err := Load("tiny.yaml", nil)
	if err != nil || got.Train.Steps != 77 {
		t.Errorf("a tiny.yaml on disk must win over the shipped one: steps %d, err %v", got.Train.Steps, err)
	}
	for _, path := range []string{"nosuch", "other/tiny.yaml", "/abs/recipes/tiny.yaml"} {
		_, _, err := Load(path, nil)
		want := "recipe " + path + ": no such file, and not a shipped recipe (long-context, moe-fine, moe-large, moe-small, tiny)"
		if err == nil || err.Error() != want {
			t.Errorf("Load(%q) = %v, want %q", path, err, want)
		}
	}
	if err := os.Mkdir("dir.yaml", 0o755); err != nil {
		t.Fatal(err)
	}
	if _, _, err := Load("dir.yaml", nil); err == nil || !strings.HasPrefix(err.Error(), "recipe dir.yaml: ") {
		t.Errorf("Load of a directory = %v, want an error naming it", err)
	}
}

func TestEmbeddedMatchesDisk(t *testing.T) {
	for _, name := range Shipped() {
		embedded, _ := shipped.ReadFile(name + ".yaml")
		if !bytes.Equal(embedded, mustRead(t, name+".yaml")) {
			t.Errorf("%s: the embedded recipe differs from the file", name)
		}
	}
}

// TestDecodeErrors checks that each problem is found, placed at its line,
// and said in words; every problem of a file comes back, not only the first.
func TestDecodeErrors(t *testing.T) {
	cases := []struct {
		name, yaml string
		want       []string
	}{
		{"unknown field", "train:\n  lr: 1e-3\n  lr_max: 1\n",
			[]string{`r.yaml:3: unknown field "lr_max" in section train; the fields are backend, global_batch, micro_batch, seq, steps, lr, min_lr, schedule, warmup_steps, decay_steps, weight_decay, beta1, beta2, eps, grad_clip, seed, eval_every, eval_batches, deterministic, recompute, optimizer_in_backward, master_weights`}},
		{"typo", "model:\n  moe:\n    topk: 1\n", []string{`r.yaml:3: unknown field "topk" in section model.moe; did you mean "top_k"?`}},
		{"unknown section", "optim:\n  lr: 1\n",
			[]string{`r.yaml:1: unknown section "optim"; the sections are model, data, train, parallel, checkpoint, log`}},
		{"section typo", "trian:\n  lr: 1\n", []string{`r.yaml:1: unknown section "trian"; did you mean "train"?`}},
		{"set twice", "train:\n  lr: 1e-3\n  lr: 2e-3\n", []string{"r.yaml:3: train.lr is set twice (first at line 2)"}},
		{"fraction for int", "train:\n  steps: 2.5\n", []string{"r.yaml:2: train.steps must be an integer, got 2.5, which is not a whole number"}},
		{"word for int", "model:\n  dim: big\n", []string{`r.yaml:2: model.dim must be an integer, got "big"`}},
		{"int too big", "model:\n  dim: 99999999999999999999\n",
			[]string{"r.yaml:2: model.dim must be an integer, got 99999999999999999999, which is out of range"}},
		{"exp int too big", "model:\n  dim: 1e19\n", []string{"r.yaml:2: model.dim must be an integer, got 1e19, which is out of range"}},
		{"quoted number", "train:\n  lr: \"3e-4\"\n",
			[]string{`r.yaml:2: train.lr must be a number, not the quoted string "3e-4"; write it without quotes`}},
		{"word for float", "train:\n  lr: fast\n", []string{`r.yaml:2: train.lr must be a number, got "fast"`}},
		{"negative seed", "train:\n  seed: -1\n", []string{`r.yaml:2: train.seed must be a non-negative integer, got "-1"`}},
		{"yes for bool", "checkpoint:\n  async: yes\n", []string{`r.yaml:2: checkpoint.async must be true or false, got "yes"`}},
		{"null number", "train:\n  lr:\n", []string{"r.yaml:2: train.lr has no value; write a number or remove the line to keep the default"}},
		{"list for leaf", "train:\n  lr: [1, 2]\n", []string{"r.yaml:2: train.lr must be a number, not a list"}},
		{"scalar section", "model: big\n", []string{`r.yaml:1: section model must be a mapping of its fields (vocab, dim, layers, heads, kv_heads, rope_theta, norm_eps, init_std, moe), not the value "big"`}},
		{"empty file", "", []string{"r.yaml: the recipe is empty (or only comments): start from a shipped one, `mktrain run tiny` or a copy of recipes/tiny.yaml, and change what you need"}},
		{"only comments", "# nothing\n", []string{"r.yaml: the recipe is empty (or only comments): start from a shipped one, `mktrain run tiny` or a copy of recipes/tiny.yaml, and change what you need"}},
		{"empty document", "---\n", []string{"r.yaml: the recipe is empty (or only comments): start from a shipped one, `mktrain run tiny` or a copy of recipes/tiny.yaml, and change what you need"}},
		{"list recipe", "- model\n", []string{"r.yaml:1: a recipe must be a mapping of sections (model, data, train, parallel, checkpoint, log), not a list"}},
		{"complex key", "train:\n  ? [a]\n  : 1\n", []string{"r.yaml:2: a key must be a plain name, not a list"}},
		{"two documents", "train:\n  lr: 1e-3\n---\ntrain:\n  lr: 2e-3\n", []string{"r.yaml:3: a recipe is one YAML document, but a second one starts here"}},
		{"syntax", "train:\n  lr: 1\n bad: 2\n", []string{"r.yaml:2: did not find expected key"}},
		{"tab", "train:\n\tlr: 1\n", []string{"r.yaml:2: found character that cannot start any token"}},
		{"several at once", "model:\n  dim: x\n  layerz: 2\nlog:\n  level: 3\n  every: 1.5\n", []string{
			`r.yaml:2: model.dim must be an integer, got "x"`,
			`r.yaml:3: unknown field "layerz" in section model; did you mean "layers"?`,
			"r.yaml:6: log.every must be an integer, got 1.5, which is not a whole number",
		}},
		// Validate's sentences, placed at the line of the field at fault.
		{"validate", "model:\n  dim: 64\n  heads: 6\ntrain:\n  lr: -0.001\n", []string{
			"r.yaml:3: model.heads (6) must divide model.dim (64)",
			"r.yaml:5: train.lr must be positive, got -0.001",
		}},
		{"validate default field", "model:\n  moe:\n    experts: 1\n",
			[]string{"r.yaml: model.moe.top_k (2) cannot exceed model.moe.experts (1)"}},
		{"validate inf", "train:\n  lr: .inf\n", []string{"r.yaml:2: train.lr must be a finite number, got +Inf"}},
		{"validate cp", "train:\n  seq: 64\nparallel:\n  cp: 3\n",
			[]string{"r.yaml:2: train.seq (64) must be a multiple of 2 x parallel.cp (2*3 = 6): context parallelism cuts each sequence into 2*cp equal chunks"}},
		{"null string", "checkpoint:\n  resume:\n",
			[]string{`r.yaml:2: checkpoint.resume must be auto, never, or the path of a checkpoint; got ""`}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, snap, err := Parse("r.yaml", []byte(tc.yaml), nil)
			if err == nil {
				t.Fatalf("no error; snapshot:\n%s", snap)
			}
			if got := errorLines(t, err, "r.yaml"); !slices.Equal(got, tc.want) {
				t.Errorf("got\n  %s\nwant\n  %s", strings.Join(got, "\n  "), strings.Join(tc.want, "\n  "))
			}
		})
	}
}

// TestDecodeAccepts covers the forms a recipe may take besides the plain one.
func TestDecodeAccepts(t *testing.T) {
	def := engine.DefaultConfig()
	cases := []struct {
		name, yaml string
		want       func(c *engine.Config)
	}{
		{"empty section", "model:\ntrain:\n  steps: 90\n", func(c *engine.Config) { c.Train.Steps = 90 }},
		{"exponent int", "train:\n  steps: 1e3\n", func(c *engine.Config) { c.Train.Steps = 1000 }},
		{"flow style", "model: {dim: 128, heads: 8}\n", func(c *engine.Config) { c.Model.Dim, c.Model.Heads = 128, 8 }},
		{"alias value", "train:\n  lr: &lr 2e-3\n  min_lr: *lr\n", func(c *engine.Config) { c.Train.LR, c.Train.MinLR = 2e-3, 2e-3 }},
		{"quoted string", "log:\n  level: \"warn\"\n", func(c *engine.Config) { c.Log.Level = "warn" }},
		{"string that looks like a number", "checkpoint:\n  resume: 123\n", func(c *engine.Config) { c.Checkpoint.Resume = "123" }},
		{"bool case", "checkpoint:\n  async: True\n", func(c *engine.Config) { c.Checkpoint.Async = true }},
		{"tagged", "train:\n  lr: !!float 2e-3\n", func(c *engine.Config) { c.Train.LR = 2e-3 }},
		{"big seed", "train:\n  seed: 18446744073709551615\n", func(c *engine.Config) { c.Train.Seed = 1<<64 - 1 }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, _, err := Parse("r.yaml", []byte(tc.yaml), nil)
			if err != nil {
				t.Fatal(err)
			}
			want := def
			tc.want(&want)
			if !reflect.DeepEqual(got, want) {
				t.Errorf("got\n%+v\nwant\n%+v", got, want)
			}
		})
	}
}

func TestOverrides(t *testing.T) {
	base := "train:\n  lr: 1e-3\n"
	cases := []struct {
		name string
		sets []string
		want func(c *engine.Config)
	}{
		{"float", []string{"train.lr=3e-4"}, func(c *engine.Config) { c.Train.LR = 3e-4 }},
		{"int", []string{"train.steps=50"}, func(c *engine.Config) { c.Train.Steps = 50 }},
		{"nested", []string{"model.moe.top_k=1"}, func(c *engine.Config) { c.Model.MoE.TopK = 1 }},
		{"bool", []string{"checkpoint.async=true"}, func(c *engine.Config) { c.Checkpoint.Async = true }},
		{"string", []string{"train.schedule=wsd"}, func(c *engine.Config) { c.Train.Schedule = "wsd" }},
		{"string as written", []string{"data.train=d/train_*.bin", "data.val=d/v #1.bin"},
			func(c *engine.Config) { c.Data.Train, c.Data.Val = "d/train_*.bin", "d/v #1.bin" }},
		{"empty string", []string{"data.train=d/t*.bin", "data.val=d/v*.bin", "data.train=", "data.val="}, func(c *engine.Config) {}},
		{"later wins", []string{"train.steps=50", "train.steps=60"}, func(c *engine.Config) { c.Train.Steps = 60 }},
		{"value with =", []string{"checkpoint.resume=runs/a=b"}, func(c *engine.Config) { c.Checkpoint.Resume = "runs/a=b" }},
		{"spaces", []string{" train.steps = 50 "}, func(c *engine.Config) { c.Train.Steps = 50 }},
		{"uint", []string{"train.seed=42"}, func(c *engine.Config) { c.Train.Seed = 42 }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, snap, err := Parse("r.yaml", []byte(base), tc.sets)
			if err != nil {
				t.Fatal(err)
			}
			want := engine.DefaultConfig()
			want.Train.LR = 1e-3
			tc.want(&want)
			if !reflect.DeepEqual(got, want) {
				t.Errorf("got\n%+v\nwant\n%+v", got, want)
			}
			for _, s := range tc.sets {
				if !strings.Contains(string(snap), "--set "+quote(s)) {
					t.Errorf("the snapshot does not name --set %s:\n%s", s, snap)
				}
			}
		})
	}
}

func TestOverrideErrors(t *testing.T) {
	cases := []struct {
		set, want string
	}{
		{"train.lr", "r.yaml: --set train.lr: an override is key.path=value, for example train.lr=3e-4"},
		{"=3", "r.yaml: --set =3: an override is key.path=value, for example train.lr=3e-4"},
		{"train.lr_max=1", `r.yaml: --set train.lr_max=1: unknown field "lr_max" in section train; the fields are backend, global_batch, micro_batch, seq, steps, lr, min_lr, schedule, warmup_steps, decay_steps, weight_decay, beta1, beta2, eps, grad_clip, seed, eval_every, eval_batches, deterministic, recompute, optimizer_in_backward, master_weights`},
		{"model.moe.topk=1", `r.yaml: --set model.moe.topk=1: unknown field "topk" in section model.moe; did you mean "top_k"?`},
		{"optim.lr=1", `r.yaml: --set optim.lr=1: unknown section "optim"; the sections are model, data, train, parallel, checkpoint, log`},
		{"model=1", "r.yaml: --set model=1: model is a section; set one of its fields, for example model.vocab"},
		{"model.moe=1", "r.yaml: --set model.moe=1: model.moe is a section; set one of its fields, for example model.moe.experts"},
		{"train.lr.x=1", `r.yaml: --set train.lr.x=1: train.lr is a single value and has no field "x"`},
		{"train.lr=abc", `r.yaml: --set train.lr=abc: train.lr must be a number, got "abc"`},
		{"train.steps=1.5", "r.yaml: --set train.steps=1.5: train.steps must be an integer, got 1.5, which is not a whole number"},
		{"train.steps=", `r.yaml: --set train.steps=: train.steps must be an integer, got ""`},
		{"checkpoint.async=on", `r.yaml: --set checkpoint.async=on: checkpoint.async must be true or false, got "on"`},
		{"train.seed=-3", `r.yaml: --set train.seed=-3: train.seed must be a non-negative integer, got "-3"`},
		{"data.train=\xff", `r.yaml: --set data.train=` + "\xff" + `: data.train must be UTF-8 text, got "\xff"`},
		// Validate's sentences, placed at the override that set the field.
		{"model.moe.top_k=3", "r.yaml: --set model.moe.top_k=3: model.moe.top_k (3) cannot exceed model.moe.experts (2)"},
		{"train.lr=-0.001", "r.yaml: --set train.lr=-0.001: train.lr must be positive, got -0.001"},
	}
	for _, tc := range cases {
		_, _, err := Parse("r.yaml", []byte("model:\n  moe:\n    experts: 2\n"), []string{tc.set})
		if err == nil {
			t.Errorf("--set %s: no error", tc.set)
			continue
		}
		if got := errorLines(t, err, "r.yaml"); len(got) != 1 || got[0] != tc.want {
			t.Errorf("--set %s:\n got %q\nwant %q", tc.set, got, tc.want)
		}
	}
	// Every bad override is reported, beside the file's own problems.
	_, _, err := Parse("r.yaml", []byte("train:\n  lr: x\n"), []string{"a=1", "train.steps=x"})
	if got := errorLines(t, err, "r.yaml"); len(got) != 3 {
		t.Errorf("want 3 problems, got %q", got)
	}
}

// TestCanonicalRoundTrip writes random configurations, with strings chosen to
// trip YAML's quoting, and wants each to read back exactly.
func TestCanonicalRoundTrip(t *testing.T) {
	rng := newRand(7)
	for i := range 300 {
		cfg := randomConfig(rng)
		d := decoder{file: "canonical", lines: map[string]int{}}
		got := engine.DefaultConfig()
		d.document(Canonical(cfg), &got)
		if len(d.errs) > 0 {
			t.Fatalf("config %d: %v\n%s", i, errors.Join(d.errs...), Canonical(cfg))
		}
		if !reflect.DeepEqual(got, cfg) {
			t.Fatalf("config %d reads back as\n%+v\nwant\n%+v\n%s", i, got, cfg, Canonical(cfg))
		}
	}
}

// TestHash wants the digest of the canonical YAML, and a different hash for
// a change to any one field.
func TestHash(t *testing.T) {
	cfg := engine.DefaultConfig()
	sum := sha256.Sum256(Canonical(cfg))
	if got, want := Hash(cfg), hex.EncodeToString(sum[:8]); got != want {
		t.Fatalf("Hash = %s, want %s", got, want)
	}
	seen := map[string]string{Hash(cfg): "the default"}
	for _, l := range leaves() {
		c := engine.DefaultConfig()
		v, err := lookup(&c, l.path)
		if err != nil {
			t.Fatal(err)
		}
		switch v.Kind() {
		case reflect.Int:
			v.SetInt(v.Int() + 1)
		case reflect.Uint64:
			v.SetUint(v.Uint() + 1)
		case reflect.Float64:
			v.SetFloat(v.Float()*2 + 0.5)
		case reflect.String:
			v.SetString(v.String() + "x")
		case reflect.Bool:
			v.SetBool(!v.Bool())
		}
		h := Hash(c)
		if other, dup := seen[h]; dup {
			t.Errorf("changing %s gives the hash of %s", l.path, other)
		}
		seen[h] = l.path
	}
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.FromSlash(path))
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// errorLines checks that err joins *Errors about file and returns their texts.
func errorLines(t *testing.T, err error, file string) []string {
	t.Helper()
	if err == nil {
		return nil
	}
	joined, ok := err.(interface{ Unwrap() []error })
	if !ok {
		t.Fatalf("%T is not a joined error: %v", err, err)
	}
	var out []string
	for _, e := range joined.Unwrap() {
		var re *Error
		if !errors.As(e, &re) || re.File != file {
			t.Fatalf("problem %q is %T, want *Error about %s", e, e, file)
		}
		out = append(out, e.Error())
	}
	return out
}

// TestProblemsCapped: a recipe of many problems reports the first
// maxProblems and counts the rest, rather than printing every one.
func TestProblemsCapped(t *testing.T) {
	var b strings.Builder
	b.WriteString("train:\n")
	for i := range maxProblems + 5 {
		fmt.Fprintf(&b, "  unknown_%d: 1\n", i)
	}
	_, _, err := Parse("r.yaml", []byte(b.String()), nil)
	if err == nil {
		t.Fatal("a recipe of unknown fields was accepted")
	}
	lines := strings.Split(err.Error(), "\n")
	if len(lines) != maxProblems+1 {
		t.Fatalf("%d lines of problems, want %d:\n%s", len(lines), maxProblems+1, err)
	}
	if last := lines[len(lines)-1]; last != "r.yaml: and 5 more problems" {
		t.Errorf("last line %q, want the count of the rest", last)
	}
}

// TestLoadRefusesHugeFiles: Load reads at most MaxRecipeBytes, so a wrong
// path (an endless device, a data file) is an error, not an exhausted
// memory.
func TestLoadRefusesHugeFiles(t *testing.T) {
	big := filepath.Join(t.TempDir(), "big.yaml")
	if err := os.WriteFile(big, []byte("# "+strings.Repeat("x", MaxRecipeBytes)+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	paths := []string{big}
	if _, err := os.Stat("/dev/zero"); err == nil {
		paths = append(paths, "/dev/zero")
	}
	for _, p := range paths {
		_, _, err := Load(p, nil)
		if err == nil || !strings.Contains(err.Error(), "larger than") || !strings.Contains(err.Error(), p) {
			t.Errorf("Load(%s): %v, want a refusal naming the file and its size", p, err)
		}
	}
}
