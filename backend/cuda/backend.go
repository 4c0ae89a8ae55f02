package cuda

// Backend: the backend.Backend interface on one GPU. Tensors are float32 (or
// int32, or bfloat16 for MatMul operands) in device memory; MatMul
// multiplies in bf16 with fp32 accumulation (Gemm), every other op computes
// in fp32. Ops queue kernels on the
// device's stream and return at once; what goes wrong on the way (a launch
// the driver refuses, an allocation the GPU cannot hold, a kernel that
// faults) is kept and returned by the next Sync, as package backend
// prescribes. Shape mismatches are caller bugs and panic before anything is
// queued.

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/mktrain/mktrain/backend"
	"github.com/mktrain/mktrain/backend/cuda/driver"
)

// ErrNoGPU is returned by OpenBackend when the driver loads but sees no GPU.
var ErrNoGPU = errors.New("cuda: the driver sees no GPU")

// relTolerance is the Backend's precision against a float64 reference
// (backend.Precision): MatMul rounds its inputs to bf16, 8 significant bits,
// so a product's error is a few times 2^-9 of its magnitude.
const relTolerance = 1e-2

// Backend implements backend.Backend on one Device. Its methods may be
// called from several goroutines; ops from one goroutine run in the order
// they were called.
type Backend struct {
	dev  *Device
	owns bool // Close closes dev (OpenBackend)
	k    *kernelSet
	gemm *Gemm
	// experts runs GroupedMatMul's forward products on the Hopper grouped
	// GEMM (experts.go).
	experts expertGemm
	// fused holds the MoE fused kernels' tables (moe_fused.go).
	fused fusedTables
	// zigzag holds the fused ring attention kernels' pointer tables
	// (attention_zigzag.go).
	zigzag zigzagTables
	// tp holds the fused tensor-parallel ops' bf16 operands (tp_fused.go).
	tp tpScratch

	// deterministic selects the ops' fixed-order forms (SetDeterministic).
	deterministic atomic.Bool

	mu  sync.Mutex
	err error // the first error since the last Sync
}

var (
	_ backend.Backend           = (*Backend)(nil)
	_ backend.Precision         = (*Backend)(nil)
	_ backend.Deterministic     = (*Backend)(nil)
	_ backend.LaterReducer      = (*Backend)(nil)
	_ backend.SquaringOptimizer = (*Backend)(nil)
)

// SetDeterministic selects, for on, the fixed-order forms of the ops that
// otherwise add with float atomics in the order the GPU happens to run
// them: ScatterAddRows, EmbeddingBackward and CombineRows sort their rows
// and sum each output row in one block (scatterOrdered), and
// AttentionBackward runs attention_tc.cu's kernels (dq in a pass of its
// own) instead of the Hopper kernel's dq atomics. It also turns off
// the autotuning of matrix products (GemmOptions.NoAutotune), whose choice
// by timing can differ from run to run and round differently. Every other
// op already adds in a fixed order (the RMSNorm weight gradient through
// per-block partial sums), so with it the
// same ops on the same inputs give the same bits on every run on one GPU.
func (b *Backend) SetDeterministic(on bool) {
	b.deterministic.Store(on)
	b.gemm.noTune.Store(on)
}

// NewBackend makes a Backend on d. It compiles (or reads from the kernel
// cache) every kernel the ops use, so a broken kernel or compiler shows up
// here rather than in the middle of a step. Closing the Backend leaves d
// open.
func NewBackend(d *Device) (*Backend, error) {
	ks, err := loadKernelSet(d)
	if err != nil {
		return nil, err
	}
	g, err := NewGemm(d)
	if err != nil {
		return nil, fmt.Errorf("cuda: matrix multiply: %w", err)
	}
	return &Backend{dev: d, k: ks, gemm: g}, nil
}

// OpenBackend loads the CUDA libraries with opts, opens GPU 0 and returns a
// Backend that owns it (Close closes the device). Where there is no usable
// GPU the error says why: a *driver.NotFoundError naming the places looked
// in, ErrNoGPU, or the driver's own error (NoGPU reports all three).
func OpenBackend(opts Options) (*Backend, error) { return OpenBackendOn(opts, 0) }

// OpenBackendOn is OpenBackend on the GPU of the given ordinal (counted
// among the GPUs CUDA_VISIBLE_DEVICES leaves visible).
func OpenBackendOn(opts Options, ordinal int) (*Backend, error) {
	rt, err := Load(opts)
	if err != nil {
		return nil, err
	}
	n, err := rt.DeviceCount()
	if err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, ErrNoGPU
	}
	if ordinal < 0 || ordinal >= n {
		return nil, fmt.Errorf("cuda: GPU %d asked for, but %d are visible", ordinal, n)
	}
	d, err := rt.Open(ordinal)
	if err != nil {
		return nil, err
	}
	b, err := NewBackend(d)
	if err != nil {
		d.Close()
		return nil, err
	}
	b.owns = true
	return b, nil
}

