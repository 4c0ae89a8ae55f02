// Package backendtest is the conformance suite every backend runs, and the
// float64 gradient checks that make the CPU backend a trustworthy oracle.
//
// A backend's test file calls
//
//	backendtest.RunAll(t, b, cpu.New(backend.Float64))  // b against the oracle
//	backendtest.GradCheck(t, cpu.New(backend.Float64))  // the oracle against calculus
//
// # The table
//
// The suite is one table of Case values: coreCases (core_compare.go,
// core_check.go), attentionCases (attention_cases.go), routerCases
// (router_cases.go), bf16Cases (bf16_cases.go: the ops that take or
// produce BFloat16 tensors), groupedCases (grouped_cases.go) and
// peerCases (peer_cases.go: the peer-row ops and the fused MoE ops, on 1,
// 2 and 4 ranks: DispatchSwiGLU and DownCombine, and their backward twins
// DispatchDgradSwiGLU and DgradCombine, each checked against the oracle
// and against a float64 reference of gather, grouped products, SwiGLU or
// its derivative, and scatter). A new op adds its cases once and every
// backend runs them. A Case has a Name (the subtest) and up to two
// functions:
//
//   - Compare builds inputs through an Env and runs the op on both backends;
//     RunAll calls it. Inputs are drawn from a generator seeded by the case
//     name (NewRand) and rounded to float32, so both backends see the same
//     values. Outputs made with Env.Out are filled with NaN first, so an op
//     that skips part of its output, or reads it when it should not (MatMul
//     with beta 0), fails. After the run every output and every Env.InOut
//     pair must agree within Env.Tol (Tolerance of the tested backend's float
//     type: 1e-5 for float32, 1e-12 for float64, 1e-2 for a half type; or
//     the backend's own RelTolerance when it implements backend.Precision) and
//     never be NaN or Inf, and every plain input must come back unchanged on
//     both backends.
//   - Check verifies the op on a float64 backend; GradCheck calls it. The
//     core checks come in two kinds: "ref" checks compare a forward with a
//     naive formulation written independently of any backend (RoPE as a
//     complex rotation, cross-entropy as a direct log-softmax, AdamW as
//     torch's formula), and "grad" checks compare a backward with central
//     finite differences of the forward (CheckGrad), the forward reduced to
//     a scalar by a random projection R so that the backward gets dout = R.
//
// A typical Compare:
//
//	func(e *Env) {
//		x, w := e.Rand("x", 19, 48), e.Uniform("w", 0.5, 1.5, 48)
//		out, rstd := e.Out("out", 19, 48), e.Out("rstd", 19)
//		e.Run(func(b backend.Backend, p Pick) {
//			b.RMSNormForward(p(out), p(rstd), p(x), p(w), 1e-5)
//		})
//	}
//
// Run calls its function twice, once per backend, and p maps each Pair to
// that backend's tensor (a nil Pair to a nil tensor, for optional
// arguments). Forward and backward may run in one Run when the backward
// needs what the forward saved. Env.View tests ops on views: make the
// parent InOut so that everything outside the view is checked unchanged.
//
// # Helpers for writing cases
//
// Env: Rand, Uniform, Floats, Ints, IntsOf (inputs); BF16, BF16Uniform,
// BF16Floats (BFloat16 inputs, drawn on the bf16 grid); Out, OutBF16,
// IntOut (poisoned outputs); InOut (in-place or accumulating arguments);
// View; Run, RunScalar. BFloat16 outputs are compared at bf16 tolerance at
// least (Tolerance(backend.BFloat16)), whatever Tol is: two correct
// backends may round a result to neighbouring bf16 values (bf16_cases.go).
// Host side: NewRand, RandFloats, RandInts, Upload, UploadBF16,
// UploadInts, Set, Download, DownloadInts, Dot, RoundTo, RoundBF16. Checking: CompareFloats (the
// suite's tolerance rule), Tolerance, CheckGrad and FDStep.
package backendtest
