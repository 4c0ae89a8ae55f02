// Cross-entropy over rows of V logits, fused with its gradient.

// cross_entropy_f32: one block of 256 threads per row t;
//   loss[t] = logsumexp(logits[t]) - logits[t][target[t]]
//   dlogits[t] = (softmax(logits[t]) - onehot(target[t])) * grad_scale
// dlogits may be null (loss only) or logits itself (in place: each element
// is read before the same thread overwrites it). A negative target gives
// loss 0 and a zero gradient row; a target >= V gives NaN.
extern "C" __global__ void __launch_bounds__(256) cross_entropy_f32(float* loss, float* dlogits, const float* logits, const int* targets, int T, int V, float grad_scale) {
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  if (t >= T) return;
  const long long off = (long long)t * V;
  const float* row = logits + off;
  const int tgt = targets[t];
  if (tgt < 0) {
    if (dlogits != 0)
      for (int j = threadIdx.x; j < V; j += blockDim.x) dlogits[off + j] = 0.0f;
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
      dlogits[off + j] = p * grad_scale;
    }
  }
}
