// Lab copy of kernels/grouped_gemm.cu (kernels/dev/README.md): built with
// no define it is that source, kernel for kernel. GG_CLUSTER=1 adds
// gemm_nt_c2_bn256_f32 (below, after the copy): the bn256 float32 NT
// product on clusters of two blocks that multicast the weight tile, the
// pipeline cuBLASLt's fastest kernel at tensor parallelism's shapes runs
// (kernels/grouped_gemm.md). backend/cuda's TestGemmClusterLab launches it.

#ifndef GG_CLUSTER
#define GG_CLUSTER 0
#endif

// The grouped products of the MoE experts on Hopper (sm_90a): the
// forward's NT product (out = A . W_e^T per expert, the pipeline of
// grouped_gemm.cuh) and the weight gradients' TN product (out[e] =
// A[rows of e]^T . B[rows of e], grouped_gemm_tn below). Launched by
// backend/cuda/grouped_gemm.go.

#include "grouped_gemm.cuh"

// ---- The NT product ----
//
// Three kernels, the ones training runs: cooperative with n tile 128 (6
// stages) or 256 (4 stages), float32 out, which backend/cuda picks per N
// (the one that pads N less); and bn256s, bf16 out: bn256 with
// setmaxnreg (producer 40 registers, consumers 232, which needs the
// (384, 1) launch bound to fix the entry count at 168), 3 stages and the
// TMA-store epilogue (it also takes mapO, the output's {N, rows} bf16
// tensor map with 64x64 boxes and the 128-byte swizzle).
// Launch: GG_THREADS threads, at most one block per SM (persistent; blocks
// past the tile count exit at once), dynamic shared memory
// 1024 + STAGES*(16384 + BN*128) + staging + 16*STAGES + 4*(3E+1)
// bytes (ggSmemBytes in backend/cuda/grouped_gemm.go).

extern "C" __global__ void __launch_bounds__(384) grouped_gemm_nt_bn128_f32(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, void* out, const int* off, int rows,
    int N, int K, int E, float alpha, float beta) {
  gg_body<128, 6, false, false, false>(&mapA, &mapW, nullptr, out, off, rows, N, K, E, alpha, beta);
}

extern "C" __global__ void __launch_bounds__(384) grouped_gemm_nt_bn256_f32(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, void* out, const int* off, int rows,
    int N, int K, int E, float alpha, float beta) {
  gg_body<256, 4, false, false, false>(&mapA, &mapW, nullptr, out, off, rows, N, K, E, alpha, beta);
}

extern "C" __global__ void __launch_bounds__(384, 1) grouped_gemm_nt_bn256s_bf16(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, const __grid_constant__ gg_tmap mapO,
    void* out, const int* off, int rows, int N, int K, int E, float alpha, float beta) {
  gg_body<256, 3, true, true, true>(&mapA, &mapW, &mapO, out, off, rows, N, K, E, alpha, beta);
}

// ---- The TN product: weight gradients ----
//
// grouped_gemm_tn: for every expert e with rows [off[e], off[e+1]) of A
// and B (clamped to [0, rows]),
//
//   out[e, :M, :N] = alpha * A[rows of e, :M]^T . B[rows of e, :N] + beta * out[e]
//
// A [rows, M] and B [rows, N] are bfloat16 row-major: the experts' output
// gradients and their inputs, expert-major as the forward left them; out
// [E, M, N] is float32 (the weight gradients, accumulated with beta 1).
// An expert's rows are the product's K, read from off on the device, so
// the host never learns the counts; an empty expert's block is scaled by
// beta (left as it is for beta 1, never read for beta 0).
//
// Tiles. Every expert has ceil(M/128) x ceil(N/256) output tiles whatever
// its rows, so the tile list (expert-major, m-tile fastest) is fixed by
// the shapes alone; the CTAs of the persistent grid stride over it. The
// tiles running together are mostly one expert's, which keeps its A and
// B rows in L2 while they are read once per n-tile and m-tile.
//
// Operands. The K of the product runs down the rows of A and B, so both
// arrive MN-major: TMA brings 64 rows (K) x 64 columns (M or N) per box
// with the 128-byte swizzle, two boxes of A (128 of M) and four of B (256
// of N) per stage, 48 KiB as in the forward's bn256 kernels; the wgmma
// reads them through MN-major descriptors (gg_desc_mn: 8 K rows of 128
// bytes per swizzle atom, the next 64 columns one box on) with both
// transpose bits set, and each k16 step moves 16 K rows (2048 bytes) on.
// Warpgroup 0's thread 0 issues the loads into a 4-stage ring; consumer
// warpgroup c computes rows [64c, 64c+64) of the tile's M from box c of
// A, as gg_body's cooperative mainloop does. setmaxnreg gives the
// producer warpgroup 40 registers and the consumers 232 (the (384, 1)
// launch bound fixes the entry count at 168, which the host checks).
//
// An expert's last k-block may hold rows of the next expert (A and B are
// one 2-D map each; rows past the tensor come in as zeros). Before its
// wgmmas read that block, each consumer warpgroup zeroes those rows of
// its A box: whole 128-byte rows, which the swizzle only permutes within,
// then a proxy fence so the tensor cores see the generic writes. The next
// expert's B rows then meet zeros (they are finite: every row below rows
// is some expert's, written before this kernel).
//
// Launch: GG_THREADS threads, at most one block per SM, dynamic shared
// memory 1024 + GG_TN_STAGES * 49152 + 16 * GG_TN_STAGES bytes
// (ggTNSmemBytes in backend/cuda/grouped_gemm.go).
#define GG_TN_STAGES 4

