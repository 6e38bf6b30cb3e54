// Does one warpgroup's tensor-core work slow another warpgroup's softmax on the same SM? softmax_probe.cuh's softmax
// step (64 scores a thread: max, exp2, sums, bf16 packs) in warpgroup 0 while warpgroup 1 is idle, or loops over the
// forward's products at BERT's tile (S = Q K^T: 64 x 128 x 64 from shared memory; O += P V: 64 x 64 x 128 with P from
// registers), each committed and waited as the kernel does. One block an SM. Prints warpgroup 0's SM cycles a
// softmax and warpgroup 1's a product pair (clock64), each alone and together.
// The last rows run attention.cuh's own softmax_block (and P's packs) in warpgroup 0 instead, with 0, 4 and 6 of each 16
// n-tiles' exponentials exp2_fma's.
// Build and run (device; attention.cuh needs torch's C++ headers):
//   nvcc -O3 --use_fast_math -arch=sm_90a -DPYKERNELS_SM90A -I csrc $(python3 -c "from torch.utils.cpp_extension import
//   include_paths as i; print(' '.join('-I' + p for p in i()))") -o /tmp/swp benchmarks/dev/softmax_wgmma_probe.cu && /tmp/swp
#include <cstdio>

#include "attention.cuh"
#include "softmax_probe.cuh"

using namespace pykernels::attn;

enum Gemm { kIdle = 0, kSS = 1, kSSRS = 2 };

// iters softmaxes (warpgroup 0, if soft) and gemm_iters products (warpgroup 1, GEMM); the counts make the two loops
// about equally long, so that each runs beside the other nearly throughout (a stop flag read by each thread would
// leave the warpgroup's threads at different iterations, and wgmma is warpgroup-wide: an illegal instruction)
// KSM >= 0: warpgroup 0 runs the kernel's own softmax_block (attention.cuh) as the warp-specialised forward calls it on
// an unmasked key block at D = 64 (raw scores, the lazy max, no dropout; KSM of each 16 n-tiles' exponentials
// exp2_fma's, softmax_block's kEmu), then P's packs (acc_to_a), each step's scores the previous step's P; else
// softmax_probe.cuh's step
template <int GEMM, int KSM = -1>
__global__ void __launch_bounds__(256, 1) probe(float* out, long long* cycles, int iters, bool soft, int gemm_iters) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = (static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + 1023u) & ~1023u;
  const uint32_t sQ = base, sK = base + 8192, sV = base + 8192 + 16384;
  (void)sQ, (void)sK, (void)sV;
  for (int i = threadIdx.x; i < 40960 / 4; i += blockDim.x) reinterpret_cast<float*>(smem)[i] = 0.01f * (i % 7);
  __syncthreads();
  const int wg = __shfl_sync(0xffffffffu, threadIdx.x >> 7, 0);  // (uniform to ptxas: see attention.cuh)
  float r = 0.f;
  long long n = 0;
  const long long t0 = clock64();
  if (wg == 0) {
    if (soft && KSM >= 0) {
      Params p{};
      p.scale_log2 = 0.125f * kLog2e;
      p.lazy_max = kLazyMax;
      const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t4 = lane & 3;
      const int row[2] = {warp * 16 + (lane >> 2), warp * 16 + (lane >> 2) + 8};
      const Seq sq{0, 0, 512, 512};
      float sc[16][4], o[8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
      uint32_t pa[8][4], acc = 0u;
#pragma unroll
      for (int i = 0; i < 16; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sc[i][e] = 0.01f * ((threadIdx.x * 7 + i * 13 + e) % 97);
          o[i / 2][e] = 0.f;
        }
      for (int it = 0; it < iters; ++it) {
        softmax_block<kModeNone, 128, 64, true, true, 0, (KSM < 0 ? 0 : KSM)>(p, sc, o, m, l, 0, 0, row, 0, sq, false,
                                                                                nullptr, t4);
#pragma unroll
        for (int kt = 0; kt < 8; ++kt) {
          acc_to_a<__nv_bfloat16>(pa[kt], sc[2 * kt], sc[2 * kt + 1]);
          acc ^= pa[kt][0] ^ pa[kt][1] ^ pa[kt][2] ^ pa[kt][3];  // (kept live, as softmax_probe.cuh's packs)
        }
      }
      n = iters;
      r = l[0] + l[1] + m[0] + m[1] + static_cast<float>(acc & 1u);
#pragma unroll
      for (int i = 0; i < 8; ++i) r += o[i][0] + sc[2 * i][1];
    } else if (soft) {
      float x[64];
#pragma unroll
      for (int i = 0; i < 64; ++i) x[i] = 0.001f * ((threadIdx.x * 7 + i * 13) % 97) - 0.05f;
      float m0, m1, l0 = 0.f, l1 = 0.f;
      unsigned acc = 0u;
      for (int it = 0; it < iters; ++it) probe_softmax_step(x, m0, m1, l0, l1, acc);
      n = iters;
      r = l0 + l1 + static_cast<float>(acc & 1u);
#pragma unroll
      for (int i = 0; i < 64; ++i) r += x[i];
    }
  } else if (GEMM != kIdle) {
#if defined(PK_WGMMA)
    float sc[16][4], o[8][4];
    uint32_t pa[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        o[i][e] = 0.f;
        pa[i][e] = 0x3c003c00u;
      }
    for (;;) {
      wgmma_fence();
      wgmma_chain_ss<__nv_bfloat16, 128, 64, 64, 128>(sc, sQ, sK);
      if (GEMM == kSSRS) {
#pragma unroll
        for (int kt = 0; kt < 8; ++kt) wgmma_rs<__nv_bfloat16, 64>(o, pa[kt], gmma_desc<128 * 128, 1024>(sV, kt * 16 * 128));
      }
      wgmma_commit();
      wgmma_wait_all();
      fence_acc(sc);
      fence_acc(o);
#pragma unroll
      for (int i = 0; i < 8; ++i) pa[i][0] ^= __float_as_uint(sc[2 * i][0]) & 1u;  // (P depends on S, as in the kernel)
      ++n;
      if (n >= gemm_iters) break;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) r += o[i][0] + static_cast<float>(pa[i][0] & 1u);
#endif
  }
  const long long t1 = clock64();
  out[blockIdx.x * blockDim.x + threadIdx.x] = r;
  if ((threadIdx.x & 127) == 0) {
    cycles[blockIdx.x * 4 + 2 * wg] = t1 - t0;
    cycles[blockIdx.x * 4 + 2 * wg + 1] = n;
  }
}

