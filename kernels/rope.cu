// Rotary position embedding, Hugging Face rotate-half convention, into out
// (x itself, or a float32 or bf16 tensor that does not overlap it).
// Within each head of head_dim dims, dim i < head_dim/2 pairs with dim
// i + head_dim/2, and the pair turns by the angle pos * theta^(-2i/head_dim):
//
//   out[i]        = x[i]*cos - x[i+half]*sin
//   out[i+half]   = x[i+half]*cos + x[i]*sin
//
// inverse turns by -angle, which is the backward (the rotation is
// orthogonal). The angles, and their sines and cosines, are computed in
// float64, as backend/cpu does: positions up to 1e5 and more keep float32
// accuracy.

#ifndef __CUDACC_RTC__
extern "C" __device__ double pow(double, double);
extern "C" __device__ void sincos(double, double*, double*);
#endif

// The angles' cosines and sines come from a table of (cos, sin) pairs per
// position and pair index, rope_table's, built once per theta and head dim
// for positions below P (backend/cuda/rope.go): computing them in float64
// in every call (a sincos and a pow per row and pair) took about 50 us a
// call at moe-small's shape in the profile at fdd8c22, several times what
// its bytes need. A position at or
// past P (or with no table) computes its pair in the kernel, with the same
// float64 code, so both give the same float32 values.

struct alignas(8) rp_cs {
  float c, s;
};

__device__ __forceinline__ rp_cs rope_angle(int p, int i, int head_dim, double theta) {
  double s, c;
  sincos((double)p * pow(theta, -2.0 * (double)i / (double)head_dim), &s, &c);
  return rp_cs{(float)c, (float)s};
}

// rope_table: tab[p*half + i] = (cos, sin) of p * theta^(-2i/head_dim),
// rounded to float32, for p < P and i < half = head_dim/2. Grid-stride.
extern "C" __global__ void rope_table(rp_cs* tab, int P, int head_dim, double theta) {
  const int half = head_dim / 2;
  const long long n = (long long)P * half;
  for (long long e = mk_global_id(); e < n; e += mk_grid_stride()) tab[e] = rope_angle((int)(e / half), (int)(e % half), head_dim, theta);
}

// rope_pairs: one thread per (row, pair), grid-stride; x and out are
// [rows, width], width a multiple of head_dim; pos is [rows]; tab the
// table of positions below P (null: none). Each thread reads both values
// of its pair before writing either, so out may be x. A warp's pairs are
// consecutive in a head, so its loads of x and of the table are whole
// lines.
template <typename Out>
__device__ __forceinline__ void rope_pairs(Out* out, const float* x, const int* pos, const rp_cs* tab, int P, int rows,
                                           int width, int head_dim, double theta, int inverse) {
  const int half = head_dim / 2, pairs = width / 2;
  const long long n = (long long)rows * pairs;
  for (long long e = mk_global_id(); e < n; e += mk_grid_stride()) {
    const int t = (int)(e / pairs), j = (int)(e % pairs);
    const int i = j % half, at = (j / half) * head_dim + i;
    const int p = pos[t];
    const rp_cs a = tab != 0 && p >= 0 && p < P ? tab[(long long)p * half + i] : rope_angle(p, i, head_dim, theta);
    const float c = a.c, sn = inverse ? -a.s : a.s;
    const float* row = x + (long long)t * width;
    Out* out_row = out + (long long)t * width;
    const float u = row[at], w = row[at + half];
    mk_store(out_row + at, u * c - w * sn);
    mk_store(out_row + at + half, w * c + u * sn);
  }
}

// rope_f32: float32 out (x itself for the in-place rotation).
extern "C" __global__ void __launch_bounds__(256) rope_f32(float* out, const float* x, const int* pos, const rp_cs* tab, int P, int rows, int width, int head_dim, double theta, int inverse) {
  rope_pairs(out, x, pos, tab, P, rows, width, head_dim, theta, inverse);
}

// rope_f32_bf16: bf16 out, each value rounded once from the float32
// rotation.
extern "C" __global__ void __launch_bounds__(256) rope_f32_bf16(mk_bf16* out, const float* x, const int* pos, const rp_cs* tab, int P, int rows, int width, int head_dim, double theta, int inverse) {
  rope_pairs(out, x, pos, tab, P, rows, width, head_dim, theta, inverse);
}
