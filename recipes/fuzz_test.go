package recipes

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

// brokenRecipes are seeds that each break a recipe in a different way.
var brokenRecipes = []string{
	"",
	"---\n",
	"model: {dim: 64, heads: 6}\n",
	"model:\n  moe:\n    top_k: 3\n    experts: 2\n",
	"train:\n  lr: -0.001\n  lr_max: 1\n",
	"train:\n  lr: .nan\n  min_lr: .inf\n",
	"train:\n  steps: 2.5\n  seed: -1\n",
	"train:\n  lr: 1\n  lr: 2\n",
	"a: &a [*a]\n",
	"x: &x 1\ntrain: *x\n",
	"train: &t\n  steps: 100\nlog: *t\n",
	"model:\n  dim: 99999999999999999999999\n",
	"- 1\n- 2\n",
	"model: [1, {2: 3}]\n",
	"? [a, b]\n: c\n",
	"train:\n  lr: 1\n---\ntrain:\n  lr: 2\n",
	"train:\n\tlr: 1\n",
	"data:\n  train: \"\\xff\"\n",
	"checkpoint:\n  async: yes\n  resume:\n",
	"parallel: {dp: 4611686018427387904, ep: 4}\n",
	"<<: {train: {lr: 1}}\n",
	"!!binary aGVsbG8=\n",
	"model:\n  vocab: !!float 1e3\n",
}

// FuzzParse wants Parse never to panic, to return either a configuration or
// problems that each name the file, and a snapshot that reads back as the
// same configuration.
func FuzzParse(f *testing.F) {
	for _, name := range Shipped() {
		data, err := shipped.ReadFile(name + ".yaml")
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
		// The same recipe cut short, and with a line indented wrongly.
		f.Add(data[:len(data)/2])
		f.Add([]byte(strings.Replace(string(data), "\n  dim:", "\n dim:", 1)))
	}
	for _, s := range brokenRecipes {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		checkParse(t, data, nil)
	})
}

// FuzzOverride does the same for one --set argument on the tiny recipe.
func FuzzOverride(f *testing.F) {
	for _, s := range []string{"train.lr=3e-4", "model.moe.top_k=1", "checkpoint.async=true", "data.train=",
		"train.steps=1e3", "model=1", "train.lr.x=2", "=", "", "log.level=\x00", "train.seed=-0", "parallel.ep=2"} {
		f.Add(s)
	}
	tiny, err := shipped.ReadFile("tiny.yaml")
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, set string) {
		checkParse(t, tiny, []string{set})
	})
}

func checkParse(t *testing.T, data []byte, sets []string) {
	cfg, snap, err := Parse("fuzz.yaml", data, sets)
	if err != nil {
		var problems []error
		if joined, ok := err.(interface{ Unwrap() []error }); ok {
			problems = joined.Unwrap()
		}
		if len(problems) == 0 {
			t.Fatalf("error %T is not a list of problems: %v", err, err)
		}
		for _, p := range problems {
			var re *Error
			if !errors.As(p, &re) || re.File != "fuzz.yaml" || re.Err == nil {
				t.Fatalf("problem %q (%T) does not name the file", p, p)
			}
		}
		if snap != nil {
			t.Fatal("a snapshot came with an error")
		}
		return
	}
	if err := cfg.Validate(); err != nil {
		t.Fatalf("Parse returned a config that does not validate: %v", err)
	}
	again, snap2, err := Parse("snapshot", snap, nil)
	if err != nil {
		t.Fatalf("the snapshot does not parse: %v\n%s", err, snap)
	}
	if !reflect.DeepEqual(again, cfg) || Hash(again) != Hash(cfg) {
		t.Fatalf("the snapshot reads back as another config:\n%s\n%s", snap, snap2)
	}
}
