// attention.cuh's forward kernels for __nv_bfloat16: one translation unit a direction and dtype (built in parallel)
#include "attention.cuh"

namespace pykernels {
namespace attn {
template void launch_forward<__nv_bfloat16>(const Params&, cudaStream_t, const ZeroRows*);
bool fwd_key_ranges_planned(const Params& p) { return fwd_key_ranges(p); }
#ifdef PYKERNELS_FWD_TRACE
// the bf16 forward's timeline (attention.cuh, FwdTrace): copied to ``host`` (kTraceCtas x kTraceWarps x kTraceN
// values), then zeroed where ``reset``; returns the number of values
int64_t fwd_trace_read(unsigned long long* host, bool reset) {
  constexpr int64_t n = static_cast<int64_t>(kTraceCtas) * kTraceWarps * kTraceN;
  if (host != nullptr) C10_CUDA_CHECK(cudaMemcpyFromSymbol(host, g_fwd_trace, n * sizeof(unsigned long long)));
  if (reset) {
    void* dev = nullptr;
    C10_CUDA_CHECK(cudaGetSymbolAddress(&dev, g_fwd_trace));
    C10_CUDA_CHECK(cudaMemset(dev, 0, n * sizeof(unsigned long long)));
  }
  return n;
}
#endif
}  // namespace attn
}  // namespace pykernels
