package engine

import (
	"math"
	"testing"
)

func TestLearningRateSchedules(t *testing.T) {
	tc := TrainConfig{LR: 1, MinLR: 0.1, WarmupSteps: 10, Steps: 110, Schedule: "cosine"}
	check := func(name string, got, want float64) {
		t.Helper()
		if math.Abs(got-want) > 1e-12 {
			t.Errorf("%s: %v, want %v", name, got, want)
		}
	}
	check("warmup start", learningRate(tc, 1), 0.1)
	check("warmup end", learningRate(tc, 10), 1)
	check("cosine middle", learningRate(tc, 60), 0.55)
	check("cosine end", learningRate(tc, 110), 0.1)
	tc.Schedule = "constant"
	check("constant", learningRate(tc, 90), 1)
	tc.Schedule, tc.DecaySteps = "wsd", 20
	check("wsd stable", learningRate(tc, 90), 1)
	check("wsd decay middle", learningRate(tc, 100), 0.55)
	check("wsd end", learningRate(tc, 110), 0.1)
}
