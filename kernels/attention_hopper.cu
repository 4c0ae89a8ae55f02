// Causal grouped-query attention forward for Hopper (sm_90a): bf16 q, k
// and v read by TMA into a ring of shared-memory stages, both products on
// wgmma, float32 softmax statistics and accumulation, float32 out and lse.
// Same semantics as attention_tc.cu's forward (backend.AttnShape): query
// token b*S + i, key token b*KS + j, query head h reads kv head h/(H/KV),
// scores scaled by 1/sqrt(Dh), key j visible to query i iff j <= off + i
// (an unmasked call passes off = KS-1) and j < KS; lse [B, H, S] in
// natural log. Head dims 64 and 128.
//
// Work split. A block owns 128 queries of one (sequence, head) and has
// three warpgroups (384 threads). Warpgroup 0 is the producer: one thread
// loads the block's q tile once and then, for every key tile of 128 keys
// the block sees, the k tile and the v tile, each completing on its own
// "full" mbarrier of a STAGES-deep ring (so the scores can start before v
// has landed). Warpgroups 1 and 2 are the consumers, 64 queries each:
//
//   S = q . k^T     wgmma m64n128k16 from shared memory (both K-major)
//   mask, online softmax in registers (rows' max and sum, base 2)
//   o = o*alpha + P . v   wgmma m64nDhk16, P from registers (bf16), v an
//                         MN-major shared tile (transpose bit)
//
// and each consumer warp arrives on the stage's "empty" mbarrier once its
// products are done, which lets the producer refill it. The scores'
// accumulator layout is the A operand layout of the next product (both
// are mma.m16n8k16's per warp), so P never leaves the registers. The two
// consumers run the same key tiles on different queries, so while one is
// in its softmax the other's products keep the tensor cores busy.
//
// Masking. Only tiles that cross the causal diagonal or the end of the
// keys are masked, element by element; a block loads key tiles up to the
// last key its last valid query sees, and a consumer whose queries see
// fewer tiles drains the rest (waits for them to land and frees them). A
// key tile past KS reads the next sequence's rows (k and v are one 2-D
// map) or TMA's zero fill; both are masked. Queries past S in the last
// q tile are computed on whatever rows the map returns and not stored.
//
// Registers. __launch_bounds__(384, 1) gives every thread 168; the
// producer drops to 40 (setmaxnreg) and the consumers rise to 232, which
// holds the scores (64 floats), o (Dh/2) and P (32 bf16 pairs).
//
// Layout in shared memory (128-byte swizzle, as grouped_gemm.cuh
// explains): a tile of R rows and Dh columns is Dh/64 TMA boxes of {64
// columns, R rows}, each R rows of 128 bytes. The scores' descriptors
// advance 32 bytes per k16 step inside a box; v's MN-major descriptor
// (gg_desc_mn) has its 64-column boxes 16 KiB apart (128 key rows) and
// advances 2048 bytes (16 keys) per k16 step.

#include "hopper.cuh"

#define AH_BM 128  // queries per block
#define AH_BN 128  // keys per tile
#define AH_LN2 0.6931471805599453f

extern __shared__ __attribute__((aligned(1024))) unsigned char ah_smem[];

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

// ah_stages is the ring depth per head dim: a stage is a k and a v tile
// (32 KiB at Dh 64, 64 KiB at Dh 128), beside the q tile.
template <int DH>
struct ah_cfg {
  static constexpr int STAGES = DH == 64 ? 4 : 2;
  static constexpr unsigned BOX = AH_BN * 128;             // {64 columns, 128 rows} of bf16: 16 KiB
  static constexpr unsigned TILE = (DH / 64) * BOX;        // a q, k or v tile
  static constexpr unsigned SMEM = 1024 + TILE + 2 * STAGES * TILE + 8 * (1 + 3 * STAGES);
};

