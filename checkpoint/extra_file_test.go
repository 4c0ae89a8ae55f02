package checkpoint

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestWriteFileTravelsWithTheCheckpoint: an extra file (a tokenizer, say)
// is stored byte for byte, listed and hashed in the manifest, read back
// with ReadFile, and a change to it fails Verify.
func TestWriteFileTravelsWithTheCheckpoint(t *testing.T) {
	root := t.TempDir()
	s, err := BeginSave(root, 7)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Abort()
	content := []byte("{\"model\": {\"type\": \"BPE\"},\n   \"spacing\": \"kept as written\"}")
	if err := s.WriteFile("tokenizer.json", content); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"state.json", "MANIFEST.json", "model-rank00000.safetensors", "optim-x", "../x", "", "a/b"} {
		if err := s.WriteFile(bad, content); err == nil {
			t.Errorf("WriteFile(%q) was accepted", bad)
		}
	}
	if err := s.Commit(); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(root, StepDirName(7))
	if err := Verify(dir); err != nil {
		t.Fatal(err)
	}
	ck, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	got, ok, err := ck.ReadFile("tokenizer.json")
	if err != nil || !ok || !bytes.Equal(got, content) {
		t.Fatalf("ReadFile: %q, %v, %v", got, ok, err)
	}
	if _, ok, err := ck.ReadFile("absent.json"); ok || err != nil {
		t.Fatalf("ReadFile of a file the manifest does not list: ok %v, %v", ok, err)
	}
	changed := bytes.Replace(content, []byte("kept"), []byte("lost"), 1)
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), changed, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := Verify(dir); err == nil || !strings.Contains(err.Error(), "tokenizer.json: checksum mismatch") {
		t.Fatalf("Verify after the file changed: %v", err)
	}
}
