// The merge of two partial attentions of the same query rows over two sets
// of keys (backend.Backend.AttentionMerge), the step a context-parallel
// ring takes after each chunk of keys it computes on:
//
//   lse' = log(exp(lse) + exp(plse))
//   out' = out*exp(lse-lse') + part*exp(plse-lse')
//
// in place in out and lse. A row whose lse is -inf saw no keys and weighs
// nothing; where both are -inf, out' is 0 and lse' stays -inf.
//
// Layout (backend.AttnShape): out and part [B*S, H*Dh], row t = b*S + i;
// lse and plse [B, H, S], natural log.

// attn_merge_f32: grid-stride over the rows*H (row, head) pairs, one warp
// per pair, its lanes over the head's Dh dims; blocks of 256 threads.
extern "C" __global__ void __launch_bounds__(256) attn_merge_f32(float* out, float* lse, const float* part, const float* plse,
                                                                 long long rows, int S, int H, int Dh) {
  const int lane = threadIdx.x % 32;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  for (long long p = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; p < rows * H; p += warps) {
    const long long t = p / H, b = t / S, i = t % S;
    const int h = (int)(p % H);
    const long long li = (b * H + h) * S + i;
    const float l = lse[li], lp = plse[li];
    // Every lane has read lse before lane 0 overwrites it below.
    asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
    float* o = out + t * H * Dh + (long long)h * Dh;
    const float* q = part + t * H * Dh + (long long)h * Dh;
    const float m = fmaxf(l, lp);
    if (m == -MK_INF) {
      for (int d = lane; d < Dh; d += 32) o[d] = 0.0f;
      continue;
    }
    const float wo = expf(l - m), wp = expf(lp - m), sum = wo + wp;
    const float a = wo / sum, c = wp / sum;
    for (int d = lane; d < Dh; d += 32) o[d] = a * o[d] + c * q[d];
    if (lane == 0) lse[li] = m + logf(sum);
  }
}
