// The softmax step that softmax_probe.cu and softmax_wgmma_probe.cu time: softmax_block's work (attention.cuh) on a
// thread's 64 scores of two rows of 32.
#pragma once

#include <cuda_bf16.h>

#include <cstdio>
#include <cstring>

// each row's max as one serial chain of 32 FMNMX, then over the quad (two shuffles)
__device__ __forceinline__ void probe_row_max(const float (&x)[64], float& a, float& b) {
  a = x[0];
  b = x[32];
#pragma unroll
  for (int i = 1; i < 32; ++i) {
    a = fmaxf(a, x[i]);
    b = fmaxf(b, x[32 + i]);
  }
  a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
  b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, 1));
  a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
  b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, 2));
}

// the max (scaled into m0, m1), then 64 FFMA + exp2 (x becomes P) with the two rows' sums added to l0, l1, then P's
// bf16 pairs (the P V product's A operand), kept live through an xor into acc (the next step reads x itself)
__device__ __forceinline__ void probe_softmax_step(float (&x)[64], float& m0, float& m1, float& l0, float& l1,
                                                   unsigned& acc) {
  float a, b;
  probe_row_max(x, a, b);
  m0 = a * 0.125f;
  m1 = b * 0.125f;
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    x[i] = exp2f(fmaf(x[i], 0.125f, -m0));
    s0 += x[i];
    x[32 + i] = exp2f(fmaf(x[32 + i], 0.125f, -m1));
    s1 += x[32 + i];
  }
  l0 += s0;
  l1 += s1;
#pragma unroll
  for (int i = 0; i < 64; i += 2) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(x[i], x[i + 1]);
    unsigned u;
    memcpy(&u, &p, 4);
    acc ^= u;
  }
}

// the device's SMs (at most 132, the probes' result arrays), printed with its name and ``what``
inline int probe_sms(const char* what) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  printf("%s, %d SMs%s\n", prop.name, sms, what);
  return sms > 132 ? 132 : sms;
}

// the launches' outcome, as the exit status (the error printed)
inline int probe_status() {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) printf("CUDA error: %s\n", cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
