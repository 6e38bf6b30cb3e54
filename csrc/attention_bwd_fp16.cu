// attention.cuh's backward kernels for __half: one translation unit a direction and dtype (built in parallel)
#include "attention.cuh"

namespace pykernels {
namespace attn {
template void launch_backward<__half>(const Params&, cudaStream_t);
}  // namespace attn
}  // namespace pykernels
