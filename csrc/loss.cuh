// What the loss ops (cross_entropy.cu, masked_lm_loss.cu) share: the online logsumexp's steps in the log2
// domain, and their last step: the (N,) fp32 row losses summed in fp64 in a
// fixed order by one block (deterministic: no atomics), the valid targets counted, and the sum divided by the
// count (clamped to at least 1: an all-ignored call gives 0, never NaN), by a host int or by a device tensor
// (``num_valid``; clamped too where ``clamp_given``: cross_entropy's semantics, not masked_lm_loss's).
#pragma once

#include <cmath>
#include <cstdint>

#include "pack.cuh"

namespace pykernels {
namespace {

constexpr int kReduceThreads = 1024;

// reduction codes shared with pykernels/cross_entropy.py and masked_lm_loss.py (_REDUCTION_CODES)
constexpr int64_t kNone = 0, kSum = 1, kMean = 2;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// (m, s) of an online logsumexp in the log2 domain folded with one more value x2 (already times log2 e)
__device__ __forceinline__ void fold(float x2, float& m, float& s) {
  if (x2 > m) {
    s *= exp2f(m - x2);  // m = -inf: 0 * 0
    m = x2;
  }
  if (m != -INFINITY) s += exp2f(x2 - m);
}

// (m, s) <- (m, s) + (m2, s2)
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) {
    s = 0.f;
  } else {
    s = s * exp2f(m - mx) + s2 * exp2f(m2 - mx);
  }
  m = mx;
}

// The block's (m, s) and, with SMOOTH, sum sx: shuffles within each warp, then thread 0 over the warps' results
// (the totals are thread 0's only)
template <int THREADS, bool SMOOTH>
__device__ __forceinline__ void block_lse(float& m, float& s, float& sx) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
    combine(m, s, m2, s2);
    if (SMOOTH) sx += __shfl_xor_sync(0xffffffffu, sx, o);
  }
  constexpr int kWarps = THREADS / 32;
  __shared__ float red_m[kWarps], red_s[kWarps], red_x[kWarps];
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    red_m[warp] = m;
    red_s[warp] = s;
    red_x[warp] = sx;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    m = red_m[0];
    s = red_s[0];
    sx = red_x[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      combine(m, s, red_m[w], red_s[w]);
      sx += red_x[w];
    }
  }
}

template <typename TT>
__device__ __forceinline__ int64_t target_at(const TT* target, int64_t row) {
  return static_cast<int64_t>(target[row]);
}

// out = sum (or mean) of the N row losses, in a fixed order; scale = d(out) / d(row loss)
template <typename T, typename TT>
__global__ void __launch_bounds__(kReduceThreads) loss_reduce_kernel(
    const float* __restrict__ loss_rows, const TT* __restrict__ target, int64_t N, int64_t ignore_index,
    int64_t reduction, double denom_host, const float* __restrict__ denom_dev, bool clamp_given, T* __restrict__ out,
    float* __restrict__ scale) {
  // fp64 accumulation: the sum's rounding is then the final cast's alone (an fp32 sum of 10^4 row losses
  // of ~10 can be off by more than twice torch's cascade sum)
  double total = 0.0;
  int64_t count = 0;
  for (int64_t i = threadIdx.x; i < N; i += kReduceThreads) {
    total += static_cast<double>(loss_rows[i]);
    count += target_at(target, i) != ignore_index;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    total += __shfl_xor_sync(0xffffffffu, total, o);
    count += __shfl_xor_sync(0xffffffffu, count, o);
  }
  __shared__ double red_t[kReduceThreads / 32];
  __shared__ long long red_c[kReduceThreads / 32];
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    red_t[warp] = total;
    red_c[warp] = count;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  total = 0.0;
  count = 0;
  for (int w = 0; w < kReduceThreads / 32; ++w) {
    total += red_t[w];
    count += red_c[w];
  }
  double denom = 1.0;
  if (reduction == kMean) {
    const bool given = denom_dev != nullptr || denom_host >= 0.0;
    denom = denom_dev != nullptr ? static_cast<double>(*denom_dev)
                                 : (denom_host >= 0.0 ? denom_host : static_cast<double>(count));
    if (!given || clamp_given) denom = fmax(denom, 1.0);  // the count: an all-ignored call gives 0, never NaN
  }
  *out = from_f<T>(static_cast<float>(reduction == kMean ? total / denom : total));
  *scale = static_cast<float>(1.0 / denom);
}

}  // namespace
}  // namespace pykernels
