// Lab copy of kernels/attention_hopper.cu (kernels/dev/README.md): with no
// define it compiles to the production source's PTX. AH_EXPERIMENT has no
// bit at the moment. The last lab, fwd-dynamic (head dim 64's walking
// forward claiming its items after the first from a counter,
// ah_walk_next), is production since it measured 1.02-1.03x. Before it:
// zz-red-v2 (the ring backward's shared dk and dv added two columns a
// reduction) is production since it was measured by Nsight Compute;
// zz-chunk-shift (the walk's chunk of a position by a shift) was level
// and left. Before them (kernels/attention_hopper.md): the ring
// backward's zz-walk-rev (each head's query tiles from the last down) is
// production since it was measured by Nsight Compute (1.3-1.8% faster a
// step); zz-heads-inner and zz-rev-heads-inner (the block's heads inner)
// were slower and left; bwd-walk-fastdiv (the whole-sequence backward
// walk's division as a multiply and a shift, ah_div) and bwd-prescale (the
// exponential giving P^T * scale) are production; fwd-walk-fastdiv (the
// same for the persistent forward's item decoding) was level and left at
// 3cbb251; before them bwd-walk-* (production since 614052d) and
// bwd-head-split (left at 6306c9e); the ring backward's zz-chunk-search
// was level and left at 8bde2a8; git keeps them.
//
// Causal grouped-query attention for Hopper (sm_90a), forward and
// backward (the backward's section below): bf16 q, k and v read by TMA
// into a ring of shared-memory stages, the products on wgmma, float32
// softmax statistics and accumulation, float32 out, lse and gradients.
// Same semantics as attention_tc.cu's forward (backend.AttnShape): query
// token b*S + i, key token b*KS + j, query head h reads kv head h/(H/KV),
// scores scaled by 1/sqrt(Dh), key j visible to query i iff j <= off + i
// (an unmasked call passes off = KS-1) and j < KS; lse [B, H, S] in
// natural log. Head dims 64 and 128.
//
// The same core serves the fused ring of zigzag context parallelism
// (attn_h_zz_forward_d*, attn_h_zz_backward_d*, after the whole-sequence
// kernels of each direction): one rank's share, every rank's tensors read
// in place through tensor maps.
//
// Work split. An item is 64*NC queries of one (sequence, head); a block
// has 1+NC warpgroups: NC = 3 at head dim 64 (192 queries, 512 threads,
// FlashAttention-3's shape there), 2 at head dim 128 and in the ring's
// kernels (128 queries, 384 threads). The ring's blocks and head dim
// 128's whole-sequence blocks run one item each (ah_forward); head dim
// 64's walk items on a persistent grid where that pays (ah_forward_walk). Warpgroup 0 is the producer: one
// thread loads an item's q tile and then, for every key tile of
// 128 keys the item sees, the k tile and the v tile, each completing on
// its own "full" mbarrier of a STAGES-deep ring (so the scores can start
// before v has landed). The other warpgroups are the consumers, 64
// queries each:
//
//   S = q . k^T     wgmma m64n128k16 from shared memory (both K-major)
//   mask, online softmax in registers (rows' max and sum, base 2)
//   o = o*alpha + P . v   wgmma m64nDhk16, P from registers (bf16), v an
//                         MN-major shared tile (transpose bit)
//
// Inside a consumer, tile t's scores and tile t-1's P . v are in flight
// together while tile t-1's softmax is finished (FlashAttention-3's
// intra-warpgroup overlap, ah_fwd_tiles), and each consumer warp arrives
// on the stage's "emptyK" mbarrier once its scores are in and on its
// "emptyV" once its P . v is, which lets the producer refill each tile
// apart. The scores' accumulator layout is the A operand layout of the
// next product (both are mma.m16n8k16's per warp), so P never leaves the
// registers. The consumers run the same key tiles on different queries,
// so while one is in its softmax another's products keep the tensor cores
// busy too; a third
// consumer (head dim 64, whose tiles are half the work of 128's) loads
// each key tile once for 192 queries and has twelve warps hide the
// softmax's latencies: 1.14x the two-consumer kernel at B8 S2048 and
// 1.12x at B4 S4096 on an H200 (kernels/attention_hopper.md, fwd-3c).
//
// Masking. Only tiles that cross the causal diagonal or the end of the
// keys are masked, element by element; a block loads key tiles up to the
// last key its last valid query sees, and a consumer whose queries see
// fewer tiles drains the rest (waits for them to land and frees them). A
// key tile past KS reads the next sequence's rows (k and v are one 2-D
// map) or TMA's zero fill; both are masked. Queries past S in the last
// q tile are computed on whatever rows the map returns and not stored.
//
// Registers. __launch_bounds__(384, 1) gives every thread 168 at entry
// (twelve warps put three on each of the SM's four register files). The
// producer warpgroup hands registers to the consumers with setmaxnreg (40
// and 232), and ptxas compiles the consumers' code to 232, which holds
// the scores (64 floats), o (Dh/2) and P (32 bf16 pairs) without
// spilling, as long as no trap sits in it (gg_bar_wait's is a call:
// hopper.cuh). With three consumers (512 threads, 128 each at entry) the
// producer drops to 32 and the consumers rise to 160, enough at head dim
// 64 (o is 32 floats); 128 x 32 + 384 x 160 is the register file's 65536.
//
// Layout in shared memory (128-byte swizzle, as grouped_gemm.cuh
// explains): a tile of R rows and Dh columns is Dh/64 TMA boxes of {64
// columns, R rows}, each R rows of 128 bytes. The scores' descriptors
// advance 32 bytes per k16 step inside a box; v's MN-major descriptor
// (gg_desc_mn) has its 64-column boxes 16 KiB apart (128 key rows) and
// advances 2048 bytes (16 keys) per k16 step.

#include "hopper.cuh"
#ifndef AH_EXPERIMENT
#define AH_EXPERIMENT 0
#endif

#define AH_BM 128  // queries per block of two consumers (the ring's kernels, the backward's key blocks)
#define AH_BN 128  // keys per tile
#define AH_LN2 0.6931471805599453f

// ah_band_of maps item lin of pairs x items in launch order (item 0 of a
// pair the heaviest) to its pair and item so that the items run band
// pairs at a time, each band's items heaviest first. band = pairs is the
// launch order itself: every pair's item 0, then every pair's item 1, ...
// The whole-sequence kernels take band from the host (hopperAttnBand says
// when a few pairs at a time pay: their rows then stay in L2).
__device__ __forceinline__ void ah_band_of(int lin, int pairs, int items, int band, int& pair, int& item) {
  const int first = lin / (band * items) * band;
  const int inBand = gg_min(band, pairs - first), r = lin - first * items;
  pair = first + r % inBand;
  item = r / inBand;
}

// ah_band is ah_band_of for this block of a grid of gridDim.x pairs by
// gridDim.y items, launched in the order blockIdx.y * gridDim.x +
// blockIdx.x.
__device__ __forceinline__ void ah_band(int band, int& pair, int& item) {
  ah_band_of(blockIdx.y * gridDim.x + blockIdx.x, gridDim.x, gridDim.y, band, pair, item);
}

extern __shared__ __attribute__((aligned(1024))) unsigned char ah_smem[];

// ah_div divides by d >= 1, fixed for the kernel, with a multiply and a
// shift (Granlund and Montgomery, "Division by invariant integers using
// multiplication", 1994): q = (umulhi(n, m) + n) >> l, l = ceil(log2 d),
// m = floor(2^32 (2^l - d) / d) + 1, exact for 0 <= n < 2^31; the
// constructor's 64-bit division runs once. The backward's walk divides
// its item index by its tiles a head every item, in every warp: as an
// integer division that was some 30 instructions, and the backward 3-5%
// slower (kernels/attention_hopper.md, bwd-walk-fastdiv); the ring's walk
// divides so too (its division of a position by the chunk length stays:
// a second divider spilled). Mirrored by ahDiv in backend/cuda's tests.
struct ah_div {
  unsigned m;
  int l;
  __device__ __forceinline__ explicit ah_div(int d0) {
    const unsigned d = d0 > 1 ? (unsigned)d0 : 1u;
    unsigned lz;
    asm("clz.b32 %0, %1;" : "=r"(lz) : "r"(d - 1));
    l = 32 - (int)lz;  // 0 for d == 1 (clz of 0 is 32)
    m = (unsigned)((((unsigned long long)((1ull << l) - d)) << 32) / d + 1);
  }
  __device__ __forceinline__ int div(int n) const {
    unsigned hi;
    asm("mul.hi.u32 %0, %1, %2;" : "=r"(hi) : "r"((unsigned)n), "r"(m));
    return (int)((hi + (unsigned)n) >> l);
  }
};

__device__ __forceinline__ float ah_neg_inf() { return gg_bits_float(0xff800000u); }

// ah_ex2 is 2^x (2^-inf = 0); ah_lg2 is log2(x).
__device__ __forceinline__ float ah_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float ah_lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- wgmma with A in registers ----

// D[64 x N] += A[64 x 16] * B[N x 16]^T, A in registers (four bf16 pairs a
// thread: per warp the A layout of mma.m16n8k16, rows 16w..16w+15), B an
// MN-major tile in shared memory (descriptor db, gg_desc_mn; transpose bit
// set). N = 64 (d holds 32 floats) or 128 (64).
__device__ __forceinline__ void ah_wgmma_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.eq.u32 p, 1, 1;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

