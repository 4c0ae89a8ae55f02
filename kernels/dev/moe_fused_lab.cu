// The lab copy of kernels/moe_fused.cu: the fused kernels (the MoE
// experts' and tensor parallelism's) with the
// experiment switches that training never sets, as compile-time defines
// (kernels/dev.Sources lists the builds worth measuring). Each build is a
// compilation of its own, so a switch leaves the other kernels, and the
// default ones' registers, as they are. With no define it is the
// production source to the instruction: dev_test.go compares the two
// builds' clang PTX, so a variant's figure is read against what trains.
// It includes the production headers (hopper.cuh, grouped_gemm.cuh):
// its experiments are the fused steps, not the pipeline.
//
// To adopt a variant, copy its code into kernels/moe_fused.cu by hand,
// here as the default, and take its switch out; a variant that lost is
// taken out with a line in kernels/grouped_gemm.md.
//
// GG_EXPERIMENT: the gather of moe_dispatch_swiglu and moe_dispatch_dgrad
//   1  float32 sources read as bf16 rows (timing only)
//   2  the rows loaded, none stored (timing only)
//   4  loads cache-streaming (ld.global.cs: evicted first)
//   16 no fences before a chunk's flag (timing only)
// GG_MODE: what each part of the kernels costs (timing only)
//   1   no gather and no tile waits (both dispatches: the products run on
//       whatever xRD holds)
//   2   moe_dispatch_swiglu: no act (neither its math nor its store)
//   4   moe_dispatch_swiglu: act without silu (h1 * h3)
//   16  moe_dispatch_swiglu: the gather without the tile waits (rows may
//       be stale)
//   32  moe_dispatch_dgrad: no dh1/dh3 stores
//   64  moe_dispatch_dgrad: no loads of h1/h3 boxes 2 and 3
//   128 moe_dispatch_dgrad: the gather unpaced (no GG_GATHER_LEAD)
//   256 moe_dispatch_dgrad: the gather's copy one step deep (not two)

#include "grouped_gemm.cuh"

// MOE_TEST_LOST_ROWS, defined to 1 by backend/cuda's tests only (a build
// of their own), makes the kernels lose rows as a peer that never
// delivers would: the gathers never publish the last m-tile's chunk 0,
// and the combines never raise row 0's flag. The tests check that the
// bounded waits report it.
#ifndef MOE_TEST_LOST_ROWS
#define MOE_TEST_LOST_ROWS 0
#endif

#ifndef GG_EXPERIMENT
#define GG_EXPERIMENT 0
#endif
#define GG_EX_BF16_SOURCES 1
#define GG_EX_NO_STORES 2
#define GG_EX_STREAMING 4
#define GG_EX_NO_FENCES 16

#ifndef GG_MODE
#define GG_MODE 0
#endif

// The gather's float32 load (GG_EX_STREAMING: evicted first).
#if (GG_EXPERIMENT & GG_EX_STREAMING) != 0
#define GG_GATHER_LD "ld.global.cs.v4.f32"
#else
#define GG_GATHER_LD "ld.global.v4.f32"
#endif

#define GG_CHUNKS 8
#define GG_CHUNK_ROWS (GG_BM / GG_CHUNKS)

// ---- the gather ----

// The gather's unit is a chunk of up to GG_CHUNK_ROWS rows of one m-tile;
// a step copies two of its rows' 1024-column block jb (a lane: four
// 8-column pieces of each row, 64 floats in flight).
struct gg_gather_chunk {
  int g, c, r0, nr;  // m-tile, chunk in it, first row, rows (0..GG_CHUNK_ROWS)
};

__device__ __forceinline__ gg_gather_chunk gg_gather_chunk_of(int u, int E, const int* sBeg, const int* sEnd,
                                                              const int* sCum) {
  gg_gather_chunk k;
  k.g = u / GG_CHUNKS;
  k.c = u - k.g * GG_CHUNKS;
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (sCum[mid] <= k.g) lo = mid;
    else hi = mid - 1;
  }
  k.r0 = sBeg[lo] + (k.g - sCum[lo]) * GG_BM + k.c * GG_CHUNK_ROWS;
  k.nr = gg_max(gg_min(k.r0 + GG_CHUNK_ROWS, sEnd[lo]) - k.r0, 0);
  return k;
}

// gg_sigmoid is 1 / (1 + e^-x) with the hardware's approximate exp2 and
// reciprocal (relative error ~1e-7, far below bf16's rounding): the
// accurate expf and IEEE division cost the act epilogue ~0.2 ms on
// moe-small. x very negative: exp2 gives inf and its reciprocal 0.
__device__ __forceinline__ float gg_sigmoid(float x) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return r;
}

// gg_silu is x * sigmoid(x) (x very negative: -0).
__device__ __forceinline__ float gg_silu(float x) { return x * gg_sigmoid(x); }

// gg_gather_load issues the loads of step st of a chunk of nr rows: lane
// i < nr holds row i's source address (src) in its float32 rows (SRC_BF16:
// bf16 rows, widened exactly).
template <bool SRC_BF16>
__device__ __forceinline__ void gg_gather_load(int st, int nJ, int nr, int K, int lane, long long src,
                                               float (&v)[2][4][8]) {
  const int i = (st / nJ) * 2, j0 = lane * 8 + (st % nJ) * 1024;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const float* p = (const float*)gg_shfl_ptr(src, gg_min(i + h, nr - 1));
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const int j = j0 + 256 * u;
      if (j >= K) continue;
      if constexpr (SRC_BF16 || (GG_EXPERIMENT & GG_EX_BF16_SOURCES) != 0) {
        // The same columns as bf16: 16 bytes where float32 takes 32.
        unsigned w[4];
        asm volatile("ld.global.v4.b32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                     : "l"((const unsigned short*)p + j));
#pragma unroll
        for (int q = 0; q < 4; q++) {
          v[h][u][2 * q] = gg_bf16_lo(w[q]);
          v[h][u][2 * q + 1] = gg_bf16_hi(w[q]);
        }
      } else {
        asm volatile(GG_GATHER_LD " {%0, %1, %2, %3}, [%4];"
                     : "=f"(v[h][u][0]), "=f"(v[h][u][1]), "=f"(v[h][u][2]), "=f"(v[h][u][3])
                     : "l"(p + j));
        asm volatile(GG_GATHER_LD " {%0, %1, %2, %3}, [%4];"
                     : "=f"(v[h][u][4]), "=f"(v[h][u][5]), "=f"(v[h][u][6]), "=f"(v[h][u][7])
                     : "l"(p + j + 4));
      }
    }
  }
}

// gg_gather_store writes step st's rows, scaled (lane i: row i's scale),
// to xRD as bf16, and, when fz.xFull is set (GG_TP_GATHER), unrounded to
// xFull too (plain stores: hinted evict-first or L1-bypassing, they cost
// the product 2-3%, kernels/grouped_gemm.md). An odd chunk's last pair
// copies its last row twice.
__device__ __forceinline__ void gg_gather_store(const gg_fuse& fz, int st, int nJ, int nr, int r0, int K, int lane,
                                                float scale, const float (&v)[2][4][8]) {
  if constexpr ((GG_EXPERIMENT & GG_EX_NO_STORES) != 0) return;
  const int i = (st / nJ) * 2, j0 = lane * 8 + (st % nJ) * 1024;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int ii = gg_min(i + h, nr - 1);
    unsigned short* dst = fz.xRD + (long long)(r0 + ii) * K;
    float* full = fz.xFull ? fz.xFull + (long long)(r0 + ii) * K : nullptr;
    const float sc = gg_bits_float((unsigned)gg_shfl_idx((int)gg_float_bits(scale), ii));
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const int j = j0 + 256 * u;
      if (j < K) {
        float w[8];
#pragma unroll
        for (int q = 0; q < 8; q++) w[q] = v[h][u][q] * sc;
        asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst + j), "r"(gg_pack_bf16(w[0], w[1])),
                     "r"(gg_pack_bf16(w[2], w[3])), "r"(gg_pack_bf16(w[4], w[5])), "r"(gg_pack_bf16(w[6], w[7]))
                     : "memory");
        if (full) {
          asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(full + j), "f"(w[0]), "f"(w[1]), "f"(w[2]),
                       "f"(w[3])
                       : "memory");
          asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(full + j + 4), "f"(w[4]), "f"(w[5]),
                       "f"(w[6]), "f"(w[7])
                       : "memory");
        }
      }
    }
  }
}

