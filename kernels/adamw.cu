// AdamW with PyTorch's semantics (decoupled weight decay), over n elements:
//
//   p = p * decay                      decay = 1 - lr*wd
//   m = b1*m + (1-b1)*g,  v = b2*v + (1-b2)*g^2
//   p -= lr * (m/bc1) / (sqrt(v/bc2) + eps)      bc = 1 - beta^step
//
// computed in float64 from the float32 state, as the CPU backend does. Any
// grid.
extern "C" __global__ void adamw_f32(float* p, const float* g, float* m, float* v, long long n,
                                     double lr, double beta1, double beta2, double eps,
                                     double decay, double bc1, double bc2) {
  for (long long i = mk_global_id(); i < n; i += mk_grid_stride()) {
    const double gi = (double)g[i];
    const float mi = (float)(beta1 * (double)m[i] + (1.0 - beta1) * gi);
    const float vi = (float)(beta2 * (double)v[i] + (1.0 - beta2) * gi * gi);
    m[i] = mi;
    v[i] = vi;
    const double mhat = (double)mi / bc1, vhat = (double)vi / bc2;
    p[i] = (float)((double)p[i] * decay - lr * mhat / (sqrt(vhat) + eps));
  }
}
