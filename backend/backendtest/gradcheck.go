package backendtest

import "testing"

// FDStep is the step of CheckGrad's central differences. With inputs of
// order one and float64 arithmetic, its truncation error (FDStep^2) and its
// rounding error (1e-16/FDStep) both stay near 1e-10.
const FDStep = 1e-5

// CheckGrad checks analytic, the gradient of the scalar f with respect to x,
// against central finite differences: for each i it sets x[i] to x[i]±FDStep,
// calls f (which must read x afresh: upload it, run the forward op, and
// reduce the output to a number, typically its dot product with a fixed
// random projection), and restores x[i]. It calls f once more at the end, so
// whatever f uploads holds x unperturbed again. The comparison is CompareFloats's
// with tolerance tol; 1e-6 suits float64 ops on inputs of order one.
func CheckGrad(t testing.TB, name string, f func() float64, x, analytic []float64, tol float64) bool {
	t.Helper()
	if len(x) != len(analytic) {
		t.Errorf("%s: %d inputs but %d gradient entries", name, len(x), len(analytic))
		return false
	}
	fd := make([]float64, len(x))
	for i, xi := range x {
		x[i] = xi + FDStep
		fp := f()
		x[i] = xi - FDStep
		fm := f()
		x[i] = xi
		fd[i] = (fp - fm) / (2 * FDStep)
	}
	f()
	return CompareFloats(t, name+": analytic gradient vs finite differences", analytic, fd, tol)
}
