package tune_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cpu"
	"github.com/mktrain/mktrain/moe"
	"github.com/mktrain/mktrain/tune"
)

// elsewhere is the CPU backend under another name, so that auto treats it
// as a machine worth measuring.
type elsewhere struct{ *cpu.Backend }

func (elsewhere) Name() string { return "elsewhere" }

// named is a backend that tells its device's name; wrapped hides a
// backend behind a profiler-like wrapper.
type named struct{ *cpu.Backend }

func (named) DeviceName() string { return "Device 9" }

// versioned is a backend that tells its software's versions.
type versioned struct{ *cpu.Backend }

func (versioned) SoftwareVersions() string { return "driver 13.0" }

type wrapped struct{ backend.Backend }

func (w wrapped) Inner() backend.Backend { return w.Backend }

func selectConfig() moe.Config {
	return moe.Config{Experts: 4, TopK: 2, FFN: 24, Dispatcher: moe.DispatcherAuto}
}

func TestMachineName(t *testing.T) {
	c := cpu.New(backend.Float32)
	for _, tc := range []struct {
		b    backend.Backend
		want string
	}{
		{c, "cpu"}, {wrapped{c}, "cpu"}, {named{c}, "cpu/Device 9"}, {wrapped{named{c}}, "cpu/Device 9"}, {elsewhere{c}, "elsewhere"},
	} {
		if got := tune.MachineName(tc.b); got != tc.want {
			t.Errorf("%T: %q, want %q", tc.b, got, tc.want)
		}
	}
	for _, tc := range []struct {
		b    backend.Backend
		want string
	}{{c, ""}, {named{c}, ""}, {versioned{c}, "driver 13.0"}, {wrapped{versioned{c}}, "driver 13.0"}} {
		if got := tune.SoftwareName(tc.b); got != tc.want {
			t.Errorf("SoftwareName(%T): %q, want %q", tc.b, got, tc.want)
		}
	}
	if k := tune.NewDispatchKey(versioned{c}, selectConfig(), 16, 40, 2); k.Software != "driver 13.0" ||
		!strings.Contains(k.String(), "driver 13.0") {
		t.Errorf("key %+v: %s", k, k)
	}
}

