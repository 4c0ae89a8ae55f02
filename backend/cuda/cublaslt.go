package cuda

// Bindings for the part of cuBLASLt (libcublasLt.so.13 or .12) that a plain
// GEMM needs, called through purego like the driver API: no cgo, one C call
// per method, every status checked. Enum values and struct layouts are those
// of cublasLt.h, cublas_api.h and library_types.h (cuBLAS 12 and 13 agree on
// all of them); TestCublasLtABI pins the struct sizes.
//
// The handle and descriptors are host objects, but cuBLASLt binds the handle
// to the context current when it is created, so the Gemm calls everything
// here on its Device's thread.

import (
	"fmt"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// CublasStatus is a cublasStatus_t.
type CublasStatus int32

// The statuses of cublas_api.h.
const (
	CublasSuccess         CublasStatus = 0
	CublasNotInitialized  CublasStatus = 1
	CublasAllocFailed     CublasStatus = 3
	CublasInvalidValue    CublasStatus = 7
	CublasArchMismatch    CublasStatus = 8
	CublasMappingError    CublasStatus = 11
	CublasExecutionFailed CublasStatus = 13
	CublasInternalError   CublasStatus = 14
	CublasNotSupported    CublasStatus = 15
	CublasLicenseError    CublasStatus = 16
)

func (s CublasStatus) String() string {
	switch s {
	case CublasSuccess:
		return "CUBLAS_STATUS_SUCCESS"
	case CublasNotInitialized:
		return "CUBLAS_STATUS_NOT_INITIALIZED"
	case CublasAllocFailed:
		return "CUBLAS_STATUS_ALLOC_FAILED"
	case CublasInvalidValue:
		return "CUBLAS_STATUS_INVALID_VALUE"
	case CublasArchMismatch:
		return "CUBLAS_STATUS_ARCH_MISMATCH"
	case CublasMappingError:
		return "CUBLAS_STATUS_MAPPING_ERROR"
	case CublasExecutionFailed:
		return "CUBLAS_STATUS_EXECUTION_FAILED"
	case CublasInternalError:
		return "CUBLAS_STATUS_INTERNAL_ERROR"
	case CublasNotSupported:
		return "CUBLAS_STATUS_NOT_SUPPORTED"
	case CublasLicenseError:
		return "CUBLAS_STATUS_LICENSE_ERROR"
	}
	return fmt.Sprintf("cublasStatus_t %d", int32(s))
}

// CublasError is a failed cuBLASLt call: the C function, its status and the
// arguments that matter, e.g.
//
//	cublasLtMatmul: CUBLAS_STATUS_NOT_SUPPORTED (m=7, n=13, k=5, transA=false, transB=true, bf16 inputs)
type CublasError struct {
	Call   string
	Status CublasStatus
	Detail string
}

func (e *CublasError) Error() string {
	if e.Detail == "" {
		return fmt.Sprintf("%s: %v", e.Call, e.Status)
	}
	return fmt.Sprintf("%s: %v (%s)", e.Call, e.Status, e.Detail)
}

// cudaDataType values (library_types.h).
const (
	cudaR32F  = 0
	cudaR16BF = 14
)

// cublasComputeType_t: float accumulation and products. Unlike
// CUBLAS_COMPUTE_32F_FAST_TF32 it never rounds fp32 inputs to TF32.
const cublasCompute32F = 68

// cublasOperation_t.
const (
	cublasOpN = 0
	cublasOpT = 1
)

// cublasLtMatmulDescAttributes_t (int32 values).
const (
	ltDescTransA = 3
	ltDescTransB = 4
)

// cublasLtMatrixLayoutAttribute_t: TYPE is uint32, ROWS and COLS uint64, LD
// int64. The order stays the default, column-major.
const (
	ltLayoutType = 0
	ltLayoutRows = 2
	ltLayoutCols = 3
	ltLayoutLD   = 4
)

// cublasLtMatmulPreferenceAttributes_t: MAX_WORKSPACE_BYTES is uint64, the
// alignments uint32 (default 256, which excludes nothing but assumes
// 256-byte aligned pointers).
const (
	ltPrefMaxWorkspaceBytes = 1
	ltPrefMinAlignmentA     = 5
	ltPrefMinAlignmentB     = 6
	ltPrefMinAlignmentC     = 7
	ltPrefMinAlignmentD     = 8
)

// Opaque cuBLASLt handles (C pointers).
type (
	ltHandle     uintptr
	ltMatmulDesc uintptr
	ltLayout     uintptr
	ltPreference uintptr
)

// ltAlgo is cublasLtMatmulAlgo_t: 8 uint64s, copied by value.
type ltAlgo struct{ data [8]uint64 }

// ltHeuristicResult is cublasLtMatmulHeuristicResult_t (96 bytes).
type ltHeuristicResult struct {
	algo          ltAlgo
	workspaceSize uint64 // size_t
	state         CublasStatus
	wavesCount    float32
	reserved      [4]int32
}

// cublasLt is libcublasLt's function table.
type cublasLt struct {
	lib *driver.Library
	fn  struct {
		create, destroy, getVersion                                 uintptr
		matmulDescCreate, matmulDescDestroy, matmulDescSetAttribute uintptr
		layoutCreate, layoutDestroy, layoutSetAttribute             uintptr
		preferenceCreate, preferenceDestroy, preferenceSetAttribute uintptr
		algoGetHeuristic, matmul                                    uintptr
	}
}

// loadCublasLt finds and opens libcublasLt with s and resolves every symbol
// the Gemm uses, so a library too old is reported before anything runs.
func loadCublasLt(s driver.Search) (*cublasLt, error) {
	lib, err := s.Open(driver.LibCublasLt)
	if err != nil {
		return nil, err
	}
	lt := &cublasLt{lib: lib}
	f := &lt.fn
	for name, dst := range map[string]*uintptr{
		"cublasLtCreate":                       &f.create,
		"cublasLtDestroy":                      &f.destroy,
		"cublasLtGetVersion":                   &f.getVersion,
		"cublasLtMatmulDescCreate":             &f.matmulDescCreate,
		"cublasLtMatmulDescDestroy":            &f.matmulDescDestroy,
		"cublasLtMatmulDescSetAttribute":       &f.matmulDescSetAttribute,
		"cublasLtMatrixLayoutCreate":           &f.layoutCreate,
		"cublasLtMatrixLayoutDestroy":          &f.layoutDestroy,
		"cublasLtMatrixLayoutSetAttribute":     &f.layoutSetAttribute,
		"cublasLtMatmulPreferenceCreate":       &f.preferenceCreate,
		"cublasLtMatmulPreferenceDestroy":      &f.preferenceDestroy,
		"cublasLtMatmulPreferenceSetAttribute": &f.preferenceSetAttribute,
		"cublasLtMatmulAlgoGetHeuristic":       &f.algoGetHeuristic,
		"cublasLtMatmul":                       &f.matmul,
	} {
		if *dst, err = lib.Symbol(name); err != nil {
			return nil, err
		}
	}
	return lt, nil
}

// ltCall is go:uintptrescapes, like purego.SyscallN: a Go pointer converted
// to uintptr in the argument list stays alive and in place for the call.
//
//go:uintptrescapes
func ltCall(fn uintptr, args ...uintptr) CublasStatus {
	r, _, _ := purego.SyscallN(fn, args...)
	return CublasStatus(int32(r))
}

// ltCheck turns a status into a *CublasError; detail is formatted only on
// failure.
func ltCheck(s CublasStatus, call string, detail func() string) error {
	if s == CublasSuccess {
		return nil
	}
	e := &CublasError{Call: call, Status: s}
	if detail != nil {
		e.Detail = detail()
	}
	return e
}

// Version is cublasLtGetVersion: major*10000 + minor*100 + patch.
func (lt *cublasLt) Version() int {
	r, _, _ := purego.SyscallN(lt.fn.getVersion)
	return int(r)
}

// Create is cublasLtCreate.
func (lt *cublasLt) Create() (ltHandle, error) {
	var h uintptr
	s := ltCall(lt.fn.create, uintptr(unsafe.Pointer(&h)))
	return ltHandle(h), ltCheck(s, "cublasLtCreate", nil)
}

// Destroy is cublasLtDestroy.
func (lt *cublasLt) Destroy(h ltHandle) error {
	return ltCheck(ltCall(lt.fn.destroy, uintptr(h)), "cublasLtDestroy", nil)
}

// MatmulDescCreate is cublasLtMatmulDescCreate.
func (lt *cublasLt) MatmulDescCreate(computeType, scaleType int32) (ltMatmulDesc, error) {
	var d uintptr
	s := ltCall(lt.fn.matmulDescCreate, uintptr(unsafe.Pointer(&d)), uintptr(computeType), uintptr(scaleType))
	return ltMatmulDesc(d), ltCheck(s, "cublasLtMatmulDescCreate", func() string {
		return fmt.Sprintf("compute type %d, scale type %d", computeType, scaleType)
	})
}

// MatmulDescDestroy is cublasLtMatmulDescDestroy.
func (lt *cublasLt) MatmulDescDestroy(d ltMatmulDesc) error {
	return ltCheck(ltCall(lt.fn.matmulDescDestroy, uintptr(d)), "cublasLtMatmulDescDestroy", nil)
}

// MatmulDescSetInt32 is cublasLtMatmulDescSetAttribute for an int32
// attribute (TRANSA, TRANSB).
func (lt *cublasLt) MatmulDescSetInt32(d ltMatmulDesc, attr int, v int32) error {
	s := ltCall(lt.fn.matmulDescSetAttribute, uintptr(d), uintptr(attr), uintptr(unsafe.Pointer(&v)), 4)
	return ltCheck(s, "cublasLtMatmulDescSetAttribute", func() string { return fmt.Sprintf("attribute %d = %d", attr, v) })
}

// LayoutCreate is cublasLtMatrixLayoutCreate (column-major).
func (lt *cublasLt) LayoutCreate(dataType uint32, rows, cols uint64, ld int64) (ltLayout, error) {
	var l uintptr
	s := ltCall(lt.fn.layoutCreate, uintptr(unsafe.Pointer(&l)), uintptr(dataType), uintptr(rows), uintptr(cols), uintptr(ld))
	return ltLayout(l), ltCheck(s, "cublasLtMatrixLayoutCreate", func() string {
		return fmt.Sprintf("type %d, %dx%d, ld %d", dataType, rows, cols, ld)
	})
}

// LayoutDestroy is cublasLtMatrixLayoutDestroy.
func (lt *cublasLt) LayoutDestroy(l ltLayout) error {
	return ltCheck(ltCall(lt.fn.layoutDestroy, uintptr(l)), "cublasLtMatrixLayoutDestroy", nil)
}

// LayoutSet sets a layout's type, rows, columns and leading dimension
// (four cublasLtMatrixLayoutSetAttribute calls), so one descriptor serves
// every shape.
func (lt *cublasLt) LayoutSet(l ltLayout, dataType uint32, rows, cols uint64, ld int64) error {
	fn := lt.fn.layoutSetAttribute
	for attr, s := range [...]CublasStatus{
		ltLayoutType: ltCall(fn, uintptr(l), ltLayoutType, uintptr(unsafe.Pointer(&dataType)), 4),
		ltLayoutRows: ltCall(fn, uintptr(l), ltLayoutRows, uintptr(unsafe.Pointer(&rows)), 8),
		ltLayoutCols: ltCall(fn, uintptr(l), ltLayoutCols, uintptr(unsafe.Pointer(&cols)), 8),
		ltLayoutLD:   ltCall(fn, uintptr(l), ltLayoutLD, uintptr(unsafe.Pointer(&ld)), 8),
	} {
		if s != CublasSuccess {
			return &CublasError{Call: "cublasLtMatrixLayoutSetAttribute", Status: s,
				Detail: fmt.Sprintf("attribute %d; type %d, %dx%d, ld %d", attr, dataType, rows, cols, ld)}
		}
	}
	return nil
}

// PreferenceCreate is cublasLtMatmulPreferenceCreate.
func (lt *cublasLt) PreferenceCreate() (ltPreference, error) {
	var p uintptr
	s := ltCall(lt.fn.preferenceCreate, uintptr(unsafe.Pointer(&p)))
	return ltPreference(p), ltCheck(s, "cublasLtMatmulPreferenceCreate", nil)
}

// PreferenceDestroy is cublasLtMatmulPreferenceDestroy.
func (lt *cublasLt) PreferenceDestroy(p ltPreference) error {
	return ltCheck(ltCall(lt.fn.preferenceDestroy, uintptr(p)), "cublasLtMatmulPreferenceDestroy", nil)
}

// PreferenceSetUint64 is cublasLtMatmulPreferenceSetAttribute for a uint64
// attribute (MAX_WORKSPACE_BYTES).
func (lt *cublasLt) PreferenceSetUint64(p ltPreference, attr int, v uint64) error {
	s := ltCall(lt.fn.preferenceSetAttribute, uintptr(p), uintptr(attr), uintptr(unsafe.Pointer(&v)), 8)
	return ltCheck(s, "cublasLtMatmulPreferenceSetAttribute", func() string { return fmt.Sprintf("attribute %d = %d", attr, v) })
}

// PreferenceSetUint32 is cublasLtMatmulPreferenceSetAttribute for a uint32
// attribute (the MIN_ALIGNMENT_*_BYTES).
func (lt *cublasLt) PreferenceSetUint32(p ltPreference, attr int, v uint32) error {
	s := ltCall(lt.fn.preferenceSetAttribute, uintptr(p), uintptr(attr), uintptr(unsafe.Pointer(&v)), 4)
	return ltCheck(s, "cublasLtMatmulPreferenceSetAttribute", func() string { return fmt.Sprintf("attribute %d = %d", attr, v) })
}

// AlgoGetHeuristic is cublasLtMatmulAlgoGetHeuristic asking for the single
// best algorithm; found is false when cuBLASLt has none for the problem.
// C and D share one layout.
func (lt *cublasLt) AlgoGetHeuristic(h ltHandle, d ltMatmulDesc, a, b, c ltLayout, p ltPreference) (res ltHeuristicResult, found bool, err error) {
	var n int32
	s := ltCall(lt.fn.algoGetHeuristic, uintptr(h), uintptr(d), uintptr(a), uintptr(b), uintptr(c), uintptr(c),
		uintptr(p), 1, uintptr(unsafe.Pointer(&res)), uintptr(unsafe.Pointer(&n)))
	if s != CublasSuccess {
		return res, false, &CublasError{Call: "cublasLtMatmulAlgoGetHeuristic", Status: s}
	}
	return res, n > 0, nil
}

// AlgoGetHeuristics is cublasLtMatmulAlgoGetHeuristic asking for up to n
// algorithms, best first by cuBLASLt's estimate.
func (lt *cublasLt) AlgoGetHeuristics(h ltHandle, d ltMatmulDesc, a, b, c ltLayout, p ltPreference, n int) ([]ltHeuristicResult, error) {
	res := make([]ltHeuristicResult, n)
	var got int32
	s := ltCall(lt.fn.algoGetHeuristic, uintptr(h), uintptr(d), uintptr(a), uintptr(b), uintptr(c), uintptr(c),
		uintptr(p), uintptr(n), uintptr(unsafe.Pointer(&res[0])), uintptr(unsafe.Pointer(&got)))
	if s != CublasSuccess {
		return nil, &CublasError{Call: "cublasLtMatmulAlgoGetHeuristic", Status: s}
	}
	return res[:got], nil
}

// Matmul is cublasLtMatmul with host alpha and beta and D = C in place.
// It queues the product on stream and returns.
func (lt *cublasLt) Matmul(h ltHandle, d ltMatmulDesc, alpha float32, a driver.DevicePtr, la ltLayout,
	b driver.DevicePtr, lb ltLayout, beta float32, c driver.DevicePtr, lc ltLayout,
	algo *ltAlgo, workspace driver.DevicePtr, workspaceBytes uint64, stream driver.Stream) CublasStatus {
	return ltCall(lt.fn.matmul, uintptr(h), uintptr(d), uintptr(unsafe.Pointer(&alpha)),
		uintptr(a), uintptr(la), uintptr(b), uintptr(lb), uintptr(unsafe.Pointer(&beta)),
		uintptr(c), uintptr(lc), uintptr(c), uintptr(lc),
		uintptr(unsafe.Pointer(algo)), uintptr(workspace), uintptr(workspaceBytes), uintptr(stream))
}
