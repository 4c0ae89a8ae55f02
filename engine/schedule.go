package engine

import "math"

// learningRate is the schedule's value for optimizer step (1-based): a linear
// warmup from 0 to lr, then
//   - cosine: half a cosine from lr down to min_lr at the last step;
//   - constant: lr;
//   - wsd (warmup-stable-decay): lr until the last decay_steps steps, then a
//     linear decay to min_lr.
func learningRate(t TrainConfig, step int) float64 {
	if t.WarmupSteps > 0 && step <= t.WarmupSteps {
		return t.LR * float64(step) / float64(t.WarmupSteps)
	}
	switch t.Schedule {
	case "constant":
		return t.LR
	case "wsd":
		decay := t.DecaySteps
		if decay <= 0 {
			decay = max(1, t.Steps/5)
		}
		start := t.Steps - decay
		if step <= start {
			return t.LR
		}
		frac := float64(step-start) / float64(decay)
		return t.LR + (t.MinLR-t.LR)*min(frac, 1)
	default: // cosine
		span := t.Steps - t.WarmupSteps
		if span <= 0 {
			return t.LR
		}
		frac := min(float64(step-t.WarmupSteps)/float64(span), 1)
		return t.MinLR + (t.LR-t.MinLR)*0.5*(1+math.Cos(math.Pi*frac))
	}
}
