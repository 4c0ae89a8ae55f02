// The grouped GEMM pipeline on Hopper (sm_90a), shared by the grouped
// products (grouped_gemm.cu) and the fused MoE kernels (moe_fused.cu).
// For every expert e,
//
//   out[r, :N] = alpha * A[r, :K] . W[e, :N, :K]^T + beta * out[r, :N]
//   for r in [off[e], off[e+1])
//
// A [rows, K] and W [E, N, K] are bfloat16, row-major, both K-contiguous
// ("NT"); out [rows, N] is float32 or bfloat16; accumulation is float32.
// off (E+1 int32, prefix sums of the per-expert row counts) is read here,
// in device memory: the host never learns the counts. beta == 0 never
// reads out (it may hold NaN); rows no expert owns are not written.
//
// Work split. A persistent grid (one CTA per SM, at most) walks a tile list
// over (expert, m-tile of 128 rows, n-tile of BN columns), m-tile major
// (gg_tile). Each CTA first turns off into the expert's m-tile prefix sums
// in shared memory (one warp, shuffle scan), then maps a global m-tile to
// its expert by binary search. Empty experts own no m-tile. The tile list
// is mirrored in Go (backend/cuda/grouped_gemm.go, ggTileOf) and tested
// there.
//
// A CTA has three warpgroups (384 threads). Warpgroup 0 is the producer:
// one thread issues the TMA loads (cp.async.bulk.tensor) of a 128x64 A
// tile and a BNx64 W tile per stage into a ring of STAGES shared-memory
// stages, each completing on its "full" mbarrier (expect_tx of the whole
// stage: TMA counts the zero-filled out-of-bounds part of a box too).
// Warpgroups 1 and 2 are the consumers: each owns 64 rows of the 128-row
// tile and all BN columns, runs wgmma.m64nBNk16 (4 per 64-wide k-block)
// from shared-memory descriptors into float32 registers, and frees a stage
// (its "empty" mbarrier, one arrival per consumer warp) once the wgmmas
// that read it have completed (wgmma.wait_group 1: the k-block before the
// current one). __launch_bounds__(384) caps every thread at 168
// registers, which holds the consumers' BN/2 accumulators (128 for BN
// 256); REG kernels add setmaxnreg under (384, 1): the producer
// warpgroup drops to 40 registers, the consumers rise to 232.
//
// Epilogue. The default one stores registers straight to global memory
// (masked), with the tensor cores idle meanwhile. TMA_STORE (BN 256, bf16
// out) instead writes a warpgroup's 64x256 block to a shared-memory
// staging buffer in TMA's swizzled box layout and lets one thread queue
// TMA stores (cp.async.bulk.tensor, bulk_group) that run under the next
// tile's mainloop; the buffer is reused only after
// cp.async.bulk.wait_group.read. Blocks with rows of the next expert, and
// beta != 0, keep the register path (gg_epilogue_tma).
//
// Fusion. A fused MoE kernel is this pipeline with one of the gg_fusion
// kinds: its gather, extra operands and epilogue are steps defined in
// moe_fused.cu (declared below); the plain products never reach them.
//
// Every mbarrier wait is bounded (GG_TIMEOUT_NS, hopper.cuh): a pipeline
// bug traps and surfaces as a launch error at the host's next Sync, not a
// hang.
//
// Bounds. K and N tails, and A rows past `rows`, come from TMA's
// out-of-bounds zero fill (W is a 3-D map {K, N, E}, so a tile past N
// never reads the next expert). A tile of expert e may load rows of expert
// e+1 (A is one 2-D map); those rows' results are dropped by the store
// mask row < off[e+1]. Columns >= N are masked too.
//
// Shared layout (128-byte swizzle). TMA writes a box {64 bf16, R rows} as
// R rows of 128 bytes whose 16-byte chunks are XOR-ed with (row & 7); the
// wgmma descriptor for such a K-major tile is: start address >> 4, leading
// byte offset 1 (unused for swizzled K-major), stride byte offset 1024 (8
// rows of 128 B) >> 4, layout 1 (128B swizzle) in bits 62-63. Each k16 step
// inside the 64-wide k-block advances the start address by 32 bytes; the
// hardware applies the XOR on absolute address bits, which is why every
// tile starts 1024-byte aligned.
//
// Accumulator layout (wgmma m64nN, f32): thread t of the warpgroup, warp
// w = t/32, lane l: d[4i+0..1] hold row 16w + l/4, columns 8i + 2(l%4) +
// {0,1}; d[4i+2..3] the same columns of row 16w + l/4 + 8.

#include "hopper.cuh"

#define GG_BM 128
#define GG_BK 64
#define GG_THREADS 384
// Most experts the in-kernel schedule holds (shared memory: 12 bytes each).
#define GG_MAX_EXPERTS 1024

extern __shared__ __attribute__((aligned(1024))) unsigned char gg_smem[];

// ---- epilogues ----

// gg_store writes alpha*(a, b) + beta*old to the two neighbouring elements
// at out + i (i even, so the pair is 8- or 4-byte aligned). beta == 0
// never reads out.
template <bool OUT_BF16>
__device__ __forceinline__ void gg_store(void* out, long long i, float a, float b, float alpha, float beta) {
  a *= alpha;
  b *= alpha;
  if (OUT_BF16) {
    unsigned short* p = (unsigned short*)out + i;
    if (beta != 0.0f) {
      unsigned old;
      asm volatile("ld.global.b32 %0, [%1];" : "=r"(old) : "l"(p));
      a += beta * __uint_as_float(old << 16);
      b += beta * __uint_as_float(old & 0xffff0000u);
    }
    asm volatile("st.global.b32 [%0], %1;" ::"l"(p), "r"(gg_pack_bf16(a, b)) : "memory");
  } else {
    float* p = (float*)out + i;
    if (beta != 0.0f) {
      float o0, o1;
      asm volatile("ld.global.v2.f32 {%0, %1}, [%2];" : "=f"(o0), "=f"(o1) : "l"(p));
      a += beta * o0;
      b += beta * o1;
    }
    asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
  }
}

