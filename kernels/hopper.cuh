// Hopper (sm_90a) building blocks of the grouped GEMM kernels
// (grouped_gemm.cuh, grouped_gemm.cu, moe_fused.cu): one inline function a
// PTX instruction or idiom, so the kernels read as what they do.
//
//   - mbarrier: init, arrive, expect_tx and a bounded wait (a wait past
//     GG_TIMEOUT_NS traps, so a pipeline bug is a launch error, not a hang)
//   - clusters: rank, cluster-wide barrier, peer shared addresses and
//     arrivals on a peer's mbarrier
//   - TMA: tensor loads into shared memory (one block's, or multicast to
//     a cluster's), stores from it (bulk groups), prefetches; gg_tmap is
//     a CUtensorMap passed by value
//   - wgmma: shared-memory descriptors (K-major and MN-major, 128-byte
//     swizzle), fence, commit, wait, m64n128k16 and m64n256k16
//   - warp shuffles, bf16 packing and widening, acquire loads
//
// Sources include it with #include "hopper.cuh"; kernels.Source.Text
// pastes it in (NVRTC is given no include path).

#ifndef __CUDACC_RTC__
// clang-19 (the compile check) has no grid_constant attribute.
#define __grid_constant__
#endif

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
// error at its next synchronization instead of a hung process. The fused
// kernels' waits for a tile's rows give up well before it
// (backend/cuda/moe_fused.go, fusedTimeout), so a consumer waiting on
// that tile's stage never traps first.
#define GG_TIMEOUT_NS 10000000000ull

__device__ __forceinline__ unsigned long long gg_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// gg_trap_timeout ends the launch with an error. It is a call, not an
// inline trap, because ptxas gives a setmaxnreg region whose code holds a
// trap only the kernel's entry register count: the attention forward's
// consumers, raised to 160 or 232 registers, were compiled to 128 or 168
// and spilled (kernels/attention_hopper.md, "Registers and the trap").
__device__ __noinline__ void gg_trap_timeout() { asm volatile("trap;"); }

// gg_bar_wait returns once the phase of parity `parity` has completed.
__device__ __forceinline__ void gg_bar_wait(unsigned bar, unsigned parity) {
  if (gg_bar_try(bar, parity)) return;
  const unsigned long long t0 = gg_globaltimer();
  while (!gg_bar_try(bar, parity)) {
    if (gg_globaltimer() - t0 > GG_TIMEOUT_NS) gg_trap_timeout();
  }
}

// ---- thread-block clusters ----
//
// A kernel launched in clusters (cuLaunchKernelEx) reaches its cluster's
// other blocks' shared memory: their mbarriers, and TMA multicasts that
// land in all of them at once.

__device__ __forceinline__ unsigned gg_cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// gg_cluster_sync: every thread of every block of the cluster; what each
// wrote before it (mbarrier inits included, after
// fence.mbarrier_init.release.cluster) is seen by all after it.
__device__ __forceinline__ void gg_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// gg_peer_addr is the shared::cluster address of this block's shared
// address addr in the shared memory of the block of cluster rank rank.
__device__ __forceinline__ unsigned gg_peer_addr(unsigned addr, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}

// gg_bar_arrive_peer arrives on another block's mbarrier (gg_peer_addr).
// A consumer's arrival on a stage's empty barrier only says that its
// wgmmas are done reading the stage: it publishes no data, so it keeps
// the default CTA-scope semantics. Release at cluster scope compiles to
// MEMBAR.ALL.GPU before the arrival, a wait for every memory operation
// the warp has in flight, each k-block (1.09-1.41x slower in the lab,
// kernels/grouped_gemm.md); the waits on empty barriers likewise acquire
// at CTA scope (cluster scope adds an L1 invalidation after each).
__device__ __forceinline__ void gg_bar_arrive_peer(unsigned clusterAddr) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(clusterAddr) : "memory");
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

// gg_tma_3d_multicast is gg_tma_3d into the shared address dst of every
// block of the cluster that mask names (bit i: cluster rank i), each
// completing its bytes on the mbarrier at bar's offset in that block.
__device__ __forceinline__ void gg_tma_3d_multicast(unsigned dst, const gg_tmap* map, int c0, int c1, int c2,
                                                    unsigned bar, unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(dst),
      "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(mask)
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

// gg_tma_reduce_add_2d queues a TMA reduction of the box at shared
// address src into the tensor at (c0, c1): each element is added to the
// tensor's (float32 maps: f32 adds, performed at L2, atomic per element);
// elements past the bounds are dropped. It joins this thread's current
// bulk async-group, as gg_tma_store_2d.
__device__ __forceinline__ void gg_tma_reduce_add_2d(const gg_tmap* map, int c0, int c1, unsigned src) {
  asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
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

// gg_named_arrive marks this warp's arrival at barrier `id` of `count`
// threads without waiting: the producer's side of a barrier whose
// consumers wait in gg_named_sync (its writes before it are seen by them).
__device__ __forceinline__ void gg_named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// ---- wgmma ----

// gg_desc is the wgmma shared-memory descriptor of a K-major bf16 tile laid
// out by TMA with the 128-byte swizzle (rows of 128 bytes, 1024-byte
// aligned); see grouped_gemm.cuh.
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

// ---- small helpers ----

__device__ __forceinline__ int gg_min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int gg_max(int a, int b) { return a > b ? a : b; }

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

// gg_shfl_ptr is lane src's 64-bit value.
__device__ __forceinline__ long long gg_shfl_ptr(long long v, int src) {
  return (long long)(unsigned)gg_shfl_idx((int)(v & 0xffffffff), src) |
         ((long long)gg_shfl_idx((int)(v >> 32), src) << 32);
}