// TestDispatchCache: entries are stored and found by key, replaced for the
// same key, written whole (no temporary file left, valid JSON), and a
// damaged or foreign file does not stop a Store.
func TestDispatchCache(t *testing.T) {
	dir := t.TempDir()
	c := tune.DispatchCache{Path: filepath.Join(dir, "sub", "dispatch.json")}
	k1 := tune.DispatchKey{Machine: "cuda/X", Kernels: "0123456789ab", Dim: 1024, FFN: 2816, Experts: 8, TopK: 2, Tokens: 16384, EP: 8}
	k2 := k1
	k2.EP = 4
	// Other kernels, or another driver: not k1's measurement.
	k3 := k1
	k3.Kernels = "ba9876543210"
	k4 := k1
	k4.Software = "driver 13.1"
	if _, ok, err := c.Lookup(k1); ok || err != nil {
		t.Fatalf("empty table: %v, %v", ok, err)
	}
	ms := time.Millisecond
	fused := moe.Timing{Iters: 5, FusedStep: ms, UnfusedStep: 2 * ms, FusedForward: ms / 2, UnfusedForward: ms}
	unfused := moe.Timing{Iters: 5, FusedStep: 3 * ms, UnfusedStep: 2 * ms}
	if _, err := c.Store(k1, fused); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Store(k2, unfused); err != nil {
		t.Fatal(err)
	}
	for _, w := range []struct {
		k    tune.DispatchKey
		want string
	}{{k1, moe.DispatcherFused}, {k2, moe.DispatcherUnfused}} {
		e, ok, err := c.Lookup(w.k)
		if err != nil || !ok || e.Choice != w.want || e.DispatchKey != w.k || e.Iters != 5 {
			t.Errorf("%v: %+v, %v, %v; want %s", w.k, e, ok, err, w.want)
		}
	}
	if _, ok, err := c.Lookup(k3); ok || err != nil {
		t.Errorf("k1's shape with other kernels: found %v, %v", ok, err)
	}
	if _, ok, err := c.Lookup(k4); ok || err != nil {
		t.Errorf("k1's shape under another driver: found %v, %v", ok, err)
	}
	e, _, _ := c.Lookup(k1)
	if e.FusedMS != 1 || e.UnfusedMS != 2 || e.FusedForwardMS != 0.5 || e.UnfusedForwardMS != 1 || e.MeasuredAt.IsZero() {
		t.Errorf("entry %+v", e)
	}
	// The same key again: replaced, not added.
	if _, err := c.Store(k1, unfused); err != nil {
		t.Fatal(err)
	}
	if e, _, _ := c.Lookup(k1); e.Choice != moe.DispatcherUnfused {
		t.Errorf("k1 after a second Store: %+v", e)
	}
	var table struct {
		Version int               `json:"version"`
		Entries []json.RawMessage `json:"entries"`
	}
	buf, err := os.ReadFile(c.Path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(buf, &table); err != nil || table.Version != 3 || len(table.Entries) != 2 {
		t.Errorf("table %s: version %d, %d entries, %v", buf, table.Version, len(table.Entries), err)
	}
	files, _ := os.ReadDir(filepath.Dir(c.Path))
	if len(files) != 1 {
		t.Errorf("files beside the table: %v", files)
	}

	// A damaged table is an error to Lookup and replaced by Store.
	if err := os.WriteFile(c.Path, []byte("{not json"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Lookup(k1); err == nil {
		t.Error("Lookup of a damaged table: no error")
	}
	if _, err := c.Store(k2, fused); err != nil {
		t.Fatal(err)
	}
	if e, ok, err := c.Lookup(k2); err != nil || !ok || e.Choice != moe.DispatcherFused {
		t.Errorf("after replacing a damaged table: %+v, %v, %v", e, ok, err)
	}
	// A table of another version is ignored.
	if err := os.WriteFile(c.Path, []byte(`{"version": 99, "entries": [{"machine": "cuda/X", "choice": "fused"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := c.Lookup(k1); ok || err != nil {
		t.Errorf("a table of version 99: %v, %v", ok, err)
	}
}

func TestDefaultDispatchCache(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("MKTRAIN_CACHE_DIR", dir)
	c, err := tune.DefaultDispatchCache()
	if err != nil || c.Path != filepath.Join(dir, "dispatch.json") {
		t.Errorf("MKTRAIN_CACHE_DIR: %q, %v", c.Path, err)
	}
	t.Setenv("MKTRAIN_CACHE_DIR", "")
	base, err := os.UserCacheDir()
	if err != nil {
		t.Skip("no user cache directory: ", err)
	}
	c, err = tune.DefaultDispatchCache()
	if err != nil || c.Path != filepath.Join(base, "mktrain", "dispatch.json") {
		t.Errorf("default: %q, %v", c.Path, err)
	}
}

// resolve runs ResolveDispatcher on a small layer of 2 ranks and returns
// the choice and what it logged.
func resolve(t *testing.T, b backend.Backend, dispatcher string, canPeer bool) (string, string, error) {
	t.Helper()
	cfg := selectConfig()
	cfg.Dispatcher = dispatcher
	var log []string
	got, err := tune.ResolveDispatcher(b, cfg, 16, 40, 2, canPeer, func(s string) { log = append(log, s) })
	return got, strings.Join(log, "\n"), err
}

func TestResolveDispatcher(t *testing.T) {
	cache := t.TempDir()
	t.Setenv("MKTRAIN_CACHE_DIR", cache)
	table := filepath.Join(cache, "dispatch.json")
	c := cpu.New(backend.Float32)
	other := elsewhere{c}

	// Explicit values pass; fused needs peer access; unknown values fail.
	for _, d := range []string{moe.DispatcherFused, moe.DispatcherUnfused} {
		if got, _, err := resolve(t, other, d, true); got != d || err != nil {
			t.Errorf("%s: %q, %v", d, got, err)
		}
	}
	if got, _, err := resolve(t, other, moe.DispatcherUnfused, false); got != moe.DispatcherUnfused || err != nil {
		t.Errorf("unfused without peer access: %q, %v", got, err)
	}
	if _, _, err := resolve(t, other, moe.DispatcherFused, false); err == nil || !strings.Contains(err.Error(), "peer access") {
		t.Errorf("fused without peer access: %v", err)
	}
	if _, _, err := resolve(t, other, "quick", true); err == nil || !strings.Contains(err.Error(), "model.moe.dispatcher") {
		t.Errorf("unknown dispatcher: %v", err)
	}

	// auto without peer access, and on the CPU: unfused, unmeasured.
	for _, d := range []string{moe.DispatcherAuto, ""} {
		if got, log, err := resolve(t, other, d, false); got != moe.DispatcherUnfused || err != nil || !strings.Contains(log, "no peer access") {
			t.Errorf("%q without peer access: %q, %v, %q", d, got, err, log)
		}
		if got, log, err := resolve(t, c, d, true); got != moe.DispatcherUnfused || err != nil || !strings.Contains(log, "unmeasured") {
			t.Errorf("%q on the CPU: %q, %v, %q", d, got, err, log)
		}
	}
	if _, err := os.Stat(table); err == nil {
		t.Fatal("nothing was measured, but the table exists")
	}

	// auto elsewhere: measured and stored, then read from the table.
	measured, log, err := resolve(t, other, moe.DispatcherAuto, true)
	if err != nil || !strings.Contains(log, "measuring") || !strings.Contains(log, "stored in "+table) {
		t.Fatalf("first auto: %q, %v, log:\n%s", measured, err, log)
	}
	got, log, err := resolve(t, other, "", true)
	if err != nil || got != measured || !strings.Contains(log, "from the table") || strings.Contains(log, "measuring") {
		t.Errorf("second auto: %q (measured %q), %v, log:\n%s", got, measured, err, log)
	}
	// What the table says goes, whichever it is.
	key := tune.NewDispatchKey(other, selectConfig(), 16, 40, 2)
	for _, tm := range []moe.Timing{{FusedStep: 1, UnfusedStep: 2}, {FusedStep: 2, UnfusedStep: 1}} {
		if _, err := (tune.DispatchCache{Path: table}).Store(key, tm); err != nil {
			t.Fatal(err)
		}
		if got, _, err := resolve(t, other, moe.DispatcherAuto, true); got != tm.Faster() || err != nil {
			t.Errorf("table says %s: %q, %v", tm.Faster(), got, err)
		}
	}
	// Another shape is not in the table.
	cfg := selectConfig()
	cfg.TopK = 1
	var logs []string
	if _, err := tune.ResolveDispatcher(other, cfg, 16, 40, 2, true, func(s string) { logs = append(logs, s) }); err != nil ||
		!strings.Contains(strings.Join(logs, "\n"), "measuring") {
		t.Errorf("top-1: %v, log %q", err, logs)
	}

	// A table that cannot be written costs nothing but the storing.
	t.Setenv("MKTRAIN_CACHE_DIR", filepath.Join(table, "not-a-dir"))
	if got, log, err := resolve(t, other, moe.DispatcherAuto, true); err != nil || got == "" || !strings.Contains(log, "not stored") {
		t.Errorf("unwritable table: %q, %v, log:\n%s", got, err, log)
	}
}
