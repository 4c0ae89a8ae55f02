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

// The bf16 variants: a and b both float or both bf16, out (or da and db)
// float or bf16, rounded to nearest even when bf16; dout is always float.
// Arithmetic is float32 whatever the storage. One entry point per
// combination, named swiglu_{forward,backward}_<inputs>_<outputs>; vec != 0
// processes four elements per access (8-byte bf16 and 16-byte float
// loads and stores; the launcher sets it only when every pointer is
// aligned to its four elements), then the last n%4 one at a time.

struct alignas(8) sg_h4 {
  mk_bf16 x, y, z, w;
};

__device__ __forceinline__ float sg_ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float sg_ld(const mk_bf16* p, long long i) { return mk_bf16_to_f32(p[i]); }
__device__ __forceinline__ void sg_st(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void sg_st(mk_bf16* p, long long i, float v) { p[i] = mk_f32_to_bf16(v); }

// sg_ld4 and sg_st4 move group g (elements 4g..4g+3).
__device__ __forceinline__ void sg_ld4(const float* p, long long g, float v[4]) {
  const sg_f4 q = ((const sg_f4*)p)[g];
  v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
}
__device__ __forceinline__ void sg_ld4(const mk_bf16* p, long long g, float v[4]) {
  const sg_h4 q = ((const sg_h4*)p)[g];
  v[0] = mk_bf16_to_f32(q.x), v[1] = mk_bf16_to_f32(q.y), v[2] = mk_bf16_to_f32(q.z), v[3] = mk_bf16_to_f32(q.w);
}
__device__ __forceinline__ void sg_st4(float* p, long long g, const float v[4]) {
  ((sg_f4*)p)[g] = sg_f4{v[0], v[1], v[2], v[3]};
}
__device__ __forceinline__ void sg_st4(mk_bf16* p, long long g, const float v[4]) {
  ((sg_h4*)p)[g] = sg_h4{mk_f32_to_bf16(v[0]), mk_f32_to_bf16(v[1]), mk_f32_to_bf16(v[2]), mk_f32_to_bf16(v[3])};
}

template <typename TI, typename TO>
__device__ __forceinline__ void sg_forward(TO* out, const TI* a, const TI* b, long long n, int vec) {
  const long long stride = mk_grid_stride();
  long long tail = 0;
  if (vec) {
    const long long groups = n >> 2;
    for (long long g = mk_global_id(); g < groups; g += stride) {
      float av[4], bv[4], o[4];
      sg_ld4(a, g, av);
      sg_ld4(b, g, bv);
      for (int j = 0; j < 4; j++) o[j] = sg_fwd(av[j], bv[j]);
      sg_st4(out, g, o);
    }
    tail = 4 * groups;
  }
  for (long long i = tail + mk_global_id(); i < n; i += stride) sg_st(out, i, sg_fwd(sg_ld(a, i), sg_ld(b, i)));
}

template <typename TI, typename TG>
__device__ __forceinline__ void sg_backward(TG* da, TG* db, const float* dout, const TI* a, const TI* b, long long n, int vec) {
  const long long stride = mk_grid_stride();
  long long tail = 0;
  if (vec) {
    const long long groups = n >> 2;
    for (long long g = mk_global_id(); g < groups; g += stride) {
      float gv[4], av[4], bv[4], x[4], y[4];
      sg_ld4(dout, g, gv);
      sg_ld4(a, g, av);
      sg_ld4(b, g, bv);
      for (int j = 0; j < 4; j++) sg_bwd(gv[j], av[j], bv[j], &x[j], &y[j]);
      sg_st4(da, g, x);
      sg_st4(db, g, y);
    }
    tail = 4 * groups;
  }
  for (long long i = tail + mk_global_id(); i < n; i += stride) {
    float x, y;
    sg_bwd(dout[i], sg_ld(a, i), sg_ld(b, i), &x, &y);
    sg_st(da, i, x);
    sg_st(db, i, y);
  }
}

extern "C" __global__ void swiglu_forward_bf16_f32(float* out, const mk_bf16* a, const mk_bf16* b, long long n, int vec) {
  sg_forward(out, a, b, n, vec);
}
extern "C" __global__ void swiglu_forward_f32_bf16(mk_bf16* out, const float* a, const float* b, long long n, int vec) {
  sg_forward(out, a, b, n, vec);
}
extern "C" __global__ void swiglu_forward_bf16_bf16(mk_bf16* out, const mk_bf16* a, const mk_bf16* b, long long n, int vec) {
  sg_forward(out, a, b, n, vec);
}

extern "C" __global__ void swiglu_backward_bf16_f32(float* da, float* db, const float* dout, const mk_bf16* a, const mk_bf16* b, long long n, int vec) {
  sg_backward(da, db, dout, a, b, n, vec);
}
extern "C" __global__ void swiglu_backward_f32_bf16(mk_bf16* da, mk_bf16* db, const float* dout, const float* a, const float* b, long long n, int vec) {
  sg_backward(da, db, dout, a, b, n, vec);
}
extern "C" __global__ void swiglu_backward_bf16_bf16(mk_bf16* da, mk_bf16* db, const float* dout, const mk_bf16* a, const mk_bf16* b, long long n, int vec) {
  sg_backward(da, db, dout, a, b, n, vec);
}
