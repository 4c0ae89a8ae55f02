// Sorting a MoE router's choices by expert, on the device, for the dispatch.
//
// route_by_expert: idx holds n = T*K assignments (assignment a = t*K + k
// picked expert idx[a], in [0, E)). One block per expert e, 1024 threads:
//   1. the block counts the assignments to experts below e (its output
//      offset) and to e itself, and writes them: offsets[e] and counts[e]
//      (a float: exact below 2^24, which the host checks), the last
//      block offsets[E] = n too;
//   2. it walks the assignments in tiles of 1024 in order; each thread
//      flags whether its assignment is e's, a warp ballot and a scan of the
//      32 warp totals give each flagged assignment its rank, and it is
//      written at offset + earlier tiles' count + rank: send_slot = a,
//      send_tok = a / K, and (send_pos not null) send_pos[a] = that place.
// So rows come out grouped by expert and, within an expert, in assignment
// order (stable), as the host counting sort in moe/plan.go orders them, and
// the result is deterministic. Each block reads idx twice (n ints: 128 KiB
// for moe-small, from L2). The offsets are the grouped products' group
// offsets, read there on the device: the host need not learn the counts
// before it queues the experts' forward.

__device__ __forceinline__ unsigned int rt_ballot(bool p) {
  unsigned int r;
  asm volatile(
      "{\n\t.reg .pred q;\n\tsetp.ne.u32 q, %1, 0;\n\tvote.sync.ballot.b32 %0, q, 0xffffffff;\n\t}"
      : "=r"(r)
      : "r"((unsigned int)p));
  return r;
}

__device__ __forceinline__ int rt_popc(unsigned int v) {
  int r;
  asm("popc.b32 %0, %1;" : "=r"(r) : "r"(v));
  return r;
}

__device__ __forceinline__ unsigned int rt_lanemask_lt() {
  unsigned int r;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(r));
  return r;
}

// rt_block_count adds v over the block (1024 threads, 32 warps); every
// thread gets the sum. scratch holds 32 ints of shared memory.
__device__ __forceinline__ int rt_block_count(int v, int* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int m = 16; m > 0; m >>= 1) {
    int o;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=r"(o) : "r"(v), "r"(m));
    v += o;
  }
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  int s = 0;
  for (int w = 0; w < 32; w++) s += scratch[w];
  return s;
}

extern "C" __global__ void __launch_bounds__(1024) route_by_expert(float* counts, int* offsets, int* send_tok,
                                                                    int* send_slot, int* send_pos, const int* idx, int n,
                                                                    int K) {
  __shared__ int scratch[32];
  __shared__ int warp_base[33];
  const int e = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  int below = 0, mine = 0;
  for (int a = threadIdx.x; a < n; a += 1024) {
    const int x = idx[a];
    below += x < e;
    mine += x == e;
  }
  const int offset = rt_block_count(below, scratch);
  const int total = rt_block_count(mine, scratch);
  if (threadIdx.x == 0) {
    counts[e] = (float)total;
    offsets[e] = offset;
    if (e == gridDim.x - 1) offsets[e + 1] = offset + total;
  }

  int done = 0;  // assignments of e placed by earlier tiles
  for (int t0 = 0; t0 < n; t0 += 1024) {
    const int a = t0 + threadIdx.x;
    const bool hit = a < n && idx[a] == e;
    const unsigned int votes = rt_ballot(hit);
    __syncthreads();  // warp_base is free: the last tile has read it
    if (lane == 0) warp_base[warp] = rt_popc(votes);
    __syncthreads();
    if (threadIdx.x == 0) {
      int s = 0;
      for (int w = 0; w < 32; w++) {
        const int c = warp_base[w];
        warp_base[w] = s;
        s += c;
      }
      warp_base[32] = s;
    }
    __syncthreads();
    if (hit) {
      const int at = offset + done + warp_base[warp] + rt_popc(votes & rt_lanemask_lt());
      send_slot[at] = a;
      send_tok[at] = a / K;
      if (send_pos != 0) send_pos[a] = at;
    }
    done += warp_base[32];
  }
}