// gg_epilogue64 stores one warpgroup's 64-row accumulator block: this
// thread's rows r0 and r0+8 (kept when below rowEnd), columns c0 + 8i and
// c0 + 8i + 1 (kept when below N).
template <bool OUT_BF16, int R>
__device__ __forceinline__ void gg_epilogue64(const float (&acc)[R], long long r0, int rowEnd, int c0, int N, void* out,
                                              float alpha, float beta) {
  const long long r1 = r0 + 8;
  const bool ok0 = r0 < rowEnd, ok1 = r1 < rowEnd;
#pragma unroll
  for (int i = 0; i < R / 4; i++) {
    const int col = c0 + 8 * i;
    if (col < N) {
      if (ok0) gg_store<OUT_BF16>(out, r0 * N + col, acc[4 * i], acc[4 * i + 1], alpha, beta);
      if (ok1) gg_store<OUT_BF16>(out, r1 * N + col, acc[4 * i + 2], acc[4 * i + 3], alpha, beta);
    }
  }
}

// gg_epilogue_tma stores one consumer warpgroup's 64x256 accumulator block
// (alpha applied, bf16) through shared memory with TMA stores, so the
// warpgroup goes back to the tensor cores while the copy engine writes
// global memory. The block is four boxes of 64 columns x 64 rows (128-byte
// rows, 128-byte swizzle: the 16-byte chunk c of row r sits at chunk
// c ^ (r & 7), which also makes the writes below conflict-free: the 8 rows
// a warp writes per step land in 8 different chunks). NPASS 1 stages all
// four boxes (32 KiB per warpgroup); NPASS 2 stages two at a time in 16 KiB
// and waits for the first pair to be read before writing the second.
// stg is this warpgroup's staging buffer (1024-byte aligned); wtid the
// thread's index in the warpgroup; barrier id is the warpgroup's own. The
// previous tile's stores from stg may still be reading it: thread 0, which
// issued them, waits for that before the warpgroup overwrites it. Boxes
// past N are skipped; the N tail of a box and rows past the tensor are
// clipped by TMA. Callers guarantee every row of the block that is inside

// gg_epilogue_tma stores one consumer warpgroup's 64x256 accumulator block
// (alpha applied, bf16) through shared memory with TMA stores, so the
// warpgroup goes back to the tensor cores while the copy engine writes
// global memory. The block is four boxes of 64 columns x 64 rows (128-byte
// rows, 128-byte swizzle: the 16-byte chunk c of row r sits at chunk
// c ^ (r & 7), which also makes the writes below conflict-free: the 8 rows
// a warp writes per step land in 8 different chunks), staged whole (32 KiB
// per warpgroup). stg is this warpgroup's staging buffer (1024-byte
// aligned); wtid the thread's index in the warpgroup; barrier id is the
// warpgroup's own. The previous tile's stores from stg may still be
// reading it: thread 0, which issued them, waits for that before the
// warpgroup overwrites it. Boxes past N are skipped; the N tail of a box
// and rows past the tensor are clipped by TMA. Callers guarantee every row
// of the block that is inside the tensor belongs to the tile's expert.
__device__ __forceinline__ void gg_epilogue_tma(const float (&acc)[128], const gg_tmap* mapO, unsigned stg, int wtid,
                                                int warp, int lane, int row0, int n0, int N, float alpha, int id) {
  const int rl = (warp & 3) * 16 + (lane >> 2);
  const unsigned rowA = stg + rl * 128, rowB = rowA + 8 * 128;
  const int sw = lane >> 2;  // rl & 7, and (rl + 8) & 7
  if (wtid == 0) gg_bulk_wait_read();
  gg_named_sync(id, 128);
#pragma unroll
  for (int i = 0; i < 32; i++) {  // 8-column group of the 256
    const unsigned o = (i >> 3) * 8192 + ((((i & 7) ^ sw) << 4) | ((lane & 3) << 2));
    const unsigned lo = gg_pack_bf16(alpha * acc[4 * i], alpha * acc[4 * i + 1]);
    const unsigned hi = gg_pack_bf16(alpha * acc[4 * i + 2], alpha * acc[4 * i + 3]);
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(rowA + o), "r"(lo) : "memory");
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(rowB + o), "r"(hi) : "memory");
  }
  // Generic-proxy writes, async-proxy reader: each writer fences its own
  // writes, then the barrier orders them before thread 0's stores.
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  gg_named_sync(id, 128);
  if (wtid == 0) {
#pragma unroll
    for (int b = 0; b < 4; b++) {
      const int c = n0 + b * 64;
      if (c < N) gg_tma_store_2d(mapO, c, row0, stg + b * 8192);
    }
    gg_bulk_commit();
  }
}

// gg_epilogue_tma_f32 is gg_epilogue_tma for a float32 out (no alpha):
// the warpgroup's 64x256 block is eight boxes of 32 columns x 64 rows
// (128-byte rows, 128-byte swizzle), staged four at a time in 32 KiB, two
// passes; before each pass thread 0 waits for the previous stores to have
// read the buffer. A thread's column pair (8 bytes) of column group i
// sits in 16-byte chunk 2(i % 4) + (lane % 4) / 2 of its box row, at byte
// 8 (lane % 2) in it. reduce adds the boxes into mapO's tensor
// (gg_tma_reduce_add_2d) instead of storing them; row0 is the block's
// row in mapO's tensor.
__device__ __forceinline__ void gg_epilogue_tma_f32(const float (&acc)[128], const gg_tmap* mapO, unsigned stg,
                                                    int wtid, int warp, int lane, int row0, int n0, int N, int id,
                                                    bool reduce = false) {
  const int rl = (warp & 3) * 16 + (lane >> 2);
  const unsigned rowA = stg + rl * 128, rowB = rowA + 8 * 128;
  const int sw = lane >> 2;  // rl & 7, and (rl + 8) & 7
  const unsigned within = (unsigned)(lane & 1) << 3;
#pragma unroll
  for (int pass = 0; pass < 2; pass++) {
    if (wtid == 0) gg_bulk_wait_read();
    gg_named_sync(id, 128);
#pragma unroll
    for (int j = 0; j < 16; j++) {  // column groups 16 pass + j
      const int i = 16 * pass + j;
      const int c = (j & 3) * 2 + ((lane & 3) >> 1);
      const unsigned o = (j >> 2) * 8192 + ((unsigned)(c ^ sw) << 4 | within);
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(rowA + o), "f"(acc[4 * i]), "f"(acc[4 * i + 1]) : "memory");
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(rowB + o), "f"(acc[4 * i + 2]), "f"(acc[4 * i + 3])
                   : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    gg_named_sync(id, 128);
    if (wtid == 0) {
#pragma unroll
      for (int b = 0; b < 4; b++) {
        const int c = n0 + (4 * pass + b) * 32;
        if (c >= N) continue;
        if (reduce) gg_tma_reduce_add_2d(mapO, c, row0, stg + b * 8192);
        else gg_tma_store_2d(mapO, c, row0, stg + b * 8192);
      }
      gg_bulk_commit();
    }
  }
}

