// Grouped GEMM for MoE experts on Hopper (sm_90a): for every expert e,
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
// over (expert, m-tile of 128 rows, n-tile of BN columns), in raster
// groups of GM m-tiles (a kernel argument), n-tile major inside a group,
// so the CTAs running together share a few A tiles and a few W tiles
// (gg_tile; GM 1 is plain m-tile major order). Each CTA first turns
// off into the expert's m-tile prefix sums in shared memory (one warp,
// shuffle scan), then maps a global m-tile to its expert by binary search.
// Empty experts own no m-tile. The tile list is mirrored in Go
// (backend/cuda/grouped_gemm.go, ggTileOf) and tested there.
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
// current one). That is the cooperative kernel (n tile 128 or 256). The
// ping-pong kernel (n tile 128, gg_consume_pp) instead gives each consumer
// warpgroup whole 128x128 tiles, alternately, so one's epilogue runs under
// the other's mainloop. __launch_bounds__(384) caps every thread at 168
// registers, which holds the consumers' BN/2 accumulators (128 for BN 256);
// the "r" kernels (bn256r, pp128r) add setmaxnreg under (384, 1): the
// producer warpgroup drops to 40 registers, the consumers rise to 232
// (the ping-pong kernel spilled 88 bytes under the flat 168, so it only
// comes as pp128r).
//
// Epilogue. The default one stores registers straight to global memory
// (masked), with the tensor cores idle meanwhile. The "s" and "h" kernels
// (bn256 + setmaxnreg, bf16 out) instead write a warpgroup's 64x256 block
// to a shared-memory staging buffer in TMA's swizzled box layout and let
// one thread queue TMA stores (cp.async.bulk.tensor, bulk_group) that run
// under the next tile's mainloop; the buffer is reused only after
// cp.async.bulk.wait_group.read. Blocks with rows of the next expert, and
// beta != 0, keep the register path (gg_epilogue_tma).
//
// Every mbarrier wait is bounded (GG_TIMEOUT_NS): a pipeline bug traps
// and surfaces as a launch error at the host's next Sync, not a hang.
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

#ifndef __CUDACC_RTC__
// clang-19 (the compile check) has no grid_constant attribute.
#define __grid_constant__
#endif

#define GG_BM 128
#define GG_BK 64
#define GG_THREADS 384
// Most experts the in-kernel schedule holds (shared memory: 12 bytes each).
#define GG_MAX_EXPERTS 1024

// CUtensorMap: 128 opaque bytes, 64-byte aligned, filled by
// cuTensorMapEncodeTiled on the host and passed by value.
struct __attribute__((aligned(64))) gg_tmap {
  unsigned long long v[16];
};

__device__ __forceinline__ unsigned gg_smem_addr(const void* p) {
  unsigned d;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(d) : "l"(p));
  return d;
}

// ---- mbarrier ----