__device__ __forceinline__ void ah_wgmma_rs(float (&d)[64], const unsigned (&a)[4], unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.eq.u32 p, 1, 1;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// D[64 x 64] (+)= A[64 x 16] * B[64 x 16]^T from shared memory
// (descriptors da, db); scale_d 0 overwrites D, 1 accumulates. TA and TB
// say how A and B are stored: 0 K-major (gg_desc), 1 MN-major
// (gg_desc_mn).
template <int TA, int TB>
__device__ __forceinline__ void ah_wgmma_ss(float (&d)[32], unsigned long long da, unsigned long long db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, "
      "%32, %33, p, 1, 1, %35, %36;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}

// ah_cfg is the forward's layout for head dim DH and NC consumer
// warpgroups: STAGES is the ring depth (a stage is a k and a v tile, 32
// KiB at Dh 64, 64 KiB at Dh 128), beside the q tile of 64*NC rows and
// the mbarriers (q's, and fullK, fullV, emptyK, emptyV a stage, and
// qFree) and ah_forward_walk's item slot.
template <int DH, int NC = 2>
struct ah_cfg {
  static constexpr int STAGES = DH == 64 ? 4 : 2;
  static constexpr int BM = 64 * NC;                       // queries per block
  static constexpr unsigned BOX = AH_BN * 128;             // {64 columns, 128 rows} of bf16: 16 KiB
  static constexpr unsigned TILE = (DH / 64) * BOX;        // a k or v tile
  static constexpr unsigned QBOX = BM * 128;               // {64 columns, BM rows}
  static constexpr unsigned QTILE = (DH / 64) * QBOX;      // the q tile
  static constexpr unsigned SMEM = 1024 + QTILE + 2 * STAGES * TILE + 8 * (3 + 4 * STAGES);
  // setmaxnreg's counts: 128 x REG_DEC + 128NC x REG_INC <= 65536.
  static constexpr int REG_DEC = NC == 2 ? 40 : 32, REG_INC = NC == 2 ? 232 : 160;
};

// ah_fwd_nc is the whole-sequence forward's consumer warpgroups per head
// dim (the Go side's hopperAttnConsumers).
template <int DH>
struct ah_fwd_nc {
  static constexpr int NC = DH == 64 ? 3 : 2;
};

// ah_store2 writes two adjacent outputs: float32, or bf16 rounded to
// nearest even (one cvt for the pair) in one 32-bit store.
__device__ __forceinline__ void ah_store2(float* p, float a, float b) {
  asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ void ah_store2(mk_bf16* p, float a, float b) {
  asm volatile("st.global.b32 [%0], %1;" ::"l"(p), "r"(gg_pack_bf16(a, b)) : "memory");
}

// The steps of the forwards' consumer loop (ah_fwd_tiles), as functions
// that inline (a lambda called from two places may stay a call, its
// arrays then in local memory, which makes ptxas serialise the wgmma
// instructions).
// ah_fwd_issue_s queues tile t's scores into sc (one commit group).
template <int DH, int STAGES>
__device__ __forceinline__ void ah_fwd_issue_s(float (&sc)[64], unsigned long long dq, unsigned ks, unsigned fullK, int t) {
  constexpr unsigned BOX = AH_BN * 128, TILE = (DH / 64) * BOX;
  const int s = t % STAGES;
  gg_bar_wait(fullK + 8 * s, (t / STAGES) & 1);
  asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
  const unsigned long long dk = gg_desc(ks + s * TILE);
  gg_wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < DH / 16; kk++) {
    const unsigned long long step = (kk / 4) * (BOX >> 4) + 2 * (kk % 4);
    gg_wgmma(sc, dq + step, dk + step, kk > 0 ? 1 : 0);
  }
  gg_wgmma_commit();
}

// ah_fwd_issue_pv queues o += P . v for tile t (one commit group), P in p.
template <int DH, int STAGES>
__device__ __forceinline__ void ah_fwd_issue_pv(float (&o)[DH / 2], const unsigned (&p)[8][4], unsigned vs, unsigned fullV,
                                                int t) {
  constexpr unsigned BOX = AH_BN * 128, TILE = (DH / 64) * BOX;
  const int s = t % STAGES;
  gg_bar_wait(fullV + 8 * s, (t / STAGES) & 1);
  asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
  const unsigned long long dv = gg_desc_mn(vs + s * TILE, BOX);
  gg_wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < AH_BN / 16; kk++) ah_wgmma_rs(o, p[kk], dv + 128 * kk);  // +2048 bytes: 16 keys
  gg_wgmma_commit();
}

// ah_fwd_softmax turns tile t's scores (sc, done) into its exponentials in
// place, moves the row maxima (m0, m1) and sums (l0, l1) on and sets the
// rescale a0, a1 of what came before: ah_forward's arithmetic.
__device__ __forceinline__ void ah_fwd_softmax(float (&sc)[64], float& m0, float& m1, float& l0, float& l1, float& a0,
                                               float& a1, int t, int off, int w0, int r0, int r1, int KS, int t4,
                                               float scaleLog2) {
  const int j0 = t * AH_BN;
  if (j0 + AH_BN - 1 > off + w0 || j0 + AH_BN > KS) {
    const int lim0 = gg_min(off + r0, KS - 1), lim1 = gg_min(off + r1, KS - 1);
#pragma unroll
    for (int n = 0; n < 16; n++) {
      const int j = j0 + 8 * n + 2 * t4;
      if (j > lim0) sc[4 * n] = ah_neg_inf();
      if (j + 1 > lim0) sc[4 * n + 1] = ah_neg_inf();
      if (j > lim1) sc[4 * n + 2] = ah_neg_inf();
      if (j + 1 > lim1) sc[4 * n + 3] = ah_neg_inf();
    }
  }
  float mx0 = ah_neg_inf(), mx1 = ah_neg_inf();
#pragma unroll
  for (int n = 0; n < 16; n++) {
    mx0 = fmaxf(mx0, fmaxf(sc[4 * n], sc[4 * n + 1]));
    mx1 = fmaxf(mx1, fmaxf(sc[4 * n + 2], sc[4 * n + 3]));
  }
  mx0 = fmaxf(mx0, mk_shfl_xor(mx0, 1));
  mx0 = fmaxf(mx0, mk_shfl_xor(mx0, 2));
  mx1 = fmaxf(mx1, mk_shfl_xor(mx1, 1));
  mx1 = fmaxf(mx1, mk_shfl_xor(mx1, 2));
  const float n0 = fmaxf(m0, mx0 * scaleLog2), n1 = fmaxf(m1, mx1 * scaleLog2);
  a0 = ah_ex2(m0 - n0);
  a1 = ah_ex2(m1 - n1);
  m0 = n0;
  m1 = n1;
  float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
  for (int n = 0; n < 16; n++) {
    sc[4 * n] = ah_ex2(sc[4 * n] * scaleLog2 - n0);
    sc[4 * n + 1] = ah_ex2(sc[4 * n + 1] * scaleLog2 - n0);
    sc[4 * n + 2] = ah_ex2(sc[4 * n + 2] * scaleLog2 - n1);
    sc[4 * n + 3] = ah_ex2(sc[4 * n + 3] * scaleLog2 - n1);
    s0 += sc[4 * n] + sc[4 * n + 1];
    s1 += sc[4 * n + 2] + sc[4 * n + 3];
  }
  l0 = l0 * a0 + s0;
  l1 = l1 * a1 + s1;
}

// ah_fwd_rescale_pack scales o by a0, a1 and packs the exponentials in sc
// into P.
template <int DH>
__device__ __forceinline__ void ah_fwd_rescale_pack(float (&o)[DH / 2], unsigned (&p)[8][4], const float (&sc)[64], float a0,
                                                    float a1) {
#pragma unroll
  for (int i = 0; i < DH / 8; i++) {
    o[4 * i] *= a0;
    o[4 * i + 1] *= a0;
    o[4 * i + 2] *= a1;
    o[4 * i + 3] *= a1;
  }
#pragma unroll
  for (int n = 0; n < 16; n++) {
    p[n >> 1][2 * (n & 1)] = gg_pack_bf16(sc[4 * n], sc[4 * n + 1]);
    p[n >> 1][2 * (n & 1) + 1] = gg_pack_bf16(sc[4 * n + 2], sc[4 * n + 3]);
  }
}

// ah_fwd_tiles is the forwards' consumer loop over tiles 0 .. nT-1 (nT >=
// 1), FlashAttention-3's overlap inside a warpgroup: the first tile's
// scores and softmax, then each step tile t's scores and tile t-1's P.V in
// flight together, tile t's softmax once the scores (the older group) are
// in, o's rescale and P_t's packing once P.V is; the last tile's P.V after
// the loop. Every wait is unconditional (a conditional wait inside the
// loop made ptxas serialise the wgmma instructions: C7514). The live
// registers are one score tile, o and P: 128 a thread at head dim 64, 160
// at 128, within the consumers' 160 and 232. k and v are released on
// emptyK and emptyV as each is done with, so that the two-stage ring at
// head dim 128 still loads tile t+1's k during tile t. The stages count
// on from T0 (the tiles of the block's earlier items: tile t is on stage
// (T0 + t) % STAGES); with FREE_Q each warp also arrives on qFree once
// its last scores are in (its last read of the q tile).
template <int DH, int STAGES, bool FREE_Q>
__device__ __forceinline__ void ah_fwd_tiles(float (&o)[DH / 2], float& m0, float& m1, float& l0, float& l1, int nT, int T0,
                                             unsigned long long dq, unsigned ks, unsigned vs, unsigned fullK,
                                             unsigned fullV, unsigned emptyK, unsigned emptyV, unsigned qFree, int lane,
                                             int off, int w0, int r0, int r1, int KS, int t4, float scaleLog2) {
  float sc[64];
  unsigned p[8][4];
  float a0, a1;  // the rescale of what came before tile t (the softmax's)
  ah_fwd_issue_s<DH, STAGES>(sc, dq, ks, fullK, T0);
  gg_wgmma_wait<0>();
  gg_fence_acc(sc);
  if (lane == 0) {
    gg_bar_arrive(emptyK + 8 * (T0 % STAGES));
    if (FREE_Q && nT == 1) gg_bar_arrive(qFree);
  }
  ah_fwd_softmax(sc, m0, m1, l0, l1, a0, a1, 0, off, w0, r0, r1, KS, t4, scaleLog2);
  ah_fwd_rescale_pack<DH>(o, p, sc, a0, a1);
#pragma unroll 1
  for (int t = 1; t < nT; t++) {
    ah_fwd_issue_s<DH, STAGES>(sc, dq, ks, fullK, T0 + t);
    ah_fwd_issue_pv<DH, STAGES>(o, p, vs, fullV, T0 + t - 1);
    gg_wgmma_wait<1>();  // the scores (the older group)
    gg_fence_acc(sc);
    if (lane == 0) {
      gg_bar_arrive(emptyK + 8 * ((T0 + t) % STAGES));
      if (FREE_Q && t == nT - 1) gg_bar_arrive(qFree);  // this warp's last read of the q tile
    }
    ah_fwd_softmax(sc, m0, m1, l0, l1, a0, a1, t, off, w0, r0, r1, KS, t4, scaleLog2);
    gg_wgmma_wait<0>();  // tile t-1's P.V: o and p free
    gg_fence_acc(o);
    gg_fence_acc(sc);  // (so that P_t's packing, which reads sc, stays after the wait: p is P.V's operand until then)
    if (lane == 0) gg_bar_arrive(emptyV + 8 * ((T0 + t - 1) % STAGES));
    ah_fwd_rescale_pack<DH>(o, p, sc, a0, a1);
  }
  ah_fwd_issue_pv<DH, STAGES>(o, p, vs, fullV, T0 + nT - 1);
  gg_wgmma_wait<0>();
  gg_fence_acc(o);
  if (lane == 0) gg_bar_arrive(emptyV + 8 * ((T0 + nT - 1) % STAGES));
}

// ah_fwd_init_bars is thread 0's setup of a forward's mbarriers: q's
// (and qFree unless it is 0: one arrival per consumer warp) and the stages'
// full k and v (the producer's expect_tx) and empty k and v (one arrival
// per consumer warp), fenced for the async proxy. The block syncs after.
template <int STAGES>
__device__ __forceinline__ void ah_fwd_init_bars(unsigned barQ, unsigned qFree, unsigned fullK, unsigned fullV,
                                                 unsigned emptyK, unsigned emptyV, int consumerWarps) {
  gg_bar_init(barQ, 1);
  if (qFree != 0) gg_bar_init(qFree, consumerWarps);
  for (int s = 0; s < STAGES; s++) {
    gg_bar_init(fullK + 8 * s, 1);
    gg_bar_init(fullV + 8 * s, 1);
    gg_bar_init(emptyK + 8 * s, consumerWarps);
    gg_bar_init(emptyV + 8 * s, consumerWarps);
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ah_fwd_load_item is the producer's part of one item: its q tile (on
// barQ), then its nT key tiles' k and v on the stages' ring, tile u on
// stage (T0 + u) % STAGES, each stage refilled once every consumer warp
// has freed it.
template <int DH, int STAGES>
__device__ __forceinline__ void ah_fwd_load_item(const gg_tmap* mapQ, const gg_tmap* mapK, const gg_tmap* mapV, unsigned qs,
                                                 unsigned ks, unsigned vs, unsigned barQ, unsigned fullK, unsigned fullV,
                                                 unsigned emptyK, unsigned emptyV, unsigned qTile, unsigned box, unsigned tile,
                                                 unsigned qBox, int h, int kvh, int qRow, int kRow, int nT, int T0) {
  gg_bar_expect_tx(barQ, qTile);
#pragma unroll
  for (int c = 0; c < DH / 64; c++) gg_tma_2d(qs + c * qBox, mapQ, h * DH + 64 * c, qRow, barQ);
  for (int u = 0; u < nT; u++) {
    const int s = (T0 + u) % STAGES;
    const unsigned ph = ((T0 + u) / STAGES) & 1;
    const int row = kRow + u * AH_BN;
    gg_bar_wait(emptyK + 8 * s, ph ^ 1);  // a fresh barrier's parity-1 phase counts as complete
    gg_bar_expect_tx(fullK + 8 * s, tile);
#pragma unroll
    for (int c = 0; c < DH / 64; c++) gg_tma_2d(ks + s * tile + c * box, mapK, kvh * DH + 64 * c, row, fullK + 8 * s);
    gg_bar_wait(emptyV + 8 * s, ph ^ 1);
    gg_bar_expect_tx(fullV + 8 * s, tile);
#pragma unroll
    for (int c = 0; c < DH / 64; c++) gg_tma_2d(vs + s * tile + c * box, mapV, kvh * DH + 64 * c, row, fullV + 8 * s);
  }
}

// ah_fwd_drain waits for and frees an item's tiles from .. nT-1, which the
// producer loaded for other warpgroups' queries and this one's do not see
// (tile u on stage (T0 + u) % STAGES).
template <int STAGES>
__device__ __forceinline__ void ah_fwd_drain(int from, int nT, int T0, unsigned fullK, unsigned fullV, unsigned emptyK,
                                             unsigned emptyV, int lane) {
  for (int u = from; u < nT; u++) {
    const int s = (T0 + u) % STAGES;
    const unsigned ph = ((T0 + u) / STAGES) & 1;
    gg_bar_wait(fullK + 8 * s, ph);
    gg_bar_wait(fullV + 8 * s, ph);
    if (lane == 0) {
      gg_bar_arrive(emptyK + 8 * s);
      gg_bar_arrive(emptyV + 8 * s);
    }
  }
}

// ah_fwd_store normalises this thread's rows r0 and r1 of an item's out
// (rows b*S + r of head h) by their sums and writes them, and their lse
// at lrow[r] (the (sequence, head)'s row of lse), rows past S not. The
// whole-sequence forwards and the ring's (S its 2C local rows) share it.
template <int DH, typename Out>
__device__ __forceinline__ void ah_fwd_store(const float (&o)[DH / 2], float m0, float m1, float l0, float l1, Out* out,
                                             float* lrow, int b, int h, int S, int H, int r0, int r1, int t4) {
  l0 += mk_shfl_xor(l0, 1);
  l0 += mk_shfl_xor(l0, 2);
  l1 += mk_shfl_xor(l1, 1);
  l1 += mk_shfl_xor(l1, 2);
  const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
  const int HD = H * DH;
  Out* o0 = out + ((long long)b * S + r0) * HD + h * DH + 2 * t4;
  Out* o1 = o0 + 8LL * HD;
#pragma unroll
  for (int i = 0; i < DH / 8; i++) {
    if (r0 < S) ah_store2(o0 + 8 * i, o[4 * i] * inv0, o[4 * i + 1] * inv0);
    if (r1 < S) ah_store2(o1 + 8 * i, o[4 * i + 2] * inv1, o[4 * i + 3] * inv1);
  }
  if (t4 == 0) {
    if (r0 < S) lrow[r0] = (m0 + ah_lg2(l0)) * AH_LN2;
    if (r1 < S) lrow[r1] = (m1 + ah_lg2(l1)) * AH_LN2;
  }
}

// ah_forward is the whole-sequence forward with one block an item, on a
// grid of pairs by q tiles in ah_band's order: head dim 128's kernels.
// Walking items on a persistent grid (ah_forward_walk) ran head dim 128's
// forward 4-10% slower on an H100 even at one block an item, and gains
// nothing there (kernels/attention_hopper.md, fwd-persistent).
template <int DH, typename Out, int NC>
__device__ __forceinline__ void ah_forward(const gg_tmap* mapQ, const gg_tmap* mapK, const gg_tmap* mapV, Out* out,
                                           float* lse, int S, int KS, int off, int H, int KV, float scaleLog2, int band) {
  using cfg = ah_cfg<DH, NC>;
  constexpr int STAGES = cfg::STAGES, BM = cfg::BM;
  constexpr unsigned BOX = cfg::BOX, TILE = cfg::TILE, QBOX = cfg::QBOX, QTILE = cfg::QTILE;
  const unsigned base = (gg_smem_addr(ah_smem) + 1023u) & ~1023u;
  const unsigned qs = base, ks = base + QTILE, vs = base + QTILE + STAGES * TILE;
  // mbarriers: q, fullK[STAGES], fullV[STAGES], emptyK[STAGES], emptyV[STAGES] (and qFree's slot, unused).
  const unsigned barQ = base + QTILE + 2 * STAGES * TILE, fullK = barQ + 8, fullV = fullK + 8 * STAGES,
                 emptyK = fullV + 8 * STAGES, emptyV = emptyK + 8 * STAGES;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  int bh, ty;
  ah_band(band, bh, ty);
  const int b = bh / H, h = bh % H, kvh = h / (H / KV);
  const int nQT = (S + BM - 1) / BM, i0 = (nQT - 1 - ty) * BM;
  const int lastRow = gg_min(S - 1, i0 + BM - 1);
  const int nT = gg_min(KS - 1, off + lastRow) / AH_BN + 1;  // key tiles the block loads
  if (tid == 0) ah_fwd_init_bars<STAGES>(barQ, 0, fullK, fullV, emptyK, emptyV, 4 * NC);
  __syncthreads();

  if (warp < 4) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(cfg::REG_DEC) : "memory");
    if (tid != 0) return;
    gg_prefetch_tmap(mapQ);
    gg_prefetch_tmap(mapK);
    gg_prefetch_tmap(mapV);
    ah_fwd_load_item<DH, STAGES>(mapQ, mapK, mapV, qs, ks, vs, barQ, fullK, fullV, emptyK, emptyV, QTILE, BOX, TILE, QBOX, h,
                                 kvh, b * S + i0, b * KS, nT, 0);
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(cfg::REG_INC) : "memory");
  const int cw = (warp >> 2) - 1, g = lane >> 2, t4 = lane & 3;
  const int w0 = i0 + 64 * cw, r0 = w0 + 16 * (warp & 3) + g, r1 = r0 + 8;
  const int nTw = w0 <= S - 1 ? gg_min(KS - 1, off + gg_min(S - 1, w0 + 63)) / AH_BN + 1 : 0;
  float o[DH / 2];
#pragma unroll
  for (int i = 0; i < DH / 2; i++) o[i] = 0.0f;
  float m0 = ah_neg_inf(), m1 = ah_neg_inf(), l0 = 0.0f, l1 = 0.0f;  // base-2 scaled max, this thread's part of the sum
  gg_bar_wait(barQ, 0);
  const unsigned long long dq = gg_desc(qs + cw * 64 * 128);
  if (nTw > 0)
    ah_fwd_tiles<DH, STAGES, false>(o, m0, m1, l0, l1, nTw, 0, dq, ks, vs, fullK, fullV, emptyK, emptyV, 0, lane, off, w0, r0,
                                    r1, KS, t4, scaleLog2);
  ah_fwd_drain<STAGES>(nTw, nT, 0, fullK, fullV, emptyK, emptyV, lane);
  ah_fwd_store<DH>(o, m0, m1, l0, l1, out, lse + ((long long)b * H + h) * S, b, h, S, H, r0, r1, t4);
}

// ah_walk_next and ah_walk_done are ah_forward_walk's claims: module
// globals, zero when the module loads, which the last block of a launch
// to finish claiming zeroes again, so that each launch on the device's
// one stream finds them zero (a Device loads the module for itself).
__device__ unsigned ah_walk_next, ah_walk_done;

// ah_atom_add adds v to *p at the GPU's scope and returns what was there
// (relaxed); ah_atom_add_acq_rel also orders this thread's accesses
// before it ahead of it and those after it behind it.
__device__ __forceinline__ unsigned ah_atom_add(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ unsigned ah_atom_add_acq_rel(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// ah_forward_walk is the whole-sequence forward on a grid of gridDim.x
// blocks over the pairs x q tiles (items) in ah_band_of's order: block x
// runs item x first, then claims the next unclaimed item (gridDim.x + the
// count of claims so far, ah_walk_next) each time its producer has queued
// an item's last tile load, so a block whose items ran short takes the
// next heaviest (the host launches one block an item where a band
// applies, whose L2 order one block an SM would lose, and min(SMs,
// items) blocks elsewhere): head dim 64's kernels. The producer hands
// each item to the consumers in a shared slot written before its q
// tile's barrier arrival and read after their wait; it writes the next
// once qFree says every consumer warp has its last scores of the item
// before, then loads the item's q tile and its k and v tiles on the
// stages' ring, which turns on across items (T counts the block's
// tiles), so that the next item's q and first tiles land under this
// one's last products and epilogue (kernels/attention_hopper.md,
// fwd-persistent: 1.07-1.09x at moe-small's shape; fwd-dynamic, the
// claims instead of a fixed stride: 1.02-1.03x).
template <int DH, typename Out, int NC>
__device__ __forceinline__ void ah_forward_walk(const gg_tmap* mapQ, const gg_tmap* mapK, const gg_tmap* mapV, Out* out,
                                                float* lse, int S, int KS, int off, int H, int KV, float scaleLog2, int band,
                                                int pairs) {
  using cfg = ah_cfg<DH, NC>;
  constexpr int STAGES = cfg::STAGES, BM = cfg::BM;
  constexpr unsigned BOX = cfg::BOX, TILE = cfg::TILE, QBOX = cfg::QBOX, QTILE = cfg::QTILE;
  const unsigned base = (gg_smem_addr(ah_smem) + 1023u) & ~1023u;
  const unsigned qs = base, ks = base + QTILE, vs = base + QTILE + STAGES * TILE;
  // mbarriers: q, fullK[STAGES], fullV[STAGES], emptyK[STAGES], emptyV[STAGES], qFree.
  const unsigned barQ = base + QTILE + 2 * STAGES * TILE, fullK = barQ + 8, fullV = fullK + 8 * STAGES,
                 emptyK = fullV + 8 * STAGES, emptyV = emptyK + 8 * STAGES, qFree = emptyV + 8 * STAGES;
  // The item the producer claimed: written before barQ's arrival for it
  // (its release), read after the consumers' wait (their acquire), not
  // rewritten before qFree says every consumer warp has read it.
  const unsigned slot = qFree + 8;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int nQT = (S + BM - 1) / BM, items = pairs * nQT;
  if (tid == 0) ah_fwd_init_bars<STAGES>(barQ, qFree, fullK, fullV, emptyK, emptyV, 4 * NC);
  __syncthreads();

  if (warp < 4) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(cfg::REG_DEC) : "memory");
    if (tid != 0) return;
    gg_prefetch_tmap(mapQ);
    gg_prefetch_tmap(mapK);
    gg_prefetch_tmap(mapV);
    int T = 0;  // the block's tiles so far: the stages' position
    for (int lin = blockIdx.x, j = 0;; j++) {
      gg_bar_wait(qFree, (j & 1) ^ 1);  // item j-1's q and slot read (item 0: a fresh barrier's parity 1)
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(slot), "r"(lin) : "memory");
      if (lin >= items) {
        gg_bar_arrive(barQ);  // the slot says: no more items
        break;
      }
      int bh, ty;
      ah_band_of(lin, pairs, nQT, band, bh, ty);
      const int b = bh / H, h = bh % H, kvh = h / (H / KV), i0 = (nQT - 1 - ty) * BM;
      const int nT = gg_min(KS - 1, off + gg_min(S - 1, i0 + BM - 1)) / AH_BN + 1;
      ah_fwd_load_item<DH, STAGES>(mapQ, mapK, mapV, qs, ks, vs, barQ, fullK, fullV, emptyK, emptyV, QTILE, BOX, TILE, QBOX, h,
                                   kvh, b * S + i0, b * KS, nT, T);
      T += nT;
      lin = gridDim.x + (int)ah_atom_add(&ah_walk_next, 1u);
    }
    // Every block has made its last claim once the last one gets here:
    // each block's count releases its claims, and the last one's acquires
    // them all before it zeroes the counters.
    if (ah_atom_add_acq_rel(&ah_walk_done, 1u) == gridDim.x - 1) {
      asm volatile("st.relaxed.gpu.u32 [%0], 0;" ::"l"(&ah_walk_next) : "memory");
      asm volatile("st.relaxed.gpu.u32 [%0], 0;" ::"l"(&ah_walk_done) : "memory");
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(cfg::REG_INC) : "memory");
  const int cw = (warp >> 2) - 1, g = lane >> 2, t4 = lane & 3;
  const unsigned long long dq = gg_desc(qs + cw * 64 * 128);
  int T = 0;  // the producer's count, in step
#pragma unroll 1
  for (int j = 0;; j++) {
    gg_bar_wait(barQ, j & 1);
    int lin;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(lin) : "r"(slot) : "memory");
    if (lin >= items) break;
    int bh, ty;
    ah_band_of(lin, pairs, nQT, band, bh, ty);
    const int i0 = (nQT - 1 - ty) * BM;
    const int nT = gg_min(KS - 1, off + gg_min(S - 1, i0 + BM - 1)) / AH_BN + 1;
    const int w0 = i0 + 64 * cw, r0 = w0 + 16 * (warp & 3) + g, r1 = r0 + 8;
    const int nTw = w0 <= S - 1 ? gg_min(KS - 1, off + gg_min(S - 1, w0 + 63)) / AH_BN + 1 : 0;
    float o[DH / 2];
#pragma unroll
    for (int i = 0; i < DH / 2; i++) o[i] = 0.0f;
    float m0 = ah_neg_inf(), m1 = ah_neg_inf(), l0 = 0.0f, l1 = 0.0f;
    if (nTw > 0)
      ah_fwd_tiles<DH, STAGES, true>(o, m0, m1, l0, l1, nTw, T, dq, ks, vs, fullK, fullV, emptyK, emptyV, qFree, lane, off, w0,
                                     r0, r1, KS, t4, scaleLog2);
    else {
      // Queries past S: q never read. Every lane has read the slot before
      // lane 0 frees it (the lanes may leave barQ's wait apart; in
      // ah_fwd_tiles the warpgroup's products gather them first).
      asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
      if (lane == 0) gg_bar_arrive(qFree);
    }
    ah_fwd_drain<STAGES>(nTw, nT, T, fullK, fullV, emptyK, emptyV, lane);
    T += nT;
    // (The item's sequence and head again, rather than held in registers
    // through the tiles.)
    ah_band_of(lin, pairs, nQT, band, bh, ty);
    ah_fwd_store<DH>(o, m0, m1, l0, l1, out, lse + (long long)bh * S, bh / H, bh % H, S, H, r0, r1, t4);
  }
}

