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

// gather_rows_f32_bf16: gather_rows_f32 into a bf16 out, each value rounded
// to nearest even; gather_rows_bf16 and gather_rows_bf16_bf16 the same
// from a bf16 in (widened exactly) into a float32 or bf16 out (a bf16 row
// unscaled comes through unchanged). Grid: N blocks. vec != 0 moves four
// elements per access; the launcher sets it only when D is a multiple of
// 4 and both tensors are aligned to four of their elements.
struct alignas(16) rw_f4 {
  float x, y, z, w;
};
struct alignas(8) rw_h4 {
  mk_bf16 x, y, z, w;
};

__device__ __forceinline__ rw_f4 rw_load4(const float* p, int j) { return ((const rw_f4*)p)[j]; }
__device__ __forceinline__ rw_f4 rw_load4(const mk_bf16* p, int j) {
  const rw_h4 h = ((const rw_h4*)p)[j];
  return rw_f4{mk_bf16_to_f32(h.x), mk_bf16_to_f32(h.y), mk_bf16_to_f32(h.z), mk_bf16_to_f32(h.w)};
}
__device__ __forceinline__ float rw_load(const float* p) { return *p; }
__device__ __forceinline__ float rw_load(const mk_bf16* p) { return mk_bf16_to_f32(*p); }
__device__ __forceinline__ void rw_store4(float* p, int j, rw_f4 v) { ((rw_f4*)p)[j] = v; }
__device__ __forceinline__ void rw_store4(mk_bf16* p, int j, rw_f4 v) {
  ((rw_h4*)p)[j] = rw_h4{mk_f32_to_bf16(v.x), mk_f32_to_bf16(v.y), mk_f32_to_bf16(v.z), mk_f32_to_bf16(v.w)};
}

// gather_rows_narrow_f32 and scatter_add_rows_narrow_f32 are
// gather_rows_f32 and scatter_add_rows_f32 for narrow rows (the MoE
// layer's gates, one value a row): one thread per element, grid-stride,
// instead of a block per row of which all but a few threads idle.
extern "C" __global__ void gather_rows_narrow_f32(float* out, const float* in, const int* rows, const float* scale, int N, int D) {
  const long long n = (long long)N * D;
  for (long long e = mk_global_id(); e < n; e += mk_grid_stride()) {
    const long long i = e / D;
    const int d = (int)(e % D);
    out[e] = (scale != 0 ? scale[i] : 1.0f) * in[(long long)rows[i] * D + d];
  }
}

extern "C" __global__ void scatter_add_rows_narrow_f32(float* out, const float* in, const int* rows, const float* scale, int N, int D) {
  const long long n = (long long)N * D;
  for (long long e = mk_global_id(); e < n; e += mk_grid_stride()) {
    const long long i = e / D;
    const int d = (int)(e % D);
    atomicAdd(&out[(long long)rows[i] * D + d], (scale != 0 ? scale[i] : 1.0f) * in[e]);
  }
}

// row_dots_f32: out[i] = dot(a[rows[i], :], b[i, :]); row_dots_f32_bf16
// the same with a bf16 b (the MoE layer's expert outputs), widened
// exactly. One warp per row, grid-stride, float32 sums; vec as
// gather_rows (four elements per access).
__device__ __forceinline__ float rw_widen(float v) { return v; }
__device__ __forceinline__ float rw_widen(mk_bf16 v) { return mk_bf16_to_f32(v); }

template <typename B>
__device__ __forceinline__ void row_dots(float* out, const float* a, const int* rows, const B* b, int N, int D, int vec) {
  const int lane = threadIdx.x & 31;
  const long long warps = mk_grid_stride() >> 5;
  for (long long i = mk_global_id() >> 5; i < N; i += warps) {
    const float* x = a + (long long)rows[i] * D;
    const B* y = b + i * D;
    float acc = 0.0f;
    if (vec) {
      for (int j = lane; j < D / 4; j += 32) {
        const rw_f4 u = rw_load4(x, j), v = rw_load4(y, j);
        acc += u.x * v.x + u.y * v.y + u.z * v.z + u.w * v.w;
      }
    } else {
      for (int j = lane; j < D; j += 32) acc += x[j] * rw_widen(y[j]);
    }
    acc = mk_warp_sum(acc);
    if (lane == 0) out[i] = acc;
  }
}