// gg_row_ref is row r's source (or owner) rank and position: from the
// references, or, without them (the tensor-parallel kinds), rank r /
// blockRows, position r % blockRows.
__device__ __forceinline__ void gg_row_ref(const gg_fuse& fz, int r, int& s, int& p) {
  if (fz.refs) {
    s = fz.refs[2 * r];
    p = fz.refs[2 * r + 1];
  } else {
    s = r / fz.blockRows;
    p = r - s * fz.blockRows;
  }
}

// GG_GATHER_LEAD is how many m-tiles GG_DISPATCH_DGRAD's paced gather may
// run ahead of its block's tiles: 2.5 waves of 132 tiles at moe-small's 11
// column tiles a row of tiles, far longer than a chunk's copy takes.
#define GG_GATHER_LEAD 32

// gg_gather is a gathering warp's work (the dispatches): chunks u = cw,
// cw + ncw, ... of the GG_CHUNKS * M chunks, m-tile major from m-tile
// fz.rotM (wrapping; 0 but for GG_TP_GATHER); each row is
// read from its source as float32, scaled (GG_DISPATCH_DGRAD: by its
// send-order scale), and written to xRD as bf16 (K is a multiple of 8), then the
// chunk is published. The next chunk's row lookups (references, then
// token indices: two dependent loads) are issued under the current
// chunk's copy and its fence. Two ways to run it:
// - FIRST (GG_DISPATCH_SWIGLU; GG_DISPATCH_DGRAD in moe_dispatch_dgrad_first): every warp of the
//   block but the TMA thread's gathers before its own work, unpaced; the
//   copy is one step deep, since the consumers' code inlines it and a
//   second step's registers cost their mainloop more than the depth
//   gains with eleven warps a block copying (kernels/grouped_gemm.md).
// - otherwise (GG_DISPATCH_DGRAD): three warps a block gather beside the products,
//   paced by the block's front; the copy is bound by load latency, so two
//   steps are in flight (one stored while the next one's loads are out).
template <bool FIRST, bool SRC_BF16>
__device__ __forceinline__ void gg_gather(const gg_fuse& fz, int cw, int ncw, int lane, int K, int E, const int* sBeg,
                                          const int* sEnd, const int* sCum, const volatile int* front) {
  if constexpr ((GG_MODE & 1) != 0) return;
  const int total = sCum[E] * GG_CHUNKS, nJ = (K + 1023) / 1024;
  if (cw >= total) return;
  // A source row's length in floats (K bf16 take K / 2).
  const int rowFloats = SRC_BF16 || (GG_EXPERIMENT & GG_EX_BF16_SOURCES) != 0 ? K / 2 : K;
  // Lane i < nr: its row's source rank and send position (the references)
  // and, resolved from them, its source address and scale.
  const int rot = fz.rotM * GG_CHUNKS;
  gg_gather_chunk cur = gg_gather_chunk_of(gg_rotate(cw, rot, total), E, sBeg, sEnd, sCum);
  int refS = 0, refP = 0;
  if (lane < cur.nr) gg_row_ref(fz, cur.r0 + lane, refS, refP);
  long long src = 0;
  float scale = 1.0f;
  // The source row: the token list's entry (the dispatches), or the
  // position itself (no token lists: GG_TP_GATHER).
  if (lane < cur.nr) {
    const int row = fz.toks ? ((const int*)fz.toks[refS])[refP] : refP;
    src = (long long)((const float*)fz.ptrs[refS] + (long long)row * rowFloats);
    if (fz.scales) scale = ((const float*)fz.scales[refS])[refP];
  }
  for (int u = cw; u < total; u += ncw) {
    // Paced: at most GG_GATHER_LEAD m-tiles ahead of this block's TMA
    // thread (front), so the rows stream in over the whole product rather
    // than in one burst that takes L2 and DRAM bandwidth from its first
    // tiles. No wait can close a cycle: the lowest unpublished chunk's
    // warp is never held, since its block's TMA thread is at that chunk's
    // m-tile or past it (or done: front GG_FRONT_DONE); on clusters
    // (GG_TP_GATHER) a TMA thread may also wait for its peer block, whose
    // TMA thread is at the pair's other m-tile, one away, inside the
    // lead. Pacing only orders work, so a wait past the tile waits' bound
    // gives up on it rather than risk a hang. Lane 0 decides for the warp.
    // Both count m-tiles along the walk (before the rotation).
    const int walkG = u / GG_CHUNKS;
    if (!FIRST && (GG_MODE & 128) == 0 && walkG > *front + GG_GATHER_LEAD) {
      const unsigned long long t0 = gg_globaltimer();
      while (gg_shfl_idx(walkG > *front + GG_GATHER_LEAD && gg_globaltimer() - t0 < fz.timeoutNs, 0))
        asm volatile("nanosleep.u32 256;");
    }
    const bool more = u + ncw < total;
    gg_gather_chunk next = cur;
    if (more) {
      next = gg_gather_chunk_of(gg_rotate(u + ncw, rot, total), E, sBeg, sEnd, sCum);
      if (lane < next.nr) gg_row_ref(fz, next.r0 + lane, refS, refP);
    }
    const int steps = ((cur.nr + 1) / 2) * nJ;
    float va[2][4][8], vb[2][4][8];
    if (FIRST || (GG_MODE & 256) != 0) {
      // One step in flight (each stored before the next one's loads go
      // out).
      for (int st = 0; st < steps; st++) {
        gg_gather_load<SRC_BF16>(st, nJ, cur.nr, K, lane, src, va);
        gg_gather_store(fz, st, nJ, cur.nr, cur.r0, K, lane, scale, va);
      }
    } else {
      if (steps > 0) gg_gather_load<SRC_BF16>(0, nJ, cur.nr, K, lane, src, va);
      for (int st = 0; st < steps; st += 2) {
        if (st + 1 < steps) gg_gather_load<SRC_BF16>(st + 1, nJ, cur.nr, K, lane, src, vb);
        gg_gather_store(fz, st, nJ, cur.nr, cur.r0, K, lane, scale, va);
        if (st + 2 < steps) gg_gather_load<SRC_BF16>(st + 2, nJ, cur.nr, K, lane, src, va);
        if (st + 1 < steps) gg_gather_store(fz, st + 1, nJ, cur.nr, cur.r0, K, lane, scale, vb);
      }
    }
    // The next chunk's sources, resolved while this chunk's stores drain.
    long long nsrc = 0;
    float nscale = 1.0f;
    if (more && lane < next.nr) {
      const int row = fz.toks ? ((const int*)fz.toks[refS])[refP] : refP;
      nsrc = (long long)((const float*)fz.ptrs[refS] + (long long)row * rowFloats);
      if (fz.scales) nscale = ((const float*)fz.scales[refS])[refP];
    }
    // Every lane's rows are visible at GPU scope, and ordered before the
    // async proxy's (TMA's) reads, before lane 0 publishes the chunk.
    if constexpr ((GG_EXPERIMENT & GG_EX_NO_FENCES) == 0) {
      asm volatile("fence.acq_rel.gpu;" ::: "memory");
      asm volatile("fence.proxy.async.global;" ::: "memory");
    }
    asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
    // MOE_TEST_LOST_ROWS: a chunk that is never published.
    const bool lost = MOE_TEST_LOST_ROWS && cur.g == (sCum[E] - 1 + fz.rotM) % sCum[E] && cur.c == 0;
    if (lane == 0 && !lost)
      asm volatile("red.release.gpu.global.or.b32 [%0], %1;" ::"l"(fz.flags + cur.g), "r"(1u << cur.c) : "memory");
    cur = next;
    src = nsrc;
    scale = nscale;
  }
}

