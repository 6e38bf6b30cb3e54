// attention.cuh's backward kernels for __nv_bfloat16: one translation unit a direction and dtype (built in parallel)
#include "attention.cuh"

namespace pykernels {
namespace attn {
template void launch_backward<__nv_bfloat16>(const Params&, cudaStream_t);
bool fused_dq_planned(const Params& p) { return fused_dq_plan(p); }
}  // namespace attn
}  // namespace pykernels
