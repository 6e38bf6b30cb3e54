// Hopper's warpgroup MMA (wgmma.mma_async, sm_90a) for the CUDA C++ attention's sm_90 forward (attention.cuh,
// attn_fwd_sm90_kernel): the shared-memory matrix descriptor, the fences, and the products the kernel issues, each a
// warpgroup (4 warps, 64 rows: warp w of the group holds rows 16 w .. 16 w + 15 in mma.sync's m16n8 accumulator
// layout, n-tile i in d[i]):
//   wgmma_ss<T, N>: d (64 x N, fp32) += A (64 x 16) B (16 x N), A and B K-major in shared memory (descriptors);
//   wgmma_ss_first<T, N>: d = A B (the first k-step; d's old values are not read, so the instructions that wrote
//                   them need no ordering against it: ptxas then keeps the chains asynchronous, C7515);
//   wgmma_rs<T, N>: d += A B, A in registers (mma.sync's m16k16 A fragment: acc_to_a), B N-major in shared memory.
// Tiles are stored in 128-byte swizzled rows (sw128_offset): 64 fp16 / bf16 columns a row, rows of 8 a 1024-byte
// atom, the 16-byte chunk c of row r at chunk c ^ (r % 8); wider rows are split into 64-column regions. The code
// exists only in the sm_90a compile (PK_WGMMA); the host launches the kernel only when the build has it
// (PYKERNELS_SM90A, set by setup.py when TORCH_CUDA_ARCH_LIST has 9.0a) and the device is compute capability 9.0.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PK_WGMMA 1
#endif