extern "C" __global__ void row_dots_f32(float* out, const float* a, const int* rows, const float* b, int N, int D, int vec) {
  row_dots(out, a, rows, b, N, D, vec);
}

extern "C" __global__ void row_dots_f32_bf16(float* out, const float* a, const int* rows, const mk_bf16* b, int N, int D, int vec) {
  row_dots(out, a, rows, b, N, D, vec);
}

template <typename In, typename Out>
__device__ __forceinline__ void gather_rows(Out* out, const In* in, const int* rows, const float* scale, int N, int D, int vec) {
  const int i = blockIdx.x;
  if (i >= N) return;
  const float s = scale != 0 ? scale[i] : 1.0f;
  const In* src = in + (long long)rows[i] * D;
  Out* dst = out + (long long)i * D;
  if (vec) {
    for (int d = threadIdx.x; d < D / 4; d += blockDim.x) {
      const rw_f4 v = rw_load4(src, d);
      rw_store4(dst, d, rw_f4{s * v.x, s * v.y, s * v.z, s * v.w});
    }
    return;
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) mk_store(dst + d, s * rw_load(src + d));
}

extern "C" __global__ void gather_rows_f32_bf16(mk_bf16* out, const float* in, const int* rows, const float* scale, int N, int D, int vec) {
  gather_rows(out, in, rows, scale, N, D, vec);
}

extern "C" __global__ void gather_rows_bf16(float* out, const mk_bf16* in, const int* rows, const float* scale, int N, int D, int vec) {
  gather_rows(out, in, rows, scale, N, D, vec);
}

extern "C" __global__ void gather_rows_bf16_bf16(mk_bf16* out, const mk_bf16* in, const int* rows, const float* scale, int N, int D, int vec) {
  gather_rows(out, in, rows, scale, N, D, vec);
}

// gather_sum_rows_f32 and gather_sum_rows_bf16 (from a bf16 in): out[t, :]
// += sum over k < K of scale[t*K + k] * in[pos[t*K + k], :], skipping
// pos < 0, the terms added in increasing pos (the order a scatter over
// in's rows adds them) with each product and sum rounded on its own
// (mul.rn, add.rn: never fused), as the CPU backend adds: both give the
// same bits. The scatter-add of the MoE combine done as a gather: every
// output row read and written once by one block, no atomics, the same
// sums in the same order on every run. A row's non-negative positions are
// distinct; K <= RW_MAX_K (the launcher checks). Grid: T blocks of at
// least K threads; vec as gather_rows (D a multiple of 4, out and in
// aligned to four elements).
#define RW_MAX_K 64

__device__ __forceinline__ float rw_madd(float acc, float s, float v) {
  float p;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(p) : "f"(s), "f"(v));
  asm("add.rn.f32 %0, %0, %1;" : "+f"(acc) : "f"(p));
  return acc;
}

template <typename In>
__device__ __forceinline__ void gather_sum_rows(float* out, const In* in, const int* pos, const float* scale, int T, int K,
                                                int D, int vec) {
  __shared__ int sPos[RW_MAX_K];
  __shared__ float sScale[RW_MAX_K];
  __shared__ int sN;
  const int t = blockIdx.x;
  if (t >= T) return;
  // The token's terms in increasing position: thread k places its own at
  // its rank among the valid ones.
  const int* p = pos + (long long)t * K;
  if ((int)threadIdx.x < K) {
    const int mine = p[threadIdx.x];
    if (mine >= 0) {
      int r = 0;  // ties (a row naming a position twice, against the contract) by k: no slot left unwritten
      for (int j = 0; j < K; j++) {
        const int o = p[j];
        r += o >= 0 && (o < mine || (o == mine && j < (int)threadIdx.x));
      }
      sPos[r] = mine;
      sScale[r] = scale != 0 ? scale[(long long)t * K + threadIdx.x] : 1.0f;
    }
  }
  if (threadIdx.x == 0) {
    int n = 0;
    for (int j = 0; j < K; j++) n += p[j] >= 0;
    sN = n;
  }
  __syncthreads();
  const int n = sN;
  float* dst = out + (long long)t * D;
  if (vec) {
    for (int d = threadIdx.x; d < D / 4; d += blockDim.x) {
      rw_f4 acc = ((const rw_f4*)dst)[d];
      for (int r = 0; r < n; r++) {
        const float s = sScale[r];
        const rw_f4 v = rw_load4(in + (long long)sPos[r] * D, d);
        acc = rw_f4{rw_madd(acc.x, s, v.x), rw_madd(acc.y, s, v.y), rw_madd(acc.z, s, v.z), rw_madd(acc.w, s, v.w)};
      }
      rw_store4(dst, d, acc);
    }
    return;
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = dst[d];
    for (int r = 0; r < n; r++) acc = rw_madd(acc, sScale[r], rw_load(in + (long long)sPos[r] * D + d));
    dst[d] = acc;
  }
}

