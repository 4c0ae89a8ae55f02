// Row gathers and scatters used by MoE dispatch and combine. rows[i] names a
// row of the T-row tensor; scale may be null (1).

// gather_rows_f32: out[i, :] = scale[i] * in[rows[i], :]. Grid: N blocks.
extern "C" __global__ void gather_rows_f32(float* out, const float* in, const int* rows, const float* scale, int N, int D) {
  const int i = blockIdx.x;
  if (i >= N) return;
  const float s = scale != 0 ? scale[i] : 1.0f;
  const float* src = in + (long long)rows[i] * D;
  float* dst = out + (long long)i * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) dst[d] = s * src[d];
}

// scatter_add_rows_f32: out[rows[i], :] += scale[i] * in[i, :]. Grid: N
// blocks. Rows hit more than once add through atomics.
extern "C" __global__ void scatter_add_rows_f32(float* out, const float* in, const int* rows, const float* scale, int N, int D) {
  const int i = blockIdx.x;
  if (i >= N) return;
  const float s = scale != 0 ? scale[i] : 1.0f;
  const float* src = in + (long long)i * D;
  float* dst = out + (long long)rows[i] * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) atomicAdd(&dst[d], s * src[d]);
}

// row_dots_f32: out[i] = dot(a[rows[i], :], b[i, :]). Grid: N blocks of 256.
extern "C" __global__ void __launch_bounds__(256) row_dots_f32(float* out, const float* a, const int* rows, const float* b, int N, int D) {
  __shared__ float scratch[32];
  const int i = blockIdx.x;
  if (i >= N) return;
  const float* x = a + (long long)rows[i] * D;
  const float* y = b + (long long)i * D;
  float acc = 0.0f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) acc += x[d] * y[d];
  acc = mk_block_sum(acc, scratch);
  if (threadIdx.x == 0) out[i] = acc;
}

// gather_rows_f32_bf16: gather_rows_f32 into a bf16 out, each value rounded
// to nearest even. Grid: N blocks. vec != 0 moves four elements per access
// (16-byte loads, 8-byte stores); the launcher sets it only when D is a
// multiple of 4, in is 16-byte and out 8-byte aligned.
struct alignas(16) rw_f4 {
  float x, y, z, w;
};
struct alignas(8) rw_h4 {
  mk_bf16 x, y, z, w;
};

extern "C" __global__ void gather_rows_f32_bf16(mk_bf16* out, const float* in, const int* rows, const float* scale, int N, int D, int vec) {
  const int i = blockIdx.x;
  if (i >= N) return;
  const float s = scale != 0 ? scale[i] : 1.0f;
  const float* src = in + (long long)rows[i] * D;
  mk_bf16* dst = out + (long long)i * D;
  if (vec) {
    const rw_f4* src4 = (const rw_f4*)src;
    rw_h4* dst4 = (rw_h4*)dst;
    for (int d = threadIdx.x; d < D / 4; d += blockDim.x) {
      const rw_f4 v = src4[d];
      dst4[d] = rw_h4{mk_f32_to_bf16(s * v.x), mk_f32_to_bf16(s * v.y), mk_f32_to_bf16(s * v.z), mk_f32_to_bf16(s * v.w)};
    }
    return;
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) dst[d] = mk_f32_to_bf16(s * src[d]);
}
