// Conversions between float32 and bfloat16 (stored as 16-bit words). Any
// grid works.

// f32_to_bf16: out[i] = bf16(x[i]), rounding to nearest even.
extern "C" __global__ void f32_to_bf16(mk_bf16* out, const float* x, long long n) {
  for (long long i = mk_global_id(); i < n; i += mk_grid_stride()) out[i] = mk_f32_to_bf16(x[i]);
}

// bf16_to_f32: out[i] = float(x[i]), exact.
extern "C" __global__ void bf16_to_f32(float* out, const mk_bf16* x, long long n) {
  for (long long i = mk_global_id(); i < n; i += mk_grid_stride()) out[i] = mk_bf16_to_f32(x[i]);
}