__device__ __forceinline__ void gg_bar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void gg_bar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void gg_bar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// gg_bar_try reports whether the phase of parity `parity` has completed
// (try_wait itself blocks for a short, hardware-chosen time first).
__device__ __forceinline__ bool gg_bar_try(unsigned bar, unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// A wait longer than this is a bug (a transaction count that never
// completes, a phase mismatch): the kernel traps, so the host gets an
// error at its next synchronization instead of a hung process.
#define GG_TIMEOUT_NS 10000000000ull

__device__ __forceinline__ unsigned long long gg_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// gg_bar_wait returns once the phase of parity `parity` has completed.
__device__ __forceinline__ void gg_bar_wait(unsigned bar, unsigned parity) {
  if (gg_bar_try(bar, parity)) return;
  const unsigned long long t0 = gg_globaltimer();
  while (!gg_bar_try(bar, parity)) {
    if (gg_globaltimer() - t0 > GG_TIMEOUT_NS) asm volatile("trap;");
  }
}

// ---- TMA ----

__device__ __forceinline__ void gg_tma_2d(unsigned dst, const gg_tmap* map, int c0, int c1, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void gg_tma_3d(unsigned dst, const gg_tmap* map, int c0, int c1, int c2, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void gg_prefetch_tmap(const gg_tmap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"((unsigned long long)map) : "memory");
}

// gg_tma_store_2d queues a TMA store of the box at shared address src to
// the tensor at coordinates (c0, c1): elements past the tensor's bounds
// are dropped. It joins this thread's current bulk async-group.
__device__ __forceinline__ void gg_tma_store_2d(const gg_tmap* map, int c0, int c1, unsigned src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                   (unsigned long long)map),
               "r"(c0), "r"(c1), "r"(src)
               : "memory");
}

// gg_tma_prefetch_l2 asks for the box at (c0, c1) to be brought into L2.
__device__ __forceinline__ void gg_tma_prefetch_l2(const gg_tmap* map, int c0, int c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];" ::"l"((unsigned long long)map),
               "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void gg_bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// gg_bulk_wait_read returns once this thread's bulk stores have finished
// reading shared memory (the global writes may still be in flight).
__device__ __forceinline__ void gg_bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// gg_bulk_wait returns once this thread's bulk stores are complete.
__device__ __forceinline__ void gg_bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// gg_named_sync is a barrier over the `count` threads (whole warps) that
// use barrier `id` (0 is __syncthreads's).
__device__ __forceinline__ void gg_named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// ---- wgmma ----

// gg_desc is the wgmma shared-memory descriptor of a K-major bf16 tile laid
// out by TMA with the 128-byte swizzle (rows of 128 bytes, 1024-byte
// aligned); see the header.
__device__ __forceinline__ unsigned long long gg_desc(unsigned saddr) {
  return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}

// gg_desc_mn is the descriptor of an MN-major bf16 tile laid out by TMA
// boxes of {64 M or N, 64 K} with the 128-byte swizzle: each K row is 128
// bytes (64 elements of M or N), 8 K rows make a 1024-byte swizzle atom
// (the stride byte offset), and the next 64 elements of M or N are the
// next box, lbo bytes on (the leading byte offset).
__device__ __forceinline__ unsigned long long gg_desc_mn(unsigned saddr, unsigned lbo) {
  return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFFu) << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void gg_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void gg_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void gg_wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// gg_fence_acc keeps the compiler from moving accumulator reads or writes
// across the asynchronous wgmma window.
template <int R>
__device__ __forceinline__ void gg_fence_acc(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64 x 128] (+)= A[64 x 16] * B[128 x 16]^T, both K-major in shared memory
// (descriptors da, db); scale_d 0 overwrites D, 1 accumulates.
__device__ __forceinline__ void gg_wgmma(float (&d)[64], unsigned long long da, unsigned long long db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, "
      "%64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

// D[64 x 256] (+)= A[64 x 16] * B[256 x 16]^T from shared memory
// (descriptors da, db); scale_d 0 overwrites D, 1 accumulates. TA and TB
// say how A and B are stored: 0 K-major (the default), 1 MN-major (the
// weight-gradient kernel's operands, gg_desc_mn).
template <int TA = 0, int TB = 0>
__device__ __forceinline__ void gg_wgmma(float (&d)[128], unsigned long long da, unsigned long long db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, "
      "%128, %129, p, 1, 1, %131, %132;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}

__device__ __forceinline__ int gg_min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int gg_max(int a, int b) { return a > b ? a : b; }

// ---- small helpers ----

__device__ __forceinline__ int gg_shfl_up(int v, int delta) {
  int r;
  asm volatile("shfl.sync.up.b32 %0, %1, %2, 0x0, 0xffffffff;" : "=r"(r) : "r"(v), "r"(delta));
  return r;
}

__device__ __forceinline__ int gg_shfl_idx(int v, int src) {
  int r;
  asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=r"(r) : "r"(v), "r"(src));
  return r;
}

__device__ __forceinline__ unsigned gg_pack_bf16(float lo, float hi) {
  unsigned d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

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
// the tensor belongs to the tile's expert.
template <int NPASS>
__device__ __forceinline__ void gg_epilogue_tma(const float (&acc)[128], const gg_tmap* mapO, unsigned stg, int wtid,
                                                int warp, int lane, int row0, int n0, int N, float alpha, int id) {
  constexpr int BOXES = 4 / NPASS;  // boxes staged per pass
  const int rl = (warp & 3) * 16 + (lane >> 2);
  const unsigned rowA = stg + rl * 128, rowB = rowA + 8 * 128;
  const int sw = lane >> 2;  // rl & 7, and (rl + 8) & 7
#pragma unroll
  for (int p = 0; p < NPASS; p++) {
    if (wtid == 0) gg_bulk_wait_read();
    gg_named_sync(id, 128);
#pragma unroll
    for (int ii = 0; ii < 8 * BOXES; ii++) {
      const int i = p * 8 * BOXES + ii;  // 8-column group of the 256
      const unsigned o = (ii >> 3) * 8192 + ((((i & 7) ^ sw) << 4) | ((lane & 3) << 2));
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
      for (int b = 0; b < BOXES; b++) {
        const int c = n0 + (p * BOXES + b) * 64;
        if (c < N) gg_tma_store_2d(mapO, c, row0, stg + b * 8192);
      }
      gg_bulk_commit();
    }
  }
}

// gg_tile decodes tile t of the schedule. The M = cum[E] global m-tiles
// are cut into raster groups of GM (the last one may be short, gs); the
// tiles of a group run n-tile major: t -> group t / (GM*nTN), then within
// it m-tile rem % gs, n-tile rem / gs. So the ~132 tiles in flight cover
// about GM m-tiles times 132/GM n-tiles, and both their A rows and their
// W columns stay in L2 (GM 1 is plain m-tile major order: with N 28672
// every wave then streams ~110 distinct W tiles from DRAM). The expert
// is the largest e with cum[e] <= g (empty experts have cum[e] ==
// cum[e+1], so they are never picked for a g they do not own). Mirrored
// by ggTileOf in Go.
struct gg_tile_t {
  int e, row0, rowEnd, n0, g;  // g: the global m-tile index
};

template <int BN>
__device__ __forceinline__ gg_tile_t gg_tile(int t, int nTN, int M, int GM, int E, const int* sBeg, const int* sEnd,
                                             const int* sCum) {
  const int span = GM * nTN, grp = t / span, gbase = grp * GM;
  const int gs = gg_min(GM, M - gbase), rem = t - grp * span;
  const int nt = rem / gs, g = gbase + (rem - nt * gs);
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


// ---- MoE fusion (FUSE 1: Dispatch+GEMM+SwiGLU, FUSE 2: GEMM+Combine) ----
//
// FUSE 1 computes, for the expert-major rows of a rank's experts,
//   xRD[r] = bf16(src_s[tok_s[p]]), (s, p) = refs[r]   (the dispatch)
//   h1 = xRD.W1_e^T, h3 = xRD.W3_e^T, act = silu(h1) * h3 (bf16 out)
// in one persistent grid. Every warp of a block but the TMA thread's
// first gathers (gg_gather): it pulls each row from its source rank's
// token buffer (a plain device pointer: a virtual rank's buffer, or a peer
// GPU's over NVLink), converts it to bf16 into xRD, and publishes per
// m-tile ready counts (release); then the consumer warpgroups compute and
// the producer warpgroup's warps 1 and 2 finish their epilogues (SwiGLU
// and act's store, gg_act_helper). The TMA thread never gathers: it waits
// for an m-tile's count (acquire) before its first A load of that tile,
// so a tile is multiplied as soon as its rows have landed while later
// tiles are still being copied. A tile of 128 rows is gathered as
// GG_CHUNKS chunks, dealt round-robin over every gathering warp of the
// grid in m-tile order (the order the tiles are consumed), so the first
// tiles land first. (FUSE 3 gathers with three warps a block beside its
// products instead, paced; kernels/grouped_gemm.md measures both ways.)
// The B tile is the two halves W1[n0:n0+128] and W3[n0:n0+128] (one
// 256-row wgmma operand), so every thread holds h1 and h3 of the same
// columns and SwiGLU runs in the epilogue, off the consumers' critical
// path.
//
// FUSE 2 is the plain NT product act.W2_e^T whose epilogue writes each
// output row straight to its source: dst_s + p*N for (s, p) = refs[r]
// (float32).
//
// FUSE 3 is FUSE 1's flow for the backward: the gathered rows are the
// output gradients scaled by their gates (dy), the product is the dgrad
// dAct = dy.W2_e (W2_e [K, N] as stored: the B operand MN-major, four
// boxes of 64 columns x 64 rows of K per stage, read with the transpose
// bit and gg_desc_mn as grouped_gemm_tn's operands), and the
// epilogue turns dAct, with the forward's h1 and h3, into dh1 and dh3
// (SwiGLU's backward); dAct never leaves the registers. h1 and h3 come in
// by TMA, box by box, into the staging buffers (the first two boxes of a
// tile are requested early in its mainloop), dh1 and dh3 are written over
// them and leave by TMA stores (gg_epilogue_dswiglu_tma).
//
// FUSE 4 is FUSE 2 over two K halves: dx = dh1.W1_e + dh3.W3_e, the
// k-blocks of (dh1, W1) then those of (dh3, W3) in one accumulator (the
// weights as stored, MN-major, as FUSE 3's W2), the rows written to their
// source ranks.
//
// FUSE 2 and 4 raise per-row completion flags when given them (fz.done,
// per rank its int32 list in send order): a warpgroup's 64-row block of
// an m-tile is written by nTN column tiles, so each warpgroup, once its
// block of a tile is stored, counts the tile in rowTiles[2g + half]
// (zeroed by the host), and the count's last tile sets done_s[p] = 1 for
// the block's rows, released at system scope (gg_mark_rows). The source rank's combine acquires the flag, reads the row and
// sets it back to 0 (combine_rows, kernels/rows.cu), so no host barrier
// has to order a peer's writes before the combine.
//
// The per-tile chunk sets (flags, one int per m-tile, bit c for chunk c)
// are zeroed by the host before each launch. The wait is bounded: past
// fz.timeoutNs the TMA thread records the m-tile, the chunks that landed
// and the source rank of the first missing chunk's first row in fz.fault
// (the first such wait of the launch only), and every later wait of the
// launch returns at once: the kernel finishes, with wrong rows, and the
// host reports the record at its next Sync instead of hanging.
#define GG_CHUNKS 8
#define GG_CHUNK_ROWS (GG_BM / GG_CHUNKS)

struct gg_fuse {
  const gg_tmap* mapW3;                // FUSE 1: W3's map (as mapW); FUSE 4: W3ᵀ's map (the second K half's B)
  const gg_tmap* mapA2;                // FUSE 4: dh3's map (the second K half's A)
  const gg_tmap* mapOut[4];            // {N, rows} maps, 64x64 boxes, 128B swizzle: FUSE 1: h1, h3, act;
                                       // FUSE 3: dh1, dh3 (out), h1, h3 (in)
  unsigned short* h3;                  // FUSE 1: bf16 [rows, N]; FUSE 3: dh3, bf16 [rows, N]
  unsigned short* act;                 // FUSE 1: bf16 [rows, N]
  const unsigned short* h1In;          // FUSE 3: the forward's h1, bf16 [rows, N]
  const unsigned short* h3In;          // FUSE 3: the forward's h3, bf16 [rows, N]
  unsigned short* xRD;                 // FUSE 1, 3: the gathered rows, bf16 [rows, K] (mapA's tensor)
  const int* refs;                     // [rows, 2]: (rank, position)
  const unsigned long long* ptrs;      // FUSE 1, 3: per rank, its float32 source rows [*, K]; FUSE 2, 4: its float32 output rows [*, N]
  const unsigned long long* toks;      // FUSE 1, 3: per rank, its int32 send-order token indices
  const unsigned long long* scales;    // FUSE 3: per rank, its float32 send-order row scales (the gates)
  int* flags;                          // FUSE 1, 3: per m-tile bit set of landed chunks (zeroed by the host)
  int* fault;                          // FUSE 1, 3: [4] the first wait that timed out: FUSE, m-tile, chunks landed, source rank
  unsigned long long timeoutNs;        // FUSE 1, 3: bound of a tile wait
  const unsigned long long* done;      // FUSE 2, 4: per rank, its int32 row flags in send order (0: none)
  int* rowTiles;                       // FUSE 2, 4: [2 * m-tiles] column tiles stored per 64-row block (zeroed)
  int mode;                            // FUSE 1 experiments: 1 no gather/waits, 2 no act (math or store), 4 no silu,
                                       // 16 the gather without the waits (timing only: rows may be stale);
                                       // FUSE 3 experiments: 128 the gather unpaced (no GG_GATHER_LEAD),
                                       // 256 its copy one step deep (not two);
                                       // FUSE 1, 3 test hook: 8 the last m-tile's chunk 0 is never published;
                                       // FUSE 3 experiments: 1 no gather/waits, 16 the register epilogue
                                       // (gg_epilogue_dswiglu) for every block, 32 no dh1/dh3 stores,
                                       // 64 no loads of boxes 2 and 3;
                                       // FUSE 2, 4 test hook: 8 row 0's flag is never raised
};

__device__ __forceinline__ int gg_ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// gg_bf16_lo and gg_bf16_hi widen the low and high bf16 of a pair.
__device__ __forceinline__ float gg_bits_float(unsigned v) {
  float f;
  asm("mov.b32 %0, %1;" : "=f"(f) : "r"(v));
  return f;
}
__device__ __forceinline__ unsigned gg_float_bits(float f) {
  unsigned v;
  asm("mov.b32 %0, %1;" : "=r"(v) : "f"(f));
  return v;
}
__device__ __forceinline__ float gg_bf16_lo(unsigned v) { return gg_bits_float(v << 16); }
__device__ __forceinline__ float gg_bf16_hi(unsigned v) { return gg_bits_float(v & 0xffff0000u); }

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

// gg_shfl_ptr is lane src's 64-bit value.
__device__ __forceinline__ long long gg_shfl_ptr(long long v, int src) {
  return (long long)(unsigned)gg_shfl_idx((int)(v & 0xffffffff), src) |
         ((long long)gg_shfl_idx((int)(v >> 32), src) << 32);
}

// GG_EXPERIMENT selects a compile-time variant of the gather (bits
// below; kernels.Source.Variants lists them). 0, the default, is the
// kernels as trained with. A variant is a compilation of its own, so it
// leaves every other kernel, and the default ones' registers, as they are.
#ifndef GG_EXPERIMENT
#define GG_EXPERIMENT 0
#endif
#define GG_EX_BF16_SOURCES 1  // float32 sources read as bf16 rows (timing only)
#define GG_EX_NO_STORES 2     // the rows loaded, none stored (timing only)
#define GG_EX_STREAMING 4     // loads cache-streaming (ld.global.cs)
#define GG_EX_NO_FENCES 16    // no fences before a chunk's flag (timing only)

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

// The gather's float32 load (GG_EX_STREAMING: evicted first).
#if (GG_EXPERIMENT & GG_EX_STREAMING) != 0
#define GG_GATHER_LD "ld.global.cs.v4.f32"
#else
#define GG_GATHER_LD "ld.global.v4.f32"
#endif

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
// to xRD as bf16. An odd chunk's last pair copies its last row twice.
__device__ __forceinline__ void gg_gather_store(const gg_fuse& fz, int st, int nJ, int nr, int r0, int K, int lane,
                                                float scale, const float (&v)[2][4][8]) {
  if constexpr ((GG_EXPERIMENT & GG_EX_NO_STORES) != 0) return;
  const int i = (st / nJ) * 2, j0 = lane * 8 + (st % nJ) * 1024;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int ii = gg_min(i + h, nr - 1);
    unsigned short* dst = fz.xRD + (long long)(r0 + ii) * K;
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
      }
    }
  }
}

// GG_GATHER_LEAD is how many m-tiles FUSE 3's paced gather may run ahead
// of its block's tiles: 2.5 waves of 132 tiles at moe-small's 11 column
// tiles a row of tiles, far longer than a chunk's copy takes.
#define GG_GATHER_LEAD 32
// GG_FRONT_DONE is a finished block's front: past every m-tile, and far
// enough from INT_MAX that adding the lead cannot overflow.
#define GG_FRONT_DONE (1 << 30)

// gg_gather is a gathering warp's work (FUSE 1, 3): chunks u = cw,
// cw + ncw, ... of the GG_CHUNKS * M chunks, m-tile major; each row is
// read from its source as float32, scaled (FUSE 3: by its send-order
// scale), and written to xRD as bf16 (K is a multiple of 8), then the
// chunk is published. The next chunk's row lookups (references, then
// token indices: two dependent loads) are issued under the current
// chunk's copy and its fence. Two ways to run it:
// - FIRST (FUSE 1; FUSE 3 in moe_dispatch_dgrad_first): every warp of the
//   block but the TMA thread's gathers before its own work, unpaced; the
//   copy is one step deep, since the consumers' code inlines it and a
//   second step's registers cost their mainloop more than the depth
//   gains with eleven warps a block copying (kernels/grouped_gemm.md).
// - otherwise (FUSE 3): three warps a block gather beside the products,
//   paced by the block's front; the copy is bound by load latency, so two
//   steps are in flight (one stored while the next one's loads are out).
template <bool FIRST, bool SRC_BF16>
__device__ __forceinline__ void gg_gather(const gg_fuse& fz, int cw, int ncw, int lane, int K, int E, const int* sBeg,
                                          const int* sEnd, const int* sCum, const volatile int* front) {
  const int total = sCum[E] * GG_CHUNKS, nJ = (K + 1023) / 1024;
  if (cw >= total) return;
  // A source row's length in floats (K bf16 take K / 2).
  const int rowFloats = SRC_BF16 || (GG_EXPERIMENT & GG_EX_BF16_SOURCES) != 0 ? K / 2 : K;
  // Lane i < nr: its row's source rank and send position (the references)
  // and, resolved from them, its source address and scale.
  gg_gather_chunk cur = gg_gather_chunk_of(cw, E, sBeg, sEnd, sCum);
  int refS = 0, refP = 0;
  if (lane < cur.nr) {
    refS = fz.refs[2 * (cur.r0 + lane)];
    refP = fz.refs[2 * (cur.r0 + lane) + 1];
  }
  long long src = 0;
  float scale = 1.0f;
  if (lane < cur.nr) {
    src = (long long)((const float*)fz.ptrs[refS] + (long long)((const int*)fz.toks[refS])[refP] * rowFloats);
    if (fz.scales) scale = ((const float*)fz.scales[refS])[refP];
  }
  for (int u = cw; u < total; u += ncw) {
    // Paced: at most GG_GATHER_LEAD m-tiles ahead of this block's TMA
    // thread (front), so the rows stream in over the whole product rather
    // than in one burst that takes L2 and DRAM bandwidth from its first
    // tiles. No wait can close a cycle: the lowest unpublished chunk's
    // warp is never held, since its block's TMA thread is at that chunk's
    // m-tile or past it (or done: front GG_FRONT_DONE). Pacing only orders
    // work, so a wait past the tile waits' bound gives up on it rather
    // than risk a hang. Lane 0 decides for the warp.
    if (!FIRST && !(fz.mode & 128) && cur.g > *front + GG_GATHER_LEAD) {
      const unsigned long long t0 = gg_globaltimer();
      while (gg_shfl_idx(cur.g > *front + GG_GATHER_LEAD && gg_globaltimer() - t0 < fz.timeoutNs, 0))
        asm volatile("nanosleep.u32 256;");
    }
    const bool more = u + ncw < total;
    gg_gather_chunk next = cur;
    if (more) {
      next = gg_gather_chunk_of(u + ncw, E, sBeg, sEnd, sCum);
      if (lane < next.nr) {
        refS = fz.refs[2 * (next.r0 + lane)];
        refP = fz.refs[2 * (next.r0 + lane) + 1];
      }
    }
    const int steps = ((cur.nr + 1) / 2) * nJ;
    float va[2][4][8], vb[2][4][8];
    if (FIRST || (fz.mode & 256)) {
      // One step in flight (each stored before the next one's loads go
      // out): FIRST, or the experiment of mode 256.
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
      nsrc = (long long)((const float*)fz.ptrs[refS] + (long long)((const int*)fz.toks[refS])[refP] * rowFloats);
      if (fz.scales) nscale = ((const float*)fz.scales[refS])[refP];
    }
    // Every lane's rows are visible at GPU scope, and ordered before the
    // async proxy's (TMA's) reads, before lane 0 publishes the chunk.
    if constexpr ((GG_EXPERIMENT & GG_EX_NO_FENCES) == 0) {
      asm volatile("fence.acq_rel.gpu;" ::: "memory");
      asm volatile("fence.proxy.async.global;" ::: "memory");
    }
    asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
    // Test hook (mode 8): a chunk that is never published, as a peer that
    // never delivers.
    const bool lost = (fz.mode & 8) && cur.g == sCum[E] - 1 && cur.c == 0;
    if (lane == 0 && !lost)
      asm volatile("red.release.gpu.global.or.b32 [%0], %1;" ::"l"(fz.flags + cur.g), "r"(1u << cur.c) : "memory");
    cur = next;
    src = nsrc;
    scale = nscale;
  }
}

// gg_wait_tile returns once m-tile g's GG_CHUNKS chunks have landed (FUSE
// 1 and 3's TMA thread, before the tile's first A load), or the wait timed
// out (this one, recorded in fz.fault, or an earlier one of the launch).
// Its rows are [row0, rowEnd).
#define GG_ALL_CHUNKS ((1 << GG_CHUNKS) - 1)
// kind (the kernel's FUSE, 1 or 3) is the record's first word.
__device__ __forceinline__ void gg_wait_tile(const gg_fuse& fz, int g, int row0, int rowEnd, int kind) {
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
          fz.fault[3] = r < rowEnd ? fz.refs[2 * r] : -1;
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

// gg_block_tma reports whether a warpgroup's 64-row block from row wr0 of
// a tile whose expert ends at rowEnd goes through a TMA-store epilogue:
// every row of it that is inside the tensor (`rows`) is the expert's. A
// full block qualifies, and so does the tensor's last block (TMA clips
// past `rows`); other partial blocks, whose rows past rowEnd belong to
// the next expert, keep the register path (FUSE 1: the helper's plain
// stores, gg_act_rows). Uniform per warpgroup, as the named barriers
// need.
__device__ __forceinline__ bool gg_block_tma(int wr0, int rowEnd, int rows) {
  return wr0 < rowEnd && (wr0 + 64 <= rowEnd || rowEnd == rows);
}

// gg_block_staged reports whether FUSE 1's consumers stage a block for
// their helper warp (gg_stage_h13): every block with a row of the
// expert's. The helper stores the blocks gg_block_tma allows by TMA and
// the others' rows by plain stores (gg_act_rows), so the consumers'
// epilogue is the same short one for every block.
__device__ __forceinline__ bool gg_block_staged(int wr0, int rowEnd) { return wr0 < rowEnd; }

// gg_stage_h13 is the consumers' half of FUSE 1's epilogue: the
// warpgroup writes its
// 64 x 128 blocks of h1 and h3 (bf16) to its two 16 KiB staging buffers,
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
// SILU false writes the product without silu (mode 4, an experiment).
template <bool SILU>
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
        v1[u][w] = SILU ? gg_pack_bf16(gg_silu(a0) * b0, gg_silu(a1) * b1) : gg_pack_bf16(a0 * b0, a1 * b1);
      }
      const unsigned a = stg + 16u * (lane + 32 * (i0 + u));
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(v1[u][0]), "r"(v1[u][1]),
                   "r"(v1[u][2]), "r"(v1[u][3])
                   : "memory");
    }
  }
}

