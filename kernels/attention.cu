// Causal grouped-query attention, flash style, in float32 on the CUDA cores:
// the forward writes out and lse, the backward dq, dk and dv. No kernel
// holds a Seq x Seq matrix: scores live in registers, a chunk of 8 or 16
// keys (or queries) at a time.
//
// Layout (backend.AttnShape): S queries and KS keys per sequence (KS =
// KVSeq, equal to S in plain self-attention); query token b*S + i, key
// token b*KS + j; q and out are [B*S, H*Dh], k and v [B*KS, KV*Dh],
// row-major; query head h reads kv head h / (H/KV) (Hugging Face repeat_kv
// order); lse is [B, H, S], natural log. Scores are scaled by 1/sqrt(Dh)
// and masked causally with the query offset off (QOffset): query i sees
// keys 0..min(off+i, KS-1); an unmasked call (AttnShape.Full) passes
// off = KS-1. So key tiles run up to the block's last visible key, and
// the dk/dv kernel's query tiles start at the first query that sees its
// first key (max(0, j0-off)); a key block no query sees writes zeros.
//
// Work split. Every kernel is instantiated for DP = 32, 64 and 128, the head
// dim rounded up; dims Dh..DP-1 are zeros in registers and shared memory.
// A block owns 64 rows (query rows in the forward and dq kernels, key rows
// in the dk/dv kernel) with 64*G threads, G = DP/32: the G consecutive
// threads of a row hold 32 of its dims each, in the float4 slots g, g+G,
// g+2G, ... (interleaved, so the G threads of a row read adjacent 16-byte
// words of a shared row and never share a bank). The other side streams
// through shared memory in tiles of 4096/DP rows (16 KiB per operand). All
// threads of a warp read the same shared row at the same time, a broadcast,
// so each 16-byte shared load feeds 4 FMAs per thread. Dot products are
// summed over the G threads of a row with warp shuffles.
//
// Scores are kept in base 2: q (or k) is multiplied on load by
// scale_log2 = log2(e)/sqrt(Dh), so softmax uses exp2f; lse is converted to
// natural log when written and back when read.
//
// The backward is two kernels, deterministic, with no atomics:
//   attn_backward_dq: per query tile, dq_i = scale * sum_j ds_ij k_j, where
//     p_ij = exp(s_ij - lse_i), ds_ij = p_ij * (dout_i.v_j - D_i); it also
//     writes D_i = dout_i.out_i to delta [B, H, S] for the next kernel.
//   attn_backward_dkdv: per key tile of one kv head, over the H/KV query
//     heads of its group and the query tiles that see its keys:
//     dv_j = sum_i p_ij dout_i, dk_j = scale * sum_i ds_ij q_i.
// Each output row is written by the one thread group that owns it.

#ifndef __CUDACC_RTC__
extern "C" __device__ float exp2f(float);
#endif

#define ATTN_ROWS 64
#define ATTN_LOG2E 1.4426950408889634f
#define ATTN_LN2 0.6931471805599453f

struct alignas(16) attn_f4 {
  float x, y, z, w;
};

__device__ __forceinline__ int attn_min(int a, int b) { return a < b ? a : b; }

// attn_dot4 returns acc + r[0..3] . s.
__device__ __forceinline__ float attn_dot4(float acc, const float* r, attn_f4 s) {
  acc += r[0] * s.x;
  acc += r[1] * s.y;
  acc += r[2] * s.z;
  acc += r[3] * s.w;
  return acc;
}

// attn_axpy4 does r[0..3] += a * s.
__device__ __forceinline__ void attn_axpy4(float* r, float a, attn_f4 s) {
  r[0] += a * s.x;
  r[1] += a * s.y;
  r[2] += a * s.z;
  r[3] += a * s.w;
}

// attn_group_sum sums v over the G consecutive lanes that share a row.
template <int G>
__device__ __forceinline__ float attn_group_sum(float v) {
#pragma unroll
  for (int m = 1; m < G; m <<= 1) v += mk_shfl_xor(v, m);
  return v;
}