// gg_wait_tile returns once m-tile g's GG_CHUNKS chunks have landed (the
// dispatches' TMA thread, before the tile's first A load), or the wait
// timed out (this one, recorded in fz.fault, or an earlier one of the
// launch). Its rows are [row0, rowEnd).
#define GG_ALL_CHUNKS ((1 << GG_CHUNKS) - 1)
// kind (the kernel's gg_fusion, GG_DISPATCH_SWIGLU or GG_DISPATCH_DGRAD)
// is the record's first word.
__device__ __forceinline__ void gg_wait_tile(const gg_fuse& fz, int g, int row0, int rowEnd, int kind) {
  if ((GG_MODE & 1) != 0 || (kind == GG_DISPATCH_SWIGLU && (GG_MODE & 16) != 0)) return;
  const int* f = fz.flags + g;
  int got = gg_ld_acquire(f);
  if (got != GG_ALL_CHUNKS) {
    const unsigned long long t0 = gg_globaltimer();
    while ((got = gg_ld_acquire(f)) != GG_ALL_CHUNKS) {
      if (*(volatile const int*)fz.fault != 0) break;  // an earlier wait failed
      if (gg_globaltimer() - t0 > fz.timeoutNs) {
        int was;
        asm volatile("atom.relaxed.gpu.global.cas.b32 %0, [%1], 0, %2;"
                     : "=r"(was)
                     : "l"(fz.fault), "r"(kind)
                     : "memory");
        if (was == 0) {
          int c = 0;
          while (c < GG_CHUNKS && (got >> c) & 1) c++;
          const int r = row0 + c * GG_CHUNK_ROWS;
          fz.fault[1] = g;
          fz.fault[2] = got;
          int s = -1, p = 0;
          if (r < rowEnd) gg_row_ref(fz, r, s, p);
          fz.fault[3] = s;
          asm volatile("fence.acq_rel.gpu;" ::: "memory");
        }
        break;
      }
    }
  }
  // The rows were written through the generic proxy; TMA reads them
  // through the async proxy.
  asm volatile("fence.proxy.async.global;" ::: "memory");
}


// ---- GG_DISPATCH_SWIGLU's epilogue ----

// gg_stage_h13 is the consumers' half of GG_DISPATCH_SWIGLU's epilogue:
// the warpgroup writes its 64 x 128 blocks of h1 and h3 (bf16) to its two
// 16 KiB staging buffers,
// each as two 64x64 swizzled boxes, and tells its helper warp (staged),
// which stores them, computes act and frees the buffers (gg_act_helper).
// Before block c (c counts the warpgroup's staged blocks) it waits until
// block c - 1's buffers are free. So the consumers' epilogue is two
// conflict-free shared-memory stores a pair of columns, for every block
// (gg_block_staged); the stores, SwiGLU and act's store run under the
// next tile's mainloop.
__device__ __forceinline__ void gg_stage_h13(const float (&acc)[128], unsigned stg, unsigned staged, unsigned freed,
                                             int wtid, int warp, int lane, int id, unsigned& c) {
  if (c > 0) gg_bar_wait(freed, (c - 1) & 1u);
  const int rl = (warp & 3) * 16 + (lane >> 2);
  const int sw = lane >> 2;  // rl & 7, and (rl + 8) & 7
  const unsigned rowA = stg + rl * 128, rowB = rowA + 8 * 128;
#pragma unroll
  for (int p = 0; p < 2; p++) {
#pragma unroll
    for (int i = 0; i < 16; i++) {
      const unsigned o = p * 16384u + (i >> 3) * 8192 + ((((i & 7) ^ sw) << 4) | ((lane & 3) << 2));
      const int a = 4 * (i + 16 * p);  // h1: groups 0..15, h3: 16..31
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(rowA + o), "r"(gg_pack_bf16(acc[a], acc[a + 1])) : "memory");
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(rowB + o), "r"(gg_pack_bf16(acc[a + 2], acc[a + 3])) : "memory");
    }
  }
  // Generic-proxy writes, async-proxy (TMA) reader; the named barrier
  // orders every thread's writes before the one arrival.
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  gg_named_sync(id, 128);
  if (wtid == 0) gg_bar_arrive(staged);
  c++;
}

// gg_act_pieces writes act = silu(h1) * h3 over h1's staging buffer stg
// (h3's is 16 KiB after it), 16-byte piece lane + 32 * i for i < 32:
// 1024 pieces a 64 x 128 block, four pieces' loads in flight before
// their math and stores. h1, h3 and act share one layout,
// so act is computed element by element with no unswizzling, from the
// bf16 h1 and h3 that the unfused SwiGLU and the backward also see.
__device__ __forceinline__ void gg_act_pieces(unsigned stg, int lane) {
  for (int i0 = 0; i0 < 32; i0 += 4) {
    unsigned v1[4][4], v3[4][4];
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const unsigned a = stg + 16u * (lane + 32 * (i0 + u));
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v1[u][0]), "=r"(v1[u][1]), "=r"(v1[u][2]), "=r"(v1[u][3])
                   : "r"(a));
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v3[u][0]), "=r"(v3[u][1]), "=r"(v3[u][2]), "=r"(v3[u][3])
                   : "r"(a + 16384u));
    }
#pragma unroll
    for (int u = 0; u < 4; u++) {
#pragma unroll
      for (int w = 0; w < 4; w++) {
        const float a0 = gg_bf16_lo(v1[u][w]), a1 = gg_bf16_hi(v1[u][w]);
        const float b0 = gg_bf16_lo(v3[u][w]), b1 = gg_bf16_hi(v3[u][w]);
        v1[u][w] = (GG_MODE & 4) == 0 ? gg_pack_bf16(gg_silu(a0) * b0, gg_silu(a1) * b1) : gg_pack_bf16(a0 * b0, a1 * b1);
      }
      const unsigned a = stg + 16u * (lane + 32 * (i0 + u));
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(v1[u][0]), "r"(v1[u][1]),
                   "r"(v1[u][2]), "r"(v1[u][3])
                   : "memory");
    }
  }
}

// gg_act_rows is the act epilogue of a block that TMA cannot store
// (gg_block_tma refuses it: its rows past rowEnd are the next expert's):
// piece q = lane + 32 * i of the staged h1 and h3 (box q >> 9, row
// (q >> 3) & 63, its 16-byte chunk (q & 7) swizzled by the row, as
// gg_stage_h13 wrote it) goes to global memory with act = silu(h1) * h3
// beside it, rows from rowEnd on masked. No act is written over the
// staging buffers. Such a block is an expert's last (one in ~7 at the
// fine-grained shape); on the consumers, with act computed in their
// registers, it delayed their next tile, and the blocks of an expert's
// m-tiles drifted apart and stopped sharing its weight tiles in L2
// (kernels/grouped_gemm.md, "Partial blocks staged").
__device__ __forceinline__ void gg_act_rows(const gg_fuse& fz, unsigned short* h1, unsigned stg, int lane, int wr0,
                                            int rowEnd, int n0, int N) {
#pragma unroll 4
  for (int i = 0; i < 32; i++) {
    const int q = lane + 32 * i, r = (q >> 3) & 63;
    const long long row = (long long)wr0 + r;
    const int col = n0 + 64 * (q >> 9) + 8 * ((q & 7) ^ (r & 7));
    if (row >= rowEnd || col >= N) continue;
    unsigned v1[4], v3[4];
    const unsigned a = stg + 16u * q;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v1[0]), "=r"(v1[1]), "=r"(v1[2]), "=r"(v1[3]) : "r"(a));
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v3[0]), "=r"(v3[1]), "=r"(v3[2]), "=r"(v3[3])
                 : "r"(a + 16384u));
    const long long o = row * N + col;
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(h1 + o), "r"(v1[0]), "r"(v1[1]), "r"(v1[2]), "r"(v1[3])
                 : "memory");
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(fz.h3 + o), "r"(v3[0]), "r"(v3[1]), "r"(v3[2]),
                 "r"(v3[3])
                 : "memory");
    if constexpr ((GG_MODE & 2) != 0) continue;  // no act
    unsigned va[4];