namespace pykernels {
namespace attn {

// The byte offset of element (r, c) (c a multiple of 8) in a tile of ``rows`` rows stored as 128-byte swizzled rows
__device__ __forceinline__ uint32_t sw128_offset(int rows, int r, int c) {
  return static_cast<uint32_t>((c >> 6) * rows * 128 + r * 128 + ((((c >> 3) & 7) ^ (r & 7)) << 4));
}

// The matrix descriptor of a 128-byte-swizzled operand at shared address ``base + off`` (its atom 1024-byte aligned, or
// a k-step's 32-byte offset into one): LBO the leading and SBO the stride byte offsets (K-major: SBO from 8 rows to
// the next 8, LBO unused; N-major: LBO from 64 columns to the next 64, SBO from 8 k to the next 8). The high word is
// a constant, and the low word base's field plus off / 16 (off a multiple of 16, usually a k-step's constant), so the
// descriptors of one base share its shift and or and cost an add each: a descriptor of base + off as a whole (a mask,
// a shift, an or and moves each) took 168 uniform-datapath instructions a warp and iteration of the fused attention
// backward, about a fifth of its instructions (run279's profile). No carry leaves the 14-bit address field: shared
// addresses are below 2^18.
template <uint32_t LBO, uint32_t SBO>
__device__ __forceinline__ uint64_t gmma_desc(uint32_t base, uint32_t off) {
  constexpr uint32_t lbo = ((LBO & 0x3FFFF) >> 4) << 16, hi = ((SBO & 0x3FFFF) >> 4) | (1u << 30);
  const uint32_t lo = (((base & 0x3FFFF) >> 4) | lbo) + (off >> 4);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

#if defined(PK_WGMMA)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// until at most N of the committed groups are pending (they complete in order)
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void wgmma_wait_all() { wgmma_wait<0>(); }
// shared memory written through the generic proxy (cp.async) made visible to wgmma's async proxy
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// keeps the compiler from moving reads or writes of an accumulator (float) across a wgmma fence or wait; for a
// wgmma_rs A operand (uint32_t), called after the wait that retires it, keeps its registers holding their values
template <typename E, int N>
__device__ __forceinline__ void fence_acc(E (&d)[N][4]) {
  static_assert(sizeof(E) == 4, "32-bit registers");
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (std::is_same_v<E, float>)
        asm volatile("" : "+f"(d[i][e])::"memory");
      else
        asm volatile("" : "+r"(d[i][e])::"memory");
    }
}

// The warp-specialised forward's synchronisation (attn_fwd_sm90_ws_kernel): mbarriers in shared memory (``bar``
// their shared addresses), named barriers, and the warpgroups' register reallocation.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// blocks until the phase of parity ``parity`` has completed (parity 1 before any: returns at once)
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "PK_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra PK_WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Two phases at once: both barriers polled before either's branch (one round trip where two waits in a row take two)
__device__ __forceinline__ void mbar_wait2(uint32_t a, uint32_t pa, uint32_t b, uint32_t pb) {
  asm volatile(
      "{\n.reg .pred da, db;\n"
      "PK_WAIT2:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 da, [%0], %1;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 db, [%2], %3;\n"
      "@!da bra PK_WAIT2;\n"
      "@!db bra PK_WAIT2;\n}\n" ::"r"(a),
      "r"(pa), "r"(b), "r"(pb)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// an arrival on ``bar`` once every cp.async this thread issued so far has landed (counted in the barrier's init)
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// The same arrival with the barrier's pending count raised by one first (no net change: the tail of a tile that TMA
// loads otherwise, whose own single arrival then comes from one thread once every thread has issued this one)
__device__ __forceinline__ void cp_async_arrive_inc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// TMA (the bulk tensor copy engine): an arrival on ``bar`` that also expects ``bytes`` more to land on it, and the box
// of the 4-D tensor map at ``map`` (a __grid_constant__ kernel parameter) at coordinates c0..c3 into shared memory at
// ``dst`` (1024-byte aligned for the map's 128-byte swizzle), its bytes counted on ``bar`` as they land
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
// The shared tile at ``src`` (in the map's 128-byte swizzled layout, 1024-byte aligned) stored into the box of the 4-D
// tensor map at ``map`` at coordinates c0..c3 (elements outside the tensor are not written), as one bulk group
__device__ __forceinline__ void tma_store_4d(const void* map, uint32_t src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// The thread's bulk groups: read from shared memory (it may be written again) / complete (before the kernel ends)
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// named barrier ``id`` of ``n`` threads: wait for it / arrive without waiting
__device__ __forceinline__ void named_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
template <int N>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t da, uint64_t db);
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss_first(float (&d)[N / 8][4], uint64_t da, uint64_t db);
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db);

// The products' asm, one macro a form: m64nNk16 with N / 2 accumulator operands, d[i][e] as operand 4 i + e, listed
// by PK_WG_D<N>(C) with C the constraint (PK_WG_ACC: read and written; PK_WG_OUT: written only, the first k-step),
// then the descriptors (and A's 4 registers) and the scale-d flag (whether d is read). TY is the PTX type (f16, bf16).
#define PK_WG_ACC(x) "+f"(x)
#define PK_WG_OUT(x) "=f"(x)
#define PK_WG_D4(C, i) C(d[i][0]), C(d[i][1]), C(d[i][2]), C(d[i][3])
#define PK_WG_D32(C) PK_WG_D4(C, 0), PK_WG_D4(C, 1), PK_WG_D4(C, 2), PK_WG_D4(C, 3)
#define PK_WG_D64(C) PK_WG_D32(C), PK_WG_D4(C, 4), PK_WG_D4(C, 5), PK_WG_D4(C, 6), PK_WG_D4(C, 7)
#define PK_WG_D128(C) \
  PK_WG_D64(C), PK_WG_D4(C, 8), PK_WG_D4(C, 9), PK_WG_D4(C, 10), PK_WG_D4(C, 11), PK_WG_D4(C, 12), PK_WG_D4(C, 13), \
      PK_WG_D4(C, 14), PK_WG_D4(C, 15)
#define PK_WG_R32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define PK_WG_R64                                                                                                    \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "  \
  "%24, %25, %26, %27, %28, %29, %30, %31}"
#define PK_WG_R128                                                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "  \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "    \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
// wgmma_ss / wgmma_ss_first (F: the function, C: the constraint, SC: scale-d) at N; a0 = N / 2 the first operand after
// the accumulators
#define PK_WGMMA_SS(F, T, TY, N, C, SC, a0, a1, a2)                                                                 \
  template <>                                                                                                        \
  __device__ __forceinline__ void F<T, N>(float (&d)[N / 8][4], uint64_t da, uint64_t db) {                          \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #a2 ", 0;\n"                                                   \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " PK_WG_R##N ", "                    \
                 "%" #a0 ", %" #a1 ", p, 1, 1, 0, 0;\n}\n"                                                           \
                 : PK_WG_D##N(C)                                                                                     \
                 : "l"(da), "l"(db), "r"(SC));                                                                       \
  }
#define PK_WGMMA_RS(T, TY, N, a0, a1, a2, a3, a4, a5)                                                               \
  template <>                                                                                                        \
  __device__ __forceinline__ void wgmma_rs<T, N>(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db) {        \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #a5 ", 0;\n"                                                   \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " PK_WG_R##N ", "                    \
                 "{%" #a0 ", %" #a1 ", %" #a2 ", %" #a3 "}, %" #a4 ", p, 1, 1, 1;\n}\n"                              \
                 : PK_WG_D##N(PK_WG_ACC)                                                                             \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));                                     \
  }
#define PK_WGMMA_ALL(T, TY)                                           \
  PK_WGMMA_SS(wgmma_ss, T, TY, 32, PK_WG_ACC, 1, 16, 17, 18)          \
  PK_WGMMA_SS(wgmma_ss, T, TY, 64, PK_WG_ACC, 1, 32, 33, 34)          \
  PK_WGMMA_SS(wgmma_ss, T, TY, 128, PK_WG_ACC, 1, 64, 65, 66)         \
  PK_WGMMA_SS(wgmma_ss_first, T, TY, 32, PK_WG_OUT, 0, 16, 17, 18)    \
  PK_WGMMA_SS(wgmma_ss_first, T, TY, 64, PK_WG_OUT, 0, 32, 33, 34)    \
  PK_WGMMA_SS(wgmma_ss_first, T, TY, 128, PK_WG_OUT, 0, 64, 65, 66)   \
  PK_WGMMA_RS(T, TY, 32, 16, 17, 18, 19, 20, 21)                      \
  PK_WGMMA_RS(T, TY, 64, 32, 33, 34, 35, 36, 37)                      \
  PK_WGMMA_RS(T, TY, 128, 64, 65, 66, 67, 68, 69)
PK_WGMMA_ALL(__half, "f16")
PK_WGMMA_ALL(__nv_bfloat16, "bf16")
#undef PK_WGMMA_ALL
#undef PK_WGMMA_RS
#undef PK_WGMMA_SS

// d (64 x 64, fp32) = A B (acc 0) or += A B (acc 1), A MN-major in shared memory (the transposed operand: its 64 rows
// are a tile's 64 columns, tnspA), B K-major: the fused backward's dQ^T = K^T dS^T (a head-dim-row x query tile, 64
// queries)
template <typename T>
__device__ __forceinline__ void wgmma_ss_ta64(float (&d)[8][4], uint64_t da, uint64_t db, int acc);
#define PK_WGMMA_SS_TA(T, TY)                                                                                        \
  template <>                                                                                                        \
  __device__ __forceinline__ void wgmma_ss_ta64<T>(float (&d)[8][4], uint64_t da, uint64_t db, int acc) {            \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                       \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " PK_WG_R64 ", "                         \
                 "%32, %33, p, 1, 1, 1, 0;\n}\n"                                                                    \
                 : PK_WG_D64(PK_WG_ACC)                                                                              \
                 : "l"(da), "l"(db), "r"(acc));                                                                      \
  }
PK_WGMMA_SS_TA(__nv_bfloat16, "bf16")
PK_WGMMA_SS_TA(__half, "f16")
#undef PK_WGMMA_SS_TA
#undef PK_WG_R128
#undef PK_WG_R64
#undef PK_WG_R32
#undef PK_WG_D128
#undef PK_WG_D64
#undef PK_WG_D32
#undef PK_WG_D4
#undef PK_WG_OUT
#undef PK_WG_ACC

// acc = A B^T, one wgmma chain over D / 16 k-steps (issued, not committed): A's rows at shared address a, B's at b,
// both K-major in 128-byte swizzled rows (sw128_offset) of AR and BR rows a 64-column region; the first k-step
// overwrites acc. S = Q K^T in the forward kernels.
template <typename T, int N, int D, int AR, int BR>
__device__ __forceinline__ void wgmma_chain_ss(float (&acc)[N / 8][4], uint32_t a, uint32_t b) {
#pragma unroll
  for (int kt = 0; kt < D / 16; ++kt) {
    const uint32_t col = kt >> 2, kk = (kt & 3) * 32u;
    const uint64_t da = gmma_desc<16, 1024>(a, col * AR * 128 + kk);
    const uint64_t db = gmma_desc<16, 1024>(b, col * BR * 128 + kk);
    if (kt == 0)
      wgmma_ss_first<T, N>(acc, da, db);
    else
      wgmma_ss<T, N>(acc, da, db);
  }
}
#endif  // PK_WGMMA

}  // namespace attn
}  // namespace pykernels
