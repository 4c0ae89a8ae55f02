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
// update alone (sq null) adds nothing.
//
// aw_f32_loop updates elements [first, n), one a step of the grid-stride
// loop, and returns acc plus the squares of the gradient it read (SQ).
template <bool SQ>
__device__ __forceinline__ double aw_f32_loop(float* p, const float* g, float* m, float* v, long long first,
                                              long long n, double lr, double beta1, double beta2, double eps,
                                              double decay, double bc1, double bc2, double gscale, double acc) {
  for (long long i = first + mk_global_id(); i < n; i += mk_grid_stride()) {
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
    aw_f32_loop<false>(p, g, m, v, 0, n, lr, beta1, beta2, eps, decay, bc1, bc2, gscale, 0.0);
    return;
  }
  aw_squares(aw_f32_loop<true>(p, g, m, v, 0, n, lr, beta1, beta2, eps, decay, bc1, bc2, gscale, 0.0), sq);
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
  return aw_f32_loop<SQ>(p, g, m, v, 4 * groups, n, lr, beta1, beta2, eps, decay, bc1, bc2, gscale, acc);
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
// what keeps lo the master's low bits; a NaN keeps a NaN in hi. Two pairs
// per step of the grid-stride loop where g, m and v are 16-byte aligned
// and hi and lo 8-byte aligned (hi and lo as 8 bytes each, g, m and v as
// 16: 3.0% faster than one pair a step, 2.70 against 2.78 TB/s on an H100
// in kernels/dev's lab at 1647552, the same bits), then, and elsewhere,
// one pair a step (hi and lo as one word each, g, m and v as 8-byte pairs;
// every pointer 8-byte aligned, n even).

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

struct alignas(8) aws_u2 {
  unsigned x, y;
};

// aws_pair updates the pair of masters in words hw and lw from gradients
// gx and gy, with the moments at mx, my, vx and vy.
__device__ __forceinline__ void aws_pair(unsigned* hw, unsigned* lw, float gx, float gy, float* mx, float* my,
                                         float* vx, float* vy, double lr, double beta1, double beta2, double eps,
                                         double decay, double bc1, double bc2, double gscale) {
  float w0 = aws_join(*hw & 0xffffu, *lw & 0xffffu), w1 = aws_join(*hw >> 16, *lw >> 16);
  aw_one(&w0, gx, mx, vx, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
  aw_one(&w1, gy, my, vy, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
  unsigned h0, l0, h1, l1;
  aws_split(w0, &h0, &l0);
  aws_split(w1, &h1, &l1);
  *hw = h0 | (h1 << 16);
  *lw = l0 | (l1 << 16);
}

template <bool SQ>
__device__ __forceinline__ double aw_split_loop(unsigned* hi, unsigned* lo, const float* g, float* m, float* v,
                                               long long pairs, double lr, double beta1, double beta2, double eps,
                                               double decay, double bc1, double bc2, double gscale) {
  double acc = 0.0;
  long long first = 0;
  const bool wide = (((unsigned long long)g | (unsigned long long)m | (unsigned long long)v) & 15) == 0 &&
                    (((unsigned long long)hi | (unsigned long long)lo) & 7) == 0;
  if (wide) {
    const long long quads = pairs >> 1;
    for (long long j = mk_global_id(); j < quads; j += mk_grid_stride()) {
      aws_u2 hw = ((const aws_u2*)hi)[j], lw = ((const aws_u2*)lo)[j];
      const aw_f4 gv = ((const aw_f4*)g)[j];
      aw_f4 mv = ((aw_f4*)m)[j], vv = ((aw_f4*)v)[j];
      if (SQ) {
        acc += (double)gv.x * (double)gv.x;
        acc += (double)gv.y * (double)gv.y;
        acc += (double)gv.z * (double)gv.z;
        acc += (double)gv.w * (double)gv.w;
      }
      aws_pair(&hw.x, &lw.x, gv.x, gv.y, &mv.x, &mv.y, &vv.x, &vv.y, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
      aws_pair(&hw.y, &lw.y, gv.z, gv.w, &mv.z, &mv.w, &vv.z, &vv.w, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
      ((aws_u2*)hi)[j] = hw;
      ((aws_u2*)lo)[j] = lw;
      ((aw_f4*)m)[j] = mv;
      ((aw_f4*)v)[j] = vv;
    }
    first = 2 * quads;
  }
  const aws_f2* g2 = (const aws_f2*)g;
  aws_f2 *m2 = (aws_f2*)m, *v2 = (aws_f2*)v;
  for (long long j = first + mk_global_id(); j < pairs; j += mk_grid_stride()) {
    unsigned hw = hi[j], lw = lo[j];
    const aws_f2 gv = g2[j];
    aws_f2 mv = m2[j], vv = v2[j];
    if (SQ) {
      acc += (double)gv.x * (double)gv.x;
      acc += (double)gv.y * (double)gv.y;
    }
    aws_pair(&hw, &lw, gv.x, gv.y, &mv.x, &mv.y, &vv.x, &vv.y, lr, beta1, beta2, eps, decay, bc1, bc2, gscale);
    hi[j] = hw;
    lo[j] = lw;
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
