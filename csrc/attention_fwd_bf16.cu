// attention.cuh's forward kernels for __nv_bfloat16: one translation unit a direction and dtype (built in parallel)
#include "attention.cuh"

namespace pykernels {
namespace attn {
template void launch_forward<__nv_bfloat16>(const Params&, cudaStream_t, const ZeroRows*);
}  // namespace attn
}  // namespace pykernels
