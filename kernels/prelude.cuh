// mktrain kernel prelude, prepended to every source in kernels/ (see
// kernels.go). The kernels include no header at all: NVRTC is given none, so
// they compile where only the driver and a pip-installed NVRTC are present.
//
// Under NVRTC (__CUDACC_RTC__ defined) the CUDA keywords, the built-in
// variables, the math functions and atomicAdd are the compiler's own. The
// block below stands in for them only when clang compiles the sources to PTX
// as a compile check (kernels_test.go); it is never part of a real build.
#ifndef __CUDACC_RTC__
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))
#define __constant__ __attribute__((constant))
#define __forceinline__ __attribute__((always_inline)) inline
#define __launch_bounds__(...) __attribute__((launch_bounds(__VA_ARGS__)))
#define MK_BUILTIN_FIELD(FIELD, INTRINSIC)                                \
  __declspec(property(get = fetch_##FIELD)) unsigned int FIELD;          \
  static inline __attribute__((always_inline)) __device__ unsigned int    \
  fetch_##FIELD(void) { return INTRINSIC; }
struct mk_thread_idx {
  MK_BUILTIN_FIELD(x, __nvvm_read_ptx_sreg_tid_x())
  MK_BUILTIN_FIELD(y, __nvvm_read_ptx_sreg_tid_y())
  MK_BUILTIN_FIELD(z, __nvvm_read_ptx_sreg_tid_z())
};
struct mk_block_idx {
  MK_BUILTIN_FIELD(x, __nvvm_read_ptx_sreg_ctaid_x())
  MK_BUILTIN_FIELD(y, __nvvm_read_ptx_sreg_ctaid_y())
  MK_BUILTIN_FIELD(z, __nvvm_read_ptx_sreg_ctaid_z())
};
struct mk_block_dim {
  MK_BUILTIN_FIELD(x, __nvvm_read_ptx_sreg_ntid_x())
  MK_BUILTIN_FIELD(y, __nvvm_read_ptx_sreg_ntid_y())
  MK_BUILTIN_FIELD(z, __nvvm_read_ptx_sreg_ntid_z())
};
struct mk_grid_dim {
  MK_BUILTIN_FIELD(x, __nvvm_read_ptx_sreg_nctaid_x())
  MK_BUILTIN_FIELD(y, __nvvm_read_ptx_sreg_nctaid_y())
  MK_BUILTIN_FIELD(z, __nvvm_read_ptx_sreg_nctaid_z())
};
extern const __device__ mk_thread_idx threadIdx;
extern const __device__ mk_block_idx blockIdx;
extern const __device__ mk_block_dim blockDim;
extern const __device__ mk_grid_dim gridDim;
// __syncthreads is a clang builtin already.
extern "C" __device__ float expf(float);
extern "C" __device__ float logf(float);
extern "C" __device__ float sqrtf(float);
extern "C" __device__ float fmaxf(float, float);
extern "C" __device__ double exp(double);
extern "C" __device__ double log(double);
extern "C" __device__ double sqrt(double);
__device__ __forceinline__ float atomicAdd(float* p, float v) { return __nvvm_atom_add_gen_f(p, v); }
__device__ __forceinline__ double atomicAdd(double* p, double v) { return __nvvm_atom_add_gen_d(p, v); }
__device__ __forceinline__ unsigned int __float_as_uint(float f) { return __builtin_bit_cast(unsigned int, f); }
__device__ __forceinline__ float __uint_as_float(unsigned int u) { return __builtin_bit_cast(float, u); }
#endif

// Shared helpers. Every name starts with mk_ so sources never collide with
// NVRTC's built-ins.

#define MK_NAN __uint_as_float(0x7fc00000u)
#define MK_INF __uint_as_float(0x7f800000u)

// The global index of this thread and the grid-stride step, in 64 bits so
// tensors past 2^31 elements index correctly.
__device__ __forceinline__ long long mk_global_id() {
  return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long long mk_grid_stride() {
  return (long long)gridDim.x * blockDim.x;
}

// Warp shuffles through PTX, identical under NVRTC and clang.
__device__ __forceinline__ float mk_shfl_xor(float v, int lane_mask) {
  float r;
  asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(r) : "f"(v), "r"(lane_mask));
  return r;
}

__device__ __forceinline__ float mk_warp_sum(float v) {
  for (int m = 16; m > 0; m >>= 1) v += mk_shfl_xor(v, m);
  return v;
}

__device__ __forceinline__ float mk_warp_max(float v) {
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, mk_shfl_xor(v, m));
  return v;
}

// Block-wide reductions for blocks of a multiple of 32 threads (at most
// 1024). scratch holds 32 floats of shared memory; every thread gets the
// result. The leading barrier lets callers reuse scratch back to back.
__device__ __forceinline__ float mk_block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = mk_warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0f;
  return mk_warp_sum(v);
}

__device__ __forceinline__ float mk_block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = mk_warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -MK_INF;
  return mk_warp_max(v);
}

// mk_block_sum_256_f64 returns, in thread 0 of a block of exactly 256
// threads, the sum of the threads' v, added in a fixed tree order (so a
// fixed grid's partial sums repeat bit for bit); s is 256 doubles of
// shared memory.
__device__ __forceinline__ double mk_block_sum_256_f64(double v, double* s) {
  s[threadIdx.x] = v;
  __syncthreads();
  for (int half = 128; half > 0; half >>= 1) {
    if ((int)threadIdx.x < half) s[threadIdx.x] += s[threadIdx.x + half];
    __syncthreads();
  }
  return s[0];
}

// bfloat16, stored as its 16 bits. Conversion from float rounds to nearest
// even and keeps NaNs NaN (quiet), as torch and cuda_bf16.h do.
typedef unsigned short mk_bf16;

__device__ __forceinline__ float mk_bf16_to_f32(mk_bf16 h) {
  return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ mk_bf16 mk_f32_to_bf16(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (mk_bf16)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (mk_bf16)(u >> 16);
}

// mk_store writes a float result into a float32 or bf16 output (rounded
// to nearest even): kernels templated on their output type use it.
__device__ __forceinline__ void mk_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void mk_store(mk_bf16* p, float v) { *p = mk_f32_to_bf16(v); }