#define AH_ZZ_MAX 8  // the ranks the zigzag kernels take

// ---- The fused ring's forward (zigzag context parallelism) ----
//
// attn_h_zz_forward_d{64,128} serve one context-parallel rank r of W
// (backend.ZigzagShape, W <= AH_ZZ_MAX): its 2C local rows of each of B
// sequences, chunk r's then chunk 2W-1-r's, every rank's k and v read in
// place through a tensor map each (the virtual ranks' tensors on this
// GPU, or a peer GPU's over NVLink). All tensors bf16 but out (float32,
// [B*2C, H*Dh]) and lse (float32, [B, 2, H, C], natural log). C must be a
// multiple of 128, so a block's 128 queries and every 128-key tile lie in
// one chunk. A block is ah_forward's: the same producer, consumers and
// online softmax, over the key tiles of positions 0 .. its last query's,
// each loaded from the rank that holds it (tile t is chunk 128t/C), in
// position order, so the softmax state stays in registers from the first
// chunk to the last. Masking is ah_forward's with the block's offset
// between global positions and local rows as off.

// ah_zz_maps is the kernels' tensor maps: this rank's q [B*2C, H*Dh] in
// boxes of 128 rows, every rank's k and v [B*2C, KV*Dh] in boxes of 128
// rows (entries past W unused).
struct ah_zz_maps {
  gg_tmap q;
  gg_tmap k[AH_ZZ_MAX], v[AH_ZZ_MAX];
};