// gg_tn_tile is the expert, first output row (of M) and first column (of
// N) of tile t; Go twin ggTNTileOf.
__device__ __forceinline__ void gg_tn_tile(int t, int nTM, int nTN, int& e, int& m0, int& n0) {
  const int per = nTM * nTN;
  e = t / per;
  const int r = t - e * per;
  m0 = (r % nTM) * GG_BM;
  n0 = (r / nTM) * 256;
}

// gg_tn_rows is expert e's row range, clamped to [0, rows].
__device__ __forceinline__ void gg_tn_rows(const int* off, int e, int rows, int& beg, int& end) {
  beg = gg_min(gg_max(off[e], 0), rows);
  end = gg_min(gg_max(off[e + 1], beg), rows);
}

// gg_epilogue_tn stores one consumer warpgroup's 64x256 float32 block:
// out = alpha*acc + beta*out, this thread's rows r0 and r0+8 (kept below
// rowEnd), columns c0 + 8i and c0 + 8i + 1 (kept below N). With beta != 0
// the old values of four column groups are loaded before any of them is
// stored, so their loads overlap; gg_store's load-then-store per pair
// waited a full load latency 64 times a tile (beta 1 made the kernel
// 1.36x slower than with beta 0 at 53821a3).
__device__ __forceinline__ void gg_epilogue_tn(const float (&acc)[128], long long r0, int rowEnd, int c0, int N,
                                               float* out, float alpha, float beta) {
  constexpr int B = 4;  // column groups per batch of loads
  const long long r1 = r0 + 8;
  const bool ok0 = r0 < rowEnd, ok1 = r1 < rowEnd;
#pragma unroll
  for (int i0 = 0; i0 < 32; i0 += B) {
    float old[B][4];
#pragma unroll
    for (int u = 0; u < B; u++) {
      const int col = c0 + 8 * (i0 + u);
      old[u][0] = old[u][1] = old[u][2] = old[u][3] = 0.0f;
      if (beta != 0.0f && col < N) {
        if (ok0)
          asm volatile("ld.global.v2.f32 {%0, %1}, [%2];" : "=f"(old[u][0]), "=f"(old[u][1]) : "l"(out + r0 * N + col));
        if (ok1)
          asm volatile("ld.global.v2.f32 {%0, %1}, [%2];" : "=f"(old[u][2]), "=f"(old[u][3]) : "l"(out + r1 * N + col));
      }
    }
#pragma unroll
    for (int u = 0; u < B; u++) {
      const int i = i0 + u, col = c0 + 8 * i;
      if (col < N) {
        if (ok0)
          asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(out + r0 * N + col),
                       "f"(alpha * acc[4 * i] + beta * old[u][0]), "f"(alpha * acc[4 * i + 1] + beta * old[u][1])
                       : "memory");
        if (ok1)
          asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(out + r1 * N + col),
                       "f"(alpha * acc[4 * i + 2] + beta * old[u][2]), "f"(alpha * acc[4 * i + 3] + beta * old[u][3])
                       : "memory");
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(384, 1) grouped_gemm_tn(const __grid_constant__ gg_tmap mapA,
                                                                     const __grid_constant__ gg_tmap mapB, float* out,
                                                                     const int* off, int rows, int M, int N, int E,
                                                                     float alpha, float beta) {
  constexpr int STAGES = GG_TN_STAGES;
  constexpr unsigned BOX = 64 * 128;                   // {64 columns, 64 rows} of bf16: 8 KiB
  constexpr unsigned A_BYTES = 2 * BOX;                // 128 of M
  constexpr unsigned STAGE_BYTES = A_BYTES + 4 * BOX;  // and 256 of N: 48 KiB
  const unsigned raw = gg_smem_addr(gg_smem);
  const unsigned base = (raw + 1023u) & ~1023u;
  const unsigned bars = base + STAGES * STAGE_BYTES;  // full[STAGES], empty[STAGES]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < STAGES; s++) {
      gg_bar_init(bars + 8 * s, 1);             // full: the producer's expect_tx
      gg_bar_init(bars + 8 * (STAGES + s), 8);  // empty: one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  const int nTM = (M + GG_BM - 1) / GG_BM, nTN = (N + 255) / 256;
  const int total = E * nTM * nTN;  // the host checks it fits

  if (warp < 4) {
    // The producer warpgroup gives its registers to the consumers, whose
    // 128 accumulators, addresses and epilogue loads spill at 168.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
    if (tid != 0) return;
    gg_prefetch_tmap(&mapA);
    gg_prefetch_tmap(&mapB);
    int s = 0;
    unsigned ph = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      int e, m0, n0, beg, end;
      gg_tn_tile(t, nTM, nTN, e, m0, n0);
      gg_tn_rows(off, e, rows, beg, end);
      for (int k0 = beg; k0 < end; k0 += GG_BK) {
        const unsigned full = bars + 8 * s, empty = bars + 8 * (STAGES + s);
        gg_bar_wait(empty, ph ^ 1);  // a fresh barrier's parity-1 phase counts as complete
        gg_bar_expect_tx(full, STAGE_BYTES);
        const unsigned a = base + s * STAGE_BYTES;
        gg_tma_2d(a, &mapA, m0, k0, full);
        gg_tma_2d(a + BOX, &mapA, m0 + 64, k0, full);
#pragma unroll
        for (int j = 0; j < 4; j++) gg_tma_2d(a + A_BYTES + j * BOX, &mapB, n0 + 64 * j, k0, full);
        if (++s == STAGES) {
          s = 0;
          ph ^= 1;
        }
      }
    }
    return;
  }

  // Consumer warpgroups 1 and 2: rows [64*cw, 64*cw + 64) of the tile's M.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");  // 128*40 + 256*232 <= 64K
  const int cw = (warp >> 2) - 1, wtid = tid - 128 * (cw + 1);
  float acc[128];
  int s = 0, prev = 0;
  unsigned ph = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    int e, m0, n0, beg, end;
    gg_tn_tile(t, nTM, nTN, e, m0, n0);
    gg_tn_rows(off, e, rows, beg, end);
    const int nK = (end - beg + GG_BK - 1) / GG_BK;
    if (nK == 0 && beta == 1.0f) continue;  // an empty expert's block stays as it is
    // Zero for an empty expert's block; otherwise the first wgmma
    // overwrites it, but an accumulator left with the last tile's values
    // on one path makes ptxas serialize every wgmma (C7514).
#pragma unroll
    for (int i = 0; i < 128; i++) acc[i] = 0.0f;
    for (int kb = 0; kb < nK; kb++) {
      gg_bar_wait(bars + 8 * s, ph);
      const unsigned a = base + s * STAGE_BYTES, boxA = a + cw * BOX;
      const int valid = end - beg - kb * GG_BK;
      if (valid < GG_BK) {
        // Rows [valid, 64) of the block are the next expert's: zero them
        // in this warpgroup's A box. Every thread takes the same four
        // 16-byte pieces of the box's 512 and stores those past row valid
        // (predicated stores, no divergent loop before the wgmmas).
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const int i = wtid + 128 * j;
          if (i >= valid * 8)
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(boxA + 16 * i), "r"(0) : "memory");
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        gg_named_sync(1 + cw, 128);
      }
      // Reconverge the warp before the .aligned wgmma instructions.
      asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
      const unsigned long long da = gg_desc_mn(boxA, BOX), db = gg_desc_mn(a + A_BYTES, BOX);
      gg_wgmma_fence();
      gg_fence_acc(acc);
#pragma unroll
      for (int kk = 0; kk < GG_BK / 16; kk++) {
        // +128 in the descriptor's address field is 2048 bytes: 16 rows of K.
        gg_wgmma<1, 1>(acc, da + 128 * kk, db + 128 * kk, (kb > 0 || kk > 0) ? 1 : 0);
      }
      gg_wgmma_commit();
      if (kb > 0) {
        // The k-block before this one is done with its stage.
        gg_wgmma_wait<1>();
        gg_fence_acc(acc);
        if (lane == 0) gg_bar_arrive(bars + 8 * (STAGES + prev));
      }
      prev = s;
      if (++s == STAGES) {
        s = 0;
        ph ^= 1;
      }
    }
    if (nK > 0) {
      gg_wgmma_wait<0>();
      gg_fence_acc(acc);
      if (lane == 0) gg_bar_arrive(bars + 8 * (STAGES + prev));
    }
    const long long r0 = (long long)m0 + cw * 64 + (warp & 3) * 16 + (lane >> 2);
    gg_epilogue_tn(acc, r0, M, n0 + 2 * (lane & 3), N, out + (long long)e * M * N, alpha, beta);
  }
}

