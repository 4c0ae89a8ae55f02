package cuda

import (
	"strings"
	"testing"
	"time"
)

// TestFusedFaultError: the report of a tile wait that timed out names the
// kernel, the m-tile, the missing chunks and the rank to look at.
func TestFusedFaultError(t *testing.T) {
	err := fusedFaultError("moe_dispatch_dgrad", 10*time.Second, 6, 0b11110110, 2)
	for _, want := range []string{"moe_dispatch_dgrad", "m-tile 6", "within 10s", "[0 3] of 8 missing", "from rank 2"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q lacks %q", err, want)
		}
	}
	if err := fusedFaultError("moe_dispatch_swiglu", time.Second, 0, 0b01111111, -1); !strings.Contains(err.Error(), "no rank") {
		t.Errorf("a chunk without rows: %q", err)
	}
}
