package cuda

// Tests of the Backend that need no GPU.

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"testing"

	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// TestRouterLimitsMatchKernel: the host-side limits are the kernel's
// register layout (32 lanes x MK_ROUTER_SLOTS experts, MK_ROUTER_MAXK
// selections).
func TestRouterLimitsMatchKernel(t *testing.T) {
	_, text := kernelSource(t, "router.cu")
	define := func(name string) int {
		m := regexp.MustCompile(`#define ` + name + ` (\d+)`).FindStringSubmatch(text)
		if m == nil {
			t.Fatalf("router.cu does not define %s", name)
		}
		v, _ := strconv.Atoi(m[1])
		return v
	}
	if slots := define("MK_ROUTER_SLOTS"); 32*slots != RouterMaxExperts {
		t.Errorf("RouterMaxExperts = %d, but the kernel holds 32 x %d experts", RouterMaxExperts, slots)
	}
	if k := define("MK_ROUTER_MAXK"); k != RouterMaxTopK {
		t.Errorf("RouterMaxTopK = %d, but the kernel selects at most %d", RouterMaxTopK, k)
	}
}

func TestNoGPU(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{&driver.NotFoundError{Lib: driver.LibCUDA, Looked: []string{"/usr/lib"}}, true},
		{fmt.Errorf("train.backend: cuda: %w", &driver.NotFoundError{Lib: driver.LibCUDA}), true},
		{ErrNoGPU, true},
		{errors.New("cuda: GPU 0 failed"), false},
		{&OutOfMemoryError{}, false},
	} {
		if got := NoGPU(c.err); got != c.want {
			t.Errorf("NoGPU(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
