// The float32 -> bfloat16 conversion of convert.cu, four elements at a
// time: 16-byte loads and 8-byte stores, two groups in flight per thread.
// The rounding is the same function (mk_f32_to_bf16: nearest even, NaNs
// kept NaN with their payload's top bits), so the bits match f32_to_bf16's.

struct alignas(16) cv_f4 {
  float x, y, z, w;
};
struct alignas(8) cv_u2 {
  unsigned int x, y;
};

__device__ __forceinline__ cv_u2 cv_round4(cv_f4 v) {
  return cv_u2{(unsigned int)mk_f32_to_bf16(v.x) | ((unsigned int)mk_f32_to_bf16(v.y) << 16),
               (unsigned int)mk_f32_to_bf16(v.z) | ((unsigned int)mk_f32_to_bf16(v.w) << 16)};
}

// f32_to_bf16_x4: out[i] = bf16(x[i]) for i < n. x must be 16-byte and out
// 8-byte aligned (the launcher falls back to f32_to_bf16 otherwise); the
// last n%4 elements are converted one at a time.
extern "C" __global__ void f32_to_bf16_x4(mk_bf16* out, const float* x, long long n) {
  const long long groups = n >> 2, stride = mk_grid_stride();
  const cv_f4* x4 = (const cv_f4*)x;
  cv_u2* out4 = (cv_u2*)out;
  for (long long i = mk_global_id(); i < groups; i += 2 * stride) {
    const long long j = i + stride;
    const cv_f4 a = x4[i];
    cv_f4 b;
    if (j < groups) b = x4[j];
    out4[i] = cv_round4(a);
    if (j < groups) out4[j] = cv_round4(b);
  }
  for (long long i = 4 * groups + mk_global_id(); i < n; i += stride) out[i] = mk_f32_to_bf16(x[i]);
}
