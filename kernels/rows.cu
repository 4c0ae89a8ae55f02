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

// The ordered scatter-add below is train.deterministic's form of
// scatter_add_rows_f32 and embedding_backward_f32: the same sums, each
// output row added to by one block in increasing i, so the result is the
// same bits on every run (and the CPU backend's, which adds in that order
// too). It takes two launches: stable_order_i32 sorts the row indices, then
// scatter_add_rows_ordered_f32 adds each run of equal rows.

// stable_order_i32: order[rank(i)] = i, where rank(i) counts the j with
// keys[j] < keys[i], or keys[j] == keys[i] and j < i: a stable sort of the
// N keys by counting, O(N^2) comparisons through shared-memory tiles (every
// thread reads the same key at a time, a broadcast) and no atomics. Grid:
// ceil(N/256) blocks of 256.
extern "C" __global__ void __launch_bounds__(256) stable_order_i32(int* order, const int* keys, int N) {
  __shared__ int tile[1024];
  const int i = blockIdx.x * 256 + threadIdx.x;
  const int key = i < N ? keys[i] : 0;
  int rank = 0;
  for (int j0 = 0; j0 < N; j0 += 1024) {
    __syncthreads();
    for (int j = threadIdx.x; j < 1024; j += 256) tile[j] = j0 + j < N ? keys[j0 + j] : 0;
    __syncthreads();
    const int jn = N - j0 < 1024 ? N - j0 : 1024;
    const int before = i - j0;  // tile entries j < before come before i
    for (int j = 0; j < jn; j++) {
      const int kj = tile[j];
      rank += (kj < key) | ((kj == key) & (j < before));
    }
  }
  if (i < N) order[rank] = i;
}

// scatter_add_rows_ordered_f32: out[rows[i], :] += scale[i] * in[i, :] for
// every i, rows in [0, T) only (others are skipped, as the embedding's ids
// outside the table). order is stable_order_i32 of rows. Block p starts the
// run of equal rows at order[p] (other blocks return): it reads the output
// row once, adds the run's rows in increasing i with products and sums
// rounded one at a time (mul.rn, add.rn: never fused), and writes it back.
// Grid: N blocks.
extern "C" __global__ void scatter_add_rows_ordered_f32(float* out, const float* in, const int* rows, const float* scale,
                                                        const int* order, int N, int D, int T) {
  const int p = blockIdx.x;
  if (p >= N) return;
  const int row = rows[order[p]];
  if ((p > 0 && rows[order[p - 1]] == row) || row < 0 || row >= T) return;
  int end = p + 1;
  while (end < N && rows[order[end]] == row) end++;
  float* dst = out + (long long)row * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = dst[d];
    for (int q = p; q < end; q++) {
      const int i = order[q];
      float v = in[(long long)i * D + d];
      if (scale != 0) asm("mul.rn.f32 %0, %0, %1;" : "+f"(v) : "f"(scale[i]));
      asm("add.rn.f32 %0, %0, %1;" : "+f"(acc) : "f"(v));
    }
    dst[d] = acc;
  }
}