template <int DH>
__device__ __forceinline__ void ah_forward(const gg_tmap* mapQ, const gg_tmap* mapK, const gg_tmap* mapV, float* out,
                                           float* lse, int S, int KS, int off, int H, int KV, float scaleLog2) {
  constexpr int STAGES = ah_cfg<DH>::STAGES;
  constexpr unsigned BOX = ah_cfg<DH>::BOX, TILE = ah_cfg<DH>::TILE;
  const unsigned base = (gg_smem_addr(ah_smem) + 1023u) & ~1023u;
  const unsigned qs = base, ks = base + TILE, vs = base + (1 + STAGES) * TILE;
  // mbarriers: q, fullK[STAGES], fullV[STAGES], empty[STAGES].
  const unsigned barQ = base + (1 + 2 * STAGES) * TILE, fullK = barQ + 8, fullV = fullK + 8 * STAGES,
                 empty = fullV + 8 * STAGES;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int bh = blockIdx.x, b = bh / H, h = bh % H, kvh = h / (H / KV);
  // Heaviest q tiles first: causal work grows with the tile index.
  const int nQT = (S + AH_BM - 1) / AH_BM, i0 = (nQT - 1 - (int)blockIdx.y) * AH_BM;
  const int lastRow = gg_min(S - 1, i0 + AH_BM - 1);
  const int nT = gg_min(KS - 1, off + lastRow) / AH_BN + 1;  // key tiles the block loads
  if (tid == 0) {
    gg_bar_init(barQ, 1);
    for (int s = 0; s < STAGES; s++) {
      gg_bar_init(fullK + 8 * s, 1);
      gg_bar_init(fullV + 8 * s, 1);
      gg_bar_init(empty + 8 * s, 8);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  if (warp < 4) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
    if (tid != 0) return;
    gg_prefetch_tmap(mapQ);
    gg_prefetch_tmap(mapK);
    gg_prefetch_tmap(mapV);
    gg_bar_expect_tx(barQ, TILE);
#pragma unroll
    for (int c = 0; c < DH / 64; c++) gg_tma_2d(qs + c * BOX, mapQ, h * DH + 64 * c, b * S + i0, barQ);
    for (int t = 0; t < nT; t++) {
      const int s = t % STAGES;
      const unsigned ph = (t / STAGES) & 1;
      gg_bar_wait(empty + 8 * s, ph ^ 1);  // a fresh barrier's parity-1 phase counts as complete
      const int row = b * KS + t * AH_BN;
      gg_bar_expect_tx(fullK + 8 * s, TILE);
#pragma unroll
      for (int c = 0; c < DH / 64; c++) gg_tma_2d(ks + s * TILE + c * BOX, mapK, kvh * DH + 64 * c, row, fullK + 8 * s);
      gg_bar_expect_tx(fullV + 8 * s, TILE);
#pragma unroll
      for (int c = 0; c < DH / 64; c++) gg_tma_2d(vs + s * TILE + c * BOX, mapV, kvh * DH + 64 * c, row, fullV + 8 * s);
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
  // Consumer cw owns queries [i0 + 64cw, i0 + 64cw + 64); this thread rows
  // r0 and r0 + 8 of them (the accumulator layout, grouped_gemm.cuh).
  const int cw = (warp >> 2) - 1, g = lane >> 2, t4 = lane & 3;
  const int w0 = i0 + 64 * cw, r0 = w0 + 16 * (warp & 3) + g, r1 = r0 + 8;
  const int nTw = w0 <= S - 1 ? gg_min(KS - 1, off + gg_min(S - 1, w0 + 63)) / AH_BN + 1 : 0;
  float o[DH / 2];
#pragma unroll
  for (int i = 0; i < DH / 2; i++) o[i] = 0.0f;
  float m0 = ah_neg_inf(), m1 = ah_neg_inf(), l0 = 0.0f, l1 = 0.0f;  // base-2 scaled max, this thread's part of the sum
  gg_bar_wait(barQ, 0);
  const unsigned long long dq = gg_desc(qs + cw * 64 * 128);
  for (int t = 0; t < nTw; t++) {
    const int s = t % STAGES;
    const unsigned ph = (t / STAGES) & 1;
    float sc[64];
    gg_bar_wait(fullK + 8 * s, ph);
    asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
    const unsigned long long dk = gg_desc(ks + s * TILE);
    gg_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < DH / 16; kk++) {
      // Box kk/4 (BOX bytes on), 32 bytes a k16 step within it.
      const unsigned long long step = (kk / 4) * (BOX >> 4) + 2 * (kk % 4);
      gg_wgmma(sc, dq + step, dk + step, kk > 0 ? 1 : 0);
    }
    gg_wgmma_commit();
    gg_wgmma_wait<0>();
    gg_fence_acc(sc);
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
    // Online softmax: new row maxima (base 2, scaled), the rescale of what
    // came before, and P = 2^(s*scale - max).
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
    // A row with no visible key in this tile keeps its max (mx is -inf).
    const float n0 = fmaxf(m0, mx0 * scaleLog2), n1 = fmaxf(m1, mx1 * scaleLog2);
    // Every row sees key 0 (off >= 0), so n0 and n1 are finite from the
    // first tile on; ah_ex2(-inf) is 0 for the first rescale.
    const float a0 = ah_ex2(m0 - n0), a1 = ah_ex2(m1 - n1);
    m0 = n0;
    m1 = n1;
    float s0 = 0.0f, s1 = 0.0f;
    unsigned p[8][4];
#pragma unroll
    for (int n = 0; n < 16; n++) {
      const float e0 = ah_ex2(sc[4 * n] * scaleLog2 - n0), e1 = ah_ex2(sc[4 * n + 1] * scaleLog2 - n0);
      const float e2 = ah_ex2(sc[4 * n + 2] * scaleLog2 - n1), e3 = ah_ex2(sc[4 * n + 3] * scaleLog2 - n1);
      s0 += e0 + e1;
      s1 += e2 + e3;
      // n8 block n is k columns 8(n%2).. of the k16 chunk n/2: registers
      // 0, 1 (rows g, g+8) for the first half, 2, 3 for the second.
      p[n >> 1][2 * (n & 1)] = gg_pack_bf16(e0, e1);
      p[n >> 1][2 * (n & 1) + 1] = gg_pack_bf16(e2, e3);
    }
    l0 = l0 * a0 + s0;
    l1 = l1 * a1 + s1;
#pragma unroll
    for (int i = 0; i < DH / 8; i++) {
      o[4 * i] *= a0;
      o[4 * i + 1] *= a0;
      o[4 * i + 2] *= a1;
      o[4 * i + 3] *= a1;
    }
    gg_bar_wait(fullV + 8 * s, ph);
    asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
    const unsigned long long dv = gg_desc_mn(vs + s * TILE, BOX);
    gg_wgmma_fence();
    gg_fence_acc(o);
#pragma unroll
    for (int kk = 0; kk < AH_BN / 16; kk++) ah_wgmma_rs(o, p[kk], dv + 128 * kk);  // +2048 bytes: 16 keys
    gg_wgmma_commit();
    gg_wgmma_wait<0>();
    gg_fence_acc(o);
    if (lane == 0) gg_bar_arrive(empty + 8 * s);
  }
  // Tiles the block loaded that this warpgroup's queries do not see: let
  // them land, then free them, so the producer's ring turns.
  for (int t = nTw; t < nT; t++) {
    const int s = t % STAGES;
    const unsigned ph = (t / STAGES) & 1;
    gg_bar_wait(fullK + 8 * s, ph);
    gg_bar_wait(fullV + 8 * s, ph);
    if (lane == 0) gg_bar_arrive(empty + 8 * s);
  }
  l0 += mk_shfl_xor(l0, 1);
  l0 += mk_shfl_xor(l0, 2);
  l1 += mk_shfl_xor(l1, 1);
  l1 += mk_shfl_xor(l1, 2);
  const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
  const int HD = H * DH;
  float* o0 = out + ((long long)b * S + r0) * HD + h * DH + 2 * t4;
  float* o1 = o0 + 8LL * HD;
#pragma unroll
  for (int i = 0; i < DH / 8; i++) {
    if (r0 < S)
      asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(o0 + 8 * i), "f"(o[4 * i] * inv0), "f"(o[4 * i + 1] * inv0)
                   : "memory");
    if (r1 < S)
      asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(o1 + 8 * i), "f"(o[4 * i + 2] * inv1),
                   "f"(o[4 * i + 3] * inv1)
                   : "memory");
  }
  if (t4 == 0) {
    float* lrow = lse + ((long long)b * H + h) * S;
    if (r0 < S) lrow[r0] = (m0 + ah_lg2(l0)) * AH_LN2;
    if (r1 < S) lrow[r1] = (m1 + ah_lg2(l1)) * AH_LN2;
  }
}

extern "C" __global__ void __launch_bounds__(384, 1) attn_h_forward_d64(const __grid_constant__ gg_tmap mapQ, const __grid_constant__ gg_tmap mapK, const __grid_constant__ gg_tmap mapV, float* out, float* lse, int S, int KS, int off, int H, int KV, float scaleLog2) {
  ah_forward<64>(&mapQ, &mapK, &mapV, out, lse, S, KS, off, H, KV, scaleLog2);
}

extern "C" __global__ void __launch_bounds__(384, 1) attn_h_forward_d128(const __grid_constant__ gg_tmap mapQ, const __grid_constant__ gg_tmap mapK, const __grid_constant__ gg_tmap mapV, float* out, float* lse, int S, int KS, int off, int H, int KV, float scaleLog2) {
  ah_forward<128>(&mapQ, &mapK, &mapV, out, lse, S, KS, off, H, KV, scaleLog2);
}
