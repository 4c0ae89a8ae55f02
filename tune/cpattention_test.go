package tune_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/attention"
	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/tune"
)

// cpCase is a small context-parallel layer: cp 2, sequences of 16.
func cpCase(mode string) tune.CPAttentionCase {
	return tune.CPAttentionCase{Mode: mode, Shape: attention.Shape{Dim: 16, Heads: 4, KVHeads: 2, RopeTheta: 1e4},
		Batch: 2, Seq: 16, CP: 2, OneDevice: true}
}

func resolveCP(t *testing.T, b backend.Backend, c tune.CPAttentionCase) (string, string, error) {
	t.Helper()
	var logs []string
	got, err := tune.ResolveCPAttention(b, c, func(s string) { logs = append(logs, s) })
	return got, strings.Join(logs, "\n"), err
}

func TestResolveCPAttention(t *testing.T) {
	cache := t.TempDir()
	t.Setenv("MKTRAIN_CACHE_DIR", cache)
	table := filepath.Join(cache, "cp_attention.json")
	c := cpu.New(backend.Float32)
	other := elsewhere{c}

	// Explicit values pass; unknown values fail, naming the field.
	for _, m := range []string{"ring", "allgather"} {
		if got, log, err := resolveCP(t, other, cpCase(m)); got != m || err != nil || !strings.Contains(log, "as the recipe says") {
			t.Errorf("%s: %q, %v, %q", m, got, err, log)
		}
	}
	if _, _, err := resolveCP(t, other, cpCase("star")); err == nil || !strings.Contains(err.Error(), "parallel.cp_attention") {
		t.Errorf("unknown mode: %v", err)
	}

	// auto by rule: one context rank (silently), the CPU, ranks on
	// separate devices, train.deterministic.
	one := cpCase("auto")
	one.CP = 1
	if got, log, err := resolveCP(t, other, one); got != "allgather" || err != nil || log != "" {
		t.Errorf("cp 1: %q, %v, %q", got, err, log)
	}
	apart := cpCase("")
	apart.OneDevice = false
	det := cpCase("auto")
	det.Deterministic = true
	for _, x := range []struct {
		name string
		b    backend.Backend
		c    tune.CPAttentionCase
		says string
	}{
		{"cpu", c, cpCase("auto"), "on the CPU"},
		{"separate devices", other, apart, "separate GPUs or nodes"},
		{"deterministic", other, det, "train.deterministic"},
	} {
		if got, log, err := resolveCP(t, x.b, x.c); got != "allgather" || err != nil || !strings.Contains(log, x.says) || !strings.Contains(log, "unmeasured") {
			t.Errorf("%s: %q, %v, %q", x.name, got, err, log)
		}
	}
	if _, err := os.Stat(table); err == nil {
		t.Fatal("nothing was measured, but the table exists")
	}

	// auto elsewhere: measured and stored, then read from the table.
	measured, log, err := resolveCP(t, other, cpCase("auto"))
	if err != nil || !strings.Contains(log, "measuring") || !strings.Contains(log, "stored in "+table) {
		t.Fatalf("first auto: %q, %v, log:\n%s", measured, err, log)
	}
	got, log, err := resolveCP(t, other, cpCase(""))
	if err != nil || got != measured || !strings.Contains(log, "from the table") || strings.Contains(log, "measuring") {
		t.Errorf("second auto: %q (measured %q), %v, log:\n%s", got, measured, err, log)
	}
	// What the table says goes, whichever it is.
	key := tune.NewCPAttentionKey(other, cpCase("auto"))
	for _, tm := range []attention.ContextTiming{{AllGather: 1, Ring: 2}, {AllGather: 2, Ring: 1}} {
		if _, err := (tune.CPAttentionCache{Path: table}).Store(key, tm); err != nil {
			t.Fatal(err)
		}
		if got, _, err := resolveCP(t, other, cpCase("auto")); got != string(tm.Faster()) || err != nil {
			t.Errorf("table says %s: %q, %v", tm.Faster(), got, err)
		}
	}
	// Another shape is not in the table.
	longer := cpCase("auto")
	longer.Seq = 24
	if _, log, err := resolveCP(t, other, longer); err != nil || !strings.Contains(log, "measuring") {
		t.Errorf("seq 24: %v, log %q", err, log)
	}
	// A table that cannot be written costs nothing but the storing.
	t.Setenv("MKTRAIN_CACHE_DIR", filepath.Join(table, "not-a-dir"))
	if got, log, err := resolveCP(t, other, cpCase("auto")); err != nil || got == "" || !strings.Contains(log, "not stored") {
		t.Errorf("unwritable table: %q, %v, log:\n%s", got, err, log)
	}
}

func TestCPAttentionKey(t *testing.T) {
	c := cpu.New(backend.Float32)
	k := tune.NewCPAttentionKey(versioned{c}, cpCase("auto"))
	if k.Machine != "cpu" || k.Software != "driver 13.0" || k.Kernels == "" || k.HeadDim != 4 || k.CP != 2 {
		t.Errorf("key %+v", k)
	}
	for _, want := range []string{"cpu (kernels", "driver 13.0", "4 heads over 2 kv heads of 4", "2 sequences of 16", "cp 2"} {
		if !strings.Contains(k.String(), want) {
			t.Errorf("%q lacks %q", k.String(), want)
		}
	}
}
