package driver

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// fakeTree is a temporary root with files at the given absolute paths.
func fakeTree(t *testing.T, files ...string) string {
	t.Helper()
	root := t.TempDir()
	for _, f := range files {
		p := filepath.Join(root, f)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("not really ELF"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func envOf(kv map[string]string) func(string) string {
	return func(k string) string { return kv[k] }
}

func TestFindOrder(t *testing.T) {
	const (
		override = "/opt/mine/libcuda.so.1"
		libDir   = "/opt/libdir"
		ldPath   = "/opt/ldpath"
		cudaHome = "/opt/cuda-13"
		wheel    = "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib"
		venv     = "/home/u/venv/lib/python3.11/site-packages/nvidia/nccl/lib"
	)
	system := systemDirs()[1] // /usr/lib/<arch>-linux-gnu
	root := fakeTree(t,
		override,
		libDir+"/libnvrtc.so.12",
		ldPath+"/libnvrtc.so.13", ldPath+"/libcuda.so.1",
		cudaHome+"/lib64/libcublasLt.so.12",
		wheel+"/libcublasLt.so.13", wheel+"/libnvrtc.so.13",
		venv+"/libnccl.so.2",
		system+"/libnccl.so.2",
	)
	env := map[string]string{
		"MKTRAIN_LIBCUDA":      override,
		"MKTRAIN_CUDA_LIB_DIR": "/nonexistent:" + libDir,
		"LD_LIBRARY_PATH":      ldPath,
		"CUDA_HOME":            cudaHome,
		"VIRTUAL_ENV":          "/home/u/venv",
	}
	s := Search{Getenv: envOf(env), Root: root}
	want := []struct {
		lib  Lib
		path string
		via  string
	}{
		{LibCUDA, override, "MKTRAIN_LIBCUDA"},
		// An earlier place with the older version beats a later place
		// with the newer one: the user's order is respected.
		{LibNVRTC, libDir + "/libnvrtc.so.12", EnvLibDir},
		{LibCublasLt, cudaHome + "/lib64/libcublasLt.so.12", "CUDA_HOME"},
		{LibNCCL, venv + "/libnccl.so.2", "Python wheel"},
	}
	for _, w := range want {
		f, err := s.Find(w.lib)
		if err != nil {
			t.Fatalf("%v: %v", w.lib, err)
		}
		if f.Path != filepath.Join(root, w.path) || f.Via != w.via {
			t.Errorf("%v: found %s via %s, want %s via %s", w.lib, f.Path, f.Via, w.path, w.via)
		}
	}

	// Without the overrides: LD_LIBRARY_PATH, then the wheel folder.
	delete(env, "MKTRAIN_LIBCUDA")
	delete(env, "MKTRAIN_CUDA_LIB_DIR")
	delete(env, "CUDA_HOME")
	delete(env, "VIRTUAL_ENV")
	for lib, w := range map[Lib]string{
		LibCUDA:     ldPath + "/libcuda.so.1",
		LibNVRTC:    ldPath + "/libnvrtc.so.13",
		LibCublasLt: wheel + "/libcublasLt.so.13",
		LibNCCL:     system + "/libnccl.so.2",
	} {
		f, err := s.Find(lib)
		if err != nil {
			t.Fatalf("%v: %v", lib, err)
		}
		if f.Path != filepath.Join(root, w) {
			t.Errorf("%v: found %s via %s, want %s", lib, f.Path, f.Via, w)
		}
	}
}

func TestFindNewestInOnePlace(t *testing.T) {
	dir := "/opt/both"
	root := fakeTree(t, dir+"/libnvrtc.so.12", dir+"/libnvrtc.so.13")
	f, err := Search{Getenv: envOf(map[string]string{"LD_LIBRARY_PATH": dir}), Root: root}.Find(LibNVRTC)
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(f.Path) != "libnvrtc.so.13" {
		t.Errorf("found %s, want libnvrtc.so.13", f.Path)
	}
}

func TestFindOverrideFolderAndMistakes(t *testing.T) {
	root := fakeTree(t, "/opt/nv/libnccl.so.2", "/usr/lib/x86_64-linux-gnu/libnccl.so.2")
	s := Search{Getenv: envOf(map[string]string{"MKTRAIN_LIBNCCL": "/opt/nv"}), Root: root}
	f, err := s.Find(LibNCCL)
	if err != nil || f.Path != filepath.Join(root, "/opt/nv/libnccl.so.2") {
		t.Fatalf("folder override: got %+v, %v", f, err)
	}
	// A wrong override is an error, not a silent fall-back to the copy in
	// the system folder.
	s.Getenv = envOf(map[string]string{"MKTRAIN_LIBNCCL": "/opt/typo/libnccl.so.2"})
	if _, err := s.Find(LibNCCL); err == nil || !strings.Contains(err.Error(), "MKTRAIN_LIBNCCL=/opt/typo/libnccl.so.2") {
		t.Fatalf("wrong override: err = %v", err)
	}
	s.Getenv = envOf(map[string]string{"MKTRAIN_LIBNVRTC": "/opt/nv"})
	var nf *NotFoundError
	if _, err := s.Find(LibNVRTC); !errors.As(err, &nf) {
		t.Fatalf("override folder without the library: err = %v", err)
	}
}

func TestNotFoundListsEveryPlace(t *testing.T) {
	root := fakeTree(t, "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libnvrtc.so.13")
	env := map[string]string{
		"MKTRAIN_CUDA_LIB_DIR": "/opt/a:/opt/b",
		"LD_LIBRARY_PATH":      "/opt/c",
		"CUDA_HOME":            "/opt/cuda",
		"HOME":                 "/home/u",
	}
	_, err := Search{Getenv: envOf(env), Root: root}.Find(LibCUDA)
	var nf *NotFoundError
	if !errors.As(err, &nf) {
		t.Fatalf("err = %v, want *NotFoundError", err)
	}
	msg := err.Error()
	for _, want := range []string{
		"no libcuda found (libcuda.so.1)",
		"/opt/a (MKTRAIN_CUDA_LIB_DIR)",
		"/opt/b (MKTRAIN_CUDA_LIB_DIR)",
		"/opt/c (LD_LIBRARY_PATH)",
		"/etc/ld.so.cache: not present (loader cache)",
		"/opt/cuda/lib64 (CUDA_HOME)",
		"/opt/cuda/targets/" + cudaTarget() + "/lib (CUDA_HOME)",
		"/usr/local/cuda/lib64 (CUDA toolkit)",
		"/usr/local/cuda/targets/" + cudaTarget() + "/lib (CUDA toolkit)",
		"/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib (Python wheel)",
		"/usr/local/nvidia/lib64 (system folder)",
		systemDirs()[1] + " (system folder)",
		"set MKTRAIN_LIBCUDA",
	} {
		if !strings.Contains(msg, want) {
			t.Errorf("message lacks %q:\n%s", want, msg)
		}
	}
	// With no wheel folder at all, the message still says where wheels
	// were looked for.
	_, err = Search{Getenv: envOf(nil), Root: t.TempDir()}.Find(LibNCCL)
	if err == nil || !strings.Contains(err.Error(), "no site-packages/nvidia/*/lib under /opt/torch/.venv, /usr/local, /usr (Python wheel)") {
		t.Errorf("no wheels: %v", err)
	}
	// The order of the list is the search order.
	if strings.Index(msg, "(LD_LIBRARY_PATH)") > strings.Index(msg, "(loader cache)") ||
		strings.Index(msg, "(loader cache)") > strings.Index(msg, "(Python wheel)") {
		t.Errorf("places out of order:\n%s", msg)
	}
}

// ldCacheFile builds a loader cache in glibc's new format, optionally
// behind an old-format table, mapping name -> path with the given flags.
func ldCacheFile(withOld bool, entries [][3]any) []byte {
	var strs bytes.Buffer
	type ent struct {
		flags      int32
		key, value uint32
	}
	n := len(entries)
	strBase := ldNewHeader + n*ldNewEntry
	var ents []ent
	for _, e := range entries {
		k := uint32(strBase + strs.Len())
		strs.WriteString(e[0].(string) + "\x00")
		v := uint32(strBase + strs.Len())
		strs.WriteString(e[1].(string) + "\x00")
		ents = append(ents, ent{e[2].(int32), k, v})
	}
	var b bytes.Buffer
	if withOld {
		b.WriteString(ldCacheOldMagic)
		b.WriteByte(0)
		binary.Write(&b, binary.LittleEndian, uint32(1))
		b.Write(make([]byte, ldOldEntry)) // one old entry, ignored
		for b.Len()%8 != 0 {
			b.WriteByte(0)
		}
	}
	b.WriteString(ldCacheNewMagic)
	binary.Write(&b, binary.LittleEndian, uint32(n))
	binary.Write(&b, binary.LittleEndian, uint32(strs.Len()))
	b.Write(make([]byte, 4+4+12))
	for _, e := range ents {
		binary.Write(&b, binary.LittleEndian, e.flags)
		binary.Write(&b, binary.LittleEndian, e.key)
		binary.Write(&b, binary.LittleEndian, e.value)
		b.Write(make([]byte, 4+8))
	}
	b.Write(strs.Bytes())
	return b.Bytes()
}

func TestLdCacheSynthetic(t *testing.T) {
	flags := ldCacheFlags()
	for _, withOld := range []bool{false, true} {
		data := ldCacheFile(withOld, [][3]any{
			{"libcuda.so.1", "/usr/lib/i386-linux-gnu/libcuda.so.1", int32(ldFlagELFLibc)}, // 32-bit: skipped
			{"libcuda.so.1", "/drv/libcuda.so.1", flags},
			{"libcuda.so.1", "/later/libcuda.so.1", flags}, // first entry wins
			{"libnccl.so.2", "/usr/lib/x86_64-linux-gnu/libnccl.so.2", flags},
		})
		m, err := parseLdCache(data, flags)
		if err != nil {
			t.Fatalf("withOld=%v: %v", withOld, err)
		}
		if len(m) != 2 || m["libcuda.so.1"] != "/drv/libcuda.so.1" || m["libnccl.so.2"] != "/usr/lib/x86_64-linux-gnu/libnccl.so.2" {
			t.Errorf("withOld=%v: parsed %v", withOld, m)
		}
		// Every truncation is an error, never a panic or a wrong entry.
		for cut := 0; cut < len(data)-1; cut += 7 {
			if m, err := parseLdCache(data[:cut], flags); err == nil && len(m) == 2 {
				t.Fatalf("withOld=%v: truncated at %d parsed fully", withOld, cut)
			}
		}
	}

	// Through Search: the cache under Root names a path under Root.
	root := fakeTree(t, "/drv/libcuda.so.1")
	data := ldCacheFile(false, [][3]any{{"libcuda.so.1", "/drv/libcuda.so.1", flags}})
	if err := os.MkdirAll(filepath.Join(root, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, DefaultLdCache), data, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := Search{Getenv: envOf(nil), Root: root}.Find(LibCUDA)
	if err != nil || f.Via != "loader cache" || f.Path != filepath.Join(root, "/drv/libcuda.so.1") {
		t.Fatalf("got %+v, %v", f, err)
	}
}

// TestLdCacheMatchesLdconfig compares the parser with ldconfig -p on this
// machine's real cache.
func TestLdCacheMatchesLdconfig(t *testing.T) {
	data, err := os.ReadFile(DefaultLdCache)
	if err != nil {
		t.Skipf("no %s on this machine: %v", DefaultLdCache, err)
	}
	out, err := exec.Command("ldconfig", "-p").Output()
	if err != nil {
		out, err = exec.Command("/sbin/ldconfig", "-p").Output()
	}
	if err != nil {
		t.Skipf("ldconfig -p: %v", err)
	}
	m, err := parseLdCache(data, ldCacheFlags())
	if err != nil {
		t.Fatal(err)
	}
	arch := "x86-64"
	if ldCacheFlags()&0x0f00 == 0x0a00 {
		arch = "AArch64"
	}
	n := 0
	for _, line := range strings.Split(string(out), "\n") {
		fields := strings.Fields(line)
		if len(fields) < 4 || !strings.Contains(line, arch) {
			continue
		}
		n++
		name, path := fields[0], fields[len(fields)-1]
		if _, ok := m[name]; !ok {
			t.Errorf("ldconfig -p lists %s => %s; parser has nothing", name, path)
		}
	}
	if n == 0 || len(m) == 0 {
		t.Fatalf("ldconfig listed %d %s entries, parser %d", n, arch, len(m))
	}
}

func TestErrorText(t *testing.T) {
	e := &Error{Call: "cuMemAlloc_v2(1073741824 bytes)", Code: ErrorOutOfMemory, Name: "CUDA_ERROR_OUT_OF_MEMORY", Text: "out of memory"}
	want := "cuMemAlloc_v2(1073741824 bytes): CUDA_ERROR_OUT_OF_MEMORY (out of memory)"
	if e.Error() != want {
		t.Errorf("got %q, want %q", e.Error(), want)
	}
	wrapped := errors.Join(errors.New("context"), e)
	if Code(wrapped) != ErrorOutOfMemory || Code(errors.New("x")) != Success {
		t.Errorf("Code does not see through wrapping")
	}
}