// gg_act_range is gg_act_pieces with mode 4 (no silu) tested once,
// outside the loop. Tested per element, it was a branch
// around every pair's silu that kept the compiler from interleaving the
// pairs' dependent ex2, rcp and multiplies: one warp's act loop was bound
// by their latency, and the fused pair took 0.06-0.10 ms longer at
// moe-small (kernels/grouped_gemm.md).
__device__ __forceinline__ void gg_act_range(const gg_fuse& fz, unsigned stg, int lane) {
  if (fz.mode & 4)
    gg_act_pieces<false>(stg, lane);
  else
    gg_act_pieces<true>(stg, lane);
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
template <bool SILU>
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
    if (fz.mode & 2) continue;  // no act (experiment)
    unsigned va[4];
#pragma unroll
    for (int w = 0; w < 4; w++) {
      const float a0 = gg_bf16_lo(v1[w]), a1 = gg_bf16_hi(v1[w]);
      const float b0 = gg_bf16_lo(v3[w]), b1 = gg_bf16_hi(v3[w]);
      va[w] = SILU ? gg_pack_bf16(gg_silu(a0) * b0, gg_silu(a1) * b1) : gg_pack_bf16(a0 * b0, a1 * b1);
    }
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(fz.act + o), "r"(va[0]), "r"(va[1]), "r"(va[2]),
                 "r"(va[3])
                 : "memory");
  }
}