#pragma unroll
    for (int w = 0; w < 4; w++) {
      const float a0 = gg_bf16_lo(v1[w]), a1 = gg_bf16_hi(v1[w]);
      const float b0 = gg_bf16_lo(v3[w]), b1 = gg_bf16_hi(v3[w]);
      va[w] = (GG_MODE & 4) == 0 ? gg_pack_bf16(gg_silu(a0) * b0, gg_silu(a1) * b1) : gg_pack_bf16(a0 * b0, a1 * b1);
    }
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(fz.act + o), "r"(va[0]), "r"(va[1]), "r"(va[2]),
                 "r"(va[3])
                 : "memory");
  }
}

// gg_act_helper is GG_DISPATCH_SWIGLU's act epilogue, run by one warp of the producer
// warpgroup for consumer warpgroup cw (warps 1 and 2 for warpgroups 0 and
// 1). It walks the same tiles as its consumers; for each block they stage
// (gg_stage_h13) it stores h1 and h3 by TMA, and once those stores have
// read the buffers it writes act over h1's buffer (gg_act_pieces), stores
// act by TMA and frees both buffers (freed); a block TMA cannot store (an
// expert's last, partial) goes out by plain stores (gg_act_rows).
__device__ __forceinline__ void gg_act_helper(const gg_fuse& fz, int cw, int lane, unsigned stg, unsigned staged,
                                              unsigned freed, unsigned short* h1, int rows, int N, int total, int nTN,
                                              int E, const int* sBeg, const int* sEnd, const int* sCum) {
  unsigned k = 0;  // blocks handled
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const gg_tile_t tile = gg_tile<128>(t, nTN, E, sBeg, sEnd, sCum);
    const int wr0 = tile.row0 + cw * 64;
    if (!gg_block_staged(wr0, tile.rowEnd)) continue;
    gg_bar_wait(staged, k & 1u);
    if (!gg_block_tma(wr0, tile.rowEnd, rows)) {
      // A partial block: its rows by plain stores. No TMA store reads
      // these buffers (the last one to was waited for before they were
      // freed), so they are free once the loads are done.
      asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
      gg_act_rows(fz, h1, stg, lane, wr0, tile.rowEnd, tile.n0, N);
      asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
      if (lane == 0) gg_bar_arrive(freed);
      k++;
      continue;
    }
    if (lane == 0) {
#pragma unroll
      for (int p = 0; p < 2; p++) {
#pragma unroll
        for (int b = 0; b < 2; b++) {
          const int col = tile.n0 + 64 * b;
          if (col < N) gg_tma_store_2d(fz.mapOut[p], col, wr0, stg + p * 16384u + b * 8192u);
        }
      }
      gg_bulk_commit();
      if constexpr ((GG_MODE & 2) == 0) gg_bulk_wait_read();
    }
    if constexpr ((GG_MODE & 2) == 0) {
      asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
      gg_act_pieces(stg, lane);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
      if (lane == 0) {
#pragma unroll
        for (int b = 0; b < 2; b++) {
          const int col = tile.n0 + 64 * b;
          if (col < N) gg_tma_store_2d(fz.mapOut[2], col, wr0, stg + b * 8192u);
        }
        gg_bulk_commit();
      }
    }
    if (lane == 0) {
      gg_bulk_wait_read();
      gg_bar_arrive(freed);
    }
    k++;
  }
  // The staging buffers must outlive the stores reading them.
  if (lane == 0) gg_bulk_wait();
}


// gg_quad_gather turns a quad's accumulator layout into column runs: lane
// q (= lane & 3) has p[2j], p[2j+1] = columns 8j + 2q, +1 (j = 0..3) of one
// row's 32-column block; on return o[0..7] are columns 8q .. 8q+7. Four
// rounds of two shuffles. Every lane must call it.
__device__ __forceinline__ void gg_quad_gather(const float (&p)[8], int lane, float (&o)[8]) {
  const int q = lane & 3;
#pragma unroll
  for (int rr = 0; rr < 4; rr++) {
    // Round rr: lane q receives from quad lane (q + rr) & 3 its pair of
    // column group q, so that lane sends its pair (q - rr) & 3.
    const int sj = (q - rr) & 3;
    const float lo = sj == 0 ? p[0] : sj == 1 ? p[2] : sj == 2 ? p[4] : p[6];
    const float hi = sj == 0 ? p[1] : sj == 1 ? p[3] : sj == 2 ? p[5] : p[7];
    const int src = (lane & ~3) | ((q + rr) & 3);
    float glo, ghi;
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(glo) : "f"(lo), "r"(src));
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(ghi) : "f"(hi), "r"(src));
    // The pair came from quad lane (q + rr) & 3: columns 2 * that, +1.
    const int at = 2 * ((q + rr) & 3);
#pragma unroll
    for (int c = 0; c < 8; c += 2) {
      if (c == at) {
        o[c] = glo;
        o[c + 1] = ghi;
      }
    }
  }
}

// gg_epilogue_dswiglu is GG_DISPATCH_DGRAD's epilogue: one warpgroup's 64 rows of
// dAct (accumulator groups i: columns n0 + 8i + 2(lane & 3), +1) become
//   dh1 = dAct * h3 * s(h1) * (1 + h1 * (1 - s(h1))),  dh3 = dAct * h1 * s(h1)
// with h1 and h3 read from the forward's rows. Each 32-column block of a
// row is first regrouped so that each lane of a quad holds 8 adjacent
// columns (gg_quad_gather): its h1 and h3 then come as one 16-byte load
// each and dh1, dh3 go out as one 16-byte store each, whole sectors per
// warp. The loads of a block are issued for both row halves before any
// math. Every lane runs the whole loop; rows past rowEnd are masked.
// It takes the blocks gg_epilogue_dswiglu_tma cannot (rows of two
// experts).
__device__ __forceinline__ void gg_epilogue_dswiglu(const float (&acc)[128], long long r0, int rowEnd, int n0, int N,
                                                    int lane, unsigned short* dh1, const gg_fuse& fz) {
  const int q = lane & 3;
#pragma unroll
  for (int k = 0; k < 8; k++) {
    const int col = n0 + 32 * k + 8 * q;
    unsigned v1[2][4], v3[2][4];  // bf16 pairs of h1 and h3: columns col .. col+7
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const long long r = r0 + 8 * half;
#pragma unroll
      for (int w = 0; w < 4; w++) v1[half][w] = v3[half][w] = 0x3f803f80u;  // 1.0, 1.0
      if (r < rowEnd && col < N) {
        asm volatile("ld.global.v4.b32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v1[half][0]), "=r"(v1[half][1]), "=r"(v1[half][2]), "=r"(v1[half][3])
                     : "l"(fz.h1In + r * N + col));
        asm volatile("ld.global.v4.b32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v3[half][0]), "=r"(v3[half][1]), "=r"(v3[half][2]), "=r"(v3[half][3])
                     : "l"(fz.h3In + r * N + col));
      }
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const long long r = r0 + 8 * half;
      float p[8], d[8];
#pragma unroll
      for (int j = 0; j < 4; j++) {
        p[2 * j] = acc[4 * (4 * k + j) + 2 * half];
        p[2 * j + 1] = acc[4 * (4 * k + j) + 2 * half + 1];
      }
      gg_quad_gather(p, lane, d);
      unsigned o1[4], o3[4];
#pragma unroll
      for (int w = 0; w < 4; w++) {
        float d1[2], d3[2];
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const float h1 = e ? gg_bf16_hi(v1[half][w]) : gg_bf16_lo(v1[half][w]);
          const float h3 = e ? gg_bf16_hi(v3[half][w]) : gg_bf16_lo(v3[half][w]);
          const float g = d[2 * w + e], sg = gg_sigmoid(h1);
          d3[e] = g * h1 * sg;
          d1[e] = g * h3 * sg * (1.0f + h1 * (1.0f - sg));
        }
        o1[w] = gg_pack_bf16(d1[0], d1[1]);
        o3[w] = gg_pack_bf16(d3[0], d3[1]);
      }
      if (r < rowEnd && col < N) {
        asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dh1 + r * N + col), "r"(o1[0]), "r"(o1[1]),
                     "r"(o1[2]), "r"(o1[3])
                     : "memory");
        asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(fz.h3 + r * N + col), "r"(o3[0]), "r"(o3[1]),
                     "r"(o3[2]), "r"(o3[3])
                     : "memory");
      }
    }
  }
}

