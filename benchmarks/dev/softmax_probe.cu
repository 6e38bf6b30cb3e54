// What one consumer warp's online softmax costs on this card, apart from the attention kernel: SM cycles (clock64) an
// iteration of a loop that does what softmax_block does to the 64 scores a thread holds (two rows of 32) at BERT's
// key blocks of 128, with 1, 2, 3 or 4 warps on each scheduler (one block an SM of 4 W warps). Modes:
//   mufu:    64 independent exp2 (MUFU.EX2) a thread, and the FFMA that feeds each: the MUFU pipe's rate
//   max:     the two rows' max as two serial chains of 32 FMNMX, then the quad's two shuffles: the chain's latency
//   softmax: max, shuffles, 64 FFMA + exp2 + two FADD sum chains, and the bf16 packs of P (attention.cuh's order)
// Build and run (device): nvcc -O3 --use_fast_math -arch=sm_90a -o /tmp/softmax_probe benchmarks/dev/softmax_probe.cu && /tmp/softmax_probe
#include <cstdio>

#include "softmax_probe.cuh"

enum Mode { kMufu = 0, kMax = 1, kSoftmax = 2 };

template <int MODE>
__global__ void __launch_bounds__(512, 1) probe(float* out, long long* cycles, int iters) {
  float x[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) x[i] = 0.001f * ((threadIdx.x * 7 + i * 13) % 97) - 0.05f;
  float m0 = -1.f, m1 = -1.f, l0 = 0.f, l1 = 0.f;
  unsigned acc = 0u;
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    if (MODE == kMufu) {
#pragma unroll
      for (int i = 0; i < 64; ++i) x[i] = exp2f(fmaf(x[i], 0.5f, -0.25f));
    } else if (MODE == kMax) {
      float a, b;
      probe_row_max(x, a, b);
      m0 += a;
      m1 += b;
#pragma unroll
      for (int i = 0; i < 64; ++i) x[i] += 1e-7f;  // (a new max next time)
    } else {
      probe_softmax_step(x, m0, m1, l0, l1, acc);
    }
  }
  const long long t1 = clock64();
  float r = m0 + m1 + l0 + l1 + static_cast<float>(acc & 1u);
#pragma unroll
  for (int i = 0; i < 64; ++i) r += x[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = r;
  if ((threadIdx.x & 31) == 0) cycles[blockIdx.x * 16 + (threadIdx.x >> 5)] = t1 - t0;
}

template <int MODE>
void run(const char* name, int warps_per_sched, int sms) {
  const int threads = 128 * warps_per_sched, iters = 2000;
  float* out;
  long long* cyc;
  cudaMalloc(&out, sms * 512 * sizeof(float));
  cudaMalloc(&cyc, sms * 16 * sizeof(long long));
  probe<MODE><<<sms, threads>>>(out, cyc, 10);
  probe<MODE><<<sms, threads>>>(out, cyc, iters);
  cudaDeviceSynchronize();
  long long h[16 * 132];
  cudaMemcpy(h, cyc, sizeof(long long) * 16 * sms, cudaMemcpyDeviceToHost);
  double mean = 0;
  for (int b = 0; b < sms; ++b)
    for (int w = 0; w < threads / 32; ++w) mean += h[b * 16 + w];
  mean /= sms * (threads / 32) * static_cast<double>(iters);
  // exp2 a warp an iteration: 64 (mufu, softmax); a scheduler's MUFU warp-instructions a cycle
  const double mufu_rate = MODE == kMax ? 0.0 : 64.0 * warps_per_sched / mean;
  printf("%-8s warps/scheduler %d: %7.1f cycles an iteration a warp; %.4f MUFU.EX2 a cycle a scheduler (%.1f cycles "
         "each)\n",
         name, warps_per_sched, mean, mufu_rate, mufu_rate > 0 ? 1.0 / mufu_rate : 0.0);
  cudaFree(out);
  cudaFree(cyc);
}

int main() {
  const int sms = probe_sms("");
  for (int w = 1; w <= 4; ++w) run<kMufu>("mufu", w, sms);
  for (int w = 1; w <= 4; ++w) run<kMax>("max", w, sms);
  for (int w = 1; w <= 4; ++w) run<kSoftmax>("softmax", w, sms);
  return probe_status();
}
