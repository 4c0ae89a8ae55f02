// Package backendtest is the conformance suite every backend runs, and the
// float64 gradient checks that make the CPU backend a trustworthy oracle.
//
// # Use
//
// A backend's test file calls
//
//	backendtest.RunAll(t, b, cpu.New(backend.Float64))  // b against the oracle
//	backendtest.GradCheck(t, cpu.New(backend.Float64))  // the oracle against calculus
//
// (backend/cpu/cpu_test.go and backend/cuda/conformance_gpu_test.go do).
// BF16Operands wraps a backend so that code keeping matrix-product operands
// in bf16 runs that path without a GPU.
//
// # Adding an op
//
// The suite is one table of Case values, built in suite.go from the case
// files: core_compare.go and core_check.go (elementwise, matrix products,
// rows, norms, RoPE, SwiGLU, loss, AdamW), grouped_cases.go (grouped
// products), attention_cases.go, router_cases.go (router and routing ops),
// bf16_cases.go (ops on BFloat16 tensors) and peer_cases.go (the peer-row
// ops and the fused MoE ops on 1, 2 and 4 ranks). A new op adds its cases
// once and every backend runs them. A Case has a Name (the subtest) and up
// to two functions:
//
//   - Compare builds inputs through an Env and runs the op on both
//     backends; RunAll calls it.
//   - Check verifies the op on a float64 backend; GradCheck calls it. A
//     "ref" check compares a forward with a naive formulation written
//     independently of any backend (RoPE as a complex rotation,
//     cross-entropy as a direct log-softmax, AdamW as torch's formula); a
//     "grad" check compares a backward with central finite differences of
//     the forward (CheckGrad, FDStep), the forward reduced to a scalar by a
//     random projection R so that the backward gets dout = R.
//
// A typical Compare:
//
//	func(e *Env) {
//		x, w := e.Rand("x", 19, 48), e.Uniform("w", 0.5, 1.5, 48)
//		out, rstd := e.Out("out", 19, 48), e.Out("rstd", 19)
//		e.Run(func(b backend.Backend, p Pick) {
//			b.RMSNormForward(p(out), p(rstd), nil, p(x), p(w), 1e-5)
//		})
//	}
//
// Run calls its function once per backend, and p maps each Pair to that
// backend's tensor (a nil Pair to a nil tensor, for optional arguments);
// forward and backward may share one Run when the backward needs what the
// forward saved. Env makes inputs (Rand, Uniform, Floats, Ints, IntsOf;
// BF16, BF16Uniform, BF16Floats on the bf16 grid), outputs (Out, OutBF16,
// IntOut), in-place arguments (InOut) and views (View: make the parent
// InOut so that everything outside the view is checked unchanged). Host
// helpers: NewRand, RandFloats, RandInts, Upload, UploadBF16, UploadInts,
// Set, Download, DownloadInts, Dot, RoundTo, RoundBF16.
//
// # What a Compare checks
//
// Inputs come from a generator seeded by the case name (NewRand) and are
// rounded to float32 (float64 when both backends compute in it), so both
// backends see the same values.
// Outputs from Env.Out start as NaN, so an op that skips part of its output
// or reads it when it should not (MatMul with beta 0) fails. After the run
// every output and InOut pair must agree within Env.Tol (Tolerance of the
// tested backend's float type: 1e-5 for float32, 1e-12 for float64, 1e-2
// for bf16; or the backend's RelTolerance when it implements
// backend.Precision) by CompareFloats, never be NaN or Inf, and every
// plain input must come back unchanged. BFloat16 outputs are held to bf16
// tolerance at least: two correct backends may round a result to
// neighbouring bf16 values. CompareNormWise is the metric for long
// reductions over bf16 operands (attention on tensor cores).
package backendtest
