package cuda

import (
	"strings"
	"testing"
)

// TestInfoSoftware: the versions that key the dispatch table, also in the
// device's log line.
func TestInfoSoftware(t *testing.T) {
	i := Info{Name: "NVIDIA H200", DriverVersion: 12080, NVRTCMajor: 12, NVRTCMinor: 9}
	if got, want := i.Software(), "driver 12.8, NVRTC 12.9"; got != want {
		t.Errorf("Software: %q, want %q", got, want)
	}
	if !strings.HasSuffix(i.String(), ", driver 12.8, NVRTC 12.9") {
		t.Errorf("String: %q", i.String())
	}
}
