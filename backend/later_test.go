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

func (r *laterReducer) SumLater(t Tensor) func() float64 {
	r.queued++
	return func() float64 { return 41 }
}

// TestLaterReducersFallBack: a LaterReducer queues the reductions; any
// other backend computes Sum and SumSquares at once.
func TestLaterReducersFallBack(t *testing.T) {
	r := &laterReducer{}
	if got := SumSquaresLater(r, nil)(); got != 42 || r.queued != 1 {
		t.Errorf("a LaterReducer: %g after %d queued, want 42 after 1", got, r.queued)
	}
	if got := SumLater(r, nil)(); got != 41 || r.queued != 2 {
		t.Errorf("a LaterReducer's sum: %g after %d queued, want 41 after 2", got, r.queued)
	}
	var plain sumSquaresOnly
	if got := SumSquaresLater(plain, nil)(); got != 7 {
		t.Errorf("a plain backend: %g, want its SumSquares, 7", got)
	}
	if got := SumLater(plain, nil)(); got != 6 {
		t.Errorf("a plain backend's sum: %g, want its Sum, 6", got)
	}
}

type sumSquaresOnly struct{ Backend }

func (sumSquaresOnly) SumSquares(Tensor) float64 { return 7 }
func (sumSquaresOnly) Sum(Tensor) float64        { return 6 }

// squaringOptimizer records the AdamW calls it was asked for.
type squaringOptimizer struct {
	Backend
	calls []string
}

func (o *squaringOptimizer) AdamWUpdateSquares(param, grad, m, v Tensor, h AdamW) func() float64 {
	o.calls = append(o.calls, "AdamWUpdateSquares")
	return func() float64 { return 42 }
}

func (o *squaringOptimizer) AdamWUpdateSplitSquares(hi, lo, grad, m, v Tensor, h AdamW) func() float64 {
	o.calls = append(o.calls, "AdamWUpdateSplitSquares")
	return func() float64 { return 43 }
}

// plainOptimizer has neither capability: its updates and sums are
// recorded in the order they are called.
type plainOptimizer struct {
	Backend
	calls []string
}

func (o *plainOptimizer) SumSquares(Tensor) float64 {
	o.calls = append(o.calls, "SumSquares")
	return 7
}
func (o *plainOptimizer) AdamWUpdate(param, grad, m, v Tensor, h AdamW) {
	o.calls = append(o.calls, "AdamWUpdate")
}
func (o *plainOptimizer) AdamWUpdateSplit(hi, lo, grad, m, v Tensor, h AdamW) {
	o.calls = append(o.calls, "AdamWUpdateSplit")
}

// TestAdamWUpdateSquaresFallsBack: a SquaringOptimizer updates and sums in
// one call; any other backend sums the gradient's squares before the
// update changes nothing of it, then updates.
func TestAdamWUpdateSquaresFallsBack(t *testing.T) {
	o := &squaringOptimizer{}
	a, s := AdamWUpdateSquares(o, nil, nil, nil, nil, AdamW{})(), AdamWUpdateSplitSquares(o, nil, nil, nil, nil, nil, AdamW{})()
	if a != 42 || s != 43 || len(o.calls) != 2 || o.calls[0] != "AdamWUpdateSquares" || o.calls[1] != "AdamWUpdateSplitSquares" {
		t.Errorf("a SquaringOptimizer: sums %g and %g after %v", a, s, o.calls)
	}
	p := &plainOptimizer{}
	a, s = AdamWUpdateSquares(p, nil, nil, nil, nil, AdamW{})(), AdamWUpdateSplitSquares(p, nil, nil, nil, nil, nil, AdamW{})()
	want := []string{"SumSquares", "AdamWUpdate", "SumSquares", "AdamWUpdateSplit"}
	if a != 7 || s != 7 || len(p.calls) != len(want) {
		t.Fatalf("a plain backend: sums %g and %g after %v, want 7 and 7 after %v", a, s, p.calls, want)
	}
	for i := range want {
		if p.calls[i] != want[i] {
			t.Errorf("a plain backend called %v, want %v", p.calls, want)
			break
		}
	}
}
