// The MoE router: softmax over each token's E expert logits, top-k
// selection by probs + bias, Mixtral's gate renormalisation, and the
// backward with the load-balancing and z-loss gradients. The CPU twin is
// backend/cpu/router.go; both kernels follow it step by step.
//
// One warp per token row, 8 rows per block of 256 threads. Lane l holds
// experts l, l+32, l+64, ... in registers, so E is at most 32*MK_ROUTER_SLOTS
// = 256 and K at most MK_ROUTER_MAXK = 8 (checked on the host).

#define MK_ROUTER_SLOTS 8
#define MK_ROUTER_MAXK 8

__device__ __forceinline__ int mk_router_shfl_xor_i(int v, int lane_mask) {
  int r;
  asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=r"(r) : "r"(v), "r"(lane_mask));
  return r;
}

// mk_router_better says whether candidate (s, e) beats (bs, be): a higher
// score, or an equal score at a lower expert index; be < 0 means no
// candidate yet. NaN scores rank below every number (among themselves by
// index), so the order is total and every lane of the butterfly below agrees
// on the winner.
__device__ __forceinline__ bool mk_router_better(float s, int e, float bs, int be) {
  if (e < 0) return false;
  if (be < 0) return true;
  const bool snan = s != s, bnan = bs != bs;
  if (snan != bnan) return bnan;
  if (snan) return e < be;
  return s > bs || (s == bs && e < be);
}

// router_forward_f32: per row t of logits [T, E]
//   probs[t] = softmax(logits[t]),  lse[t] = logsumexp(logits[t])
//   idx[t]   = the K experts with the largest probs+bias (bias may be null),
//              best first, ties to the lower expert index
//   gates[t] = probs[t][idx[t]] / sum of those probs
// Grid: ceil(T/8) blocks of 256 threads.
extern "C" __global__ void __launch_bounds__(256) router_forward_f32(float* probs, float* lse, int* idx, float* gates,
                                                                     const float* logits, const float* bias, int T, int E, int K) {
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (t >= T) return;  // whole warps leave together: t is uniform in a warp
  const long long off = (long long)t * E;

  float p[MK_ROUTER_SLOTS];
  float m = -MK_INF;
#pragma unroll
  for (int j = 0; j < MK_ROUTER_SLOTS; j++) {
    const int e = lane + 32 * j;
    p[j] = e < E ? logits[off + e] : -MK_INF;
    m = fmaxf(m, p[j]);
  }
  m = mk_warp_max(m);
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < MK_ROUTER_SLOTS; j++) {
    const int e = lane + 32 * j;
    p[j] = e < E ? expf(p[j] - m) : 0.0f;
    s += p[j];
  }
  s = mk_warp_sum(s);
  const float inv = 1.0f / s;
  float score[MK_ROUTER_SLOTS];
#pragma unroll
  for (int j = 0; j < MK_ROUTER_SLOTS; j++) {
    const int e = lane + 32 * j;
    if (e < E) {
      p[j] = p[j] * inv;
      probs[off + e] = p[j];
      score[j] = bias != 0 ? p[j] + bias[e] : p[j];
    }
  }
  if (lane == 0) lse[t] = m + logf(s);

  // K rounds of a warp-wide argmax over the experts not yet taken. The k
  // loop is unrolled to its bound so sel and psel stay in registers.
  unsigned taken = 0;  // bit j: this lane's slot j is selected
  int sel[MK_ROUTER_MAXK];
  float psel[MK_ROUTER_MAXK];
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < MK_ROUTER_MAXK; k++) {
    if (k >= K) break;
    float bs = 0.0f, bp = 0.0f;
    int be = -1;
#pragma unroll
    for (int j = 0; j < MK_ROUTER_SLOTS; j++) {
      const int e = lane + 32 * j;
      if (e < E && !(taken & (1u << j)) && mk_router_better(score[j], e, bs, be)) {
        bs = score[j];
        bp = p[j];
        be = e;
      }
    }
    for (int w = 16; w > 0; w >>= 1) {
      const float os = mk_shfl_xor(bs, w), op = mk_shfl_xor(bp, w);
      const int oe = mk_router_shfl_xor_i(be, w);
      if (mk_router_better(os, oe, bs, be)) {
        bs = os;
        bp = op;
        be = oe;
      }
    }
    // Every lane now holds the same winner.
    if (be >= 0 && (be & 31) == lane) taken |= 1u << (be >> 5);
    sel[k] = be;
    psel[k] = bp;
    sum += bp;
  }
  // Lane k writes entry k.
#pragma unroll
  for (int k = 0; k < MK_ROUTER_MAXK; k++) {
    if (k < K && k == lane) {
      idx[(long long)t * K + k] = sel[k];
      gates[(long long)t * K + k] = psel[k] / sum;
    }
  }
}

// router_backward_f32: per row t, with S = the sum of the selected probs,
//   dprobs[e]  = aux[e] + [e selected] (dgates_e - sum_j dgates_j gates_j) / S
//   dlogits[e] = p_e (dprobs[e] - sum_f p_f dprobs[f]) + zscale * lse[t] * p_e
// aux may be null (0). Grid: ceil(T/8) blocks of 256 threads.
extern "C" __global__ void __launch_bounds__(256) router_backward_f32(float* dlogits, const float* dgates, const float* probs, const float* lse,
                                                                      const int* idx, const float* gates, const float* aux,
                                                                      int T, int E, int K, float zscale) {
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (t >= T) return;
  const long long off = (long long)t * E, koff = (long long)t * K;

  float sum = 0.0f, dgDotG = 0.0f;
  for (int k = 0; k < K; k++) {
    const int e = idx[koff + k];
    if (e >= 0 && e < E) sum += probs[off + e];
    dgDotG += dgates[koff + k] * gates[koff + k];
  }
  float p[MK_ROUTER_SLOTS], dp[MK_ROUTER_SLOTS];
  float pDotDp = 0.0f;
#pragma unroll
  for (int j = 0; j < MK_ROUTER_SLOTS; j++) {
    const int e = lane + 32 * j;
    p[j] = 0.0f;
    dp[j] = 0.0f;
    if (e < E) {
      p[j] = probs[off + e];
      dp[j] = aux != 0 ? aux[e] : 0.0f;
      for (int k = 0; k < K; k++)
        if (idx[koff + k] == e) dp[j] += (dgates[koff + k] - dgDotG) / sum;
      pDotDp += p[j] * dp[j];
    }
  }
  pDotDp = mk_warp_sum(pDotDp);
  const float z = zscale * lse[t];
#pragma unroll
  for (int j = 0; j < MK_ROUTER_SLOTS; j++) {
    const int e = lane + 32 * j;
    if (e < E) dlogits[off + e] = p[j] * (dp[j] - pDotDp) + z * p[j];
  }
}