// ---- the schedule ----

// gg_tile decodes tile t of the schedule: the M = cum[E] global m-tiles
// in order, each over its nTN n-tiles (tile t is m-tile t / nTN, n-tile
// t % nTN). The expert is the largest e with cum[e] <= g (empty experts
// have cum[e] == cum[e+1], so they are never picked for a g they do not
// own). Mirrored by ggTileOf in Go.
struct gg_tile_t {
  int e, row0, rowEnd, n0, g;  // g: the global m-tile index
};

template <int BN>
__device__ __forceinline__ gg_tile_t gg_tile(int t, int nTN, int E, const int* sBeg, const int* sEnd,
                                             const int* sCum) {
  const int g = t / nTN, nt = t - g * nTN;
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (sCum[mid] <= g) lo = mid;
    else hi = mid - 1;
  }
  gg_tile_t r;
  r.e = lo;
  r.row0 = sBeg[lo] + (g - sCum[lo]) * GG_BM;
  r.rowEnd = sEnd[lo];
  r.n0 = nt * BN;
  r.g = g;
  return r;
}

// gg_rotate is walk position t of n moved on by by (0 <= by < n, so one
// subtraction wraps it): the tensor-parallel kinds start at their own
// rank's block.
__device__ __forceinline__ int gg_rotate(int t, int by, int n) {
  t += by;
  return t >= n ? t - n : t;
}

// The tensor-parallel kinds walk their tiles in groups of fz.groupM
// m-tiles, n-tile by n-tile (the host's choice, tpGroupM in
// backend/cuda/tp_fused.go): with groups of 16 a wave of 132 tiles reads
// the weight columns of ~8 n-tiles for 16 m-tiles instead of every
// n-tile's for ~9 m-tiles, so a weight larger than L2 (the
// Llama-70B-like layer's) is read from DRAM once per 16 m-tiles, not once
// per wave; groups of 1 are the m-tile-major walk, which a gather of
// narrow products keeps up with better (kernels/grouped_gemm.md).

// gg_tp_tile decodes walk position t of the tensor-parallel kinds (one
// group of rows, m = rows / 128 rounded up m-tiles, nTN n-tiles): in
// groups of G m-tiles, n-tile by n-tile, then the m-tile moved on by rotM
// (wrapping). walkG is the tile's m-tile along the walk before the
// rotation, the gather's pacing front.
//
// On clusters of two blocks (CLUSTER 2) a walk position is a pair of
// m-tiles of one n-tile, the block of cluster rank `rank` taking the
// pair's m-tile 2p + rank (walk order, before the rotation), in groups of
// G/2 pairs. The last pair of an odd m has no second m-tile: that block
// gets g = -1 and row0 past the rows, so it loads TMA's zero fill (its
// half of the weight still reaches its peer) and stores nothing. The
// clusters' walk is mirrored by tpTileOf in Go (backend/cuda/tp_fused.go)
// and tested there.
template <int BN, int CLUSTER = 1>
__device__ __forceinline__ gg_tile_t gg_tp_tile(int t, int nTN, int m, int G, int rotM, int rows, int rank,
                                                int& walkG) {
  const int units = (m + CLUSTER - 1) / CLUSTER, GU = gg_max(1, G / CLUSTER);
  const int group = t / (GU * nTN), first = group * GU;
  const int size = gg_min(GU, units - first), in = t - first * nTN;
  const int nt = in / size;
  walkG = (first + (in - nt * size)) * CLUSTER + rank;
  gg_tile_t r;
  r.e = 0;
  r.rowEnd = rows;
  r.n0 = nt * BN;
  if (CLUSTER == 1 || walkG < m) {
    r.g = gg_rotate(walkG, rotM, m);
    r.row0 = r.g * GG_BM;
  } else {
    r.g = -1;
    r.row0 = m * GG_BM;
  }
  return r;
}

// gg_block_tma reports whether a warpgroup's 64-row block from row wr0 of
// a tile whose expert ends at rowEnd goes through a TMA-store epilogue:
// every row of it that is inside the tensor (`rows`) is the expert's. A
// full block qualifies, and so does the tensor's last block (TMA clips
// past `rows`); other partial blocks, whose rows past rowEnd belong to
// the next expert, keep the register path (GG_DISPATCH_SWIGLU: the
// helper's plain stores, gg_act_rows). Uniform per warpgroup, as the
// named barriers need.
__device__ __forceinline__ bool gg_block_tma(int wr0, int rowEnd, int rows) {
  return wr0 < rowEnd && (wr0 + 64 <= rowEnd || rowEnd == rows);
}

// gg_block_staged reports whether GG_DISPATCH_SWIGLU's consumers stage a
// block for their helper warp (gg_stage_h13): every block with a row of
// the expert's. The helper stores the blocks gg_block_tma allows by TMA
// and the others' rows by plain stores (gg_act_rows), so the consumers'
// epilogue is the same short one for every block.
__device__ __forceinline__ bool gg_block_staged(int wr0, int rowEnd) { return wr0 < rowEnd; }

// ---- fusion ----

