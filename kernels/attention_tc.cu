// Causal grouped-query attention on the tensor cores, flash style
// (FlashAttention-2's algorithm): the forward writes out and lse, the
// backward dq, dk and dv. Same layout and semantics as attention.cu, whose
// float32 kernels serve the head dims these do not (these take Dh = 64 and
// 128 only, and 16-byte aligned tensors).
//
// Layout (backend.AttnShape): S queries and KS keys per sequence (KS =
// KVSeq, equal to S in plain self-attention); query token b*S + i, key
// token b*KS + j; q and out are [B*S, H*Dh], k and v [B*KS, KV*Dh],
// row-major float32; query head h reads kv head h / (H/KV); lse is
// [B, H, S], natural log. Scores are scaled by 1/sqrt(Dh) and masked
// causally with the query offset off (QOffset): query i sees keys
// 0..min(off+i, KS-1); an unmasked call (AttnShape.Full) passes off =
// KS-1, which the forward and dq kernels clip at the last key. Key tiles run up to the block's last visible key; the dk/dv
// kernel's query tiles start at the first query that sees its first key
// (max(0, j0-off)), and a key block no query sees writes zeros.
//
// Precision. Tiles are read as float32 and rounded to bfloat16 (nearest
// even) when they are staged into shared memory; the products run as
// mma.sync.m16n8k16 with bf16 operands and float32 accumulation. Softmax
// statistics, lse, the rescaling and every accumulator stay in float32;
// the probabilities P and the score gradients dS are rounded to bf16 only
// as the A operand of the next product, and D_i = rowsum(dout_i * out_i)
// is summed in float32 (from dout rounded to bf16, as dP sees it). Expect
// bf16-level error against a float64 reference: about 4e-3 relative (L2)
// on out and 5e-3..8e-3 on the gradients, and element-wise deviations of a
// few percent of the tensor's rms; bf16 rounding of the inputs alone
// accounts for over 1e-2 of rms element-wise.
//
// Work split. A block has 4 warps and owns 64 rows (queries in the forward
// and dq kernels, keys in the dk/dv kernel), 16 per warp: each warp runs
// its own m16 row of mma tiles and keeps its accumulators in registers.
// The other side streams through shared memory in tiles of BN rows. A
// tile's float32 loads (16 bytes per thread, coalesced) are issued into
// registers before the current tile is computed, and rounded and stored
// into the other of two shared buffers after it, so one barrier per tile
// suffices and global latency hides behind the mma work. Shared tiles are
// bf16 rows of Dh elements whose 16-byte chunks are XOR-swizzled by the
// row (chunk c of row r sits at c ^ (r & 7)), so ldmatrix reads 8 rows of
// one chunk without bank conflicts. Everything fits the 48 KiB of static
// shared memory; BN is chosen per kernel and head dim so the prefetch
// registers, the accumulators and the operand fragments fit without
// spilling.
//
// Fragments (PTX ISA, mma.m16n8k16 .bf16): lane = 4*g + t4. A (16x16, row
// major) holds rows g and g+8, columns 2*t4.. and 2*t4+8..; B (16x8, "col")
// holds k = 2*t4.. and 2*t4+8.. of column g; the accumulator C holds rows g
// (c0, c1) and g+8 (c2, c3), columns 2*t4, 2*t4+1. So a row's scores sit
// in the 4 lanes of a quad (reduced with two shuffles), and the C tiles of
// two neighbouring n8 blocks, rounded to bf16 pairs, are exactly the A
// fragment of the next product (P or dS as A needs no shuffle).
//
// The backward is two kernels, deterministic, with no atomics, as in
// attention.cu: attn_tc_backward_dq per query tile (also writes
// delta = D_i), then attn_tc_backward_dkdv per key tile of one kv head,
// over the query heads of its group and the query tiles that see its keys.

#define ATC_THREADS 128
#define ATC_ROWS 64
#define ATC_LOG2E 1.4426950408889634f
#define ATC_LN2 0.6931471805599453f

struct alignas(16) atc_f4 {
  float x, y, z, w;
};
struct alignas(8) atc_u2 {
  unsigned int x, y;
};
struct alignas(8) atc_f2 {
  float x, y;
};

__device__ __forceinline__ int atc_min(int a, int b) { return a < b ? a : b; }

// The PTX the kernels use, wrapped. A host emulation of the warp (a test
// tool that runs this file on the CPU) defines ATC_HOST_EMULATION and
// supplies its own versions of these functions.
#ifndef ATC_HOST_EMULATION
typedef unsigned int atc_saddr;  // an address in the shared state space

__device__ __forceinline__ atc_saddr atc_smem_addr(const void* p) {
  unsigned int d;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(d) : "l"(p));
  return d;
}

// atc_ldg4 reads 16 bytes of a tensor no kernel writes while this one
// runs. volatile keeps the prefetch where it is written, ahead of the
// work that hides its latency.
__device__ __forceinline__ atc_f4 atc_ldg4(const float* p) {
  atc_f4 r;
  asm volatile("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ float atc_ldg1(const float* p) {
  float r;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(r) : "l"(p));
  return r;
}

// atc_ldsm reads four 8x8 bf16 matrices; lanes 8m..8m+7 give the row
// addresses of matrix m, and register m receives row lane/4, columns
// 2*(lane%4) and 2*(lane%4)+1 of it (atc_ldsm_t: of its transpose).
__device__ __forceinline__ void atc_ldsm(unsigned int (&r)[4], atc_saddr a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}

__device__ __forceinline__ void atc_ldsm_t(unsigned int (&r)[4], atc_saddr a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}

