// Cross-entropy over rows of V logits, fused with its gradient.

// cross_entropy_rows: one block of 256 threads per row t;
//   loss[t] = logsumexp(logits[t]) - logits[t][target[t]]
//   dlogits[t] = (softmax(logits[t]) - onehot(target[t])) * grad_scale
// dlogits (float32, or bf16 rounded once: the LM head's backward
// products read it so) may be null (loss only) or logits itself (in
// place: each element is read before the same thread overwrites it). A
// negative target gives loss 0 and a zero gradient row; a target >= V
// gives NaN.
template <typename Out>
__device__ __forceinline__ void cross_entropy_rows(float* loss, Out* dlogits, const float* logits, const int* targets, int T, int V, float grad_scale) {
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  if (t >= T) return;
  const long long off = (long long)t * V;
  const float* row = logits + off;
  const int tgt = targets[t];
  if (tgt < 0) {
    if (dlogits != 0)
      for (int j = threadIdx.x; j < V; j += blockDim.x) mk_store(dlogits + off + j, 0.0f);
    if (threadIdx.x == 0) loss[t] = 0.0f;
    return;
  }
  float mx = -MK_INF;
  for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = mk_block_max(mx, scratch);
  float se = 0.0f;
  for (int j = threadIdx.x; j < V; j += blockDim.x) se += expf(row[j] - mx);
  se = mk_block_sum(se, scratch);
  const float lse = mx + logf(se);
  // Read the target's logit before any thread overwrites the row.
  const float xt = tgt < V ? row[tgt] : MK_NAN;
  __syncthreads();
  if (threadIdx.x == 0) loss[t] = lse - xt;
  if (dlogits != 0) {
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
      float p = expf(row[j] - lse);
      if (j == tgt) p -= 1.0f;
      mk_store(dlogits + off + j, p * grad_scale);
    }
  }
}

extern "C" __global__ void __launch_bounds__(256) cross_entropy_f32(float* loss, float* dlogits, const float* logits, const int* targets, int T, int V, float grad_scale) {
  cross_entropy_rows(loss, dlogits, logits, targets, T, V, grad_scale);
}

extern "C" __global__ void __launch_bounds__(256) cross_entropy_f32_bf16(float* loss, mk_bf16* dlogits, const float* logits, const int* targets, int T, int V, float grad_scale) {
  cross_entropy_rows(loss, dlogits, logits, targets, T, V, grad_scale);
}

// cross_entropy_f32_reg is cross_entropy_f32 for rows that fit in
// registers: one block of 1024 threads per row, each thread holding up to
// CE_VEC float4s of it, so the row is read from memory once and written
// once (the loop kernel above reads it three times; a 32768-wide vocabulary
// row is 128 KiB, more than stays in cache across the passes). It needs V a
// multiple of 4, V <= 4096*CE_VEC, and logits and dlogits 16-byte aligned
// (the launcher checks; 8-byte aligned for a bf16 dlogits). Same results
// as cross_entropy_f32 up to the order of the float additions.
#define CE_VEC 8
struct alignas(16) ce_f4 {
  float x, y, z, w;
};
struct alignas(8) ce_h4 {
  mk_bf16 x, y, z, w;
};

// ce_store4 writes four gradients at group j of a row: float32, or bf16
// rounded.
__device__ __forceinline__ void ce_store4(float* row, int j, ce_f4 p) { ((ce_f4*)row)[j] = p; }
__device__ __forceinline__ void ce_store4(mk_bf16* row, int j, ce_f4 p) {
  ((ce_h4*)row)[j] = ce_h4{mk_f32_to_bf16(p.x), mk_f32_to_bf16(p.y), mk_f32_to_bf16(p.z), mk_f32_to_bf16(p.w)};
}