// gg_dswiglu_load requests box b (64 columns from n0 + 64b, the
// warpgroup's 64 rows from row0) of the forward's h1 and h3 into staging
// slot `slot` (h1 at +0, h3 at +8 KiB, the layout of the TMA-store boxes),
// completing on that slot's barrier. Boxes past N are zero-filled by TMA.
// The caller has waited for the slot's last store to finish reading it.
__device__ __forceinline__ void gg_dswiglu_load(const gg_fuse& fz, unsigned slot, unsigned bar, int row0, int n0,
                                                int b) {
  gg_bar_expect_tx(bar, 16384u);
  gg_tma_2d(slot, fz.mapOut[2], n0 + 64 * b, row0, bar);
  gg_tma_2d(slot + 8192u, fz.mapOut[3], n0 + 64 * b, row0, bar);
}

// gg_epilogue_dswiglu_tma is GG_DISPATCH_DGRAD's epilogue through shared memory: the
// warpgroup's 64 x 256 block of dAct in four boxes of 64 columns. Box b
// sits in slot b & 1 of the warpgroup's two 16 KiB slots (h1 and h3 boxes,
// brought in by gg_dswiglu_load: boxes 0 and 1 during the tile's
// mainloop, box b + 2 as soon as box b's stores have read its slot). Each
// thread reads the h1 and h3 of its accumulator's elements at their
// swizzled places, writes dh1 and dh3 over them, and thread 0 stores the
// two boxes by TMA while the warpgroup goes on. Every element is read and
// written by one thread, so no barrier separates the reads from the
// writes. c counts the warpgroup's boxes (a multiple of 4 on entry):
// slot b & 1's barrier completes its ((c + b) >> 1)-th phase for box b.
// The rows are those gg_block_tma allows.
__device__ __forceinline__ void gg_epilogue_dswiglu_tma(const float (&acc)[128], const gg_fuse& fz, unsigned stg,
                                                        unsigned ebar, int wtid, int warp, int lane, int row0, int n0,
                                                        int N, int id, unsigned& c) {
  const int rl = (warp & 3) * 16 + (lane >> 2);
  const int sw = lane >> 2;  // rl & 7, and (rl + 8) & 7
#pragma unroll
  for (int b = 0; b < 4; b++) {
    const unsigned slot = stg + (b & 1) * 16384u, bar = ebar + 8 * (b & 1);
    gg_bar_wait(bar, ((c + b) >> 1) & 1u);
    // A row half at a time: its 16 loads issue back to back, then 8
    // independent chains of math, then the 16 stores (a load-use chain per
    // element left the epilogue latency-bound: 8 warps an SM hide little).
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const unsigned row = slot + (rl + 8 * half) * 128;
      unsigned v1[8], v3[8];
#pragma unroll
      for (int i = 0; i < 8; i++) {
        const unsigned a = row + (((i ^ sw) << 4) | ((lane & 3) << 2));
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v1[i]) : "r"(a) : "memory");
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v3[i]) : "r"(a + 8192u) : "memory");
      }
#pragma unroll
      for (int i = 0; i < 8; i++) {
        const int gi = 8 * b + i;  // the accumulator's 8-column group
        float d1[2], d3[2];
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const float h1 = e ? gg_bf16_hi(v1[i]) : gg_bf16_lo(v1[i]);
          const float h3 = e ? gg_bf16_hi(v3[i]) : gg_bf16_lo(v3[i]);
          const float g = acc[4 * gi + 2 * half + e], sg = gg_sigmoid(h1);
          d3[e] = g * h1 * sg;
          d1[e] = g * h3 * sg * (1.0f + h1 * (1.0f - sg));
        }
        v1[i] = gg_pack_bf16(d1[0], d1[1]);
        v3[i] = gg_pack_bf16(d3[0], d3[1]);
      }
#pragma unroll
      for (int i = 0; i < 8; i++) {
        const unsigned a = row + (((i ^ sw) << 4) | ((lane & 3) << 2));
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(a), "r"(v1[i]) : "memory");
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(a + 8192u), "r"(v3[i]) : "memory");
      }
    }
    // Generic-proxy writes, async-proxy reader (as gg_epilogue_tma).
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    gg_named_sync(id, 128);
    if (wtid == 0) {
      const int col = n0 + 64 * b;
      if (col < N && (GG_MODE & 32) == 0) {
        gg_tma_store_2d(fz.mapOut[0], col, row0, slot);
        gg_tma_store_2d(fz.mapOut[1], col, row0, slot + 8192u);
      }
      gg_bulk_commit();
      if (b + 2 < 4) {
        gg_bulk_wait_read();
        if constexpr ((GG_MODE & 64) != 0) gg_bar_arrive(bar);
        else gg_dswiglu_load(fz, slot, bar, row0, n0, b + 2);
      }
    }
  }
  c += 4;
}

// ---- the combines' epilogue ----

// gg_epilogue_rows stores one warpgroup's 64x256 block with each row sent
// to its source rank's buffer: float32, or with fz.rowsBF16 bf16 (each
// pair rounded to nearest even in one 32-bit store).
__device__ __forceinline__ void gg_epilogue_rows(const float (&acc)[128], long long r0, int rowEnd, int c0, int N,
                                                 const gg_fuse& fz) {
#pragma unroll
  for (int half = 0; half < 2; half++) {
    const long long r = r0 + 8 * half;
    if (r >= rowEnd) continue;
    const int s = fz.refs[2 * r], p = fz.refs[2 * r + 1];
    if (fz.rowsBF16) {
      unsigned short* dst = (unsigned short*)fz.ptrs[s] + (long long)p * N;
#pragma unroll
      for (int i = 0; i < 32; i++) {
        const int col = c0 + 8 * i;
        if (col < N)
          asm volatile("st.global.b32 [%0], %1;" ::"l"(dst + col),
                       "r"(gg_pack_bf16(acc[4 * i + 2 * half], acc[4 * i + 2 * half + 1]))
                       : "memory");
      }
      continue;
    }
    float* dst = (float*)fz.ptrs[s] + (long long)p * N;
#pragma unroll
    for (int i = 0; i < 32; i++) {
      const int col = c0 + 8 * i;
      if (col < N)
        asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(dst + col), "f"(acc[4 * i + 2 * half]),
                     "f"(acc[4 * i + 2 * half + 1])
                     : "memory");
    }
  }
}

