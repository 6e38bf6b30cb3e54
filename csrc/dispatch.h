// Host-side dtype dispatch shared by the ops: calls f with a value of the C++ element type (float, __half,
// __nv_bfloat16) matching ``st``, or raises naming ``what`` (the op and the argument).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

namespace pykernels {

template <typename F>
void dispatch_float_dtype(at::ScalarType st, const char* what, F&& f) {
  switch (st) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(__half{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, what, " must be float16, bfloat16 or float32, got ", st);
  }
}

}  // namespace pykernels
