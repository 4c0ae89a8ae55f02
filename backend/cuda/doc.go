// Package cuda is the runtime under mktrain's CUDA backend: it loads the
// NVIDIA libraries at run time (no cgo, no toolkit at build time), owns each
// GPU through a Device, compiles the kernels of package kernels with NVRTC
// and launches them.
//
// # Use
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
// # Threads
//
// A CUDA context is current on one OS thread at a time, and goroutines move
// between threads, so a Device runs every context-bound call on one
// goroutine locked to its thread (runtime.LockOSThread), fed closures
// through a channel. Do waits for the closure; Submit and Launch only queue
// it, and their errors, like the GPU's own asynchronous faults, come back
// from the next Sync. The channel's order is the stream's order. One Device
// may be used from many goroutines. A round trip through Do costs tens of
// microseconds (waking a parked thread and back), a queued Launch a few, so
// hot paths queue and synchronize once. A closure run by Do or Submit must
// not call the Device's own methods: they would wait for the thread it holds.
//
// # Memory
//
// Alloc rounds a request up to a size class (512 bytes, then four classes
// per power of two) and serves it from that class's free list when it can,
// without a trip to the device thread.
// Free puts the block back on the list once the work queued before it has
// reached the stream, so a block is reused only by later work. Blocks return
// to the driver when an allocation fails (then the allocation is retried),
// on EmptyCache, and on Close. AllocStats reports bytes in use, cached and
// at peak, and allocation counts. When the GPU is full, Alloc returns an
// *OutOfMemoryError naming the bytes asked and free and telling the user to
// lower train.micro_batch or train.seq.
//
// # Kernels
//
// Load compiles a kernels.Source for the device's architecture (sm_90a on
// compute capability 9.0, sm_XY otherwise) to a cubin and caches it under
// $XDG_CACHE_HOME/mktrain/kernels (else ~/.cache/mktrain/kernels), keyed by
// sha256 of the source, target, options and NVRTC version; a cache file is
// written to a temporary name and renamed. A rejected source returns a
// *driver.CompileError with NVRTC's log. Launch takes the kernel's arguments
// as typed Go values (*Buffer, int32, int64, float32, float64, ...).
//
// # Backend
//
// Backend implements backend.Backend on one Device:
//
//	b, err := cuda.OpenBackend(cuda.Options{})  // GPU 0; cuda.NoGPU(err) where there is none
//	defer b.Close()
//	x := b.New(backend.Float32, T, D)           // zeroed, in device memory
//	b.RMSNormForward(out, rstd, x, w, 1e-5)     // queued on the stream
//	err = b.Sync()                              // the first failure since the last Sync
//
// The engine does not import this package: programs hand it Driver
// (NewDriver, usually through package backend/all), a registry.Driver that
// declares the kernels' limits and places one rank per GPU with NCCL
// between them, in one process or over several (driver_registry.go).
//
// Tensors are float32, int32 or bfloat16 (float64 panics: the CPU backend
// serves gradient checks); a Tensor is a window on a storage that views
// share. Storage returns to the caching allocator when the garbage
// collector finds it unreachable, stream-ordered (backend_tensor.go says
// why that is safe). MatMul rounds float32 inputs to bf16 and accumulates
// in fp32 (Gemm, through cuBLASLt); bfloat16 tensors (OperandType) are the
// operands it reads without that conversion, and GatherRows and SwiGLU can
// write and read them (bf16.go, kernels/swiglu.cu and rows.cu). Every
// other op computes in fp32, so the Backend reports a
// bf16-level RelTolerance (backend.Precision) to the conformance suite. Ops
// return at once; a launch the driver refuses, an allocation the GPU cannot
// hold or a kernel fault is kept for Sync, and ops on a tensor whose
// allocation failed do nothing. Download, Sum and SumSquares wait for the
// GPU; Upload waits only until the driver has staged the host data.
//
// # Matrix products
//
// Gemm (matmul.go) runs every MatMul through cuBLASLt, and the grouped
// products (GroupedMatMul, GroupedMatMulTN: the MoE experts) as one
// cuBLASLt call per group, except GroupedMatMul's NT products with bf16
// operands and beta 0 (the experts' forward): those run on GroupedGemm
// (grouped_gemm.go, experts.go), one persistent wgmma/TMA kernel over
// every expert that reads the group offsets on the device; and
// GroupedMatMulTN's bf16 weight gradients into float32 where the TN
// kernel's tiles fill the GPU's waves (GroupedGemm.RunTN; experts.go has
// the rule and its measurements). The algorithm for a product comes from
// cuBLASLt's heuristic, cached per size bucket: 128 wide for MatMul, a
// quarter octave wide for a grouped product's rows (an expert's row count
// changes every step; asking again for each would cost more than the
// product, and the GPU waits on the layer's routing meanwhile). MatMul
// products of at least 2 GFLOP whose sizes are all multiples of 128, the
// model's own dimensions, are autotuned the first time they come:
// cuBLASLt's best 8 candidates are timed and the fastest kept for those
// sizes (GemmOptions.NoAutotune turns it off for runs that must repeat bit
// for bit). Grouped products are never autotuned: a row count seen once
// may never recur.
//
// # Collectives
//
// NCCLGroup (nccl.go, nccl_group.go) is a comm.Group over NCCL on one
// Backend's stream: NewNCCLGroups for one process driving several GPUs,
// NewNCCLGroup for one rank per process with the unique id handed out by
// the rendezvous (launch.Rendezvous). Tensor collectives queue on the stream;
// the calls that return host values wait with a watchdog that turns a
// peer's failure or a timeout into an error instead of a hang. The engine
// uses it through NCCLRanks (one process, one GPU per rank) and
// NCCLNodeRanks (several processes: one NCCL world joined through the
// rendezvous, its groups cut with ncclCommSplit); layouts with more ranks
// than GPUs run as virtual ranks on one GPU (comm.NewLocal).
package cuda
