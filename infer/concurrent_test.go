package infer

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
)

// TestModelConcurrentUse: samples and evaluations run from several
// goroutines at once on one Model give exactly what they give one at a
// time (a seed reproduces its sample whatever runs beside it). Run under
// -race (make race) it also checks that no two forward passes share the
// model's buffers unguarded.
func TestModelConcurrentUse(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	trainRun(t, testConfig(), dir)
	m, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	prompt := []int32{'T', 'h', 'e', ' '}
	const samplers = 4
	alone := make([][]int32, samplers)
	for i := range alone {
		if alone[i], err = m.Sample(ctx, prompt, 12, 0.9, 8, uint64(i)); err != nil {
			t.Fatal(err)
		}
	}
	evalAlone, err := m.Evaluate(ctx, "", 3)
	if err != nil {
		t.Fatal(err)
	}

	together := make([][]int32, samplers)
	errs := make([]error, samplers+1)
	var evalTogether EvalResult
	var wg sync.WaitGroup
	for i := range samplers {
		wg.Go(func() { together[i], errs[i] = m.Sample(ctx, prompt, 12, 0.9, 8, uint64(i)) })
	}
	wg.Go(func() { evalTogether, errs[samplers] = m.Evaluate(ctx, "", 3) })
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	for i := range samplers {
		if !slices.Equal(alone[i], together[i]) {
			t.Errorf("seed %d: %v alone, %v beside other calls", i, alone[i], together[i])
		}
	}
	if evalAlone != evalTogether {
		t.Errorf("Evaluate: %s alone, %s beside samples", fmt.Sprint(evalAlone), fmt.Sprint(evalTogether))
	}
}
