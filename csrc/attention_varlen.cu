// Packed varlen attention: the rows of an output or gradient that no sequence holds, filled (attention.h's ZeroRows,
// zero_rows.cuh). forward_impl and backward_impl allocate o, lse, dq, dk and dv uninitialised and every sequence's
// rows are written by the kernels (the test suite poisons them with NaN first); the rows before cu_seqlens[0] and
// from cu_seqlens[B] on are filled by spare threads of kernels that run anyway, or here, by a launch of its own, on
// the forward's paths that run no order kernel. A fill of every row cost the packed BERT batch 6-7 us a tensor
// (run308: 27 us of fills in a forward + backward of 425 us); this launch, 3.2 us with nothing to fill (run311).
// Also the key-padding mask's ranges (launch_kv_range), which the dense forward's split takes.
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

// A boolean key-padding mask's valid key range a batch (Params::kv_range; block b: batch b): the first valid key lo,
// one past the last hi (Sk and 0 where none), and whether every key in [lo, hi) is valid (and there is one), as
// pykernels.attention._key_padding_range computes them; with dropout that flag only where lo is 0 (attention.cuh's
// key_run)
__global__ void __launch_bounds__(256) attn_kv_range_kernel(const Params p, int* out) {
  const bool* m = static_cast<const bool*>(p.mask) + static_cast<int64_t>(blockIdx.x) * p.m_sb;
  int lo = p.sk, hi = 0, n = 0;
  for (int j = threadIdx.x; j < p.sk; j += blockDim.x) {
    if (m[j * p.m_sk]) {
      lo = min(lo, j);
      hi = max(hi, j + 1);
      ++n;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    n += __shfl_xor_sync(0xffffffffu, n, o);
  }
  __shared__ int red[3][8];
  const int w = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    red[0][w] = lo;
    red[1][w] = hi;
    red[2][w] = n;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < static_cast<int>(blockDim.x >> 5); ++i) {
      lo = min(lo, red[0][i]);
      hi = max(hi, red[1][i]);
      n += red[2][i];
    }
    out[3 * blockIdx.x] = lo;
    out[3 * blockIdx.x + 1] = hi;
    out[3 * blockIdx.x + 2] = n > 0 && n == hi - lo && (p.p_drop == 0.f || lo == 0) ? 1 : 0;
  }
}

}  // namespace

void launch_kv_range(const Params& p, int* out, cudaStream_t stream) {
  if (p.batch == 0) return;
  attn_kv_range_kernel<<<p.batch, 256, 0, stream>>>(p, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void zero_rows_outside(const ZeroRows& z, cudaStream_t stream) {
  if (z.n == 0) return;
  zero_rows_outside_kernel<<<132, 256, 0, stream>>>(z);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace attn
}  // namespace pykernels
