// AdamW with PyTorch's semantics (decoupled weight decay), over n elements:
//
//   g = g * gscale                     (gradient clipping, folded in)
//   p = p * decay                      decay = 1 - lr*wd
//   m = b1*m + (1-b1)*g,  v = b2*v + (1-b2)*g^2
//   p -= lr * (m/bc1) / (sqrt(v/bc2) + eps)      bc = 1 - beta^step
//
// computed in float64 from the float32 state, as the CPU backend does. Any
// grid. adamw_f32_x4 does four elements at a time with 16-byte accesses
// (every pointer 16-byte aligned; the launcher falls back otherwise): the
// optimizer reads and writes every parameter's four float32s of state, the
// largest memory pass of a step.

__device__ __forceinline__ void aw_one(float* p, float g, float* m, float* v, double lr, double beta1, double beta2,
                                       double eps, double decay, double bc1, double bc2, double gscale) {
  const double gi = (double)g * gscale;
  const float mi = (float)(beta1 * (double)*m + (1.0 - beta1) * gi);
  const float vi = (float)(beta2 * (double)*v + (1.0 - beta2) * gi * gi);
  *m = mi;
  *v = vi;
  const double mhat = (double)mi / bc1, vhat = (double)vi / bc2;
  *p = (float)((double)*p * decay - lr * mhat / (sqrt(vhat) + eps));
}

extern "C" __global__ void adamw_f32(float* p, const float* g, float* m, float* v, long long n,
                                     double lr, double beta1, double beta2, double eps,
                                     double decay, double bc1, double bc2, double gscale) {
  for (long long i = mk_global_id(); i < n; i += mk_grid_stride())
    aw_one(&p[i], g[i], &m[i], &v[i], lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
}

struct alignas(16) aw_f4 {
  float x, y, z, w;
};

extern "C" __global__ void adamw_f32_x4(float* p, const float* g, float* m, float* v, long long n,
                                        double lr, double beta1, double beta2, double eps,
                                        double decay, double bc1, double bc2, double gscale) {
  const long long groups = n >> 2, stride = mk_grid_stride();
  aw_f4 *p4 = (aw_f4*)p, *m4 = (aw_f4*)m, *v4 = (aw_f4*)v;
  const aw_f4* g4 = (const aw_f4*)g;
  for (long long i = mk_global_id(); i < groups; i += stride) {
    aw_f4 pv = p4[i], mv = m4[i], vv = v4[i];
    const aw_f4 gv = g4[i];
    aw_one(&pv.x, gv.x, &mv.x, &vv.x, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
    aw_one(&pv.y, gv.y, &mv.y, &vv.y, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
    aw_one(&pv.z, gv.z, &mv.z, &vv.z, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
    aw_one(&pv.w, gv.w, &mv.w, &vv.w, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
    p4[i] = pv;
    m4[i] = mv;
    v4[i] = vv;
  }
  for (long long i = 4 * groups + mk_global_id(); i < n; i += stride)
    aw_one(&p[i], g[i], &m[i], &v[i], lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
}
