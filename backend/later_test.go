package backend

import "testing"

// laterReducer counts the reductions it was asked to queue.
type laterReducer struct {
	Backend
	queued int
}

func (r *laterReducer) SumSquaresLater(t Tensor) func() float64 {
	r.queued++
	return func() float64 { return 42 }
}

// TestSumSquaresLaterFallsBack: a LaterReducer queues the reduction; any
// other backend computes SumSquares at once.
func TestSumSquaresLaterFallsBack(t *testing.T) {
	r := &laterReducer{}
	if got := SumSquaresLater(r, nil)(); got != 42 || r.queued != 1 {
		t.Errorf("a LaterReducer: %g after %d queued, want 42 after 1", got, r.queued)
	}
	var plain sumSquaresOnly
	if got := SumSquaresLater(plain, nil)(); got != 7 {
		t.Errorf("a plain backend: %g, want its SumSquares, 7", got)
	}
}

type sumSquaresOnly struct{ Backend }

func (sumSquaresOnly) SumSquares(Tensor) float64 { return 7 }