template <typename Out>
__device__ __forceinline__ void cross_entropy_rows_reg(float* loss, Out* dlogits, const float* logits, const int* targets, int T, int V, float grad_scale) {
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  if (t >= T) return;
  const long long off = (long long)t * V;
  const ce_f4* row = (const ce_f4*)(logits + off);
  const int tgt = targets[t], V4 = V >> 2;
  if (tgt < 0) {
    if (dlogits != 0)
      for (int j = threadIdx.x; j < V4; j += blockDim.x) ce_store4(dlogits + off, j, ce_f4{0.0f, 0.0f, 0.0f, 0.0f});
    if (threadIdx.x == 0) loss[t] = 0.0f;
    return;
  }
  // The target's logit is read before the block reductions, whose barriers
  // order it before any in-place write of the row.
  const float xt = threadIdx.x == 0 && tgt < V ? logits[off + tgt] : MK_NAN;
  ce_f4 v[CE_VEC];
  float mx = -MK_INF;
#pragma unroll
  for (int i = 0; i < CE_VEC; i++) {
    const int j = threadIdx.x + i * 1024;
    v[i] = j < V4 ? row[j] : ce_f4{-MK_INF, -MK_INF, -MK_INF, -MK_INF};
    mx = fmaxf(mx, fmaxf(fmaxf(v[i].x, v[i].y), fmaxf(v[i].z, v[i].w)));
  }
  mx = mk_block_max(mx, scratch);
  float se = 0.0f;
#pragma unroll
  for (int i = 0; i < CE_VEC; i++) se += expf(v[i].x - mx) + expf(v[i].y - mx) + expf(v[i].z - mx) + expf(v[i].w - mx);
  se = mk_block_sum(se, scratch);
  const float lse = mx + logf(se);
  if (threadIdx.x == 0) loss[t] = lse - xt;
  if (dlogits == 0) return;
  // Every thread has read its part of the row before the reductions'
  // barriers, so writing in place is safe.
  Out* out = dlogits + off;
#pragma unroll
  for (int i = 0; i < CE_VEC; i++) {
    const int j = threadIdx.x + i * 1024;
    if (j >= V4) break;
    const int c = 4 * j;
    ce_f4 p = ce_f4{expf(v[i].x - lse), expf(v[i].y - lse), expf(v[i].z - lse), expf(v[i].w - lse)};
    if (c == tgt) p.x -= 1.0f;
    if (c + 1 == tgt) p.y -= 1.0f;
    if (c + 2 == tgt) p.z -= 1.0f;
    if (c + 3 == tgt) p.w -= 1.0f;
    ce_store4(out, j, ce_f4{p.x * grad_scale, p.y * grad_scale, p.z * grad_scale, p.w * grad_scale});
  }
}

extern "C" __global__ void __launch_bounds__(1024) cross_entropy_f32_reg(float* loss, float* dlogits, const float* logits, const int* targets, int T, int V, float grad_scale) {
  cross_entropy_rows_reg(loss, dlogits, logits, targets, T, V, grad_scale);
}

extern "C" __global__ void __launch_bounds__(1024) cross_entropy_f32_bf16_reg(float* loss, mk_bf16* dlogits, const float* logits, const int* targets, int T, int V, float grad_scale) {
  cross_entropy_rows_reg(loss, dlogits, logits, targets, T, V, grad_scale);
}

// cross_entropy_shard_f32: one block of 256 threads per row t of logits
// [T, V] holding the vocabulary ids [lo, lo+V) (tensor parallelism's
// vocabulary-parallel LM head):
//   lse[t] = logsumexp(logits[t])
//   target_logit[t] = logits[t][targets[t]-lo] when the target lies in the
//                     slice, else 0 (and for a negative target)
// The LM head all-gathers lse and all-reduces target_logit before
// cross_entropy_shard_finish_f32.
extern "C" __global__ void __launch_bounds__(256) cross_entropy_shard_f32(float* lse, float* target_logit, const float* logits, const int* targets, int T, int V, int lo) {
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  if (t >= T) return;
  const float* row = logits + (long long)t * V;
  float mx = -MK_INF;
  for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = mk_block_max(mx, scratch);
  float se = 0.0f;
  for (int j = threadIdx.x; j < V; j += blockDim.x) se += expf(row[j] - mx);
  se = mk_block_sum(se, scratch);
  if (threadIdx.x == 0) {
    lse[t] = mx + logf(se);
    const int tgt = targets[t], j = tgt - lo;
    target_logit[t] = tgt >= 0 && j >= 0 && j < V ? row[j] : 0.0f;
  }
}

// cross_entropy_shard_finish_f32: one block of 256 threads per row t; lse_r
// [R, T] holds every slice's lse (all-gathered), target_logit the target's
// logit summed over the slices:
//   loss[t] = logsumexp_r(lse_r[r][t]) - target_logit[t]
//   dlogits[t] = (exp(logits[t] - that) - onehot(targets[t]-lo)) * grad_scale
// dlogits may be logits itself (each element read before the same thread
// writes it). A negative target gives loss 0 and a zero gradient row.
extern "C" __global__ void __launch_bounds__(256) cross_entropy_shard_finish_f32(float* loss, float* dlogits, const float* logits, const float* lse_r, const float* target_logit,
                                                                                  const int* targets, int T, int V, int R, int lo, float grad_scale) {
  const int t = blockIdx.x;
  if (t >= T) return;
  const long long off = (long long)t * V;
  const int tgt = targets[t];
  if (tgt < 0) {
    for (int j = threadIdx.x; j < V; j += blockDim.x) dlogits[off + j] = 0.0f;
    if (threadIdx.x == 0) loss[t] = 0.0f;
    return;
  }
  // R (the tensor-parallel ranks) is small: every thread joins the slices.
  float mx = -MK_INF;
  for (int q = 0; q < R; q++) mx = fmaxf(mx, lse_r[(long long)q * T + t]);
  float se = 0.0f;
  for (int q = 0; q < R; q++) se += expf(lse_r[(long long)q * T + t] - mx);
  const float lse = mx + logf(se);
  if (threadIdx.x == 0) loss[t] = lse - target_logit[t];
  const int jt = tgt - lo;
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    float p = expf(logits[off + j] - lse);
    if (j == jt) p -= 1.0f;
    dlogits[off + j] = p * grad_scale;
  }
}
