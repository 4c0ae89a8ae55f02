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

// The most rotation pairs per head (head_dim <= 2*ROPE_MAX_HALF).
#define ROPE_MAX_HALF 512

// rope_rows: one block per row t < rows (any multiple of 32 threads, at
// most 256). x and out are [rows, width], width a multiple of head_dim;
// pos is [rows]. The block first builds the row's cos/sin table in shared
// memory, then turns every pair of every head with it. Each thread reads
// both values of its pair before writing either, so out may be x.
template <typename Out>
__device__ __forceinline__ void rope_rows(Out* out, const float* x, const int* pos, int rows, int width, int head_dim, double theta, int inverse) {
  __shared__ float cs[ROPE_MAX_HALF];
  __shared__ float sn[ROPE_MAX_HALF];
  const int t = blockIdx.x;
  if (t >= rows) return;
  const int half = head_dim / 2;
  const double p = (double)pos[t];
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    double s, c;
    sincos(p * pow(theta, -2.0 * (double)i / (double)head_dim), &s, &c);
    cs[i] = (float)c;
    sn[i] = inverse ? -(float)s : (float)s;
  }
  __syncthreads();
  const float* row = x + (long long)t * width;
  Out* out_row = out + (long long)t * width;
  for (int e = threadIdx.x; e < width / 2; e += blockDim.x) {
    const int i = e % half;
    const int at = (e / half) * head_dim + i;
    const float u = row[at], w = row[at + half];
    mk_store(out_row + at, u * cs[i] - w * sn[i]);
    mk_store(out_row + at + half, w * cs[i] + u * sn[i]);
  }
}

// rope_f32: float32 out (x itself for the in-place rotation).
extern "C" __global__ void __launch_bounds__(256) rope_f32(float* out, const float* x, const int* pos, int rows, int width, int head_dim, double theta, int inverse) {
  rope_rows(out, x, pos, rows, width, head_dim, theta, inverse);
}

// rope_f32_bf16: bf16 out, each value rounded once from the float32
// rotation.
extern "C" __global__ void __launch_bounds__(256) rope_f32_bf16(mk_bf16* out, const float* x, const int* pos, int rows, int width, int head_dim, double theta, int inverse) {
  rope_rows(out, x, pos, rows, width, head_dim, theta, inverse);
}