// ah_zz_forward is the ring's forward on ah_forward's producer and
// consumer loop (ah_fwd_tiles), k and v released apart. Shared memory:
// ah_cfg<DH>::SMEM.
template <int DH>
__device__ __forceinline__ void ah_zz_forward(const ah_zz_maps* maps, float* out, float* lse, int r, int W, int C, int H,
                                              int KV, float scaleLog2, int band) {
  constexpr int STAGES = ah_cfg<DH>::STAGES;
  constexpr unsigned BOX = ah_cfg<DH>::BOX, TILE = ah_cfg<DH>::TILE;
  const unsigned base = (gg_smem_addr(ah_smem) + 1023u) & ~1023u;
  const unsigned qs = base, ks = base + TILE, vs = base + (1 + STAGES) * TILE;
  const unsigned barQ = base + (1 + 2 * STAGES) * TILE, fullK = barQ + 8, fullV = fullK + 8 * STAGES,
                 emptyK = fullV + 8 * STAGES, emptyV = emptyK + 8 * STAGES;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // Pairs (sequence, head) by q tiles, heaviest first: the late chunk's
  // (n = 1), its last rows first.
  int bh, y;
  ah_band(band, bh, y);
  const int b = bh / H, h = bh % H, kvh = h / (H / KV);
  const int per = C / AH_BM, n = y < per ? 1 : 0;
  const int tile = n == 1 ? per - 1 - y : per - 1 - (y - per);
  const int S = 2 * C;                  // local rows per sequence
  const int i0 = n * C + tile * AH_BM;  // the block's first local row
  const int p0 = (n == 0 ? r : 2 * W - 1 - r) * C + tile * AH_BM;
  const int off = p0 - i0;               // position = local row + off
  const int nT = p0 / AH_BN + 1;         // key tiles: positions 0 .. p0 + 127
  if (tid == 0) ah_fwd_init_bars<STAGES>(barQ, 0, fullK, fullV, emptyK, emptyV, 8);
  __syncthreads();

  if (warp < 4) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
    if (tid != 0) return;
    gg_prefetch_tmap(&maps->q);
    for (int w = 0; w < W; w++) {
      gg_prefetch_tmap(&maps->k[w]);
      gg_prefetch_tmap(&maps->v[w]);
    }
    gg_bar_expect_tx(barQ, TILE);
#pragma unroll
    for (int c = 0; c < DH / 64; c++) gg_tma_2d(qs + c * BOX, &maps->q, h * DH + 64 * c, b * S + i0, barQ);
    for (int t = 0; t < nT; t++) {
      const int s = t % STAGES;
      const unsigned ph = (t / STAGES) & 1;
      gg_bar_wait(emptyK + 8 * s, ph ^ 1);  // a fresh barrier's parity-1 phase counts as complete
      // Tile t is chunk ck's rows from pos - ck*C on, on the rank that
      // holds ck (its early chunk below W, else its late one).
      const int pos = t * AH_BN, ck = pos / C;
      const int owner = ck < W ? ck : 2 * W - 1 - ck;
      const int row = b * S + (ck < W ? 0 : C) + pos - ck * C;
      gg_bar_expect_tx(fullK + 8 * s, TILE);
#pragma unroll
      for (int c = 0; c < DH / 64; c++)
        gg_tma_2d(ks + s * TILE + c * BOX, &maps->k[owner], kvh * DH + 64 * c, row, fullK + 8 * s);
      gg_bar_wait(emptyV + 8 * s, ph ^ 1);
      gg_bar_expect_tx(fullV + 8 * s, TILE);
#pragma unroll
      for (int c = 0; c < DH / 64; c++)
        gg_tma_2d(vs + s * TILE + c * BOX, &maps->v[owner], kvh * DH + 64 * c, row, fullV + 8 * s);
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
  // Consumer cw owns local rows [i0 + 64cw, i0 + 64cw + 64); this thread
  // rows r0 and r0 + 8 of them. Both consumers see all nT tiles.
  const int cw = (warp >> 2) - 1, g = lane >> 2, t4 = lane & 3;
  const int w0 = i0 + 64 * cw, r0 = w0 + 16 * (warp & 3) + g, r1 = r0 + 8;
  float o[DH / 2];
#pragma unroll
  for (int i = 0; i < DH / 2; i++) o[i] = 0.0f;
  float m0 = ah_neg_inf(), m1 = ah_neg_inf(), l0 = 0.0f, l1 = 0.0f;
  gg_bar_wait(barQ, 0);
  const unsigned long long dq = gg_desc(qs + cw * 64 * 128);
  // Every tile (both consumers see all nT), masked on the diagonal only
  // (no key past the positions: KS out of reach).
  ah_fwd_tiles<DH, STAGES, false>(o, m0, m1, l0, l1, nT, 0, dq, ks, vs, fullK, fullV, emptyK, emptyV, 0, lane, off, w0, r0, r1,
                                  0x3fffffff, t4, scaleLog2);
  // lse [B, 2, H, C]: the block's chunk n, row r - nC of it.
  ah_fwd_store<DH>(o, m0, m1, l0, l1, out, lse + ((long long)(b * 2 + n) * H + h) * C - (long long)n * C, b, h, S, H, r0, r1,
                   t4);
}

extern "C" __global__ void __launch_bounds__(384, 1) attn_h_zz_forward_d64(const __grid_constant__ ah_zz_maps maps, float* out, float* lse, int r, int W, int C, int H, int KV, float scaleLog2, int band) {
  ah_zz_forward<64>(&maps, out, lse, r, W, C, H, KV, scaleLog2, band);
}

extern "C" __global__ void __launch_bounds__(384, 1) attn_h_zz_forward_d128(const __grid_constant__ ah_zz_maps maps, float* out, float* lse, int r, int W, int C, int H, int KV, float scaleLog2, int band) {
  ah_zz_forward<128>(&maps, out, lse, r, W, C, H, KV, scaleLog2, band);
}

extern "C" __global__ void __launch_bounds__(512, 1) attn_h_forward_d64(const __grid_constant__ gg_tmap mapQ, const __grid_constant__ gg_tmap mapK, const __grid_constant__ gg_tmap mapV, float* out, float* lse, int S, int KS, int off, int H, int KV, float scaleLog2, int band, int pairs) {
  ah_forward_walk<64, float, ah_fwd_nc<64>::NC>(&mapQ, &mapK, &mapV, out, lse, S, KS, off, H, KV, scaleLog2, band, pairs);
}

extern "C" __global__ void __launch_bounds__(384, 1) attn_h_forward_d128(const __grid_constant__ gg_tmap mapQ, const __grid_constant__ gg_tmap mapK, const __grid_constant__ gg_tmap mapV, float* out, float* lse, int S, int KS, int off, int H, int KV, float scaleLog2, int band) {
  ah_forward<128, float, ah_fwd_nc<128>::NC>(&mapQ, &mapK, &mapV, out, lse, S, KS, off, H, KV, scaleLog2, band);
}

// attn_h_forward_d{64,128}_bf16: the same with a bf16 out (the output
// projection's operand), each value rounded once.
extern "C" __global__ void __launch_bounds__(512, 1) attn_h_forward_d64_bf16(const __grid_constant__ gg_tmap mapQ, const __grid_constant__ gg_tmap mapK, const __grid_constant__ gg_tmap mapV, mk_bf16* out, float* lse, int S, int KS, int off, int H, int KV, float scaleLog2, int band, int pairs) {
  ah_forward_walk<64, mk_bf16, ah_fwd_nc<64>::NC>(&mapQ, &mapK, &mapV, out, lse, S, KS, off, H, KV, scaleLog2, band, pairs);
}

extern "C" __global__ void __launch_bounds__(384, 1) attn_h_forward_d128_bf16(const __grid_constant__ gg_tmap mapQ, const __grid_constant__ gg_tmap mapK, const __grid_constant__ gg_tmap mapV, mk_bf16* out, float* lse, int S, int KS, int off, int H, int KV, float scaleLog2, int band) {
  ah_forward<128, mk_bf16, ah_fwd_nc<128>::NC>(&mapQ, &mapK, &mapV, out, lse, S, KS, off, H, KV, scaleLog2, band);
}

// ---- backward ----
//
// One kernel computes dk and dv and adds dq, after attn_h_delta. A block
// owns 128 keys of one (sequence, kv head) and walks every query head of
// the kv head's group and every query tile (128 queries at head dim 64,
// 64 at 128) that sees one of its keys (an item); a producer warpgroup
// (ah_bwd_block) loads its k and v tiles once and each item's q and dout
// tiles into a STAGES-deep ring, refilling a stage once both consumer
// warpgroups are done with it, and copies each item's lse and delta into
// shared memory. Each of the two consumer warpgroups owns 64 keys and
// computes, per item, with the scores transposed (keys are the rows, so
// that P^T and dS^T land in registers as the A operands of the products
// that accumulate into the keys' rows):
//
//   S^T = k q^T, dP^T = v dout^T   wgmma m64n128k16 (head dim 64) or
//                                  m64n64k16, shared memory, K-major
//   P'^T = 2^(S^T*scale - lse + log2 scale), which is P^T scale
//   dS^T = P'^T (dP^T - delta)     = P^T (dP^T - delta) scale, with no
//                                  multiply by scale (1/sqrt(Dh)) an
//                                  element
//   dv += P'^T dout, dk += dS^T q  wgmma m64nDhk16, A from registers, q and
//                                  dout MN-major (transpose bit); dv
//                                  multiplied by 1/scale once at the end
//   dq += dS k                     dS^T stored to shared memory in the
//                                  128-byte swizzled MN-major layout, then
//                                  wgmma m64n64k16 with both operands
//                                  transposed over all 128 keys (both
//                                  warpgroups' dS^T, after a 256-thread
//                                  barrier): at head dim 64 each
//                                  warpgroup takes its 64-query half, at
//                                  128 its 64 of dq's columns. Staged in
//                                  shared memory and added to dq by TMA
//                                  reductions (cp.reduce.async.bulk): one
//                                  block per warpgroup and item, issued
//                                  by the consumer at head dim 64 and by
//                                  the producer warpgroup's writer warp
//                                  at 128
//
// dk and dv stay in registers across the whole walk (GQA needs no partial
// sums per head) and are stored once. dq must be zero before the kernel;
// its sums are float adds at L2 in the order the blocks run, so dq's last
// bits vary from run to run (train.deterministic takes attention_tc.cu's
// ordered backward instead: kernels/attention_hopper.md).
// delta is rowsum(dout * out) per query and head, from dout rounded to
// bf16 as dP^T sees it.

#define AH_BQ 64        // the rows of a backward q, dout or dq box (TMA)
#define AH_NO_END 0x3fffffff  // a sequence length no position reaches (the ring's masks)
#define AH_LOG2E 1.4426950408889634f
// Named barriers of head dim 128's backward block (besides 3, the two
// consumers' meeting every item): dq's staging buffers, 2cw + buffer on
// from each base, full (consumer cw arrives, the writer warp waits) and
// empty (the writer arrives, consumer cw waits); 160 threads each.
#define AH_BAR_DQ_FULL 4
#define AH_BAR_DQ_EMPTY 8

struct alignas(16) ah_f4 {
  float x, y, z, w;
};

// ah_bcfg is the backward block's layout at head dim DH: items of BQ
// queries (128 at head dim 64, FlashAttention-3's tile there; 64 at 128,
// where a consumer's registers hold no more), q and dout tiles of
// (DH/64) x (BQ/64) TMA boxes of 64 rows (box (c, r): columns 64c.., rows
// 64r.., at (c*(BQ/64) + r) * QBOX), DQBUF dq staging buffers a warpgroup.
template <int DH>
struct ah_bcfg {
  static constexpr int STAGES = 2;
  static constexpr int BQ = DH == 64 ? 128 : 64;                // queries per item
  static constexpr int DQBUF = DH == 64 ? 1 : 2;                // dq staging buffers a warpgroup
  static constexpr unsigned KBOX = 128 * 128;                   // {64 columns, 128 key rows} of bf16: 16 KiB
  static constexpr unsigned QBOX = AH_BQ * 128;                 // {64 columns, 64 query rows}: 8 KiB
  static constexpr unsigned KT = (DH / 64) * KBOX;              // the k (or v) tile
  static constexpr unsigned QT = (DH / 64) * (BQ / 64) * QBOX;  // a q (or dout) tile
  static constexpr unsigned DSB = 64 * BQ * 2;                  // one warpgroup's dS^T: 64 keys x BQ queries
  static constexpr unsigned DQB = 64 * 64 * 4;                  // a dq staging block: 64 queries x 64 columns
  static constexpr unsigned STAT = BQ * 8;                      // a stage's lse and delta
  // k, v, STAGES x (q, dout), dS^T [2 parities][2 warpgroups], dq staging
  // [2 warpgroups][DQBUF], lse and delta [STAGES][2][BQ], barriers.
  static constexpr unsigned SMEM =
      1024 + 2 * KT + STAGES * 2 * QT + 4 * DSB + 2 * DQBUF * DQB + STAGES * STAT + 8 * (1 + 2 * STAGES);
};

__device__ __forceinline__ void ah_sts(unsigned addr, unsigned v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void ah_sts2f(unsigned addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ void ah_stsf(unsigned addr, float a) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(a) : "memory");
}
__device__ __forceinline__ void ah_lds2f(unsigned addr, float& a, float& b) {
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(a), "=f"(b) : "r"(addr) : "memory");
}