// gg_fusion is what a kernel fuses around the grouped product (moe_fused.cu
// describes each):
//   GG_PLAIN            the product alone (grouped_gemm.cu)
//   GG_DISPATCH_SWIGLU  gather the rows, h1 = x.W1^T and h3 = x.W3^T in one
//                       256-column tile, act = silu(h1) * h3
//   GG_DOWN_COMBINE     act.W2^T, each row written to its source rank
//   GG_DISPATCH_DGRAD   gather the output gradients, dAct = dy.W2, SwiGLU's
//                       backward to dh1 and dh3
//   GG_DGRAD_COMBINE    dh1.W1 + dh3.W3 (two K halves), each row written
//                       to its source rank
//   GG_TP_GATHER        tensor parallelism's AllGather+GEMM: gather the
//                       ranks' row blocks, x.op(W) with a plain epilogue
//   GG_TP_SCATTER       tensor parallelism's GEMM+ReduceScatter: A.op(W),
//                       each row block stored, added or atomically added
//                       into its owner rank's buffer
// The dispatches' numbers are also the first word of their fault record
// (gg_wait_tile), which backend/cuda/moe_fused.go reads.
enum gg_fusion {
  GG_PLAIN = 0,
  GG_DISPATCH_SWIGLU = 1,
  GG_DOWN_COMBINE = 2,
  GG_DISPATCH_DGRAD = 3,
  GG_DGRAD_COMBINE = 4,
  // 5 is CombineRows' fault record (peer_rows.cu).
  GG_TP_GATHER = 6,
  GG_TP_SCATTER = 7,
};

// gg_fuse holds a fused kernel's operands besides the product's own.
struct gg_fuse {
  const gg_tmap* mapW3;                // DISPATCH_SWIGLU: W3's map (as mapW); DGRAD_COMBINE: W3ᵀ's map (the second K half's B)
  const gg_tmap* mapA2;                // DGRAD_COMBINE: dh3's map (the second K half's A)
  const gg_tmap* mapOut[4];            // {N, rows} maps, 64x64 boxes, 128B swizzle: DISPATCH_SWIGLU: h1, h3, act;
                                       // DISPATCH_DGRAD: dh1, dh3 (out), h1, h3 (in)
  unsigned short* h3;                  // DISPATCH_SWIGLU: bf16 [rows, N]; DISPATCH_DGRAD: dh3, bf16 [rows, N]
  unsigned short* act;                 // DISPATCH_SWIGLU: bf16 [rows, N]
  const unsigned short* h1In;          // DISPATCH_DGRAD: the forward's h1, bf16 [rows, N]
  const unsigned short* h3In;          // DISPATCH_DGRAD: the forward's h3, bf16 [rows, N]
  unsigned short* xRD;                 // the dispatches: the gathered rows, bf16 [rows, K] (mapA's tensor)
  const int* refs;                     // [rows, 2]: (rank, position)
  const unsigned long long* ptrs;      // the dispatches: per rank, its float32 source rows [*, K];
                                       // the combines: its float32 (or rowsBF16: bf16) output rows [*, N]
  const unsigned long long* toks;      // the dispatches: per rank, its int32 send-order token indices
  const unsigned long long* scales;    // DISPATCH_DGRAD: per rank, its float32 send-order row scales (the gates)
  int* flags;                          // the dispatches: per m-tile bit set of landed chunks (zeroed by the host)
  int* fault;                          // the dispatches: [4] the first wait that timed out: kind, m-tile, chunks landed, source rank
  unsigned long long timeoutNs;        // the dispatches: bound of a tile wait
  const unsigned long long* done;      // the combines: per rank, its int32 row flags in send order (0: none)
  int* rowTiles;                       // the combines: [2 * m-tiles] column tiles stored per 64-row block (zeroed)
  int rowsBF16;                        // DOWN_COMBINE: the output rows are bf16 (each value rounded once), not float32
  // The tensor-parallel kinds (refs null: a row's rank and position are
  // arithmetic, row r is position r % blockRows of rank r / blockRows).
  float* xFull;                        // TP_GATHER: the gathered rows as float32 too, [rows, K] (null: not kept)
  int blockRows;                       // TP kinds: rows per rank's block
  int slotRow0;                        // TP_SCATTER: the owners' buffers' row where this rank's block lands
  int rotM;                            // TP kinds: the walk over m-tiles starts here (the rank's own block) and wraps
  int groupM;                          // TP kinds: m-tiles a group of the walk holds (gg_tp_tile), at least 1
  int scatterMode;                     // TP_SCATTER: GG_SCATTER_STORE, _ADD or _RED
  // TP_SCATTER: per owner rank its float32 {N, rows} map (128 bytes each,
  // in global memory; boxes of 32 x 64), or null: the register epilogue.
  // With maps the rows leave by TMA stores or reductions (blockRows a
  // multiple of 64, so no 64-row block straddles two owners).
  const unsigned char* ownerMaps;
};

// TP_SCATTER's ways to land a row in its owner's buffer: store it (the
// buffer is this rank's slot), add it (read, add, write: the rows are
// this rank's alone), or add it atomically (red.global.add: every rank
// adds into the same rows).
#define GG_SCATTER_STORE 0
#define GG_SCATTER_ADD 1
#define GG_SCATTER_RED 2

// GG_FRONT_DONE is a finished block's pacing front (the dispatches'
// sFront): past every m-tile, and far enough from INT_MAX that adding
// the gather's lead cannot overflow.
#define GG_FRONT_DONE (1 << 30)

// The fused kernels' steps are the static members of gg_fused_steps<FUSE>,
// which moe_fused.cu defines. gg_body calls them only in branches that the
// plain products' instantiations discard (if constexpr), and through the
// template parameter, so that they are looked up only where a fused kernel
// instantiates gg_body: grouped_gemm.cu compiles without them. (NVRTC
// refuses inline functions that are declared, referenced in a discarded
// branch and never defined; clang takes them.)
template <gg_fusion FUSE>
struct gg_fused_steps;


// ---- the kernel body ----

// gg_release_stage is a consumer warp's arrival on a stage's empty
// barrier: its block's, and on clusters of two its peer's too.
template <int CLUSTER>
__device__ __forceinline__ void gg_release_stage(unsigned empty, unsigned crank) {
  gg_bar_arrive(empty);
  if constexpr (CLUSTER > 1) gg_bar_arrive_peer(gg_peer_addr(empty, crank ^ 1u));
}

