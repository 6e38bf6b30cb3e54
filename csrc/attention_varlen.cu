// Packed varlen attention: the rows of an output or gradient that no sequence holds, zeroed
// (attention.h's zero_rows_outside). forward_impl and backward_impl allocate o, dq, dk and dv uninitialised and
// every sequence's rows are written by the kernels (the test suite poisons them with NaN first); the rows before
// cu_seqlens[0] and from cu_seqlens[B] on are zeroed here, by one launch after the kernels. A fill of every row
// cost the packed BERT batch 6-7 us a tensor (run308: 27 us of fills in a forward + backward of 425 us).
#include <c10/cuda/CUDAException.h>

#include <cstdint>

#include "attention.h"

namespace pykernels {
namespace attn {
namespace {

// Each target's rows outside [cu[0], cu[batch]) (clamped to [0, rows]), in 16-byte units where a row's bytes allow
// them, else 2-byte ones; a grid-stride loop over the targets' outside units only (none: every block returns at once)
__global__ void __launch_bounds__(256) zero_rows_outside_kernel(ZeroRows z) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int j = 0; j < z.n; ++j) {
    const ZeroRows::Target& t = z.t[j];
    const int64_t lo = min(max(static_cast<int64_t>(t.cu[0]), int64_t{0}), t.rows);
    const int64_t hi = max(min(static_cast<int64_t>(t.cu[z.batch]), t.rows), lo);
    const bool wide = t.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(t.ptr) % 16 == 0;
    const int64_t unit = wide ? 16 : 2, per_row = t.row_bytes / unit;
    const int64_t n0 = lo * per_row, n = n0 + (t.rows - hi) * per_row;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
      const int64_t u = i < n0 ? i : hi * per_row + (i - n0);
      if (wide)
        reinterpret_cast<uint4*>(t.ptr)[u] = make_uint4(0u, 0u, 0u, 0u);
      else
        reinterpret_cast<uint16_t*>(t.ptr)[u] = 0;
    }
  }
}

}  // namespace

void zero_rows_outside(const ZeroRows& z, cudaStream_t stream) {
  if (z.n == 0) return;
  zero_rows_outside_kernel<<<264, 256, 0, stream>>>(z);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace attn
}  // namespace pykernels
