// Row gathers and scatters across the ranks of an expert group: the MoE
// dispatch and combine when a rank reads and writes its peers' tensors
// directly (backend.Backend's GatherPeerRows and ScatterPeerRows). Row r of
// the expert side refers to (rank s, send position p) = refs[2r], refs[2r+1].
//
// The ranks' tensors are separate allocations, so each kernel takes a small
// table of 64-bit words per rank, uploaded by backend/cuda/peer.go:
//   gather:  PR_GATHER_WORDS per rank: source rows' base address, token
//            list (int32), scale list (float32; 0 for none), the rank's
//            send count, its source's row count.
//   scatter: PR_SCATTER_WORDS per rank: out's base address, its row count.
// The counts let the kernels check references on the GPU, where the host
// cannot read them: a gather row whose reference (or token) is out of range
// is written as NaN, and a scatter row with a bad reference is skipped.
//
// One warp moves one row (grid-stride over rows): the reference and table
// loads are one broadcast per warp, and the lanes stream the row. vec != 0
// moves four elements per access; the launcher sets it only when D is a
// multiple of 4 and every base address is aligned for it (16 bytes for
// float32, 8 for bf16), so every row is.

#define PR_GATHER_WORDS 5
#define PR_SCATTER_WORDS 2

struct alignas(16) pr_f4 {
  float x, y, z, w;
};
struct alignas(8) pr_h4 {
  mk_bf16 x, y, z, w;
};

__device__ __forceinline__ void pr_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void pr_store(mk_bf16* p, float v) { *p = mk_f32_to_bf16(v); }
__device__ __forceinline__ void pr_store4(float* p, pr_f4 v) { *(pr_f4*)p = v; }
__device__ __forceinline__ void pr_store4(mk_bf16* p, pr_f4 v) {
  *(pr_h4*)p = pr_h4{mk_f32_to_bf16(v.x), mk_f32_to_bf16(v.y), mk_f32_to_bf16(v.z), mk_f32_to_bf16(v.w)};
}

__device__ __forceinline__ float pr_load(const float* p) { return *p; }
__device__ __forceinline__ float pr_load(const mk_bf16* p) { return mk_bf16_to_f32(*p); }
__device__ __forceinline__ pr_f4 pr_load4(const float* p) { return *(const pr_f4*)p; }
__device__ __forceinline__ pr_f4 pr_load4(const mk_bf16* p) {
  const pr_h4 h = *(const pr_h4*)p;
  return pr_f4{mk_bf16_to_f32(h.x), mk_bf16_to_f32(h.y), mk_bf16_to_f32(h.z), mk_bf16_to_f32(h.w)};
}

// pr_gather: out[r, :] = scale_s[p] * src_s[tok_s[p], :] for (s, p) =
// refs[r]; scale 1 where rank s has no scale list. Sources of type TS
// (float, or bf16 widened exactly).
template <typename TO, typename TS>
__device__ __forceinline__ void pr_gather(TO* out, const unsigned long long* ranks, const int* refs, int S, int R, int D, int vec) {
  const int lane = threadIdx.x & 31;
  const long long warps = mk_grid_stride() >> 5;
  for (long long r = mk_global_id() >> 5; r < R; r += warps) {
    TO* dst = out + r * D;
    const int s = refs[2 * r], p = refs[2 * r + 1];
    const TS* src = 0;
    float k = 1.0f;
    bool ok = false;
    if (s >= 0 && s < S) {
      const unsigned long long* e = ranks + (long long)PR_GATHER_WORDS * s;
      if (p >= 0 && (unsigned long long)p < e[3]) {
        const int t = ((const int*)e[1])[p];
        if (t >= 0 && (unsigned long long)t < e[4]) {
          src = (const TS*)e[0] + (long long)t * D;
          if (e[2] != 0) k = ((const float*)e[2])[p];
          ok = true;
        }
      }
    }
    if (!ok) {
      for (int j = lane; j < D; j += 32) pr_store(dst + j, MK_NAN);
      continue;
    }
    if (vec) {
      for (int j = lane; j < D / 4; j += 32) {
        const pr_f4 v = pr_load4(src + 4 * j);
        pr_store4(dst + 4 * j, pr_f4{k * v.x, k * v.y, k * v.z, k * v.w});
      }
      continue;
    }
    for (int j = lane; j < D; j += 32) pr_store(dst + j, k * pr_load(src + j));
  }
}

