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

// rp_turn turns the pair (u, w) by (c, sn): lo = u*c - w*sn, hi = w*c +
// u*sn, each product and sum rounded on its own (mul.rn, add.rn, sub.rn:
// never fused into an FMA, which NVRTC would otherwise choose per kernel),
// as backend/cpu computes them: every kernel here and the CPU give the
// same bits.
__device__ __forceinline__ void rp_turn(float u, float w, float c, float sn, float& lo, float& hi) {
  float uc, ws, wc, us;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(uc) : "f"(u), "f"(c));
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(ws) : "f"(w), "f"(sn));
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(wc) : "f"(w), "f"(c));
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(us) : "f"(u), "f"(sn));
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(lo) : "f"(uc), "f"(ws));
  asm("add.rn.f32 %0, %1, %2;" : "=f"(hi) : "f"(wc), "f"(us));
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
    float lo, hi;
    rp_turn(row[at], row[at + half], c, sn, lo, hi);
    mk_store(out_row + at, lo);
    mk_store(out_row + at + half, hi);
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

// rope_quads is rope_pairs four pairs at a time, for head dims with
// half a multiple of 4: pairs i..i+3 of one head of one row, x read and
// out written 16 bytes at a time (8 for bf16), the table 32, and the
// index arithmetic in 32 bits (the host checks that rows * width / 8
// fits). rope_pairs spends two 64-bit divisions on each pair's 8 bytes;
// its profiled calls moved about 1.5 TB/s (moe-small at 44e5f8c). Each
// value is rope_pairs' rp_turn, so the same bits.
// x and out 16-byte aligned (bf16 out: 8).
struct alignas(16) rp_f4 {
  float x, y, z, w;
};
struct alignas(8) rp_u2 {
  unsigned x, y;
};

__device__ __forceinline__ void rp_store4(float* p, const float (&v)[4]) { *(rp_f4*)p = rp_f4{v[0], v[1], v[2], v[3]}; }
__device__ __forceinline__ void rp_store4(mk_bf16* p, const float (&v)[4]) {
  *(rp_u2*)p = rp_u2{(unsigned)mk_f32_to_bf16(v[0]) | ((unsigned)mk_f32_to_bf16(v[1]) << 16),
                     (unsigned)mk_f32_to_bf16(v[2]) | ((unsigned)mk_f32_to_bf16(v[3]) << 16)};
}

template <typename Out>
__device__ __forceinline__ void rope_quads(Out* out, const float* x, const int* pos, const rp_cs* tab, int P, int rows,
                                           int width, int head_dim, double theta, int inverse) {
  const unsigned half = head_dim / 2, per_row = width / 8, n = (unsigned)rows * per_row;
  for (unsigned e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
    const unsigned t = e / per_row, j = 4 * (e - t * per_row);
    const unsigned h = j / half, i = j - h * half, at = h * head_dim + i;
    const int p = pos[t];
    rp_cs a[4];
    if (tab != 0 && p >= 0 && p < P) {
      const rp_f4* cs = (const rp_f4*)(tab + (long long)p * half + i);
      const rp_f4 c01 = cs[0], c23 = cs[1];
      a[0] = rp_cs{c01.x, c01.y}, a[1] = rp_cs{c01.z, c01.w}, a[2] = rp_cs{c23.x, c23.y}, a[3] = rp_cs{c23.z, c23.w};
    } else {
#pragma unroll
      for (int k = 0; k < 4; k++) a[k] = rope_angle(p, (int)i + k, head_dim, theta);
    }
    const float* row = x + (long long)t * width;
    const rp_f4 u4 = *(const rp_f4*)(row + at), w4 = *(const rp_f4*)(row + at + half);
    const float u[4] = {u4.x, u4.y, u4.z, u4.w}, w[4] = {w4.x, w4.y, w4.z, w4.w};
    float lo[4], hi[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const float c = a[k].c, sn = inverse ? -a[k].s : a[k].s;
      rp_turn(u[k], w[k], c, sn, lo[k], hi[k]);
    }
    Out* out_row = out + (long long)t * width;
    rp_store4(out_row + at, lo);
    rp_store4(out_row + at + half, hi);
  }
}

extern "C" __global__ void __launch_bounds__(256) rope_f32_x4(float* out, const float* x, const int* pos, const rp_cs* tab, int P, int rows, int width, int head_dim, double theta, int inverse) {
  rope_quads(out, x, pos, tab, P, rows, width, head_dim, theta, inverse);
}

extern "C" __global__ void __launch_bounds__(256) rope_f32_bf16_x4(mk_bf16* out, const float* x, const int* pos, const rp_cs* tab, int P, int rows, int width, int head_dim, double theta, int inverse) {
  rope_quads(out, x, pos, tab, P, rows, width, head_dim, theta, inverse);
}