// gg_body is the whole kernel, for each kernel of grouped_gemm.cu and
// moe_fused.cu: BN 128 or 256 columns a
// tile, STAGES deep, bf16 or float32 out (OUT_BF16), setmaxnreg (REG),
// the TMA-store epilogue (TMA_STORE: BN 256, bf16 out; it stages the
// whole 128x256 tile, 64 KiB) and the fusion kind (FUSE: GG_PLAIN, or
// one of moe_fused.cu's, BN 256 holding for GG_DISPATCH_SWIGLU W1's and
// W3's 128 columns; out is h1 for it, dh1 for GG_DISPATCH_DGRAD, unused
// by the combines, whose rows go to fz.ptrs). GATHER_FIRST
// (GG_DISPATCH_DGRAD only; GG_DISPATCH_SWIGLU always does): the rows are
// gathered first, by every warp but the TMA thread's, not by three warps
// beside the products. SRC_BF16 (GG_DISPATCH_SWIGLU only): the gathered
// sources are bf16 rows, not float32. MNB (the tensor-parallel kinds
// only): W is read as stored, [K, N] (MN-major), as GG_DISPATCH_DGRAD
// reads W2, for the products x.W rather than x.W^T. CLUSTER (the
// tensor-parallel kinds only) 2: the kernel runs on clusters of two
// blocks (below).
//
// Clusters. The two blocks of a cluster take the two m-tiles of one
// n-tile (gg_tp_tile), so they read the same weight tile: each block's
// TMA thread loads its own A tile and half the weight tile (128 rows of
// mapW's boxes, which the host sizes so, or two of MNB's four 64-column
// boxes), multicast into both blocks' stage, and L2 hands a block 32 KiB
// a k-block instead of 48 (kernels/grouped_gemm.md). A stage's full
// barrier still expects the whole stage (half of it lands from the peer).
// A stage is free only when both blocks' consumers are done with it,
// since either block's TMA writes into both: its empty barrier counts 16
// arrivals, each consumer warp arriving on its own block's and its
// peer's. Both blocks walk the same pairs, so the counts match; before
// it exits, the TMA thread waits for the ring's last phases, the peer's
// arrivals among them, since none may land on a block that has exited.
template <int BN, int STAGES, bool OUT_BF16, bool REG, bool TMA_STORE, gg_fusion FUSE = GG_PLAIN,
          bool GATHER_FIRST = false, bool SRC_BF16 = false, bool MNB = false, int CLUSTER = 1>