// gather_peer_rows_f32: pr_gather into a float32 out. Grid: grid-stride,
// one warp per row.
extern "C" __global__ void gather_peer_rows_f32(float* out, const unsigned long long* ranks, const int* refs, int S, int R, int D, int vec) {
  pr_gather<float, float>(out, ranks, refs, S, R, D, vec);
}

// gather_peer_rows_f32_bf16: pr_gather into a bf16 out, each value rounded
// to nearest even (mk_f32_to_bf16, as every bf16 write of the backend).
extern "C" __global__ void gather_peer_rows_f32_bf16(mk_bf16* out, const unsigned long long* ranks, const int* refs, int S, int R, int D, int vec) {
  pr_gather<mk_bf16, float>(out, ranks, refs, S, R, D, vec);
}

// gather_peer_rows_bf16: pr_gather from bf16 sources into a bf16 out (a
// row scaled by 1 is copied exactly).
extern "C" __global__ void gather_peer_rows_bf16(mk_bf16* out, const unsigned long long* ranks, const int* refs, int S, int R, int D, int vec) {
  pr_gather<mk_bf16, mk_bf16>(out, ranks, refs, S, R, D, vec);
}

// scatter_peer_rows_f32: out_s[p, :] = in[r, :] for (s, p) = refs[r]; and
// scatter_peer_rows_bf16 the same on bf16 rows (copied as they are: the
// MoE layer's bf16 expert outputs). The references must be distinct (two
// rows written to one place race). Grid: grid-stride, one warp per row.
template <typename T, typename V>
__device__ __forceinline__ void pr_scatter(const T* in, const unsigned long long* ranks, const int* refs, int S, int R, int D,
                                           int vec) {
  const int lane = threadIdx.x & 31;
  const long long warps = mk_grid_stride() >> 5;
  for (long long r = mk_global_id() >> 5; r < R; r += warps) {
    const int s = refs[2 * r], p = refs[2 * r + 1];
    if (s < 0 || s >= S) continue;
    const unsigned long long* e = ranks + (long long)PR_SCATTER_WORDS * s;
    if (p < 0 || (unsigned long long)p >= e[1]) continue;
    T* dst = (T*)e[0] + (long long)p * D;
    const T* src = in + r * D;
    if (vec) {
      const V* src4 = (const V*)src;
      V* dst4 = (V*)dst;
      for (int j = lane; j < D / 4; j += 32) {
        const V v = src4[j];
        dst4[j] = V{v.x, v.y, v.z, v.w}; // by field: one vector store, not two smaller copies
      }
      continue;
    }
    for (int j = lane; j < D; j += 32) dst[j] = src[j];
  }
}

extern "C" __global__ void scatter_peer_rows_f32(const float* in, const unsigned long long* ranks, const int* refs, int S, int R, int D, int vec) {
  pr_scatter<float, pr_f4>(in, ranks, refs, S, R, D, vec);
}

extern "C" __global__ void scatter_peer_rows_bf16(const mk_bf16* in, const unsigned long long* ranks, const int* refs, int S, int R, int D, int vec) {
  pr_scatter<mk_bf16, pr_h4>(in, ranks, refs, S, R, D, vec);
}

