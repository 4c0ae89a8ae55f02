// RMSNorm over rows of D: out = x * rstd * w with rstd = 1/sqrt(mean(x^2) +
// eps), and its backward.

// rmsnorm_forward_rows: one block of 256 threads per row; writes out[t, :]
// (float32, or bf16 rounded once: the products' operand), rstd[t] and,
// when copy is not null, copy[t, :] = x[t, :] (the residual stream's copy
// that the block after the norm adds its output to), reading x once.
template <typename Out>
__device__ __forceinline__ void rmsnorm_forward_rows(Out* out, float* rstd, float* copy, const float* x, const float* w, int T, int D, float eps) {
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  if (t >= T) return;
  const float* xt = x + (long long)t * D;
  float ss = 0.0f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) ss += xt[d] * xt[d];
  ss = mk_block_sum(ss, scratch);
  const float r = 1.0f / sqrtf(ss / (float)D + eps);
  Out* ot = out + (long long)t * D;
  if (copy != 0) {
    float* ct = copy + (long long)t * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
      const float v = xt[d];
      mk_store(ot + d, w[d] * (v * r));
      ct[d] = v;
    }
  } else {
    for (int d = threadIdx.x; d < D; d += blockDim.x) mk_store(ot + d, w[d] * (xt[d] * r));
  }
  if (threadIdx.x == 0) rstd[t] = r;
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm_forward_f32(float* out, float* rstd, float* copy, const float* x, const float* w, int T, int D, float eps) {
  rmsnorm_forward_rows(out, rstd, copy, x, w, T, D, eps);
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm_forward_f32_bf16(mk_bf16* out, float* rstd, float* copy, const float* x, const float* w, int T, int D, float eps) {
  rmsnorm_forward_rows(out, rstd, copy, x, w, T, D, eps);
}

// rmsnorm_forward_warps: rmsnorm_forward_rows for rows of D <= 1024
// columns, D a multiple of 128 and every row 16-byte aligned: a warp per
// row, whose lanes hold its D/32 values in registers (16-byte loads, read
// once), a shuffle sum instead of the block's barriers; blocks of 8 warps,
// ceil(T/8) of them. The products' operand is written with 8-byte (bf16)
// or 16-byte stores.
#define RMS_WARP_MAXCH 8  // four-float columns a lane holds: D <= 8 * 128
struct alignas(16) rms_f4 {
  float x, y, z, w;
};
struct alignas(8) rms_u2 {
  unsigned lo, hi;
};
__device__ __forceinline__ rms_f4 rms_f4_of(float x, float y, float z, float w) { return rms_f4{x, y, z, w}; }
__device__ __forceinline__ void rms_store4(float* p, rms_f4 v) { *(rms_f4*)p = v; }
__device__ __forceinline__ void rms_store4(mk_bf16* p, rms_f4 v) {
  *(rms_u2*)p = rms_u2{(unsigned)mk_f32_to_bf16(v.x) | ((unsigned)mk_f32_to_bf16(v.y) << 16),
                       (unsigned)mk_f32_to_bf16(v.z) | ((unsigned)mk_f32_to_bf16(v.w) << 16)};
}

template <typename Out>
__device__ __forceinline__ void rmsnorm_forward_warps(Out* out, float* rstd, float* copy, const float* x, const float* w, int T, int D, float eps) {
  const int lane = threadIdx.x & 31, ch = D >> 7;
  const long long t = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= T) return;
  const rms_f4* x4 = (const rms_f4*)(x + t * D);
  rms_f4 v[RMS_WARP_MAXCH];
  float ss = 0.0f;
#pragma unroll
  for (int c = 0; c < RMS_WARP_MAXCH; c++) {
    if (c < ch) {
      v[c] = x4[lane + 32 * c];
      ss += v[c].x * v[c].x + v[c].y * v[c].y + v[c].z * v[c].z + v[c].w * v[c].w;
    }
  }
  ss = mk_warp_sum(ss);
  const float r = 1.0f / sqrtf(ss / (float)D + eps);
  const rms_f4* w4 = (const rms_f4*)w;
#pragma unroll
  for (int c = 0; c < RMS_WARP_MAXCH; c++) {
    if (c < ch) {
      const int i = lane + 32 * c;
      const rms_f4 wv = w4[i];
      rms_store4(out + t * D + 4 * i, rms_f4_of(wv.x * (v[c].x * r), wv.y * (v[c].y * r), wv.z * (v[c].z * r), wv.w * (v[c].w * r)));
      if (copy != 0) ((rms_f4*)(copy + t * D))[i] = v[c];
    }
  }
  if (lane == 0) rstd[t] = r;
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm_forward_warps_f32(float* out, float* rstd, float* copy, const float* x, const float* w, int T, int D, float eps) {
  rmsnorm_forward_warps(out, rstd, copy, x, w, T, D, eps);
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm_forward_warps_f32_bf16(mk_bf16* out, float* rstd, float* copy, const float* x, const float* w, int T, int D, float eps) {
  rmsnorm_forward_warps(out, rstd, copy, x, w, T, D, eps);
}

// rmsnorm_backward_dx_f32: one block of 256 threads per row;
// dx = beta*dx + r * (w*g - x * r^2 * mean(w*g*x)), dx not read when beta
// is 0 (beta 1: the residual stream's gradient, which the norm's input
// feeds besides the norm).
extern "C" __global__ void __launch_bounds__(256) rmsnorm_backward_dx_f32(float* dx, const float* dout, const float* x, const float* w, const float* rstd, int T, int D, float beta) {
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  if (t >= T) return;
  const long long off = (long long)t * D;
  float dot = 0.0f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) dot += w[d] * dout[off + d] * x[off + d];
  dot = mk_block_sum(dot, scratch);
  const float r = rstd[t];
  const float c = r * r * dot / (float)D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    const float g = r * (w[d] * dout[off + d] - x[off + d] * c);
    dx[off + d] = beta != 0.0f ? beta * dx[off + d] + g : g;
  }
}

