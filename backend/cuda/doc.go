// Package cuda is mktrain's CUDA backend: backend.Backend on NVIDIA GPUs,
// NCCL collectives between them, and the runtime under both. It loads the
// NVIDIA libraries at run time (no cgo, no toolkit at build time), owns
// each GPU through a Device, compiles the kernels of package kernels with
// NVRTC and launches them.
//
// # Use
//
// Programs do not import this package to train: they hand the engine
// NewDriver's Driver, usually through package backend/all
// (engine.WithDrivers(all.Drivers()...)). The Driver is a registry.Driver
// that declares the kernels' limits and places one rank per GPU, with NCCL
// between them in one process or over several (driver_registry.go). Tests
// and tools open a Backend directly:
//
//	b, err := cuda.OpenBackend(cuda.Options{})  // GPU 0; cuda.NoGPU(err) where there is none
//	defer b.Close()
//	x := b.New(backend.Float32, T, D)           // zeroed, in device memory
//	b.RMSNormForward(out, rstd, nil, x, w, 1e-5) // queued on the stream
//	err = b.Sync()                              // the first failure since the last Sync
//
// and the runtime below it:
//
//	rt, err := cuda.Load(cuda.Options{})        // finds libcuda and libnvrtc, cuInit
//	dev, err := rt.Open(0)                      // thread, primary context, stream
//	defer dev.Close()
//	buf, err := dev.Alloc(4 * n)                // caching allocator
//	err = dev.CopyToDevice(buf, 0, cuda.Bytes(xs))
//	src, _ := kernels.Lookup("elementwise.cu")
//	mod, err := dev.Load(src)                   // NVRTC, disk cache, cuModuleLoadData
//	k, _ := mod.Kernel("scale_f32")
//	err = dev.Launch(k, dev.StrideGrid(n, 256, 4), buf, float32(2), int64(n))
//	err = dev.Sync()                            // first asynchronous error, if any
//
// Where the libraries are looked for, and the variables that override it
// (MKTRAIN_LIBCUDA, MKTRAIN_LIBNVRTC, MKTRAIN_LIBCUBLASLT, MKTRAIN_LIBNCCL,
// MKTRAIN_CUDA_LIB_DIR), is documented in package driver.
//
// # Design notes
//
// Threads. A CUDA context is current on one OS thread at a time, so a
// Device runs every context-bound call on one goroutine locked to its
// thread, fed closures through a channel whose order is the stream's. Do
// waits for the closure; Submit and Launch only queue it, and their errors,
// like the GPU's own faults, come back from the next Sync. A round trip
// through Do costs tens of microseconds, so hot paths queue and synchronize
// once. A closure run by Do or Submit must not call its Device's methods.
//
// Memory. Alloc rounds a request up to a size class and serves it from that
// class's free list; Free returns the block once the work queued before it
// has reached the stream. Cached blocks go back to the driver when an
// allocation fails (which is then retried), on EmptyCache and on Close;
// AllocStats reports usage. A full GPU gives an *OutOfMemoryError that
// tells the user to lower train.micro_batch or train.seq. Backend tensors
// return their storage when the garbage collector finds them unreachable,
// stream-ordered (backend_tensor.go says why that is safe).
//
// Kernels. Load compiles a kernels.Source for the device's architecture
// (sm_90a on compute capability 9.0) to a cubin cached under
// DefaultKernelCacheDir, keyed by the source, target, options and NVRTC
// version; a rejected source returns a *driver.CompileError with NVRTC's log.
//
// Precision. Tensors are float32, int32 or bfloat16. MatMul rounds float32
// inputs to bf16 and accumulates in fp32; bfloat16 tensors (OperandType)
// are operands it reads without that conversion. Every other op computes in
// fp32, so the Backend reports a bf16-level RelTolerance (backend.Precision)
// to the conformance suite. Ops return at once; a refused launch, a failed
// allocation or a kernel fault is kept for Sync. Download, Sum and
// SumSquares wait for the GPU.
//
// Matrix products (matmul.go, experts.go). MatMul and most grouped products
// run on cuBLASLt, with its heuristic's algorithm cached per size bucket;
// large MatMuls of the model's dimensions are autotuned once
// (GemmOptions.NoAutotune turns that off for bitwise-repeatable runs). The
// experts' bf16 forward products, and their weight gradients where the
// tiles fill the GPU, run on GroupedGemm (grouped_gemm.go): one persistent
// wgmma/TMA kernel over every expert that reads the group offsets on the
// device. The fused MoE ops (moe_fused.go, peer.go) reach other ranks' rows
// through peer access. kernels/grouped_gemm.md records the choices.
//
// Collectives. NCCLGroup (nccl.go, nccl_group.go) is a comm.Group over NCCL
// on one Backend's stream; the calls that return host values wait with a
// watchdog that turns a peer's failure or a timeout into an error instead
// of a hang. NCCLRanks builds the groups of one process driving several
// GPUs; NCCLNodeRanks a node's part of a world of several processes, joined
// through the rendezvous (launch.Rendezvous), its groups cut with
// ncclCommSplit. Layouts with more ranks than GPUs run as
// virtual ranks on one GPU (comm.NewLocal).
//
// Profiling. ProfileClock times ops with CUDA events for package
// backend/profile (profile_clock.go); StartProfiler and StopProfiler call
// the CUDA profiler API (profiler_api.go), so that an attached
// `nsys profile --capture-range=cudaProfilerApi` records only the stretch
// between them.
package cuda