// OpenBackendsBeside opens GPUs 1..n-1 beside gpu0 (GPU 0, already open),
// one backend each, for n ranks of one process that take a GPU each.
// gpus[0] is gpu0; closeRest closes the backends OpenBackendsBeside
// opened (not gpu0). On an error it closes them itself, and the error
// names the GPU that failed.
func OpenBackendsBeside(opts Options, gpu0 *Backend, n int) (gpus []*Backend, closeRest func() error, err error) {
	gpus = []*Backend{gpu0}
	closeRest = func() error {
		var errs []error
		for _, b := range gpus[1:] {
			errs = append(errs, b.Close())
		}
		return errors.Join(errs...)
	}
	for r := 1; r < n; r++ {
		b, err := OpenBackendOn(opts, r)
		if err != nil {
			return nil, nil, errors.Join(fmt.Errorf("opening GPU %d: %w", r, err), closeRest())
		}
		gpus = append(gpus, b)
	}
	return gpus, closeRest, nil
}

// VisibleGPUs loads the CUDA libraries with opts and counts the GPUs this
// process sees (CUDA_VISIBLE_DEVICES applies).
func VisibleGPUs(opts Options) (int, error) {
	rt, err := Load(opts)
	if err != nil {
		return 0, err
	}
	return rt.DeviceCount()
}

// NoGPU reports whether err, from OpenBackend or Load, means that this
// machine has no usable NVIDIA GPU (no driver library, no device), as
// opposed to a GPU that failed.
func NoGPU(err error) bool {
	var nf *driver.NotFoundError
	if errors.As(err, &nf) || errors.Is(err, ErrNoGPU) {
		return true
	}
	c := driver.Code(err)
	return c == driver.ErrorNoDevice || c == driver.ErrorNotInitialized
}

// Device is the GPU the Backend runs on.
func (b *Backend) Device() *Device { return b.dev }

// Close waits for queued work, frees the matrix multiply's memory and,
// when OpenBackend opened the device, closes it. Tensors of the Backend
// must not be used afterwards.
func (b *Backend) Close() error {
	err := errors.Join(b.Sync(), b.experts.close(b.dev), b.fused.close(b.dev), b.gemm.Close())
	if b.owns {
		err = errors.Join(err, b.dev.Close())
	}
	return err
}

func (b *Backend) Name() string { return "cuda" }

func (b *Backend) FloatType() backend.DType { return backend.Float32 }

// DeviceName is the GPU's name ("NVIDIA H200"): tune.ResolveDispatcher keys
// its measured table by it.
func (b *Backend) DeviceName() string { return b.dev.Info().Name }

// SoftwareVersions names the driver and NVRTC under the kernels ("driver
// 13.0, NVRTC 13.0"): tune.ResolveDispatcher's table measures again when
// they change.
func (b *Backend) SoftwareVersions() string { return b.dev.Info().Software() }

// OperandType is BFloat16: MatMul multiplies in bf16, so operands kept in
// bf16 go to cuBLASLt without the conversion a float32 operand needs.
func (b *Backend) OperandType() backend.DType { return backend.BFloat16 }

// RelTolerance is the relative tolerance the conformance suite applies to
// this backend against a float64 reference (backend.Precision).
func (b *Backend) RelTolerance() float64 { return relTolerance }

// Sync waits for every queued op and returns the first error since the last
// Sync: the Backend's own (an allocation that failed, a launch the driver
// refused), else the device's, else a fused MoE kernel's report of rows
// that never arrived (fusedTables.checkFault).
func (b *Backend) Sync() error {
	derr := b.dev.Sync()
	b.mu.Lock()
	err := b.err
	b.err = nil
	b.mu.Unlock()
	if err == nil {
		err = derr
	}
	if err == nil {
		err = b.fused.checkFault(b.dev)
	}
	return err
}

// fail keeps err (if not nil) for the next Sync.
func (b *Backend) fail(err error) {
	if err == nil {
		return
	}
	b.mu.Lock()
	if b.err == nil {
		b.err = err
	}
	b.mu.Unlock()
}

// launch queues k. Arguments that are tensors (*Tensor, or a nil
// backend.Tensor for an optional one) become device addresses; the rest go
// to Device.Launch as they are. A tensor whose allocation failed makes the
// launch a no-op: the failure is already waiting for Sync.
func (b *Backend) launch(k *Kernel, g Grid, args ...any) {
	conv := make([]any, len(args))
	for i, a := range args {
		switch v := a.(type) {
		case nil:
			conv[i] = driver.DevicePtr(0)
		case *Tensor:
			if v == nil {
				conv[i] = driver.DevicePtr(0)
				continue
			}
			p, ok := v.ptr()
			if !ok {
				return
			}
			conv[i] = p
		default:
			conv[i] = a
		}
	}
	b.fail(b.dev.Launch(k, g, conv...))
	// The addresses are in the queue now; until then the tensors must stay
	// reachable, or their memory could be recycled ahead of the launch.
	runtime.KeepAlive(args)
}

// strideBlocksPerSM is how many 256-thread blocks per SM a grid-stride op
// launches: 8 fill an SM's 2048 threads, so memory-bound kernels keep
// enough loads in flight.
const strideBlocksPerSM = 8

// strideGrid sizes a grid-stride launch over n elements.
func (b *Backend) strideGrid(n int) Grid { return b.dev.StrideGrid(int64(n), 256, strideBlocksPerSM) }
