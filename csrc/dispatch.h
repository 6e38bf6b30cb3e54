// Host-side helpers shared by the ops: the dtype dispatch, and the test suite's output poisoning.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <cstdlib>
#include <cstring>
#include <limits>

namespace pykernels {

// Calls f with a value of the C++ element type (float, __half, __nv_bfloat16) matching ``st``, or raises naming
// ``what`` (the op and the argument).

template <typename F>
void dispatch_float_dtype(at::ScalarType st, const char* what, F&& f) {
  switch (st) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(__half{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, what, " must be float16, bfloat16 or float32, got ", st);
  }
}

// PYKERNELS_POISON=1 (the test suite sets it, as for the Python allocations in pykernels/_alloc.py): outputs the
// kernels must write in full are filled with NaN first, so a row a kernel leaves unwritten shows as NaN in tests.
// Read once.
inline bool poisoning() {
  static const bool on = [] {
    const char* e = std::getenv("PYKERNELS_POISON");
    return e != nullptr && e[0] != '\0' && std::strcmp(e, "0") != 0;
  }();
  return on;
}

inline at::Tensor poisoned(at::Tensor t) {
  if (poisoning() && t.defined() && t.numel() > 0 && at::isFloatingType(t.scalar_type()))
    t.fill_(std::numeric_limits<double>::quiet_NaN());
  return t;
}

}  // namespace pykernels
