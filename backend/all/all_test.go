package all_test

import (
	"testing"

	"github.com/mktrain/mktrain/backend/all"
	"github.com/mktrain/mktrain/backend/registry"
)

// TestDrivers: the drivers form a set, cuda among them, placing one rank
// per GPU in one process or over several.
func TestDrivers(t *testing.T) {
	s, err := registry.NewSet(all.Drivers()...)
	if err != nil {
		t.Fatal(err)
	}
	d, ok := s.Lookup("cuda")
	if !ok {
		t.Fatalf("no cuda driver among %v", s.Names())
	}
	if _, ok := d.(registry.MultiProcess); !ok {
		t.Errorf("the cuda driver (%T) does not span processes", d)
	}
}