// attn_load_row reads this thread's 32 dims of one head row (src + base,
// Dh wide) into r, times mul; zeros past Dh and for a row that is not there.
template <int G>
__device__ __forceinline__ void attn_load_row(float* r, const float* src, long long base, bool valid, int Dh, int g, float mul) {
#pragma unroll
  for (int u = 0; u < 8; u++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int d = 4 * (g + G * u) + e;
      r[4 * u + e] = (valid && d < Dh) ? src[base + d] * mul : 0.0f;
    }
}

// attn_store_row writes this thread's 32 dims of a head row, times mul.
template <int G>
__device__ __forceinline__ void attn_store_row(float* dst, long long base, const float* r, int Dh, int g, float mul) {
#pragma unroll
  for (int u = 0; u < 8; u++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int d = 4 * (g + G * u) + e;
      if (d < Dh) dst[base + d] = r[4 * u + e] * mul;
    }
}

// Asynchronous copies from global to shared memory (cp.async, sm_80 and
// later), so the next tile loads while the current one is used. A copy
// with valid false reads nothing and writes a zero.
__device__ __forceinline__ void attn_cp_async4(float* dst, const float* src, bool valid) {
  unsigned int d;
  asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(d) : "l"(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
__device__ __forceinline__ void attn_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// attn_cp_wait_prev waits for all but the most recent group of copies.
__device__ __forceinline__ void attn_cp_wait_prev() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void attn_cp_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// attn_reread makes the compiler load shared memory afresh after it: the
// second pass over a chunk re-reads the rows the first pass read, which is
// cheaper than keeping them all in registers in between (that spills).
__device__ __forceinline__ void attn_reread() { asm volatile("" ::: "memory"); }

// attn_issue_tile starts copying TILE head rows, from sequence position
// row0, into dst as rows of DP floats. src + base is the head's first
// column at position 0 of the sequence, stride the matrix's row stride.
// Positions past S and dims past Dh read as zero. Each thread copies one
// column of every NT/DP-th row, so it keeps one pointer, not one per copy.
template <int DP, int NT, int TILE>
__device__ __forceinline__ void attn_issue_tile(attn_f4* dst, const float* src, long long base, long long stride, int row0, int S, int Dh) {
  constexpr int RS = NT / DP;
  static_assert(NT % DP == 0 && TILE % RS == 0, "tile copy shape");
  const int c = threadIdx.x % DP, r0 = threadIdx.x / DP;
  float* d = (float*)dst + r0 * DP + c;
  const float* p = src + base + (long long)(row0 + r0) * stride + c;
#pragma unroll
  for (int n = 0; n < TILE / RS; n++) {
    const bool valid = row0 + r0 + n * RS < S && c < Dh;
    attn_cp_async4(d + n * RS * DP, valid ? p : src, valid);
    p += RS * stride;
  }
}

// attn_forward: grid (B*H, ceil(S/64)), 64*G threads. Writes out and lse
// for queries q0..q0+63 of head h; the longest rows go first.
template <int DP>
__device__ __forceinline__ void attn_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                                             int S, int KS, int off, int H, int KV, int Dh, float scale_log2) {
  constexpr int G = DP / 32, NT = ATTN_ROWS * G, TILE = 2048 / DP, CH = 16, RW = 32 / G;
  __shared__ attn_f4 ks[2][TILE * DP / 4];
  __shared__ attn_f4 vs[2][TILE * DP / 4];
  const int tid = threadIdx.x, g = tid % G;
  const int b = blockIdx.x / H, h = blockIdx.x % H, kvh = h / (H / KV);
  const int q0 = (gridDim.y - 1 - blockIdx.y) * ATTN_ROWS;
  const int i = q0 + tid / G;
  // The last key any row of this warp sees, and one past the block's.
  const int warp_last = off + q0 + (tid / 32 + 1) * RW - 1;
  const long long qstride = (long long)H * Dh, kstride = (long long)KV * Dh;
  const long long qrow = ((long long)b * S + i) * qstride + (long long)h * Dh;
  const long long kbase = (long long)b * KS * kstride + (long long)kvh * Dh;
  const int kend = attn_min(KS, off + attn_min(S, q0 + ATTN_ROWS)), ntiles = (kend + TILE - 1) / TILE;

  attn_issue_tile<DP, NT, TILE>(ks[0], k, kbase, kstride, 0, KS, Dh);
  attn_issue_tile<DP, NT, TILE>(vs[0], v, kbase, kstride, 0, KS, Dh);
  attn_cp_commit();

  float qr[32], o[32];
  attn_load_row<G>(qr, q, qrow, i < S, Dh, g, scale_log2);
#pragma unroll
  for (int d = 0; d < 32; d++) o[d] = 0.0f;
  float m = -MK_INF, l = 0.0f;

  for (int t = 0; t < ntiles; t++) {
    const int k0 = t * TILE;
    if (t + 1 < ntiles) {
      attn_issue_tile<DP, NT, TILE>(ks[(t + 1) & 1], k, kbase, kstride, k0 + TILE, KS, Dh);
      attn_issue_tile<DP, NT, TILE>(vs[(t + 1) & 1], v, kbase, kstride, k0 + TILE, KS, Dh);
      attn_cp_commit();
      attn_cp_wait_prev();
    } else {
      attn_cp_wait_all();
    }
    __syncthreads();  // tile t is in for every thread
    const attn_f4* kt = ks[t & 1];
    const attn_f4* vt = vs[t & 1];
    for (int c0 = 0; c0 < TILE && k0 + c0 < kend; c0 += CH) {
      // Warp-uniform: keys after every row of this warp are all masked.
      if (k0 + c0 > warp_last) break;
      float s[CH];
#pragma unroll
      for (int c = 0; c < CH; c++) s[c] = 0.0f;
#pragma unroll
      for (int u = 0; u < 8; u++)
#pragma unroll
        for (int c = 0; c < CH; c++) s[c] = attn_dot4(s[c], qr + 4 * u, kt[(c0 + c) * (DP / 4) + g + G * u]);
      float mx = m;
#pragma unroll
      for (int c = 0; c < CH; c++) {
        s[c] = attn_group_sum<G>(s[c]);
        if (k0 + c0 + c > off + i || k0 + c0 + c >= KS) s[c] = -MK_INF;
        mx = fmaxf(mx, s[c]);
      }
      // Key 0 is in every row's first chunk, so mx is finite after it; the
      // guard keeps a chunk masked for a whole row from making NaNs.
      const float mref = mx == -MK_INF ? 0.0f : mx;
      const float corr = exp2f(m - mref);
      m = mx;
      l *= corr;
#pragma unroll
      for (int d = 0; d < 32; d++) o[d] *= corr;
#pragma unroll
      for (int c = 0; c < CH; c++) {
        const float p = exp2f(s[c] - mref);
        l += p;
#pragma unroll
        for (int u = 0; u < 8; u++) attn_axpy4(o + 4 * u, p, vt[(c0 + c) * (DP / 4) + g + G * u]);
      }
    }
    __syncthreads();  // tile t is used up before its buffer is refilled
  }
  if (i < S) {
    attn_store_row<G>(out, qrow, o, Dh, g, 1.0f / l);
    if (g == 0) lse[((long long)b * H + h) * S + i] = m * ATTN_LN2 + logf(l);
  }
}

// attn_backward_dq: grid (B*H, ceil(S/64)), 64*G threads. Writes dq and
// delta for queries q0..q0+63 of head h.
template <int DP>
__device__ __forceinline__ void attn_backward_dq(float* dq, float* delta, const float* dout, const float* q, const float* k,
                                                 const float* v, const float* out, const float* lse,
                                                 int S, int KS, int off, int H, int KV, int Dh, float scale_log2, float scale) {
  constexpr int G = DP / 32, NT = ATTN_ROWS * G, TILE = 2048 / DP, CH = 8, RW = 32 / G;
  __shared__ attn_f4 ks[2][TILE * DP / 4];
  __shared__ attn_f4 vs[2][TILE * DP / 4];
  const int tid = threadIdx.x, g = tid % G;
  const int b = blockIdx.x / H, h = blockIdx.x % H, kvh = h / (H / KV);
  const int q0 = (gridDim.y - 1 - blockIdx.y) * ATTN_ROWS;
  const int i = q0 + tid / G;
  const int warp_last = off + q0 + (tid / 32 + 1) * RW - 1;
  const long long qstride = (long long)H * Dh, kstride = (long long)KV * Dh;
  const long long qrow = ((long long)b * S + i) * qstride + (long long)h * Dh;
  const long long kbase = (long long)b * KS * kstride + (long long)kvh * Dh;
  const long long lrow = ((long long)b * H + h) * S + i;
  const int kend = attn_min(KS, off + attn_min(S, q0 + ATTN_ROWS)), ntiles = (kend + TILE - 1) / TILE;

  attn_issue_tile<DP, NT, TILE>(ks[0], k, kbase, kstride, 0, KS, Dh);
  attn_issue_tile<DP, NT, TILE>(vs[0], v, kbase, kstride, 0, KS, Dh);
  attn_cp_commit();

  float qr[32], dor[32], acc[32];
  attn_load_row<G>(qr, q, qrow, i < S, Dh, g, scale_log2);
  attn_load_row<G>(dor, dout, qrow, i < S, Dh, g, 1.0f);
  // acc holds out for a moment, for D_i.
  attn_load_row<G>(acc, out, qrow, i < S, Dh, g, 1.0f);
  float di = 0.0f;
#pragma unroll
  for (int d = 0; d < 32; d++) {
    di += dor[d] * acc[d];
    acc[d] = 0.0f;
  }
  di = attn_group_sum<G>(di);
  const float lse2 = i < S ? lse[lrow] * ATTN_LOG2E : 0.0f;
  if (i < S && g == 0) delta[lrow] = di;

  for (int t = 0; t < ntiles; t++) {
    const int k0 = t * TILE;
    if (t + 1 < ntiles) {
      attn_issue_tile<DP, NT, TILE>(ks[(t + 1) & 1], k, kbase, kstride, k0 + TILE, KS, Dh);
      attn_issue_tile<DP, NT, TILE>(vs[(t + 1) & 1], v, kbase, kstride, k0 + TILE, KS, Dh);
      attn_cp_commit();
      attn_cp_wait_prev();
    } else {
      attn_cp_wait_all();
    }
    __syncthreads();
    const attn_f4* kt = ks[t & 1];
    const attn_f4* vt = vs[t & 1];
    for (int c0 = 0; c0 < TILE && k0 + c0 < kend; c0 += CH) {
      if (k0 + c0 > warp_last) break;
      float s[CH], dp[CH];
#pragma unroll
      for (int c = 0; c < CH; c++) s[c] = dp[c] = 0.0f;
#pragma unroll
      for (int u = 0; u < 8; u++)
#pragma unroll
        for (int c = 0; c < CH; c++) {
          const int slot = (c0 + c) * (DP / 4) + g + G * u;
          s[c] = attn_dot4(s[c], qr + 4 * u, kt[slot]);
          dp[c] = attn_dot4(dp[c], dor + 4 * u, vt[slot]);
        }
#pragma unroll
      for (int c = 0; c < CH; c++) {
        // Every lane shuffles (shfl.sync with a full mask), masked or not.
        const float sc = attn_group_sum<G>(s[c]), dpc = attn_group_sum<G>(dp[c]);
        const float p = k0 + c0 + c > off + i || k0 + c0 + c >= KS ? 0.0f : exp2f(sc - lse2);
        s[c] = p * (dpc - di);  // now ds
      }
      attn_reread();
#pragma unroll
      for (int c = 0; c < CH; c++)
#pragma unroll
        for (int u = 0; u < 8; u++) attn_axpy4(acc + 4 * u, s[c], kt[(c0 + c) * (DP / 4) + g + G * u]);
    }
    __syncthreads();
  }
  if (i < S) attn_store_row<G>(dq, qrow, acc, Dh, g, scale);
}

// attn_backward_dkdv: grid (B*KV, ceil(KS/64)), 64*G threads. Writes dk
// and dv for keys j0..j0+63 of kv head kvh; the longest rows (small j0) go
// first. Its tiles run over the group's query heads and, for each, the
// query positions from i1 = max(0, j0-off) on, the first that sees key j0;
// with none (i1 >= S) it writes zeros.
template <int DP>
__device__ __forceinline__ void attn_backward_dkdv(float* dk, float* dv, const float* dout, const float* q, const float* k,
                                                   const float* v, const float* lse, const float* delta,
                                                   int S, int KS, int off, int H, int KV, int Dh, float scale_log2, float scale) {
  constexpr int G = DP / 32, NT = ATTN_ROWS * G, TILE = 2048 / DP, CH = 8, RW = 32 / G;
  __shared__ attn_f4 qs[2][TILE * DP / 4];
  __shared__ attn_f4 dos[2][TILE * DP / 4];
  __shared__ float lse_s[2][TILE];
  __shared__ float del_s[2][TILE];
  const int tid = threadIdx.x, g = tid % G;
  const int b = blockIdx.x / KV, kvh = blockIdx.x % KV, group = H / KV;
  const int j0 = blockIdx.y * ATTN_ROWS;
  const int j = j0 + tid / G;
  const int warp_first = j0 + (tid / 32) * RW;
  const long long qstride = (long long)H * Dh, kstride = (long long)KV * Dh;
  const long long krow = ((long long)b * KS + j) * kstride + (long long)kvh * Dh;
  const int i1 = j0 > off ? j0 - off : 0;
  const int per_head = i1 < S ? (S - i1 + TILE - 1) / TILE : 0, ntiles = group * per_head;

  // issue starts loading tile t (head kvh*group + t/per_head) into stage.
  auto issue = [&](int t, int stage) {
    const int h = kvh * group + t / per_head, i0 = i1 + (t % per_head) * TILE;
    const long long qbase = (long long)b * S * qstride + (long long)h * Dh;
    const long long lbase = ((long long)b * H + h) * S;
    attn_issue_tile<DP, NT, TILE>(qs[stage], q, qbase, qstride, i0, S, Dh);
    attn_issue_tile<DP, NT, TILE>(dos[stage], dout, qbase, qstride, i0, S, Dh);
    for (int x = tid; x < TILE; x += NT) {
      const bool valid = i0 + x < S;
      attn_cp_async4(&lse_s[stage][x], valid ? lse + lbase + i0 + x : lse, valid);
      attn_cp_async4(&del_s[stage][x], valid ? delta + lbase + i0 + x : delta, valid);
    }
    attn_cp_commit();
  };
  if (ntiles > 0) issue(0, 0);

  float kr[32], vr[32], dka[32], dva[32];
  attn_load_row<G>(kr, k, krow, j < KS, Dh, g, scale_log2);
  attn_load_row<G>(vr, v, krow, j < KS, Dh, g, 1.0f);
#pragma unroll
  for (int d = 0; d < 32; d++) dka[d] = dva[d] = 0.0f;

  for (int t = 0; t < ntiles; t++) {
    const int i0 = i1 + (t % per_head) * TILE;
    if (t + 1 < ntiles) {
      issue(t + 1, (t + 1) & 1);
      attn_cp_wait_prev();
    } else {
      attn_cp_wait_all();
    }
    __syncthreads();
    const attn_f4* qt = qs[t & 1];
    const attn_f4* dot = dos[t & 1];
    const float* lt = lse_s[t & 1];
    const float* dt = del_s[t & 1];
    for (int c0 = 0; c0 < TILE && i0 + c0 < S; c0 += CH) {
      // Warp-uniform: queries before every key of this warp are masked.
      if (off + i0 + c0 + CH - 1 < warp_first) continue;
      float s[CH], dp[CH];
#pragma unroll
      for (int c = 0; c < CH; c++) s[c] = dp[c] = 0.0f;
#pragma unroll
      for (int u = 0; u < 8; u++)
#pragma unroll
        for (int c = 0; c < CH; c++) {
          const int slot = (c0 + c) * (DP / 4) + g + G * u;
          s[c] = attn_dot4(s[c], kr + 4 * u, qt[slot]);
          dp[c] = attn_dot4(dp[c], vr + 4 * u, dot[slot]);
        }
#pragma unroll
      for (int c = 0; c < CH; c++) {
        const int ii = i0 + c0 + c;
        const float sc = attn_group_sum<G>(s[c]), dpc = attn_group_sum<G>(dp[c]);
        const float p = off + ii < j || ii >= S ? 0.0f : exp2f(sc - lt[c0 + c] * ATTN_LOG2E);
        dp[c] = p * (dpc - dt[c0 + c]);  // now ds
        s[c] = p;
      }
      attn_reread();
#pragma unroll
      for (int c = 0; c < CH; c++)
#pragma unroll
        for (int u = 0; u < 8; u++) {
          const int slot = (c0 + c) * (DP / 4) + g + G * u;
          attn_axpy4(dva + 4 * u, s[c], dot[slot]);
          attn_axpy4(dka + 4 * u, dp[c], qt[slot]);
        }
    }
    __syncthreads();
  }
  if (j < KS) {
    attn_store_row<G>(dk, krow, dka, Dh, g, scale);
    attn_store_row<G>(dv, krow, dva, Dh, g, 1.0f);
  }
}

// The entry points, one per padded head dim DP: 64*DP/32 threads per block.

extern "C" __global__ void __launch_bounds__(64) attn_forward_d32_f32(float* out, float* lse, const float* q, const float* k, const float* v, int S, int KS, int off, int H, int KV, int Dh, float scale_log2) {
  attn_forward<32>(out, lse, q, k, v, S, KS, off, H, KV, Dh, scale_log2);
}
extern "C" __global__ void __launch_bounds__(128) attn_forward_d64_f32(float* out, float* lse, const float* q, const float* k, const float* v, int S, int KS, int off, int H, int KV, int Dh, float scale_log2) {
  attn_forward<64>(out, lse, q, k, v, S, KS, off, H, KV, Dh, scale_log2);
}
extern "C" __global__ void __launch_bounds__(256) attn_forward_d128_f32(float* out, float* lse, const float* q, const float* k, const float* v, int S, int KS, int off, int H, int KV, int Dh, float scale_log2) {
  attn_forward<128>(out, lse, q, k, v, S, KS, off, H, KV, Dh, scale_log2);
}

extern "C" __global__ void __launch_bounds__(64) attn_backward_dq_d32_f32(float* dq, float* delta, const float* dout, const float* q, const float* k, const float* v, const float* out, const float* lse, int S, int KS, int off, int H, int KV, int Dh, float scale_log2, float scale) {
  attn_backward_dq<32>(dq, delta, dout, q, k, v, out, lse, S, KS, off, H, KV, Dh, scale_log2, scale);
}
extern "C" __global__ void __launch_bounds__(128) attn_backward_dq_d64_f32(float* dq, float* delta, const float* dout, const float* q, const float* k, const float* v, const float* out, const float* lse, int S, int KS, int off, int H, int KV, int Dh, float scale_log2, float scale) {
  attn_backward_dq<64>(dq, delta, dout, q, k, v, out, lse, S, KS, off, H, KV, Dh, scale_log2, scale);
}
extern "C" __global__ void __launch_bounds__(256) attn_backward_dq_d128_f32(float* dq, float* delta, const float* dout, const float* q, const float* k, const float* v, const float* out, const float* lse, int S, int KS, int off, int H, int KV, int Dh, float scale_log2, float scale) {
  attn_backward_dq<128>(dq, delta, dout, q, k, v, out, lse, S, KS, off, H, KV, Dh, scale_log2, scale);
}

extern "C" __global__ void __launch_bounds__(64) attn_backward_dkdv_d32_f32(float* dk, float* dv, const float* dout, const float* q, const float* k, const float* v, const float* lse, const float* delta, int S, int KS, int off, int H, int KV, int Dh, float scale_log2, float scale) {
  attn_backward_dkdv<32>(dk, dv, dout, q, k, v, lse, delta, S, KS, off, H, KV, Dh, scale_log2, scale);
}
extern "C" __global__ void __launch_bounds__(128) attn_backward_dkdv_d64_f32(float* dk, float* dv, const float* dout, const float* q, const float* k, const float* v, const float* lse, const float* delta, int S, int KS, int off, int H, int KV, int Dh, float scale_log2, float scale) {
  attn_backward_dkdv<64>(dk, dv, dout, q, k, v, lse, delta, S, KS, off, H, KV, Dh, scale_log2, scale);
}
extern "C" __global__ void __launch_bounds__(256) attn_backward_dkdv_d128_f32(float* dk, float* dv, const float* dout, const float* q, const float* k, const float* v, const float* lse, const float* delta, int S, int KS, int off, int H, int KV, int Dh, float scale_log2, float scale) {
  attn_backward_dkdv<128>(dk, dv, dout, q, k, v, lse, delta, S, KS, off, H, KV, Dh, scale_log2, scale);
}