// gg_act_helper is FUSE 1's act epilogue, run by one warp of the producer
// warpgroup for consumer warpgroup cw (warps 1 and 2 for warpgroups 0 and
// 1). It walks the same tiles as its consumers; for each block they stage
// (gg_stage_h13) it stores h1 and h3 by TMA, and once those stores have
// read the buffers it writes act over h1's buffer (gg_act_range), stores
// act by TMA and frees both buffers (freed); a block TMA cannot store (an
// expert's last, partial) goes out by plain stores (gg_act_rows). Mode
// 2: no act (experiment).
__device__ __forceinline__ void gg_act_helper(const gg_fuse& fz, int cw, int lane, unsigned stg, unsigned staged,
                                              unsigned freed, unsigned short* h1, int rows, int N, int total, int nTN,
                                              int GM, int E, const int* sBeg, const int* sEnd, const int* sCum) {
  unsigned k = 0;  // blocks handled
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const gg_tile_t tile = gg_tile<128>(t, nTN, sCum[E], GM, E, sBeg, sEnd, sCum);
    const int wr0 = tile.row0 + cw * 64;
    if (!gg_block_staged(wr0, tile.rowEnd)) continue;
    gg_bar_wait(staged, k & 1u);
    if (!gg_block_tma(wr0, tile.rowEnd, rows)) {
      // A partial block: its rows by plain stores. No TMA store reads
      // these buffers (the last one to was waited for before they were
      // freed), so they are free once the loads are done.
      asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
      if (fz.mode & 4) gg_act_rows<false>(fz, h1, stg, lane, wr0, tile.rowEnd, tile.n0, N);
      else gg_act_rows<true>(fz, h1, stg, lane, wr0, tile.rowEnd, tile.n0, N);
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
      if (!(fz.mode & 2)) gg_bulk_wait_read();
    }
    if (!(fz.mode & 2)) {
      asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
      gg_act_range(fz, stg, lane);
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

// gg_epilogue_dswiglu is FUSE 3's epilogue: one warpgroup's 64 rows of
// dAct (accumulator groups i: columns n0 + 8i + 2(lane & 3), +1) become
//   dh1 = dAct * h3 * s(h1) * (1 + h1 * (1 - s(h1))),  dh3 = dAct * h1 * s(h1)
// with h1 and h3 read from the forward's rows. Each 32-column block of a
// row is first regrouped so that each lane of a quad holds 8 adjacent
// columns (gg_quad_gather): its h1 and h3 then come as one 16-byte load
// each and dh1, dh3 go out as one 16-byte store each, whole sectors per
// warp. The loads of a block are issued for both row halves before any
// math. Every lane runs the whole loop; rows past rowEnd are masked.
// It takes the blocks gg_epilogue_dswiglu_tma cannot (rows of two
// experts), and every block under mode 16.
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

// gg_epilogue_dswiglu_tma is FUSE 3's epilogue through shared memory: the
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
      if (col < N && !(fz.mode & 32)) {
        gg_tma_store_2d(fz.mapOut[0], col, row0, slot);
        gg_tma_store_2d(fz.mapOut[1], col, row0, slot + 8192u);
      }
      gg_bulk_commit();
      if (b + 2 < 4) {
        gg_bulk_wait_read();
        if (fz.mode & 64) gg_bar_arrive(bar);
        else gg_dswiglu_load(fz, slot, bar, row0, n0, b + 2);
      }
    }
  }
  c += 4;
}