// rmsnorm_backward_f32 is rmsnorm_backward_dx_f32 and
// rmsnorm_backward_dw_f32 in one pass over dout and x: a block takes
// rows_per_block rows one after another, each thread the columns
// threadIdx.x + k*blockDim.x (k < RMS_BWD_COLS, so D <= RMS_BWD_COLS *
// blockDim.x), and it writes dx of each row as the dx kernel does and its
// column sums of dout*x*rstd over its rows to partial[blockIdx.x, :], which
// rmsnorm_dw_reduce_f32 adds to dw in block order (the same bits on every
// run). The second read of a row (for dx, after the dot product's
// reduction) finds it in cache.
#define RMS_BWD_COLS 8
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_backward_f32(float* dx, float* partial, const float* dout, const float* x, const float* w, const float* rstd, int T, int D, int rows_per_block, float beta) {
  __shared__ float scratch[32];
  const long long t0 = (long long)blockIdx.x * rows_per_block;
  const long long t1 = t0 + rows_per_block < T ? t0 + rows_per_block : T;
  float acc[RMS_BWD_COLS];
#pragma unroll
  for (int k = 0; k < RMS_BWD_COLS; k++) acc[k] = 0.0f;
  for (long long t = t0; t < t1; t++) {
    const long long off = t * D;
    const float r = rstd[t];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < RMS_BWD_COLS; k++) {
      const int d = threadIdx.x + k * blockDim.x;
      if (d < D) {
        const float g = dout[off + d], xv = x[off + d];
        dot += w[d] * g * xv;
        acc[k] += g * xv * r;
      }
    }
    dot = mk_block_sum(dot, scratch);
    const float c = r * r * dot / (float)D;
#pragma unroll
    for (int k = 0; k < RMS_BWD_COLS; k++) {
      const int d = threadIdx.x + k * blockDim.x;
      if (d < D) {
        const float v = r * (w[d] * dout[off + d] - x[off + d] * c);
        dx[off + d] = beta != 0.0f ? beta * dx[off + d] + v : v;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < RMS_BWD_COLS; k++) {
    const int d = threadIdx.x + k * blockDim.x;
    if (d < D) partial[(long long)blockIdx.x * D + d] = acc[k];
  }
}

// rmsnorm_backward_warps_f32 is rmsnorm_backward_f32 for rows of D <=
// 1024 columns, D a multiple of 128 and every row 16-byte aligned: a warp
// per row (16-byte loads, a shuffle sum instead of the block's two
// barriers a row), each of a block's 8 warps taking ceil(rows_per_block/8)
// of its rows in turn; the warps' column sums are added in warp order in
// shared memory and written as the block's row of partial, the layout
// rmsnorm_dw_reduce_f32 reads (the same bits on every run). A lane holds
// its elements of the row's dout and x in registers from the dot
// product's pass to dx's, as the forward's warp-per-row kernel holds x, so
// the row is read once (kernels/rmsnorm.md); with beta != 0 it loads dx's
// old values in that pass too, so all of the row's loads are in flight
// together. It writes dx after loading those elements, so dx may be x.
extern "C" __global__ void __launch_bounds__(256) rmsnorm_backward_warps_f32(float* dx, float* partial, const float* dout, const float* x, const float* w, const float* rstd, int T, int D, int rows_per_block, float beta) {
  __shared__ __attribute__((aligned(16))) float sums[8 * 1024];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, ch = D >> 7;
  const long long b0 = (long long)blockIdx.x * rows_per_block;
  const long long bend = b0 + rows_per_block < T ? b0 + rows_per_block : T;
  const int per = (rows_per_block + 7) >> 3;
  const long long t0 = b0 + (long long)warp * per;
  const long long t1 = t0 + per < bend ? t0 + per : bend;
  const rms_f4* w4 = (const rms_f4*)w;
  rms_f4 acc[RMS_WARP_MAXCH];
#pragma unroll
  for (int c = 0; c < RMS_WARP_MAXCH; c++) acc[c] = rms_f4_of(0.0f, 0.0f, 0.0f, 0.0f);
  for (long long t = t0; t < t1; t++) {
    const rms_f4* g4 = (const rms_f4*)(dout + t * D);
    const rms_f4* x4 = (const rms_f4*)(x + t * D);
    rms_f4* d4 = (rms_f4*)(dx + t * D);
    const float r = rstd[t];
    rms_f4 gs[RMS_WARP_MAXCH], xs[RMS_WARP_MAXCH], os[RMS_WARP_MAXCH];
    float dot = 0.0f;
#pragma unroll
    for (int c = 0; c < RMS_WARP_MAXCH; c++) {
      if (c < ch) {
        const int i = lane + 32 * c;
        gs[c] = g4[i];
        xs[c] = x4[i];
        if (beta != 0.0f) os[c] = d4[i];
      }
    }
#pragma unroll
    for (int c = 0; c < RMS_WARP_MAXCH; c++) {
      if (c < ch) {
        const int i = lane + 32 * c;
        const rms_f4 g = gs[c], xv = xs[c], wv = w4[i];
        dot += wv.x * g.x * xv.x + wv.y * g.y * xv.y + wv.z * g.z * xv.z + wv.w * g.w * xv.w;
        acc[c].x += g.x * xv.x * r;
        acc[c].y += g.y * xv.y * r;
        acc[c].z += g.z * xv.z * r;
        acc[c].w += g.w * xv.w * r;
      }
    }
    dot = mk_warp_sum(dot);
    const float cr = r * r * dot / (float)D;
#pragma unroll
    for (int c = 0; c < RMS_WARP_MAXCH; c++) {
      if (c < ch) {
        const int i = lane + 32 * c;
        const rms_f4 g = gs[c], xv = xs[c], wv = w4[i];
        rms_f4 v = rms_f4_of(r * (wv.x * g.x - xv.x * cr), r * (wv.y * g.y - xv.y * cr), r * (wv.z * g.z - xv.z * cr),
                             r * (wv.w * g.w - xv.w * cr));
        if (beta != 0.0f) {
          const rms_f4 o = os[c];
          v = rms_f4_of(beta * o.x + v.x, beta * o.y + v.y, beta * o.z + v.z, beta * o.w + v.w);
        }
        d4[i] = v;
      }
    }
  }
#pragma unroll
  for (int c = 0; c < RMS_WARP_MAXCH; c++) {
    if (c < ch) ((rms_f4*)(sums + warp * D))[lane + 32 * c] = acc[c];
  }
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; k++) s += sums[k * D + d];
    partial[(long long)blockIdx.x * D + d] = s;
  }
}

