// 16-byte packs of fp32 / fp16 / bf16 elements and the conversions the kernels share (layer_norm.cu,
// cross_entropy.cu): every global load and store of a row's body is one uint4.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace pykernels {

template <typename T>
struct Pack {
  static constexpr int n = 16 / sizeof(T);  // elements a pack
};

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// the pack's elements as fp32
template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float* out) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Pack<T>::n; ++i) out[i] = to_f(e[i]);
}

template <typename T>
__device__ __forceinline__ uint4 pack_of_floats(const float* in) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < Pack<T>::n; ++i) e[i] = from_f<T>(in[i]);
  return raw;
}

template <typename T>
__device__ __forceinline__ void load_pack(const T* p, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Pack<T>::n; ++i) out[i] = to_f(e[i]);
}

template <typename T>
__device__ __forceinline__ void store_pack(T* p, const float* in) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < Pack<T>::n; ++i) e[i] = from_f<T>(in[i]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// n elements of type T (n * sizeof(T) a multiple of 16 bytes, p 16-byte aligned) as fp32, one uint4 load per 16
// bytes: a pack of another element type's width (the LayerNorm's fp32 weight beside a bf16 row's 8-element pack)
template <typename T, int n>
__device__ __forceinline__ void load_packs(const T* p, float* out) {
  static_assert(n % Pack<T>::n == 0, "whole 16-byte packs");
#pragma unroll
  for (int k = 0; k < n / Pack<T>::n; ++k) load_pack(p + k * Pack<T>::n, out + k * Pack<T>::n);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace pykernels