// gg_epilogue_rows stores one warpgroup's 64-row block (float32) with each
// row sent to its source rank's buffer (FUSE 2).
template <int R>
__device__ __forceinline__ void gg_epilogue_rows(const float (&acc)[R], long long r0, int rowEnd, int c0, int N,
                                                 const gg_fuse& fz) {
#pragma unroll
  for (int half = 0; half < 2; half++) {
    const long long r = r0 + 8 * half;
    if (r >= rowEnd) continue;
    const int s = fz.refs[2 * r], p = fz.refs[2 * r + 1];
    float* dst = (float*)fz.ptrs[s] + (long long)p * N;
#pragma unroll
    for (int i = 0; i < R / 4; i++) {
      const int col = c0 + 8 * i;
      if (col < N)
        asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(dst + col), "f"(acc[4 * i + 2 * half]),
                     "f"(acc[4 * i + 2 * half + 1])
                     : "memory");
    }
  }
}

// gg_mark_rows counts one stored tile of a warpgroup's block: rows
// [wr0, wr0 + 64) below rowEnd of m-tile g, half cw (FUSE 2, 4 with
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
    if (r >= rowEnd || ((fz.mode & 8) && r == 0)) continue;
    const int s = fz.refs[2 * r], p = fz.refs[2 * r + 1];
    asm volatile("st.relaxed.sys.global.b32 [%0], %1;" ::"l"((int*)fz.done[s] + p), "r"(1) : "memory");
  }
}

extern __shared__ __attribute__((aligned(1024))) unsigned char gg_smem[];

// gg_consume_pp is the ping-pong consumer (n tile 128): warpgroup cw takes
// every other tile of its CTA's list (local tiles cw, cw+2, ...) and
// computes all 128 rows of it, two m64n128 wgmmas per k16 step, so one
// warpgroup's epilogue runs while the other's mainloop has the tensor
// cores. The ring holds the tiles' k-blocks in list order (nK per tile),
// so a warpgroup skips nK ring slots for each tile of the other one; the
// producer filling the ring in that order is what staggers the two.
template <int STAGES, bool OUT_BF16>
__device__ __forceinline__ void gg_consume_pp(int cw, int warp, int lane, unsigned base, unsigned bars, void* out, int N,
                                              int nTN, int nK, int total, int GM, int E, const int* sBeg, const int* sEnd,
                                              const int* sCum, float alpha, float beta) {
  constexpr unsigned A_BYTES = GG_BM * GG_BK * 2;
  constexpr unsigned STAGE_BYTES = A_BYTES + 128 * GG_BK * 2;
  float acc0[64], acc1[64];  // rows 0..63 and 64..127 of the tile
#pragma unroll
  for (int i = 0; i < 64; i++) acc0[i] = acc1[i] = 0.0f;
  int s = 0, prev = 0;
  unsigned ph = 0;
  int j = 0;  // local tile index
  // Turn-taking barriers (4 warp arrivals each): ordMine is signalled by
  // the other warpgroup when its mainloop is done.
  const unsigned ordMine = bars + 8 * (2 * STAGES + cw), ordOther = bars + 8 * (2 * STAGES + (cw ^ 1));
  unsigned ordPh = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x, j++) {
    if ((j & 1) != cw) {
      // The other warpgroup's tile: skip its nK ring slots.
      const int it = s + nK;
      s = it % STAGES;
      ph ^= (unsigned)(it / STAGES) & 1u;
      continue;
    }
    const gg_tile_t tile = gg_tile<128>(t, nTN, sCum[E], GM, E, sBeg, sEnd, sCum);
    // Mainloops take turns: wait until the other warpgroup has passed
    // every ring wait of the tile before this one. Besides the overlap,
    // this keeps the parity waits valid: the full barrier of each slot is
    // then at most one phase from the one this warpgroup waits for.
    if (j > 0) {
      gg_bar_wait(ordMine, ordPh);
      ordPh ^= 1;
    }
    for (int kb = 0; kb < nK; kb++) {
      gg_bar_wait(bars + 8 * s, ph);
      asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
      const unsigned a = base + s * STAGE_BYTES;
      const unsigned long long da0 = gg_desc(a), da1 = gg_desc(a + 64 * 128), db = gg_desc(a + A_BYTES);
      gg_wgmma_fence();
      gg_fence_acc(acc0);
      gg_fence_acc(acc1);
#pragma unroll
      for (int kk = 0; kk < GG_BK / 16; kk++) {
        const int sc = (kb > 0 || kk > 0) ? 1 : 0;
        gg_wgmma(acc0, da0 + 2 * kk, db + 2 * kk, sc);
        gg_wgmma(acc1, da1 + 2 * kk, db + 2 * kk, sc);
      }
      gg_wgmma_commit();
      if (kb > 0) {
        gg_wgmma_wait<1>();
        gg_fence_acc(acc0);
        gg_fence_acc(acc1);
        if (lane == 0) gg_bar_arrive(bars + 8 * (STAGES + prev));
      }
      prev = s;
      if (++s == STAGES) {
        s = 0;
        ph ^= 1;
      }
    }
    if (lane == 0) gg_bar_arrive(ordOther);
    gg_wgmma_wait<0>();
    gg_fence_acc(acc0);
    gg_fence_acc(acc1);
    if (lane == 0) gg_bar_arrive(bars + 8 * (STAGES + prev));

    const long long r0 = (long long)tile.row0 + (warp & 3) * 16 + (lane >> 2);
    const int c0 = tile.n0 + 2 * (lane & 3);
    gg_epilogue64<OUT_BF16>(acc0, r0, tile.rowEnd, c0, N, out, alpha, beta);
    gg_epilogue64<OUT_BF16>(acc1, r0 + 64, tile.rowEnd, c0, N, out, alpha, beta);
  }
}

// STORE 0 is the register epilogue; STORE 1 and 2 (BN 256, bf16 out, the
// cooperative consumers) stage full-tile results in shared memory and
// store them with TMA through mapO (gg_epilogue_tma with NPASS = STORE):
// 1 stages the whole 128x256 tile (64 KiB), 2 half of it (32 KiB).
//
// FUSE (see "MoE fusion" above): 0 plain; 1 Dispatch+GEMM+SwiGLU (BN 256
// holding W1's and W3's 128 columns, out is h1); 2 GEMM+Combine (out
// unused: rows go to fz.ptrs); 3 Dispatch+dgrad+SwiGLU backward (out is
// dh1); 4 GEMM+Combine over two K halves. GATHER_FIRST (FUSE 3 only;
// FUSE 1 always does): the rows are gathered first, by every warp but the
// TMA thread's, not by three warps beside the products. SRC_BF16 (FUSE 1
// only): the gathered sources are bf16 rows, not float32.
template <int BN, int STAGES, bool OUT_BF16, bool PP, bool REG, int STORE, int FUSE = 0, bool GATHER_FIRST = false,
          bool SRC_BF16 = false>
