// Lab copy of kernels/adamw.cu (kernels/dev/README.md): with no define it
// compiles to the production source's PTX. AW_EXPERIMENT bits, same
// kernels and arguments:
//   4  adamw_split two pairs per step of the loop: hi and lo 8 bytes, g,
//      m and v 16 bytes per access (exact; needs 16-byte aligned g, m, v
//      and 8-byte aligned hi and lo). It adds the gradient's squares in
//      another order than production's (four at a time), so the norm's
//      sum rounds differently.
// Measured and dropped (kernels/adamw.md): float32 arithmetic (bit 1) and
// hoisted float64 (bit 2): the kernels are not arithmetic-bound.
//
#ifndef AW_EXPERIMENT
#define AW_EXPERIMENT 0
#endif

#if AW_EXPERIMENT == 0

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
//
// sq, when not null, gets one float64 per block: the sum of the squares of
// the gradient the block read (as given, before gscale), added in a fixed
// order (blocks of exactly 256 threads), so a fixed grid gives the same
// bits every time. A norm that does not gate the update (the experts'
// update in the backward) so costs no second pass over the gradient.

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

// aw_squares writes this block's sum of its threads' acc to sq[blockIdx.x].
__device__ __forceinline__ void aw_squares(double acc, double* sq) {
  __shared__ double s[256];
  const double sum = mk_block_sum_256_f64(acc, s);
  if (threadIdx.x == 0) sq[blockIdx.x] = sum;
}

