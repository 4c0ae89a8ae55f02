package tune_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
)

// resolverTest is what the auto resolvers' tests share: a resolver, its
// recipe field and table, and how to make its cases.
type resolverTest[C any] struct {
	field    string   // the recipe field an unknown value's error names
	table    string   // the table's file name in the cache directory
	explicit []string // the values a recipe may set, taken as they are
	unknown  string   // a value the resolver refuses
	rule     string   // what auto settles on by rule, unmeasured
	newCase  func(mode string) C
	// single makes a case of one rank (auto then settles silently), apart
	// one of ranks on separate devices, deterministic one under
	// train.deterministic.
	single, apart, deterministic func(*C)
	resolve                      func(b backend.Backend, c C, log func(string)) (string, error)
}

// run resolves c on b and returns the answer and the log's lines.
func (r resolverTest[C]) run(t *testing.T, b backend.Backend, c C) (string, string, error) {
	t.Helper()
	var logs []string
	got, err := r.resolve(b, c, func(s string) { logs = append(logs, s) })
	return got, strings.Join(logs, "\n"), err
}

// with is r's case for mode, changed by change.
func (r resolverTest[C]) with(mode string, change func(*C)) C {
	c := r.newCase(mode)
	change(&c)
	return c
}

// checkShared runs the checks every resolver passes, in a fresh cache
// directory: explicit values pass and unknown ones fail naming the field;
// auto settles by rule, unmeasured, with one rank, on the CPU, across
// devices and under train.deterministic, and writes no table; elsewhere
// auto measures and stores, then reads the table. It returns the table's
// path, the backend that is not the CPU's, and the measured answer.
func (r resolverTest[C]) checkShared(t *testing.T) (table string, other backend.Backend, measured string) {
	t.Helper()
	cache := t.TempDir()
	t.Setenv("MKTRAIN_CACHE_DIR", cache)
	table = filepath.Join(cache, r.table)
	c := cpu.New(backend.Float32)
	other = elsewhere{c}

	for _, m := range r.explicit {
		if got, log, err := r.run(t, other, r.newCase(m)); got != m || err != nil || !strings.Contains(log, "as the recipe says") {
			t.Errorf("%s: %q, %v, %q", m, got, err, log)
		}
	}
	if _, _, err := r.run(t, other, r.newCase(r.unknown)); err == nil || !strings.Contains(err.Error(), r.field) {
		t.Errorf("unknown mode: %v", err)
	}

	if got, log, err := r.run(t, other, r.with("auto", r.single)); got != r.rule || err != nil || log != "" {
		t.Errorf("one rank: %q, %v, %q", got, err, log)
	}
	for _, x := range []struct {
		name string
		b    backend.Backend
		c    C
		says string
	}{
		{"cpu", c, r.newCase("auto"), "on the CPU"},
		{"separate devices", other, r.with("", r.apart), "separate GPUs or nodes"},
		{"deterministic", other, r.with("auto", r.deterministic), "train.deterministic"},
	} {
		if got, log, err := r.run(t, x.b, x.c); got != r.rule || err != nil || !strings.Contains(log, x.says) || !strings.Contains(log, "unmeasured") {
			t.Errorf("%s: %q, %v, %q", x.name, got, err, log)
		}
	}
	if _, err := os.Stat(table); err == nil {
		t.Fatal("nothing was measured, but the table exists")
	}

	measured, log, err := r.run(t, other, r.newCase("auto"))
	if err != nil || !slices.Contains(r.explicit, measured) || !strings.Contains(log, "measuring") || !strings.Contains(log, "stored in "+table) {
		t.Fatalf("first auto: %q, %v, log:\n%s", measured, err, log)
	}
	got, log, err := r.run(t, other, r.newCase(""))
	if err != nil || got != measured || !strings.Contains(log, "from the table") || strings.Contains(log, "measuring") {
		t.Errorf("second auto: %q (measured %q), %v, log:\n%s", got, measured, err, log)
	}
	return table, other, measured
}