extern "C" __global__ void gather_sum_rows_f32(float* out, const float* in, const int* pos, const float* scale, int T, int K, int D, int vec) {
  gather_sum_rows(out, in, pos, scale, T, K, D, vec);
}

extern "C" __global__ void gather_sum_rows_bf16(float* out, const mk_bf16* in, const int* pos, const float* scale, int T, int K, int D, int vec) {
  gather_sum_rows(out, in, pos, scale, T, K, D, vec);
}

// The ordered scatter-add below is train.deterministic's form of
// scatter_add_rows_f32 and embedding_backward_f32: the same sums, each
// output element added to by one thread in increasing i, so the result is
// the same bits on every run (and the CPU backend's, which adds in that
// order too). Three launches: stable_rank_i32 and stable_place_i32 sort the
// row indices stably, then scatter_add_rows_ordered_f32 adds each run of
// equal rows.

// stable_rank_i32: rank[i] += the number of j in this block's key range
// with (keys[j], j) < (keys[i], i), so that over the whole grid rank[i] is
// i's place in a stable sort of the N keys (rank zeroed before). O(N^2)
// comparisons of 64-bit (key, index) pairs: each thread ranks 4 items
// against the 4096 keys of its block's range, which pass through shared
// memory 1024 at a time, every thread reading the same one at a time (a
// broadcast). The partial counts meet in integer atomics, whose sum does
// not depend on their order. Grid: (ceil(N/1024), ceil(N/4096)) blocks of
// 256.
__device__ __forceinline__ long long mk_key_index(int key, int i) {
  // key * 2^32 + i: ordered by key, then by index; a multiplication, as a
  // left shift of a negative key (an id outside the table) is undefined.
  return (long long)key * 4294967296LL + (unsigned)i;
}

extern "C" __global__ void __launch_bounds__(256) stable_rank_i32(int* rank, const int* keys, int N) {
  __shared__ long long tile[1024];
  long long mine[4];
  int count[4];
#pragma unroll
  for (int c = 0; c < 4; c++) {
    const int i = blockIdx.x * 1024 + c * 256 + threadIdx.x;
    mine[c] = i < N ? mk_key_index(keys[i], i) : 0;
    count[c] = 0;
  }
  const int jEnd = (blockIdx.y + 1) * 4096 < N ? (blockIdx.y + 1) * 4096 : N;
  for (int j0 = blockIdx.y * 4096; j0 < jEnd; j0 += 1024) {
    __syncthreads();
    for (int j = threadIdx.x; j < 1024; j += 256)
      tile[j] = j0 + j < jEnd ? mk_key_index(keys[j0 + j], j0 + j) : 0x7fffffffffffffffLL;
    __syncthreads();
#pragma unroll 4
    for (int j = 0; j < 1024; j++) {
      const long long t = tile[j];
#pragma unroll
      for (int c = 0; c < 4; c++) count[c] += t < mine[c];
    }
  }
#pragma unroll
  for (int c = 0; c < 4; c++) {
    const int i = blockIdx.x * 1024 + c * 256 + threadIdx.x;
    if (i < N && count[c] != 0) asm volatile("red.global.add.s32 [%0], %1;" ::"l"(rank + i), "r"(count[c]) : "memory");
  }
}

