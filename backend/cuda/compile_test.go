package cuda

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
)

func TestCacheKey(t *testing.T) {
	opts := compileOptions("sm_90a")
	base := cacheKey("src", "sm_90a", opts, 13, 0)
	if len(base) != 64 {
		t.Fatalf("key %q is not a hex sha256", base)
	}
	if cacheKey("src", "sm_90a", opts, 13, 0) != base {
		t.Fatal("key is not deterministic")
	}
	for name, k := range map[string]string{
		"source":  cacheKey("src ", "sm_90a", opts, 13, 0),
		"arch":    cacheKey("src", "sm_90", compileOptions("sm_90"), 13, 0),
		"options": cacheKey("src", "sm_90a", append(opts[:len(opts):len(opts)], "-G"), 13, 0),
		"nvrtc":   cacheKey("src", "sm_90a", opts, 13, 1),
		"defines": cacheKey("src", "sm_90a", compileOptions("sm_90a", "MOE_TEST_LOST_ROWS=1"), 13, 0),
		// Field boundaries matter: moving text between fields changes the key.
		"boundary": cacheKey("srcsm_90a", "", opts, 13, 0),
	} {
		if k == base {
			t.Errorf("changing the %s does not change the key", name)
		}
	}
}

// TestCompileOptionsDefines: a variant's defines follow the fixed options
// as -D arguments, and no defines leave the options (and so the cache keys
// of the sources as used) as they were.
func TestCompileOptionsDefines(t *testing.T) {
	plain := compileOptions("sm_90a")
	if want := []string{"--gpu-architecture=sm_90a", "--std=c++17", "-lineinfo"}; !slices.Equal(plain, want) {
		t.Errorf("options %q, want %q", plain, want)
	}
	got := compileOptions("sm_90a", "A=1", "B=2")
	if want := append(plain[:len(plain):len(plain)], "-DA=1", "-DB=2"); !slices.Equal(got, want) {
		t.Errorf("options with defines %q, want %q", got, want)
	}
}

func TestCachedCompile(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a", "b") // created on first write
	calls := 0
	compile := func() ([]byte, string, error) {
		calls++
		return []byte("cubin bytes"), "a warning", nil
	}
	img, info, err := cachedCompile(dir, "k1", false, compile)
	if err != nil || info.CacheHit || info.CacheErr != nil || calls != 1 || info.Log != "a warning" {
		t.Fatalf("first: %q %+v %v (calls %d)", img, info, err, calls)
	}
	img2, info2, err := cachedCompile(dir, "k1", false, compile)
	if err != nil || !info2.CacheHit || calls != 1 || !bytes.Equal(img, img2) {
		t.Fatalf("second: %q %+v %v (calls %d)", img2, info2, err, calls)
	}
	// skipRead recompiles and rewrites.
	if _, info3, _ := cachedCompile(dir, "k1", true, compile); info3.CacheHit || calls != 2 {
		t.Fatalf("skipRead: %+v, calls %d", info3, calls)
	}
	// Another key misses.
	if _, info4, _ := cachedCompile(dir, "k2", false, compile); info4.CacheHit || calls != 3 {
		t.Fatalf("other key: %+v, calls %d", info4, calls)
	}
	// No temporary files are left behind.
	entries, _ := os.ReadDir(dir)
	if len(entries) != 2 {
		t.Errorf("cache folder holds %d entries, want k1.cubin and k2.cubin", len(entries))
	}
	// A failed compile writes nothing.
	boom := errors.New("boom")
	if _, _, err := cachedCompile(dir, "k3", false, func() ([]byte, string, error) { return nil, "log", boom }); !errors.Is(err, boom) {
		t.Fatalf("compile error not returned: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "k3.cubin")); err == nil {
		t.Error("failed compile left a cache file")
	}
	// No cache: always compiles, writes nothing.
	if _, info5, _ := cachedCompile("", "k1", false, compile); info5.CacheHit || info5.CachePath != "" || calls != 4 {
		t.Fatalf("no cache: %+v, calls %d", info5, calls)
	}
}

func TestCachedCompileUnwritable(t *testing.T) {
	// A file where the cache folder should be: the write fails, the
	// compile still succeeds and says why nothing was cached.
	parent := t.TempDir()
	blocker := filepath.Join(parent, "kernels")
	if err := os.WriteFile(blocker, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	img, info, err := cachedCompile(blocker, "k", false, func() ([]byte, string, error) { return []byte("x"), "", nil })
	if err != nil || string(img) != "x" || info.CacheErr == nil {
		t.Fatalf("got %q %+v %v", img, info, err)
	}
}

func TestCachedCompileConcurrent(t *testing.T) {
	dir := t.TempDir()
	want := bytes.Repeat([]byte("0123456789"), 100000)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			img, _, err := cachedCompile(dir, "same", false, func() ([]byte, string, error) { return want, "", nil })
			if err != nil || !bytes.Equal(img, want) {
				t.Errorf("concurrent compile: %v", err)
			}
		}()
	}
	wg.Wait()
	got, err := os.ReadFile(filepath.Join(dir, "same.cubin"))
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("cache file torn or missing: %d bytes, %v", len(got), err)
	}
}

func TestDefaultKernelCacheDirAndArch(t *testing.T) {
	env := func(kv map[string]string) func(string) string { return func(k string) string { return kv[k] } }
	for _, c := range []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{"XDG_CACHE_HOME": "/x", "HOME": "/h"}, "/x/mktrain/kernels"},
		{map[string]string{"XDG_CACHE_HOME": "relative", "HOME": "/h"}, "/h/.cache/mktrain/kernels"},
		{map[string]string{"HOME": "/h"}, "/h/.cache/mktrain/kernels"},
		{nil, ""},
	} {
		if got := DefaultKernelCacheDir(env(c.env)); got != c.want {
			t.Errorf("DefaultKernelCacheDir(%v) = %q, want %q", c.env, got, c.want)
		}
	}
	for cc, want := range map[[2]int]string{{9, 0}: "sm_90a", {8, 0}: "sm_80", {8, 9}: "sm_89", {10, 0}: "sm_100", {12, 0}: "sm_120"} {
		if got := Arch(cc[0], cc[1]); got != want {
			t.Errorf("Arch(%d.%d) = %s, want %s", cc[0], cc[1], got, want)
		}
	}
}

func TestArgBits(t *testing.T) {
	for _, c := range []struct {
		v    any
		want uint64
	}{
		{int32(-1), 0xffffffff},
		{uint32(7), 7},
		{int64(-2), 0xfffffffffffffffe},
		{float32(1), 0x3f800000},
		{float64(1), 0x3ff0000000000000},
		{(*Buffer)(nil), 0},
		{&Buffer{ptr: 0x1000}, 0x1000},
	} {
		got, err := argBits(c.v)
		if err != nil || got != c.want {
			t.Errorf("argBits(%T %v) = %#x, %v; want %#x", c.v, c.v, got, err, c.want)
		}
	}
	for _, bad := range []any{3, "x", &Buffer{}} {
		if _, err := argBits(bad); err == nil {
			t.Errorf("argBits(%T) accepted", bad)
		}
	}
}