// ah_bwd_scores issues a backward item's S^T = k q^T and dP^T = v dout^T
// (wgmma m64n64k16 from shared memory, K-major, Dh/16 steps each) as one
// commit group; the caller waits for it.
template <int DH>
__device__ __forceinline__ void ah_bwd_scores(float (&sc)[32], float (&dp)[32], unsigned long long descK, unsigned long long descV,
                                              unsigned long long descQ, unsigned long long descO) {
  constexpr unsigned KBOX = 128 * 128, QBOX = AH_BQ * 128;
  gg_wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < DH / 16; kk++) {
    const unsigned long long kstep = (kk / 4) * (KBOX >> 4) + 2 * (kk % 4), qstep = (kk / 4) * (QBOX >> 4) + 2 * (kk % 4);
    ah_wgmma_ss<0, 0>(sc, descK + kstep, descQ + qstep, kk > 0 ? 1 : 0);
  }
#pragma unroll
  for (int kk = 0; kk < DH / 16; kk++) {
    const unsigned long long kstep = (kk / 4) * (KBOX >> 4) + 2 * (kk % 4), qstep = (kk / 4) * (QBOX >> 4) + 2 * (kk % 4);
    ah_wgmma_ss<0, 0>(dp, descV + kstep, descO + qstep, kk > 0 ? 1 : 0);
  }
  gg_wgmma_commit();
}

// ah_bwd_pack packs this thread's P^T and dS^T (sc and dp, as
// ah_bwd_probs left them) into bf16 A operands: k16 chunk kk is n blocks
// 2kk and 2kk + 1.
__device__ __forceinline__ void ah_bwd_pack(unsigned (&pa)[4][4], unsigned (&da)[4][4], const float (&sc)[32],
                                            const float (&dp)[32]) {
#pragma unroll
  for (int n = 0; n < 8; n++) {
    pa[n >> 1][2 * (n & 1)] = gg_pack_bf16(sc[4 * n], sc[4 * n + 1]);
    pa[n >> 1][2 * (n & 1) + 1] = gg_pack_bf16(sc[4 * n + 2], sc[4 * n + 3]);
    da[n >> 1][2 * (n & 1)] = gg_pack_bf16(dp[4 * n], dp[4 * n + 1]);
    da[n >> 1][2 * (n & 1) + 1] = gg_pack_bf16(dp[4 * n + 2], dp[4 * n + 3]);
  }
}

// ah_bwd_rs issues acc += A t over an item's 64 queries (dv's product with
// P^T and dout's tile, dk's with dS^T and q's): wgmma m64nDHk16, A from
// registers, the tile at t MN-major (transpose bit), 16 queries (2048
// bytes) a step. The caller fences and commits.
template <int DH>
__device__ __forceinline__ void ah_bwd_rs(float (&acc)[DH / 2], const unsigned (&a)[4][4], unsigned t) {
  const unsigned long long mn = gg_desc_mn(t, AH_BQ * 128);
#pragma unroll
  for (int kk = 0; kk < AH_BQ / 16; kk++) ah_wgmma_rs(acc, a[kk], mn + 128 * kk);
}

// ah_bwd_probs turns this thread's S^T and dP^T (key rows kr0 and kr0 +
// 8; column 8n + 2t4 + e is query q0 + 8n + 2t4 + e) into P'^T = P^T
// scale = 2^(S^T*scale - lse2) (lse2 = lse log2 e - log2 scale, as the
// producer stored it) and dS^T = P'^T (dP^T - delta), 0 where the
// key does not see the query (key kr sees query i iff kr - off <= i <
// S and kr < KS). A block whose every key sees every query (whole,
// uniform over the warpgroup) takes no mask at all; otherwise a hidden
// element's exponent is -inf, whose ex2 is +0: no branch per element (a
// conditional ex2 became a divergent branch each, about 590 instructions
// for 32 elements, and cost 10-14% of the backward:
// kernels/attention_hopper.md). stats(n, l2, dl) gives column block n's
// lse2 and delta.
template <typename Stats>
__device__ __forceinline__ void ah_bwd_probs(float (&sc)[32], float (&dp)[32], bool whole, int q0, int t4, int kr0,
                                             int S, int KS, int off, float scaleLog2, Stats stats) {
  if (whole) {
#pragma unroll
    for (int n = 0; n < 8; n++) {
      float l2[2], dl[2];
      stats(n, l2, dl);
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const float p0 = ah_ex2(sc[4 * n + e] * scaleLog2 - l2[e]);
        const float p1 = ah_ex2(sc[4 * n + 2 + e] * scaleLog2 - l2[e]);
        sc[4 * n + e] = p0;
        sc[4 * n + 2 + e] = p1;
        dp[4 * n + e] = p0 * (dp[4 * n + e] - dl[e]);
        dp[4 * n + 2 + e] = p1 * (dp[4 * n + 2 + e] - dl[e]);
      }
    }
    return;
  }
  // Key row kr sees query i iff kr - off <= i < S and kr < KS: in terms of
  // the column's offset c = 8n + e from this thread's first query q0 +
  // 2t4, iff lo <= c < end.
  const int first = q0 + 2 * t4, end = S - first;
  const int lo0 = kr0 < KS ? kr0 - off - first : 0x7fffffff, lo1 = kr0 + 8 < KS ? kr0 + 8 - off - first : 0x7fffffff;
#pragma unroll
  for (int n = 0; n < 8; n++) {
    float l2[2], dl[2];
    stats(n, l2, dl);
#pragma unroll
    for (int e = 0; e < 2; e++) {
      const int c = 8 * n + e;
      const float x0 = sc[4 * n + e] * scaleLog2 - l2[e], x1 = sc[4 * n + 2 + e] * scaleLog2 - l2[e];
      const float p0 = ah_ex2(c >= lo0 && c < end ? x0 : ah_neg_inf());
      const float p1 = ah_ex2(c >= lo1 && c < end ? x1 : ah_neg_inf());
      sc[4 * n + e] = p0;
      sc[4 * n + 2 + e] = p1;
      dp[4 * n + e] = p0 * (dp[4 * n + e] - dl[e]);
      dp[4 * n + 2 + e] = p1 * (dp[4 * n + 2 + e] - dl[e]);
    }
  }
}

// ah_store_dst writes this thread's part of a warpgroup's dS^T (da, as
// ah_bwd_pack packed it) to its buffer dsb, for dq's product to read
// through a descriptor: key row r holds its 64 queries in 128 bytes,
// 16-byte chunk n at n ^ (r & 7).
__device__ __forceinline__ void ah_store_dst(unsigned dsb, const unsigned (&da)[4][4], int wr, int t4) {
#pragma unroll
  for (int n = 0; n < 8; n++) {
    ah_sts(dsb + wr * 128 + ((n ^ (wr & 7)) << 4) + 4 * t4, da[n >> 1][2 * (n & 1)]);
    ah_sts(dsb + (wr + 8) * 128 + ((n ^ ((wr + 8) & 7)) << 4) + 4 * t4, da[n >> 1][2 * (n & 1) + 1]);
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ah_stage_dq writes a warpgroup's 64 x 64 block of dq (this thread's
// acc: rows wr and wr + 8, columns 8n + 2t4, +1) at stg as two TMA boxes
// of {32 columns, 64 rows} float32, 128-byte swizzled (row r's 16-byte
// chunk x at x ^ (r & 7)), for one thread to add to dq at L2.
__device__ __forceinline__ void ah_stage_dq(unsigned stg, const float (&acc)[32], int wr, int t4) {
  constexpr unsigned DQB = 64 * 64 * 4;
#pragma unroll
  for (int n = 0; n < 8; n++) {
    const unsigned box = stg + (n >> 2) * (DQB / 2), x = 2 * (n & 3) + (t4 >> 1), off8 = 8 * (t4 & 1);
    ah_sts2f(box + wr * 128 + ((x ^ (wr & 7)) << 4) + off8, acc[4 * n], acc[4 * n + 1]);
    ah_sts2f(box + (wr + 8) * 128 + ((x ^ ((wr + 8) & 7)) << 4) + off8, acc[4 * n + 2], acc[4 * n + 3]);
  }
}

// ah_store_dkdv stores this thread's rows of dk and dv (key rows kr0 and
// kr0 + 8 of sequence b, kv head kvh; columns 8i + 2t4, +1), the rows past
// KS not.
template <int DH>
__device__ __forceinline__ void ah_store_dkdv(float* dk, float* dv, const float (&dka)[DH / 2], const float (&dva)[DH / 2], int b,
                                              int kvh, int KS, int KV, int kr0, int t4) {
  const int KD = KV * DH, kr1 = kr0 + 8;
  float* k0 = dk + ((long long)b * KS + kr0) * KD + kvh * DH + 2 * t4;
  float* v0 = dv + ((long long)b * KS + kr0) * KD + kvh * DH + 2 * t4;
#pragma unroll
  for (int i = 0; i < DH / 8; i++) {
    if (kr0 < KS) {
      asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(k0 + 8 * i), "f"(dka[4 * i]), "f"(dka[4 * i + 1]) : "memory");
      asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(v0 + 8 * i), "f"(dva[4 * i]), "f"(dva[4 * i + 1]) : "memory");
    }
    if (kr1 < KS) {
      asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(k0 + 8LL * KD + 8 * i), "f"(dka[4 * i + 2]), "f"(dka[4 * i + 3])
                   : "memory");
      asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(v0 + 8LL * KD + 8 * i), "f"(dva[4 * i + 2]), "f"(dva[4 * i + 3])
                   : "memory");
    }
  }
}

// ---- The backward block, shared by the whole sequence and the ring ----
//
// A backward block owns 128 keys of one (sequence, kv head) and walks
// items: one tile of BQ queries (ah_bcfg) of one query head of the group
// each, in the order its walk gives. Its shared memory (ah_bcfg) holds k
// and v once, STAGES stages of q and dout, dS^T [parity][warpgroup], dq
// staging [warpgroup][DQBUF], the stages' statistics (BQ lse, BQ delta
// each) and the barriers. 384 threads: a producer warpgroup (warp 0
// working; at head dim 128 warp 1 too, dq's writer) fills the stages; two
// consumer warpgroups of 64 keys each
// compute, at setmaxnreg 240 against the producer's 24 (168 at entry:
// 128 x 24 + 256 x 240 fits the register file's 65,536). What a
// whole-sequence kernel and a ring kernel differ in is the walk
// (ah_bwd_item), which keys see which queries, where k and v come from
// and where dk and dv go: ah_bwd_block takes those and runs the rest,
// head dim 64's consumers (version 7 in kernels/attention_hopper.md) or
// 128's (version 8).

// ah_bwd_item is one item as the walk gives it.
struct ah_bwd_item {
  int h;                     // the query head
  int q0;                    // the tile's first query position (the mask's frame)
  int row;                   // the tile's first row in q's, dout's and dq's tensor maps
  const gg_tmap *q, *dout;   // where its q and dout are read
  const gg_tmap* dq;         // and its dq blocks added
  const float *lse, *delta;  // the statistics of its first query (lse in natural log)
  int valid;                 // how many of its queries have statistics (the rest read zeros, add no dq)
};