// atc_mma does c += a * b for one m16n8k16 tile, bf16 in, float32 out.
__device__ __forceinline__ void atc_mma(float (&c)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// atc_pack rounds lo and hi to bf16 (nearest even) into one word, lo in
// the low half: the element order of a fragment register.
__device__ __forceinline__ unsigned int atc_pack(float lo, float hi) {
  unsigned int d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// atc_ex2 is 2^x; 2^-inf = 0.
__device__ __forceinline__ float atc_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

// atc_off is the byte offset of 16-byte chunk c of row r in a swizzled
// bf16 tile of rows DH wide.
template <int DH>
__device__ __forceinline__ int atc_off(int r, int c) {
  return r * (DH * 2) + ((c ^ (r & 7)) << 4);
}

// atc_load issues this thread's share of the float32 loads of a ROWS x DH
// tile whose first row starts at src, rows stride floats apart; rows at or
// past n read as zeros. Thread tid takes the float4s tid, tid + 128, ... of
// the tile in row-major order, so a warp reads whole rows.
template <int DH, int ROWS>
__device__ __forceinline__ void atc_load(atc_f4 (&r)[ROWS * DH / (4 * ATC_THREADS)], const float* src,
                                         long long stride, int n) {
  constexpr int C4 = DH / 4;
  static_assert(ROWS * DH % (4 * ATC_THREADS) == 0, "tile shape");
#pragma unroll
  for (int i = 0; i < ROWS * DH / (4 * ATC_THREADS); i++) {
    const int idx = (int)threadIdx.x + i * ATC_THREADS, row = idx / C4, c4 = idx % C4;
    if (row < n) {
      r[i] = atc_ldg4(src + (long long)row * stride + 4 * c4);
    } else {
      r[i] = atc_f4{0.0f, 0.0f, 0.0f, 0.0f};
    }
  }
}

// atc_store rounds what atc_load fetched to bf16 and writes it into the
// swizzled tile at tile.
template <int DH, int ROWS>
__device__ __forceinline__ void atc_store(unsigned char* tile, const atc_f4 (&r)[ROWS * DH / (4 * ATC_THREADS)]) {
  constexpr int C4 = DH / 4;
#pragma unroll
  for (int n = 0; n < ROWS * DH / (4 * ATC_THREADS); n++) {
    const int idx = (int)threadIdx.x + n * ATC_THREADS, row = idx / C4, c4 = idx % C4;
    *(atc_u2*)(tile + atc_off<DH>(row, c4 >> 1) + ((c4 & 1) << 3)) =
        atc_u2{atc_pack(r[n].x, r[n].y), atc_pack(r[n].z, r[n].w)};
  }
}

// atc_a_frag packs the float32 C tiles c[2k] and c[2k+1] (16 rows x 16
// columns) into the bf16 A fragment of a product over those columns.
__device__ __forceinline__ void atc_a_frag(unsigned int (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = atc_pack(lo[0], lo[1]);
  a[1] = atc_pack(lo[2], lo[3]);
  a[2] = atc_pack(hi[0], hi[1]);
  a[3] = atc_pack(hi[2], hi[3]);
}

// atc_quad_max and atc_quad_sum reduce over the 4 lanes that share a row.
__device__ __forceinline__ float atc_quad_max(float v) {
  v = fmaxf(v, mk_shfl_xor(v, 1));
  return fmaxf(v, mk_shfl_xor(v, 2));
}
__device__ __forceinline__ float atc_quad_sum(float v) {
  v += mk_shfl_xor(v, 1);
  return v + mk_shfl_xor(v, 2);
}

// Lane roles in ldmatrix: lane l gives the address of row l%8 of matrix
// l/8. For an A fragment (16 rows x 16 columns, matrices ordered rows 0-7
// / 8-15, then columns 8-15) and for the B fragments of two n8 tiles read
// transposed from [k][n] storage, that is row (l/8%2)*8 + l%8, chunk l/16.
// For the B fragments of two n8 tiles read from [n][k] storage (matrices:
// n 0-7 k lo, n 0-7 k hi, n 8-15 k lo, n 8-15 k hi), row (l/16)*8 + l%8,
// chunk l/8%2.
struct atc_lanes {
  int g, t4;          // the lane's mma row group and column pair
  int arow, achunk;   // A-style and transposed-B-style ldmatrix address
  int brow, bchunk;   // B-style ldmatrix address
};

__device__ __forceinline__ atc_lanes atc_lane_roles() {
  const int lane = (int)threadIdx.x & 31;
  atc_lanes r;
  r.g = lane >> 2;
  r.t4 = lane & 3;
  r.arow = ((lane >> 3) & 1) * 8 + (lane & 7);
  r.achunk = lane >> 4;
  r.brow = (lane >> 4) * 8 + (lane & 7);
  r.bchunk = (lane >> 3) & 1;
  return r;
}

// Where a block's rows are and what they see. The plain kernels (one
// call's q, k and v) and the zigzag ones (a context-parallel rank that
// reads its peers' keys or queries through device pointers) run the same
// tile loops below and differ only in these descriptions.

// atc_qtile is a forward or dq block: rows q0..q0+63 of query head h of
// sequence b, of S rows. Row i sits at q + qbase + i*H*DH (out, dout and dq
// alike), its lse and delta at [lbase + i]; it sees the keys at positions
// 0..off+i.
struct atc_qtile {
  int b, h, q0, S, off;
  long long qbase, lbase;
};

// atc_ktile is a dk/dv block: rows j0..j0+63 of kv head kvh of sequence b,
// of KS rows, at k + kbase + j*KV*DH (v, dk and dv alike), over the queries
// of the nh query heads from h0 on. Row j is at key position j + koff; a
// query at position p sees it iff p >= j + koff.
struct atc_ktile {
  int b, kvh, j0, KS, koff, h0, nh;
  long long kbase;
};

// atc_at is where a tile of rows starts in the tensors of a source (k and
// v; or q, dout, lse and delta) and how many rows exist from there.
struct atc_at {
  const float *a, *b, *lse, *delta;
  int n;
};

// atc_keys_one: one call's keys, [B*KS, KV*DH]; position j of sequence b
// is row b*KS + j. k and v point at row 0 of the block's sequence and kv
// head (atc_plain_keys). Tiles go in position order.
struct atc_keys_one {
  const float *k, *v;
  int KS;
  long long kstride;
  __device__ __forceinline__ atc_at at(int, int, int j) const {
    const long long o = (long long)j * kstride;
    return atc_at{k + o, v + o, nullptr, nullptr, KS - j};
  }
  __device__ __forceinline__ int count() const { return KS; }
};

// atc_queries_one: one call's queries [B*S, H*DH] (q, dout) and their lse
// and delta [B, H, S]; position i of sequence b is row b*S + i.
struct atc_queries_one {
  const float *q, *dout, *lse, *delta;
  int S, H, dh;
  __device__ __forceinline__ atc_at at(int b, int h, int i) const {
    const long long o = ((long long)b * S + i) * H * dh + (long long)h * dh;
    const long long l = ((long long)b * H + h) * S + i;
    return atc_at{q + o, dout + o, lse + l, delta + l, S - i};
  }
};

// Zigzag context parallelism (backend.ZigzagShape): a sequence of 2WC
// positions in 2W chunks of C, rank r holding chunks r and 2W-1-r as its
// local rows [0, C) and [C, 2C) of each sequence. Position p is in chunk
// c = p / C, owned by rank c (c < W) or 2W-1-c, at its local row
// (c < W ? 0 : C) + p % C. Tiles never straddle chunks (C is a multiple
// of 64). Every rank's tensors come as a table of W device pointers.
__device__ __forceinline__ void atc_zz_locate(int p, int W, int C, int& rank, int& row, int& n) {
  const int c = p / C;
  n = c < W ? 0 : 1;
  rank = n == 0 ? c : 2 * W - 1 - c;
  row = n * C + (p - c * C);
}

// atc_keys_zz: every rank's k and v. Tiles go in position order, as the
// plain kernels' do, so a rank's rows get the bits the whole sequence's
// call gives them (the same tiles, in the same order, round alike).
// k and v point at the block's own table in shared memory (atc_zz_keys):
// each rank's address of row 0 of the block's sequence and kv head, so a
// tile's address costs no global load and few registers.
struct atc_keys_zz {
  const float* const* k;
  const float* const* v;
  int W, C;
  long long kstride;
  __device__ __forceinline__ atc_at at(int, int, int j) const {
    int rank, row, n;
    atc_zz_locate(j, W, C, rank, row, n);
    const long long o = (long long)row * kstride;
    return atc_at{k[rank] + o, v[rank] + o, nullptr, nullptr, C - (row - n * C)};
  }
  __device__ __forceinline__ int count() const { return 2 * W * C; }
};

// ATC_ZZ_MAX_RANKS bounds W (backend/cuda's zigzagMaxRanks).
#define ATC_ZZ_MAX_RANKS 64

// atc_zz_keys fills the block's key table from every rank's k and v (ks,
// vs: W device pointers) for the forward and dq blocks of grid (B*H, ..).
template <int DH>
__device__ __forceinline__ atc_keys_zz atc_zz_keys(const float* const* ks, const float* const* vs, int W, int C, int H,
                                                   int KV) {
  __shared__ const float* tab[2 * ATC_ZZ_MAX_RANKS];
  const int b = blockIdx.x / H, kvh = (blockIdx.x % H) / (H / KV);
  const long long o = (long long)b * 2 * C * KV * DH + (long long)kvh * DH;
  for (int i = threadIdx.x; i < W; i += ATC_THREADS) {
    tab[i] = ks[i] + o;
    tab[ATC_ZZ_MAX_RANKS + i] = vs[i] + o;
  }
  __syncthreads();
  return atc_keys_zz{tab, tab + ATC_ZZ_MAX_RANKS, W, C, (long long)KV * DH};
}

// atc_queries_zz: every rank's q, dout ([B*2C, H*DH]) and lse, delta
// ([B, 2, H, C]); a query index is its position in the sequence.
struct atc_queries_zz {
  const float* const* q;
  const float* const* dout;
  const float* const* lse;
  const float* const* delta;
  int W, C, H, dh;
  __device__ __forceinline__ atc_at at(int b, int h, int i) const {
    int rank, row, n;
    atc_zz_locate(i, W, C, rank, row, n);
    const long long o = ((long long)b * 2 * C + row) * H * dh + (long long)h * dh;
    const long long l = ((long long)(b * 2 + n) * H + h) * C + (i % C);
    return atc_at{q[rank] + o, dout[rank] + o, lse[rank] + l, delta[rank] + l, C - (i % C)};
  }
};

// atc_forward: grid (B*H, ceil(S/64)), 128 threads. Writes out and lse for
// queries q0..q0+63 of head h; the longest rows go first. K and V stream
// in tiles of BN keys.
template <int DH, int BN, class Keys>
__device__ __forceinline__ void atc_forward(float* out, float* lse, const float* q, const Keys& keys,
                                            const atc_qtile& Q, int H, int KV, float scale_log2) {
  constexpr int TILE = BN * DH * 2, QTILE = ATC_ROWS * DH * 2;
  constexpr int SMEM = QTILE > 4 * TILE ? QTILE : 4 * TILE;
  constexpr int NL = BN * DH / (4 * ATC_THREADS);
  // Q is staged here first, then the two K/V buffers reuse the space.
  __shared__ atc_f4 smem4[SMEM / 16];
  unsigned char* smem = (unsigned char*)smem4;
  const atc_saddr sbase = atc_smem_addr(smem);
  const atc_lanes L = atc_lane_roles();
  const int w = (int)threadIdx.x >> 5;
  const int b = Q.b, kvh = Q.h / (H / KV), q0 = Q.q0, S = Q.S;
  const long long qstride = (long long)H * DH, kstride = (long long)KV * DH;
  const long long qbase = Q.qbase;
  // Tiles up to the block's last visible key, and never past the last key
  // (an unmasked call's offset sees them all).
  const int kcount = keys.count();
  const int ntiles = (atc_min(Q.off + atc_min(S, q0 + ATC_ROWS), kcount) + BN - 1) / BN;
  const int wrow = q0 + 16 * w;   // the warp's first query row
  const int wkey = Q.off + wrow;  // the last key the warp's first row sees

  {
    atc_f4 qr[ATC_ROWS * DH / (4 * ATC_THREADS)];
    atc_load<DH, ATC_ROWS>(qr, q + qbase + (long long)q0 * qstride, qstride, S - q0);
    atc_store<DH, ATC_ROWS>(smem, qr);
  }
  __syncthreads();
  unsigned int qf[DH / 16][4];
#pragma unroll
  for (int kk = 0; kk < DH / 16; kk++) atc_ldsm(qf[kk], sbase + atc_off<DH>(16 * w + L.arow, 2 * kk + L.achunk));
  __syncthreads();  // Q is in registers; its space takes K and V now

  atc_f4 kr[NL], vr[NL];
  {
    const atc_at a = keys.at(b, kvh, 0);
    atc_load<DH, BN>(kr, a.a, kstride, a.n);
    atc_load<DH, BN>(vr, a.b, kstride, a.n);
  }
  atc_store<DH, BN>(smem, kr);
  atc_store<DH, BN>(smem + TILE, vr);
  __syncthreads();

  float o[DH / 8][4];
#pragma unroll
  for (int n = 0; n < DH / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  // m is the running max in log2 units (score * scale_log2); l the running
  // sum of this lane's columns, summed over the quad at the end.
  float m[2] = {-MK_INF, -MK_INF}, l[2] = {0.0f, 0.0f};

  for (int t = 0; t < ntiles; t++) {
    const int k0 = t * BN;
    if (t + 1 < ntiles) {
      const atc_at a = keys.at(b, kvh, k0 + BN);
      atc_load<DH, BN>(kr, a.a, kstride, a.n);
      atc_load<DH, BN>(vr, a.b, kstride, a.n);
    }
    const atc_saddr ks = sbase + (t & 1) * 2 * TILE, vs = ks + TILE;
    // Warp-uniform: a tile of keys past every row of this warp is all
    // masked.
    if (k0 <= wkey + 15) {
      float s[BN / 8][4];
#pragma unroll
      for (int n = 0; n < BN / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < DH / 16; kk++)
#pragma unroll
        for (int j = 0; j < BN / 16; j++) {
          unsigned int bf[4];
          atc_ldsm(bf, ks + atc_off<DH>(16 * j + L.brow, 2 * kk + L.bchunk));
          atc_mma(s[2 * j], qf[kk], bf[0], bf[1]);
          atc_mma(s[2 * j + 1], qf[kk], bf[2], bf[3]);
        }
      if (k0 + BN - 1 > wkey || k0 + BN > kcount) {  // the tile crosses the diagonal or the last key
#pragma unroll
        for (int n = 0; n < BN / 8; n++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            const int key = k0 + 8 * n + 2 * L.t4 + (e & 1);
            if (key > wkey + L.g + 8 * (e >> 1) || key >= kcount) s[n][e] = -MK_INF;
          }
      }
      float mref[2];
#pragma unroll
      for (int r = 0; r < 2; r++) {
        float mx = -MK_INF;
#pragma unroll
        for (int n = 0; n < BN / 8; n++) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        const float mn = fmaxf(m[r], atc_quad_max(mx) * scale_log2);
        // Key 0 is in every row's first tile, so mn is finite from then
        // on; the guard keeps a row that sees no key of a tile (a query
        // offset that is not a multiple of 16 leaves such rows in active
        // warps) from turning into NaNs.
        mref[r] = mn == -MK_INF ? 0.0f : mn;
        const float corr = atc_ex2(m[r] - mref[r]);
        m[r] = mn;
        l[r] *= corr;
#pragma unroll
        for (int n = 0; n < DH / 8; n++) {
          o[n][2 * r] *= corr;
          o[n][2 * r + 1] *= corr;
        }
      }
#pragma unroll
      for (int n = 0; n < BN / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          s[n][e] = atc_ex2(s[n][e] * scale_log2 - mref[e >> 1]);
          l[e >> 1] += s[n][e];
        }
#pragma unroll
      for (int kk = 0; kk < BN / 16; kk++) {
        unsigned int pa[4];
        atc_a_frag(pa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
        for (int j = 0; j < DH / 16; j++) {
          unsigned int bf[4];
          atc_ldsm_t(bf, vs + atc_off<DH>(16 * kk + L.arow, 2 * j + L.achunk));
          atc_mma(o[2 * j], pa, bf[0], bf[1]);
          atc_mma(o[2 * j + 1], pa, bf[2], bf[3]);
        }
      }
    }
    if (t + 1 < ntiles) {
      // The other buffer was last read in tile t-1, before the barrier
      // that ended it.
      unsigned char* nb = smem + ((t + 1) & 1) * 2 * TILE;
      atc_store<DH, BN>(nb, kr);
      atc_store<DH, BN>(nb + TILE, vr);
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; r++) {
    const float lr = atc_quad_sum(l[r]);
    const int i = wrow + L.g + 8 * r;
    if (i < S) {
      const float inv = 1.0f / lr;
      float* row = out + qbase + (long long)i * qstride + 2 * L.t4;
#pragma unroll
      for (int n = 0; n < DH / 8; n++) *(atc_f2*)(row + 8 * n) = atc_f2{o[n][2 * r] * inv, o[n][2 * r + 1] * inv};
      if (L.t4 == 0) lse[Q.lbase + i] = m[r] * ATC_LN2 + logf(lr);
    }
  }
}

// atc_backward_dq: grid (B*H, ceil(S/64)), 128 threads. Writes dq and
// delta (D_i = dout_i . out_i) for queries q0..q0+63 of head h. K and V
// stream in tiles of BN keys; per tile, with P = exp(S - lse) and
// dS = P * (dout V^T - D): dq += dS K (times the scale at the end).
template <int DH, int BN, class Keys>
__device__ __forceinline__ void atc_backward_dq(float* dq, float* delta, const float* dout, const float* q,
                                                const Keys& keys, const float* out, const float* lse,
                                                const atc_qtile& Q, int H, int KV, float scale_log2, float scale) {
  constexpr int TILE = BN * DH * 2, QTILE = ATC_ROWS * DH * 2;
  constexpr int SMEM = 2 * QTILE > 4 * TILE ? 2 * QTILE : 4 * TILE;
  constexpr int NL = BN * DH / (4 * ATC_THREADS), NQ = ATC_ROWS * DH / (4 * ATC_THREADS), C4 = DH / 4;
  // Q and dout are staged here first, then the K/V buffers reuse the space.
  __shared__ atc_f4 smem4[SMEM / 16];
  __shared__ float dsum[ATC_ROWS];
  unsigned char* smem = (unsigned char*)smem4;
  const atc_saddr sbase = atc_smem_addr(smem);
  const atc_lanes L = atc_lane_roles();
  const int tid = threadIdx.x, w = tid >> 5;
  const int b = Q.b, kvh = Q.h / (H / KV), q0 = Q.q0, S = Q.S;
  const long long qstride = (long long)H * DH, kstride = (long long)KV * DH;
  const long long qbase = Q.qbase, lbase = Q.lbase;
  // Tiles up to the block's last visible key, and never past the last key
  // (an unmasked call's offset sees them all).
  const int kcount = keys.count();
  const int ntiles = (atc_min(Q.off + atc_min(S, q0 + ATC_ROWS), kcount) + BN - 1) / BN;
  const int wrow = q0 + 16 * w;
  const int wkey = Q.off + wrow;  // the last key the warp's first row sees
  const float* qrow0 = q + qbase + (long long)q0 * qstride;

  {
    // D_i, summed in float32 while dout is staged: the C4 lanes of a row
    // (consecutive, within one warp) add up its products. dout enters
    // rounded to bf16, as it enters dP = dout V^T, so that sum_j dS_ij =
    // sum_j P_ij dP_ij - D_i is 0 up to P's rounding (a row with one key
    // gets dS = 0 exactly, as in exact arithmetic) rather than off by
    // dout's rounding error, which dq and dk would otherwise carry.
    atc_f4 dr[NQ], orr[NQ];
    atc_load<DH, ATC_ROWS>(dr, dout + (qrow0 - q), qstride, S - q0);
    atc_load<DH, ATC_ROWS>(orr, out + (qrow0 - q), qstride, S - q0);
    atc_store<DH, ATC_ROWS>(smem + QTILE, dr);
#pragma unroll
    for (int n = 0; n < NQ; n++) {
      const unsigned int lo = atc_pack(dr[n].x, dr[n].y), hi = atc_pack(dr[n].z, dr[n].w);
      float part = __uint_as_float(lo << 16) * orr[n].x + __uint_as_float(lo & 0xffff0000u) * orr[n].y +
                   __uint_as_float(hi << 16) * orr[n].z + __uint_as_float(hi & 0xffff0000u) * orr[n].w;
#pragma unroll
      for (int x = 1; x < C4; x <<= 1) part += mk_shfl_xor(part, x);
      const int idx = tid + n * ATC_THREADS;
      if (idx % C4 == 0) {
        const int row = idx / C4;
        dsum[row] = part;
        if (q0 + row < S) delta[lbase + q0 + row] = part;
      }
    }
  }
  {
    atc_f4 qr[NQ];
    atc_load<DH, ATC_ROWS>(qr, qrow0, qstride, S - q0);
    atc_store<DH, ATC_ROWS>(smem, qr);
  }
  __syncthreads();
  unsigned int qf[DH / 16][4], df[DH / 16][4];
#pragma unroll
  for (int kk = 0; kk < DH / 16; kk++) {
    atc_ldsm(qf[kk], sbase + atc_off<DH>(16 * w + L.arow, 2 * kk + L.achunk));
    atc_ldsm(df[kk], sbase + QTILE + atc_off<DH>(16 * w + L.arow, 2 * kk + L.achunk));
  }
  float dd[2], lse2[2];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int i = wrow + L.g + 8 * r;
    dd[r] = dsum[16 * w + L.g + 8 * r];
    lse2[r] = i < S ? lse[lbase + i] * ATC_LOG2E : 0.0f;
  }
  __syncthreads();  // Q and dout are in registers; their space takes K and V

  atc_f4 kr[NL], vr[NL];
  {
    const atc_at a = keys.at(b, kvh, 0);
    atc_load<DH, BN>(kr, a.a, kstride, a.n);
    atc_load<DH, BN>(vr, a.b, kstride, a.n);
  }
  atc_store<DH, BN>(smem, kr);
  atc_store<DH, BN>(smem + TILE, vr);
  __syncthreads();

  float acc[DH / 8][4];
#pragma unroll
  for (int n = 0; n < DH / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

  for (int t = 0; t < ntiles; t++) {
    const int k0 = t * BN;
    if (t + 1 < ntiles) {
      const atc_at a = keys.at(b, kvh, k0 + BN);
      atc_load<DH, BN>(kr, a.a, kstride, a.n);
      atc_load<DH, BN>(vr, a.b, kstride, a.n);
    }
    const atc_saddr ks = sbase + (t & 1) * 2 * TILE, vs = ks + TILE;
    if (k0 <= wkey + 15) {
      float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
      for (int n = 0; n < BN / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < DH / 16; kk++)
#pragma unroll
        for (int j = 0; j < BN / 16; j++) {
          unsigned int bf[4];
          atc_ldsm(bf, ks + atc_off<DH>(16 * j + L.brow, 2 * kk + L.bchunk));
          atc_mma(s[2 * j], qf[kk], bf[0], bf[1]);
          atc_mma(s[2 * j + 1], qf[kk], bf[2], bf[3]);
          atc_ldsm(bf, vs + atc_off<DH>(16 * j + L.brow, 2 * kk + L.bchunk));
          atc_mma(dp[2 * j], df[kk], bf[0], bf[1]);
          atc_mma(dp[2 * j + 1], df[kk], bf[2], bf[3]);
        }
      // s becomes dS; masked keys (after the row's last, which also
      // covers keys past KS) give 0.
#pragma unroll
      for (int n = 0; n < BN / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int key = k0 + 8 * n + 2 * L.t4 + (e & 1);
          const bool masked = key > wkey + L.g + 8 * (e >> 1) || key >= kcount;
          const float p = masked ? 0.0f : atc_ex2(s[n][e] * scale_log2 - lse2[e >> 1]);
          s[n][e] = p * (dp[n][e] - dd[e >> 1]);
        }
#pragma unroll
      for (int kk = 0; kk < BN / 16; kk++) {
        unsigned int da[4];
        atc_a_frag(da, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
        for (int j = 0; j < DH / 16; j++) {
          unsigned int bf[4];
          atc_ldsm_t(bf, ks + atc_off<DH>(16 * kk + L.arow, 2 * j + L.achunk));
          atc_mma(acc[2 * j], da, bf[0], bf[1]);
          atc_mma(acc[2 * j + 1], da, bf[2], bf[3]);
        }
      }
    }
    if (t + 1 < ntiles) {
      unsigned char* nb = smem + ((t + 1) & 1) * 2 * TILE;
      atc_store<DH, BN>(nb, kr);
      atc_store<DH, BN>(nb + TILE, vr);
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int i = wrow + L.g + 8 * r;
    if (i < S) {
      float* row = dq + qbase + (long long)i * qstride + 2 * L.t4;
#pragma unroll
      for (int n = 0; n < DH / 8; n++)
        *(atc_f2*)(row + 8 * n) = atc_f2{acc[n][2 * r] * scale, acc[n][2 * r + 1] * scale};
    }
  }
}

// atc_backward_dkdv: grid (B*KV, ceil(KS/64)), 128 threads. Writes dk and
// dv for keys j0..j0+63 of kv head kvh; the longest rows (small j0) go
// first. Q and dout stream in tiles of BM queries, over the group's query
// heads and, for each, the positions from i1 = max(0, j0-off) on, the first
// that sees key j0; with none (i1 >= S) the block writes zeros. Per tile, transposed
// (keys are the rows here): P^T = exp(K Q^T - lse), dS^T = P^T * (V dout^T
// - D); dv += P^T dout, dk += dS^T Q (times the scale at the end). K and V
// stay in shared memory for the block's lifetime.
template <int DH, int BM, class Queries>
__device__ __forceinline__ void atc_backward_dkdv(float* dk, float* dv, const float* k, const float* v,
                                                  const Queries& qs, const atc_ktile& K, int S, int off, int H,
                                                  int KV, float scale_log2, float scale) {
  constexpr int KTILE = ATC_ROWS * DH * 2, TILE = BM * DH * 2;
  constexpr int NL = BM * DH / (4 * ATC_THREADS), NK = ATC_ROWS * DH / (4 * ATC_THREADS);
  // K, V, then two buffers of (Q, dout).
  __shared__ atc_f4 smem4[(2 * KTILE + 4 * TILE) / 16];
  unsigned char* smem = (unsigned char*)smem4;
  const atc_saddr sbase = atc_smem_addr(smem);
  const atc_lanes L = atc_lane_roles();
  const int w = (int)threadIdx.x >> 5;
  const int b = K.b, j0 = K.j0, KS = K.KS;
  const long long qstride = (long long)H * DH, kstride = (long long)KV * DH;
  const long long kbase = K.kbase;
  // Queries are indexed by i with position off + i; key row j is at
  // position j + koff, seen by the queries from i1 on.
  const int i1 = j0 + K.koff > off ? j0 + K.koff - off : 0;
  const int per_head = i1 < S ? (S - i1 + BM - 1) / BM : 0, ntiles = K.nh * per_head;
  const int wkey = j0 + 16 * w;  // the warp's first key row
  const int wpos = wkey + K.koff - off;  // its position, counted as a query index

  {
    atc_f4 r[NK];
    atc_load<DH, ATC_ROWS>(r, k + kbase + (long long)j0 * kstride, kstride, KS - j0);
    atc_store<DH, ATC_ROWS>(smem, r);
    atc_load<DH, ATC_ROWS>(r, v + kbase + (long long)j0 * kstride, kstride, KS - j0);
    atc_store<DH, ATC_ROWS>(smem + KTILE, r);
  }

  // Tile t is query head kvh*group + t/per_head, positions i0.. with
  // i0 = i1 + (t % per_head)*BM. Besides Q and dout, each lane fetches lse
  // (times log2 e) and D of the query columns its C fragments hold.
  atc_f4 qr[NL], dr[NL];
  float lsen[BM / 8][2], deln[BM / 8][2];
  auto issue = [&](int t) {
    const int h = K.h0 + t / per_head, i0 = i1 + (t % per_head) * BM;
    const atc_at a = qs.at(b, h, i0);
    atc_load<DH, BM>(qr, a.a, qstride, a.n);
    atc_load<DH, BM>(dr, a.b, qstride, a.n);
#pragma unroll
    for (int n = 0; n < BM / 8; n++)
#pragma unroll
      for (int c = 0; c < 2; c++) {
        const int i = 8 * n + 2 * L.t4 + c;
        lsen[n][c] = i < a.n ? atc_ldg1(a.lse + i) : 0.0f;
        deln[n][c] = i < a.n ? atc_ldg1(a.delta + i) : 0.0f;
      }
  };
  float lsec[BM / 8][2], delc[BM / 8][2];
  auto stage = [&](int t) {
    unsigned char* nb = smem + 2 * KTILE + (t & 1) * 2 * TILE;
    atc_store<DH, BM>(nb, qr);
    atc_store<DH, BM>(nb + TILE, dr);
#pragma unroll
    for (int n = 0; n < BM / 8; n++)
#pragma unroll
      for (int c = 0; c < 2; c++) {
        lsec[n][c] = lsen[n][c] * ATC_LOG2E;
        delc[n][c] = deln[n][c];
      }
  };
  if (ntiles > 0) {
    issue(0);
    stage(0);
  }
  __syncthreads();

  float dka[DH / 8][4], dva[DH / 8][4];
#pragma unroll
  for (int n = 0; n < DH / 8; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) dka[n][e] = dva[n][e] = 0.0f;

  for (int t = 0; t < ntiles; t++) {
    const int i0 = i1 + (t % per_head) * BM;
    if (t + 1 < ntiles) issue(t + 1);
    const atc_saddr qs = sbase + 2 * KTILE + (t & 1) * 2 * TILE, ds = qs + TILE;
    // Warp-uniform: queries before every key of this warp see none of them.
    if (i0 + BM - 1 >= wpos) {
      float s[BM / 8][4], dp[BM / 8][4];
#pragma unroll
      for (int n = 0; n < BM / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < DH / 16; kk++) {
        unsigned int ka[4], va[4];
        atc_ldsm(ka, sbase + atc_off<DH>(16 * w + L.arow, 2 * kk + L.achunk));
        atc_ldsm(va, sbase + KTILE + atc_off<DH>(16 * w + L.arow, 2 * kk + L.achunk));
#pragma unroll
        for (int j = 0; j < BM / 16; j++) {
          unsigned int bf[4];
          atc_ldsm(bf, qs + atc_off<DH>(16 * j + L.brow, 2 * kk + L.bchunk));
          atc_mma(s[2 * j], ka, bf[0], bf[1]);
          atc_mma(s[2 * j + 1], ka, bf[2], bf[3]);
          atc_ldsm(bf, ds + atc_off<DH>(16 * j + L.brow, 2 * kk + L.bchunk));
          atc_mma(dp[2 * j], va, bf[0], bf[1]);
          atc_mma(dp[2 * j + 1], va, bf[2], bf[3]);
        }
      }
      // s becomes P^T, dp becomes dS^T; a query that does not see the key
      // (i < j's position), or past S, gives 0.
#pragma unroll
      for (int n = 0; n < BM / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int i = i0 + 8 * n + 2 * L.t4 + (e & 1), j = wpos + L.g + 8 * (e >> 1);
          const float p = i < j || i >= S ? 0.0f : atc_ex2(s[n][e] * scale_log2 - lsec[n][e & 1]);
          dp[n][e] = p * (dp[n][e] - delc[n][e & 1]);
          s[n][e] = p;
        }
#pragma unroll
      for (int kk = 0; kk < BM / 16; kk++) {
        unsigned int pa[4], da[4];
        atc_a_frag(pa, s[2 * kk], s[2 * kk + 1]);
        atc_a_frag(da, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
        for (int j = 0; j < DH / 16; j++) {
          unsigned int bf[4];
          atc_ldsm_t(bf, ds + atc_off<DH>(16 * kk + L.arow, 2 * j + L.achunk));
          atc_mma(dva[2 * j], pa, bf[0], bf[1]);
          atc_mma(dva[2 * j + 1], pa, bf[2], bf[3]);
          atc_ldsm_t(bf, qs + atc_off<DH>(16 * kk + L.arow, 2 * j + L.achunk));
          atc_mma(dka[2 * j], da, bf[0], bf[1]);
          atc_mma(dka[2 * j + 1], da, bf[2], bf[3]);
        }
      }
    }
    if (t + 1 < ntiles) stage(t + 1);
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int j = wkey + L.g + 8 * r;
    if (j < KS) {
      const long long row = kbase + (long long)j * kstride + 2 * L.t4;
#pragma unroll
      for (int n = 0; n < DH / 8; n++) {
        *(atc_f2*)(dk + row + 8 * n) = atc_f2{dka[n][2 * r] * scale, dka[n][2 * r + 1] * scale};
        *(atc_f2*)(dv + row + 8 * n) = atc_f2{dva[n][2 * r], dva[n][2 * r + 1]};
      }
    }
  }
}

// The entry points. Tile sizes per head dim keep registers under ~200 and
// static shared memory within 48 KiB: forward BN = 64 / 32 keys, dq
// BN = 32 / 16 keys, dk/dv BM = 32 / 16 queries for Dh = 64 / 128. The dq
// kernels of Dh = 64 are held to 170 registers, three blocks per SM (at
// 176 they ran two, 12% slower end to end on an H200).
//
// The plain kernels serve one call (backend.AttnShape): grid (B*H or
// B*KV, ceil(rows/64)), the longest rows first (the last queries in the
// forward and dq, the first keys in dk/dv).

template <int DH>
__device__ __forceinline__ atc_qtile atc_plain_qtile(int S, int off, int H) {
  const int b = blockIdx.x / H, h = blockIdx.x % H;
  return atc_qtile{b, h, (int)(gridDim.y - 1 - blockIdx.y) * ATC_ROWS, S, off,
                   (long long)b * S * H * DH + (long long)h * DH, ((long long)b * H + h) * S};
}

template <int DH>
__device__ __forceinline__ atc_keys_one atc_plain_keys(const float* k, const float* v, int KS, int H, int KV) {
  const int b = blockIdx.x / H, kvh = (blockIdx.x % H) / (H / KV);
  const long long o = (long long)b * KS * KV * DH + (long long)kvh * DH;
  return atc_keys_one{k + o, v + o, KS, (long long)KV * DH};
}

template <int DH>
__device__ __forceinline__ atc_ktile atc_plain_ktile(int KS, int H, int KV) {
  const int b = blockIdx.x / KV, kvh = blockIdx.x % KV, group = H / KV;
  return atc_ktile{b, kvh, (int)blockIdx.y * ATC_ROWS, KS, 0, kvh * group, group,
                   (long long)b * KS * KV * DH + (long long)kvh * DH};
}

extern "C" __global__ void __launch_bounds__(128) attn_tc_forward_d64(float* out, float* lse, const float* q, const float* k, const float* v, int S, int KS, int off, int H, int KV, float scale_log2) {
  atc_forward<64, 64>(out, lse, q, atc_plain_keys<64>(k, v, KS, H, KV), atc_plain_qtile<64>(S, off, H), H, KV, scale_log2);
}

extern "C" __global__ void __launch_bounds__(128) attn_tc_forward_d128(float* out, float* lse, const float* q, const float* k, const float* v, int S, int KS, int off, int H, int KV, float scale_log2) {
  atc_forward<128, 32>(out, lse, q, atc_plain_keys<128>(k, v, KS, H, KV), atc_plain_qtile<128>(S, off, H), H, KV, scale_log2);
}

extern "C" __global__ void __launch_bounds__(128, 3) attn_tc_backward_dq_d64(float* dq, float* delta, const float* dout, const float* q, const float* k, const float* v, const float* out, const float* lse, int S, int KS, int off, int H, int KV, float scale_log2, float scale) {
  atc_backward_dq<64, 32>(dq, delta, dout, q, atc_plain_keys<64>(k, v, KS, H, KV), out, lse, atc_plain_qtile<64>(S, off, H), H, KV, scale_log2, scale);
}

extern "C" __global__ void __launch_bounds__(128) attn_tc_backward_dq_d128(float* dq, float* delta, const float* dout, const float* q, const float* k, const float* v, const float* out, const float* lse, int S, int KS, int off, int H, int KV, float scale_log2, float scale) {
  atc_backward_dq<128, 16>(dq, delta, dout, q, atc_plain_keys<128>(k, v, KS, H, KV), out, lse, atc_plain_qtile<128>(S, off, H), H, KV, scale_log2, scale);
}

extern "C" __global__ void __launch_bounds__(128) attn_tc_backward_dkdv_d64(float* dk, float* dv, const float* dout, const float* q, const float* k, const float* v, const float* lse, const float* delta, int S, int KS, int off, int H, int KV, float scale_log2, float scale) {
  atc_backward_dkdv<64, 32>(dk, dv, k, v, atc_queries_one{q, dout, lse, delta, S, H, 64}, atc_plain_ktile<64>(KS, H, KV), S, off, H, KV, scale_log2, scale);
}

extern "C" __global__ void __launch_bounds__(128) attn_tc_backward_dkdv_d128(float* dk, float* dv, const float* dout, const float* q, const float* k, const float* v, const float* lse, const float* delta, int S, int KS, int off, int H, int KV, float scale_log2, float scale) {
  atc_backward_dkdv<128, 16>(dk, dv, k, v, atc_queries_one{q, dout, lse, delta, S, H, 128}, atc_plain_ktile<128>(KS, H, KV), S, off, H, KV, scale_log2, scale);
}

// The zigzag kernels serve one context-parallel rank r of W
// (backend.ZigzagShape): its 2C local rows of each of B sequences, their
// keys (or, for dk/dv, their queries) read from every rank's tensors
// through tables of W device pointers. The forward and dq blocks take a
// 64-row tile of one local chunk, the later chunk's tiles first and each
// chunk's last rows first (the longest rows); the block's keys are the
// positions 0.. its last row, in position order (atc_keys_zz). The dk/dv
// blocks take a 64-row tile of keys, the earlier chunk first, and every
// query of the sequence from the tile's first position on, one query head
// per block: a rank holds 1/W of the keys, and with the heads of a GQA
// group in one block (as the plain kernel has them) its first key tile,
// which every query sees, would be one block's work as long as the whole
// rank's share spread over the GPU. Each head's block writes its own
// partial dk, dv, which attn_zz_sum_heads adds in head order. C must be a
// multiple of 64, so no tile straddles two chunks.

__device__ __forceinline__ atc_qtile atc_zz_qtile(int r, int W, int C, int H, int dh) {
  const int b = blockIdx.x / H, h = blockIdx.x % H, per = C / ATC_ROWS, t = blockIdx.y;
  const int n = t < per ? 1 : 0;                          // the local chunk
  const int q0 = n * C + (per - 1 - (t - (1 - n) * per)) * ATC_ROWS;
  const int chunk = n == 0 ? r : 2 * W - 1 - r;
  return atc_qtile{b, h, q0, 2 * C, (chunk - n) * C, (long long)b * 2 * C * H * dh + (long long)h * dh,
                   ((long long)(b * 2 + n) * H + h) * C - (long long)n * C};
}

__device__ __forceinline__ atc_ktile atc_zz_ktile(int r, int W, int C, int H, int KV, int dh) {
  const int b = blockIdx.x / H, h = blockIdx.x % H, kvh = h / (H / KV), per = C / ATC_ROWS, t = blockIdx.y;
  const int n = t < per ? 0 : 1;
  const int chunk = n == 0 ? r : 2 * W - 1 - r;
  return atc_ktile{b, kvh, t * ATC_ROWS, 2 * C, (chunk - n) * C, h, 1,
                   (long long)b * 2 * C * KV * dh + (long long)kvh * dh};
}

// atc_zz_part is the slice of the dk/dv partial sums [H/KV][B*2C, KV*DH]
// that a zigzag dk/dv block of query head h writes: one per head of the
// GQA group (attn_zz_sum_heads adds them up).
__device__ __forceinline__ long long atc_zz_part(int C, int H, int KV, int dh) {
  const int B = gridDim.x / H, h = blockIdx.x % H;
  return (long long)(h % (H / KV)) * B * 2 * C * KV * dh;
}

extern "C" __global__ void __launch_bounds__(128) attn_zz_forward_d64(float* out, float* lse, const float* q, const float* const* ks, const float* const* vs, int r, int W, int C, int H, int KV, float scale_log2) {
  atc_forward<64, 64>(out, lse, q, atc_zz_keys<64>(ks, vs, W, C, H, KV), atc_zz_qtile(r, W, C, H, 64), H, KV, scale_log2);
}

extern "C" __global__ void __launch_bounds__(128) attn_zz_forward_d128(float* out, float* lse, const float* q, const float* const* ks, const float* const* vs, int r, int W, int C, int H, int KV, float scale_log2) {
  atc_forward<128, 32>(out, lse, q, atc_zz_keys<128>(ks, vs, W, C, H, KV), atc_zz_qtile(r, W, C, H, 128), H, KV, scale_log2);
}

extern "C" __global__ void __launch_bounds__(128, 3) attn_zz_backward_dq_d64(float* dq, float* delta, const float* dout, const float* q, const float* out, const float* lse, const float* const* ks, const float* const* vs, int r, int W, int C, int H, int KV, float scale_log2, float scale) {
  atc_backward_dq<64, 32>(dq, delta, dout, q, atc_zz_keys<64>(ks, vs, W, C, H, KV), out, lse, atc_zz_qtile(r, W, C, H, 64), H, KV, scale_log2, scale);
}

extern "C" __global__ void __launch_bounds__(128) attn_zz_backward_dq_d128(float* dq, float* delta, const float* dout, const float* q, const float* out, const float* lse, const float* const* ks, const float* const* vs, int r, int W, int C, int H, int KV, float scale_log2, float scale) {
  atc_backward_dq<128, 16>(dq, delta, dout, q, atc_zz_keys<128>(ks, vs, W, C, H, KV), out, lse, atc_zz_qtile(r, W, C, H, 128), H, KV, scale_log2, scale);
}

extern "C" __global__ void __launch_bounds__(128) attn_zz_backward_dkdv_d64(float* dk, float* dv, const float* k, const float* v, const float* const* qs, const float* const* douts, const float* const* lses, const float* const* deltas, int r, int W, int C, int H, int KV, float scale_log2, float scale) {
  const long long part = atc_zz_part(C, H, KV, 64);
  atc_backward_dkdv<64, 32>(dk + part, dv + part, k, v, atc_queries_zz{qs, douts, lses, deltas, W, C, H, 64}, atc_zz_ktile(r, W, C, H, KV, 64), 2 * W * C, 0, H, KV, scale_log2, scale);
}

extern "C" __global__ void __launch_bounds__(128) attn_zz_backward_dkdv_d128(float* dk, float* dv, const float* k, const float* v, const float* const* qs, const float* const* douts, const float* const* lses, const float* const* deltas, int r, int W, int C, int H, int KV, float scale_log2, float scale) {
  const long long part = atc_zz_part(C, H, KV, 128);
  atc_backward_dkdv<128, 16>(dk + part, dv + part, k, v, atc_queries_zz{qs, douts, lses, deltas, W, C, H, 128}, atc_zz_ktile(r, W, C, H, KV, 128), 2 * W * C, 0, H, KV, scale_log2, scale);
}


// attn_zz_sum_heads: dk = sum over g < group of pk[g*n ..], dv likewise from
// pv, n a multiple of 4; grid-stride over float4s, heads in order.
extern "C" __global__ void __launch_bounds__(256) attn_zz_sum_heads(float* dk, float* dv, const float* pk, const float* pv, long long n, int group) {
  const long long n4 = n / 4;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
    atc_f4 a = atc_ldg4(pk + 4 * i), c = atc_ldg4(pv + 4 * i);
    for (int g = 1; g < group; g++) {
      const atc_f4 x = atc_ldg4(pk + (long long)g * n + 4 * i), y = atc_ldg4(pv + (long long)g * n + 4 * i);
      a.x += x.x, a.y += x.y, a.z += x.z, a.w += x.w;
      c.x += y.x, c.y += y.y, c.z += y.z, c.w += y.w;
    }
    *(atc_f4*)(dk + 4 * i) = a;
    *(atc_f4*)(dv + 4 * i) = c;
  }
}