// stable_place_i32: order[rank[i]] = i and sorted[rank[i]] = keys[i].
// Grid-stride over N.
extern "C" __global__ void stable_place_i32(int* order, int* sorted, const int* rank, const int* keys, int N) {
  for (long long i = mk_global_id(); i < N; i += mk_grid_stride()) {
    order[rank[i]] = (int)i;
    sorted[rank[i]] = keys[i];
  }
}

// scatter_add_rows_ordered_f32: out[rows[i], :] += scale[i] * in[i, :] for
// every i, rows in [0, T) only (others are skipped, as the embedding's ids
// outside the table), given the stable sort of rows: order and sorted (the
// rows in that order). Block p starts the run of equal rows at position p
// (other blocks return at once): it stages the run's indices 256 at a time
// in shared memory and adds their rows in increasing i, each thread owning
// columns threadIdx.x + 256c, with products and sums rounded one at a time
// (mul.rn, add.rn: never fused), eight rows' loads in flight. Columns go
// 2048 at a time (eight accumulators a thread). Grid: N blocks of 256.
extern "C" __global__ void __launch_bounds__(256) scatter_add_rows_ordered_f32(
    float* out, const float* in, const int* sorted, const float* scale, const int* order, int N, int D, int T) {
  __shared__ int sIdx[256];
  __shared__ float sScale[256];
  __shared__ int sWarpCount[8];
  const int p = blockIdx.x;
  if (p >= N) return;
  const int row = sorted[p];
  if ((p > 0 && sorted[p - 1] == row) || row < 0 || row >= T) return;
  float* dst = out + (long long)row * D;
  for (int d0 = 0; d0 < D; d0 += 2048) {
    float acc[8];
#pragma unroll
    for (int c = 0; c < 8; c++) {
      const int d = d0 + c * 256 + threadIdx.x;
      acc[c] = d < D ? dst[d] : 0.0f;
    }
    for (int q0 = p; q0 < N; q0 += 256) {
      // Stage the next 256 positions; the run's are a prefix of them.
      const int q = q0 + threadIdx.x;
      const int idx = q < N && sorted[q] == row ? order[q] : -1;
      __syncthreads();  // the previous chunk's reads are done
      sIdx[threadIdx.x] = idx;
      sScale[threadIdx.x] = idx >= 0 && scale != 0 ? scale[idx] : 1.0f;
      unsigned ballot, count;
      asm volatile("{ .reg .pred staged; setp.ge.s32 staged, %1, 0; vote.sync.ballot.b32 %0, staged, 0xffffffff; }"
                   : "=r"(ballot) : "r"(idx));
      asm("popc.b32 %0, %1;" : "=r"(count) : "r"(ballot));
      if ((threadIdx.x & 31) == 0) sWarpCount[threadIdx.x >> 5] = (int)count;
      __syncthreads();
      int n = 0;
#pragma unroll
      for (int w = 0; w < 8; w++) n += sWarpCount[w];
#pragma unroll
      for (int c = 0; c < 8; c++) {
        const int d = d0 + c * 256 + threadIdx.x;
        if (d >= D) break;
        // Eight rows' loads issued together, then added in order.
        for (int j0 = 0; j0 < n; j0 += 8) {
          float v[8];
#pragma unroll
          for (int u = 0; u < 8; u++) v[u] = j0 + u < n ? in[(long long)sIdx[j0 + u] * D + d] : 0.0f;
#pragma unroll
          for (int u = 0; u < 8; u++) {
            if (j0 + u >= n) break;
            if (scale != 0) asm("mul.rn.f32 %0, %0, %1;" : "+f"(v[u]) : "f"(sScale[j0 + u]));
            asm("add.rn.f32 %0, %0, %1;" : "+f"(acc[c]) : "f"(v[u]));
          }
        }
      }
      if (n < 256) break;
    }
#pragma unroll
    for (int c = 0; c < 8; c++) {
      const int d = d0 + c * 256 + threadIdx.x;
      if (d < D) dst[d] = acc[c];
    }
  }
}