#if GG_CLUSTER
// ---- Lab: 2-block clusters multicasting the weight tile ----
//
// gemm_nt_c2_bn256_f32 is grouped_gemm_nt_bn256_f32 for one expert
// (out[rows, N] = A[rows, K] . W[N, K]^T, float32 out, beta 0) on clusters
// of two blocks (cuLaunchKernelEx's cluster dimension {2, 1, 1}). The two
// blocks of a cluster take m-tiles 2p and 2p + 1 of the same n-tile, so
// they read the same 256x64 weight tile each k-block: each block's TMA
// thread loads its own 128x64 A tile and one 128-row half of the weight
// tile, multicast into both blocks' stage. L2 then hands a block 32 KiB a
// k-block instead of 48, which cuBLASLt's nvjet_sm90_tss_192x192_64x4_1x2
// (192x192 tiles, clusters of two, the weight multicast) gets too: the
// suspect in the 1.16x between the pipeline's product and that kernel at
// tensor parallelism's shapes (kernels/grouped_gemm.md).
//
// The pipeline is gg_body's on clusters ("Clusters" in grouped_gemm.cuh,
// which took it from this lab for the tensor-parallel kernels): the full
// barrier expects the whole stage, the empty barrier counts both blocks'
// consumer warps, the TMA thread waits for the ring's last phases before
// it exits, and the cluster helpers are hopper.cuh's (arrivals and waits
// at CTA scope: gg_bar_arrive_peer says why). An m-tile past the rows (an
// odd m-tile count) loads TMA's zero fill and stores nothing.
//
// mapA: {K, rows} bf16, boxes {64, 128}, 128-byte swizzle (as the
// production's); mapWh: {K, N, 1} bf16, boxes {64, 128, 1}: half the
// weight tile. Launch: a multiple of two blocks of 384 threads (two per
// cluster), at most one per SM; dynamic shared memory 1024 + 4 * 49152 +
// 64 bytes.

