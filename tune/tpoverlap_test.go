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

// tpCase is a small tensor-parallel layer: tp 2 over 32 rows, sequence
// parallel.
func tpCase(mode string) tune.TPOverlapCase {
	return tune.TPOverlapCase{Mode: mode, Shape: attention.Shape{Dim: 16, Heads: 4, KVHeads: 2, RopeTheta: 1e4},
		Rows: 32, TP: 2, SequenceParallel: true, OneDevice: true}
}

// tpResolver is ResolveTPOverlap's resolverTest.
var tpResolver = resolverTest[tune.TPOverlapCase]{
	field: "parallel.tp_overlap", table: "tp_overlap.json",
	explicit: []string{"fused", "unfused"}, unknown: "overlapped", rule: "unfused",
	newCase:       tpCase,
	single:        func(c *tune.TPOverlapCase) { c.TP = 1 },
	apart:         func(c *tune.TPOverlapCase) { c.OneDevice = false },
	deterministic: func(c *tune.TPOverlapCase) { c.Deterministic = true },
	resolve:       tune.ResolveTPOverlap,
}

// TestResolveTPOverlap: the checks every resolver passes (on the virtual
// ranks' peer access auto measures the fused path), then the table's
// answers, other cases and an unwritable table.
func TestResolveTPOverlap(t *testing.T) {
	table, other, _ := tpResolver.checkShared(t)
	resolveTP := tpResolver.run
	// What the table says goes, whichever it is.
	key := tune.NewTPOverlapKey(other, tpCase("auto"))
	for _, tm := range []tune.TPOverlapTiming{{Fused: 1, Unfused: 2}, {Fused: 2, Unfused: 1}, {Fused: 1, Unfused: 1}} {
		if _, err := (tune.TPOverlapCache{Path: table}).Store(key, tm); err != nil {
			t.Fatal(err)
		}
		if got, _, err := resolveTP(t, other, tpCase("auto")); got != tm.Faster() || err != nil {
			t.Errorf("table says %s: %q, %v", tm.Faster(), got, err)
		}
	}
	if (tune.TPOverlapTiming{Fused: 1, Unfused: 1}).Faster() != "unfused" {
		t.Error("a tie does not go to unfused, the reference")
	}
	// Another case is not in the table: replicated rows (tp 4, the kv
	// heads then replicated), and another row count.
	for _, change := range []func(*tune.TPOverlapCase){
		func(c *tune.TPOverlapCase) { c.SequenceParallel = false; c.TP = 4 },
		func(c *tune.TPOverlapCase) { c.Rows = 48 },
	} {
		x := tpCase("auto")
		change(&x)
		if got, log, err := resolveTP(t, other, x); err != nil || got == "" || !strings.Contains(log, "measuring") {
			t.Errorf("%+v: %q, %v, log %q", x, got, err, log)
		}
	}
	// A table that cannot be written costs nothing but the storing.
	t.Setenv("MKTRAIN_CACHE_DIR", filepath.Join(table, "not-a-dir"))
	if got, log, err := resolveTP(t, other, tpCase("auto")); err != nil || got == "" || !strings.Contains(log, "not stored") {
		t.Errorf("unwritable table: %q, %v, log:\n%s", got, err, log)
	}
}

// MeasureTPOverlap refuses cases it cannot split, naming what.
func TestMeasureTPOverlapRefuses(t *testing.T) {
	b := elsewhere{cpu.New(backend.Float32)}
	for _, x := range []struct {
		change func(*tune.TPOverlapCase)
		says   string
	}{
		{func(c *tune.TPOverlapCase) { c.TP = 1 }, "at least 2"},
		{func(c *tune.TPOverlapCase) { c.Rows = 33 }, "33 rows over 2 ranks"},
		{func(c *tune.TPOverlapCase) { c.TP = 8 }, "cannot split over 8"},
	} {
		c := tpCase("auto")
		x.change(&c)
		if _, err := tune.MeasureTPOverlap(b, c, 1); err == nil || !strings.Contains(err.Error(), x.says) {
			t.Errorf("%+v: %v, want an error saying %q", c, err, x.says)
		}
	}
}

func TestTPOverlapKey(t *testing.T) {
	c := cpu.New(backend.Float32)
	k := tune.NewTPOverlapKey(versioned{c}, tpCase("auto"))
	if k.Machine != "cpu" || k.Software != "driver 13.0" || k.Kernels == "" || k.Dim != 16 || k.TP != 2 || !k.SequenceParallel {
		t.Errorf("key %+v", k)
	}
	for _, want := range []string{"cpu (kernels", "driver 13.0", "dim 16, 4 heads over 2 kv heads", "32 rows", "tp 2", "sequence parallel"} {
		if !strings.Contains(k.String(), want) {
			t.Errorf("%q lacks %q", k.String(), want)
		}
	}
}
