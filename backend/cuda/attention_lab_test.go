package cuda

import (
	"fmt"
	"strings"
	"testing"

	"github.com/mktrain/mktrain/kernels/dev"
)

// TestAttentionLabLaunchesMatchVariants checks the own-launch tables of
// the attention lab's GPU tests against kernels/dev on any machine: every
// entry names a variant of attention_hopper_lab.cu whose source defines
// the entry's kernels, and every variant whose purpose says a test
// launches it has an entry there, so a lab added or dropped on one side
// only fails here instead of on the GPU (where it would be skipped, or
// swapped in for production kernels it does not replace).
func TestAttentionLabLaunchesMatchVariants(t *testing.T) {
	lab, err := dev.Lookup("attention_hopper_lab.cu")
	if err != nil {
		t.Fatal(err)
	}
	text, err := lab.Text()
	if err != nil {
		t.Fatal(err)
	}
	check := func(table, name, kernel string, headDims []int) {
		if _, err := lab.Variant(name); err != nil {
			t.Errorf("%s: %v", table, err)
		}
		for _, dh := range headDims {
			k := fmt.Sprintf(kernel, dh)
			if !strings.Contains(text, " "+k+"(") {
				t.Errorf("%s[%s]: %s defines no kernel %s", table, name, lab.File, k)
			}
		}
	}
	for name, how := range ownLaunch {
		check("ownLaunch", name, how.kernel, how.headDims)
	}
	for name, how := range ownForwardLaunch {
		check("ownForwardLaunch", name, how.kernel, how.headDims)
		if how.ringKernel != "" {
			check("ownForwardLaunch (ring)", name, how.ringKernel, how.headDims)
		}
	}
	for _, v := range lab.Variants {
		_, bwd := ownLaunch[v.Name]
		_, fwd := ownForwardLaunch[v.Name]
		switch {
		case strings.Contains(v.Purpose, "TestAttentionLabOwnLaunch") && !bwd:
			t.Errorf("variant %s says TestAttentionLabOwnLaunch launches it, but ownLaunch has no entry for it", v.Name)
		case strings.Contains(v.Purpose, "TestAttentionLabForwardOwnLaunch") && !fwd:
			t.Errorf("variant %s says TestAttentionLabForwardOwnLaunch launches it, but ownForwardLaunch has no entry for it", v.Name)
		}
	}
}