#define GGC_STAGES 4

extern "C" __global__ void __launch_bounds__(384, 1) gemm_nt_c2_bn256_f32(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapWh, float* out, int rows, int N, int K) {
  constexpr unsigned A_BYTES = GG_BM * GG_BK * 2;  // 16 KiB
  constexpr unsigned HALF_BYTES = 128 * GG_BK * 2;  // 16 KiB: half the 256-row weight tile
  constexpr unsigned STAGE_BYTES = A_BYTES + 2 * HALF_BYTES;
  const unsigned raw = gg_smem_addr(gg_smem);
  const unsigned base = (raw + 1023u) & ~1023u;
  const unsigned bars = base + GGC_STAGES * STAGE_BYTES;  // full[STAGES], then empty[STAGES]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const unsigned rank = gg_cluster_rank(), peer = rank ^ 1u;
  if (tid == 0) {
    for (int s = 0; s < GGC_STAGES; s++) {
      gg_bar_init(bars + 8 * s, 1);                  // full: this block's expect_tx
      gg_bar_init(bars + 8 * (GGC_STAGES + s), 16);  // empty: 8 consumer warps of each block
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // The barriers exist in both blocks before either block's TMA or
  // consumers reach the other's.
  gg_cluster_sync();

  const int mTiles = (rows + GG_BM - 1) / GG_BM, nTN = (N + 255) / 256, nK = (K + GG_BK - 1) / GG_BK;
  const int pairs = (mTiles + 1) / 2 * nTN;
  const int cluster = blockIdx.x >> 1, clusters = gridDim.x >> 1;

  if (warp < 4) {
    if (tid != 0) return;
    gg_prefetch_tmap(&mapA);
    gg_prefetch_tmap(&mapWh);
    int s = 0;
    unsigned ph = 0;
    for (int p = cluster; p < pairs; p += clusters) {
      const int row0 = (2 * (p / nTN) + (int)rank) * GG_BM, n0 = (p % nTN) * 256;
      for (int kb = 0; kb < nK; kb++) {
        const unsigned full = bars + 8 * s, empty = bars + 8 * (GGC_STAGES + s);
        gg_bar_wait(empty, ph ^ 1);
        gg_bar_expect_tx(full, STAGE_BYTES);
        const unsigned a = base + s * STAGE_BYTES;
        gg_tma_2d(a, &mapA, kb * GG_BK, row0, full);
        gg_tma_3d_multicast(a + A_BYTES + rank * HALF_BYTES, &mapWh, kb * GG_BK, n0 + 128 * (int)rank, 0, full, 3);
        if (++s == GGC_STAGES) {
          s = 0;
          ph ^= 1;
        }
      }
    }
    // Every stage's last use released by both blocks' consumers.
    for (int i = 0; i < GGC_STAGES; i++) {
      gg_bar_wait(bars + 8 * (GGC_STAGES + s), ph ^ 1);
      if (++s == GGC_STAGES) {
        s = 0;
        ph ^= 1;
      }
    }
    return;
  }

  // Consumer warpgroups 1 and 2: rows [64*cw, 64*cw + 64) of the tile, as
  // gg_body's.
  const int cw = (warp >> 2) - 1;
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; i++) acc[i] = 0.0f;
  int s = 0, prev = 0;
  unsigned ph = 0;
  for (int p = cluster; p < pairs; p += clusters) {
    const int row0 = (2 * (p / nTN) + (int)rank) * GG_BM, n0 = (p % nTN) * 256;
    for (int kb = 0; kb < nK; kb++) {
      gg_bar_wait(bars + 8 * s, ph);
      asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
      const unsigned a = base + s * STAGE_BYTES;
      const unsigned long long da = gg_desc(a + cw * 64 * 128), db = gg_desc(a + A_BYTES);
      gg_wgmma_fence();
      gg_fence_acc(acc);
#pragma unroll
      for (int kk = 0; kk < GG_BK / 16; kk++) gg_wgmma(acc, da + 2 * kk, db + 2 * kk, (kb > 0 || kk > 0) ? 1 : 0);
      gg_wgmma_commit();
      if (kb > 0) {
        gg_wgmma_wait<1>();
        gg_fence_acc(acc);
        if (lane == 0) {
          const unsigned empty = bars + 8 * (GGC_STAGES + prev);
          gg_bar_arrive(empty);
          gg_bar_arrive_peer(gg_peer_addr(empty, peer));
        }
      }
      prev = s;
      if (++s == GGC_STAGES) {
        s = 0;
        ph ^= 1;
      }
    }
    gg_wgmma_wait<0>();
    gg_fence_acc(acc);
    if (lane == 0) {
      const unsigned empty = bars + 8 * (GGC_STAGES + prev);
      gg_bar_arrive(empty);
      gg_bar_arrive_peer(gg_peer_addr(empty, peer));
    }
    const long long r0 = (long long)row0 + cw * 64 + (warp & 3) * 16 + (lane >> 2);
    gg_epilogue64<false>(acc, r0, rows, n0 + 2 * (lane & 3), N, out, 1.0f, 0.0f);
  }
}
#endif