// ah_bwd_smem is the block's shared-memory layout at the aligned base.
template <int DH>
struct ah_bwd_smem {
  using cfg = ah_bcfg<DH>;
  unsigned ks, vs, qs, dss, dqs, stat, barKV, full, empty;
  __device__ __forceinline__ explicit ah_bwd_smem(unsigned base) {
    ks = base;
    vs = base + cfg::KT;
    qs = base + 2 * cfg::KT;                   // stage s: q at qs + 2*QT*s, dout QT on
    dss = qs + cfg::STAGES * 2 * cfg::QT;      // dS^T [parity][warpgroup]
    dqs = dss + 4 * cfg::DSB;                  // dq staging [warpgroup][DQBUF]
    stat = dqs + 2 * cfg::DQBUF * cfg::DQB;    // [stage]: BQ lse, BQ delta
    barKV = stat + cfg::STAGES * cfg::STAT;
    full = barKV + 8;
    empty = full + 8 * cfg::STAGES;
  }
};

// ah_bwd_produce is the producer warp's walk: for each item, once both
// consumers have freed its stage, lane 0 loads the q and dout tiles and
// the 32 lanes copy BQ/32 queries' statistics each into the stage's (zeros
// past valid): delta, and lse as the exponent of ah_bwd_probs wants it,
// lse2 = lse log2 e - lg2s (lg2s = log2 scale, so that the exponential
// gives P^T * scale), all arriving on the stage's full barrier (33
// arrivals: the expect_tx and the lanes). So the consumers never wait on
// global loads, and do no arithmetic on the statistics.
template <int DH, typename Walk>
__device__ __forceinline__ void ah_bwd_produce(const ah_bwd_smem<DH>& m, int items, int lane, Walk walk, float lg2s) {
  using cfg = ah_bcfg<DH>;
  for (int it = 0; it < items; it++) {
    const int s = it % cfg::STAGES;
    const unsigned ph = (it / cfg::STAGES) & 1;
    ah_bwd_item at;
    walk(it, at);
    gg_bar_wait(m.empty + 8 * s, ph ^ 1);
    if (lane == 0) {
      const unsigned qa = m.qs + s * 2 * cfg::QT;
      gg_bar_expect_tx(m.full + 8 * s, 2 * cfg::QT);
#pragma unroll
      for (int c = 0; c < DH / 64; c++) {
#pragma unroll
        for (int r = 0; r < cfg::BQ / 64; r++) {
          const unsigned box = (c * (cfg::BQ / 64) + r) * cfg::QBOX;
          gg_tma_2d(qa + box, at.q, at.h * DH + 64 * c, at.row + 64 * r, m.full + 8 * s);
          gg_tma_2d(qa + cfg::QT + box, at.dout, at.h * DH + 64 * c, at.row + 64 * r, m.full + 8 * s);
        }
      }
    }
    const unsigned st = m.stat + s * cfg::STAT;
#pragma unroll
    for (int e = 0; e < cfg::BQ / 32; e++) {
      const int c = lane + 32 * e;
      ah_stsf(st + 4 * c, c < at.valid ? at.lse[c] * AH_LOG2E - lg2s : 0.0f);
      ah_stsf(st + 4 * cfg::BQ + 4 * c, c < at.valid ? at.delta[c] : 0.0f);
    }
    gg_bar_arrive(m.full + 8 * s);
  }
}

// ah_bwd_whole says whether each of the 64 keys from kw sees each of the
// BQ queries from q0 (key kr sees query i iff kr - off <= i < S and
// kr < KS): such a tile takes no mask.
template <int BQ>
__device__ __forceinline__ bool ah_bwd_whole(int kw, int q0, int S, int KS, int off) {
  return kw + 63 <= off + q0 && q0 + BQ <= S && kw + 63 < KS;
}

// ah_bwd_stats reads column block n's lse2 (ah_bwd_produce) and delta
// from a stage's statistics st of BQ queries, for ah_bwd_probs: this
// thread's columns 8n + 2t4 and 8n + 2t4 + 1.
template <int BQ>
__device__ __forceinline__ void ah_bwd_stats(unsigned st, int n, int t4, float (&l2)[2], float (&dl)[2]) {
  ah_lds2f(st + 4 * (8 * n + 2 * t4), l2[0], l2[1]);
  ah_lds2f(st + 4 * BQ + 4 * (8 * n + 2 * t4), dl[0], dl[1]);
}

// ah_bwd64_consume is a consumer warpgroup of head dim 64's block
// (version 7 in kernels/attention_hopper.md, FlashAttention-3's at this
// head dim): it owns the 64 keys from position kw (shared-memory key rows
// 64cw on) and takes items of 128 queries. Per item it computes S^T and
// dP^T (wgmma m64n128k16: 64 floats each a thread), P^T and dS^T
// (ah_bwd_probs on each 64-query half), dv's and dk's products over the
// 128 queries (eight k16 steps each), stores dS^T, meets the other
// consumer (a 256-thread barrier: dq needs both warpgroups' dS^T) and
// computes dq for its own 64-query half over all 128 keys, one staged
// block added by TMA reductions (none for a half past valid). The stage is
// freed once dq's product is waited for, which covers dv's and dk's. Key
// kr sees query i iff kr - off <= i < S and kr < KS. This thread's rows
// wr and wr + 8 of dk and dv are left in dka and dva.
template <typename Walk>
__device__ __forceinline__ void ah_bwd64_consume(float (&dka)[32], float (&dva)[32], const ah_bwd_smem<64>& m, int items,
                                                 int cw, int kw, int S, int KS, int off, float scaleLog2, Walk walk) {
  constexpr int DH = 64;
  using cfg = ah_bcfg<DH>;
  constexpr int BQ = cfg::BQ;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int t4 = lane & 3, wtid = tid & 127, wr = 16 * (warp & 3) + (lane >> 2), kr0 = kw + wr;
#pragma unroll
  for (int i = 0; i < DH / 2; i++) dka[i] = dva[i] = 0.0f;
  gg_bar_wait(m.barKV, 0);
  const unsigned long long descK = gg_desc(m.ks + cw * 64 * 128), descV = gg_desc(m.vs + cw * 64 * 128);
  const unsigned long long mnKa = gg_desc_mn(m.ks, cfg::KBOX);  // all 128 keys, for dq
  for (int it = 0; it < items; it++) {
    const int s = it % cfg::STAGES;
    const unsigned ph = (it / cfg::STAGES) & 1;
    const unsigned qa = m.qs + s * 2 * cfg::QT, oa = qa + cfg::QT, st = m.stat + s * cfg::STAT;
    float sc[64], dp[64];
    gg_bar_wait(m.full + 8 * s, ph);
    asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
    // S^T = k q^T and dP^T = v dout^T: m64n128k16, four k16 steps of the
    // head dim (32 bytes each within the 128-byte rows; the tile's two
    // 64-row boxes make one 128-row operand).
    {
      const unsigned long long descQ = gg_desc(qa), descO = gg_desc(oa);
      gg_wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DH / 16; kk++) gg_wgmma(sc, descK + 2 * kk, descQ + 2 * kk, kk > 0 ? 1 : 0);
#pragma unroll
      for (int kk = 0; kk < DH / 16; kk++) gg_wgmma(dp, descV + 2 * kk, descO + 2 * kk, kk > 0 ? 1 : 0);
      gg_wgmma_commit();
      gg_wgmma_wait<0>();
      gg_fence_acc(sc);
      gg_fence_acc(dp);
    }
    // P^T and dS^T in place of S^T and dP^T, a 64-query half at a time
    // (columns 64hf..; column 8n + 2t4 + e of a half is its query
    // 8n + 2t4 + e), then packed to bf16 A operands: half hf's k16 chunk kk
    // is pa[4hf + kk].
    ah_bwd_item at;
    walk(it, at);
    const bool whole = ah_bwd_whole<BQ>(kw, at.q0, S, KS, off);
    unsigned pa[8][4], da[8][4];
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
      float(&sch)[32] = *reinterpret_cast<float(*)[32]>(&sc[32 * hf]);
      float(&dph)[32] = *reinterpret_cast<float(*)[32]>(&dp[32 * hf]);
      ah_bwd_probs(sch, dph, whole, at.q0 + 64 * hf, t4, kr0, S, KS, off, scaleLog2,
                   [&](int n, float (&l2)[2], float (&dl)[2]) { ah_bwd_stats<BQ>(st, n + 8 * hf, t4, l2, dl); });
    }
#pragma unroll
    for (int hf = 0; hf < 2; hf++)
      ah_bwd_pack(*reinterpret_cast<unsigned(*)[4][4]>(&pa[4 * hf]), *reinterpret_cast<unsigned(*)[4][4]>(&da[4 * hf]),
                  *reinterpret_cast<const float(*)[32]>(&sc[32 * hf]), *reinterpret_cast<const float(*)[32]>(&dp[32 * hf]));
    // dv += P^T dout, dk += dS^T q over the 128 queries: each half's four
    // k16 steps from its 64-row box.
    gg_wgmma_fence();
    gg_fence_acc(dva);
    gg_fence_acc(dka);
#pragma unroll
    for (int hf = 0; hf < 2; hf++)
      ah_bwd_rs<DH>(dva, *reinterpret_cast<const unsigned(*)[4][4]>(&pa[4 * hf]), oa + hf * cfg::QBOX);
#pragma unroll
    for (int hf = 0; hf < 2; hf++)
      ah_bwd_rs<DH>(dka, *reinterpret_cast<const unsigned(*)[4][4]>(&da[4 * hf]), qa + hf * cfg::QBOX);
    gg_wgmma_commit();
    // dS^T to this warpgroup's buffer of the item's parity, as two 64-query
    // halves. The other warpgroup read this buffer two items ago and was
    // done before it reached the 256-thread barrier below of the item
    // before, which this warpgroup has passed.
    const unsigned dsb = m.dss + ((it & 1) * 2 + cw) * cfg::DSB;
#pragma unroll
    for (int hf = 0; hf < 2; hf++)
      ah_store_dst(dsb + hf * (cfg::DSB / 2), *reinterpret_cast<const unsigned(*)[4][4]>(&da[4 * hf]), wr, t4);
    // This warpgroup's dq block of the item before has been read out of
    // its staging buffer before anyone here passes the barrier.
    if (wtid == 0) gg_bulk_wait_read();
    gg_named_sync(3, 256);  // both warpgroups' dS^T are in
    // dq for this warpgroup's 64-query half over all 128 keys: dS from both
    // warpgroups' buffers (keys 64j.. in warpgroup j's), k's 128 rows.
    // m64n64k16, 16 keys a step.
    float acc[32];
    asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
    gg_wgmma_fence();
    const unsigned pb = m.dss + (it & 1) * 2 * cfg::DSB + cw * (cfg::DSB / 2);
    const unsigned long long mnD0 = gg_desc_mn(pb, cfg::DSB / 2), mnD1 = gg_desc_mn(pb + cfg::DSB, cfg::DSB / 2);
#pragma unroll
    for (int kk = 0; kk < 8; kk++)
      ah_wgmma_ss<1, 1>(acc, (kk < 4 ? mnD0 : mnD1) + 128 * (kk & 3), mnKa + 128 * kk, kk > 0 ? 1 : 0);
    gg_wgmma_commit();
    gg_wgmma_wait<0>();
    gg_fence_acc(acc);
    // dv's and dk's products (the group before) are done with the stage.
    gg_fence_acc(dva);
    gg_fence_acc(dka);
    if (lane == 0) gg_bar_arrive(m.empty + 8 * s);
    const unsigned stg = m.dqs + cw * cfg::DQB;
    ah_stage_dq(stg, acc, wr, t4);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    gg_named_sync(1 + cw, 128);
    // A half past the queries (the last item's second, at the end of a
    // sequence) holds dS 0 and adds nothing.
    if (wtid == 0 && 64 * cw < at.valid) {
      gg_tma_reduce_add_2d(at.dq, at.h * DH, at.row + 64 * cw, stg);
      gg_tma_reduce_add_2d(at.dq, at.h * DH + 32, at.row + 64 * cw, stg + cfg::DQB / 2);
      gg_bulk_commit();
    }
  }
  if (wtid == 0) gg_bulk_wait();
}