__device__ __forceinline__ void gg_body(const gg_tmap* mapA, const gg_tmap* mapW, const gg_tmap* mapO, void* out,
                                        const int* off, int rows, int N, int K, int E, int GM, float alpha,
                                        float beta, const gg_fuse& fz = gg_fuse{}) {
  constexpr unsigned A_BYTES = GG_BM * GG_BK * 2;  // 16 KiB
  constexpr unsigned B_BYTES = BN * GG_BK * 2;     // 16 or 32 KiB
  constexpr unsigned STAGE_BYTES = A_BYTES + B_BYTES;
  constexpr int R = BN / 2;  // accumulator floats per consumer thread
  static_assert(STORE == 0 || (BN == 256 && OUT_BF16 && !PP), "the TMA-store epilogue is for bn256 with bf16 out");
  static_assert(FUSE == 0 || (BN == 256 && !PP && !REG && STORE == 0), "the fused kernels are bn256 cooperative");
  // Columns of N per tile: FUSE 1's 256-row B tile is 128 columns of W1
  // and the same 128 of W3.
  constexpr int BNT = FUSE == 1 ? 128 : BN;
  // Staging for the TMA-store epilogue: per consumer warpgroup 64 rows x
  // 256 columns of bf16 (32 KiB) divided by the passes.
  // FUSE 1 stages h1 and h3 in two 16 KiB buffers per consumer
  // warpgroup, and its helper warp writes act over h1's (gg_stage_h13,
  // gg_act_helper), with a staged and a freed barrier per warpgroup
  // (XBARS).
  // FUSE 3 brings h1 and h3 in and sends dh1 and dh3 out through two
  // 16 KiB slots per consumer warpgroup (gg_epilogue_dswiglu_tma), with
  // one barrier per slot (XBARS).
  constexpr unsigned STG_BYTES =
      STORE ? 2u * 32768u / (STORE ? STORE : 1) : ((FUSE == 1 || FUSE == 3) ? 2u * 32768u : 0u);
  constexpr int XBARS = (FUSE == 1 || FUSE == 3) ? 4 : 0;

  // Tiles start 1024-byte aligned (the swizzle is on absolute address
  // bits); the host asks for 1 KiB of slack.
  const unsigned raw = gg_smem_addr(gg_smem);
  const unsigned base = (raw + 1023u) & ~1023u;
  // The stage ring, the staging buffers (STORE), then full[STAGES],
  // empty[STAGES], the ping-pong turn barriers [2] and XBARS more.
  const unsigned stgBase = base + STAGES * STAGE_BYTES;
  const unsigned bars = stgBase + STG_BYTES;
  // FUSE 1: staged[2] then freed[2] (per consumer warpgroup); FUSE 3:
  // [consumer warpgroup][slot].
  const unsigned ebars = bars + 8 * (2 * STAGES + 2);
  int* sBeg = (int*)(gg_smem + (bars - raw) + 16 * STAGES + 16 + 8 * XBARS);
  int* sEnd = sBeg + E;
  int* sCum = sEnd + E;  // E+1
  // FUSE 1, 3: the m-tile of the TMA thread's current tile
  // (GG_FRONT_DONE once it has issued its last), which paces FUSE 3's
  // gather.
  volatile int* sFront = sCum + E + 1;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < STAGES; s++) {
      gg_bar_init(bars + 8 * s, 1);                 // full: the producer's expect_tx
      gg_bar_init(bars + 8 * (STAGES + s), PP ? 4 : 8);  // empty: one arrival per consumer warp that reads it
    }
    gg_bar_init(bars + 8 * (2 * STAGES), 4);
    gg_bar_init(bars + 8 * (2 * STAGES + 1), 4);
    // FUSE 1: one consumer thread's or the helper's arrival; FUSE 3:
    // thread 0's expect_tx.
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
    if ((FUSE == 1 || FUSE == 3) && lane == 0) *sFront = 0;
  }
  __syncthreads();

  GM = gg_max(GM, 1);  // the host sends 1..256; never divide by 0
  // FUSE 4 runs K's k-blocks twice: (A, W) then (A2, W3).
  const int nTN = (N + BNT - 1) / BNT, nK1 = (K + GG_BK - 1) / GG_BK, nK = FUSE == 4 ? 2 * nK1 : nK1;
  const int total = sCum[E] * nTN;
  // How the rows are gathered (gg_gather): first, by every warp but the
  // TMA thread's (FUSE 1; FUSE 3 when GATHER_FIRST), or beside the
  // products by the producer warpgroup's warps 1-3 (FUSE 3).
  static_assert(!GATHER_FIRST || FUSE == 3, "GATHER_FIRST chooses FUSE 3's gather");
  static_assert(!SRC_BF16 || FUSE == 1, "bf16 sources are FUSE 1's (FUSE 3 scales float32 rows)");
  constexpr bool FIRST = FUSE == 1 || (FUSE == 3 && GATHER_FIRST);

  if (warp < 4) {
    // Producer warpgroup: one thread issues every load. REG: the whole
    // warpgroup first gives registers back (40 a thread) so the consumers
    // can take 232 each (128*40 + 256*232 <= 64K).
    if (REG) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
    if (tid != 0) {
      if constexpr (FIRST) {
        // Warps 1-3 here and the consumers' 8 share the gather (11 warps a
        // block), then do their own work: FUSE 1's warps 1 and 2 the act
        // epilogue of consumer warpgroup warp - 1. Warp 0's other lanes
        // have none.
        if (warp > 0 && !(fz.mode & 1))
          gg_gather<true, SRC_BF16>(fz, blockIdx.x * 11 + warp - 1, gridDim.x * 11, lane, K, E, sBeg, sEnd, sCum, sFront);
        if (FUSE == 1 && (warp == 1 || warp == 2))
          gg_act_helper(fz, warp - 1, lane, stgBase + (warp - 1) * (STG_BYTES / 2), ebars + 8 * (warp - 1),
                        ebars + 8 * (warp + 1), (unsigned short*)out, rows, N, total, nTN, GM, E, sBeg, sEnd, sCum);
      } else if (FUSE == 3 && warp > 0 && !(fz.mode & 1)) {
        // The communication warps 1-3, beside the products.
        gg_gather<false, false>(fz, blockIdx.x * 3 + warp - 1, gridDim.x * 3, lane, K, E, sBeg, sEnd, sCum, sFront);
      }
      return;
    }
    gg_prefetch_tmap(mapA);
    gg_prefetch_tmap(mapW);
    if (STORE) gg_prefetch_tmap(mapO);
    if (FUSE == 1) {
      gg_prefetch_tmap(fz.mapW3);
      for (int i = 0; i < 3; i++) gg_prefetch_tmap(fz.mapOut[i]);
    }
    if (FUSE == 4) {
      gg_prefetch_tmap(fz.mapA2);
      gg_prefetch_tmap(fz.mapW3);
    }
    int s = 0;
    unsigned ph = 0;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      const gg_tile_t tile = gg_tile<BNT>(t, nTN, sCum[E], GM, E, sBeg, sEnd, sCum);
      if (FUSE == 1 || FUSE == 3) *sFront = tile.g;
      if ((FUSE == 1 || FUSE == 3) && !(fz.mode & 1) && !(FUSE == 1 && (fz.mode & 16))) {
        gg_wait_tile(fz, tile.g, tile.row0, tile.rowEnd, FUSE);
      }
      for (int kb = 0; kb < nK; kb++) {
        const unsigned full = bars + 8 * s, empty = bars + 8 * (STAGES + s);
        // A fresh barrier counts its "previous" phase (parity 1) as
        // complete, so the first pass over the ring does not wait.
        gg_bar_wait(empty, ph ^ 1);
        gg_bar_expect_tx(full, STAGE_BYTES);
        const unsigned a = base + s * STAGE_BYTES;
        if (FUSE != 4) gg_tma_2d(a, mapA, kb * GG_BK, tile.row0, full);
        if (FUSE == 1) {
          gg_tma_3d(a + A_BYTES, mapW, kb * GG_BK, tile.n0, tile.e, full);
          gg_tma_3d(a + A_BYTES + B_BYTES / 2, fz.mapW3, kb * GG_BK, tile.n0, tile.e, full);
        } else if (FUSE == 4) {
          // k-blocks of (dh1, W1), then of (dh3, W3).
          const bool second = kb >= nK1;
          const int kc = (second ? kb - nK1 : kb) * GG_BK;
          gg_tma_2d(a, second ? fz.mapA2 : mapA, kc, tile.row0, full);
#pragma unroll
          for (int j = 0; j < 4; j++)
            gg_tma_3d(a + A_BYTES + j * 8192u, second ? fz.mapW3 : mapW, tile.n0 + 64 * j, kc, tile.e, full);
        } else if (FUSE == 3) {
          // W2 as it is stored, [E, K, N]: MN-major boxes of 64 columns.
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
    if (FUSE == 1 || FUSE == 3) *sFront = GG_FRONT_DONE;
    return;
  }

  if (REG) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
  const int cw = (warp >> 2) - 1;
  if (PP) {
    gg_consume_pp<STAGES, OUT_BF16>(cw, warp, lane, base, bars, out, N, nTN, nK, total, GM, E, sBeg, sEnd, sCum, alpha,
                                    beta);
    return;
  }
  if constexpr (FIRST) {
    if (!(fz.mode & 1))
      gg_gather<true, SRC_BF16>(fz, blockIdx.x * 11 + warp - 1, gridDim.x * 11, lane, K, E, sBeg, sEnd, sCum, sFront);
  }
  // Consumer warpgroups 1 and 2: rows [64*cw, 64*cw + 64) of the tile.
  float acc[R];
#pragma unroll
  for (int i = 0; i < R; i++) acc[i] = 0.0f;
  int s = 0, prev = 0;
  unsigned ph = 0;
  unsigned stgc = 0;  // FUSE 1: blocks this warpgroup has staged; FUSE 3: boxes it has loaded
  const int wtid = tid - 128 * (cw + 1);
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const gg_tile_t tile = gg_tile<BNT>(t, nTN, sCum[E], GM, E, sBeg, sEnd, sCum);
    // The TMA-store epilogues (STORE and FUSE 3) take the blocks
    // gg_block_tma allows; the others keep the register path. FUSE 1
    // stages every block with rows (gg_block_staged).
    const int wr0 = tile.row0 + cw * 64;
    const bool tmaBlock = gg_block_tma(wr0, tile.rowEnd, rows);
    const bool dswTma = FUSE == 3 && tmaBlock && !(fz.mode & 16);
    // FUSE 3: the k-block after which the tile's first two h1/h3 boxes are
    // requested: late enough that the previous tile's stores have read
    // their slots, early enough that they land before the epilogue.
    const int kPre = gg_min(2, nK - 1);
    for (int kb = 0; kb < nK; kb++) {
      gg_bar_wait(bars + 8 * s, ph);
      // Reconverge the warp before the .aligned wgmma instructions.
      asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");
      const unsigned a = base + s * STAGE_BYTES;
      // The backward kernels (FUSE 3 and 4) read the weights as stored,
      // MN-major; the rest K-major.
      constexpr bool MN_B = FUSE == 3 || FUSE == 4;
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
        if (lane == 0) gg_bar_arrive(bars + 8 * (STAGES + prev));
      }
      prev = s;
      if (++s == STAGES) {
        s = 0;
        ph ^= 1;
      }
      if (dswTma && wtid == 0 && kb == kPre) {
        // The last two boxes are warmed in L2 for the epilogue's loads.
        gg_bulk_wait_read();
        const unsigned slots = stgBase + cw * (STG_BYTES / 2), eb = ebars + 16 * cw;
        gg_dswiglu_load(fz, slots, eb, wr0, tile.n0, 0);
        gg_dswiglu_load(fz, slots + 16384u, eb + 8, wr0, tile.n0, 1);
        for (int b = 2; b < 4; b++) {
          gg_tma_prefetch_l2(fz.mapOut[2], tile.n0 + 64 * b, wr0);
          gg_tma_prefetch_l2(fz.mapOut[3], tile.n0 + 64 * b, wr0);
        }
      }
    }
    gg_wgmma_wait<0>();
    gg_fence_acc(acc);
    if (lane == 0) gg_bar_arrive(bars + 8 * (STAGES + prev));

    if (STORE) {
      // beta != 0 (reads out) keeps the register path.
      if (wr0 >= tile.rowEnd) continue;  // no row of ours in this tile
      if (beta == 0.0f && tmaBlock) {
        gg_epilogue_tma<STORE ? STORE : 1>(*(const float(*)[128])acc, mapO, stgBase + cw * (STG_BYTES / 2), wtid,
                                            warp, lane, wr0, tile.n0, N, alpha, 1 + cw);
        continue;
      }
    }
    // Epilogue: registers straight to global memory, masked to the
    // expert's rows and to N.
    const long long r0 = (long long)tile.row0 + cw * 64 + (warp & 3) * 16 + (lane >> 2);
    if (FUSE == 1) {
      if (gg_block_staged(wr0, tile.rowEnd))
        gg_stage_h13(*(const float(*)[128])acc, stgBase + cw * (STG_BYTES / 2), ebars + 8 * cw, ebars + 8 * (2 + cw),
                     wtid, warp, lane, 1 + cw, stgc);
      continue;
    } else if (FUSE == 3) {
      if (dswTma) {
        gg_epilogue_dswiglu_tma(*(const float(*)[128])acc, fz, stgBase + cw * (STG_BYTES / 2), ebars + 16 * cw, wtid,
                                warp, lane, wr0, tile.n0, N, 1 + cw, stgc);
        continue;
      }
      gg_epilogue_dswiglu(*(const float(*)[128])acc, r0, tile.rowEnd, tile.n0, N, lane, (unsigned short*)out, fz);
    } else if (FUSE == 2 || FUSE == 4) {
      gg_epilogue_rows<R>(acc, r0, tile.rowEnd, tile.n0 + 2 * (lane & 3), N, fz);
      if (fz.done != 0) gg_mark_rows(fz, tile.g, cw, wr0, tile.rowEnd, nTN, warp, lane, 1 + cw);
    } else {
      gg_epilogue64<OUT_BF16>(acc, r0, tile.rowEnd, tile.n0 + 2 * (lane & 3), N, out, alpha, beta);
    }
  }
  // The staging buffers must outlive the stores reading them.
  if ((STORE || FUSE == 1 || FUSE == 3) && wtid == 0) gg_bulk_wait();
}

