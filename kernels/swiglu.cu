// SwiGLU, elementwise over n = N*F elements: out = silu(a) * b. Any grid.

__device__ __forceinline__ float mk_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// swiglu_forward_f32: out[i] = a[i] * sigmoid(a[i]) * b[i].
extern "C" __global__ void swiglu_forward_f32(float* out, const float* a, const float* b, long long n) {
  for (long long i = mk_global_id(); i < n; i += mk_grid_stride()) {
    const float av = a[i];
    out[i] = av * mk_sigmoid(av) * b[i];
  }
}

// swiglu_backward_f32: da = g * b * s * (1 + a*(1-s)), db = g * a * s, with
// s = sigmoid(a).
extern "C" __global__ void swiglu_backward_f32(float* da, float* db, const float* dout, const float* a, const float* b, long long n) {
  for (long long i = mk_global_id(); i < n; i += mk_grid_stride()) {
    const float av = a[i], g = dout[i], s = mk_sigmoid(av);
    da[i] = g * b[i] * s * (1.0f + av * (1.0f - s));
    db[i] = g * av * s;
  }
}