// ah_bwd128_consume is a consumer warpgroup of head dim 128's block
// (version 8), ah_bwd64_consume's contract with items of 64 queries (240
// registers hold no more beside dk and dv): per item it computes the
// scores, P^T and dS^T (ah_bwd_probs; the statistics a column block at a
// time, which 240 registers hold beside dk, dv, S^T and dP^T), issues
// dv's product, stores dS^T, meets the other consumer (a 256-thread
// barrier: dq needs both warpgroups' dS^T), issues dq's product over all
// 128 keys for its 64 of dq's columns and then dk's, and waits for dv's
// and dq's only (wgmma.wait_group 1): dk's product runs under dq's
// staging, and the stage is freed once the next item's scores are waited
// for, which covers it. dq's block goes to the writer warp
// (ah_bwd_dq_writer) through one of two staging buffers: the warpgroup
// waits until the writer has read what the buffer held two items ago,
// stages the block and marks it full without waiting (version 8).
template <typename Walk>
__device__ __forceinline__ void ah_bwd128_consume(float (&dka)[64], float (&dva)[64], const ah_bwd_smem<128>& m, int items,
                                                  int cw, int kw, int S, int KS, int off, float scaleLog2, Walk walk) {
  constexpr int DH = 128;
  constexpr int STAGES = ah_bcfg<DH>::STAGES;
  constexpr unsigned KBOX = ah_bcfg<DH>::KBOX, QT = ah_bcfg<DH>::QT, DSB = ah_bcfg<DH>::DSB, DQB = ah_bcfg<DH>::DQB;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int t4 = lane & 3, wtid = tid & 127, wr = 16 * (warp & 3) + (lane >> 2), kr0 = kw + wr;
#pragma unroll
  for (int i = 0; i < DH / 2; i++) dka[i] = dva[i] = 0.0f;
  gg_bar_wait(m.barKV, 0);
  const unsigned long long descK = gg_desc(m.ks + cw * 64 * 128), descV = gg_desc(m.vs + cw * 64 * 128);
  for (int it = 0; it < items; it++) {
    const int s = it % STAGES;
    const unsigned ph = (it / STAGES) & 1;
    ah_bwd_item at;
    walk(it, at);
    const unsigned qa = m.qs + s * 2 * QT, oa = qa + QT;
    float sc[32], dp[32];
    gg_bar_wait(m.full + 8 * s, ph);
    asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
    const unsigned long long descQ = gg_desc(qa), descO = gg_desc(oa);
    ah_bwd_scores<DH>(sc, dp, descK, descV, descQ, descO);
    gg_wgmma_wait<0>();
    gg_fence_acc(sc);
    gg_fence_acc(dp);
    // The item before's dk product (left in flight under its dq staging)
    // is done with its stage too.
    if (it > 0) {
      gg_fence_acc(dka);
      if (lane == 0) gg_bar_arrive(m.empty + 8 * ((it - 1) % STAGES));
    }
    const unsigned st = m.stat + s * ah_bcfg<DH>::STAT;
    ah_bwd_probs(sc, dp, ah_bwd_whole<ah_bcfg<DH>::BQ>(kw, at.q0, S, KS, off), at.q0, t4, kr0, S, KS, off, scaleLog2,
                 [&](int n, float (&l2)[2], float (&dl)[2]) { ah_bwd_stats<ah_bcfg<DH>::BQ>(st, n, t4, l2, dl); });
    unsigned da[4][4];
    // dv's product now, dk's after dq's (FlashAttention-3's order): dq's
    // result comes back a product earlier and dk's runs under its staging.
    {
      unsigned pa[4][4];
      ah_bwd_pack(pa, da, sc, dp);
      gg_wgmma_fence();
      gg_fence_acc(dva);
      ah_bwd_rs<DH>(dva, pa, oa);
      gg_wgmma_commit();
    }
    const unsigned dsb = m.dss + ((it & 1) * 2 + cw) * DSB;
    ah_store_dst(dsb, da, wr, t4);
    gg_named_sync(3, 256);  // both warpgroups' dS^T are in
    // This warpgroup's 64 columns of dq over all 128 keys (keys 64j.. from
    // warpgroup j's buffer).
    float acc[32];
    asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
    gg_wgmma_fence();
    const unsigned long long mnK = gg_desc_mn(m.ks + cw * KBOX, KBOX);
#pragma unroll
    for (int kk = 0; kk < 8; kk++) {
      const unsigned long long mnD = gg_desc_mn(m.dss + ((it & 1) * 2 + kk / 4) * DSB, DSB);
      ah_wgmma_ss<1, 1>(acc, mnD + 128 * (kk % 4), mnK + 128 * kk, kk > 0 ? 1 : 0);
    }
    gg_wgmma_commit();
    ah_bwd_rs<DH>(dka, da, qa);
    gg_wgmma_commit();
    gg_wgmma_wait<1>();  // dv's and dq's products; dk's stays in flight (its stage freed at the next item)
    gg_fence_acc(acc);
    gg_fence_acc(dva);
    const int buf = it & 1;
    gg_named_sync(AH_BAR_DQ_EMPTY + 2 * cw + buf, 160);
    ah_stage_dq(m.dqs + (cw * 2 + buf) * DQB, acc, wr, t4);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    gg_named_arrive(AH_BAR_DQ_FULL + 2 * cw + buf, 160);
  }
  gg_wgmma_wait<0>();  // the last item's dk product
  gg_fence_acc(dka);
  // A no-op (this warpgroup issues no bulk operation), but without it
  // ptxas (NVRTC 12.4) serializes every wgmma of the whole-sequence
  // kernel (C7515).
  if (wtid == 0) gg_bulk_wait();
}

// ah_bwd_dq_writer is warp 1 of head dim 128's producer warpgroup: for
// each item, each consumer's staged dq block once it is full (named
// barrier AH_BAR_DQ_FULL + 2cw + buffer), added to dq at L2 by TMA
// reductions; once both are read, their buffers are marked empty
// (AH_BAR_DQ_EMPTY + 2cw + buffer) for the blocks two items on, and all
// four before the first blocks, so that a consumer waits for an empty
// buffer at every item (a block of fewer than two items leaves those
// arrivals pending at its exit, harmlessly: named barriers belong to
// the CTA instance, sixteen each, PTX ISA "barrier"). The consumers used
// to issue the reductions themselves, one thread waiting for the
// buffer's last reduction to be read and its warpgroup for that thread
// at every item: 6% of the backward at B2 S8192, 10-14% of the ring's
// (kernels/attention_hopper.md).
template <typename Walk>
__device__ __forceinline__ void ah_bwd_dq_writer(const ah_bwd_smem<128>& m, int items, int lane, Walk walk) {
  constexpr int DH = 128;
  constexpr unsigned DQB = ah_bcfg<DH>::DQB;
  for (int b = 0; b < 4; b++) gg_named_arrive(AH_BAR_DQ_EMPTY + b, 160);
  for (int it = 0; it < items; it++) {
    const int buf = it & 1;
    ah_bwd_item at;
    walk(it, at);
#pragma unroll 1
    for (int cw = 0; cw < 2; cw++) {
      gg_named_sync(AH_BAR_DQ_FULL + 2 * cw + buf, 160);
      if (lane == 0) {
        const unsigned stg = m.dqs + (cw * 2 + buf) * DQB;
        gg_tma_reduce_add_2d(at.dq, at.h * DH + 64 * cw, at.row, stg);
        gg_tma_reduce_add_2d(at.dq, at.h * DH + 64 * cw + 32, at.row, stg + DQB / 2);
        gg_bulk_commit();
      }
    }
    if (lane == 0) gg_bulk_wait_read();
    asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
    if (it + 2 < items) {
      gg_named_arrive(AH_BAR_DQ_EMPTY + buf, 160);
      gg_named_arrive(AH_BAR_DQ_EMPTY + 2 + buf, 160);
    }
  }
  if (lane == 0) gg_bulk_wait();
}

// ah_bwd_block runs a backward block of head dim DH on the walk it is
// given: countItems() items (counted after the warpgroups part: a count
// made before was spilled across setmaxnreg, NVRTC 12.4), walk(it,
// ah_bwd_item&), the block's first key at
// position kp0, key kr seeing query i iff kr - off <= i < S and kr < KS,
// loadKV(ks, vs, barKV) run by lane 0 of the producer (its tensor-map
// prefetches and the k and v loads, expect_tx included), and store(dka,
// dva, row, t4) for this thread's rows of dk and dv: the block's key rows
// row and row + 8, columns 8i + 2t4 and 8i + 2t4 + 1.
template <int DH, typename Items, typename Walk, typename LoadKV, typename Store>
__device__ __forceinline__ void ah_bwd_block(Items countItems, int kp0, int S, int KS, int off, float scaleLog2, float scale,
                                             Walk walk, LoadKV loadKV, Store store) {
  static_assert(DH == 64 || DH == 128, "the backward block is head dim 64's or 128's");
  constexpr int STAGES = ah_bcfg<DH>::STAGES;
  const ah_bwd_smem<DH> m((gg_smem_addr(ah_smem) + 1023u) & ~1023u);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    gg_bar_init(m.barKV, 1);
    for (int s = 0; s < STAGES; s++) {
      gg_bar_init(m.full + 8 * s, 33);  // the producer's expect_tx and its 32 lanes' statistics
      gg_bar_init(m.empty + 8 * s, 8);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  if (warp < 4) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;" ::: "memory");
    if constexpr (DH == 128) {
      if (warp == 1) {
        ah_bwd_dq_writer(m, countItems(), lane, walk);
        return;
      }
    }
    if (warp != 0) return;
    if (lane == 0) loadKV(m.ks, m.vs, m.barKV);
    ah_bwd_produce<DH>(m, countItems(), lane, walk, ah_lg2(scale));
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;" ::: "memory");
  // Consumer cw owns keys [64cw, 64cw + 64) of the block, at positions
  // from kw on; this thread rows wr and wr + 8 of them.
  const int cw = (warp >> 2) - 1, kw = kp0 + 64 * cw, wr = 16 * (warp & 3) + (lane >> 2);
  float dka[DH / 2], dva[DH / 2];
  const int items = countItems();
  if constexpr (DH == 64) {
    ah_bwd64_consume(dka, dva, m, items, cw, kw, S, KS, off, scaleLog2, walk);
  } else {
    ah_bwd128_consume(dka, dva, m, items, cw, kw, S, KS, off, scaleLog2, walk);
  }
  // dv was accumulated from P^T * scale.
  const float unscale = 1.0f / scale;
#pragma unroll
  for (int i = 0; i < DH / 2; i++) dva[i] *= unscale;
  store(dka, dva, 64 * cw + wr, lane & 3);
}

// ah_backward is the whole sequence's backward at head dim DH: a block
// owns 128 keys of one (sequence, kv head) pair (ah_band's order) and
// walks, per query head of the group, every tile of BQ queries (ah_bcfg)
// from the last down to the first with a query that sees its first key:
// so the blocks of a pair that start together read the same q and dout
// tiles and add into the same dq blocks (from the diagonal up, each
// started on its own tile; kernels/attention_hopper.md, "The backward's
// walk"). q, dout, k and v are read through tensor maps, lse and delta
// from [B, H, S]; dq [B*S, H*DH] float32 takes TMA reductions, and dk
// and dv [B*KS, KV*DH] float32 are stored, their rows past KS not.
template <int DH>
__device__ __forceinline__ void ah_backward(const gg_tmap* mapQ, const gg_tmap* mapDO, const gg_tmap* mapK,
                                            const gg_tmap* mapV, const gg_tmap* mapDQ, const float* lse,
                                            const float* delta, float* dk, float* dv, int S, int KS, int off, int H,
                                            int KV, float scaleLog2, float scale, int band) {
  int pair, kb;
  ah_band(band, pair, kb);
  const int b = pair / KV, kvh = pair % KV, G = H / KV;
  const int j0 = kb * 128;
  constexpr int BQ = ah_bcfg<DH>::BQ;
  const int nQT = (S + BQ - 1) / BQ;
  const int qt0 = gg_max(0, j0 - off) / BQ;  // the first tile with a query that sees key j0
  const int perHead = gg_max(0, nQT - qt0);
  const ah_div byHead(perHead);
  ah_bwd_block<DH>(
      [&] { return G * perHead; }, j0, S, KS, off, scaleLog2, scale,
      [&](int it, ah_bwd_item& at) {
        const int hi = byHead.div(it);
        const int q0 = (nQT - 1 - (it - hi * perHead)) * BQ;
        at.h = kvh * G + hi;
        at.q0 = q0;
        at.row = b * S + q0;
        at.q = mapQ;
        at.dout = mapDO;
        at.dq = mapDQ;
        const long long first = ((long long)b * H + at.h) * S + q0;
        at.lse = lse + first;
        at.delta = delta + first;
        at.valid = S - q0;
      },
      [&](unsigned ks, unsigned vs, unsigned barKV) {
        gg_prefetch_tmap(mapQ);
        gg_prefetch_tmap(mapDO);
        gg_bar_expect_tx(barKV, 2 * ah_bcfg<DH>::KT);
#pragma unroll
        for (int c = 0; c < DH / 64; c++) {
          gg_tma_2d(ks + c * ah_bcfg<DH>::KBOX, mapK, kvh * DH + 64 * c, b * KS + j0, barKV);
          gg_tma_2d(vs + c * ah_bcfg<DH>::KBOX, mapV, kvh * DH + 64 * c, b * KS + j0, barKV);
        }
      },
      [&](const float (&dka)[DH / 2], const float (&dva)[DH / 2], int row, int t4) {
        ah_store_dkdv<DH>(dk, dv, dka, dva, b, kvh, KS, KV, j0 + row, t4);
      });
}

// ---- The fused ring's backward ----
//
// ah_zz_store_dkdv writes a block's dk and dv: stored where it walks every
// query head of its group (gridDim.z 1), added (red.global.add.v2, into dk
// and dv the launch zeroed) where gridDim.z blocks share a key block, each
// walking G/gridDim.z of the heads: a rank's call at 2C/128 key blocks a
// kv head fills an H100 less than twice, and its key blocks' work differs
// by up to 2W times (the early chunk's keys see every later query), so the
// heaviest blocks would set its time.
template <int DH>
__device__ __forceinline__ void ah_zz_store_dkdv(float* dk, float* dv, const float (&dka)[DH / 2], const float (&dva)[DH / 2],
                                                 int b, int kvh, int S, int KV, int kr0, int t4) {
  if (gridDim.z == 1) {
    ah_store_dkdv<DH>(dk, dv, dka, dva, b, kvh, S, KV, kr0, t4);
    return;
  }
  const int KD = KV * DH;
  float* k0 = dk + ((long long)b * S + kr0) * KD + kvh * DH + 2 * t4;
  float* v0 = dv + ((long long)b * S + kr0) * KD + kvh * DH + 2 * t4;
  // A thread's two adjacent columns in one vector reduction (sm_90): half
  // the reductions of scalar adds, 0.7-2% off the S/W 4096 rows' calls.
#pragma unroll
  for (int i = 0; i < DH / 8; i++) {
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const long long at = (e >> 1) * 8LL * KD + 8 * i;  // rows kr0, kr0 + 8
      asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(k0 + at), "f"(dka[4 * i + e]), "f"(dka[4 * i + e + 1]) : "memory");
      asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(v0 + at), "f"(dva[4 * i + e]), "f"(dva[4 * i + e + 1]) : "memory");
    }
  }
}