template <int GEMM, int KSM = -1>
void run(const char* name, bool soft, int sms) {
  const int iters = 4000, gemm_iters = 4000;
  float* out;
  long long* cyc;
  cudaMalloc(&out, sms * 256 * sizeof(float));
  cudaMalloc(&cyc, sms * 4 * sizeof(long long));
  const size_t smem = 40960 + 1024;
  cudaFuncSetAttribute(probe<GEMM, KSM>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  probe<GEMM, KSM><<<sms, 256, smem>>>(out, cyc, 10, soft, 10);
  probe<GEMM, KSM><<<sms, 256, smem>>>(out, cyc, iters, soft, gemm_iters);
  cudaDeviceSynchronize();
  long long h[4 * 132];
  cudaMemcpy(h, cyc, sizeof(long long) * 4 * sms, cudaMemcpyDeviceToHost);
  double s = 0, g = 0;
  for (int b = 0; b < sms; ++b) {
    s += h[b * 4 + 1] > 0 ? static_cast<double>(h[b * 4]) / h[b * 4 + 1] : 0.0;
    g += h[b * 4 + 3] > 0 ? static_cast<double>(h[b * 4 + 2]) / h[b * 4 + 3] : 0.0;
  }
  printf("%-34s softmax %7.1f cycles each (warpgroup 0); products %7.1f cycles a pair (warpgroup 1)\n", name,
         s / sms, g / sms);
  cudaFree(out);
  cudaFree(cyc);
}

int main() {
  const int sms = probe_sms(", one block of 2 warpgroups an SM");
  run<kIdle>("softmax alone", true, sms);
  run<kSS>("S = Q K^T alone", false, sms);
  run<kSSRS>("S and P V alone", false, sms);
  run<kSS>("softmax + S = Q K^T", true, sms);
  run<kSSRS>("softmax + S and P V", true, sms);
  run<kIdle, 0>("softmax_block alone", true, sms);
  run<kSSRS, 0>("softmax_block + S and P V", true, sms);
  run<kIdle, 4>("softmax_block emu 4 alone", true, sms);
  run<kSSRS, 4>("softmax_block emu 4 + S and P V", true, sms);
  run<kIdle, 6>("softmax_block emu 6 alone", true, sms);
  run<kSSRS, 6>("softmax_block emu 6 + S and P V", true, sms);
  return probe_status();
}