// peer_row_refs: refs[r] = (rank, pos + r - first) of the last block whose
// first row is at most r; blocks holds 3 words per block (first, rank,
// pos), in order of first, the first block at row 0 (checked by the host).
// One thread per row, grid-stride: a binary search over the table (at most
// a few hundred blocks, read through L1).
extern "C" __global__ void peer_row_refs(int* refs, const unsigned long long* blocks, int B, int R) {
  for (long long r = mk_global_id(); r < R; r += mk_grid_stride()) {
    int lo = 0, hi = B;
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if ((long long)blocks[3 * mid] <= r) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const unsigned long long* bl = blocks + 3 * lo;
    refs[2 * r] = (int)bl[1];
    refs[2 * r + 1] = (int)(bl[2] + (unsigned long long)(r - (long long)bl[0]));
  }
}

// mark_peer_rows: done_s[p] = 1 for (s, p) = refs[r]; the table holds two
// words per rank, the address of its int32 row flags and their count. It
// runs after the kernels that wrote the rows, in stream order; the release
// at system scope publishes them to a reader on another GPU as well.
// Grid-stride, one thread a row; references out of range are skipped.
extern "C" __global__ void mark_peer_rows(const int* refs, const unsigned long long* done, int S, int R) {
  for (long long r = mk_global_id(); r < R; r += mk_grid_stride()) {
    const int s = refs[2 * r], p = refs[2 * r + 1];
    if (s < 0 || s >= S || p < 0 || (unsigned long long)p >= done[2 * s + 1]) continue;
    int* flag = (int*)done[2 * s] + p;
    asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(flag), "r"(1) : "memory");
  }
}

// combine_rows_f32 is the source rank's combine of rows its peers write
// and flag: for send row i, once done[i] is 1 (acquired at system scope),
// out[rows[i], :] += scale[i] * in[i, :] (scale null: 1) and done[i] = 0.
// Grid: N blocks; thread 0 waits for the flag. The wait is bounded: past
// timeoutNs the first late row of the launch records fault = {5, i, the
// rank the row was sent to, the flag seen} (rankEnd: the running totals of
// the rows sent to each of the `ranks` ranks) and is skipped, and the
// launch's later waits give up at once, so the kernel ends and the host
// reports the record. Rows hit more than once add through atomics. With
// add 0 it only waits for the rows and clears their flags, for
// train.deterministic, whose adds follow in a fixed order
// (scatter_add_rows_ordered_f32).
extern "C" __global__ void combine_rows_f32(float* out, const unsigned long long* rankEnd, const float* in,
                                            const int* rows, const float* scale, int* done, int ranks, int* fault,
                                            unsigned long long timeoutNs, int N, int D, int add) {
  __shared__ int arrived;
  const int i = blockIdx.x;
  if (i >= N) return;
  if (threadIdx.x == 0) {
    int f;
    asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(f) : "l"(done + i) : "memory");
    if (f != 1) {
      unsigned long long t0;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
      for (;;) {
        asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(f) : "l"(done + i) : "memory");
        if (f == 1 || *(volatile const int*)fault != 0) break;
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 > timeoutNs) {
          int was;
          asm volatile("atom.relaxed.gpu.global.cas.b32 %0, [%1], 0, 5;" : "=r"(was) : "l"(fault) : "memory");
          if (was == 0) {
            int rank = -1;
            for (int r = 0; r < ranks; r++) {
              if ((unsigned long long)i < rankEnd[r]) {
                rank = r;
                break;
              }
            }
            fault[1] = i;
            fault[2] = rank;
            fault[3] = f;
            asm volatile("fence.acq_rel.gpu;" ::: "memory");
          }
          break;
        }
        asm volatile("nanosleep.u32 64;");
      }
    }
    arrived = f == 1;
    if (arrived) done[i] = 0;
  }
  __syncthreads();
  if (!arrived || !add) return;
  const float s = scale != 0 ? scale[i] : 1.0f;
  const float* src = in + (long long)i * D;
  float* dst = out + (long long)rows[i] * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) atomicAdd(&dst[d], s * src[d]);
}
