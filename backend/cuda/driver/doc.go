// Package driver finds NVIDIA's shared libraries at run time and binds the
// C functions mktrain calls: the CUDA driver API (libcuda.so.1) and NVRTC
// (libnvrtc.so.13 or .12). cuBLASLt (libcublasLt.so.13 or .12) and NCCL
// (libnccl.so.2) are found and opened the same way; their bindings come
// later. Nothing here uses cgo: calls go through purego, so the binary builds
// with CGO_ENABLED=0 on any machine and needs neither the CUDA toolkit nor a
// GPU until it runs.
//
// # Where libraries are looked for
//
// For each library, the first place below that holds any accepted version
// wins; within a place the newest version is taken (libnvrtc.so.13 before
// libnvrtc.so.12):
//
//  1. MKTRAIN_LIBCUDA, MKTRAIN_LIBNVRTC, MKTRAIN_LIBCUBLASLT, MKTRAIN_LIBNCCL:
//     the library's file, or a folder holding it. When set, nothing else is
//     searched for that library, and a wrong value is an error.
//  2. MKTRAIN_CUDA_LIB_DIR: a colon-separated list of folders.
//  3. LD_LIBRARY_PATH.
//  4. The dynamic loader's cache, /etc/ld.so.cache (what `ldconfig -p`
//     prints), for this machine's architecture.
//  5. $CUDA_HOME and $CUDA_PATH: lib64 and targets/<arch>-linux/lib;
//     then /usr/local/cuda/lib64 and /usr/local/cuda/targets/<arch>-linux/lib.
//  6. NVIDIA's Python wheels: site-packages/nvidia/*/lib (and dist-packages)
//     under $VIRTUAL_ENV, $CONDA_PREFIX, /opt/torch/.venv, /usr/local, /usr
//     and ~/.local; for example
//     /opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib.
//  7. System folders: /usr/local/nvidia/lib64 (where container runtimes
//     mount the driver), /usr/lib/<arch>-linux-gnu, /lib/<arch>-linux-gnu,
//     /usr/lib64, /usr/lib, /usr/lib/wsl/lib.
//
// When no place has the library, the *NotFoundError lists every place that
// was searched, in order.
//
// # Calling convention
//
// Each Driver method is one C call; a failing CUresult becomes an *Error
// that names the call and its key arguments:
//
//	cuMemAlloc_v2(1073741824 bytes): CUDA_ERROR_OUT_OF_MEMORY (out of memory)
//
// A CUDA context is bound to an OS thread, so every call that needs one
// must run on the thread where the context was made current (package
// backend/cuda keeps one locked goroutine per GPU for this). Pointer arrays
// passed to C (kernel arguments, NVRTC options) must stay pinned for the
// call; the methods here pin what they build themselves.
package driver