// The kernels: cooperative with n tile 128 (6 stages) or 256 (4 stages),
// and ping-pong with n tile 128 (6 stages); float32 or bf16 out. The "r"
// kernels use setmaxnreg (producer 40 registers, consumers 232), which
// needs the (384, 1) launch bound to fix the entry count at 168; the
// ping-pong kernel exists only so (version 1's flat-168 pp128 spilled).
// The "s" and "h" kernels are bn256r with the TMA-store epilogue (bf16 out
// only; they also take mapO, the output's {N, rows} bf16 tensor map with
// 64x64 boxes and the 128-byte swizzle): s has 3 stages and stages the
// whole tile (64 KiB), h keeps 4 stages and stages half of it (32 KiB;
// its shared memory fits Hopper's 227 KiB only for E <= 163). GM is the
// raster group (m-tiles, >= 1; see gg_tile).
// Launch: GG_THREADS threads, at most one block per SM (persistent; blocks
// past the tile count exit at once), dynamic shared memory
// 1024 + STAGES*(16384 + BN*128) + staging + 16*STAGES + 16 + 4*(3E+1)
// bytes (ggSmemBytes in backend/cuda/grouped_gemm.go).

extern "C" __global__ void __launch_bounds__(384) grouped_gemm_nt_bn128_f32(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, void* out, const int* off, int rows,
    int N, int K, int E, int GM, float alpha, float beta) {
  gg_body<128, 6, false, false, false, 0>(&mapA, &mapW, nullptr, out, off, rows, N, K, E, GM, alpha, beta);
}

extern "C" __global__ void __launch_bounds__(384) grouped_gemm_nt_bn128_bf16(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, void* out, const int* off, int rows,
    int N, int K, int E, int GM, float alpha, float beta) {
  gg_body<128, 6, true, false, false, 0>(&mapA, &mapW, nullptr, out, off, rows, N, K, E, GM, alpha, beta);
}

extern "C" __global__ void __launch_bounds__(384) grouped_gemm_nt_bn256_f32(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, void* out, const int* off, int rows,
    int N, int K, int E, int GM, float alpha, float beta) {
  gg_body<256, 4, false, false, false, 0>(&mapA, &mapW, nullptr, out, off, rows, N, K, E, GM, alpha, beta);
}

extern "C" __global__ void __launch_bounds__(384) grouped_gemm_nt_bn256_bf16(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, void* out, const int* off, int rows,
    int N, int K, int E, int GM, float alpha, float beta) {
  gg_body<256, 4, true, false, false, 0>(&mapA, &mapW, nullptr, out, off, rows, N, K, E, GM, alpha, beta);
}

extern "C" __global__ void __launch_bounds__(384, 1) grouped_gemm_nt_bn256r_f32(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, void* out, const int* off, int rows,
    int N, int K, int E, int GM, float alpha, float beta) {
  gg_body<256, 4, false, false, true, 0>(&mapA, &mapW, nullptr, out, off, rows, N, K, E, GM, alpha, beta);
}

extern "C" __global__ void __launch_bounds__(384, 1) grouped_gemm_nt_bn256r_bf16(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, void* out, const int* off, int rows,
    int N, int K, int E, int GM, float alpha, float beta) {
  gg_body<256, 4, true, false, true, 0>(&mapA, &mapW, nullptr, out, off, rows, N, K, E, GM, alpha, beta);
}

extern "C" __global__ void __launch_bounds__(384, 1) grouped_gemm_nt_pp128r_f32(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, void* out, const int* off, int rows,
    int N, int K, int E, int GM, float alpha, float beta) {
  gg_body<128, 6, false, true, true, 0>(&mapA, &mapW, nullptr, out, off, rows, N, K, E, GM, alpha, beta);
}