// gg_epilogue_scatter is GG_TP_SCATTER's epilogue: one warpgroup's 64x256
// block (float32), row r landing in its owner's buffer, rank r /
// blockRows, at row slotRow0 + r % blockRows, as fz.scatterMode says.
// The atomic adds are two scalar reductions a pair (red.global.add.f32:
// relaxed, gpu scope; a peer GPU's buffer is reached the same way over
// NVLink).
__device__ __forceinline__ void gg_epilogue_scatter(const float (&acc)[128], long long r0, int rowEnd, int c0, int N,
                                                    const gg_fuse& fz) {
#pragma unroll
  for (int half = 0; half < 2; half++) {
    const long long r = r0 + 8 * half;
    if (r >= rowEnd) continue;
    int s, p;
    gg_row_ref(fz, (int)r, s, p);
    float* dst = (float*)fz.ptrs[s] + (long long)(fz.slotRow0 + p) * N;
#pragma unroll
    for (int i = 0; i < 32; i++) {
      const int col = c0 + 8 * i;
      if (col >= N) continue;
      float a = acc[4 * i + 2 * half], b = acc[4 * i + 2 * half + 1];
      if (fz.scatterMode == GG_SCATTER_RED) {
        asm volatile("red.global.add.f32 [%0], %1;" ::"l"(dst + col), "f"(a) : "memory");
        asm volatile("red.global.add.f32 [%0], %1;" ::"l"(dst + col + 1), "f"(b) : "memory");
        continue;
      }
      if (fz.scatterMode == GG_SCATTER_ADD) {
        float o0, o1;
        asm volatile("ld.global.v2.f32 {%0, %1}, [%2];" : "=f"(o0), "=f"(o1) : "l"(dst + col));
        a += o0;
        b += o1;
      }
      asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(dst + col), "f"(a), "f"(b) : "memory");
    }
  }
}

// gg_mark_rows counts one stored tile of a warpgroup's block: rows
// [wr0, wr0 + 64) below rowEnd of m-tile g, half cw (the combines, with
// flags). After the named barrier every thread's stores of the block are
// done, so one thread adds the tile to the block's count,
// rowTiles[2g + cw], with acq_rel at system scope: the release covers the
// warpgroup's stores, the acquire the other column tiles' (their CTAs
// counted before). The block's last tile (the count reaching nTN) raises
// its rows' flags: its first warp syncs (ordering the lanes after the
// acquire), fences (acq_rel, system scope: once per lane, one instruction
// for the warp) and stores the flags, two rows a lane, so a reader that
// acquires a flag, on any GPU, sees the whole row.
__device__ __forceinline__ void gg_mark_rows(const gg_fuse& fz, int g, int cw, int wr0, int rowEnd, int nTN, int warp,
                                             int lane, int barId) {
  gg_named_sync(barId, 128);
  if ((warp & 3) != 0 || wr0 >= rowEnd) return;
  int before = 0;
  if (lane == 0)
    asm volatile("atom.acq_rel.sys.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(fz.rowTiles + 2 * g + cw) : "memory");
  asm volatile("shfl.sync.idx.b32 %0, %0, 0, 0x1f, 0xffffffff;" : "+r"(before));
  if (before != nTN - 1) return;
  asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int r = wr0 + 32 * h + lane;
    if (r >= rowEnd || (MOE_TEST_LOST_ROWS && r == 0)) continue;
    const int s = fz.refs[2 * r], p = fz.refs[2 * r + 1];
    asm volatile("st.relaxed.sys.global.b32 [%0], %1;" ::"l"((int*)fz.done[s] + p), "r"(1) : "memory");
  }
}

// gg_body reaches the steps above through gg_fused_steps (grouped_gemm.cuh
// says why): each member forwards to its step, inlined.
template <gg_fusion FUSE>
struct gg_fused_steps {
  template <bool FIRST, bool SRC_BF16>
  static __device__ __forceinline__ void gather(const gg_fuse& fz, int cw, int ncw, int lane, int K, int E,
                                                const int* sBeg, const int* sEnd, const int* sCum,
                                                const volatile int* front) {
    gg_gather<FIRST, SRC_BF16>(fz, cw, ncw, lane, K, E, sBeg, sEnd, sCum, front);
  }
  static __device__ __forceinline__ void wait_tile(const gg_fuse& fz, int g, int row0, int rowEnd, int kind) {
    gg_wait_tile(fz, g, row0, rowEnd, kind);
  }
  static __device__ __forceinline__ void act_helper(const gg_fuse& fz, int cw, int lane, unsigned stg,
                                                    unsigned staged, unsigned freed, unsigned short* h1, int rows,
                                                    int N, int total, int nTN, int E, const int* sBeg,
                                                    const int* sEnd, const int* sCum) {
    gg_act_helper(fz, cw, lane, stg, staged, freed, h1, rows, N, total, nTN, E, sBeg, sEnd, sCum);
  }
  static __device__ __forceinline__ void stage_h13(const float (&acc)[128], unsigned stg, unsigned staged,
                                                   unsigned freed, int wtid, int warp, int lane, int id, unsigned& c) {
    gg_stage_h13(acc, stg, staged, freed, wtid, warp, lane, id, c);
  }
  static __device__ __forceinline__ void dswiglu_load(const gg_fuse& fz, unsigned slot, unsigned bar, int row0,
                                                      int n0, int b) {
    gg_dswiglu_load(fz, slot, bar, row0, n0, b);
  }
  static __device__ __forceinline__ void epilogue_dswiglu_tma(const float (&acc)[128], const gg_fuse& fz,
                                                              unsigned stg, unsigned ebar, int wtid, int warp,
                                                              int lane, int row0, int n0, int N, int id, unsigned& c) {
    gg_epilogue_dswiglu_tma(acc, fz, stg, ebar, wtid, warp, lane, row0, n0, N, id, c);
  }
  static __device__ __forceinline__ void epilogue_dswiglu(const float (&acc)[128], long long r0, int rowEnd, int n0,
                                                          int N, int lane, unsigned short* dh1, const gg_fuse& fz) {
    gg_epilogue_dswiglu(acc, r0, rowEnd, n0, N, lane, dh1, fz);
  }
  static __device__ __forceinline__ void epilogue_rows(const float (&acc)[128], long long r0, int rowEnd, int c0,
                                                       int N, const gg_fuse& fz) {
    gg_epilogue_rows(acc, r0, rowEnd, c0, N, fz);
  }
  static __device__ __forceinline__ void mark_rows(const gg_fuse& fz, int g, int cw, int wr0, int rowEnd, int nTN,
                                                   int warp, int lane, int barId) {
    gg_mark_rows(fz, g, cw, wr0, rowEnd, nTN, warp, lane, barId);
  }
  static __device__ __forceinline__ void epilogue_scatter(const float (&acc)[128], long long r0, int rowEnd, int c0,
                                                          int N, const gg_fuse& fz) {
    gg_epilogue_scatter(acc, r0, rowEnd, c0, N, fz);
  }
};

// ---- The kernels ----
//
// gg_body with a fusion kind; bn256 cooperative.
// moe_dispatch_swiglu (GG_DISPATCH_SWIGLU, 3 stages, the act helper's
// TMA-store epilogue): mapA is xRD's
// {K, rows} map (written by the kernel itself before it is read), mapW and
// mapW3 are W1's and W3's {K, N, E} maps with boxes of 128 rows; mapH1,
// mapH3 and mapAct the outputs' {N, rows} maps (64x64 boxes); h1, h3, act
// are bf16 [rows, N]; refs [rows, 2]; ptrs/toks per rank; flags one int
// per m-tile (at least rows/128 + E), zeroed; fault [4] zeroed, written
// by a tile wait that passed timeoutNs (see gg_wait_tile).
// moe_down_combine (GG_DOWN_COMBINE): mapA is act's map, mapW W2's (boxes of 256 rows); ptrs
// per rank its float32 [*, N] output rows (4 stages, register epilogue);
// done per rank its int32 row flags (or null: no flags) and rowTiles two
// zeroed ints per m-tile (at least 2 * (rows/128 + E); see gg_mark_rows).
// moe_dispatch_swiglu_bf16 is moe_dispatch_swiglu for bf16 sources (ptrs
// per rank its bf16 rows [*, K]: the layer's operand-type copy of its
// input): half the bytes to read, the same rows written to xRD.
#define GG_SWIGLU_PARAMS                                                                                              \
  const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, const __grid_constant__ gg_tmap mapW3, \
      const __grid_constant__ gg_tmap mapH1, const __grid_constant__ gg_tmap mapH3,                                  \
      const __grid_constant__ gg_tmap mapAct, unsigned short *h1, unsigned short *h3, unsigned short *act,           \
      unsigned short *xRD, const int *refs, const unsigned long long *ptrs, const unsigned long long *toks,          \
      int *flags, int *fault, unsigned long long timeoutNs, const int *off, int rows, int N, int K, int E