// rmsnorm_backward_dw_f32: partial[y, d] = sum over the rows t of block
// row y of dout[t,d] * x[t,d] * rstd[t]. Blocks of 32x8 threads; grid
// (ceil(D/32), ceil(T/rows_per_block)). Each block sums rows_per_block rows
// of 32 columns; rmsnorm_dw_reduce_f32 then adds the partial sums to dw in
// block-row order, so dw gets the same bits on every run (no atomics).
extern "C" __global__ void __launch_bounds__(256) rmsnorm_backward_dw_f32(float* partial, const float* dout, const float* x, const float* rstd, int T, int D, int rows_per_block) {
  __shared__ float s[8][33];
  const int d = blockIdx.x * 32 + threadIdx.x;
  const int t0 = blockIdx.y * rows_per_block;
  const int t1 = t0 + rows_per_block < T ? t0 + rows_per_block : T;
  float acc = 0.0f;
  if (d < D) {
    for (int t = t0 + (int)threadIdx.y; t < t1; t += 8) {
      const long long i = (long long)t * D + d;
      acc += dout[i] * x[i] * rstd[t];
    }
  }
  s[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && d < D) {
    float sum = 0.0f;
    for (int k = 0; k < 8; k++) sum += s[k][threadIdx.x];
    partial[(long long)blockIdx.y * D + d] = sum;
  }
}

// rmsnorm_dw_reduce_f32: dw[d] += the sum over y < Y of partial[y, d], in
// increasing y. Grid-stride over D.
extern "C" __global__ void rmsnorm_dw_reduce_f32(float* dw, const float* partial, int Y, int D) {
  for (long long d = mk_global_id(); d < D; d += mk_grid_stride()) {
    float sum = 0.0f;
    for (int y = 0; y < Y; y++) sum += partial[(long long)y * D + d];
    dw[d] += sum;
  }
}