__device__ __forceinline__ void gg_body(const gg_tmap* mapA, const gg_tmap* mapW, const gg_tmap* mapO, void* out,
                                        const int* off, int rows, int N, int K, int E, float alpha, float beta,
                                        const gg_fuse& fz = gg_fuse{}) {
  constexpr unsigned A_BYTES = GG_BM * GG_BK * 2;  // 16 KiB
  constexpr unsigned B_BYTES = BN * GG_BK * 2;     // 16 or 32 KiB
  constexpr unsigned STAGE_BYTES = A_BYTES + B_BYTES;
  constexpr int R = BN / 2;  // accumulator floats per consumer thread
  using steps = gg_fused_steps<FUSE>;  // the fused kernels' steps (moe_fused.cu)
  static_assert(!TMA_STORE || (BN == 256 && OUT_BF16), "the TMA-store epilogue is for bn256 with bf16 out");
  static_assert(FUSE == GG_PLAIN || (BN == 256 && !REG && !TMA_STORE), "the fused kernels are bn256 cooperative");
  // The dispatches gather their rows and wait for them; GG_DISPATCH_DGRAD
  // reads W2 as stored and the combines' second K half too.
  constexpr bool TP = FUSE == GG_TP_GATHER || FUSE == GG_TP_SCATTER;
  static_assert(!MNB || TP, "MNB is the tensor-parallel kinds'");
  static_assert(CLUSTER == 1 || (CLUSTER == 2 && TP), "clusters (of two) are the tensor-parallel kinds'");
  constexpr bool DISPATCH = FUSE == GG_DISPATCH_SWIGLU || FUSE == GG_DISPATCH_DGRAD || FUSE == GG_TP_GATHER;
  // The kinds with staging buffers and their barriers (the MoE
  // dispatches' epilogues).
  constexpr bool STAGED = FUSE == GG_DISPATCH_SWIGLU || FUSE == GG_DISPATCH_DGRAD;
  // Columns of N per tile: GG_DISPATCH_SWIGLU's 256-row B tile is 128
  // columns of W1 and the same 128 of W3.
  constexpr int BNT = FUSE == GG_DISPATCH_SWIGLU ? 128 : BN;
  // Staging for the TMA-store epilogue: per consumer warpgroup 64 rows x
  // 256 columns of bf16 (32 KiB).
  // GG_DISPATCH_SWIGLU stages h1 and h3 in two 16 KiB buffers per
  // consumer warpgroup, and its helper warp writes act over h1's
  // (gg_stage_h13, gg_act_helper), with a staged and a freed barrier per
  // warpgroup (XBARS).
  // GG_DISPATCH_DGRAD brings h1 and h3 in and sends dh1 and dh3 out
  // through two 16 KiB slots per consumer warpgroup
  // (gg_epilogue_dswiglu_tma), with one barrier per slot (XBARS).
  // The tensor-parallel kinds stage their float32 out in two passes of
  // 32 KiB per consumer warpgroup (gg_epilogue_tma_f32).
  constexpr bool TMA_F32 = TP;
  constexpr unsigned STG_BYTES = (TMA_STORE || STAGED || TMA_F32) ? 2u * 32768u : 0u;
  constexpr int XBARS = STAGED ? 4 : 0;

  // Tiles start 1024-byte aligned (the swizzle is on absolute address
  // bits); the host asks for 1 KiB of slack.
  const unsigned raw = gg_smem_addr(gg_smem);
  const unsigned base = (raw + 1023u) & ~1023u;
  // The stage ring, the staging buffers, then full[STAGES],
  // empty[STAGES] and XBARS more.
  const unsigned stgBase = base + STAGES * STAGE_BYTES;
  const unsigned bars = stgBase + STG_BYTES;
  // GG_DISPATCH_SWIGLU: staged[2] then freed[2] (per consumer warpgroup);
  // GG_DISPATCH_DGRAD: [consumer warpgroup][slot].
  const unsigned ebars = bars + 8 * (2 * STAGES);
  int* sBeg = (int*)(gg_smem + (bars - raw) + 16 * STAGES + 8 * XBARS);
  int* sEnd = sBeg + E;
  int* sCum = sEnd + E;  // E+1
  // The dispatches: the m-tile of the TMA thread's current tile
  // (GG_FRONT_DONE once it has issued its last), which paces
  // GG_DISPATCH_DGRAD's gather.
  volatile int* sFront = sCum + E + 1;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < STAGES; s++) {
      gg_bar_init(bars + 8 * s, 1);                       // full: the producer's expect_tx
      gg_bar_init(bars + 8 * (STAGES + s), 8 * CLUSTER);  // empty: one arrival per consumer warp of the cluster
    }
    // GG_DISPATCH_SWIGLU: one consumer thread's or the helper's arrival;
    // GG_DISPATCH_DGRAD: thread 0's expect_tx.
    for (int i = 0; i < XBARS; i++) gg_bar_init(ebars + 8 * i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  if (warp == 1) {
    // Per-expert row ranges (clamped to [0, rows]) and the prefix sums of
    // their m-tile counts, 32 experts per step of a shuffle scan.
    int carry = 0;
    for (int b = 0; b < E; b += 32) {
      const int e = b + lane;
      int tiles = 0;
      if (e < E) {
        const int lo = gg_min(gg_max(off[e], 0), rows);
        const int hi = gg_min(gg_max(off[e + 1], lo), rows);
        sBeg[e] = lo;
        sEnd[e] = hi;
        tiles = (hi - lo + GG_BM - 1) / GG_BM;
      }
      int v = tiles;
#pragma unroll
      for (int m = 1; m < 32; m <<= 1) {
        const int u = gg_shfl_up(v, m);
        if (lane >= m) v += u;
      }
      if (e < E) sCum[e + 1] = carry + v;
      carry += gg_shfl_idx(v, 31);
    }
    if (lane == 0) sCum[0] = 0;
    if (DISPATCH && lane == 0) *sFront = 0;
  }
  __syncthreads();
  // The cluster's barriers exist before any block's TMA or consumers
  // reach another block's.
  if constexpr (CLUSTER > 1) gg_cluster_sync();
  const unsigned crank = CLUSTER > 1 ? gg_cluster_rank() : 0u;
  // The walk: each cluster takes every clusters-th position.
  const int tFirst = CLUSTER > 1 ? (int)blockIdx.x / CLUSTER : (int)blockIdx.x;
  const int tStep = CLUSTER > 1 ? (int)gridDim.x / CLUSTER : (int)gridDim.x;

  // GG_DGRAD_COMBINE runs K's k-blocks twice: (A, W) then (A2, W3).
  const int nTN = (N + BNT - 1) / BNT, nK1 = (K + GG_BK - 1) / GG_BK, nK = FUSE == GG_DGRAD_COMBINE ? 2 * nK1 : nK1;
  const int total = (sCum[E] + CLUSTER - 1) / CLUSTER * nTN;
  // How the rows are gathered (gg_gather): first, by every warp but the
  // TMA thread's (GG_DISPATCH_SWIGLU; GG_DISPATCH_DGRAD when
  // GATHER_FIRST), or beside the products by the producer warpgroup's
  // warps 1-3 (GG_DISPATCH_DGRAD).
  static_assert(!GATHER_FIRST || FUSE == GG_DISPATCH_DGRAD, "GATHER_FIRST chooses GG_DISPATCH_DGRAD's gather");
  static_assert(!SRC_BF16 || FUSE == GG_DISPATCH_SWIGLU,
                "bf16 sources are GG_DISPATCH_SWIGLU's (GG_DISPATCH_DGRAD scales float32 rows)");
  constexpr bool FIRST = FUSE == GG_DISPATCH_SWIGLU || (FUSE == GG_DISPATCH_DGRAD && GATHER_FIRST);

  if (warp < 4) {
    // Producer warpgroup: one thread issues every load. REG: the whole
    // warpgroup first gives registers back (40 a thread) so the consumers
    // can take 232 each (128*40 + 256*232 <= 64K).
    if (REG) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
    if (tid != 0) {
      if constexpr (FIRST) {
        // Warps 1-3 here and the consumers' 8 share the gather (11 warps a
        // block), then do their own work: GG_DISPATCH_SWIGLU's warps 1
        // and 2 the act epilogue of consumer warpgroup warp - 1. Warp 0's
        // other lanes have none.
        if (warp > 0)
          steps::template gather<true, SRC_BF16>(fz, blockIdx.x * 11 + warp - 1, gridDim.x * 11, lane, K, E, sBeg, sEnd, sCum, sFront);
        if (FUSE == GG_DISPATCH_SWIGLU && (warp == 1 || warp == 2))
          steps::act_helper(fz, warp - 1, lane, stgBase + (warp - 1) * (STG_BYTES / 2), ebars + 8 * (warp - 1),
                        ebars + 8 * (warp + 1), (unsigned short*)out, rows, N, total, nTN, E, sBeg, sEnd, sCum);
      } else if constexpr (FUSE == GG_DISPATCH_DGRAD || FUSE == GG_TP_GATHER) {
        // The communication warps 1-3, beside the products.
        if (warp > 0)
          steps::template gather<false, false>(fz, blockIdx.x * 3 + warp - 1, gridDim.x * 3, lane, K, E, sBeg, sEnd, sCum, sFront);
      }
      return;
    }
    gg_prefetch_tmap(mapA);
    gg_prefetch_tmap(mapW);
    if (TMA_STORE || FUSE == GG_TP_GATHER) gg_prefetch_tmap(mapO);
    if (FUSE == GG_DISPATCH_SWIGLU) {
      gg_prefetch_tmap(fz.mapW3);
      for (int i = 0; i < 3; i++) gg_prefetch_tmap(fz.mapOut[i]);
    }
    if (FUSE == GG_DGRAD_COMBINE) {
      gg_prefetch_tmap(fz.mapA2);
      gg_prefetch_tmap(fz.mapW3);
    }
    int s = 0;
    unsigned ph = 0;
    for (int t = tFirst; t < total; t += tStep) {
      int walkG = t / nTN;
      const gg_tile_t tile = TP ? gg_tp_tile<BNT, CLUSTER>(t, nTN, sCum[E], fz.groupM, fz.rotM, rows, crank, walkG)
                                : gg_tile<BNT>(t, nTN, E, sBeg, sEnd, sCum);
      if constexpr (DISPATCH) {
        // The walk's position (before the rotation): the gather paces
        // on it.
        *sFront = walkG;
        if (CLUSTER == 1 || tile.g >= 0) steps::wait_tile(fz, tile.g, tile.row0, tile.rowEnd, FUSE);
      }
      for (int kb = 0; kb < nK; kb++) {
        const unsigned full = bars + 8 * s, empty = bars + 8 * (STAGES + s);
        // A fresh barrier counts its "previous" phase (parity 1) as
        // complete, so the first pass over the ring does not wait.
        gg_bar_wait(empty, ph ^ 1);
        gg_bar_expect_tx(full, STAGE_BYTES);
        const unsigned a = base + s * STAGE_BYTES;
        if (FUSE != GG_DGRAD_COMBINE) gg_tma_2d(a, mapA, kb * GG_BK, tile.row0, full);
        if (FUSE == GG_DISPATCH_SWIGLU) {
          gg_tma_3d(a + A_BYTES, mapW, kb * GG_BK, tile.n0, tile.e, full);
          gg_tma_3d(a + A_BYTES + B_BYTES / 2, fz.mapW3, kb * GG_BK, tile.n0, tile.e, full);
        } else if (FUSE == GG_DGRAD_COMBINE) {
          // k-blocks of (dh1, W1), then of (dh3, W3).
          const bool second = kb >= nK1;
          const int kc = (second ? kb - nK1 : kb) * GG_BK;
          gg_tma_2d(a, second ? fz.mapA2 : mapA, kc, tile.row0, full);
#pragma unroll
          for (int j = 0; j < 4; j++)
            gg_tma_3d(a + A_BYTES + j * 8192u, second ? fz.mapW3 : mapW, tile.n0 + 64 * j, kc, tile.e, full);
        } else if (CLUSTER > 1 && MNB) {
          // This block's two of the four 64-column boxes, to both blocks.
#pragma unroll
          for (int j = 2 * (int)crank; j < 2 * (int)crank + 2; j++)
            gg_tma_3d_multicast(a + A_BYTES + j * 8192u, mapW, tile.n0 + 64 * j, kb * GG_BK, tile.e, full, 3);
        } else if (CLUSTER > 1) {
          // This block's 128 rows of the weight tile (mapW's boxes are
          // 128 rows), to both blocks.
          gg_tma_3d_multicast(a + A_BYTES + crank * (B_BYTES / 2), mapW, kb * GG_BK, tile.n0 + 128 * crank, tile.e,
                              full, 3);
        } else if (FUSE == GG_DISPATCH_DGRAD || MNB) {
          // W2 (or MNB's W) as it is stored, [E, K, N]: MN-major boxes of
          // 64 columns.
#pragma unroll
          for (int j = 0; j < 4; j++) gg_tma_3d(a + A_BYTES + j * 8192u, mapW, tile.n0 + 64 * j, kb * GG_BK, tile.e, full);
        } else {
          gg_tma_3d(a + A_BYTES, mapW, kb * GG_BK, tile.n0, tile.e, full);
        }
        if (++s == STAGES) {
          s = 0;
          ph ^= 1;
        }
      }
    }
    if (DISPATCH) *sFront = GG_FRONT_DONE;
    if constexpr (CLUSTER > 1) {
      // Every stage's last use released by both blocks' consumers.
      for (int i = 0; i < STAGES; i++) {
        gg_bar_wait(bars + 8 * (STAGES + s), ph ^ 1);
        if (++s == STAGES) {
          s = 0;
          ph ^= 1;
        }
      }
    }
    return;
  }

  if (REG) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
  const int cw = (warp >> 2) - 1;
  if constexpr (FIRST) {
    steps::template gather<true, SRC_BF16>(fz, blockIdx.x * 11 + warp - 1, gridDim.x * 11, lane, K, E, sBeg, sEnd, sCum, sFront);
  }
  // Consumer warpgroups 1 and 2: rows [64*cw, 64*cw + 64) of the tile.
  float acc[R];
#pragma unroll
  for (int i = 0; i < R; i++) acc[i] = 0.0f;
  int s = 0, prev = 0;
  unsigned ph = 0;
  // GG_DISPATCH_SWIGLU: blocks this warpgroup has staged;
  // GG_DISPATCH_DGRAD: boxes it has loaded.
  unsigned stgc = 0;
  const int wtid = tid - 128 * (cw + 1);
  for (int t = tFirst; t < total; t += tStep) {
    int walkG;
    const gg_tile_t tile = TP ? gg_tp_tile<BNT, CLUSTER>(t, nTN, sCum[E], fz.groupM, fz.rotM, rows, crank, walkG)
                              : gg_tile<BNT>(t, nTN, E, sBeg, sEnd, sCum);
    // The TMA-store epilogues (TMA_STORE and GG_DISPATCH_DGRAD) take the
    // blocks gg_block_tma allows; the others keep the register path.
    // GG_DISPATCH_SWIGLU stages every block with rows (gg_block_staged).
    const int wr0 = tile.row0 + cw * 64;
    const bool tmaBlock = gg_block_tma(wr0, tile.rowEnd, rows);
    const bool dswTma = FUSE == GG_DISPATCH_DGRAD && tmaBlock;
    // GG_DISPATCH_DGRAD: the k-block after which the tile's first two
    // h1/h3 boxes are requested: late enough that the previous tile's
    // stores have read their slots, early enough that they land before
    // the epilogue.
    const int kPre = gg_min(2, nK - 1);
    for (int kb = 0; kb < nK; kb++) {
      gg_bar_wait(bars + 8 * s, ph);
      // Reconverge the warp before the .aligned wgmma instructions.
      asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
      const unsigned a = base + s * STAGE_BYTES;
      // The backward kernels (GG_DISPATCH_DGRAD and GG_DGRAD_COMBINE)
      // read the weights as stored, MN-major; the rest K-major.
      constexpr bool MN_B = FUSE == GG_DISPATCH_DGRAD || FUSE == GG_DGRAD_COMBINE || MNB;
      const unsigned long long da = gg_desc(a + cw * 64 * 128),
                               db = MN_B ? gg_desc_mn(a + A_BYTES, 8192u) : gg_desc(a + A_BYTES);
      gg_wgmma_fence();
      gg_fence_acc(acc);
#pragma unroll
      for (int kk = 0; kk < GG_BK / 16; kk++) {
        // +2 in the descriptor's address field is 32 bytes: 16 bf16 of a
        // K-major row; +128 is 2048 bytes: 16 MN-major rows of K.
        if (MN_B) gg_wgmma<0, 1>(*(float(*)[128])acc, da + 2 * kk, db + 128 * kk, (kb > 0 || kk > 0) ? 1 : 0);
        else gg_wgmma(acc, da + 2 * kk, db + 2 * kk, (kb > 0 || kk > 0) ? 1 : 0);
      }
      gg_wgmma_commit();
      if (kb > 0) {
        // The k-block before this one is done with its stage.
        gg_wgmma_wait<1>();
        gg_fence_acc(acc);
        if (lane == 0) gg_release_stage<CLUSTER>(bars + 8 * (STAGES + prev), crank);
      }
      prev = s;
      if (++s == STAGES) {
        s = 0;
        ph ^= 1;
      }
      if constexpr (FUSE == GG_DISPATCH_DGRAD) {
        if (dswTma && wtid == 0 && kb == kPre) {
          // The last two boxes are warmed in L2 for the epilogue's loads.
          gg_bulk_wait_read();
          const unsigned slots = stgBase + cw * (STG_BYTES / 2), eb = ebars + 16 * cw;
          steps::dswiglu_load(fz, slots, eb, wr0, tile.n0, 0);
          steps::dswiglu_load(fz, slots + 16384u, eb + 8, wr0, tile.n0, 1);
          for (int b = 2; b < 4; b++) {
            gg_tma_prefetch_l2(fz.mapOut[2], tile.n0 + 64 * b, wr0);
            gg_tma_prefetch_l2(fz.mapOut[3], tile.n0 + 64 * b, wr0);
          }
        }
      }
    }
    gg_wgmma_wait<0>();
    gg_fence_acc(acc);
    if (lane == 0) gg_release_stage<CLUSTER>(bars + 8 * (STAGES + prev), crank);

    if (TMA_STORE) {
      // beta != 0 (reads out) keeps the register path.
      if (wr0 >= tile.rowEnd) continue;  // no row of ours in this tile
      if (beta == 0.0f && tmaBlock) {
        gg_epilogue_tma(*(const float(*)[128])acc, mapO, stgBase + cw * (STG_BYTES / 2), wtid, warp, lane, wr0,
                        tile.n0, N, alpha, 1 + cw);
        continue;
      }
    }
    if constexpr (FUSE == GG_TP_GATHER) {
      // One group: every row of the block inside the tensor is the
      // tile's; TMA clips the rest.
      if (wr0 < tile.rowEnd)
        gg_epilogue_tma_f32(*(const float(*)[128])acc, mapO, stgBase + cw * (STG_BYTES / 2), wtid, warp, lane, wr0,
                            tile.n0, N, 1 + cw);
      continue;
    }
    if constexpr (FUSE == GG_TP_SCATTER) {
      // The block's rows all go to one owner (blockRows % 64 == 0).
      if (fz.ownerMaps) {
        if (wr0 < tile.rowEnd) {
          const int s = wr0 / fz.blockRows;
          gg_epilogue_tma_f32(*(const float(*)[128])acc, (const gg_tmap*)(fz.ownerMaps + 128 * s),
                              stgBase + cw * (STG_BYTES / 2), wtid, warp, lane, fz.slotRow0 + wr0 - s * fz.blockRows,
                              tile.n0, N, 1 + cw, fz.scatterMode != GG_SCATTER_STORE);
        }
        continue;
      }
    }
    // Epilogue: registers straight to global memory, masked to the
    // expert's rows and to N.
    const long long r0 = (long long)tile.row0 + cw * 64 + (warp & 3) * 16 + (lane >> 2);
    if constexpr (FUSE == GG_DISPATCH_SWIGLU) {
      if (gg_block_staged(wr0, tile.rowEnd))
        steps::stage_h13(*(const float(*)[128])acc, stgBase + cw * (STG_BYTES / 2), ebars + 8 * cw, ebars + 8 * (2 + cw),
                     wtid, warp, lane, 1 + cw, stgc);
      continue;
    } else if constexpr (FUSE == GG_DISPATCH_DGRAD) {
      if (dswTma) {
        steps::epilogue_dswiglu_tma(*(const float(*)[128])acc, fz, stgBase + cw * (STG_BYTES / 2), ebars + 16 * cw, wtid,
                                warp, lane, wr0, tile.n0, N, 1 + cw, stgc);
        continue;
      }
      steps::epilogue_dswiglu(*(const float(*)[128])acc, r0, tile.rowEnd, tile.n0, N, lane, (unsigned short*)out, fz);
    } else if constexpr (FUSE == GG_DOWN_COMBINE || FUSE == GG_DGRAD_COMBINE) {
      steps::epilogue_rows(acc, r0, tile.rowEnd, tile.n0 + 2 * (lane & 3), N, fz);
      if (fz.done != 0) steps::mark_rows(fz, tile.g, cw, wr0, tile.rowEnd, nTN, warp, lane, 1 + cw);
    } else if constexpr (FUSE == GG_TP_SCATTER) {
      steps::epilogue_scatter(acc, r0, tile.rowEnd, tile.n0 + 2 * (lane & 3), N, fz);
    } else {
      gg_epilogue64<OUT_BF16>(acc, r0, tile.rowEnd, tile.n0 + 2 * (lane & 3), N, out, alpha, beta);
    }
  }
  // The staging buffers must outlive the stores reading them.
  if ((TMA_STORE || STAGED || TMA_F32) && wtid == 0) gg_bulk_wait();
}