#define GG_SWIGLU_ARGS                                                                                              \
  mapA, mapW, mapW3, mapH1, mapH3, mapAct, h1, h3, act, xRD, refs, ptrs, toks, flags, fault, timeoutNs, off, rows, N, \
      K, E

template <bool SRC_BF16>
__device__ __forceinline__ void moe_dispatch_swiglu_body(
    const gg_tmap& mapA, const gg_tmap& mapW, const gg_tmap& mapW3, const gg_tmap& mapH1, const gg_tmap& mapH3,
    const gg_tmap& mapAct, unsigned short* h1, unsigned short* h3, unsigned short* act, unsigned short* xRD,
    const int* refs, const unsigned long long* ptrs, const unsigned long long* toks, int* flags, int* fault,
    unsigned long long timeoutNs, const int* off, int rows, int N, int K, int E) {
  gg_fuse fz = {};
  fz.fault = fault;
  fz.timeoutNs = timeoutNs;
  fz.mapW3 = &mapW3;
  fz.mapOut[0] = &mapH1;
  fz.mapOut[1] = &mapH3;
  fz.mapOut[2] = &mapAct;
  fz.h3 = h3;
  fz.act = act;
  fz.xRD = xRD;
  fz.refs = refs;
  fz.ptrs = ptrs;
  fz.toks = toks;
  fz.flags = flags;
  gg_body<256, 3, true, false, false, GG_DISPATCH_SWIGLU, false, SRC_BF16>(&mapA, &mapW, nullptr, h1, off, rows, N, K,
                                                                           E, 1.0f, 0.0f, fz);
}

extern "C" __global__ void __launch_bounds__(384, 1) moe_dispatch_swiglu(GG_SWIGLU_PARAMS) {
  moe_dispatch_swiglu_body<false>(GG_SWIGLU_ARGS);
}

extern "C" __global__ void __launch_bounds__(384, 1) moe_dispatch_swiglu_bf16(GG_SWIGLU_PARAMS) {
  moe_dispatch_swiglu_body<true>(GG_SWIGLU_ARGS);
}

// moe_dispatch_dgrad (GG_DISPATCH_DGRAD, 3 stages, TMA loads and stores in the
// epilogue): mapA is dy's {K, rows} map (written by the kernel itself
// before it is read; K = D), mapW W2's {N, K, E} map (W2 as stored,
// [E, D, F]; boxes of 64 columns x 64 rows; N = F); dh1, dh3 out and h1, h3 in are bf16 [rows, N], each also given
// as a {N, rows} map with 64x64 boxes (mapDh1, mapDh3, mapH1, mapH3);
// scales per rank its float32 gates in send order; flags and fault as
// moe_dispatch_swiglu's. Dynamic shared memory as moe_dispatch_swiglu's
// plus 32 bytes (the slots' barriers).
// moe_dispatch_dgrad_first is moe_dispatch_dgrad with the rows gathered
// first, by every warp but the TMA thread's (as moe_dispatch_swiglu
// gathers), instead of by three warps beside the products. Same arguments,
// same results bit for bit; which is faster depends on the shape
// (kernels/grouped_gemm.md), so backend/cuda times both and keeps the
// faster per shape.
#define GG_DGRAD_PARAMS                                                                                               \
  const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, const __grid_constant__ gg_tmap mapDh1, \
      const __grid_constant__ gg_tmap mapDh3, const __grid_constant__ gg_tmap mapH1,                                  \
      const __grid_constant__ gg_tmap mapH3, unsigned short *dh1, unsigned short *dh3, const unsigned short *h1,     \
      const unsigned short *h3, unsigned short *dy, const int *refs, const unsigned long long *ptrs,                 \
      const unsigned long long *toks, const unsigned long long *scales, int *flags, int *fault,                      \
      unsigned long long timeoutNs, const int *off, int rows, int N, int K, int E
#define GG_DGRAD_ARGS                                                                                          \
  mapA, mapW, mapDh1, mapDh3, mapH1, mapH3, dh1, dh3, h1, h3, dy, refs, ptrs, toks, scales, flags, fault, timeoutNs, \
      off, rows, N, K, E

template <bool GATHER_FIRST>
__device__ __forceinline__ void moe_dispatch_dgrad_body(
    const gg_tmap& mapA, const gg_tmap& mapW, const gg_tmap& mapDh1, const gg_tmap& mapDh3, const gg_tmap& mapH1,
    const gg_tmap& mapH3, unsigned short* dh1, unsigned short* dh3, const unsigned short* h1, const unsigned short* h3,
    unsigned short* dy, const int* refs, const unsigned long long* ptrs, const unsigned long long* toks,
    const unsigned long long* scales, int* flags, int* fault, unsigned long long timeoutNs, const int* off, int rows,
    int N, int K, int E) {
  gg_fuse fz = {};
  fz.mapOut[0] = &mapDh1;
  fz.mapOut[1] = &mapDh3;
  fz.mapOut[2] = &mapH1;
  fz.mapOut[3] = &mapH3;
  fz.h3 = dh3;
  fz.h1In = h1;
  fz.h3In = h3;
  fz.xRD = dy;
  fz.refs = refs;
  fz.ptrs = ptrs;
  fz.toks = toks;
  fz.scales = scales;
  fz.flags = flags;
  fz.fault = fault;
  fz.timeoutNs = timeoutNs;
  gg_body<256, 3, true, false, false, GG_DISPATCH_DGRAD, GATHER_FIRST>(&mapA, &mapW, nullptr, dh1, off, rows, N, K, E,
                                                                       1.0f, 0.0f, fz);
}

extern "C" __global__ void __launch_bounds__(384, 1) moe_dispatch_dgrad(GG_DGRAD_PARAMS) {
  moe_dispatch_dgrad_body<false>(GG_DGRAD_ARGS);
}

extern "C" __global__ void __launch_bounds__(384, 1) moe_dispatch_dgrad_first(GG_DGRAD_PARAMS) {
  moe_dispatch_dgrad_body<true>(GG_DGRAD_ARGS);
}

// moe_dgrad_combine (GG_DGRAD_COMBINE, 4 stages): dx = dh1.W1 + dh3.W3 per expert,
// rows to their source ranks as moe_down_combine; mapA and mapA2 are dh1's
// and dh3's {K, rows} maps (K = F), mapW and mapW3 W1's and W3's
// {N, K, E} maps (as stored, [E, F, D]; boxes of 64 columns x 64 rows;
// N = D); done and rowTiles as
// moe_down_combine's.
extern "C" __global__ void __launch_bounds__(384, 1) moe_dgrad_combine(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapA2, const __grid_constant__ gg_tmap mapW,
    const __grid_constant__ gg_tmap mapW3, const int* refs, const unsigned long long* ptrs,
    const unsigned long long* done, int* rowTiles, const int* off, int rows, int N, int K, int E) {
  gg_fuse fz = {};
  fz.mapA2 = &mapA2;
  fz.mapW3 = &mapW3;
  fz.refs = refs;
  fz.ptrs = ptrs;
  fz.done = done;
  fz.rowTiles = rowTiles;
  gg_body<256, 4, false, false, false, GG_DGRAD_COMBINE>(&mapA, &mapW, nullptr, nullptr, off, rows, N, K, E, 1.0f, 0.0f,
                                                         fz);
}


