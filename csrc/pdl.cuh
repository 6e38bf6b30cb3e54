// Programmatic dependent launch (Hopper and later): a kernel launched with programmatic stream serialization may be
// scheduled before the kernel ahead of it on the stream has finished, once every block of that kernel has run
// griddepcontrol.launch_dependents (or ended). It then sees nothing of that kernel's work until its griddepcontrol.wait
// returns, which waits for the kernels ahead to complete and their memory to be visible.
//
// The rule here: every kernel launched through launch_pdl calls pdl_enter() first, before any global memory access
// (inputs may be written by the kernel ahead, outputs may still be read by it), so the results are those of a plain
// launch; what the launch saves is the time between the kernel ahead's last block and this kernel's first: its blocks
// are already resident, waiting, when the kernel ahead ends. pdl_enter() also releases the kernel after this one at
// once: its blocks take the slots this kernel's last wave leaves free and wait there in turn.
//
// PYKERNELS_PDL=0 launches plainly (A/B runs; read at every launch). Devices below compute capability 9.0 launch
// plainly, and so does code compiled for an architecture below 9.0 (pdl_on), where the instructions are compiled out.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

namespace pykernels {

__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether ``kernel`` launches programmatically on ``device`` (asked once a kernel and device): compute capability 9.0
// or above, and the code the device runs for it compiled for a virtual architecture of 9.0 or above (its PTX version,
// cudaFuncGetAttributes), so that pdl_enter's wait is in it: a build for an older architecture list that the driver
// JIT-compiles for a Hopper device has pdl_enter compiled out, and launched programmatically it would race with the
// kernel ahead. And PYKERNELS_PDL is not '0'.
inline bool pdl_on(const void* kernel, int device) {
  const char* e = std::getenv("PYKERNELS_PDL");
  if (e != nullptr && e[0] == '0') return false;
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, bool> known;
  const std::lock_guard<std::mutex> lock(mu);
  const auto it = known.find({kernel, device});
  if (it != known.end()) return it->second;
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  cudaFuncAttributes attr = {};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const bool on = major >= 9 && attr.ptxVersion >= 90;
  known[{kernel, device}] = on;
  return on;
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization where ``want`` and pdl_on;
// ``kernel`` must call pdl_enter() before touching global memory
template <typename... KArgs, typename... Args>
inline void launch_maybe_pdl(bool want, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t stream, Args&&... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  int device = 0;
  if (want) C10_CUDA_CHECK(cudaGetDevice(&device));
  if (!want || !pdl_on(reinterpret_cast<const void*>(kernel), device)) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

template <typename... KArgs, typename... Args>
inline void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  launch_maybe_pdl(true, kernel, grid, block, smem, stream, std::forward<Args>(args)...);
}

}  // namespace pykernels