extern "C" __global__ void __launch_bounds__(384, 1) grouped_gemm_nt_pp128r_bf16(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, void* out, const int* off, int rows,
    int N, int K, int E, int GM, float alpha, float beta) {
  gg_body<128, 6, true, true, true, 0>(&mapA, &mapW, nullptr, out, off, rows, N, K, E, GM, alpha, beta);
}

extern "C" __global__ void __launch_bounds__(384, 1) grouped_gemm_nt_bn256s_bf16(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, const __grid_constant__ gg_tmap mapO,
    void* out, const int* off, int rows, int N, int K, int E, int GM, float alpha, float beta) {
  gg_body<256, 3, true, false, true, 1>(&mapA, &mapW, &mapO, out, off, rows, N, K, E, GM, alpha, beta);
}

extern "C" __global__ void __launch_bounds__(384, 1) grouped_gemm_nt_bn256h_bf16(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, const __grid_constant__ gg_tmap mapO,
    void* out, const int* off, int rows, int N, int K, int E, int GM, float alpha, float beta) {
  gg_body<256, 4, true, false, true, 2>(&mapA, &mapW, &mapO, out, off, rows, N, K, E, GM, alpha, beta);
}

// The MoE fused kernels (FUSE 1 and 2 of gg_body; bn256 cooperative).
// moe_dispatch_swiglu (3 stages, TMA-store epilogue): mapA is xRD's
// {K, rows} map (written by the kernel itself before it is read), mapW and
// mapW3 are W1's and W3's {K, N, E} maps with boxes of 128 rows; mapH1,
// mapH3 and mapAct the outputs' {N, rows} maps (64x64 boxes); h1, h3, act
// are bf16 [rows, N]; refs [rows, 2]; ptrs/toks per rank; flags one int
// per m-tile (at least rows/128 + E), zeroed; fault [4] zeroed, written
// by a tile wait that passed timeoutNs (see gg_wait_tile).
// moe_down_combine: mapA is act's map, mapW W2's (boxes of 256 rows); ptrs
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
      int *flags, int *fault, unsigned long long timeoutNs, const int *off, int rows, int N, int K, int E, int GM,   \
      int mode
#define GG_SWIGLU_ARGS                                                                                              \
  mapA, mapW, mapW3, mapH1, mapH3, mapAct, h1, h3, act, xRD, refs, ptrs, toks, flags, fault, timeoutNs, off, rows, N, \
      K, E, GM, mode

template <bool SRC_BF16>
__device__ __forceinline__ void moe_dispatch_swiglu_body(
    const gg_tmap& mapA, const gg_tmap& mapW, const gg_tmap& mapW3, const gg_tmap& mapH1, const gg_tmap& mapH3,
    const gg_tmap& mapAct, unsigned short* h1, unsigned short* h3, unsigned short* act, unsigned short* xRD,
    const int* refs, const unsigned long long* ptrs, const unsigned long long* toks, int* flags, int* fault,
    unsigned long long timeoutNs, const int* off, int rows, int N, int K, int E, int GM, int mode) {
  gg_fuse fz = {};
  fz.mode = mode;
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
  gg_body<256, 3, true, false, false, 0, 1, false, SRC_BF16>(&mapA, &mapW, nullptr, h1, off, rows, N, K, E, GM, 1.0f,
                                                             0.0f, fz);
}

extern "C" __global__ void __launch_bounds__(384, 1) moe_dispatch_swiglu(GG_SWIGLU_PARAMS) {
  moe_dispatch_swiglu_body<false>(GG_SWIGLU_ARGS);
}

extern "C" __global__ void __launch_bounds__(384, 1) moe_dispatch_swiglu_bf16(GG_SWIGLU_PARAMS) {
  moe_dispatch_swiglu_body<true>(GG_SWIGLU_ARGS);
}

// moe_dispatch_dgrad (FUSE 3, 3 stages, TMA loads and stores in the
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
      unsigned long long timeoutNs, const int *off, int rows, int N, int K, int E, int GM, int mode
#define GG_DGRAD_ARGS                                                                                          \
  mapA, mapW, mapDh1, mapDh3, mapH1, mapH3, dh1, dh3, h1, h3, dy, refs, ptrs, toks, scales, flags, fault, timeoutNs, \
      off, rows, N, K, E, GM, mode

template <bool GATHER_FIRST>
__device__ __forceinline__ void moe_dispatch_dgrad_body(
    const gg_tmap& mapA, const gg_tmap& mapW, const gg_tmap& mapDh1, const gg_tmap& mapDh3, const gg_tmap& mapH1,
    const gg_tmap& mapH3, unsigned short* dh1, unsigned short* dh3, const unsigned short* h1, const unsigned short* h3,
    unsigned short* dy, const int* refs, const unsigned long long* ptrs, const unsigned long long* toks,
    const unsigned long long* scales, int* flags, int* fault, unsigned long long timeoutNs, const int* off, int rows,
    int N, int K, int E, int GM, int mode) {
  gg_fuse fz = {};
  fz.mode = mode;
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
  gg_body<256, 3, true, false, false, 0, 3, GATHER_FIRST>(&mapA, &mapW, nullptr, dh1, off, rows, N, K, E, GM, 1.0f,
                                                          0.0f, fz);
}

extern "C" __global__ void __launch_bounds__(384, 1) moe_dispatch_dgrad(GG_DGRAD_PARAMS) {
  moe_dispatch_dgrad_body<false>(GG_DGRAD_ARGS);
}

extern "C" __global__ void __launch_bounds__(384, 1) moe_dispatch_dgrad_first(GG_DGRAD_PARAMS) {
  moe_dispatch_dgrad_body<true>(GG_DGRAD_ARGS);
}

// moe_dgrad_combine (FUSE 4, 4 stages): dx = dh1.W1 + dh3.W3 per expert,
// rows to their source ranks as moe_down_combine; mapA and mapA2 are dh1's
// and dh3's {K, rows} maps (K = F), mapW and mapW3 W1's and W3's
// {N, K, E} maps (as stored, [E, F, D]; boxes of 64 columns x 64 rows;
// N = D); done and rowTiles as
// moe_down_combine's.
extern "C" __global__ void __launch_bounds__(384, 1) moe_dgrad_combine(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapA2, const __grid_constant__ gg_tmap mapW,
    const __grid_constant__ gg_tmap mapW3, const int* refs, const unsigned long long* ptrs,
    const unsigned long long* done, int* rowTiles, const int* off, int rows, int N, int K, int E, int GM, int mode) {
  gg_fuse fz = {};
  fz.mapA2 = &mapA2;
  fz.mapW3 = &mapW3;
  fz.refs = refs;
  fz.ptrs = ptrs;
  fz.done = done;
  fz.rowTiles = rowTiles;
  fz.mode = mode;
  gg_body<256, 4, false, false, false, 0, 4>(&mapA, &mapW, nullptr, nullptr, off, rows, N, K, E, GM, 1.0f, 0.0f, fz);
}


extern "C" __global__ void __launch_bounds__(384, 1) moe_down_combine(
    const __grid_constant__ gg_tmap mapA, const __grid_constant__ gg_tmap mapW, const int* refs,
    const unsigned long long* ptrs, const unsigned long long* done, int* rowTiles, const int* off, int rows, int N,
    int K, int E, int GM, int mode) {
  gg_fuse fz = {};
  fz.refs = refs;
  fz.ptrs = ptrs;
  fz.done = done;
  fz.rowTiles = rowTiles;
  fz.mode = mode;
  gg_body<256, 4, false, false, false, 0, 2>(&mapA, &mapW, nullptr, nullptr, off, rows, N, K, E, GM, 1.0f, 0.0f, fz);
}

// ---- Weight gradients: the grouped TN product ----
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
// A, as gg_body's cooperative mainloop does.
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
  const int cw = (warp >> 2) - 1, wtid = tid - 128 * (cw + 1);
  float acc[128];
  int s = 0, prev = 0;
  unsigned ph = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    int e, m0, n0, beg, end;
    gg_tn_tile(t, nTM, nTN, e, m0, n0);
    gg_tn_rows(off, e, rows, beg, end);
    const int nK = (end - beg + GG_BK - 1) / GG_BK;
    if (nK == 0) {
      if (beta == 1.0f) continue;  // an empty expert's block stays as it is
#pragma unroll
      for (int i = 0; i < 128; i++) acc[i] = 0.0f;
    }
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