template <bool ROWS_BF16>
__device__ __forceinline__ void moe_down_combine_body(const gg_tmap& mapA, const gg_tmap& mapW, const int* refs,
                                                      const unsigned long long* ptrs, const unsigned long long* done,
                                                      int* rowTiles, const int* off, int rows, int N, int K, int E) {
  gg_fuse fz = {};
  fz.refs = refs;
  fz.ptrs = ptrs;
  fz.done = done;
  fz.rowTiles = rowTiles;
  fz.rowsBF16 = ROWS_BF16;
  gg_body<256, 4, false, false, false, GG_DOWN_COMBINE>(&mapA, &mapW, nullptr, nullptr, off, rows, N, K, E, 1.0f, 0.0f,
                                                        fz);
}

extern "C" __global__ void __launch_bounds__(384, 1) moe_down_combine(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, const int* refs,
    const unsigned long long* ptrs, const unsigned long long* done, int* rowTiles, const int* off, int rows, int N,
    int K, int E) {
  moe_down_combine_body<false>(mapA, mapW, refs, ptrs, done, rowTiles, off, rows, N, K, E);
}

// moe_down_combine_bf16 is moe_down_combine into bf16 output rows (the MoE
// layer's expert outputs y, half the bytes to write and to read back).
extern "C" __global__ void __launch_bounds__(384, 1) moe_down_combine_bf16(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, const int* refs,
    const unsigned long long* ptrs, const unsigned long long* done, int* rowTiles, const int* off, int rows, int N,
    int K, int E) {
  moe_down_combine_body<true>(mapA, mapW, refs, ptrs, done, rowTiles, off, rows, N, K, E);
}

// ---- tensor parallelism ----
//
// tp_gather_nt and tp_gather_nn (GG_TP_GATHER, 3 stages, float32 out by
// TMA stores through two 32 KiB staging buffers: gg_epilogue_tma_f32):
// AllGather+GEMM. The rows of x, W ranks' blocks
// of blockRows rows each (ptrs: per rank its float32 [blockRows, K]
// block), are gathered beside the products by three warps a block
// (gg_gather, paced), rounded to bf16 into xRD ([rows, K], mapA's tensor)
// and, when xFull is not null, kept as float32 in xFull; out [rows, N]
// float32 = x.W^T (nt: W [N, K], mapW {K, N, 1}, boxes of 256 rows) or
// x.W (nn: W [K, N] as stored, mapW {N, K, 1}, boxes of 64x64). The walk
// over m-tiles, and the gather with it, starts at m-tile rotM (this
// rank's own block) and wraps, so each rank reads its own rows first and
// the peers' in rank order after it. mapO is out's {N, rows} float32 map
// (boxes of 32 x 64, 128-byte swizzle). flags and fault as
// moe_dispatch_swiglu's.
//
// tp_scatter_nt and tp_scatter_nn (GG_TP_SCATTER, 3 stages): GEMM +
// ReduceScatter. p = A.W^T (or A.W) for A [rows, K] bf16 (mapA); row r of
// p lands in ptrs[r / blockRows] (the owner's float32 [*, N] buffer) at
// row slotRow0 + r % blockRows, stored, added, or added atomically (landing,
// GG_SCATTER_*). With ownerMaps (per owner its float32 {N, rows} map in
// global memory, 128 bytes each; blockRows a multiple of 64) a block
// leaves through shared memory by a TMA store (GG_SCATTER_STORE) or a TMA
// reduction (the adds, atomic per element at L2), under the next tile's
// mainloop; without, by the register epilogue (gg_epilogue_scatter). The walk starts at m-tile rotM (the host passes the
// first m-tile of the next rank's block), so at any moment the ranks'
// kernels write to different owners.
//
// All four run on clusters of two blocks (cuLaunchKernelEx), the weight
// tile multicast to both (gg_body's "Clusters"): mapW's boxes are 128
// rows (nt) or 64x64 (nn), the grid whole clusters, all resident at once
// (backend/cuda/tp_fused.go). On one H100 at the Llama-70B-like layer's tp
// 8 (TestTPFusedFigures, 742295e, each build twice) the gather took 7.56
// and 7.58 ms a rank on clusters against 8.38 and 8.25 on single blocks,
// the scatter was level (kernels/grouped_gemm.md).
#define TP_GATHER_PARAMS                                                                                        \
  const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, const __grid_constant__ gg_tmap mapO, \
      float *out, unsigned short *xRD,                                                                           \
      float *xFull, const unsigned long long *ptrs, int *flags, int *fault, unsigned long long timeoutNs,       \
      const int *off, int rows, int N, int K, int blockRows, int rotM, int groupM
#define TP_GATHER_ARGS \
  mapA, mapW, mapO, out, xRD, xFull, ptrs, flags, fault, timeoutNs, off, rows, N, K, blockRows, rotM, groupM

template <bool MNB>
__device__ __forceinline__ void tp_gather_body(const gg_tmap& mapA, const gg_tmap& mapW, const gg_tmap& mapO, float* out,
                                               unsigned short* xRD, float* xFull, const unsigned long long* ptrs,
                                               int* flags, int* fault, unsigned long long timeoutNs, const int* off,
                                               int rows, int N, int K, int blockRows, int rotM, int groupM) {
  gg_fuse fz = {};
  fz.groupM = groupM;
  fz.xRD = xRD;
  fz.xFull = xFull;
  fz.ptrs = ptrs;
  fz.flags = flags;
  fz.fault = fault;
  fz.timeoutNs = timeoutNs;
  fz.blockRows = blockRows;
  fz.rotM = rotM;
  gg_body<256, 3, false, false, false, GG_TP_GATHER, false, false, MNB, 2>(&mapA, &mapW, &mapO, out, off, rows, N, K,
                                                                           1, 1.0f, 0.0f, fz);
}

extern "C" __global__ void __launch_bounds__(384, 1) tp_gather_nt(TP_GATHER_PARAMS) {
  tp_gather_body<false>(TP_GATHER_ARGS);
}

extern "C" __global__ void __launch_bounds__(384, 1) tp_gather_nn(TP_GATHER_PARAMS) {
  tp_gather_body<true>(TP_GATHER_ARGS);
}

#define TP_SCATTER_PARAMS                                                                                       \
  const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, const unsigned long long *ptrs, \
      const unsigned char *ownerMaps, const int *off, int rows, int N, int K, int blockRows, int slotRow0, int rotM, \
      int groupM, int landing
#define TP_SCATTER_ARGS mapA, mapW, ptrs, ownerMaps, off, rows, N, K, blockRows, slotRow0, rotM, groupM, landing

template <bool MNB>
__device__ __forceinline__ void tp_scatter_body(const gg_tmap& mapA, const gg_tmap& mapW,
                                                const unsigned long long* ptrs, const unsigned char* ownerMaps,
                                                const int* off, int rows, int N, int K, int blockRows, int slotRow0,
                                                int rotM, int groupM, int landing) {
  gg_fuse fz = {};
  fz.groupM = groupM;
  fz.ptrs = ptrs;
  fz.ownerMaps = ownerMaps;
  fz.blockRows = blockRows;
  fz.slotRow0 = slotRow0;
  fz.rotM = rotM;
  fz.scatterMode = landing;
  gg_body<256, 3, false, false, false, GG_TP_SCATTER, false, false, MNB, 2>(&mapA, &mapW, nullptr, nullptr, off, rows,
                                                                            N, K, 1, 1.0f, 0.0f, fz);
}

extern "C" __global__ void __launch_bounds__(384, 1) tp_scatter_nt(TP_SCATTER_PARAMS) {
  tp_scatter_body<false>(TP_SCATTER_ARGS);
}

extern "C" __global__ void __launch_bounds__(384, 1) tp_scatter_nn(TP_SCATTER_PARAMS) {
  tp_scatter_body<true>(TP_SCATTER_ARGS);
}
