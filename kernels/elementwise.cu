// Elementwise ops and reductions over float32 vectors of n elements. Any
// grid works (grid-stride loops); launch about 4 blocks per SM of 256
// threads for large n.

// fill_f32: x[i] = v.
extern "C" __global__ void fill_f32(float* x, float v, long long n) {
  for (long long i = mk_global_id(); i < n; i += mk_grid_stride()) x[i] = v;
}

// axpy_f32: dst[i] += alpha * x[i].
extern "C" __global__ void axpy_f32(float* dst, float alpha, const float* x, long long n) {
  for (long long i = mk_global_id(); i < n; i += mk_grid_stride()) dst[i] += alpha * x[i];
}

// scale_f32: x[i] *= alpha.
extern "C" __global__ void scale_f32(float* x, float alpha, long long n) {
  for (long long i = mk_global_id(); i < n; i += mk_grid_stride()) x[i] *= alpha;
}

// sum_partial_f32: partial[blockIdx.x] = the float64 sum of this block's
// share of x (of x[i]^2 when squares is set). The host adds the gridDim.x
// partials in order, so a fixed grid gives the same bits every time.
// Blocks of exactly 256 threads. Where x is 16-byte aligned the loop reads
// four floats at a time (the gradient norm reads every gradient once a
// step; 16-byte loads keep more bytes in flight per thread), then the
// tail one at a time.
struct alignas(16) ew_f4 {
  float x, y, z, w;
};

extern "C" __global__ void __launch_bounds__(256) sum_partial_f32(const float* x, long long n, int squares, double* partial) {
  __shared__ double s[256];
  double acc = 0.0;
  long long tail = 0;
  if (((unsigned long long)x & 15) == 0) {
    const ew_f4* x4 = (const ew_f4*)x;
    const long long groups = n >> 2;
    for (long long i = mk_global_id(); i < groups; i += mk_grid_stride()) {
      const ew_f4 v = x4[i];
      const double a = v.x, b = v.y, c = v.z, d = v.w;
      acc += squares ? (a * a + b * b) + (c * c + d * d) : (a + b) + (c + d);
    }
    tail = 4 * groups;
  }
  for (long long i = tail + mk_global_id(); i < n; i += mk_grid_stride()) {
    double v = (double)x[i];
    acc += squares ? v * v : v;
  }
  const double sum = mk_block_sum_256_f64(acc, s);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}