// Each kernel's loop is a template on whether it sums the squares, so the
// update alone runs the loop it ran before sq existed.
template <bool SQ>
__device__ __forceinline__ double aw_f32_loop(float* p, const float* g, float* m, float* v, long long n, double lr,
                                              double beta1, double beta2, double eps, double decay, double bc1,
                                              double bc2, double gscale) {
  double acc = 0.0;
  for (long long i = mk_global_id(); i < n; i += mk_grid_stride()) {
    const float gi = g[i];
    if (SQ) acc += (double)gi * (double)gi;
    aw_one(&p[i], gi, &m[i], &v[i], lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
  }
  return acc;
}

extern "C" __global__ void __launch_bounds__(256) adamw_f32(float* p, const float* g, float* m, float* v, long long n,
                                                            double lr, double beta1, double beta2, double eps,
                                                            double decay, double bc1, double bc2, double gscale,
                                                            double* sq) {
  if (sq == nullptr) {
    aw_f32_loop<false>(p, g, m, v, n, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
    return;
  }
  aw_squares(aw_f32_loop<true>(p, g, m, v, n, lr, beta1, beta2, eps, decay, bc1, bc2, gscale), sq);
}

struct alignas(16) aw_f4 {
  float x, y, z, w;
};

template <bool SQ>
__device__ __forceinline__ double aw_f32_x4_loop(float* p, const float* g, float* m, float* v, long long n, double lr,
                                                 double beta1, double beta2, double eps, double decay, double bc1,
                                                 double bc2, double gscale) {
  const long long groups = n >> 2, stride = mk_grid_stride();
  aw_f4 *p4 = (aw_f4*)p, *m4 = (aw_f4*)m, *v4 = (aw_f4*)v;
  const aw_f4* g4 = (const aw_f4*)g;
  double acc = 0.0;
  for (long long i = mk_global_id(); i < groups; i += stride) {
    aw_f4 pv = p4[i], mv = m4[i], vv = v4[i];
    const aw_f4 gv = g4[i];
    if (SQ) {
      acc += (double)gv.x * (double)gv.x;
      acc += (double)gv.y * (double)gv.y;
      acc += (double)gv.z * (double)gv.z;
      acc += (double)gv.w * (double)gv.w;
    }
    aw_one(&pv.x, gv.x, &mv.x, &vv.x, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
    aw_one(&pv.y, gv.y, &mv.y, &vv.y, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
    aw_one(&pv.z, gv.z, &mv.z, &vv.z, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
    aw_one(&pv.w, gv.w, &mv.w, &vv.w, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
    p4[i] = pv;
    m4[i] = mv;
    v4[i] = vv;
  }
  for (long long i = 4 * groups + mk_global_id(); i < n; i += stride) {
    const float gi = g[i];
    if (SQ) acc += (double)gi * (double)gi;
    aw_one(&p[i], gi, &m[i], &v[i], lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
  }
  return acc;
}

extern "C" __global__ void __launch_bounds__(256) adamw_f32_x4(float* p, const float* g, float* m, float* v, long long n,
                                                               double lr, double beta1, double beta2, double eps,
                                                               double decay, double bc1, double bc2, double gscale,
                                                               double* sq) {
  if (sq == nullptr) {
    aw_f32_x4_loop<false>(p, g, m, v, n, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
    return;
  }
  aw_squares(aw_f32_x4_loop<true>(p, g, m, v, n, lr, beta1, beta2, eps, decay, bc1, bc2, gscale), sq);
}

// adamw_split: AdamW on split float32 masters (backend/master_split.go).
// Weight i's master is its bf16 half hi[i] shifted up 16 bits plus its
// low 16 bits read as a signed number; the low halves are packed two to a
// 32-bit word of lo (weight 2j's in the low half of word j). Each pair is
// joined, updated as aw_one updates a float32 master, and split again: hi
// rounds half away from zero (0x8000 added to the bit pattern), which is
// what keeps lo the master's low bits; a NaN keeps a NaN in hi. One pair
// per step of the grid-stride loop: hi and lo as one word each, g, m and v
// as 8-byte pairs (every pointer 8-byte aligned, n even).

__device__ __forceinline__ float aws_join(unsigned h, unsigned l) {
  return __uint_as_float((h << 16) + (unsigned)(int)(short)(l & 0xffffu));
}

__device__ __forceinline__ void aws_split(float w, unsigned* h, unsigned* l) {
  const unsigned u = __float_as_uint(w);
  *l = u & 0xffffu;
  *h = ((u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) : u + 0x8000u) >> 16;
}

struct alignas(8) aws_f2 {
  float x, y;
};

template <bool SQ>
__device__ __forceinline__ double aw_split_loop(unsigned* hi, unsigned* lo, const float* g, float* m, float* v,
                                               long long pairs, double lr, double beta1, double beta2, double eps,
                                               double decay, double bc1, double bc2, double gscale) {
  const aws_f2* g2 = (const aws_f2*)g;
  aws_f2 *m2 = (aws_f2*)m, *v2 = (aws_f2*)v;
  double acc = 0.0;
  for (long long j = mk_global_id(); j < pairs; j += mk_grid_stride()) {
    const unsigned hw = hi[j], lw = lo[j];
    float w0 = aws_join(hw & 0xffffu, lw & 0xffffu), w1 = aws_join(hw >> 16, lw >> 16);
    const aws_f2 gv = g2[j];
    aws_f2 mv = m2[j], vv = v2[j];
    if (SQ) {
      acc += (double)gv.x * (double)gv.x;
      acc += (double)gv.y * (double)gv.y;
    }
    aw_one(&w0, gv.x, &mv.x, &vv.x, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
    aw_one(&w1, gv.y, &mv.y, &vv.y, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
    unsigned h0, l0, h1, l1;
    aws_split(w0, &h0, &l0);
    aws_split(w1, &h1, &l1);
    hi[j] = h0 | (h1 << 16);
    lo[j] = l0 | (l1 << 16);
    m2[j] = mv;
    v2[j] = vv;
  }
  return acc;
}

extern "C" __global__ void __launch_bounds__(256) adamw_split(unsigned* hi, unsigned* lo, const float* g, float* m,
                                                              float* v, long long pairs, double lr, double beta1,
                                                              double beta2, double eps, double decay, double bc1,
                                                              double bc2, double gscale, double* sq) {
  if (sq == nullptr) {
    aw_split_loop<false>(hi, lo, g, m, v, pairs, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
    return;
  }
  aw_squares(aw_split_loop<true>(hi, lo, g, m, v, pairs, lr, beta1, beta2, eps, decay, bc1, bc2, gscale), sq);
}

#else


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

// aw_squares writes this block's sum of its threads' acc to sq[blockIdx.x].
__device__ __forceinline__ void aw_squares(double acc, double* sq) {
  __shared__ double s[256];
  const double sum = mk_block_sum_256_f64(acc, s);
  if (threadIdx.x == 0) sq[blockIdx.x] = sum;
}

// aw_coef: the update's constants.
struct aw_coef {
  double lr, beta1, beta2, eps, decay, bc1, bc2, gscale;
};

__device__ __forceinline__ aw_coef aw_make(double lr, double beta1, double beta2, double eps, double decay,
                                           double bc1, double bc2, double gscale) {
  return aw_coef{lr, beta1, beta2, eps, decay, bc1, bc2, gscale};
}

__device__ __forceinline__ void aw_el(float* p, float g, float* m, float* v, const aw_coef& c) {
  aw_one(p, g, m, v, c.lr, c.beta1, c.beta2, c.eps, c.decay, c.bc1, c.bc2, c.gscale);
}

extern "C" __global__ void adamw_f32(float* p, const float* g, float* m, float* v, long long n,
                                     double lr, double beta1, double beta2, double eps,
                                     double decay, double bc1, double bc2, double gscale, double* sq) {
  const aw_coef c = aw_make(lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
  double acc = 0.0;
  for (long long i = mk_global_id(); i < n; i += mk_grid_stride()) {
    acc += (double)g[i] * (double)g[i];
    aw_el(&p[i], g[i], &m[i], &v[i], c);
  }
  if (sq != nullptr) aw_squares(acc, sq);
}

struct alignas(16) aw_f4 {
  float x, y, z, w;
};

extern "C" __global__ void adamw_f32_x4(float* p, const float* g, float* m, float* v, long long n,
                                        double lr, double beta1, double beta2, double eps,
                                        double decay, double bc1, double bc2, double gscale, double* sq) {
  const aw_coef c = aw_make(lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
  double acc = 0.0;
  const long long groups = n >> 2, stride = mk_grid_stride();
  aw_f4 *p4 = (aw_f4*)p, *m4 = (aw_f4*)m, *v4 = (aw_f4*)v;
  const aw_f4* g4 = (const aw_f4*)g;
  for (long long i = mk_global_id(); i < groups; i += stride) {
    aw_f4 pv = p4[i], mv = m4[i], vv = v4[i];
    const aw_f4 gv = g4[i];
    acc += (double)gv.x * (double)gv.x + (double)gv.y * (double)gv.y + (double)gv.z * (double)gv.z + (double)gv.w * (double)gv.w;
    aw_el(&pv.x, gv.x, &mv.x, &vv.x, c);
    aw_el(&pv.y, gv.y, &mv.y, &vv.y, c);
    aw_el(&pv.z, gv.z, &mv.z, &vv.z, c);
    aw_el(&pv.w, gv.w, &mv.w, &vv.w, c);
    p4[i] = pv;
    m4[i] = mv;
    v4[i] = vv;
  }
  for (long long i = 4 * groups + mk_global_id(); i < n; i += stride) {
    acc += (double)g[i] * (double)g[i];
    aw_el(&p[i], g[i], &m[i], &v[i], c);
  }
  if (sq != nullptr) aw_squares(acc, sq);
}

__device__ __forceinline__ float aws_join(unsigned h, unsigned l) {
  return __uint_as_float((h << 16) + (unsigned)(int)(short)(l & 0xffffu));
}

__device__ __forceinline__ void aws_split(float w, unsigned* h, unsigned* l) {
  const unsigned u = __float_as_uint(w);
  *l = u & 0xffffu;
  *h = ((u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) : u + 0x8000u) >> 16;
}

struct alignas(8) aws_f2 {
  float x, y;
};

// aws_pair updates the pair of masters in words hw and lw.
__device__ __forceinline__ void aws_pair(unsigned* hw, unsigned* lw, float gx, float gy, float* mx, float* my,
                                         float* vx, float* vy, const aw_coef& c) {
  float w0 = aws_join(*hw & 0xffffu, *lw & 0xffffu), w1 = aws_join(*hw >> 16, *lw >> 16);
  aw_el(&w0, gx, mx, vx, c);
  aw_el(&w1, gy, my, vy, c);
  unsigned h0, l0, h1, l1;
  aws_split(w0, &h0, &l0);
  aws_split(w1, &h1, &l1);
  *hw = h0 | (h1 << 16);
  *lw = l0 | (l1 << 16);
}

extern "C" __global__ void adamw_split(unsigned* hi, unsigned* lo, const float* g, float* m, float* v, long long pairs,
                                       double lr, double beta1, double beta2, double eps,
                                       double decay, double bc1, double bc2, double gscale, double* sq) {
  const aw_coef c = aw_make(lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
  double acc = 0.0;
  long long first = 0;
#if AW_EXPERIMENT & 4
  struct alignas(8) aws_u2 {
    unsigned x, y;
  };
  const long long quads = pairs >> 1;
  for (long long j = mk_global_id(); j < quads; j += mk_grid_stride()) {
    aws_u2 hw = ((const aws_u2*)hi)[j], lw = ((const aws_u2*)lo)[j];
    const aw_f4 gv = ((const aw_f4*)g)[j];
    aw_f4 mv = ((aw_f4*)m)[j], vv = ((aw_f4*)v)[j];
    acc += (double)gv.x * (double)gv.x + (double)gv.y * (double)gv.y + (double)gv.z * (double)gv.z + (double)gv.w * (double)gv.w;
    aws_pair(&hw.x, &lw.x, gv.x, gv.y, &mv.x, &mv.y, &vv.x, &vv.y, c);
    aws_pair(&hw.y, &lw.y, gv.z, gv.w, &mv.z, &mv.w, &vv.z, &vv.w, c);
    ((aws_u2*)hi)[j] = hw;
    ((aws_u2*)lo)[j] = lw;
    ((aw_f4*)m)[j] = mv;
    ((aw_f4*)v)[j] = vv;
  }
  first = 2 * quads;
#endif
  const aws_f2* g2 = (const aws_f2*)g;
  aws_f2 *m2 = (aws_f2*)m, *v2 = (aws_f2*)v;
  for (long long j = first + mk_global_id(); j < pairs; j += mk_grid_stride()) {
    unsigned hw = hi[j], lw = lo[j];
    const aws_f2 gv = g2[j];
    aws_f2 mv = m2[j], vv = v2[j];
    acc += (double)gv.x * (double)gv.x + (double)gv.y * (double)gv.y;
    aws_pair(&hw, &lw, gv.x, gv.y, &mv.x, &mv.y, &vv.x, &vv.y, c);
    hi[j] = hw;
    lo[j] = lw;
    m2[j] = mv;
    v2[j] = vv;
  }
  if (sq != nullptr) aw_squares(acc, sq);
}

#endif
