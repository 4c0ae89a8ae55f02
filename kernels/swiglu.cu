// SwiGLU, elementwise over n = N*F elements: out = silu(a) * b. Any grid.
// The _x4 kernels do the same four elements at a time with 16-byte loads
// and stores (every pointer 16-byte aligned; the launcher falls back to the
// scalar kernels otherwise), the last n%4 elements one at a time: the
// expert activations of a MoE layer are the largest elementwise tensors of
// a step, and scalar accesses leave the memory system half idle.

__device__ __forceinline__ float mk_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float sg_fwd(float a, float b) { return a * mk_sigmoid(a) * b; }

// sg_bwd writes da = g * b * s * (1 + a*(1-s)) and db = g * a * s, with
// s = sigmoid(a).
__device__ __forceinline__ void sg_bwd(float g, float a, float b, float* da, float* db) {
  const float s = mk_sigmoid(a);
  *da = g * b * s * (1.0f + a * (1.0f - s));
  *db = g * a * s;
}

struct alignas(16) sg_f4 {
  float x, y, z, w;
};

// swiglu_forward_f32: out[i] = a[i] * sigmoid(a[i]) * b[i].
extern "C" __global__ void swiglu_forward_f32(float* out, const float* a, const float* b, long long n) {
  for (long long i = mk_global_id(); i < n; i += mk_grid_stride()) out[i] = sg_fwd(a[i], b[i]);
}

// swiglu_backward_f32: the gradients of swiglu_forward_f32 (sg_bwd).
extern "C" __global__ void swiglu_backward_f32(float* da, float* db, const float* dout, const float* a, const float* b, long long n) {
  for (long long i = mk_global_id(); i < n; i += mk_grid_stride()) sg_bwd(dout[i], a[i], b[i], &da[i], &db[i]);
}

extern "C" __global__ void swiglu_forward_f32_x4(float* out, const float* a, const float* b, long long n) {
  const long long groups = n >> 2, stride = mk_grid_stride();
  const sg_f4 *a4 = (const sg_f4*)a, *b4 = (const sg_f4*)b;
  sg_f4* out4 = (sg_f4*)out;
  for (long long i = mk_global_id(); i < groups; i += stride) {
    const sg_f4 av = a4[i], bv = b4[i];
    out4[i] = sg_f4{sg_fwd(av.x, bv.x), sg_fwd(av.y, bv.y), sg_fwd(av.z, bv.z), sg_fwd(av.w, bv.w)};
  }
  for (long long i = 4 * groups + mk_global_id(); i < n; i += stride) out[i] = sg_fwd(a[i], b[i]);
}

extern "C" __global__ void swiglu_backward_f32_x4(float* da, float* db, const float* dout, const float* a, const float* b, long long n) {
  const long long groups = n >> 2, stride = mk_grid_stride();
  const sg_f4 *g4 = (const sg_f4*)dout, *a4 = (const sg_f4*)a, *b4 = (const sg_f4*)b;
  sg_f4 *da4 = (sg_f4*)da, *db4 = (sg_f4*)db;
  for (long long i = mk_global_id(); i < groups; i += stride) {
    const sg_f4 g = g4[i], av = a4[i], bv = b4[i];
    sg_f4 x, y;
    sg_bwd(g.x, av.x, bv.x, &x.x, &y.x);
    sg_bwd(g.y, av.y, bv.y, &x.y, &y.y);
    sg_bwd(g.z, av.z, bv.z, &x.z, &y.z);
    sg_bwd(g.w, av.w, bv.w, &x.w, &y.w);
    da4[i] = x;
    db4[i] = y;
  }
  for (long long i = 4 * groups + mk_global_id(); i < n; i += stride) sg_bwd(dout[i], a[i], b[i], &da[i], &db[i]);
}
