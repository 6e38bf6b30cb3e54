// Packed varlen attention: the rows of an output or gradient that no sequence holds, filled (attention.h's ZeroRows,
// zero_rows.cuh). forward_impl and backward_impl allocate o, lse, dq, dk and dv uninitialised and every sequence's
// rows are written by the kernels (the test suite poisons them with NaN first); the rows before cu_seqlens[0] and
// from cu_seqlens[B] on are filled by spare threads of kernels that run anyway, or here, by a launch of its own, on
// the forward's paths that run no order kernel. A fill of every row cost the packed BERT batch 6-7 us a tensor
// (run308: 27 us of fills in a forward + backward of 425 us); this launch, 3.2 us with nothing to fill (run311).
#include <c10/cuda/CUDAException.h>

#include <cstdint>

#include "attention.h"
#include "zero_rows.cuh"

namespace pykernels {
namespace attn {
namespace {

// zero_rows.cuh's fill by a launch of its own (the forward's paths that run no order kernel)
__global__ void __launch_bounds__(256) zero_rows_outside_kernel(ZeroRows z) {
  fill_rows_outside(z, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                    static_cast<int64_t>(gridDim.x) * blockDim.x);
}

}  // namespace

void zero_rows_outside(const ZeroRows& z, cudaStream_t stream) {
  if (z.n == 0) return;
  zero_rows_outside_kernel<<<132, 256, 0, stream>>>(z);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace attn
}  // namespace pykernels