// ah_zz_backward (attn_h_zz_backward_d64 and _d128) serves one
// context-parallel rank r of W (as attn_h_zz_forward): a block owns 128 of
// the rank's keys (one local key block: its rows lie in one chunk, C a
// multiple of 128) of one (sequence, kv head) and walks, per query head of
// the group, every tile of BQ queries of the whole sequence from the
// block's first key position on, each read from the rank that holds it (q and
// dout through that rank's tensor maps, lse and delta [B, 2, H, C] through
// its pointers), from the last tile down, as the whole-sequence walk: the
// blocks that start together then read the same tiles and add into the
// same dq blocks while those are in L2 (1.3-1.8% faster than walking up,
// kernels/attention_hopper.md). The block is ah_backward's
// (ah_bwd_block); dk and dv stay in registers across every rank's queries
// and are stored once into this rank's rows, and each dq block is added
// into its owner's dq by TMA reductions (float32, zero before any rank's
// kernel; the adds land at L2 in the order blocks run). So nothing
// travels but reads and dq's reductions: no partial dk or dv, no sums
// passed around.
struct ah_zz_bmaps {
  gg_tmap k, v;                               // this rank's [B*2C, KV*Dh], boxes of 128 rows
  gg_tmap q[AH_ZZ_MAX], dout[AH_ZZ_MAX];      // every rank's [B*2C, H*Dh], boxes of 64 rows
  gg_tmap dq[AH_ZZ_MAX];                      // every rank's float32 dq, boxes of {32, 64}
  const float* lse[AH_ZZ_MAX];                // every rank's [B, 2, H, C], natural log
  const float* delta[AH_ZZ_MAX];              // every rank's [B, 2, H, C]
};

template <int DH>
__device__ __forceinline__ void ah_zz_backward(const ah_zz_bmaps* maps, float* dk, float* dv, int r, int W, int C, int H,
                                               int KV, float scaleLog2, float scale) {
  const int b = blockIdx.x / KV, kvh = blockIdx.x % KV, G = H / KV;
  // blockIdx.z: which of the gridDim.z equal shares of the group's query
  // heads the block walks (ah_zz_store_dkdv).
  const int h0 = kvh * G + (int)blockIdx.z * (G / gridDim.z);
  const int S = 2 * C;                   // local rows per sequence
  const int j0 = blockIdx.y * 128;       // the block's first local key row
  const int nk = j0 / C;                 // its local chunk
  const int kp0 = (nk == 0 ? r : 2 * W - 1 - r) * C + j0 - nk * C;  // and its first key's position
  constexpr int BQ = ah_bcfg<DH>::BQ;  // C is a multiple of 128: a query tile lies in one chunk
  const int qt0 = kp0 / BQ, perHead = 2 * W * C / BQ - qt0;
  // The key at position kp sees the query at position i iff kp <= i: no
  // sequence end on either side (S and KS out of reach, off 0).
  const ah_div byHead(perHead);
  ah_bwd_block<DH>(
      [&] { return (G / (int)gridDim.z) * perHead; }, kp0, AH_NO_END, AH_NO_END, 0, scaleLog2, scale,
      [&](int it, ah_bwd_item& at) {
        // Item it's query tile: its first position, and the rank and local
        // row that hold it.
        const int hi = byHead.div(it);
        const int qp0 = (qt0 + perHead - 1 - (it - hi * perHead)) * BQ, cq = qp0 / C;
        const int owner = cq < W ? cq : 2 * W - 1 - cq, nq = cq < W ? 0 : 1, row = nq * C + qp0 - cq * C;
        at.h = h0 + hi;
        at.q0 = qp0;
        at.row = b * S + row;
        at.q = &maps->q[owner];
        at.dout = &maps->dout[owner];
        at.dq = &maps->dq[owner];
        // The owner's [B, 2, H, C] statistics (a query tile lies in one
        // chunk, every row of it valid).
        const long long first = ((long long)(b * 2 + nq) * H + at.h) * C + (row - nq * C);
        at.lse = maps->lse[owner] + first;
        at.delta = maps->delta[owner] + first;
        at.valid = BQ;
      },
      [&](unsigned ks, unsigned vs, unsigned barKV) {
        for (int w = 0; w < W; w++) {
          gg_prefetch_tmap(&maps->q[w]);
          gg_prefetch_tmap(&maps->dout[w]);
        }
        gg_bar_expect_tx(barKV, 2 * ah_bcfg<DH>::KT);
#pragma unroll
        for (int c = 0; c < DH / 64; c++) {
          gg_tma_2d(ks + c * ah_bcfg<DH>::KBOX, &maps->k, kvh * DH + 64 * c, b * S + j0, barKV);
          gg_tma_2d(vs + c * ah_bcfg<DH>::KBOX, &maps->v, kvh * DH + 64 * c, b * S + j0, barKV);
        }
      },
      [&](const float (&dka)[DH / 2], const float (&dva)[DH / 2], int row, int t4) {
        ah_zz_store_dkdv<DH>(dk, dv, dka, dva, b, kvh, S, KV, j0 + row, t4);
      });
}

extern "C" __global__ void __launch_bounds__(384, 1) attn_h_zz_backward_d128(const __grid_constant__ ah_zz_bmaps maps, float* dk, float* dv, int r, int W, int C, int H, int KV, float scaleLog2, float scale) {
  ah_zz_backward<128>(&maps, dk, dv, r, W, C, H, KV, scaleLog2, scale);
}

extern "C" __global__ void __launch_bounds__(384, 1) attn_h_zz_backward_d64(const __grid_constant__ ah_zz_bmaps maps, float* dk, float* dv, int r, int W, int C, int H, int KV, float scaleLog2, float scale) {
  ah_zz_backward<64>(&maps, dk, dv, r, W, C, H, KV, scaleLog2, scale);
}

extern "C" __global__ void __launch_bounds__(384, 1) attn_h_backward_d64(const __grid_constant__ gg_tmap mapQ, const __grid_constant__ gg_tmap mapDO, const __grid_constant__ gg_tmap mapK, const __grid_constant__ gg_tmap mapV, const __grid_constant__ gg_tmap mapDQ, const float* lse, const float* delta, float* dk, float* dv, int S, int KS, int off, int H, int KV, float scaleLog2, float scale, int band) {
  ah_backward<64>(&mapQ, &mapDO, &mapK, &mapV, &mapDQ, lse, delta, dk, dv, S, KS, off, H, KV, scaleLog2, scale, band);
}

extern "C" __global__ void __launch_bounds__(384, 1) attn_h_backward_d128(const __grid_constant__ gg_tmap mapQ, const __grid_constant__ gg_tmap mapDO, const __grid_constant__ gg_tmap mapK, const __grid_constant__ gg_tmap mapV, const __grid_constant__ gg_tmap mapDQ, const float* lse, const float* delta, float* dk, float* dv, int S, int KS, int off, int H, int KV, float scaleLog2, float scale, int band) {
  ah_backward<128>(&mapQ, &mapDO, &mapK, &mapV, &mapDQ, lse, delta, dk, dv, S, KS, off, H, KV, scaleLog2, scale, band);
}

// attn_h_delta: delta[b, h, i] = sum over d of bf16(dout) * out at query
// row b*S + i, head h (float32 in, [B, H, S] out), and the backward's other
// inputs in the same pass: dout rounded to bf16 into doutb (the kernels'
// TMA operand, one read of dout for both) and dq zeroed (the kernels add
// into it). attn_h_delta_bf16 is the same for a dout stored in bf16 already
// (no doutb), attn_h_delta_bf16_bf16 for a bf16 dout and out. One warp per
// (row, head), grid-stride; Dh a multiple of 4, rows 16-byte aligned
// (8-byte for bf16 ones).
struct alignas(8) ah_h4 {
  mk_bf16 x, y, z, w;
};
__device__ __forceinline__ ah_f4 ah_dout4(const float* p) {
  const ah_f4 a = *(const ah_f4*)p;
  return ah_f4{mk_bf16_to_f32(mk_f32_to_bf16(a.x)), mk_bf16_to_f32(mk_f32_to_bf16(a.y)), mk_bf16_to_f32(mk_f32_to_bf16(a.z)),
               mk_bf16_to_f32(mk_f32_to_bf16(a.w))};
}
__device__ __forceinline__ ah_f4 ah_dout4(const mk_bf16* p) {
  const ah_h4 a = *(const ah_h4*)p;
  return ah_f4{mk_bf16_to_f32(a.x), mk_bf16_to_f32(a.y), mk_bf16_to_f32(a.z), mk_bf16_to_f32(a.w)};
}

__device__ __forceinline__ ah_f4 ah_out4(const float* p) { return *(const ah_f4*)p; }
__device__ __forceinline__ ah_f4 ah_out4(const mk_bf16* p) {
  const ah_h4 a = *(const ah_h4*)p;
  return ah_f4{mk_bf16_to_f32(a.x), mk_bf16_to_f32(a.y), mk_bf16_to_f32(a.z), mk_bf16_to_f32(a.w)};
}

// ah_delta writes delta and zeroes dq; with a doutb it also stores the
// rounded dout there (a's values are on the bf16 grid already, so the
// conversion back is exact).
template <typename DO, typename O>
__device__ __forceinline__ void ah_delta(float* delta, mk_bf16* doutb, float* dq, const DO* dout, const O* out, int T, int S, int H,
                                         int Dh) {
  const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  const int lane = threadIdx.x & 31;
  for (long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < (long long)T * H; w += warps) {
    const long long row = w / H;
    const int h = (int)(w % H);
    const long long at = row * H * Dh + h * Dh;
    float sum = 0.0f;
    for (int d = 4 * lane; d < Dh; d += 128) {
      const ah_f4 a = ah_dout4(dout + at + d), o = ah_out4(out + at + d);
      sum += a.x * o.x + a.y * o.y + a.z * o.z + a.w * o.w;
      if (doutb != nullptr) {
        *(ah_h4*)(doutb + at + d) = ah_h4{mk_f32_to_bf16(a.x), mk_f32_to_bf16(a.y), mk_f32_to_bf16(a.z), mk_f32_to_bf16(a.w)};
      }
      *(ah_f4*)(dq + at + d) = ah_f4{0.0f, 0.0f, 0.0f, 0.0f};
    }
    sum = mk_warp_sum(sum);
    if (lane == 0) delta[((row / S) * H + h) * S + row % S] = sum;
  }
}

extern "C" __global__ void attn_h_delta(float* delta, mk_bf16* doutb, float* dq, const float* dout, const float* out, int T, int S, int H,
                                        int Dh) {
  ah_delta(delta, doutb, dq, dout, out, T, S, H, Dh);
}

extern "C" __global__ void attn_h_delta_bf16(float* delta, float* dq, const mk_bf16* dout, const float* out, int T, int S, int H, int Dh) {
  ah_delta(delta, (mk_bf16*)nullptr, dq, dout, out, T, S, H, Dh);
}

extern "C" __global__ void attn_h_delta_bf16_bf16(float* delta, float* dq, const mk_bf16* dout, const mk_bf16* out, int T, int S, int H,
                                                  int Dh) {
  ah_delta(delta, (mk_bf16*)nullptr, dq, dout, out, T, S, H, Dh);
}
