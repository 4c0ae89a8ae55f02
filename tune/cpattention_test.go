package tune_test

import (
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

// cpResolver is ResolveCPAttention's resolverTest.
var cpResolver = resolverTest[tune.CPAttentionCase]{
	field: "parallel.cp_attention", table: "cp_attention.json",
	explicit: []string{"ring", "allgather"}, unknown: "star", rule: "allgather",
	newCase:       cpCase,
	single:        func(c *tune.CPAttentionCase) { c.CP = 1 },
	apart:         func(c *tune.CPAttentionCase) { c.OneDevice = false },
	deterministic: func(c *tune.CPAttentionCase) { c.Deterministic = true },
	resolve:       tune.ResolveCPAttention,
}

// TestResolveCPAttention: the checks every resolver passes, then the
// table's answers, another shape and an unwritable table.
func TestResolveCPAttention(t *testing.T) {
	table, other, _ := cpResolver.checkShared(t)
	resolveCP := cpResolver.run
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
