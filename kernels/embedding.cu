// Token embedding: a row gather forward, a scatter-add backward.

// embedding_forward_f32: out[t, :] = table[ids[t], :]. Grid: T blocks (any
// block size). An id outside [0, V) writes a row of NaNs, so the loss turns
// NaN instead of the kernel reading past the table.
extern "C" __global__ void embedding_forward_f32(float* out, const float* table, const int* ids, int T, int D, int V) {
  const int t = blockIdx.x;
  if (t >= T) return;
  const int id = ids[t];
  float* o = out + (long long)t * D;
  if (id < 0 || id >= V) {
    for (int d = threadIdx.x; d < D; d += blockDim.x) o[d] = MK_NAN;
    return;
  }
  const float* row = table + (long long)id * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) o[d] = row[d];
}

// embedding_backward_f32: dtable[ids[t], :] += dout[t, :]. Grid: T blocks.
// Repeated ids add through atomics, so the order of additions (and the last
// bits of the sum) can vary between runs. Ids outside [0, V) are skipped.
extern "C" __global__ void embedding_backward_f32(float* dtable, const float* dout, const int* ids, int T, int D, int V) {
  const int t = blockIdx.x;
  if (t >= T) return;
  const int id = ids[t];
  if (id < 0 || id >= V) return;
  const float* g = dout + (long long)t * D;
  float* row = dtable + (long long)id * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) atomicAdd(&row[d], g[d]);
}
